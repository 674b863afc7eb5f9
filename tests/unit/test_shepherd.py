"""Tests for the per-task shepherd, with real processes (no mocks).

The shepherd is the one component whose mistakes lose or duplicate user work, so every
behaviour is checked end to end: real bash jobs, real signals, real detachment.  Tests wait on
conditions (files, /proc, ``read_status``) with generous deadlines instead of fixed sleeps so
they hold on a busy 2-core machine, and every process they start is killed in teardown even
when an assertion fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from phalanx.agent import checkpoint_requests, shepherd_files, shepherd_launch
from phalanx.agent.shepherd_control import forward_signal, read_status, request_stop
from phalanx.agent.shepherd_launch import launch

WAIT_S = 30.0
SRC_DIR = Path(__file__).resolve().parents[2] / "src"
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"


def wait_for(cond: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """Poll ``cond`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def proc_state(pid: int) -> str | None:
    """State letter from /proc/PID/stat, or None if the pid does not exist."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def proc_dead(pid: int) -> bool:
    """Gone or a zombie: PID 1 reaps orphans slowly here, so zombies must count as dead."""
    return proc_state(pid) in (None, "Z", "X")


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


class Tasks:
    """Builds task directories and scripts, and remembers everything to kill in teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.task_dirs: list[Path] = []
        self.popens: list[subprocess.Popen[bytes]] = []
        self._n = 0

    def script(self, body: str, name: str | None = None) -> Path:
        self._n += 1
        path = self.root / (name or f"job{self._n}.sh")
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
        return path

    def task(self, argv: list[str] | Path, **overrides: Any) -> Path:
        """Create a task dir with a spec.json; ``overrides`` replace spec fields."""
        self._n += 1
        td = self.root / f"task{self._n}"
        td.mkdir()
        spec: dict[str, Any] = {
            "attempt_id": self._n,
            "job_id": 1,
            "token": "ab" * 8,
            "node": "node01",
            "rank": 0,
            "argv": [str(argv)] if isinstance(argv, Path) else argv,
            "env": {"PATH": JOB_PATH},
            "cwd": str(self.root),
            "stdout": str(td / "out"),
            "stderr": str(td / "err"),
            "open_mode": "truncate",
            "time_limit_s": None,
            "kill_grace_s": 1.0,
            "signal": None,
            "fence": None,
        }
        spec.update(overrides)
        (td / "spec.json").write_text(json.dumps(spec))
        self.task_dirs.append(td)
        return td

    def launch(self, argv: list[str] | Path, **overrides: Any) -> Path:
        td = self.task(argv, **overrides)
        launch(td)
        return td

    def wait_state(self, td: Path, state: str) -> dict[str, Any]:
        status: dict[str, Any] = wait_for(
            lambda: (s := read_status(td))["state"] == state and s,
            f"state {state!r} in {td}",
        )
        return status

    def wait_exited(self, td: Path) -> dict[str, Any]:
        return self.wait_state(td, "exited")

    def cleanup(self) -> None:
        for popen in self.popens:
            if popen.poll() is None:
                popen.kill()
            popen.wait()
        for td in self.task_dirs:
            job = _load(td / "job.json")
            if job:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job["pgid"], signal.SIGKILL)
            info = _load(td / "shepherd.pid")
            if info and shepherd_files._is_alive(info["pid"], info["starttime"]):
                os.kill(info["pid"], signal.SIGKILL)


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


@pytest.fixture
def tasks(tmp_path: Path) -> Iterator[Tasks]:
    t = Tasks(tmp_path)
    try:
        yield t
    finally:
        t.cleanup()


# -- normal runs ----------------------------------------------------------------------------


def test_exit_code_and_separate_streams(tasks: Tasks) -> None:
    job = tasks.script("echo to-out\necho to-err >&2\nexit 3\n")
    td = tasks.launch(job)
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 3
    assert result["signal"] is None
    assert not (result["timed_out"] or result["cancelled"] or result["fenced"])
    assert result["launch_failed"] is False and result["error"] is None
    assert result["stop_requested"] is False
    assert result["stop_reason"] is None and result["checkpoint_signal_sent_at"] is None
    assert result["started_at"] <= result["ended_at"]
    assert (td / "out").read_text() == "to-out\n"
    assert (td / "err").read_text() == "to-err\n"
    job_info = json.loads((td / "job.json").read_text())
    assert job_info["pid"] == job_info["pgid"]
    assert job_info["started_at"] == result["started_at"]


@pytest.mark.parametrize("stderr", ["null", "same-path"])
def test_merged_streams(tasks: Tasks, stderr: str) -> None:
    job = tasks.script("echo one\necho two >&2\necho three\n")
    td = tasks.task(job)
    spec = json.loads((td / "spec.json").read_text())
    spec["stderr"] = None if stderr == "null" else spec["stdout"]
    (td / "spec.json").write_text(json.dumps(spec))
    launch(td)
    assert tasks.wait_exited(td)["exit_code"] == 0
    assert (td / "out").read_text() == "one\ntwo\nthree\n"
    assert not (td / "err").exists()


def test_append_mode_keeps_previous_output_and_truncate_replaces_it(tasks: Tasks) -> None:
    out = tasks.root / "shared.out"
    job = tasks.script('echo "run $RUN"\n')
    for run, mode in ((1, "append"), (2, "append"), (3, "truncate"), (4, "append")):
        td = tasks.launch(
            job,
            env={"PATH": JOB_PATH, "RUN": str(run)},
            stdout=str(out),
            stderr=None,
            open_mode=mode,
        )
        assert tasks.wait_exited(td)["exit_code"] == 0
        if run == 2:
            assert out.read_text() == "run 1\nrun 2\n"
    assert out.read_text() == "run 3\nrun 4\n"


def test_env_is_complete_and_cwd_is_used(tasks: Tasks, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_TEST_LEAK", "leaked")  # must not reach the job
    workdir = tasks.root / "work dir"
    workdir.mkdir()
    job = tasks.script('echo "$FOO|${PHALANX_TEST_LEAK-unset}|$(pwd)"\n')
    td = tasks.launch(job, env={"PATH": JOB_PATH, "FOO": "bar baz"}, cwd=str(workdir))
    assert tasks.wait_exited(td)["exit_code"] == 0
    assert (td / "out").read_text() == f"bar baz|unset|{workdir}\n"


def test_arguments_and_stdin_from_devnull(tasks: Tasks) -> None:
    job = tasks.script('printf "%s," "$@"\ncat\necho "<eof>"\n')
    td = tasks.launch([str(job), "a b", "c"])
    assert tasks.wait_exited(td)["exit_code"] == 0
    assert (td / "out").read_text() == "a b,c,<eof>\n"


def test_death_by_signal_is_reported_as_signal(tasks: Tasks) -> None:
    td = tasks.launch(tasks.script("kill -KILL $$\n"))
    result = tasks.wait_exited(td)
    assert result["exit_code"] is None
    assert result["signal"] == signal.SIGKILL


# -- time limit and signals -------------------------------------------------------------------


def test_time_limit_sends_term_then_kill_after_grace(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    job = tasks.script(f"trap 'echo term >> {marker}' TERM\nwhile :; do sleep 0.1; done\n")
    td = tasks.launch(job, time_limit_s=1.0, kill_grace_s=1.0)
    result = tasks.wait_exited(td)
    assert result["timed_out"] is True
    assert result["cancelled"] is False
    assert result["stop_requested"] is False
    assert result["signal"] == signal.SIGKILL
    assert "term" in read_text(marker)  # SIGTERM was delivered and ignored...
    elapsed = result["ended_at"] - result["started_at"]
    assert elapsed >= 1.9  # ...so only the SIGKILL after limit + grace ended it
    assert elapsed < 1.0 + 1.0 + 15.0  # and it did not wait for the job forever


def test_signal_is_delivered_before_time_limit(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    job = tasks.script(f"trap 'echo usr1 >> {marker}; exit 0' USR1\nwhile :; do sleep 0.1; done\n")
    td = tasks.launch(
        job,
        time_limit_s=60.0,
        signal={"signum": int(signal.SIGUSR1), "before_s": 58.0, "batch_only": False},
    )
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0
    assert result["timed_out"] is False
    assert read_text(marker) == "usr1\n"


def _two_level_script(tasks: Tasks, marker: Path, sig: str, wait_child: bool) -> Path:
    """Main script plus a background subshell in the same process group, both trapping ``sig``.

    The main script exits once it got the signal: after seeing the child's line too when the
    whole group is expected to get it, else after giving the child a moment to (wrongly) react.
    """
    after = (
        f"for i in $(seq 400); do grep -q child {marker} && break; sleep 0.05; done\n"
        if wait_child
        else "sleep 1\n"
    )
    return tasks.script(
        f"( trap 'echo child >> {marker}; exit 0' {sig}\n"
        f"  echo ready-child >> {marker}\n"
        "  while :; do sleep 0.05; done ) &\n"
        f"trap 'got=1' {sig}\n"
        f"echo ready-main >> {marker}\n"
        'while [ -z "$got" ]; do sleep 0.05; done\n'
        f"echo main >> {marker}\n" + after
    )


def test_batch_only_time_limit_signal_reaches_main_process_only(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    job = _two_level_script(tasks, marker, "USR1", wait_child=False)
    td = tasks.launch(
        job,
        time_limit_s=60.0,
        signal={"signum": int(signal.SIGUSR1), "before_s": 57.0, "batch_only": True},
    )
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0
    lines = read_text(marker).split()
    assert "main" in lines
    assert "child" not in lines


def test_forward_signal_to_whole_group(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    td = tasks.launch(_two_level_script(tasks, marker, "USR2", wait_child=True))
    wait_for(lambda: {"ready-main", "ready-child"} <= set(read_text(marker).split()), "ready")
    assert forward_signal(td, signal.SIGUSR2) is True
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0
    assert {"main", "child"} <= set(read_text(marker).split())
    assert not list(td.glob("signal-*"))  # the request was consumed


def test_forward_signal_batch_only(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    td = tasks.launch(_two_level_script(tasks, marker, "USR1", wait_child=False))
    wait_for(lambda: {"ready-main", "ready-child"} <= set(read_text(marker).split()), "ready")
    assert forward_signal(td, signal.SIGUSR1, batch_only=True) is True
    assert tasks.wait_exited(td)["exit_code"] == 0
    lines = read_text(marker).split()
    assert "main" in lines
    assert "child" not in lines


def test_request_stop_cancels_job(tasks: Tasks) -> None:
    td = tasks.launch(tasks.script("sleep 1000\n"))
    tasks.wait_state(td, "running")
    assert request_stop(td) is True
    result = tasks.wait_exited(td)
    assert result["cancelled"] is True
    assert result["timed_out"] is False
    assert result["signal"] == signal.SIGTERM
    assert result["stop_requested"] is True
    assert result["stop_reason"] is None and result["checkpoint_signal_sent_at"] is None
    assert request_stop(td) is False  # nothing left to stop
    assert forward_signal(td, signal.SIGUSR1) is False


def test_request_stop_terminates_a_stopped_job(tasks: Tasks) -> None:
    """SIGCONT follows SIGTERM, so a job suspended with SIGSTOP still gets to die."""
    td = tasks.launch(tasks.script("kill -STOP $$\necho resumed\n"), kill_grace_s=30.0)
    job_pid = tasks.wait_state(td, "running")["job_pid"]
    wait_for(lambda: proc_state(job_pid) == "T", "job to stop itself")
    assert request_stop(td) is True
    result = tasks.wait_exited(td)
    assert result["cancelled"] is True
    assert result["signal"] == signal.SIGTERM
    assert result["ended_at"] - result["started_at"] < 30.0  # TERM worked, not the SIGKILL
    assert (td / "out").read_text() == ""


def test_request_stop_kills_job_that_ignores_term(tasks: Tasks) -> None:
    ready = tasks.root / "ready"
    job = tasks.script(f"trap '' TERM\ntouch {ready}\nwhile :; do sleep 0.1; done\n")
    td = tasks.launch(job, kill_grace_s=0.5)
    wait_for(ready.exists, "job ready")
    assert request_stop(td) is True
    result = tasks.wait_exited(td)
    assert result["cancelled"] is True
    assert result["signal"] == signal.SIGKILL


# -- checkpoint, then stop --------------------------------------------------------------------


def _stamps(path: Path) -> dict[str, list[float]]:
    """``word EPOCHREALTIME`` lines written by a job's traps, grouped by word."""
    out: dict[str, list[float]] = {}
    for line in read_text(path).splitlines():
        word, _, stamp = line.partition(" ")
        out.setdefault(word, []).append(float(stamp) if stamp else 0.0)
    return out


def _checkpointing_job(tasks: Tasks, marker: Path, *, exits: bool, term: str = "dies") -> Path:
    """A job that logs USR1 (and exits 0 if ``exits``) and logs TERM, then ignores or dies."""
    on_usr1 = "; exit 0" if exits else ""
    on_term = "" if term == "ignores" else "; exit 143"
    return tasks.script(
        f"trap 'echo \"usr1 $EPOCHREALTIME\" >> {marker}{on_usr1}' USR1\n"
        f"trap 'echo \"term $EPOCHREALTIME\" >> {marker}{on_term}' TERM\n"
        f"echo ready >> {marker}\n"
        "while :; do sleep 0.05; done\n"
    )


def test_checkpoint_stop_lets_the_job_save_and_exit(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    saved = tasks.root / "saved"
    job = tasks.script(
        f"trap 'echo checkpointed > {saved}; exit 0' USR1\n"
        f"trap 'echo term >> {marker}' TERM\n"
        f"echo ready >> {marker}\n"
        "while :; do sleep 0.05; done\n"
    )
    td = tasks.launch(job)
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=10, reason="drain")
    request = json.loads((td / "stop.json").read_text())
    assert request["checkpoint_signal"] == signal.SIGUSR1
    assert request["checkpoint_grace"] == 10.0 and request["reason"] == "drain"
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0 and result["signal"] is None
    assert result["stop_requested"] is True and result["stop_reason"] == "drain"
    assert result["cancelled"] is True and result["timed_out"] is False
    sent = result["checkpoint_signal_sent_at"]
    assert result["started_at"] <= sent <= result["ended_at"]
    assert result["ended_at"] - sent < 10.0  # exited by itself, long before the grace ran out
    assert read_text(saved) == "checkpointed\n"
    assert "term" not in read_text(marker)  # never sent SIGTERM


@pytest.mark.parametrize("term", ["dies", "ignores"])
def test_checkpoint_stop_grace_then_term_then_kill(tasks: Tasks, term: str) -> None:
    marker = tasks.root / "marker"
    td = tasks.launch(_checkpointing_job(tasks, marker, exits=False, term=term), kill_grace_s=1.0)
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=1.0)
    result = tasks.wait_exited(td)
    assert result["cancelled"] is True and result["stop_requested"] is True
    assert result["stop_reason"] is None
    assert result["signal"] == (signal.SIGKILL if term == "ignores" else None)
    assert result["exit_code"] == (None if term == "ignores" else 143)
    stamps = _stamps(marker)
    sent = result["checkpoint_signal_sent_at"]
    assert len(stamps["usr1"]) == 1 and len(stamps["term"]) == 1
    assert sent <= stamps["usr1"][0] <= stamps["term"][0]
    assert stamps["term"][0] - sent >= 0.9  # SIGTERM only after the checkpoint grace
    elapsed = result["ended_at"] - sent
    if term == "ignores":
        assert elapsed >= 1.9  # then SIGKILL after kill_grace_s
    assert elapsed < 1.0 + 1.0 + 15.0


@pytest.mark.parametrize("batch_only", [True, False])
def test_checkpoint_signal_batch_only_reaches_main_process_only(
    tasks: Tasks, batch_only: bool
) -> None:
    """The child dies on USR1 (default action) but logs SIGTERM: it only logs if it got none."""
    marker = tasks.root / "marker"
    job = tasks.script(
        f"( trap 'echo child-term >> {marker}; exit 0' TERM\n"
        f"  echo ready-child >> {marker}\n"
        "  while :; do sleep 0.05; done ) &\n"
        f"trap 'echo main-usr1 >> {marker}' USR1\n"
        f"echo ready-main >> {marker}\n"
        "while :; do sleep 0.05; done\n"
    )
    td = tasks.launch(
        job,
        kill_grace_s=5.0,
        signal={"signum": int(signal.SIGUSR1), "before_s": 0, "batch_only": batch_only},
    )
    wait_for(lambda: {"ready-main", "ready-child"} <= set(read_text(marker).split()), "ready")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=1.0)
    result = tasks.wait_exited(td)
    assert result["cancelled"] is True and result["signal"] == signal.SIGTERM
    lines = read_text(marker).split()
    assert "main-usr1" in lines
    assert ("child-term" in lines) is batch_only


def test_checkpoint_stop_is_idempotent_and_keeps_its_grace(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    td = tasks.launch(_checkpointing_job(tasks, marker, exits=False))
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=2.0, reason="a")
    wait_for(lambda: "usr1" in _stamps(marker), "checkpoint signal")
    # Neither a repeat with a longer grace nor a plain request restarts or ends the grace.
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=60.0, reason="b")
    assert request_stop(td) is True
    result = tasks.wait_exited(td)
    assert json.loads((td / "stop.json").read_text())["reason"] == "a"  # the first one won
    assert result["stop_reason"] == "a" and result["exit_code"] == 143
    stamps = _stamps(marker)
    sent = result["checkpoint_signal_sent_at"]
    assert len(stamps["usr1"]) == 1 and len(stamps["term"]) == 1
    assert 1.9 <= stamps["term"][0] - sent < 30.0
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=1.0) is False


def test_checkpoint_signal_without_handler_ends_the_job(tasks: Tasks) -> None:
    ready = tasks.root / "ready"
    td = tasks.launch(tasks.script(f"touch {ready}\nwhile :; do sleep 0.05; done\n"))
    wait_for(ready.exists, "job ready")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR2, checkpoint_grace=30.0)
    result = tasks.wait_exited(td)
    assert result["signal"] == signal.SIGUSR2
    assert result["cancelled"] is True and result["checkpoint_signal_sent_at"] is not None
    assert result["ended_at"] - result["checkpoint_signal_sent_at"] < 30.0


def test_checkpoint_signal_resumes_a_stopped_job(tasks: Tasks) -> None:
    saved = tasks.root / "saved"
    job = tasks.script(
        f"trap 'echo checkpointed > {saved}; exit 0' USR1\nkill -STOP $$\n"
        "while :; do sleep 0.05; done\n"
    )
    td = tasks.launch(job, kill_grace_s=30.0)
    job_pid = tasks.wait_state(td, "running")["job_pid"]
    wait_for(lambda: proc_state(job_pid) == "T", "job to stop itself")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=30.0)
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0
    assert result["ended_at"] - result["checkpoint_signal_sent_at"] < 30.0
    assert read_text(saved) == "checkpointed\n"


def test_stop_reason_without_checkpoint_is_a_plain_stop(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    td = tasks.launch(_checkpointing_job(tasks, marker, exits=False))
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, reason="health check failed") is True
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 143 and result["cancelled"] is True
    assert result["stop_reason"] == "health check failed"
    assert result["checkpoint_signal_sent_at"] is None
    assert "usr1" not in _stamps(marker)


def test_time_limit_during_checkpoint_grace_wins(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    td = tasks.launch(_checkpointing_job(tasks, marker, exits=False), time_limit_s=5.0)
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=60.0)
    result = tasks.wait_exited(td)
    assert result["timed_out"] is True and result["cancelled"] is False
    assert result["stop_requested"] is True
    assert result["ended_at"] - result["started_at"] < 30.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"checkpoint_signal": 0}, "signal"),
        ({"checkpoint_signal": 4096}, "signal"),
        ({"checkpoint_signal": signal.SIGUSR1, "checkpoint_grace": -1}, "grace"),
        ({"checkpoint_signal": signal.SIGUSR1, "checkpoint_grace": float("nan")}, "grace"),
    ],
)
def test_request_stop_rejects_invalid_checkpoint(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        request_stop(tmp_path, **kwargs)


# -- detachment -------------------------------------------------------------------------------


def test_shepherd_is_detached_in_its_own_session(tasks: Tasks) -> None:
    go = tasks.root / "go"
    td = tasks.launch(tasks.script(f"while [ ! -e {go} ]; do sleep 0.05; done\n"))
    status = tasks.wait_state(td, "running")
    pid = status["shepherd_pid"]
    assert os.getsid(pid) != os.getsid(0)
    assert os.getpgid(pid) != os.getpgid(0)
    with pytest.raises(ChildProcessError):  # not our child: launch reaped the intermediate
        os.waitpid(pid, os.WNOHANG)
    assert not _zombie_children(), "launch left an unreaped child behind"
    job_pid = status["job_pid"]
    assert os.getsid(job_pid) == job_pid == os.getpgid(job_pid) == status["pgid"]
    go.touch()
    assert tasks.wait_exited(td)["exit_code"] == 0


def _zombie_children() -> list[int]:
    zombies = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                data = Path(f"/proc/{name}/stat").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                continue
            fields = data[data.rfind(b")") + 2 :].split()
            if fields[0] == b"Z" and int(fields[1]) == os.getpid():
                zombies.append(int(name))
    return zombies


def test_shepherd_survives_sigkill_of_launching_process(tasks: Tasks) -> None:
    go = tasks.root / "go"
    td = tasks.task(tasks.script(f"while [ ! -e {go} ]; do sleep 0.05; done\necho done\n"))
    code = (
        "import sys, time\n"
        "from phalanx.agent.shepherd_launch import launch\n"
        "print(launch(sys.argv[1]), flush=True)\n"
        "time.sleep(1000)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, str(td)], stdout=subprocess.PIPE, env=env
    )
    tasks.popens.append(launcher)
    assert launcher.stdout is not None
    shepherd_pid = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    assert not proc_dead(shepherd_pid)
    tasks.wait_state(td, "running")
    go.touch()
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0
    assert (td / "out").read_text() == "done\n"


# -- launch failures --------------------------------------------------------------------------


def _assert_launch_failed(result: dict[str, Any]) -> None:
    assert result["launch_failed"] is True
    assert result["exit_code"] is None and result["signal"] is None
    assert result["started_at"] is None


def test_missing_script_is_a_launch_failure(tasks: Tasks) -> None:
    missing = tasks.root / "nope.sh"
    td = tasks.launch(missing)
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert result["error"] == f"cannot execute {missing}: No such file or directory"
    assert result["error"] in (td / "err").read_text()  # also where the user looks
    # and in the shepherd's own log, made for its first line
    assert f"launch failed: cannot execute {missing}" in (td / shepherd_files.LOG_FILE).read_text()


def test_a_shepherd_with_nothing_to_say_makes_no_log(tasks: Tasks) -> None:
    td = tasks.launch(["/bin/true"])
    assert tasks.wait_exited(td)["exit_code"] == 0
    assert not (td / shepherd_files.LOG_FILE).exists()


def test_non_executable_script_is_a_launch_failure(tasks: Tasks) -> None:
    job = tasks.script("echo hi\n")
    job.chmod(0o644)
    result = tasks.wait_exited(tasks.launch(job))
    _assert_launch_failed(result)
    assert result["error"] == f"cannot execute {job}: Permission denied"


def test_missing_output_directory_is_a_launch_failure(tasks: Tasks) -> None:
    out = tasks.root / "no-such-dir" / "x.out"
    td = tasks.launch(tasks.script("echo hi\n"), stdout=str(out), stderr=None)
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert result["error"] == f"cannot open output file {out}: No such file or directory"


def test_missing_stderr_directory_reports_on_stdout(tasks: Tasks) -> None:
    err = tasks.root / "no-such-dir" / "x.err"
    td = tasks.launch(tasks.script("echo hi\n"), stderr=str(err))
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert result["error"] == f"cannot open output file {err}: No such file or directory"
    assert result["error"] in (td / "out").read_text()


def test_missing_cwd_is_a_launch_failure(tasks: Tasks) -> None:
    cwd = tasks.root / "gone"
    result = tasks.wait_exited(tasks.launch(tasks.script("echo hi\n"), cwd=str(cwd)))
    _assert_launch_failed(result)
    assert result["error"] == f"cannot change directory to {cwd}: No such file or directory"


def test_missing_spec_still_yields_exit_record(tasks: Tasks) -> None:
    td = tasks.root / "empty-task"
    td.mkdir()
    tasks.task_dirs.append(td)
    launch(td)
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert "spec.json" in result["error"]


def test_launch_raises_when_task_dir_is_unusable(tmp_path: Path) -> None:
    with pytest.raises(shepherd_launch.ShepherdLaunchError, match="cannot set up shepherd"):
        launch(tmp_path / "does-not-exist")


# -- job end, fencing, status -----------------------------------------------------------------


def test_stragglers_are_killed_when_main_process_exits(tasks: Tasks) -> None:
    pids = tasks.root / "pids"
    job = tasks.script(
        f"sleep 1000 &\necho $! >> {pids}\n"
        f"( trap '' TERM; exec sleep 1000 ) &\necho $! >> {pids}\n"
        "exit 0\n"
    )
    td = tasks.launch(job, kill_grace_s=1.0)
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0
    straggler_pids = [int(p) for p in pids.read_text().split()]
    assert len(straggler_pids) == 2
    for pid in straggler_pids:
        wait_for(partial(proc_dead, pid), f"straggler {pid} to die")


def test_stale_heartbeat_fences_running_job(tasks: Tasks) -> None:
    heartbeat = tasks.root / "heartbeat"
    heartbeat.touch()
    td = tasks.launch(
        tasks.script("sleep 1000\n"),
        fence={"heartbeat_file": str(heartbeat), "timeout_s": 1.0},
    )
    result = tasks.wait_exited(td)  # nobody refreshes the heartbeat
    assert result["fenced"] is True
    assert result["cancelled"] is False and result["timed_out"] is False
    assert result["started_at"] is not None
    assert result["signal"] == signal.SIGTERM


def test_stale_heartbeat_at_launch_does_not_start_job(tasks: Tasks) -> None:
    heartbeat = tasks.root / "heartbeat"
    heartbeat.touch()
    old = time.time() - 600
    os.utime(heartbeat, (old, old))
    marker = tasks.root / "ran"
    td = tasks.launch(
        tasks.script(f"touch {marker}\n"),
        fence={"heartbeat_file": str(heartbeat), "timeout_s": 30.0},
    )
    result = tasks.wait_exited(td)
    assert result["fenced"] is True
    assert result["started_at"] is None
    assert not marker.exists()


def test_fencing_uses_its_own_short_kill_grace(tasks: Tasks) -> None:
    """A fenced job that ignores SIGTERM dies after fence kill_grace_s, not the long kill grace:
    it must be gone before the controller may requeue it elsewhere."""
    heartbeat = tasks.root / "heartbeat"
    heartbeat.touch()
    ready = tasks.root / "ready"
    td = tasks.launch(
        tasks.script(f"trap '' TERM\ntouch {ready}\nwhile :; do sleep 0.1; done\n"),
        kill_grace_s=600.0,
        fence={"heartbeat_file": str(heartbeat), "timeout_s": 1.0, "kill_grace_s": 0.5},
    )
    wait_for(ready.exists, "job ready")
    result = tasks.wait_exited(td)  # well before the 600 s kill grace
    assert result["fenced"] is True
    assert result["signal"] == signal.SIGKILL


def test_fence_shortens_the_grace_of_a_job_already_stopping(tasks: Tasks) -> None:
    heartbeat = tasks.root / "heartbeat"
    heartbeat.touch()
    ready = tasks.root / "ready"
    td = tasks.launch(
        tasks.script(f"trap '' TERM\ntouch {ready}\nwhile :; do sleep 0.1; done\n"),
        kill_grace_s=600.0,
        fence={"heartbeat_file": str(heartbeat), "timeout_s": 2.0, "kill_grace_s": 0.5},
    )
    wait_for(ready.exists, "job ready")
    assert request_stop(td) is True  # a cancel with a 600 s grace; then the agent goes silent
    result = tasks.wait_exited(td)
    assert result["cancelled"] is True
    assert result["signal"] == signal.SIGKILL


def test_fresh_heartbeat_does_not_fence(tasks: Tasks) -> None:
    heartbeat = tasks.root / "heartbeat"
    heartbeat.touch()
    td = tasks.launch(
        tasks.script("echo ok\n"),
        fence={"heartbeat_file": str(heartbeat), "timeout_s": 60.0},
    )
    result = tasks.wait_exited(td)
    assert result["fenced"] is False
    assert result["exit_code"] == 0


def test_status_lost_when_shepherd_killed_without_exit_record(tasks: Tasks) -> None:
    td = tasks.launch(tasks.script("sleep 1000\n"))
    pid = tasks.wait_state(td, "running")["shepherd_pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: proc_dead(pid), "shepherd to die")
    status = read_status(td)
    assert status["state"] == "lost"
    assert str(pid) in status["reason"]
    assert request_stop(td) is False
    assert forward_signal(td, signal.SIGUSR1) is False


def test_status_absent_for_empty_task_dir(tmp_path: Path) -> None:
    assert read_status(tmp_path) == {"state": "absent"}
    assert request_stop(tmp_path) is False
    assert forward_signal(tmp_path, signal.SIGUSR1) is False


def test_reused_pid_is_not_mistaken_for_shepherd(tasks: Tasks, tmp_path: Path) -> None:
    """A live process with the recorded pid but another start time must not be signalled."""
    sleeper = subprocess.Popen(["sleep", "1000"])
    tasks.popens.append(sleeper)
    stat = Path(f"/proc/{sleeper.pid}/stat").read_bytes()
    starttime = int(stat[stat.rfind(b")") + 2 :].split()[19])
    (tmp_path / "shepherd.pid").write_text(
        json.dumps({"pid": sleeper.pid, "starttime": starttime + 1})
    )
    assert read_status(tmp_path)["state"] == "lost"
    assert request_stop(tmp_path) is False
    assert sleeper.poll() is None
    (tmp_path / "shepherd.pid").write_text(json.dumps({"pid": sleeper.pid, "starttime": starttime}))
    assert read_status(tmp_path) == {"state": "starting", "shepherd_pid": sleeper.pid}


def test_json_helpers_match_stdlib() -> None:
    value = {
        "a": [1, -2, 3.25, None, True, False, 'x\u00e9\n"q"\U0001f600'],
        "b": {"nested": []},
        "c": 1e-9,
    }
    text = shepherd_files._dumps(value)
    assert json.loads(text) == value
    assert shepherd_files._loads(json.dumps(value)) == value
    assert shepherd_files._loads("  {}\n") == {}
    with pytest.raises(ValueError):
        shepherd_files._loads("{bad")


# -- pre-forked launcher ------------------------------------------------------------------------


def proc_ppid(pid: int) -> int | None:
    """Parent pid from /proc/PID/stat (field 4), or None if the pid does not exist."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(data[data.rfind(b")") + 2 :].split()[1])


def open_pipes(pid: int) -> set[str]:
    """The ``pipe:[inode]`` entries among the process's open fds."""
    pipes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(fd_dir / fd)
            if target.startswith("pipe:"):
                pipes.add(target)
    return pipes


def helper_pid(launcher: shepherd_launch.Launcher) -> int:
    pid = launcher.pid
    assert pid is not None
    return pid


def kill_quietly(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launcher() -> Iterator[shepherd_launch.Launcher]:
    lau = shepherd_launch.Launcher()
    lau.start()
    try:
        yield lau
    finally:
        lau.close()  # also kills and reaps a helper that does not exit on EOF


def _run_and_collect(td: Path, tasks: Tasks) -> tuple[dict[str, Any], str, str]:
    result = tasks.wait_exited(td)
    return result, read_text(td / "out"), read_text(td / "err")


def test_launcher_runs_jobs_like_launch(tasks: Tasks, launcher: shepherd_launch.Launcher) -> None:
    job = tasks.script('echo "out $1"\necho "err $1" >&2\nexit 5\n')
    plain, forked = tasks.task([str(job), "x"]), tasks.task([str(job), "x"])
    assert launch(plain) > 0
    pid = launcher.launch(forked)
    assert pid == json.loads((forked / "shepherd.pid").read_text())["pid"]  # written before reply
    (r1, out1, err1), (r2, out2, err2) = (_run_and_collect(td, tasks) for td in (plain, forked))
    assert (out1, err1) == (out2, err2) == ("out x\n", "err x\n")
    strip = ("started_at", "ended_at", "usage")  # usage: measured, differs run to run
    assert {k: v for k, v in r1.items() if k not in strip} == {
        k: v for k, v in r2.items() if k not in strip
    }
    assert r2["exit_code"] == 5 and r2["launch_failed"] is False


def test_launcher_many_launches_in_a_row(tasks: Tasks, launcher: shepherd_launch.Launcher) -> None:
    job = tasks.script('echo "n=$N"\n')
    tds = [tasks.task(job, env={"PATH": JOB_PATH, "N": str(i)}) for i in range(40)]
    pids = [launcher.launch(td) for td in tds]
    assert len(set(pids)) == len(pids)
    for i, td in enumerate(tds):
        assert tasks.wait_exited(td)["exit_code"] == 0
        assert (td / "out").read_text() == f"n={i}\n"
    assert proc_state(helper_pid(launcher)) not in (None, "Z")  # one helper did all of it
    assert not _zombie_children()


def test_launcher_is_thread_safe(tasks: Tasks, launcher: shepherd_launch.Launcher) -> None:
    import threading

    job = tasks.script('echo "n=$N"\n')
    tds = [tasks.task(job, env={"PATH": JOB_PATH, "N": str(i)}) for i in range(30)]
    pids: dict[Path, int] = {}
    errors: list[BaseException] = []

    def worker(mine: list[Path]) -> None:
        try:
            for td in mine:
                pids[td] = launcher.launch(td)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(tds[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors and len(pids) == len(tds)
    for td, pid in pids.items():
        assert json.loads((td / "shepherd.pid").read_text())["pid"] == pid
    for i, td in enumerate(tds):
        assert tasks.wait_exited(td)["exit_code"] == 0
        assert (td / "out").read_text() == f"n={i}\n"


def test_launcher_shepherd_is_detached_and_holds_no_helper_pipe(
    tasks: Tasks, launcher: shepherd_launch.Launcher
) -> None:
    go = tasks.root / "go"
    td = tasks.task(tasks.script(f"while [ ! -e {go} ]; do sleep 0.05; done\n"))
    pid = launcher.launch(td)
    helper = helper_pid(launcher)
    status = tasks.wait_state(td, "running")
    assert status["shepherd_pid"] == pid
    assert proc_ppid(pid) not in (helper, os.getpid(), None)
    assert os.getsid(pid) == pid != os.getsid(helper)  # own session, not the helper's
    assert os.getsid(helper) != os.getsid(0)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    helper_pipes = open_pipes(helper)
    assert len(helper_pipes) >= 2  # its stdin and stdout to us
    assert not helper_pipes & open_pipes(pid)
    assert not helper_pipes & open_pipes(status["job_pid"])
    go.touch()
    assert tasks.wait_exited(td)["exit_code"] == 0


def test_launching_a_task_twice_runs_it_once(
    tasks: Tasks, launcher: shepherd_launch.Launcher
) -> None:
    """Idempotent launch is what makes retrying after a helper died mid-request safe."""
    go = tasks.root / "go"
    marker = tasks.root / "runs"
    td = tasks.task(
        tasks.script(f"echo run >> {marker}\nwhile [ ! -e {go} ]; do sleep 0.05; done\n")
    )
    pid = launcher.launch(td)
    assert launcher.launch(td) == pid
    assert launch(td) == pid
    tasks.wait_state(td, "running")
    go.touch()
    assert tasks.wait_exited(td)["exit_code"] == 0
    assert read_text(marker) == "run\n"


def test_launcher_reports_task_errors_and_keeps_its_helper(
    tasks: Tasks, launcher: shepherd_launch.Launcher
) -> None:
    helper = helper_pid(launcher)
    with pytest.raises(shepherd_launch.ShepherdLaunchError, match="cannot set up shepherd"):
        launcher.launch(tasks.root / "does-not-exist")
    assert launcher.pid == helper
    td = tasks.task(tasks.script("exit 0\n"))
    launcher.launch(td)
    assert tasks.wait_exited(td)["exit_code"] == 0
    assert launcher.pid == helper


def test_shepherd_survives_helper_sigkill_and_launcher_restarts(
    tasks: Tasks, launcher: shepherd_launch.Launcher
) -> None:
    go = tasks.root / "go"
    job = tasks.script(f"while [ ! -e {go} ]; do sleep 0.05; done\necho done\n")
    first = tasks.task(job)
    pid = launcher.launch(first)
    old_helper = helper_pid(launcher)
    os.kill(old_helper, signal.SIGKILL)
    wait_for(lambda: proc_dead(old_helper), "helper to die")
    assert not proc_dead(pid)
    second = tasks.task(job)
    started = time.monotonic()
    assert launcher.launch(second) > 0
    # A dead helper is noticed at once (nothing holds its pipes), not after the reply timeout.
    assert time.monotonic() - started < shepherd_launch._LAUNCHER_REPLY_TIMEOUT_S / 2
    assert launcher.pid not in (None, old_helper)
    tasks.wait_state(first, "running")
    go.touch()
    for td in (first, second):
        result = tasks.wait_exited(td)
        assert result["exit_code"] == 0
        assert (td / "out").read_text() == "done\n"


def test_launcher_times_out_on_a_hung_helper_then_recovers(tasks: Tasks) -> None:
    lau = shepherd_launch.Launcher(reply_timeout=1.0)
    lau.start()
    hung = helper_pid(lau)
    try:
        os.kill(hung, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(shepherd_launch.ShepherdLaunchError, match="did not answer"):
            lau.launch(tasks.task(tasks.script("exit 0\n")))
        assert time.monotonic() - started < 5.0
        assert proc_state(hung) is None  # killed and reaped
        td = tasks.task(tasks.script("exit 4\n"))
        lau.launch(td)
        assert tasks.wait_exited(td)["exit_code"] == 4
    finally:
        kill_quietly(hung if proc_state(hung) not in (None, "Z") else None)
        lau.close()


class _DeadOnArrivalLauncher(shepherd_launch.Launcher):
    """A launcher whose helper is a real process that exits at once (a broken interpreter)."""

    starts = 0

    def _restart_locked(self) -> None:
        self._discard_locked()
        self.starts += 1
        self._proc = subprocess.Popen(
            ["/bin/sh", "-c", "exit 1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        self._proc.wait()


def test_launcher_falls_back_to_plain_launch(tasks: Tasks) -> None:
    lau = _DeadOnArrivalLauncher()
    try:
        td = tasks.task(tasks.script("echo fallback\n"))
        assert lau.launch(td) > 0
        assert lau.starts == 2  # restarted once, then launched without it
        assert tasks.wait_exited(td)["exit_code"] == 0
        assert (td / "out").read_text() == "fallback\n"
        td = tasks.task(tasks.script("exit 0\n"))
        lau.launch(td)
        assert lau.starts == 2  # backing off: no new helper for a while
        assert tasks.wait_exited(td)["exit_code"] == 0
    finally:
        lau.close()


def test_launcher_helper_exits_when_closed(tasks: Tasks) -> None:
    lau = shepherd_launch.Launcher()
    lau.start()
    helper = helper_pid(lau)
    try:
        go = tasks.root / "go"
        td = tasks.task(tasks.script(f"while [ ! -e {go} ]; do sleep 0.05; done\n"))
        pid = lau.launch(td)
        started = time.monotonic()
        lau.close()
        assert (
            time.monotonic() - started < shepherd_launch._LAUNCHER_CLOSE_TIMEOUT_S
        )  # exited on EOF
        assert proc_state(helper) is None and lau.pid is None
        assert not proc_dead(pid)  # its shepherd keeps running
        td2 = tasks.task(tasks.script("exit 0\n"))
        lau.launch(td2)  # after close: plain launch, no new helper
        assert lau.pid is None
        go.touch()
        for t in (td, td2):
            assert tasks.wait_exited(t)["exit_code"] == 0
    finally:
        kill_quietly(helper if proc_state(helper) not in (None, "Z") else None)
        lau.close()


def test_launcher_helper_exits_when_its_owner_dies(tasks: Tasks) -> None:
    go = tasks.root / "go"
    td = tasks.task(tasks.script(f"while [ ! -e {go} ]; do sleep 0.05; done\necho done\n"))
    code = (
        "import sys, time\n"
        "from phalanx.agent.shepherd_launch import Launcher\n"
        "lau = Launcher()\n"
        "print(lau.launch(sys.argv[1]), lau.pid, flush=True)\n"
        "time.sleep(1000)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    owner = subprocess.Popen([sys.executable, "-c", code, str(td)], stdout=subprocess.PIPE, env=env)
    tasks.popens.append(owner)
    helper = None
    try:
        assert owner.stdout is not None
        shepherd_pid, helper = map(int, owner.stdout.readline().split())
        owner.kill()
        owner.wait()
        wait_for(lambda: proc_dead(helper), "helper to exit on EOF")
        assert not proc_dead(shepherd_pid)
        go.touch()
        result = tasks.wait_exited(td)
        assert result["exit_code"] == 0
        assert (td / "out").read_text() == "done\n"
    finally:
        kill_quietly(helper if helper and not proc_dead(helper) else None)


# -- running as the job's user (spec "user") ------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A world-writable (1777) directory outside pytest's 0700 tmp_path, removed afterwards."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="phx-shep-", dir="/tmp"))
    try:
        d.chmod(0o1777)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _nobody() -> Any:
    import pwd

    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here")


@needs_root
def test_job_runs_as_its_user_with_its_groups_and_home(tasks: Tasks, shared_dir: Path) -> None:
    pw = _nobody()
    out = shared_dir / "out"
    td = tasks.launch(
        ["/bin/sh", "-c", 'id -u; id -g; id -G; echo "$USER $LOGNAME $HOME"; echo x > mine'],
        user="nobody",
        cwd=str(shared_dir),
        stdout=str(out),
        stderr=None,
    )
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0, (result, read_text(out))
    lines = out.read_text().splitlines()
    assert lines[:2] == [str(pw.pw_uid), str(pw.pw_gid)]
    assert sorted(map(int, lines[2].split())) == sorted(os.getgrouplist("nobody", pw.pw_gid))
    assert lines[3] == f"nobody nobody {pw.pw_dir}"
    assert out.stat().st_uid == pw.pw_uid, "the output file is opened as the user"
    assert (shared_dir / "mine").stat().st_uid == pw.pw_uid


def test_unknown_user_is_a_job_error(tasks: Tasks) -> None:
    td = tasks.launch(["/bin/true"], user="phx-no-such-user", node="node07")
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert result["job_error"] is True
    assert result["error"] == "user phx-no-such-user is unknown on node07"


@needs_root
def test_output_the_user_may_not_write_is_a_job_error_and_untouched(tasks: Tasks) -> None:
    _nobody()
    before = Path("/etc/passwd").read_bytes()
    td = tasks.launch(["/bin/echo", "pwned"], user="nobody", stdout="/etc/passwd", stderr=None)
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert result["job_error"] is True
    assert result["error"] == "cannot open output file /etc/passwd: Permission denied"
    assert Path("/etc/passwd").read_bytes() == before


@needs_root
def test_workdir_the_user_may_not_enter_is_a_job_error(tasks: Tasks, shared_dir: Path) -> None:
    _nobody()
    private = tasks.root / "private"
    private.mkdir(mode=0o700)
    td = tasks.launch(
        ["/bin/true"], user="nobody", cwd=str(private), stdout=str(shared_dir / "o"), stderr=None
    )
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert result["job_error"] is True
    assert result["error"] == f"cannot change directory to {private}: Permission denied"


def test_missing_directory_stays_a_plain_launch_failure(tasks: Tasks) -> None:
    td = tasks.launch(["/bin/true"], cwd=str(tasks.root / "gone"))
    result = tasks.wait_exited(td)
    _assert_launch_failed(result)
    assert "job_error" not in result, "a missing directory may be the node's (a mount)"


def test_cpu_affinity_from_the_spec(tasks: Tasks) -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    td = tasks.launch(
        ["/bin/sh", "-c", "nproc; grep Cpus_allowed_list /proc/self/status"], cpus=[cpu]
    )
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0
    lines = (td / "out").read_text().splitlines()
    assert lines[0] == "1" and lines[1].split()[-1] == str(cpu)


def test_checkpoint_stop_grace_ends_when_the_job_reports_its_checkpoint(tasks: Tasks) -> None:
    """A job that saves on the signal and runs on: its grace ends at its checkpoint marker
    (preemption, drains: work after the checkpoint would be lost anyway), not after 30 s."""
    marker = tasks.root / "marker"
    job = tasks.script(
        'trap \'echo /ck/state > "$PHX_CHECKPOINT_MARKER"; echo usr1 >> "$MARK"\' USR1\n'
        'echo ready >> "$MARK"\n'
        "while :; do sleep 0.05; done\n"
    )
    env = {"PATH": JOB_PATH, "MARK": str(marker)}
    env.update(checkpoint_requests.control_environment(tasks.root / f"task{tasks._n + 1}"))
    td = tasks.launch(job, kill_grace_s=1.0, env=env)
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, checkpoint_signal=signal.SIGUSR1, checkpoint_grace=30.0, reason="x")
    result = tasks.wait_exited(td)
    assert "usr1" in read_text(marker)
    assert result["cancelled"] is True and result["stop_requested"] is True
    assert result["ended_at"] - result["checkpoint_signal_sent_at"] < 15.0
    request = json.loads((td / "control" / "checkpoint-request.json").read_text())
    assert request["kind"] == "stop" and request["stop"] is True


def test_request_kind_names_a_preemption() -> None:
    from phalanx.agent.checkpoint_requests import request_kind

    assert request_kind("requeue: preempted by job 12 (tier 1 over tier 0)", True) == "preempted"
    assert request_kind("cancel: preempted by job 3 (tier 2 over tier 1)", True) == "preempted"
    assert request_kind("requeue: node n1 drained by alice: PSU", True) == "requeue"
    assert request_kind("time limit", True) == "time limit"
    # its reservation ended: it ends TIMEOUT, as at its time limit
    assert request_kind("timeout: Reservation r1, which this job ...", True) == "time limit"
    assert request_kind("interval", False) == "interval"
    assert request_kind("drain", True) == "stop"


# -- planned stops that reach steps (a holder, --signal=B:) -----------------------------------


def test_a_wait_stop_gives_the_grace_without_a_signal(tasks: Tasks) -> None:
    """`--signal=B:`: a step task gets the planned stop's grace but not its signal (the batch
    shell forwards it); it runs on, and exits by itself, before any SIGTERM."""
    marker = tasks.root / "marker"
    done = tasks.root / "done"
    job = tasks.script(
        f"trap 'echo usr1 >> {marker}' USR1\n"
        f"trap 'echo term >> {marker}; exit 143' TERM\n"
        f"echo ready >> {marker}\n"
        f"while [ ! -e {done} ]; do sleep 0.05; done\n"
    )
    td = tasks.launch(job)
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, checkpoint_grace=30.0, reason="requeue: drained", wait=True)
    wait_for(lambda: "waiting up to 30s" in read_text(td / "shepherd.log"), "the grace to begin")
    assert read_status(td)["state"] == "running"
    done.touch()  # the job saves and ends by itself
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 0 and result["stop_reason"] == "requeue: drained"
    assert result["cancelled"] is True
    assert read_text(marker).split() == ["ready"]  # neither USR1 nor TERM


def test_a_wait_stop_ends_in_term_when_the_grace_runs_out(tasks: Tasks) -> None:
    marker = tasks.root / "marker"
    td = tasks.launch(_checkpointing_job(tasks, marker, exits=False))
    wait_for(lambda: "ready" in read_text(marker), "job ready")
    assert request_stop(td, checkpoint_grace=1.0, wait=True)
    result = tasks.wait_exited(td)
    assert result["exit_code"] == 143
    stamps = _stamps(marker)
    assert "usr1" not in stamps and len(stamps["term"]) == 1


def _step_dir(steps_dir: Path, attempt: int, task: int) -> Path:
    """A step task directory as agent/steps.py makes them, with a live 'shepherd' (this
    test process: alive, and never the job)."""
    d = steps_dir / f"{attempt}.0.{task}"
    d.mkdir(parents=True)
    st = shepherd_files._proc_stat("self")
    assert st is not None
    (d / shepherd_files.PID_FILE).write_text(json.dumps({"pid": os.getpid(), "starttime": st[2]}))
    return d


def test_a_holder_stops_once_the_steps_on_its_node_have_ended(tasks: Tasks) -> None:
    """A holder keeps the job's cgroup on its node while step tasks (ranks still writing a
    checkpoint) run in it: it stops when they have ended, not when the stop arrives."""
    steps_dir = tasks.root / "steps"
    holder = ["/bin/sh", "-c", "trap '' HUP USR1 USR2 ALRM URG; exec sleep infinity"]
    td = tasks.task(holder, holder=True, steps_dir=str(steps_dir))
    rank = _step_dir(steps_dir, int(json.loads((td / "spec.json").read_text())["attempt_id"]), 1)
    launch(td)
    tasks.wait_state(td, "running")
    assert request_stop(td, checkpoint_grace=60.0, reason="requeue: drained", wait=True)
    wait_for(
        lambda: "for the job's steps here" in read_text(td / "shepherd.log"), "the holder to wait"
    )
    # the holder's checkpoint request tells ranks on its node that poll rather than trap
    request = checkpoint_requests.read_checkpoint_request(td)
    assert request is not None and request["stop"] is True
    assert read_status(td)["state"] == "running"
    (rank / shepherd_files.EXIT_FILE).write_text("{}")  # the rank saved and exited
    result = tasks.wait_exited(td)
    assert result["cancelled"] is True and result["ended_at"] - result["started_at"] < 60.0
    assert "steps on this node have ended" in read_text(td / "shepherd.log")


def test_a_holder_with_no_steps_stops_at_once(tasks: Tasks) -> None:
    holder = ["/bin/sh", "-c", "trap '' HUP USR1 USR2 ALRM URG; exec sleep infinity"]
    td = tasks.launch(holder, holder=True, steps_dir=str(tasks.root / "steps"))
    tasks.wait_state(td, "running")
    asked = time.time()
    assert request_stop(td, checkpoint_grace=60.0, wait=True)
    result = tasks.wait_exited(td)
    assert result["ended_at"] - asked < 15.0  # not the 60 s grace
