"""Licences in the store, on SQLite and PostgreSQL: attempts that hold their resources hold
their job's licences (the snapshot lists them) until the attempt ENDS, and the start
transaction re-checks them, so a plan made on a stale snapshot never hands out one licence
twice."""

from __future__ import annotations

import time
from typing import Any

from test_store_contract import add_node, exited, running, state, store, submit1

from phalanx.domain import scheduling
from phalanx.store.store import Store

__all__ = ["store"]

TOTALS = {"fluent": 1}


def starts(store: Store, snap: Any) -> list[dict[str, Any]]:
    plan = scheduling.plan(snap, time.time(), license_totals=TOTALS)
    lic = {int(j["id"]): j.get("licenses") for j in snap.pending}
    return [p.start_item(licenses=lic[p.job_id]) for p in plan.starts]


def test_licence_held_until_the_attempt_ends_and_rechecked_at_start(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    a = submit1(store, licenses="fluent")
    b = submit1(store, licenses="fluent:1")
    snap = store.sched_snapshot()
    assert snap.licenses_held == [] and {j["licenses"] for j in snap.pending} == {"fluent:1"}
    first = starts(store, snap)
    assert [s["job_id"] for s in first] == [a]
    # a second plan from the same (stale) snapshot would start b too: the write refuses it
    stale = [{**first[0], "job_id": b}]
    assert store.start_attempts(first, None, license_totals=TOTALS) == [a]
    assert store.start_attempts(stale, None, license_totals=TOTALS) == []
    assert state(store, b) == "PENDING"

    snap = store.sched_snapshot()
    assert snap.licenses_held == ["fluent:1"]
    plan = scheduling.plan(snap, time.time(), license_totals=TOTALS)
    assert plan.starts == [] and plan.reasons[b] == "Licenses"

    (att,) = store.attempts_of(a)
    store.apply_reports("n1" if "n1" in att["nodes"] else "n2", [running(att)], None)
    assert store.sched_snapshot().licenses_held == ["fluent:1"]
    store.apply_reports(att["nodes"][0], [exited(att, 0)], None)
    assert state(store, a) == "COMPLETED"
    snap = store.sched_snapshot()
    assert snap.licenses_held == []
    assert store.start_attempts(starts(store, snap), None, license_totals=TOTALS) == [b]
