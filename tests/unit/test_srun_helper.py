"""srun through the job's resident helper (srun/helper.py), with real processes and a real socket:
the thin srun passes its arguments, environment, directory and stdout/stderr to the helper,
which runs the step as the full srun does; anything the helper should not run falls back to
the full srun before a step exists.

The controller and the task's shepherd are played by this test (a real HTTP server on
loopback, real connections to the step's I/O port), so srun's whole protocol is exercised
without a cluster: tests/system/test_steps.py runs the same through real agents.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

from phalanx.agent import native_srun as native
from phalanx.slurm.srun import thin as srun_fast

# imported by the full srun only (srun/command.py itself is loaded by importlib.import_module, which
# -X importtime does not list)
FULL_SRUN = "phalanx.lean_client"


class FakeController:
    """Answers srun's step requests; plays one task that prints and exits with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.bodies: list[dict[str, Any]] = []
        ctl = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ctl.bodies.append(body)
                threading.Thread(target=ctl.play_task, args=(body,), daemon=True).start()
                step = {"job_id": 7, "step_id": 0, "attempt_id": 1, "nodes": ["n1"]}
                self._answer(201, {**step, "tasks": [1], "task_ids": [[0]]})

            def do_GET(self) -> None:
                self._answer(200, {"step_id": 0, "state": "RUNNING"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def play_task(self, body: dict[str, Any]) -> None:
        """What a shepherd does: streams first, then the exit record."""
        time.sleep(0.05)  # srun has the step's answer by now (it does not need it, though)
        addr = (body["host"], body["port"])
        head = body["cookie"] + " 0 "
        with socket.create_connection(addr) as out, socket.create_connection(addr) as err:
            out.sendall(f"{head}out\n".encode() + b"hello from the task\n")
            err.sendall(f"{head}err\n".encode() + b"task stderr\n")
        with socket.create_connection(addr) as ex:
            rec = {"exit_code": self.code, "started_at": time.time(), "ended_at": time.time()}
            ex.sendall(f"{head}exit\n".encode() + json.dumps(rec).encode())


@pytest.fixture
def job_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SLURM_JOB_ID": "7",
        "TMPDIR": str(tmp_path),
        "PHALANX_TOKEN": "test-token",
        "PHX_SRUN_HOST": "127.0.0.1",
    }
    yield env
    # a full srun run by the test starts its own helper on this test's socket (the first full
    # srun of a job does): stop it, found by that socket's path (unique to this test)
    path = srun_fast.socket_path(env)
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if path is not None
        and (p.info["cmdline"] or [])[-2:] == ["phalanx.slurm.srun.helper", path]
    ]
    for p in left:
        p.terminate()
    psutil.wait_procs(left, timeout=30)


