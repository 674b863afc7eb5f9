"""Maintenance windows in the store, on SQLite and PostgreSQL: adding (with the checks that
refuse bad windows), listing, removing, the cluster duty's fenced transitions (drain at the
start, return after it, only what the window drained), planned stops before a window, and the
scheduler keeping crossing jobs off the window's nodes."""

from __future__ import annotations

import time

import pytest
from test_store_contract import (  # the contract suite's helpers and `store` fixture
    add_node,
    exited,
    running,
    schedule,
    start,
    state,
    store,
    submit1,
)

from phalanx.domain import maintenance, scheduling
from phalanx.errors import Fenced, InvalidSpec, InvalidTransition, NotFound
from phalanx.store.store import Fence, Store

__all__ = ["store"]


def fence(store: Store) -> Fence:
    term = store.acquire_lease("cluster", "ctl", ttl=60)
    assert term is not None
    return Fence("cluster", "ctl", term)


def nodes4(store: Store) -> None:
    for n in ("n1", "n2", "n3", "n4"):
        add_node(store, n)


def test_add_list_and_validation(store: Store) -> None:
    nodes4(store)
    now = time.time()
    w = store.add_window("n[1-2]", now + 600, now + 1200, " firmware ", "ops")
    assert w["nodes"] == ["n1", "n2"] and w["state"] == "scheduled" and w["reason"] == "firmware"
    assert w["created_by"] == "ops" and w["nodes_expr"] == "n[1-2]"
    listed = store.list_windows()
    assert [x["id"] for x in listed] == [w["id"]]
    assert store.get_window(w["id"])["end"] == pytest.approx(now + 1200)
    ev = [e for e in store.events() if e["kind"] == "maint.add"]
    assert len(ev) == 1 and "n[1-2]" in ev[0]["message"] and ev[0]["actor"] == "ops"

    with pytest.raises(InvalidSpec, match=r"unknown nodes n\[5-6\].*phalanx nodes"):
        store.add_window("n[1-6]", now + 600, now + 1200, None, "ops")
    with pytest.raises(InvalidSpec, match="already passed"):
        store.add_window("n1", now - 600, now - 60, None, "ops")
    with pytest.raises(InvalidSpec, match="end after it starts"):
        store.add_window("n1", now + 60, now + 60, None, "ops")
    with pytest.raises(InvalidSpec, match="nodes: invalid host list"):
        store.add_window("n[1-", now + 60, now + 120, None, "ops")
    assert len(store.list_windows()) == 1  # nothing half-added
    with pytest.raises(NotFound, match="maint list"):
        store.get_window(999)


def test_start_drains_end_returns_only_what_the_window_drained(store: Store) -> None:
    nodes4(store)
    f = fence(store)
    now = time.time()
    store.drain("n2", "bad DIMM", "ops")  # an operator's drain, before the window
    w = store.add_window("n[1-3]", now - 1, now + 60, "switch swap", "ops")
    assert store.start_window(w["id"], f) == (["n1", "n3"], ["n2"])
    assert store.start_window(w["id"], f) is None  # once only
    n1 = store.get_node("n1")
    assert n1["drain"] and n1["drain_by"] == f"maint:{w['id']}"
    assert n1["drain_reason"].startswith(f"maintenance {w['id']}: switch swap until ")
    assert store.get_node("n2")["drain_by"] == "ops"
    assert not store.get_node("n4")["drain"]
    assert store.get_window(w["id"])["state"] == "active"
    # a health check fails and passes on n3 meanwhile: the window's drain stays
    store.apply_health("n3", {"status": "fail", "check": "disk", "reason": "full"})
    store.apply_health("n3", {"status": "ok"})
    assert store.get_node("n3")["drain_by"] == f"maint:{w['id']}"

    assert store.end_window(w["id"], f) == ["n1", "n3"]
    assert store.end_window(w["id"], f) is None
    assert not store.get_node("n1")["drain"] and not store.get_node("n3")["drain"]
    n2 = store.get_node("n2")
    assert n2["drain"] and n2["drain_by"] == "ops" and n2["drain_reason"] == "bad DIMM"
    assert store.get_window(w["id"])["state"] == "done"
    assert store.list_windows() == []
    assert [x["id"] for x in store.list_windows(include_past=True)] == [w["id"]]
    kinds = [e["kind"] for e in store.events()]
    assert "maint.start" in kinds and "maint.end" in kinds
    assert [e["kind"] for e in store.events(node="n1")][-2:] == ["node.drain", "node.resume"]


