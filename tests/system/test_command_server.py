"""The compiled Slurm commands and the command server (slurm/commands.c, slurm/cmdserver.py),
end to end: real compiled commands, a real server process, a real local cluster.

The oracle: a call made through the server prints and returns exactly what the same call to
the Python command prints and returns.  Both run the same code; what this checks is the way
there (arguments, environment, directory, descriptors, exit status, signals, identity), and
that the server did serve (its log counts the calls it ran).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from phalanx import native
from phalanx.slurm import install
from system.harness import Cluster, base_env, wait_for
from system.unixusers import temporary_users

pytestmark = pytest.mark.system

Result = tuple[int, str, str]  # exit status, stdout, stderr


@pytest.fixture(scope="module")
def public() -> Iterator[Path]:
    """A directory every user can reach (pytest's own are mode 700): the compiled commands
    and the server's socket live here."""
    d = Path(tempfile.mkdtemp(prefix="phx-cs-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def bindir(public: Path) -> Path:
    try:
        done = install.install(public / "bin", cache=public / "native")
    except native.BuildError as e:
        pytest.skip(f"no compiled commands on this host: {e}")
    assert sorted(done.linked) == sorted(install.SERVED) and not done.kept
    return public / "bin"


class Server:
    """A command server process on `sock`, logging each call it ran."""

    def __init__(
        self, sock: Path, log: Path, *, no_pidfd: bool = False, args: Sequence[str] = ()
    ) -> None:
        self.sock, self.log = sock, log
        self.extra = list(args)
        self.no_pidfd = no_pidfd  # as on a kernel before 5.3: workers watched by polling
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        args = ["--socket", str(self.sock), "--log-level", "debug", *self.extra]
        if self.no_pidfd:
            code = (
                "import os, sys\n"
                "def no_pidfd(pid, flags=0): raise OSError(38, 'Function not implemented')\n"
                "os.pidfd_open = no_pidfd\n"
                "from phalanx.slurm.cmdserver import main\n"
                "sys.exit(main(sys.argv[1:]))\n"
            )
            argv = [sys.executable, "-c", code, *args]
        else:
            argv = [sys.executable, "-m", "phalanx.slurm.cmdserver", *args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self._listening, what=f"the command server on {self.sock}")
        return self

    def _listening(self) -> bool:
        # its log says so once it listens (a probe connection would count as a call)
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
        return "serving the Slurm commands on" in self.log.read_text()

    def calls(self) -> int:
        """Calls its workers ran to the end."""
        return self.log.read_text().count("ended:")

    def workers(self) -> list[int]:
        """The worker of each call that ended, in order."""
        return [int(p) for p in re.findall(r"call in worker (\d+) ended:", self.log.read_text())]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def server(public: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    n = len(list(public.glob("*.sock"))) + len(list(public.glob("*.log")))
    s = Server(public / f"s{n}.sock", public / f"s{n}.log").start()
    try:
        yield s
    finally:
        s.stop()


def env_for(cluster: Cluster, **extra: str) -> dict[str, str]:
    return base_env(
        cluster.root,
        PHALANX_URL=cluster.url,
        PHALANX_TOKEN_FILE=str(cluster.root / "admin.token"),
        COLUMNS="200",
        **extra,
    )


def call(argv: list[str], env: dict[str, str], cwd: Path, stdin: str | None) -> Result:
    p = subprocess.run(
        argv,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )
    return p.returncode, p.stdout, p.stderr


def fast(
    bindir: Path,
    server: Server,
    env: dict[str, str],
    cwd: Path,
    *argv: str,
    stdin: str | None = None,
) -> Result:
    return call(
        [str(bindir / argv[0]), *argv[1:]],
        {**env, "PHALANX_COMMAND_SOCKET": str(server.sock)},
        cwd,
        stdin,
    )


def python(env: dict[str, str], cwd: Path, *argv: str, stdin: str | None = None) -> Result:
    return call(
        [sys.executable, "-m", "phalanx.slurm", *argv],
        {**env, "PHALANX_COMMAND_SOCKET": "off"},
        cwd,
        stdin,
    )


def signalled_wait(
    cluster: Cluster,
    argv: list[str],
    server: Server,
    env: dict[str, str],
    cwd: Path,
    signum: int,
) -> tuple[Result, int]:
    """`ARGV --wait --wrap='sleep 300'` through `server`, sent `signum` once its job runs:
    how the command ended, and the job's id (left for the caller to cancel)."""
    p = subprocess.Popen(
        [*argv, "--wait", "--wrap=sleep 300"],
        env={**env, "PHALANX_COMMAND_SOCKET": str(server.sock)},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        jid = int(re.fullmatch(r"Submitted batch job (\d+)\n", line).group(1))  # type: ignore[union-attr]
        cluster.wait_state(jid, "RUNNING")
        p.send_signal(signum)
        out, err = p.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
    return (p.returncode, out, err), jid


def ids_out(r: Result) -> Result:
    """A submission's result with its job ids made alike (two submissions, two ids)."""
    return r[0], re.sub(r"\d+", "N", r[1]), re.sub(r"\d+", "N", r[2])


@pytest.mark.timeout(600)
def test_every_call_through_the_server_is_the_python_commands_call(
    cluster: Cluster, bindir: Path, server: Server, tmp_path: Path
) -> None:
    cluster.start(nodes=2, cpus=2)
    env = env_for(cluster)
    (tmp_path / "job.sh").write_text("#!/bin/bash\n#SBATCH -J from-file\ntrue\n")
    sub = tmp_path / "sub"
    sub.mkdir()

    # submissions: each path makes its own job; what they print and the jobs they make match
    submissions: list[tuple[list[str], str | None, dict[str, str]]] = [
        (["sbatch", "--hold", "job.sh"], None, {}),
        (["sbatch", "--hold", "--parsable", "-J", "a b", "--wrap=echo =x"], None, {}),
        (["sbatch", "--hold", "-o", "o-%j.out"], "#!/bin/sh\necho from stdin\n", {}),
        # Slurm's input variables reach the command from the caller's environment
        (["sbatch", "--hold", "--parsable", "--wrap=true"], None, {"SBATCH_JOB_NAME": "by-env"}),
        (["sbatch", "--hold", "--array=1-3%2", "job.sh"], None, {}),
        (["sbatch", "job-that-is-not-there.sh"], None, {}),
        (["sbatch", "--no-such-option", "job.sh"], None, {}),
        (["sbatch"], "", {}),  # an empty script on stdin
        (["sbatch", "--hold", "--time=nonsense", "job.sh"], None, {}),
    ]
    made: list[tuple[int, int]] = []
    for argv, stdin, extra in submissions:
        a = fast(bindir, server, {**env, **extra}, tmp_path, *argv, stdin=stdin)
        b = python({**env, **extra}, tmp_path, *argv, stdin=stdin)
        assert ids_out(a) == ids_out(b), (argv, a, b)
        assert "Traceback" not in a[2], (argv, a)
        if a[0] == 0:
            made.append((int(re.findall(r"\d+", a[1])[0]), int(re.findall(r"\d+", b[1])[0])))
    assert len(made) == 5
    # the same job from either path: name, directory, state (the job ids differ)
    c = cluster.client()
    for fa, fb in made:
        ja, jb = c.job(fa)[0], c.job(fb)[0]
        for key in ("name", "state", "workdir", "submit_dir", "stdout", "partition", "time_limit"):
            va, vb = (
                re.sub(rf"(?<!\d){jid}(?!\d)", "N", str(job.get(key)).replace(str(tmp_path), "T"))
                for jid, job in ((fa, ja), (fb, jb))
            )
            assert va == vb, (key, ja, jb)
    # the directory is the caller's: a relative script from a subdirectory
    a = fast(bindir, server, env, sub, "sbatch", "--hold", "--parsable", "../job.sh")
    assert a[0] == 0, a
    assert c.job(int(a[1]))[0]["workdir"] == str(sub)

    held = str(made[0][0])
    queries = [
        ["squeue"],
        ["squeue", "-h", "-o", "%i %j %T %r %u"],
        ["squeue", "-O", "JobID,Name,State,Reason", "--noheader"],
        ["squeue", "-j", held, "--states=all"],
        ["squeue", "--state=nonsense"],
        ["squeue", "--no-such-option"],
        ["sacct", "-j", held, "--parsable2", "-o", "JobID,JobName,State"],
        ["sacct", "-X", "--noheader", "-o", "JobID,State"],
        ["sacct", "--format=bogusfield"],
        ["scontrol", "show", "job", held],
        ["scontrol", "show", "partition"],
        ["scontrol", "show", "job", "99999999"],
        ["scontrol", "frobnicate"],
        ["sinfo"],
        ["sinfo", "-N", "-h", "-o", "%N %T %c"],
        ["sshare"],
        ["sprio"],
        ["scancel", "99999999"],
        ["squeue", "--help"],
        ["sbatch", "--version"],
    ]
    for argv in queries:
        a = fast(bindir, server, env, tmp_path, *argv)
        b = python(env, tmp_path, *argv)
        assert a == b, (argv, a, b)
        assert "Traceback" not in a[2], (argv, a)
    # and every one of those calls ran in the server, none fell back to the interpreter
    ran = len(submissions) + 1 + len(queries)
    wait_for(lambda: server.calls() >= ran, what=f"{ran} calls in the server's log")
    assert server.calls() == ran

    # scancel through it acts: the held jobs go
    a = fast(bindir, server, env, tmp_path, "scancel", held)
    assert a == (0, "", ""), a
    assert cluster.wait_terminal([int(held)])[int(held)]["state"] == "CANCELLED"


@pytest.mark.timeout(300)
def test_without_a_server_the_commands_run_as_python(
    cluster: Cluster, bindir: Path, public: Path, tmp_path: Path
) -> None:
    cluster.start(nodes=1, cpus=2)
    env = env_for(cluster)
    expected = python(env, tmp_path, "squeue", "-h", "-o", "%i")
    gone = public / "nobody-serves-this.sock"
    for where in (str(gone), "off", ""):
        r = call(
            [str(bindir / "squeue"), "-h", "-o", "%i"],
            {**env, "PHALANX_COMMAND_SOCKET": where},
            tmp_path,
            None,
        )
        assert r == expected, (where, r)
    # the well-known path is the default; absent or not, the call is answered
    r = call([str(bindir / "sinfo"), "-h"], {**env}, tmp_path, None)
    assert r[0] == 0 and "idle" in r[1], r


@pytest.mark.timeout(300)
def test_a_signal_to_the_command_reaches_the_call_it_runs(
    cluster: Cluster, bindir: Path, server: Server, tmp_path: Path
) -> None:
    """^C on `sbatch --wait` stops the wait in the server's worker, and the command ends as
    the Python one does (the same signal, the same words)."""
    cluster.start(nodes=1, cpus=2)
    env = env_for(cluster)
    c = cluster.client()
    ended: list[Result] = []
    for argv in (
        [str(bindir / "sbatch")],
        [sys.executable, "-m", "phalanx.slurm", "sbatch"],
    ):
        (code, out, err), jid = signalled_wait(cluster, argv, server, env, tmp_path, signal.SIGINT)
        ended.append((code, out, err.splitlines()[-1] if err else ""))
        c.cancel([jid])
    assert ended[0] == ended[1] == (-signal.SIGINT, "", "KeyboardInterrupt"), ended
    # the worker is gone with it: the server saw its call end
    wait_for(lambda: server.calls() >= 1, what="the interrupted call's end")


@pytest.mark.timeout(300)
def test_each_call_runs_as_its_caller(
    cluster: Cluster, bindir: Path, server: Server, public: Path
) -> None:
    """The server runs as root; each worker becomes the uid and groups the kernel names for
    the caller, so a user reads through it what that user may read and nothing more."""
    if os.geteuid() != 0:
        pytest.skip("the server serves other users only as root")
    cluster.start(nodes=1, cpus=2)
    with temporary_users(["phxcs1"]) as (user,):
        work = public / "work-phxcs1"
        work.mkdir()
        os.chown(work, user.pw_uid, user.pw_gid)
        own = work / "own.sh"
        own.write_text("#!/bin/sh\ntrue\n")
        os.chown(own, user.pw_uid, user.pw_gid)
        own.chmod(0o600)  # the user's alone
        group = work / "group.sh"
        group.write_text("#!/bin/sh\ntrue\n")
        os.chown(group, 0, user.pw_gid)
        group.chmod(0o640)  # root's, readable by the user's group
        secret = public / "root-only.sh"
        secret.write_text("#!/bin/sh\ntrue\n")
        secret.chmod(0o600)
        env = base_env(
            cluster.root,
            PHALANX_URL=cluster.url,
            PHALANX_TOKEN=cluster.token(user.pw_name),
            PHALANX_COMMAND_SOCKET=str(server.sock),
            HOME=user.pw_dir,
        )

        def as_user(*argv: str) -> Result:
            return call(
                ["runuser", "-u", user.pw_name, "--", str(bindir / argv[0]), *argv[1:]],
                env,
                work,
                None,
            )

        before = server.calls()
        for script in (own, group):
            r = as_user("sbatch", "--hold", "--parsable", str(script))
            assert r[0] == 0 and r[1].strip().isdigit(), (script, r)
        r = as_user("sbatch", "--hold", str(secret))
        assert r[0] != 0 and "Permission denied" in r[2], r
        # and the interpreter never ran as the user: the user cannot reach it (/root is 700)
        wait_for(lambda: server.calls() >= before + 3, what="three calls in the server")
        r = as_user("squeue", "-h", "-o", "%u %j")
        assert r[0] == 0 and r[1].split("\n")[:2] == ["phxcs1 own.sh", "phxcs1 group.sh"], r


@pytest.mark.timeout(120)
def test_a_hostile_caller_gets_nothing_and_the_server_goes_on(
    cluster: Cluster, bindir: Path, server: Server, tmp_path: Path
) -> None:
    """Garbage, a half request, a request without descriptors: each is dropped by its worker;
    the next caller is served as before."""
    cluster.start(nodes=1, cpus=2)
    for raw in (b"hello\n", b"cmd1 999999999\n", b"cmd1 10\nabc", b"cmd1 5\n\0\0\0\0\0"):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(server.sock))
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        assert answer == b"exit 1\n", (raw, answer)  # dropped, nothing ran
    env = env_for(cluster)
    a = fast(bindir, server, env, tmp_path, "sinfo", "-h", "-o", "%T")
    assert a == python(env, tmp_path, "sinfo", "-h", "-o", "%T") and a[0] == 0, a


@pytest.mark.timeout(120)
def test_without_pidfd_the_server_watches_its_workers_by_polling(
    cluster: Cluster, bindir: Path, public: Path, tmp_path: Path
) -> None:
    """A kernel before Linux 5.3 (RHEL 8) has no pidfd_open: calls are served all the same."""
    cluster.start(nodes=1, cpus=2)
    server = Server(public / "nopidfd.sock", public / "nopidfd.log", no_pidfd=True).start()
    try:
        env = env_for(cluster)
        for argv in (["sinfo", "-h", "-o", "%D %T"], ["squeue", "--no-such-option"]):
            a = fast(bindir, server, env, tmp_path, *argv)
            assert a == python(env, tmp_path, *argv), (argv, a)
        wait_for(lambda: server.calls() >= 2, what="both calls in the server's log")
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_a_caller_s_next_calls_reuse_its_worker_and_nothing_of_a_call_stays_behind(
    cluster: Cluster, bindir: Path, public: Path, tmp_path: Path
) -> None:
    """A worker waits for its caller's next call (no fork, no first-call faults): five calls
    in a row run in one worker, each with its own environment (COLUMNS changes the output)
    and the same output as the Python command's, and an idle worker holds no caller's pipe
    (`subprocess.run` returns: the output pipe reached its end). A signal still ends the call
    it is sent to. With --reuse 1 every call has a worker of its own, as before."""
    cluster.start(nodes=1, cpus=2)
    env = env_for(cluster)
    reused = Server(public / "reuse.sock", public / "reuse.log").start()
    single = Server(public / "single.sock", public / "single.log", args=["--reuse", "1"]).start()
    try:
        for server in (reused, single):
            for i in range(5):
                a = fast(bindir, server, {**env, "COLUMNS": str(90 + i)}, tmp_path, "sinfo")
                assert a == python({**env, "COLUMNS": str(90 + i)}, tmp_path, "sinfo"), a
            wait_for(lambda s=server: s.calls() >= 5, what="five calls in the server's log")
        assert len(set(reused.workers())) == 1, reused.log.read_text()
        assert len(set(single.workers())) == 5, single.log.read_text()
        # the reused worker is an ordinary process for each call: SIGTERM kills it mid-call
        sbatch = [str(bindir / "sbatch")]
        (code, _, _), jid = signalled_wait(cluster, sbatch, reused, env, tmp_path, signal.SIGTERM)
        assert code == -signal.SIGTERM
        cluster.client().cancel([jid])
    finally:
        reused.stop()
        single.stop()
