"""How an attempt ended, decided from its task rows alone (domain/outcome.py), no database:
the order of the rules matters (a cancel wins over a failure, a lost node over an exit code)."""

from __future__ import annotations

from typing import Any

from phalanx.domain.outcome import (
    BATCH_ENDED,
    Advance,
    advance,
    attempt_outcome,
    describe_exit,
    launch_error,
    task_failed,
)
from phalanx.domain.states import JobState


def task(node: str = "n1", state: str = "EXITED", code: int | None = 0, **detail: Any) -> dict:
    return {
        "node": node,
        "state": state,
        "exit_code": code,
        "exit_signal": detail.pop("signal", None),
        "started_at": detail.pop("started_at", 1.0),
        "detail": detail or None,
    }


def att(stop: str | None = None) -> dict[str, Any]:
    return {"stop_reason": stop}


def test_every_task_exiting_zero_completes() -> None:
    assert attempt_outcome(att(), [task(), task("n2")]) == (JobState.COMPLETED, None, 0, None)


def test_a_failed_task_names_its_node_and_its_exit() -> None:
    state, why, code, sig = attempt_outcome(att(), [task(), task("n2", code=3)])
    assert (state, why, code, sig) == (JobState.FAILED, "task on n2 exited with code 3", 3, None)
    state, why, _, sig = attempt_outcome(att(), [task(code=None, signal=9)])
    assert (state, why, sig) == (JobState.FAILED, "task on n1 was killed by signal 9", 9)


def test_the_rules_in_their_order() -> None:
    lost = task("n2", state="LOST", code=None, error="node n2 is DOWN")
    bad = task(code=1)
    # a cancel wins over everything the tasks say
    assert attempt_outcome(att("cancel: by alice"), [bad, lost])[:2] == (
        JobState.CANCELLED,
        "by alice",
    )
    # a lost node is a node failure, whatever the other task's exit code
    assert attempt_outcome(att(), [bad, lost])[:2] == (
        JobState.NODE_FAIL,
        "task on n2 was lost (node n2 is DOWN)",
    )
    # self-fencing is a node failure too; the time limit is TIMEOUT; OOM is its own state
    assert attempt_outcome(att(), [task(code=None, signal=9, fenced=True)])[0] is JobState.NODE_FAIL
    assert attempt_outcome(att(), [task(code=None, signal=15, timed_out=True)])[0] is (
        JobState.TIMEOUT
    )
    assert attempt_outcome(att(), [task(code=None, signal=9, oom=True)])[0] is (
        JobState.OUT_OF_MEMORY
    )
    # the job's own error (an unknown user on the node) fails it with the node's words
    refused = task(code=None, job_error=True, error="user eve is unknown on n1")
    assert attempt_outcome(att(), [refused])[:2] == (JobState.FAILED, "user eve is unknown on n1")


def test_launch_errors_blame_the_node_only_when_it_is_the_nodes_fault() -> None:
    assert launch_error(task(code=None, launch_failed=True, error="fork failed")) == "fork failed"
    assert launch_error(task(code=None, launch_failed=True, job_error=True, error="x")) is None
    never = task(state="LOST", code=None, started_at=None, error="never started: agent died")
    assert launch_error(never) == "never started: agent died"
    assert launch_error(task()) is None


def test_task_failed_and_its_description() -> None:
    assert not task_failed(task())
    assert task_failed(task(code=2)) and describe_exit(task(code=2)) == "exited with code 2"
    assert task_failed(task(code=None, timed_out=True))
    assert describe_exit(task(code=None, timed_out=True)) == "reached its time limit"
    assert describe_exit(task(code=None, launch_failed=True, error="no such file")) == (
        "failed to launch: no such file"
    )


def ranked(*tasks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**t, "rank": i} for i, t in enumerate(tasks)]


RUNNING = task(state="RUNNING", code=None)


def test_advance_starts_a_starting_attempt_at_its_first_task() -> None:
    tasks = ranked(
        task(state="RUNNING", code=None, started_at=5.0),
        task(state="STARTING", code=None, started_at=None),
    )
    assert advance("STARTING", tasks, stop_reason=None, batch=False) == Advance(start=5.0)
    assert advance("RUNNING", tasks, stop_reason=None, batch=False) == Advance()


def test_advance_ends_the_batch_job_when_its_script_ends() -> None:
    tasks = ranked(task(), RUNNING)
    assert advance("RUNNING", tasks, stop_reason=None, batch=True) == Advance(stop=BATCH_ENDED)
    # not in --all-nodes mode, and not twice
    assert advance("RUNNING", tasks, stop_reason=None, batch=False) == Advance()
    assert advance("STOPPING", tasks, stop_reason=None, batch=True) == Advance()


def test_advance_stops_the_other_nodes_when_a_task_fails() -> None:
    tasks = ranked(RUNNING, task("n2", code=4))
    step = advance("RUNNING", tasks, stop_reason=None, batch=True)
    assert step.stop == "task on n2 exited with code 4; stopping the other nodes"


def test_advance_ends_from_the_batch_step_not_the_stopped_holders() -> None:
    holder = task("n2", code=None, signal=15, stop_requested=True)
    step = advance("STOPPING", ranked(task(), holder), stop_reason=None, batch=True)
    assert step.end is not None and step.end.result is JobState.COMPLETED
    assert [t["node"] for t in step.end.deciding] == ["n1"]
    # --all-nodes: every node's script counts, the signalled one fails the job
    step = advance("STOPPING", ranked(task(), holder), stop_reason=None, batch=False)
    assert step.end is not None and step.end.result is JobState.FAILED


def test_advance_names_the_launch_failures_of_an_ended_attempt() -> None:
    failed = task("n2", code=None, launch_failed=True, error="cannot fork")
    step = advance(
        "STARTING",
        ranked(task(code=None, signal=15, started_at=None), failed),
        stop_reason=None,
        batch=False,
    )
    assert step.end is not None and step.end.launch_failed == (("n2", "cannot fork"),)


def test_a_stop_at_the_end_of_its_reservation_ends_the_attempt_timeout() -> None:
    """Slurm's TIMEOUT (reason TimeLimit) for a job stopped as its reservation ended, whatever
    the tasks did with the signal: exit 0 after a checkpoint, or killed by SIGTERM."""
    why = "timeout: Reservation r1, which this job was running under, has ended (at 14:00)"
    text = why.removeprefix("timeout: ")
    for tasks in ([task(code=0)], [task(code=None, signal=15, cancelled=True)]):
        assert attempt_outcome(att(why), tasks)[:2] == (JobState.TIMEOUT, text)