def test_transitions_are_fenced(store: Store) -> None:
    nodes4(store)
    now = time.time()
    w = store.add_window("n1", now - 1, now + 60, None, "ops")
    stale = fence(store)
    store.release_lease("cluster", "ctl", stale.term)
    assert store.acquire_lease("cluster", "other", ttl=60) is not None
    with pytest.raises(Fenced):
        store.start_window(w["id"], stale)
    with pytest.raises(Fenced):
        store.end_window(w["id"], stale)
    assert store.get_window(w["id"])["state"] == "scheduled"
    assert not store.get_node("n1")["drain"]


def test_remove_returns_nodes_of_an_active_window(store: Store) -> None:
    nodes4(store)
    f = fence(store)
    now = time.time()
    active = store.add_window("n[1-2]", now - 1, now + 60, None, "ops")
    later = store.add_window("n3", now + 600, now + 900, None, "ops")
    store.start_window(active["id"], f)
    store.drain("n2", "cable", "bob")  # an operator takes n2 over during the window
    got = store.remove_window(active["id"], "ops")
    assert got["state"] == "removed" and got["returned"] == ["n1"]
    assert not store.get_node("n1")["drain"]
    assert store.get_node("n2")["drain_by"] == "bob"
    assert store.remove_window(later["id"], "ops")["returned"] == []
    with pytest.raises(InvalidTransition, match="already removed"):
        store.remove_window(later["id"], "ops")
    with pytest.raises(NotFound):
        store.remove_window(12345, "ops")
    assert store.list_windows() == []
    assert store.end_window(active["id"], f) is None  # the duty finds nothing to end
    assert [e["kind"] for e in store.events()].count("maint.remove") == 2


def test_scheduler_keeps_crossing_jobs_off_window_nodes(store: Store) -> None:
    add_node(store, "n1", cpus=4)
    add_node(store, "n2", cpus=4)
    now = time.time()
    store.add_window("n1", now + 300, now + 600, None, "ops")
    long = submit1(store, cpus_per_task=4, time_limit_s=3600)
    unlimited = submit1(store, cpus_per_task=4, time_limit_s=0)
    plan = scheduling.plan(store.sched_snapshot(), time.time())
    assert [(p.job_id, p.nodes) for p in plan.starts] == [(long, ("n2",))]
    # n1 is free, but an UNLIMITED job would cross the window: it waits, and says why
    assert plan.reasons[unlimited].startswith("Maintenance: nodes n1 have maintenance at ")
    short = submit1(store, cpus_per_task=4, time_limit_s=120)
    assert sorted(schedule(store)) == [long, short]
    assert store.get_job(long)["nodelist_run"] == ["n2"]
    assert store.get_job(short)["nodelist_run"] == ["n1"]  # it ends before the window
    assert state(store, unlimited) == "PENDING"


def test_planned_stop_before_a_window_requeues_without_a_retry(store: Store) -> None:
    nodes4(store)
    f = fence(store)
    move = submit1(store, requeue=True, time_limit_s=3600, signal="USR1@90")
    keep = submit1(store, requeue=False, time_limit_s=3600)
    a_move, a_keep = start(store, move, ["n1"]), start(store, keep, ["n1"])
    store.apply_reports("n1", [running(a_move), running(a_keep)], None)
    now = time.time()
    w = store.add_window("n1", now + 20, now + 60, "kernel", "ops")
    live = {r["attempt_id"]: r for r in store.attempts_on(["n1"])}
    assert set(live) == {a_move["id"], a_keep["id"]}
    assert live[a_move["id"]]["requeue"] and not live[a_keep["id"]]["requeue"]
    assert live[a_move["id"]]["end"] == pytest.approx(now + 3600, abs=10)
    assert store.attempts_on(["n2"]) == []
    assert store.checkpoint_graces([move, keep]) == {move: 90.0, keep: 0.0}

    window = maintenance.Window.from_row(store.get_window(w["id"]))
    reason = maintenance.stop_reason(window, now)
    # the non-requeue job is refused by the store too, not only by the pure decision
    got = store.stop_for_maintenance(
        [(a_move["id"], w["id"], reason), (a_keep["id"], w["id"], reason)], f
    )
    assert got == [move]
    assert store.stop_for_maintenance([(a_move["id"], w["id"], reason)], f) == []  # once
    assert state(store, move) == "COMPLETING" and state(store, keep) == "RUNNING"
    work = {x["attempt_id"]: x for x in store.node_work("n1")}
    assert work[a_move["id"]]["stop_reason"] == reason
    assert any(e["kind"] == "maint.signal" for e in store.events(job_id=move))

    store.apply_reports("n1", [exited(a_move, None, signal=15)], None)
    job = store.get_job(move)
    assert job["state"] == "PENDING" and job["restart_count"] == 1
    assert job["retries"] == 0  # a planned requeue spends no retry
    assert job["reason"].startswith("requeue: maintenance")
