"""The I/O around `domain/explain.py`: read what an explanation needs from the store.

A pending or held job is explained against a fresh scheduling snapshot (the one the scheduler
itself reads), with the states of its dependencies; a job that ran, from its attempts, its
events and the events of its nodes around each attempt. Efficiency figures come with the
job's view (GET /v1/jobs/{ref} ``usage``), not from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.domain import explain
from phalanx.domain.states import JobState

_NODE_EVENT_SLACK_S = 120.0


display_id = explain.display_id


def explain_job(
    store: Any,
    row: dict[str, Any],
    now: float,
    plan_options: Callable[[Any], dict[str, Any]] | None = None,
    redact: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
    overrun: float | None = 0.0,
) -> explain.Explanation:
    """Why job ``row`` (a full jobs row) is where it is, as of ``now``; ``plan_options`` gives
    the scheduling pass's keywords for a snapshot (Controller.plan_options: queue policy,
    licences, topology), so the explanation runs the pass the scheduler runs. ``redact``:
    the nodes' events as the caller may read them (they are not all the job's own).
    ``overrun``: timing.reservation_overrun (None: UNLIMITED), for a job running in a
    reservation: when its end stops it."""
    state = row["state"]
    attempts = store.attempts_of(int(row["id"]))
    if state in (JobState.PENDING.value, JobState.HELD.value):
        snap = store.sched_snapshot()
        ids = {int(j) for d in row["dependency"] or [] for j in d.get("jobs", [])}
        missing = sorted(ids - set(snap.dep_states))
        if missing:
            for r in store.list_jobs(ids=missing):
                snap.dep_states[int(r["id"])] = JobState(r["state"])
                snap.dep_started[int(r["id"])] = r["start_time"] is not None
        options = plan_options(snap) if plan_options else {}
        waiting = explain.explain_pending(row, snap, now, **options)
        if str(row.get("reason") or "").startswith(explain.PREEMPTING):
            waiting.lines += [
                f"{e['kind']}: {e['message']}"
                for e in store.events(job_id=int(row["id"]))
                if e.get("kind") == "job.preempting"
            ][-3:]
        if attempts:  # requeued: say why it came back, after why it waits now
            history = _history(store, row, attempts, now, redact)
            waiting.lines += ["earlier attempts:"] + [f"  {x}" for x in history.lines]
        return waiting
    history = _history(store, row, attempts, now, redact)
    name = (row.get("spec") or {}).get("reservation")
    if name and state in explain.LIVE_STATES:
        line = explain.reservation_end_line(
            str(name), store.reservation_end(str(name)), overrun, now
        )
        if line:
            history.lines.append(line)
    return history


def _history(
    store: Any,
    row: dict[str, Any],
    attempts: list[dict[str, Any]],
    now: float,
    redact: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
) -> explain.Explanation:
    events = store.events(job_id=int(row["id"]))
    node_events: list[dict[str, Any]] = []
    for a in attempts[-5:]:  # the recent attempts are the ones worth a node's history
        start = a.get("start_time") or a.get("created_at") or now
        end = (a.get("end_time") or now) + _NODE_EVENT_SLACK_S
        node_events += store.node_events_between(a.get("nodes") or [], start, end)
    if redact is not None:
        node_events = redact(node_events)
    return explain.explain_history(row, attempts, events, node_events, now)
