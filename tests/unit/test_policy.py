"""The verdict after an attempt ends: end, requeue (maybe after a backoff), or hold."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.domain.policy import Action, FailurePolicy, after_attempt
from phalanx.domain.states import JobState

POLICY = FailurePolicy(max_launch_failures=3, launch_backoff_base=2.0, launch_backoff_max=5.0)


def verdict(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "result": JobState.COMPLETED,
        "reason": None,
        "stop_reason": None,
        "requeue": True,
        "lost_nodes": [],
        "launch_failed": [],
        "launch_failures": 0,
        "policy": POLICY,
    }
    return after_attempt(**{**base, **kw})


def test_normal_end_keeps_the_result() -> None:
    v = verdict(result=JobState.FAILED, reason="exit 3")
    assert (v.action, v.state, v.reason) == (Action.END, JobState.FAILED, "exit 3")


def test_cancel_wins_over_everything() -> None:
    v = verdict(result=JobState.NODE_FAIL, stop_reason="cancel: by bob", reason="by bob")
    assert (v.action, v.state) == (Action.END, JobState.CANCELLED)


def test_planned_stop_requeues_even_after_a_clean_exit() -> None:
    v = verdict(stop_reason="requeue: node n1 drained by ops: x")
    assert (v.action, v.state, v.retry_after) == (Action.REQUEUE, JobState.PENDING, 0.0)


@pytest.mark.parametrize("requeue", [True, False])
def test_node_failure_requeues_only_requeueable_jobs(requeue: bool) -> None:
    v = verdict(result=JobState.NODE_FAIL, reason="lost", requeue=requeue, lost_nodes=["n2", "n1"])
    if requeue:
        assert v.action is Action.REQUEUE and v.avoid == ("n1", "n2")
    else:
        assert (v.action, v.state) == (Action.END, JobState.NODE_FAIL)


@pytest.mark.parametrize(("before", "delay"), [(0, 2.0), (1, 4.0)])
def test_launch_failures_back_off_exponentially(before: int, delay: float) -> None:
    v = verdict(
        result=JobState.FAILED, launch_failed=[("n1", "no such dir")], launch_failures=before
    )
    assert v.action is Action.REQUEUE and v.launch_failure
    assert v.retry_after == delay
    assert v.avoid == ("n1",)
    assert "no such dir" in (v.reason or "")


def test_backoff_is_capped() -> None:
    policy = FailurePolicy(max_launch_failures=10, launch_backoff_base=2.0, launch_backoff_max=5.0)
    v = verdict(launch_failed=[("n1", "x")], launch_failures=6, policy=policy)
    assert v.retry_after == 5.0


def test_hold_after_max_launch_failures_says_what_and_where() -> None:
    v = verdict(
        launch_failed=[("n7", "cannot open output file /o: Permission denied")], launch_failures=2
    )
    assert (v.action, v.state) == (Action.HOLD, JobState.HELD)
    assert "3 times" in (v.reason or "") and "n7" in (v.reason or "")
    assert "Permission denied" in (v.reason or "")