def start_helper(env: dict[str, str]) -> subprocess.Popen[bytes]:
    path = srun_fast.socket_path(env)
    assert path is not None
    helper = subprocess.Popen(
        [sys.executable, "-m", "phalanx.slurm.srun.helper", path],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert helper.poll() is None, helper.stderr.read() if helper.stderr else b""
        assert time.monotonic() < deadline, "the helper never listened"
        time.sleep(0.02)
    return helper


def srun(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed srun's path through the multi-call entry point, with -X importtime so
    the test sees what the thin srun had to import."""
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "phalanx.slurm", "srun", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def imported(stderr: str) -> set[str]:
    return {
        ln.split("|")[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")
    }


def without_imports(stderr: str) -> str:
    return "".join(ln + "\n" for ln in stderr.splitlines() if not ln.startswith("import time:"))


@contextlib.contextmanager
def caller_and_helper(
    job_env: dict[str, str], tmp_path: Path
) -> Iterator[tuple[FakeController, dict[str, str], Path, subprocess.Popen[bytes]]]:
    """A controller whose task exits 3, the caller's environment (MY_VAR differs from the
    helper's own), a working directory, and the job's helper; stopped afterwards."""
    ctl = FakeController(code=3)
    env = {**job_env, "PHALANX_URL": ctl.url, "MY_VAR": "from the caller"}
    helper = start_helper({**env, "MY_VAR": "the helper's own"})
    workdir = tmp_path / "work"
    workdir.mkdir()
    try:
        yield ctl, env, workdir, helper
    finally:
        helper.terminate()
        helper.wait(timeout=30)
        ctl.server.shutdown()


def test_the_helper_runs_the_step_for_a_thin_srun(job_env: dict[str, str], tmp_path: Path) -> None:
    with caller_and_helper(job_env, tmp_path) as (ctl, env, workdir, helper):
        r = srun(env, "-l", "echo", "hi", cwd=workdir)
        # the task's output, labelled, on srun's own stdout and stderr; its exit code
        assert r.stdout == "0: hello from the task\n", r
        # (srun reports a task's exit as it arrives, maybe before the task's last output)
        assert sorted(without_imports(r.stderr).splitlines()) == [
            "0: task stderr",
            "srun: error: n1: task 0: Exited with exit code 3",
        ], r.stderr
        assert r.returncode == 3
        # the thin srun never loaded the full srun, its HTTP client or argparse
        mods = imported(r.stderr)
        assert "phalanx.slurm.srun.thin" in mods
        assert not mods & {FULL_SRUN, "phalanx.slurm.common", "http.client", "argparse", "json"}
        # the step has the caller's command, directory and environment, not the helper's
        (body,) = ctl.bodies
        assert body["argv"] == ["echo", "hi"] and body["label"] is True
        assert body["cwd"] == str(workdir)
        assert body["env"]["MY_VAR"] == "from the caller"
        # a second srun goes through the same helper
        r2 = srun(env, "true", cwd=workdir)
        assert r2.returncode == 3 and len(ctl.bodies) == 2
        assert FULL_SRUN not in imported(r2.stderr)
        # and keeps nothing of them: no thread, no listening port per step it ran (a job
        # runs thousands of steps through one helper)
        proc = psutil.Process(helper.pid)

        def leftovers() -> tuple[int, list[Any]]:
            listening = [c for c in proc.net_connections("tcp") if c.status == "LISTEN"]
            return proc.num_threads(), listening

        deadline = time.monotonic() + 30
        while leftovers() != (1, []):
            assert time.monotonic() < deadline, f"threads and listeners left: {leftovers()}"
            time.sleep(0.05)


def test_what_the_helper_should_not_run_falls_back_to_the_full_srun(
    job_env: dict[str, str], tmp_path: Path
) -> None:
    ctl = FakeController(code=0)
    env = {**job_env, "PHALANX_URL": ctl.url}
    helper = start_helper(env)
    try:
        # an option srun refuses: the full srun says so, as it always has; nothing started
        r = srun(env, "--bogus", "true", cwd=tmp_path)
        assert r.returncode == 1
        assert "srun: error: unrecognized arguments: --bogus" in r.stderr, r.stderr
        assert FULL_SRUN in imported(r.stderr)
        # another controller than the helper's: the full srun, to that controller
        other = FakeController(code=5)
        try:
            r = srun({**env, "PHALANX_URL": other.url}, "true", cwd=tmp_path)
            assert r.returncode == 5, r.stderr
            assert FULL_SRUN in imported(r.stderr)
            assert len(other.bodies) == 1
        finally:
            other.server.shutdown()
        assert ctl.bodies == []
    finally:
        helper.terminate()
        helper.wait(timeout=30)
        ctl.server.shutdown()


def test_the_helpers_socket_is_private_and_sigterm_ends_it(
    job_env: dict[str, str],
) -> None:
    path = srun_fast.socket_path(job_env)
    assert path is not None
    helper = start_helper(job_env)
    try:
        assert os.stat(path).st_mode & 0o077 == 0  # the job's user only
    finally:
        helper.terminate()
        helper.wait(timeout=30)
    # SIGTERM (the job's end) kills it at once: its socket file stays, and a thin srun that
    # finds nobody listening there runs the full srun
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.connect(path)


def test_no_helper_outside_a_job_or_for_an_attached_batch_step(job_env: dict[str, str]) -> None:
    assert srun_fast.socket_path(job_env) == f"{job_env['TMPDIR']}/.phx-srun-7.sock"
    assert srun_fast.socket_path({**job_env, "SLURM_JOB_ID": ""}) is None
    assert srun_fast.socket_path({k: v for k, v in job_env.items() if k != "TMPDIR"}) is None
    assert srun_fast.socket_path({**job_env, srun_fast.ATTACH_ENV: "h:1:c"}) is None
    assert srun_fast.socket_path({**job_env, srun_fast.NO_HELPER_ENV: "1"}) is None


# ----------------------------------------------------------------- the compiled thin srun
@pytest.fixture(scope="module")
def compiled_srun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """srun/thin.c built as the agents build it, falling back to this interpreter."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        pytest.skip("no C compiler on this host: agents use the Python srun there")
    target = tmp_path_factory.mktemp("native") / "srun"
    native.build(compiler, sys.executable, target)
    return target


def compiled(
    exe: Path, env: dict[str, str], *args: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(exe), *args], env=env, capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_the_compiled_srun_hands_the_step_to_the_helper(
    compiled_srun: Path, job_env: dict[str, str], tmp_path: Path
) -> None:
    """Byte for byte the thin srun's request: the helper runs the step with the caller's
    command, directory and environment and writes the task's output to the caller's own
    stdout and stderr; the exit status is the step's."""
    with caller_and_helper(job_env, tmp_path) as (ctl, env, workdir, _helper):
        r = compiled(compiled_srun, env, "-l", "echo", "two words", cwd=workdir)
        assert r.stdout == "0: hello from the task\n", r
        assert sorted(r.stderr.splitlines()) == [
            "0: task stderr",
            "srun: error: n1: task 0: Exited with exit code 3",
        ], r.stderr
        assert r.returncode == 3
        (body,) = ctl.bodies
        assert body["argv"] == ["echo", "two words"] and body["label"] is True
        assert body["cwd"] == str(workdir)
        assert body["env"]["MY_VAR"] == "from the caller"


def test_the_compiled_srun_runs_the_full_srun_where_the_helper_cannot(
    compiled_srun: Path, job_env: dict[str, str], tmp_path: Path
) -> None:
    ctl = FakeController(code=4)
    env = {**job_env, "PHALANX_URL": ctl.url}
    helper = start_helper(env)
    try:
        # the helper answers `fallback` to an option srun refuses: the full srun's error
        r = compiled(compiled_srun, env, "--bogus", "true", cwd=tmp_path)
        assert r.returncode == 1
        assert "srun: error: unrecognized arguments: --bogus" in r.stderr, r.stderr
        assert ctl.bodies == []
    finally:
        helper.terminate()
        helper.wait(timeout=30)
    # no helper listening: the full srun runs the step itself
    r = compiled(compiled_srun, env, "true", cwd=tmp_path)
    assert r.returncode == 4, r.stderr
    assert len(ctl.bodies) == 1
    ctl.server.shutdown()
    # outside a job: the full srun, which says there is no controller to make a job
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    outside["PHALANX_URL"] = "http://127.0.0.1:9"
    r = compiled(compiled_srun, outside, "true", cwd=tmp_path)
    assert r.returncode == 1
    assert "srun: error: not inside a job (no SLURM_JOB_ID)" in r.stderr, r.stderr


# ----------------------------------------------------------------- sockets of other users
NOBODY = 65534  # the uid that plants sockets and connects to helpers in these tests

# Plays a user who shares the job's TMPDIR: listens at the helper's path as uid NOBODY and
# prints, for each connection, how many bytes and descriptors it was handed.  Everything it
# needs is imported before it drops root (the interpreter lives where NOBODY cannot read).
PLANT = r"""
import json, os, socket, sys
path, uid = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chown(path, uid, uid)
os.chmod(path, 0o777)
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
s.listen(8)  # the kernel records who listens: uid
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2.0)
    got = fds = 0
    try:
        while True:
            msg, passed, _flags, _addr = socket.recv_fds(c, 65536, 8)
            for fd in passed:
                os.close(fd)
            got, fds = got + len(msg), fds + len(passed)
            if not msg:
                break
    except OSError:  # TimeoutError included: the caller waits for an answer
        pass
    c.close()
    print(json.dumps({"bytes": got, "fds": fds}), flush=True)
"""

# Plays another user's process that connects to a job's helper and asks it for a step.
CONNECT_AS = r"""
import os, socket, sys
path, uid = sys.argv[1], int(sys.argv[2])
payload = b"\0".join([b"srun1", b"/", b"1", b"true"])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(path)
try:
    socket.send_fds(s, [b"srun1 %d\n" % len(payload)], [1, 2])
    s.sendall(payload)
except OSError:
    pass  # refused and closed before it read anything
data = b""
try:
    while b"\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
except OSError:
    pass
print(data.split(b"\n")[0].decode(), flush=True)
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays other uids: root only")


@contextlib.contextmanager
def planted_socket(path: str) -> Iterator[list[dict[str, int]]]:
    """A socket of uid NOBODY at `path`; yields the list of what each connection handed it
    (filled as connections end)."""
    plant = subprocess.Popen(
        [sys.executable, "-c", PLANT, path, str(NOBODY)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert plant.stdout is not None
    records: list[dict[str, int]] = []
    try:
        assert plant.stdout.readline() == "listening\n"
        assert os.stat(path).st_uid == NOBODY

        def collect() -> None:
            assert plant.stdout is not None
            for line in plant.stdout:
                records.append(json.loads(line))

        threading.Thread(target=collect, daemon=True).start()
        yield records
    finally:
        plant.kill()
        plant.wait(timeout=30)


def wait_records(records: list[dict[str, int]], n: int) -> None:
    deadline = time.monotonic() + 30
    while len(records) < n:
        assert time.monotonic() < deadline, f"the planted socket saw {records}"
        time.sleep(0.02)


@needs_root
@pytest.mark.parametrize("client", ["python", "compiled"])
def test_a_socket_another_user_planted_at_the_helpers_path_gets_nothing(
    client: str, job_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Whoever shares the job's TMPDIR could listen at the helper's name before it does: the
    thin srun (Python or compiled) asks the kernel who listens there and, for anyone but
    the caller or root, sends nothing (not its environment, not its stdout and stderr), says
    why, and runs the full srun."""
    path = srun_fast.socket_path(job_env)
    assert path is not None
    ctl = FakeController(code=6)
    env = {**job_env, "PHALANX_URL": ctl.url}
    try:
        with planted_socket(path) as records:
            if client == "python":
                r = srun(env, "true", cwd=tmp_path)
                err = without_imports(r.stderr)
            else:
                r = compiled(request.getfixturevalue("compiled_srun"), env, "true", cwd=tmp_path)
                err = r.stderr
            wait_records(records, 1)  # it did connect (and then handed over nothing)
            assert records == [{"bytes": 0, "fds": 0}], records
        assert f"srun: error: {path} is served by uid {NOBODY}, not by you (uid 0) or root" in err
        assert r.returncode == 6, err  # the full srun ran the step
        assert len(ctl.bodies) == 1
    finally:
        ctl.server.shutdown()


@needs_root
def test_the_helper_refuses_another_users_client(job_env: dict[str, str]) -> None:
    """A process of another uid that reaches the job's helper (its socket is 0600 and in the
    job's own TMPDIR; here made reachable on purpose) is answered `refused ...` before the
    helper reads its request: no step, nothing of its descriptors kept."""
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="phx-srund-", dir="/tmp"))
    try:
        shared.chmod(0o711)
        ctl = FakeController(code=0)
        env = {**job_env, "TMPDIR": str(shared), "PHALANX_URL": ctl.url}
        path = srun_fast.socket_path(env)
        assert path is not None
        helper = start_helper(env)
        try:
            os.chmod(path, 0o666)
            r = subprocess.run(
                [sys.executable, "-c", CONNECT_AS, path, str(NOBODY)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip() == (
                f"refused this srun helper serves uid 0 (and root) only, not uid {NOBODY}"
            ), r.stdout
            assert ctl.bodies == []
            assert helper.poll() is None  # and it goes on serving its own user
        finally:
            helper.terminate()
            helper.wait(timeout=30)
            ctl.server.shutdown()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
