"""The checkpoint protocol's pieces, below the system tests (docs/checkpoints.md).

Pure decisions (which reports are news, when a periodic checkpoint is due, what the agent is
told), option parsing and resolution, the job environment, and the shepherd's request file
with real processes and real signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from phalanx.agent import checkpoint_requests, shepherd_control, shepherd_files, shepherd_launch
from phalanx.agent.agent_status import read_job_reports
from phalanx.agent.agent_stops import checkpoint_due
from phalanx.controller.exchange import checkpoint_items, needs_write, stop_item
from phalanx.controller.launch import build_launch, job_environment
from phalanx.domain import job_reports
from phalanx.domain.directives import parse_submission
from phalanx.domain.spec import JobSpec, PartitionInfo, normalize
from phalanx.errors import InvalidSpec
from phalanx.store.store import TaskReport

PARTS = {"batch": PartitionInfo("batch", True, 3600, None)}
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"


def resolve(**kw: Any) -> dict[str, Any] | None:
    return normalize(
        JobSpec(wrap="true", **kw), PARTS, default_mem_per_cpu_mb=100, default_requeue=True
    ).checkpoint


# ---------------------------------------------------------------------- options
def test_options_parse_from_script_and_command_line() -> None:
    script = "#!/bin/bash\n#SBATCH --checkpoint-interval=auto\n#SBATCH --checkpoint-grace=2m\n"
    fields = parse_submission(script, ["--checkpoint-signal=USR2"], "job.sh").fields
    assert fields["checkpoint_interval_s"] == "auto"
    assert fields["checkpoint_grace_s"] == 120
    assert fields["checkpoint_signal"] == "USR2"
    fields = parse_submission(script, ["--checkpoint-interval=90s"], "job.sh").fields
    assert fields["checkpoint_interval_s"] == 90  # the command line wins
    assert (
        parse_submission(None, ["--wrap=x", "--checkpoint-interval=1:00:00"]).fields[
            "checkpoint_interval_s"
        ]
        == 3600
    )


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("--checkpoint-interval=often", "invalid duration 'often'"),
        ("--checkpoint-interval=0s", "must be more than 0"),
        ("--checkpoint-grace=UNLIMITED", "must be finite"),
        ("--checkpoint-signal=B:USR1@30", "give only the signal"),
        ("--checkpoint-signal=SIGFOO", "unknown signal name"),
    ],
)
def test_bad_option_values_are_refused_naming_the_line(option: str, says: str) -> None:
    script = f"#!/bin/bash\n#SBATCH {option}\n"
    with pytest.raises(InvalidSpec) as e:
        parse_submission(script, [], "job.sh")
    assert "job.sh line 2" in e.value.message and says in e.value.message, e.value.message


def test_resolution_defaults_and_fallbacks() -> None:
    assert resolve() is None  # no checkpoint option: not in the protocol's planned-stop part
    assert resolve(checkpoint_dir="/ck") == {
        "signum": int(signal.SIGUSR1),
        "grace_s": None,  # the cluster's checkpoint_grace
        "interval_s": None,
        "dir": "/ck",
        "batch_only": False,
    }
    # a Slurm script's --signal keeps working: its signal and lead time are the defaults
    ck = resolve(checkpoint_interval_s=60, signal="B:USR2@45")
    assert ck is not None
    assert (ck["signum"], ck["grace_s"], ck["batch_only"]) == (int(signal.SIGUSR2), 45, True)
    ck = resolve(checkpoint_signal="SIGTERM", checkpoint_grace_s=5, signal="USR2@45")
    assert ck is not None and (ck["signum"], ck["grace_s"]) == (int(signal.SIGTERM), 5)


def test_resolution_refuses_a_grace_that_does_not_fit_the_time_limit() -> None:
    with pytest.raises(InvalidSpec) as e:
        resolve(checkpoint_grace_s=600, time_limit_s=600)
    assert e.value.details["field"] == "checkpoint_grace_s"
    assert "time limit" in e.value.message


# ---------------------------------------------------------------------- environment
def work_row(**spec: Any) -> dict[str, Any]:
    resolved = normalize(
        JobSpec(wrap="true", submit_dir="/home/u/run", **spec),
        PARTS,
        default_mem_per_cpu_mb=100,
        default_requeue=True,
    )
    full = {
        **JobSpec(wrap="true", submit_dir="/home/u/run", **spec).model_dump(),
        "signal_parsed": resolved.signal,
        "checkpoint_parsed": resolved.checkpoint,
        "workdir": resolved.workdir,
    }
    return {
        "attempt_id": 9,
        "token": "t" * 16,
        "job_id": 42,
        "rank": 0,
        "seq": 1,
        "name": "train",
        "user": "u",
        "array_job_id": None,
        "array_task_id": None,
        "attempt_nodes": ["node01"],
        "attempt_partition": "batch",
        "attempt_state": "RUNNING",
        "task_state": "RUNNING",
        "stop_reason": None,
        "cpus": 1,
        "gpu_ids": [],
        "time_limit_s": 600,
        "fence_term": 1,
        "spec": full,
    }


def test_environment_has_a_stable_checkpoint_dir_and_the_signal_name() -> None:
    env = job_environment(work_row(), node="node01")
    assert env["PHX_CHECKPOINT_DIR"] == "/home/u/run/.phalanx/checkpoints/42"
    assert env["PHX_CHECKPOINT_SIGNAL"] == "USR1"
    env = job_environment(work_row(checkpoint_dir="ck", signal="USR2@30"), node="node01")
    assert env["PHX_CHECKPOINT_DIR"] == "/home/u/run/ck"  # relative to the workdir
    assert env["PHX_CHECKPOINT_SIGNAL"] == "USR2"


def test_launch_carries_the_checkpoint_settings() -> None:
    launch = build_launch(
        work_row(checkpoint_dir="/ck"), node="node01", kill_wait=5, checkpoint_grace=17
    )
    assert launch["checkpoint"] == {
        "enabled": True,
        "signum": int(signal.SIGUSR1),
        "grace_s": 17.0,
        "batch_only": False,
        "dir": "/ck",
    }
    plain = build_launch(work_row(), node="node01", kill_wait=5, checkpoint_grace=17)
    assert plain["checkpoint"]["enabled"] is False  # no request before its time limit


def test_planned_stop_uses_the_checkpoint_spec() -> None:
    w = work_row(checkpoint_signal="USR2", checkpoint_grace_s=7)
    w["stop_reason"] = "requeue: node node01 drained"
    item = stop_item(w, checkpoint_grace=30)
    assert (item["checkpoint_signal"], item["checkpoint_grace"]) == (int(signal.SIGUSR2), 7.0)
    w = work_row(signal="USR1@12")  # no checkpoint spec: --signal as before
    w["stop_reason"] = "requeue: x"
    item = stop_item(w, checkpoint_grace=30)
    assert (item["checkpoint_signal"], item["checkpoint_grace"]) == (int(signal.SIGUSR1), 12.0)
    w["stop_reason"] = "cancelled"
    assert "checkpoint_signal" not in stop_item(w, checkpoint_grace=30)
    # the end of its reservation is a planned stop too (it then ends TIMEOUT)
    w["stop_reason"] = "timeout: Reservation r1, which this job was running under, has ended"
    item = stop_item(w, checkpoint_grace=30)
    assert (item["checkpoint_signal"], item["checkpoint_grace"]) == (int(signal.SIGUSR1), 12.0)


# ---------------------------------------------------------------------- reports
def test_marker_and_progress_forms() -> None:
    helper = json.dumps({"path": "/ck/a", "finished_at": 5.0, "duration_s": 1.5, "request_seq": 2})
    assert job_reports.parse_checkpoint_marker(helper, 9.0) == {
        "path": "/ck/a",
        "finished_at": 5.0,
        "duration_s": 1.5,
        "request_seq": 2,
    }
    plain = job_reports.parse_checkpoint_marker("/ck/b\n", 9.0)
    assert plain == {"path": "/ck/b", "finished_at": 9.0, "duration_s": None, "request_seq": None}
    assert job_reports.parse_checkpoint_marker("  \n", 9.0) is None
    assert job_reports.parse_progress('{"step": 7, "ts": 3.0}', 9.0) == {"step": 7, "ts": 3.0}
    assert job_reports.parse_progress("12", 9.0) == {"step": 12, "ts": 9.0}
    assert job_reports.parse_progress("alive", 9.0) == {"step": None, "ts": 9.0}


def test_a_checkpoint_is_news_once_and_only_from_rank_0() -> None:
    rep = {"path": "/ck/a", "finished_at": 5.0, "duration_s": 1.0, "request_seq": None}
    assert job_reports.is_new_checkpoint(None, rep, rank=0)
    stored = job_reports.checkpoint_record(rep, seq=0, node="n1")
    assert not job_reports.is_new_checkpoint(stored, rep, rank=0)
    assert job_reports.is_new_checkpoint(stored, {**rep, "finished_at": 6.0}, rank=0)
    # a requeued job (restart 1) announcing the checkpoint it came back from: not news
    assert not job_reports.is_new_checkpoint(stored, rep, rank=0)
    assert not job_reports.is_new_checkpoint(None, rep, rank=1)


def test_progress_writes_are_throttled() -> None:
    gap = job_reports.PROGRESS_WRITE_INTERVAL_S
    assert job_reports.progress_due(None, {"step": 1, "ts": 100.0})
    assert not job_reports.progress_due({"step": 1, "ts": 100.0}, {"step": 9, "ts": 100.0 + 1})
    assert job_reports.progress_due({"step": 1, "ts": 100.0}, {"step": 9, "ts": 100.0 + gap})
    assert not job_reports.progress_due({"step": 1, "ts": 100.0}, None)
    assert not job_reports.progress_due(None, {"step": 1, "ts": 100.0}, rank=1)  # rank 0 only


def test_needs_write_for_a_new_checkpoint_or_due_progress() -> None:
    w = work_row(checkpoint_dir="/ck")
    ck = {"path": "/ck/a", "finished_at": 5.0, "duration_s": None, "request_seq": None}

    def report(**kw: Any) -> TaskReport:
        return TaskReport(9, w["token"], "running", started_at=1.0, **kw)

    assert not needs_write([w], [report()], None)
    assert needs_write([w], [report(checkpoint=ck)], None)
    w["job_checkpoint"] = job_reports.checkpoint_record(ck, seq=1, node="node01")
    assert not needs_write([w], [report(checkpoint=ck)], None)
    w["attempt_progress"] = {"step": 3, "ts": 100.0}
    assert not needs_write([w], [report(progress={"step": 4, "ts": 101.0})], None)
    assert needs_write([w], [report(progress={"step": 40, "ts": 110.0})], None)


def test_agents_are_told_the_interval_of_running_attempts_only() -> None:
    periodic = work_row(checkpoint_interval_s=30, signal="B:USR2@10")
    starting = {**work_row(checkpoint_interval_s=30), "attempt_id": 10, "attempt_state": "STARTING"}
    plain = {**work_row(checkpoint_dir="/ck"), "attempt_id": 11}
    seen: list[int] = []

    def interval_of(w: dict[str, Any]) -> float | None:
        seen.append(w["attempt_id"])
        return 30.0

    items = checkpoint_items([periodic, starting, plain], interval_of)
    assert items == [
        {
            "attempt_id": 9,
            "token": periodic["token"],
            "interval_s": 30.0,
            "signal": int(signal.SIGUSR2),
            "batch_only": True,
        }
    ]
    assert seen == [9]  # no store work for jobs without an interval
    assert checkpoint_items([periodic], lambda w: None) == []


def test_periodic_checkpoint_due() -> None:
    def due(now: float, **kw: Any) -> bool:
        base: dict[str, Any] = {
            "started_at": 100.0,
            "last_checkpoint_at": None,
            "last_request_at": None,
        }
        return checkpoint_due(now, 10.0, **{**base, **kw})

    assert not due(109.0) and due(110.0)  # since the attempt started
    assert not due(115.0, last_checkpoint_at=106.0) and due(116.0, last_checkpoint_at=106.0)
    assert not due(115.0, last_request_at=108.0)  # asked already: wait a whole interval again
    never = {"last_checkpoint_at": None, "last_request_at": None}
    assert not checkpoint_due(500.0, None, started_at=1.0, **never)  # no interval
    assert not checkpoint_due(500.0, 10.0, started_at=None, **never)  # not started


def test_agent_reads_the_control_files(tmp_path: Path) -> None:
    control = tmp_path / shepherd_files.CONTROL_DIR
    assert read_job_reports(tmp_path) == {}
    control.mkdir()
    (control / shepherd_files.CHECKPOINT_MARKER_FILE).write_text("/ck/x\n")
    (control / shepherd_files.PROGRESS_FILE).write_text(json.dumps({"step": 3, "ts": 1.0}))
    got = read_job_reports(tmp_path)
    assert got["checkpoint"]["path"] == "/ck/x" and got["progress"] == {"step": 3, "ts": 1.0}


# ---------------------------------------------------------------------- request file
def test_request_seq_grows_and_the_file_is_complete(tmp_path: Path) -> None:
    assert checkpoint_requests.read_checkpoint_request(tmp_path) is None
    assert (
        checkpoint_requests.write_checkpoint_request(
            tmp_path, "interval", deadline=None, stop=False
        )
        == 1
    )
    assert (
        checkpoint_requests.write_checkpoint_request(
            tmp_path, "requeue: x", deadline=9.0, stop=True
        )
        == 2
    )
    req = checkpoint_requests.read_checkpoint_request(tmp_path)
    assert req is not None
    assert {k: req[k] for k in ("seq", "reason", "deadline", "stop")} == {
        "seq": 2,
        "reason": "requeue: x",
        "deadline": 9.0,
        "stop": True,
    }
    env = checkpoint_requests.control_environment(tmp_path)
    assert env["PHX_CHECKPOINT_REQUEST"] == str(tmp_path / "control" / "checkpoint-request.json")


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Launch real shepherds for bash jobs; kill whatever is left in teardown."""
    dirs: list[Path] = []

    def launch(body: str, **spec: Any) -> Path:
        td = tmp_path / f"task{len(dirs)}"
        (td / shepherd_files.CONTROL_DIR).mkdir(parents=True)
        script = tmp_path / f"job{len(dirs)}.sh"
        script.write_text("#!/bin/bash\n" + body)
        script.chmod(0o755)
        full = {
            "attempt_id": len(dirs) + 1,
            "job_id": 1,
            "token": "ab" * 8,
            "node": "node01",
            "rank": 0,
            "argv": [str(script)],
            "env": {"PATH": JOB_PATH, **checkpoint_requests.control_environment(td)},
            "cwd": str(tmp_path),
            "stdout": str(td / "out"),
            "stderr": str(td / "out"),
            "open_mode": "truncate",
            "time_limit_s": None,
            "kill_grace_s": 1.0,
            "signal": None,
            "fence": None,
            **spec,
        }
        (td / "spec.json").write_text(json.dumps(full))
        dirs.append(td)
        shepherd_launch.launch(td)
        return td

    yield launch
    for td in dirs:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            job = json.loads((td / "job.json").read_text())
            os.killpg(job["pgid"], signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            info = json.loads((td / "shepherd.pid").read_text())
            if shepherd_files._is_alive(info["pid"], info["starttime"]):
                os.kill(info["pid"], signal.SIGKILL)


# The job copies the request file when the checkpoint signal arrives: the file must be there
# before the signal.
COPY_ON_USR1 = (
    "trap 'cp \"$PHX_CHECKPOINT_REQUEST\" {out} || echo missing > {out}' USR1\n"
    "echo ready > {ready}\n"
    "while :; do sleep 0.05; done\n"
)


def test_time_limit_request_comes_its_grace_before_the_limit(
    launched: Callable[..., Path], tmp_path: Path
) -> None:
    out, ready = tmp_path / "got", tmp_path / "ready"
    td = launched(
        COPY_ON_USR1.format(out=out, ready=ready),
        time_limit_s=3,
        checkpoint={
            "enabled": True,
            "signum": int(signal.SIGUSR1),
            "grace_s": 2.0,
            "batch_only": False,
            "dir": str(tmp_path / "ckdir"),
        },
    )
    wait_for(ready.exists, "job ready")
    assert (tmp_path / "ckdir").is_dir()  # created before the job started
    req = json.loads(wait_for(lambda: out.exists() and out.read_text(), "the request"))
    job = json.loads((td / "job.json").read_text())
    assert req["seq"] == 1 and req["reason"] == "time limit" and req["stop"] is True
    assert 0.5 <= req["requested_at"] - job["started_at"] <= 2.5  # limit 3 s - grace 2 s
    assert abs(req["deadline"] - (job["started_at"] + 3)) < 1.0
    result = wait_for(
        lambda: (s := shepherd_control.read_status(td))["state"] == "exited" and s, "exit"
    )
    assert result["timed_out"] is True


def test_no_time_limit_request_without_a_checkpoint_spec(
    launched: Callable[..., Path], tmp_path: Path
) -> None:
    out, ready = tmp_path / "got", tmp_path / "ready"
    td = launched(COPY_ON_USR1.format(out=out, ready=ready), time_limit_s=2)
    result = wait_for(
        lambda: (s := shepherd_control.read_status(td))["state"] == "exited" and s, "exit"
    )
    assert result["timed_out"] is True and not out.exists()


def test_planned_stop_and_periodic_requests_write_the_file_before_the_signal(
    launched: Callable[..., Path], tmp_path: Path
) -> None:
    out, ready = tmp_path / "got", tmp_path / "ready"
    td = launched(COPY_ON_USR1.format(out=out, ready=ready))
    wait_for(ready.exists, "job ready")
    wait_for(lambda: shepherd_control.read_status(td)["state"] == "running", "running")
    assert shepherd_control.request_checkpoint(td, "interval", int(signal.SIGUSR1)) == 1
    req = json.loads(wait_for(lambda: out.exists() and out.read_text(), "periodic request"))
    assert (req["seq"], req["reason"], req["stop"], req["deadline"]) == (1, "interval", False, None)
    out.unlink()
    before = time.time()
    assert shepherd_control.request_stop(
        td, checkpoint_signal=int(signal.SIGUSR1), checkpoint_grace=1.0, reason="requeue: drain"
    )
    req = json.loads(wait_for(lambda: out.exists() and out.read_text(), "stop request"))
    assert (req["seq"], req["reason"], req["stop"]) == (2, "requeue: drain", True)
    assert before <= req["deadline"] - 1.0 <= time.time()
    wait_for(lambda: shepherd_control.read_status(td)["state"] == "exited", "exit")
    assert shepherd_control.request_checkpoint(td, "interval", int(signal.SIGUSR1)) is None  # over
