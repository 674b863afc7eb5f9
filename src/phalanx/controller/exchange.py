"""The agent protocol's decision: given what the store wants and what the agent has, what to do.

Level-triggered (DESIGN.md §4): the reply lists tasks to start, tasks to stop and finished tasks
the agent may forget. Replaying a reply, or losing one, is harmless: the next heartbeat
reconciles again. Pure functions over plain data.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from phalanx.domain.states import AttemptState, TaskState
from phalanx.store.store import TaskReport

_ALIVE = ("starting", "running")


@dataclass
class Reply:
    start: list[dict[str, Any]] = field(default_factory=list)  # work rows to launch
    stop: list[dict[str, Any]] = field(default_factory=list)  # {"attempt_id", "token", "reason"}
    forget: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.start or self.stop)


def needs_write(
    work: list[dict[str, Any]], reports: list[TaskReport], taken_at: float | None
) -> bool:
    """Whether the agent's report says anything the store does not already know."""
    by_id = {w["attempt_id"]: w for w in work}
    reported = set()
    for r in reports:
        reported.add(r.attempt_id)
        w = by_id.get(r.attempt_id)
        if w is None or w["token"] != r.token:
            continue
        ts = w["task_state"]
        if r.state == "running" and ts == TaskState.STARTING.value:
            return True
        if r.state in ("exited", "lost") and ts in (
            TaskState.STARTING.value,
            TaskState.RUNNING.value,
        ):
            return True
    if taken_at is None:
        return False
    for w in work:
        if w["attempt_id"] in reported:
            continue
        if w["task_state"] == TaskState.RUNNING.value:
            return True
        if (
            w["task_state"] == TaskState.STARTING.value
            and w["attempt_state"] == AttemptState.STOPPING.value
        ):
            return True
    return False


def stop_item(w: dict[str, Any], checkpoint_grace: float) -> dict[str, Any]:
    """A stop request; planned stops (requeue) first give the job its checkpoint signal."""
    reason = w["stop_reason"] or "stop"
    item: dict[str, Any] = {"attempt_id": w["attempt_id"], "token": w["token"], "reason": reason}
    if reason.startswith("requeue"):
        sig = (w.get("spec") or {}).get("signal_parsed") or {}
        item["checkpoint_signal"] = int(sig.get("signum") or signal.SIGUSR1)
        item["checkpoint_grace"] = float(sig.get("before_s") or checkpoint_grace)
    return item


def decide(
    work: list[dict[str, Any]],
    reports: list[TaskReport],
    ended: set[int],
    *,
    checkpoint_grace: float = 30.0,
) -> Reply:
    """What the agent must do. `ended`: reported attempts the store has fully recorded."""
    reply = Reply()
    by_id = {w["attempt_id"]: w for w in work}
    reported = {r.attempt_id: r for r in reports}
    for w in work:
        aid = w["attempt_id"]
        r = reported.get(aid)
        if w["attempt_state"] in (AttemptState.STARTING.value, AttemptState.RUNNING.value):
            if r is None and w["task_state"] == TaskState.STARTING.value:
                reply.start.append(w)
        elif (
            w["attempt_state"] == AttemptState.STOPPING.value
            and r is not None
            and r.state in _ALIVE
        ):
            reply.stop.append(stop_item(w, checkpoint_grace))
    for r in reports:
        row = by_id.get(r.attempt_id)
        stale = row is None or row["token"] != r.token
        if stale and r.state in _ALIVE:
            reply.stop.append(
                {
                    "attempt_id": r.attempt_id,
                    "token": r.token,
                    "reason": "attempt is no longer current",
                }
            )
        elif r.state in ("exited", "lost") and (stale or r.attempt_id in ended):
            reply.forget.append(r.attempt_id)
    return reply
