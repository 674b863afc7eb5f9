"""The job-side helper (`phalanx.job`): request detection, reports, atomic saves, resume.

Real files and real signals; the environment a shepherd gives a job is set up per test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import job

SRC_DIR = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A control dir and checkpoint dir as the agent sets them up, and a fresh helper state."""
    ctl = tmp_path / "control"
    ctl.mkdir()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    monkeypatch.setenv("PHX_CONTROL_DIR", str(ctl))
    monkeypatch.setenv("PHX_CHECKPOINT_REQUEST", str(ctl / "checkpoint-request.json"))
    monkeypatch.setenv("PHX_CHECKPOINT_MARKER", str(ctl / "checkpoint.json"))
    monkeypatch.setenv("PHX_PROGRESS_FILE", str(ctl / "progress.json"))
    monkeypatch.setenv("PHX_CHECKPOINT_DIR", str(ck))
    monkeypatch.setenv("PHX_CHECKPOINT_SIGNAL", "USR1")
    monkeypatch.setenv("PHX_RESTART_COUNT", "2")
    monkeypatch.setattr(job, "_state", job._State())
    yield ctl


def _request(
    ctl: Path, seq: int, *, stop: bool = False, reason: str = "interval", age: float = 0.0
) -> None:
    """Write a request the way the node side does (atomic replace, new mtime), made ``age``
    seconds ago."""
    at = time.time() - age
    data = {"seq": seq, "reason": reason, "requested_at": at, "deadline": None}
    data["stop"] = stop
    tmp = ctl / "req.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, ctl / "checkpoint-request.json")


def test_no_request_until_the_node_side_writes_one(control: Path) -> None:
    assert job.checkpoint_requested() is False
    assert job.checkpoint_request() is None
    _request(control, 1)
    assert job.checkpoint_requested() is True
    req = job.checkpoint_request()
    assert req is not None and req["seq"] == 1 and req["reason"] == "interval"
    assert job.stop_requested() is False


def test_report_checkpoint_answers_the_request_and_writes_the_marker(
    control: Path, tmp_path: Path
) -> None:
    _request(control, 3, stop=True, reason="requeue: node drained")
    assert job.stop_requested() is True
    assert job.checkpoint_requested() is True  # seen: the next report answers it
    path = job.save_atomic(tmp_path / "ckpt" / "step-10.bin", b"weights")
    assert job.report_checkpoint(path) is True
    assert job.checkpoint_requested() is False  # answered
    marker = json.loads((control / "checkpoint.json").read_text())
    assert marker["path"] == str(path)
    assert marker["request_seq"] == 3
    assert marker["duration_s"] is not None and marker["duration_s"] >= 0  # from save_atomic
    assert abs(marker["finished_at"] - time.time()) < 60
    # a newer request is pending again
    _request(control, 4)
    assert job.checkpoint_requested() is True


def test_a_request_that_arrives_during_a_save_stays_pending(control: Path, tmp_path: Path) -> None:
    _request(control, 1)
    assert job.checkpoint_requested()
    _request(control, 2, stop=True)  # comes in while the job writes its checkpoint
    job.report_checkpoint(job.save_atomic(tmp_path / "ckpt" / "a", b"a"))
    assert json.loads((control / "checkpoint.json").read_text())["request_seq"] == 1
    req = job.checkpoint_request()
    assert req is not None and req["seq"] == 2  # not answered: checkpoint again
    job.report_checkpoint(job.save_atomic(tmp_path / "ckpt" / "b", b"b"))
    assert json.loads((control / "checkpoint.json").read_text())["request_seq"] == 2
    assert not job.checkpoint_requested()


def test_a_checkpoint_nobody_asked_for_answers_nothing(control: Path, tmp_path: Path) -> None:
    _request(control, 1)
    job.report_checkpoint(job.save_atomic(tmp_path / "ckpt" / "a", b"a"))  # periodic, own
    assert json.loads((control / "checkpoint.json").read_text())["request_seq"] is None
    assert job.checkpoint_requested()


def test_explicit_duration_wins(control: Path, tmp_path: Path) -> None:
    p = tmp_path / "ckpt" / "x"
    p.write_bytes(b"1")
    job.report_checkpoint(p, duration_s=12.5)
    marker = json.loads((control / "checkpoint.json").read_text())
    assert marker["duration_s"] == 12.5 and marker["request_seq"] is None


