"""Preemption in the store, on SQLite and PostgreSQL: candidate rows, the fenced all-or-nothing
preempt transaction, a victim never stopped twice, and the requeue that spends no retry."""

from __future__ import annotations

import time

import pytest
from test_store_contract import (  # the contract suite's helpers and `store` fixture
    add_node,
    exited,
    running,
    start,
    state,
    store,
    submit1,
)

from phalanx.domain import preemption
from phalanx.domain.preemption import Mode
from phalanx.errors import Fenced
from phalanx.store.preemption import victims_of
from phalanx.store.store import Fence, Store

__all__ = ["store"]


def fence(store: Store) -> Fence:
    term = store.acquire_lease("sched:batch", "ctl", ttl=60)
    assert term is not None
    return Fence("sched:batch", "ctl", term)


def running_job(store: Store, nodes: list[str]) -> tuple[int, dict]:
    jid = submit1(store, nodes=len(nodes), requeue=True)
    att = start(store, jid, nodes)
    for n in nodes:
        store.apply_reports(n, [running(att)], None)
    return jid, att


def test_preempt_stops_victims_reserves_nodes_and_requeues_without_a_retry(store: Store) -> None:
    for n in ("n1", "n2", "n3"):
        add_node(store, n)
    f = fence(store)
    gang, g_att = running_job(store, ["n1", "n2"])
    other, _ = running_job(store, ["n3"])
    high = submit1(store)
    rows = {r["job_id"]: r for r in store.preemption_rows()}
    assert sorted(rows[gang]["nodes"]) == ["n1", "n2"] and not rows[gang]["stopping"]
    assert rows[other]["nodes"] == ["n3"]

    reason = preemption.stop_reason(Mode.REQUEUE, high, "tier 1 over tier 0")
    until = time.time() + 90
    assert store.preempt(high, [(gang, reason)], ["n1"], until, f, why="tier 1 over tier 0") == [
        gang
    ]
    assert state(store, gang) == "COMPLETING"
    job = store.get_job(high)
    assert job["reserved_nodes"] == ["n1"] and job["reserved_until"] == pytest.approx(until)
    rows = store.preemption_rows()
    assert victims_of([r for r in rows if r["stopping"]]) == {high: [gang]}
    # a victim being stopped is not stopped again, by this preemptor or another: all or nothing
    again = submit1(store)
    assert store.preempt(again, [(other, reason), (gang, reason)], ["n3"], until, f, why="x") == []
    assert state(store, other) == "RUNNING"
    # the victim's tasks exit on their checkpoint signal: requeued, no retry spent
    for n in ("n1", "n2"):
        store.apply_reports(n, [exited(g_att, None, signal=15)], None)
    job = store.get_job(gang)
    assert job["state"] == "PENDING" and job["retries"] == 0, job
    assert job["reason"] == reason
    kinds = [e["kind"] for e in store.events(job_id=gang)]
    assert "job.preempted" in kinds and "job.requeue" in kinds
    ev = [e for e in store.events(job_id=high) if e["kind"] == "job.preempting"]
    assert ev and ev[0]["data"]["victims"] == [gang]


def test_preempt_is_fenced_and_needs_a_pending_preemptor(store: Store) -> None:
    add_node(store, "n1")
    f = fence(store)
    victim, _ = running_job(store, ["n1"])
    reason = preemption.stop_reason(Mode.CANCEL, 99, "t")
    stale = Fence(f.lease, f.holder, f.term + 1)
    high = submit1(store)
    with pytest.raises(Fenced):
        store.preempt(high, [(victim, reason)], ["n1"], time.time() + 60, stale, why="t")
    assert state(store, victim) == "RUNNING"
    store.cancel([high], "alice")
    assert store.preempt(high, [(victim, reason)], ["n1"], time.time() + 60, f, why="t") == []
    assert state(store, victim) == "RUNNING"
