"""Accounting retention: finished jobs older than the retention are purged in batches with
everything that belongs to them, on SQLite and PostgreSQL; a user's requeue in the store."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from test_store_contract import (  # the contract suite's helpers and `store` fixture
    add_node,
    exited,
    running,
    start,
    state,
    store,
    submit1,
)

from phalanx.config import load_config
from phalanx.controller.runtime import Controller
from phalanx.store import schema as s
from phalanx.store.history import JOB_ROWS
from phalanx.store.store import Store

__all__ = ["store"]  # the fixture, imported for pytest


def finished(store: Store, node: str = "n1", code: int = 0) -> int:
    jid = submit1(store)
    att = start(store, jid, [node])
    store.apply_reports(node, [running(att)], time.time())
    store.apply_reports(node, [exited(att, code)], time.time())
    assert state(store, jid) in ("COMPLETED", "FAILED")
    return jid


def counts(store: Store, ids: list[int]) -> dict[str, int]:
    """Rows that belong to these jobs, table by table (the jobs table too)."""
    out: dict[str, int] = {}
    with store.db.begin(write=False) as conn:
        for table, rows_of in JOB_ROWS:
            out[table.name] = conn.execute(
                select(func.count()).select_from(table).where(rows_of(ids))
            ).scalar_one()
        out["jobs"] = conn.execute(
            select(func.count()).select_from(s.jobs).where(s.jobs.c.id.in_(ids))
        ).scalar_one()
    return out


def backdate(store: Store, ids: list[int], ended: float) -> None:
    with store.db.begin() as conn:
        conn.execute(s.jobs.update().where(s.jobs.c.id.in_(ids)).values(end_time=ended))


def test_purge_removes_old_finished_jobs_with_their_rows_in_batches(store: Store) -> None:
    add_node(store, "n1")
    old = [finished(store) for _ in range(5)]
    recent = finished(store, code=3)
    waiting = submit1(store)
    now = time.time()
    backdate(store, old, now - 40 * 86400)
    before = counts(store, old)
    assert before["tasks"] == 5 and before["attempts"] == 5 and before["events"] >= 20, before
    # batches of 2: 2, 2, 1, then nothing
    assert [store.purge_finished(now - 30 * 86400, batch=2) for _ in range(4)] == [2, 2, 1, 0]
    assert counts(store, old) == {name: 0 for name in before}
    # what is recent, or not finished, stays whole
    kept = counts(store, [recent, waiting])
    assert kept["jobs"] == 2 and kept["attempts"] == 1 and kept["tasks"] == 1
    assert state(store, recent) == "FAILED" and state(store, waiting) == "PENDING"


def test_a_running_job_is_never_purged_whatever_its_age(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], time.time())
    backdate(store, [jid], time.time() - 400 * 86400)  # an end_time from an earlier run
    assert store.purge_finished(time.time(), batch=100) == 0
    assert state(store, jid) == "RUNNING"


def test_the_cluster_duty_purges_with_the_configured_retention(
    store: Store, monkeypatch: Any
) -> None:
    add_node(store, "n1")
    old, young = finished(store), finished(store)
    now = time.time()
    backdate(store, [old], now - 3 * 86400)
    backdate(store, [young], now - 3600)
    cfg = load_config(overrides={"accounting": {"keep_finished": "2-00:00:00", "purge_batch": 1}})
    ctl = Controller(store, cfg, cid="t")
    assert ctl.purge_tick() == ""  # not the cluster lease holder: no purge
    assert "took term" in ctl.leases.tick()
    assert ctl.purge_tick() == "purged 1 finished jobs"
    assert ctl.purge_tick() == ""  # at most once a minute
    assert counts(store, [old])["jobs"] == 0 and counts(store, [young])["jobs"] == 1
    forever = load_config(overrides={"accounting": {"keep_finished": "UNLIMITED"}})
    ctl2 = Controller(store, forever, cid="t2")
    assert ctl2.purge_tick(force=True) == ""


def test_a_user_requeue_of_a_running_job(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], time.time())
    assert store.requeue([jid], "alice") == {jid: "requeued"}
    (stopping,) = [a for a in store.attempts_of(jid) if a["id"] == att["id"]]
    assert stopping["stop_reason"] == "requeue: requested by alice"
    store.apply_reports("n1", [exited(att, 0)], time.time())
    job = store.get_job(jid)
    assert (job["state"], job["restart_count"], job["retries"]) == ("PENDING", 1, 0)
