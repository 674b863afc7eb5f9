"""The agent protocol's pure decisions: `needs_write` (is a store write needed?) and `decide`."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.controller.exchange import Reply, decide, needs_write
from phalanx.store.store import TaskReport


def work(
    aid: int,
    task_state: str = "STARTING",
    attempt_state: str = "STARTING",
    stop_reason: str | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    return {
        "attempt_id": aid,
        "token": token or f"tok{aid}",
        "task_state": task_state,
        "attempt_state": attempt_state,
        "stop_reason": stop_reason,
    }


def rep(aid: int, state: str, token: str | None = None) -> TaskReport:
    return TaskReport(aid, token or f"tok{aid}", state)


# --------------------------------------------------------------------------------------------
# needs_write
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_state", "report", "expected"),
    [
        ("STARTING", "running", True),
        ("STARTING", "starting", False),
        ("RUNNING", "running", False),
        ("STARTING", "exited", True),
        ("RUNNING", "exited", True),
        ("RUNNING", "lost", True),
        ("EXITED", "exited", False),
    ],
)
def test_needs_write_for_news(task_state: str, report: str, expected: bool) -> None:
    assert needs_write([work(1, task_state)], [rep(1, report)], None) is expected


def test_needs_write_ignores_stale_and_unknown_reports() -> None:
    assert needs_write([work(1, "STARTING")], [rep(1, "running", token="old")], None) is False
    assert needs_write([work(1, "RUNNING")], [rep(1, "exited", token="old")], None) is False
    assert needs_write([], [rep(7, "exited")], None) is False


def test_needs_write_for_silence_only_with_taken_at() -> None:
    running = [work(1, "RUNNING", "RUNNING")]
    assert needs_write(running, [], None) is False  # cannot judge without taken_at
    assert needs_write(running, [], 123.0) is True  # a running task the agent no longer has
    assert needs_write(running, [rep(1, "running")], 123.0) is False
    # a STARTING task the agent has not launched yet is normal...
    assert needs_write([work(1, "STARTING", "STARTING")], [], 123.0) is False
    # ...unless its attempt is being stopped: then it can be closed without the agent
    assert needs_write([work(1, "STARTING", "STOPPING")], [], 123.0) is True


# --------------------------------------------------------------------------------------------
# decide
# --------------------------------------------------------------------------------------------


def test_decide_starts_unreported_starting_tasks() -> None:
    w = [work(1), work(2, "RUNNING", "RUNNING"), work(3)]
    reply = decide(w, [rep(3, "starting")])
    assert [x["attempt_id"] for x in reply.start] == [1]
    assert reply.stop == [] and reply.forget == [] and not reply.empty


def test_decide_does_not_restart_a_running_task_it_no_longer_hears_of() -> None:
    # task already RUNNING in the store: only the lost-task rule (store side) handles it
    reply = decide([work(2, "RUNNING", "RUNNING")], [])
    assert reply.empty


def test_decide_stops_alive_tasks_of_stopping_attempts() -> None:
    w = [work(1, "RUNNING", "STOPPING", stop_reason="cancel: cancelled by ops")]
    reply = decide(w, [rep(1, "running")])
    assert reply.stop == [{"attempt_id": 1, "token": "tok1", "reason": "cancel: cancelled by ops"}]
    assert reply.start == []
    # not yet launched: never start it, nothing to stop either
    assert decide([work(1, "STARTING", "STOPPING")], []).empty
    # already exited: nothing to stop
    assert decide(w, [rep(1, "exited")]).stop == []
    # a stop without a recorded reason still says something
    reply = decide([work(1, "RUNNING", "STOPPING")], [rep(1, "starting")])
    assert reply.stop[0]["reason"] == "stop"


def test_decide_stops_stale_attempts() -> None:
    reply = decide(
        [work(1, "RUNNING", "RUNNING")], [rep(1, "running", token="old"), rep(9, "starting")]
    )
    assert reply.stop == [
        {"attempt_id": 1, "token": "old", "reason": "attempt is no longer current"},
        {"attempt_id": 9, "token": "tok9", "reason": "attempt is no longer current"},
    ]
    assert reply.start == []  # the current attempt 1 is not reported as STARTING


def test_decide_forgets_only_recorded_exits() -> None:
    w = [work(1, "EXITED", "RUNNING")]
    # the store has not finished the attempt yet (another node still runs): keep reporting
    assert decide(w, [rep(1, "exited")]).forget == []
    # an exit about an attempt the store no longer lists (ENDED), or a stale token
    assert decide([], [rep(5, "exited"), rep(6, "lost")]).forget == [5, 6]
    assert decide(w, [rep(1, "exited", token="old")]).forget == [1]


def test_reply_empty() -> None:
    assert Reply().empty
    assert Reply(forget=[1]).empty  # forgetting alone does not end a long-poll
    assert not Reply(stop=[{"attempt_id": 1}]).empty


def test_a_users_own_requeue_gets_no_checkpoint_signal() -> None:
    """scontrol requeue (often the job itself, from its USR1 trap) just stops the job; other
    planned requeues (drain --now, maintenance) first send the checkpoint signal."""
    from phalanx.controller.exchange import stop_item
    from phalanx.domain.policy import user_requeue_reason

    for hold in (False, True):
        w = work(1, "RUNNING", "STOPPING", stop_reason=user_requeue_reason("alice", hold=hold))
        assert "checkpoint_signal" not in stop_item(w, 30.0)
    w = work(1, "RUNNING", "STOPPING", stop_reason="requeue: node n1 drained by ops: disk")
    w.update(spec={}, job_id=7)
    assert stop_item(w, 30.0)["checkpoint_signal"] == 10  # SIGUSR1
