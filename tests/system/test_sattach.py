"""sattach end to end on a real local cluster (slurm/sattach.py, the step's I/O hub in srun:
srun/attach.py): the installed `sattach` attaches to a running step's I/O as Slurm 22.05's
does in the lab (../shared/slurm-lab).

* A step of two tasks on two nodes prints lines over time: sattach gets what srun kept and
  then the lines printed after it attached, `-l` labelled, `--output-filter` one task's (its
  stderr too), then each task's failure and exits with the worst code; `--layout` prints the
  step's tasks per node. A missing or ended step is Slurm's error, exit 1, and another Unix
  user's step is refused (run as that user, through a node's credential socket).
* A step whose srun reads a pipe kept open: sattach's stdin reaches every task, and with
  `--input-filter` one; a sattach killed changes nothing for the step; the end of sattach's
  input is the tasks' end of file. That step goes through the job's srun helper and the
  compiled thin srun, which hand it srun's stdin.

No sleep where a condition can be awaited; deadlines are generous (a busy 2-core machine).
Needs root for the other user (useradd, runuser); everything it makes is removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from system.harness import Cluster, base_env, wait_for
from system.unixusers import can_import, root_searchable, temporary_users

pytestmark = pytest.mark.system

BIN = str(Path(sys.executable).parent)  # where sattach, srun, ... are installed
PATH = f"{BIN}:/usr/local/bin:/usr/bin:/bin"
EVE = "phxsatt"
DEADLINE = 120.0
NO_STEP = "sattach: error: Could not get job step info: Invalid job id specified\n"


class Lines:
    """A pipe of a running command, read line by line in a thread; waited on by content."""

    def __init__(self, pipe: object) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe: object) -> None:
        for line in pipe:  # type: ignore[attr-defined]
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()

    def wait(self, *wanted: str, timeout: float = DEADLINE) -> list[str]:
        with self.cond:
            ok = self.cond.wait_for(lambda: all(w in self.lines for w in wanted), timeout)
            assert ok, (wanted, self.lines[-20:])
            return list(self.lines)

    def wait_any(self, prefix: str, timeout: float = DEADLINE) -> str:
        with self.cond:
            self.cond.wait_for(lambda: any(x.startswith(prefix) for x in self.lines), timeout)
            found = [x for x in self.lines if x.startswith(prefix)]
            assert found, (prefix, self.lines[-20:])
            return found[0]

    def done(self) -> list[str]:
        self.thread.join(DEADLINE)
        return list(self.lines)


@dataclass
class Attach:
    proc: subprocess.Popen[str]
    out: Lines
    err: Lines

    def finish(self) -> int:
        code = self.proc.wait(timeout=DEADLINE)
        self.out.done()
        self.err.done()
        return code


@dataclass
class Site:
    cluster: Cluster
    work: Path

    def env(self, home: str = "/root") -> dict[str, str]:
        """A shell on a cluster host: node01's credential socket, the commands on PATH."""
        return base_env(
            self.cluster.root,
            PHALANX_URL=self.cluster.url,
            PHALANX_AUTH_SOCKET=str(self.cluster.agent_socket("node01")),
            PATH=PATH,
            HOME=home,
        )

    def sattach(self, *args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
        prefix = [shutil.which("runuser") or "runuser", "-u", user, "--"] if user else []
        return subprocess.run(
            [*prefix, f"{BIN}/sattach", *args],
            env=self.env(f"/home/{user}" if user else "/root"),
            cwd=self.work if user is None else "/",
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            stdin=subprocess.DEVNULL,
        )

    def attach(self, *args: str, stdin: int | None = subprocess.DEVNULL) -> Attach:
        proc = subprocess.Popen(
            [f"{BIN}/sattach", *args],
            env=self.env(),
            cwd=self.work,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return Attach(proc, Lines(proc.stdout), Lines(proc.stderr))

    def submit(self, name: str, body: str, **extra: object) -> int:
        return self.cluster.submit_script(
            self.work, name, "#!/bin/bash\n" + body, env={"PATH": PATH}, **extra
        )

    def running_step(self, jid: int, step: int = 0) -> None:
        def running() -> bool:
            got = self.cluster.client().get(f"/v1/jobs/{jid}/steps/{step}")
            return bool(got["state"] == "RUNNING")

        wait_for(running, timeout=DEADLINE, what=f"step {jid}.{step} to run")


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    top = Path(tempfile.mkdtemp(prefix="phx-sattach-", dir="/tmp"))
    cluster: Cluster | None = None
    try:
        top.chmod(0o755)  # another user reaches the agent's credential socket through it
        with temporary_users([EVE]), root_searchable():
            can_import(EVE)
            work = top / "work"
            work.mkdir()
            cluster = Cluster(top / "cluster")
            cluster.root.chmod(0o755)
            cluster.start(nodes=2, cpus=2)
            try:
                yield Site(cluster, work)
            finally:
                swept = cluster.cleanup()
                if swept:
                    print(f"cleanup swept up stray processes: {swept}", file=sys.stderr)
    finally:
        shutil.rmtree(top, ignore_errors=True)


PRINTER = """srun -N 2 -n 2 bash -c '
i=0
while [ ! -e {work}/go ]; do
    i=$((i+1)); echo "out $SLURM_PROCID $i"; echo "err $SLURM_PROCID $i" >&2; sleep 0.2
done
echo "after $SLURM_PROCID"; echo "after-err $SLURM_PROCID" >&2
exit $((3 + SLURM_PROCID))'
"""


@pytest.mark.timeout(600)
def test_sattach_follows_a_running_steps_output_and_exits_with_its_tasks_worst_code(
    site: Site,
) -> None:
    jid = site.submit("printer", PRINTER.format(work=site.work), nodes=2)
    site.running_step(jid)
    out_file = site.work / f"printer-{jid}.out"
    wait_for(lambda: "out 1 2" in out_file.read_text(), timeout=DEADLINE, what="the step's output")

    p = site.sattach("--layout", f"{jid}.0")
    assert (p.returncode, p.stderr) == (0, ""), p
    assert p.stdout == (
        "Job step layout:\n"
        "\t2 tasks, 2 nodes (node[01-02])\n\n"
        "\tNode 0 (node01), 1 task(s): 0 \n"
        "\tNode 1 (node02), 1 task(s): 1 \n"
    )
    # errors as Slurm's: a step the job does not have, a job that does not exist
    for ref in (f"{jid}.5", "99999.0"):
        p = site.sattach(ref)
        assert (p.returncode, p.stdout, p.stderr) == (1, "", NO_STEP), p
    # another user's step: refused, as Slurm's controller refuses it (PrivateData=jobs)
    for args in ([f"{jid}.0"], ["--layout", f"{jid}.0"]):
        p = site.sattach(*args, user=EVE)
        assert (p.returncode, p.stdout) == (1, ""), p
        assert p.stderr == "sattach: error: Could not get job step info: Access/permission denied\n"

    labelled = site.attach("-l", f"{jid}.0")
    one = site.attach("--output-filter=1", f"{jid}.0")
    # srun kept the output so far (slurmstepd's replay) and goes on: lines come as printed
    labelled.out.wait("0: out 0 1", "1: out 1 1")
    labelled.err.wait("0: err 0 1", "1: err 1 1")
    one.out.wait("out 1 1")
    last = max(int(x.split()[-1]) for x in labelled.out.wait() if x.startswith("0: out 0 "))
    labelled.out.wait(f"0: out 0 {last + 2}")  # printed after sattach attached
    (site.work / "go").touch()  # the tasks' last lines, then their ends (exit 3 and 4)

    assert labelled.finish() == 4
    assert {"0: after 0", "1: after 1"} <= set(labelled.out.lines), labelled.out.lines
    assert all(x[:3] in ("0: ", "1: ") for x in labelled.out.lines)
    errs = labelled.err.lines
    assert {"0: after-err 0", "1: after-err 1"} <= set(errs), errs
    assert "sattach: error: task 0 exited with exit code 3" in errs
    assert "sattach: error: task 1 exited with exit code 4" in errs

    assert one.finish() == 4
    assert "after 1" in one.out.lines and all(
        x.startswith(("out 1 ", "after 1")) for x in one.out.lines
    )
    assert "after-err 1" in one.err.lines  # --error-filter follows --output-filter
    assert not any(x.startswith(("err 0", "after-err 0")) for x in one.err.lines), one.err.lines

    assert site.cluster.wait_terminal([jid])[jid]["state"] == "FAILED"  # srun's exit 4
    p = site.sattach(f"{jid}.0")  # ended: Slurm's controller has forgotten it
    assert (p.returncode, p.stdout, p.stderr) == (1, "", NO_STEP), p


def thin_sruns(jid: int) -> list[int]:
    """The compiled thin sruns (agent/native_srun.py) running in job `jid`."""
    found = []
    for pid in filter(str.isdecimal, os.listdir("/proc")):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "/_native/" in exe and exe.endswith("/srun") and f"SLURM_JOB_ID={jid}".encode() in env:
            found.append(int(pid))
    return found


READER = """mkfifo {work}/in.fifo
sleep 600 > {work}/in.fifo &
writer=$!
srun -n 1 true   # the job's first srun starts its srun helper; the next goes through it
sock="$TMPDIR/.phx-srun-$SLURM_JOB_ID.sock"
for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
srun -n 2 bash -c '
echo "ready $SLURM_PROCID"
while read -r line; do echo "got $SLURM_PROCID $line"; done
echo "eof $SLURM_PROCID"' < {work}/in.fifo
code=$?
kill $writer
exit $code
"""


@pytest.mark.timeout(600)
def test_sattach_input_reaches_the_tasks_and_a_killed_sattach_changes_nothing(
    site: Site,
) -> None:
    jid = site.submit("reader", READER.format(work=site.work), cpus_per_task=2)
    site.running_step(jid, 1)
    if shutil.which(os.environ.get("CC", "cc")):
        # the step is the job's srun helper's, handed over by the compiled thin srun (which
        # would have run the full srun, a Python process, had the helper not taken it)
        assert thin_sruns(jid), "the reading step did not go through the job's srun helper"
    first = site.attach("-l", f"{jid}.1", stdin=subprocess.PIPE)
    assert first.proc.stdin is not None
    first.out.wait("0: ready 0", "1: ready 1")
    first.proc.stdin.write("hello\n")
    first.proc.stdin.flush()
    first.out.wait("0: got 0 hello", "1: got 1 hello")

    # --input-filter: one task; then killed, with no end of input: the step goes on
    other = site.attach("--input-filter=1", f"{jid}.1", stdin=subprocess.PIPE)
    assert other.proc.stdin is not None
    other.out.wait("ready 1")  # attached (the output kept)
    other.proc.stdin.write("only one\n")
    other.proc.stdin.flush()
    first.out.wait("1: got 1 only one")
    other.proc.send_signal(signal.SIGKILL)
    other.proc.wait(timeout=DEADLINE)
    first.proc.stdin.write("again\n")
    first.proc.stdin.flush()
    lines = first.out.wait("0: got 0 again", "1: got 1 again")
    assert "0: got 0 only one" not in lines

    first.proc.stdin.close()  # sattach's end of input is the tasks'
    first.out.wait("0: eof 0", "1: eof 1")
    assert first.finish() == 0
    assert first.err.lines == []
    assert site.cluster.wait_terminal([jid])[jid]["state"] == "COMPLETED"
    out = (site.work / f"reader-{jid}.out").read_text()
    assert "got 0 again" in out and "eof 1" in out  # srun printed them too
    assert os.path.exists(site.work / "in.fifo")
