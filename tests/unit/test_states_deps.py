"""Lifecycle transition table, node display state and dependency evaluation (pure)."""

from __future__ import annotations

import pytest

from phalanx.domain.deps import DepVerdict, evaluate, referenced_jobs
from phalanx.domain.states import (
    ACTIVE,
    JOB_TRANSITIONS,
    TERMINAL,
    AttemptState,
    JobState,
    TaskState,
    check_job_transition,
    node_display_state,
)
from phalanx.errors import InvalidTransition

# --------------------------------------------------------------------------------------------
# job transitions
# --------------------------------------------------------------------------------------------


def test_completed_cannot_go_back_to_running() -> None:
    with pytest.raises(InvalidTransition) as err:
        check_job_transition(7, JobState.COMPLETED, JobState.RUNNING)
    assert err.value.details == {"job_id": 7, "old": "COMPLETED", "new": "RUNNING"}
    assert "job 7 cannot go from COMPLETED to RUNNING" in err.value.message
    assert err.value.http_status == 409


@pytest.mark.parametrize("old", sorted(TERMINAL))
@pytest.mark.parametrize("new", list(JobState))
def test_terminal_states_are_final(old: JobState, new: JobState) -> None:
    with pytest.raises(InvalidTransition):
        check_job_transition(1, old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (JobState.PENDING, JobState.STARTING),
        (JobState.PENDING, JobState.HELD),
        (JobState.PENDING, JobState.CANCELLED),
        (JobState.HELD, JobState.PENDING),
        (JobState.STARTING, JobState.RUNNING),
        (JobState.STARTING, JobState.PENDING),  # launch lost: requeue
        (JobState.STARTING, JobState.COMPLETED),  # exited before anyone saw it run
        (JobState.RUNNING, JobState.COMPLETING),
        (JobState.RUNNING, JobState.NODE_FAIL),
        (JobState.COMPLETING, JobState.CANCELLED),
        (JobState.COMPLETING, JobState.PENDING),
    ],
)
def test_allowed_edges(old: JobState, new: JobState) -> None:
    check_job_transition(1, old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (JobState.PENDING, JobState.RUNNING),  # must pass through STARTING (an attempt)
        (JobState.PENDING, JobState.COMPLETED),
        (JobState.HELD, JobState.STARTING),  # a held job is never scheduled
        (JobState.COMPLETING, JobState.RUNNING),
        (JobState.RUNNING, JobState.STARTING),
        (JobState.PENDING, JobState.PENDING),
    ],
)
def test_forbidden_edges(old: JobState, new: JobState) -> None:
    with pytest.raises(InvalidTransition):
        check_job_transition(1, old, new)


def test_state_sets() -> None:
    assert set(JOB_TRANSITIONS) == set(JobState)
    assert {JobState.STARTING, JobState.RUNNING, JobState.COMPLETING} == ACTIVE
    assert not (ACTIVE & TERMINAL)
    assert all(s.terminal for s in TERMINAL) and not JobState.PENDING.terminal
    assert JobState.RUNNING.active and not JobState.HELD.active
    assert AttemptState.STOPPING.holds_resources and not AttemptState.ENDED.holds_resources
    assert TaskState.LOST.finished and TaskState.EXITED.finished and not TaskState.RUNNING.finished


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"registered": False}, "UNKNOWN"),
        ({}, "IDLE"),
        ({"busy": True, "used_cpus": 2}, "MIXED"),
        ({"busy": True, "used_cpus": 8}, "ALLOCATED"),
        ({"down": True}, "DOWN"),
        ({"down": True, "drain": True}, "DOWN+DRAIN"),
        ({"drain": True}, "DRAINED"),
        ({"drain": True, "busy": True, "used_cpus": 1}, "DRAINING"),
    ],
)
def test_node_display_state(kw: dict[str, object], shown: str) -> None:
    args: dict[str, object] = {
        "registered": True,
        "down": False,
        "drain": False,
        "used_cpus": 0,
        "total_cpus": 8,
        "busy": False,
    }
    args.update(kw)
    assert node_display_state(**args) == shown  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# dependencies
# --------------------------------------------------------------------------------------------


def dep(kind: str, *jobs: int) -> dict[str, object]:
    return {"type": kind, "jobs": list(jobs)}


def test_no_dependencies_is_ready() -> None:
    assert evaluate([], {}) == (DepVerdict.READY, None)


def test_afterok() -> None:
    d = [dep("afterok", 1, 2)]
    assert evaluate(d, {1: JobState.COMPLETED, 2: JobState.COMPLETED}) == (DepVerdict.READY, None)
    assert evaluate(d, {1: JobState.COMPLETED, 2: JobState.RUNNING}) == (
        DepVerdict.WAIT,
        "Dependency (afterok:2)",
    )
    verdict, why = evaluate(d, {1: JobState.FAILED, 2: JobState.RUNNING})
    assert verdict is DepVerdict.NEVER and why is not None
    assert "afterok:1" in why and "ended FAILED" in why
    verdict, why = evaluate(d, {1: JobState.COMPLETED})  # 2 was purged
    assert verdict is DepVerdict.NEVER and why is not None and "unknown" in why


def test_afternotok_afterany_after() -> None:
    assert evaluate([dep("afternotok", 1)], {1: JobState.NODE_FAIL})[0] is DepVerdict.READY
    assert evaluate([dep("afternotok", 1)], {1: JobState.COMPLETED})[0] is DepVerdict.NEVER
    assert evaluate([dep("afternotok", 1)], {1: JobState.RUNNING})[0] is DepVerdict.WAIT
    assert evaluate([dep("afterany", 1)], {1: JobState.CANCELLED})[0] is DepVerdict.READY
    assert evaluate([dep("afterany", 1)], {})[0] is DepVerdict.READY  # purged
    assert evaluate([dep("afterany", 1)], {1: JobState.HELD})[0] is DepVerdict.WAIT
    assert evaluate([dep("after", 1)], {1: JobState.PENDING}) == (
        DepVerdict.WAIT,
        "Dependency (after:1)",
    )
    assert (
        evaluate([dep("after", 1)], {1: JobState.RUNNING}, started={1: True})[0] is DepVerdict.READY
    )
    # requeued after it had started once: still counts as started
    assert (
        evaluate([dep("after", 1)], {1: JobState.PENDING}, started={1: True})[0] is DepVerdict.READY
    )
    assert evaluate([dep("after", 1)], {1: JobState.CANCELLED})[0] is DepVerdict.READY


def test_all_clauses_must_hold_and_never_wins() -> None:
    d = [dep("afterany", 1), dep("afterok", 2)]
    assert evaluate(d, {1: JobState.RUNNING, 2: JobState.RUNNING}) == (
        DepVerdict.WAIT,
        "Dependency (afterany:1,afterok:2)",
    )
    assert evaluate(d, {1: JobState.RUNNING, 2: JobState.FAILED})[0] is DepVerdict.NEVER


def test_singleton() -> None:
    s = [dep("singleton")]
    assert evaluate(s, {}, singleton_busy=False) == (DepVerdict.READY, None)
    verdict, why = evaluate(s, {}, singleton_busy=True)
    assert verdict is DepVerdict.WAIT and why is not None and "singleton" in why


def test_referenced_jobs() -> None:
    assert referenced_jobs([dep("afterok", 1, 2), dep("singleton"), dep("after", 2, 3)]) == {
        1,
        2,
        3,
    }
