"""A heartbeat reads its node's live tasks, not every task the node ever ran (tasks.held,
migration 0011): the flag is cleared when the attempt ends, and the (node, held) index
serves the read, so a heartbeat's cost does not grow with the node's history."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import event, inspect, select
from test_store_contract import add_node, exited, running, start, store, submit1

from phalanx.store import schema as s
from phalanx.store.store import Store

__all__ = ["store"]


def held(store: Store) -> dict[tuple[int, str], bool]:
    with store.db.begin(write=False) as conn:
        rows = conn.execute(select(s.tasks.c.attempt_id, s.tasks.c.node, s.tasks.c.held))
        return {(int(r.attempt_id), r.node): bool(r.held) for r in rows}


def test_a_task_leaves_the_heartbeat_read_when_its_attempt_ends(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    done = []
    for _ in range(5):  # history on n1
        att = start(store, submit1(store), ["n1"])
        store.apply_reports("n1", [running(att)], time.time())
        store.apply_reports("n1", [exited(att, 0)], time.time())
        done.append(att["id"])
    assert store.node_work("n1") == []
    gang = start(store, submit1(store, nodes=2), ["n1", "n2"])
    store.apply_reports("n1", [running(gang)], time.time())
    store.apply_reports("n2", [running(gang)], time.time())
    # rank 1 (n2) ends first: the attempt still holds both nodes, and n2 still sees its task
    store.apply_reports("n2", [exited(gang, 0)], time.time())
    assert [(w["attempt_id"], w["task_state"]) for w in store.node_work("n2")] == [
        (gang["id"], "EXITED")
    ]
    assert [w["attempt_id"] for w in store.node_work("n1")] == [gang["id"]]
    flags = held(store)
    assert flags[(gang["id"], "n1")] and flags[(gang["id"], "n2")]
    assert not any(flags[(a, "n1")] for a in done)
    # the batch step (rank 0, n1) ends: the attempt ends and leaves both nodes' reads
    store.apply_reports("n1", [exited(gang, 0)], time.time())
    assert store.get_job(gang["job_id"])["state"] == "COMPLETED"
    assert store.node_work("n1") == [] and store.node_work("n2") == []
    assert not any(held(store).values())


def test_the_heartbeat_read_walks_the_node_held_index(tmp_path: Path) -> None:
    """SQLite's plan for the read: the (node, held) index, both columns (by the node alone
    it walked the node's whole history)."""
    st = Store(f"sqlite:///{tmp_path}/plan.db")
    try:
        st.migrate()
        add_node(st, "n1")
        plans = _plans_of(st, lambda: st.node_work("n1"), "tasks JOIN attempts")
        assert all("ix_tasks_node_held (node=? AND held=?)" in p for p in plans), plans
    finally:
        st.close()


def test_the_migration_clears_the_flag_of_tasks_already_ended(store: Store) -> None:
    """Rows from before revision 0011: tasks of ended attempts are not held, the others are."""
    add_node(store, "n1")
    ended = start(store, submit1(store), ["n1"])
    store.apply_reports("n1", [exited(ended, 0)], time.time())
    live = start(store, submit1(store), ["n1"])
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(s.__file__).parent / "migrations"))
    with store.db.begin(unbounded=True) as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0010")
        assert "held" not in [c["name"] for c in inspect(conn).get_columns("tasks")]
        command.upgrade(cfg, "head")
    assert held(store) == {(ended["id"], "n1"): False, (live["id"], "n1"): True}


def _plans_of(st: Store, run: Callable[[], Any], table_sql: str) -> list[str]:
    """SQLite's plan of each statement `run` executes whose FROM starts with `table_sql`,
    taken with the statement's own parameters. Statements are seen from SQLite's own trace of
    each connection `run` checks out: the store's hottest statements go straight to the driver
    (store/prebuilt.py), past SQLAlchemy's cursor events."""
    seen: list[str] = []

    def record(statement: str) -> None:  # (with its parameters' values filled in)
        if f"FROM {table_sql}" in statement:
            seen.append(statement)

    def trace(dbapi_conn: Any, *_: Any) -> None:
        dbapi_conn.set_trace_callback(record)

    def untrace(dbapi_conn: Any, *_: Any) -> None:
        dbapi_conn.set_trace_callback(None)

    engines = {st.db.write, st.db.read}
    for engine in engines:
        event.listen(engine, "checkout", trace)
        event.listen(engine, "checkin", untrace)
    try:
        run()
    finally:
        for engine in engines:
            event.remove(engine, "checkout", trace)
            event.remove(engine, "checkin", untrace)
    assert seen, f"no statement from {table_sql}"
    with st.db.begin(write=False) as conn:
        return [
            " | ".join(r[3] for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
            for sql in seen
        ]


def test_reads_that_must_not_grow_with_history_take_their_index(store: Store) -> None:
    """SQLite's plans, taken from the statements the store really runs: the capacity re-check
    of a start reads its nodes' live tasks by (node, held); the accounting purge finds the
    old-enough jobs by end time. By the node alone, or by state, both read every row the
    cluster ever kept (a 30-minute placements run: docs/sim.md)."""
    if store.dialect != "sqlite":
        pytest.skip("SQLite's query plans (PostgreSQL plans by its statistics)")
    add_node(store, "n1")
    job = submit1(store)
    fitting = _plans_of(store, lambda: start(store, job, ["n1"]), "tasks JOIN attempts")
    assert any("ix_tasks_node_held (node=? AND held=?)" in p for p in fitting), fitting
    purge = _plans_of(store, lambda: store.purge_finished(time.time() - 86400), "jobs")
    assert any("USING INDEX ix_jobs_end_time (end_time<?)" in p for p in purge), purge
    assert not any("TEMP B-TREE" in p for p in purge), purge