def test_signal_handler_sets_the_flag(control: Path) -> None:
    old = signal.getsignal(signal.SIGUSR1)
    try:
        assert job.install_signal_handler() == signal.SIGUSR1
        assert not job.checkpoint_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not job.checkpoint_requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.checkpoint_requested()
        assert job.checkpoint_request()["reason"] == "signal"  # type: ignore[index]
        job.report_checkpoint(control / "whatever")
        assert not job.checkpoint_requested()
    finally:
        signal.signal(signal.SIGUSR1, old)


def _signal_self_and_wait(signum: int = signal.SIGUSR1) -> None:
    before = job._state.signals
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5
    while job._state.signals == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job._state.signals > before, "the signal never reached the handler"


def test_a_requests_signal_arriving_after_its_answer_is_not_a_second_request(
    control: Path,
) -> None:
    """The node side writes the file, then signals: a job that read and answered the file
    in between must not checkpoint again for that same request's signal."""
    old = signal.getsignal(signal.SIGUSR1)
    try:
        job.install_signal_handler()
        _request(control, 1)
        assert job.checkpoint_request()["seq"] == 1  # type: ignore[index]
        job.report_checkpoint(control / "step-1")
        _signal_self_and_wait()  # request 1's own signal, late
        assert job.checkpoint_request() is None
        assert not job.checkpoint_requested()
        # the next request by file is seen as usual
        _request(control, 2)
        assert job.checkpoint_request()["seq"] == 2  # type: ignore[index]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_signal_long_after_the_last_answered_request_is_a_request(control: Path) -> None:
    old = signal.getsignal(signal.SIGUSR1)
    try:
        job.install_signal_handler()
        _request(control, 1, age=job.SIGNAL_LAG_S + 5)
        assert job.checkpoint_request()["seq"] == 1  # type: ignore[index]
        job.report_checkpoint(control / "step-1")
        _signal_self_and_wait()  # sent by hand, long after request 1
        req = job.checkpoint_request()
        assert req is not None and req["reason"] == "signal"
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_signal_name_from_the_environment(control: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHX_CHECKPOINT_SIGNAL", "SIGUSR2")
    old = signal.getsignal(signal.SIGUSR2)
    try:
        assert job.install_signal_handler() == signal.SIGUSR2
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_report_progress(control: Path) -> None:
    assert job.report_progress(41)
    rec = json.loads((control / "progress.json").read_text())
    assert rec["step"] == 41 and abs(rec["ts"] - time.time()) < 60


def test_outside_phalanx_everything_is_a_no_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (
        "PHX_CONTROL_DIR",
        "PHX_CHECKPOINT_REQUEST",
        "PHX_CHECKPOINT_MARKER",
        "PHX_PROGRESS_FILE",
        "PHX_CHECKPOINT_DIR",
        "PHX_RESTART_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(job, "_state", job._State())
    assert job.checkpoint_requested() is False
    assert job.report_progress(1) is False
    assert job.report_checkpoint(tmp_path / "x") is False
    assert job.latest_checkpoint() is None
    assert job.checkpoint_dir() is None
    assert job.restart_count() == 0


def test_save_atomic_bytes_str_and_callable(tmp_path: Path) -> None:
    a = job.save_atomic(tmp_path / "new" / "a.bin", b"\x00\x01")
    assert a.read_bytes() == b"\x00\x01"
    b = job.save_atomic(tmp_path / "b.txt", "text")
    assert b.read_text() == "text"
    c = job.save_atomic(tmp_path / "c.bin", lambda f: f.write(b"from a writer"))
    assert c.read_bytes() == b"from a writer"
    assert not [p for p in tmp_path.rglob(".*")], "temporary files left behind"


def test_save_atomic_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "ck.bin"
    job.save_atomic(target, b"old")

    def broken(f: object) -> None:
        f.write(b"half")  # type: ignore[attr-defined]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        job.save_atomic(target, broken)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["ck.bin"]


def test_latest_checkpoint_ignores_temporaries_and_prefers_the_newest(control: Path) -> None:
    ck = Path(os.environ["PHX_CHECKPOINT_DIR"])
    assert job.latest_checkpoint() is None
    first = job.save_atomic(ck / "step-1", b"1")
    os.utime(first, (time.time() - 10, time.time() - 10))
    second = job.save_atomic(ck / "step-2", b"2")
    (ck / ".step-3.tmp.1.2").write_bytes(b"torn")  # a save that died half way
    assert job.latest_checkpoint() == second
    # the reported checkpoint wins over an older file; a missing one is ignored
    job.report_checkpoint(second)
    assert job.latest_checkpoint() == second
    second.unlink()
    assert job.latest_checkpoint() == first
    # other files in the directory are not checkpoints when a pattern says what is
    (ck / "result.json").write_text("{}")
    assert job.latest_checkpoint() == ck / "result.json"
    assert job.latest_checkpoint(ck, "step-*") == first


def test_latest_checkpoint_uses_the_pointer_for_directories(control: Path) -> None:
    ck = Path(os.environ["PHX_CHECKPOINT_DIR"])
    shard_dir = ck / "step-7"
    shard_dir.mkdir()
    (shard_dir / "rank0.pt").write_bytes(b"x")
    assert job.latest_checkpoint() is None  # a directory alone is not known to be complete
    job.report_checkpoint(shard_dir)
    assert job.latest_checkpoint() == shard_dir


def test_importable_with_the_standard_library_only() -> None:
    """`python -I -S` has no site-packages: the helper must not need any."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import phalanx.job as j; "
        "print(j.checkpoint_requested(), sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('pydantic', 'sqlalchemy', 'fastapi', 'httpx')))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(SRC_DIR)],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "False []", out.stdout + out.stderr


# ---------------------------------------------------------------------- the examples
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_example(script: Path, args: list[str], env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def _digest(lines: list[str]) -> str:
    done = [x for x in lines if x.startswith("done ")]
    assert done, lines
    return done[-1].rsplit("digest=", 1)[1]


@pytest.mark.parametrize("example", ["train_pure.py", "train_torch.py"])
def test_example_stopped_on_request_resumes_to_the_same_result(
    example: str, tmp_path: Path
) -> None:
    """Outside a cluster, play the node side by hand: request a stop, then run it again."""
    if example == "train_torch.py":
        pytest.importorskip("torch", reason="torch is an optional extra ([examples])")
    script = EXAMPLES / example
    steps = "60"
    reference = _digest(
        _run_example(script, ["--steps", steps, "--checkpoint-dir", str(tmp_path / "ref")], {})
    )

    ck = tmp_path / "ck"

    def env(restart: int) -> dict[str, str]:
        ctl = tmp_path / f"control{restart}"
        ctl.mkdir()
        return {
            "PHX_CONTROL_DIR": str(ctl),
            "PHX_CHECKPOINT_REQUEST": str(ctl / "checkpoint-request.json"),
            "PHX_CHECKPOINT_MARKER": str(ctl / "checkpoint.json"),
            "PHX_PROGRESS_FILE": str(ctl / "progress.json"),
            "PHX_CHECKPOINT_DIR": str(ck),
            "PHX_CHECKPOINT_SIGNAL": "USR1",
            "PHX_RESTART_COUNT": str(restart),
        }

    first = env(0)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            "--steps",
            steps,
            "--step-time",
            "0.05",
            "--checkpoint-every",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"PATH": "/usr/bin:/bin", **first},
    )
    try:
        progress = Path(first["PHX_PROGRESS_FILE"])
        deadline = time.monotonic() + 120
        while True:
            try:
                if json.loads(progress.read_text())["step"] >= 10:
                    break
            except (OSError, ValueError):
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "no progress"
            time.sleep(0.02)
        request = {"seq": 1, "reason": "requeue: test", "requested_at": time.time()}
        request.update({"deadline": time.time() + 30, "stop": True})
        tmp = Path(first["PHX_CONTROL_DIR"]) / ".req"
        tmp.write_text(json.dumps(request))
        os.replace(tmp, first["PHX_CHECKPOINT_REQUEST"])
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    lines = out.splitlines()
    stop = [x for x in lines if x.startswith("stop restart=0 step=")]
    assert stop and [x for x in lines if "reason=requeue: test" in x], lines
    k = int(stop[0].rsplit("=", 1)[1])
    assert 10 <= k < 60
    marker = json.loads(Path(first["PHX_CHECKPOINT_MARKER"]).read_text())
    assert marker["request_seq"] == 1 and marker["path"].startswith(str(ck))

    again = _run_example(script, ["--steps", steps], env(1))
    assert again[0].endswith(f"restart=1 node=local step={k}"), again
    assert _digest(again) == reference
