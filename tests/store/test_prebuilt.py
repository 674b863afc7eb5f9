"""Statements built once (store/prebuilt.py) do what the statements they replaced did, on both
backends; on SQLite the driver path returns exactly what SQLAlchemy would; and attempt tokens
are unique and sort by their making."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, bindparam, select, update
from sqlalchemy import exc as sa_exc
from test_store_contract import add_node, start, store, submit1

from phalanx.store import (
    attempts,
    configs,
    exchange,
    history,
    job_control,
    leases,
    maintenance,
    nodes,
    prebuilt,
    reservations,
    scheduling,
    submission,
)
from phalanx.store import schema as s
from phalanx.store.store import Store, TaskReport

__all__ = ["store"]


def test_update_where_changes_the_matching_rows_only(store: Store) -> None:
    for n in ("n1", "n2", "n3"):
        add_node(store, n)
    with store.db.begin() as conn:
        matched = prebuilt.update_where(
            conn, s.nodes, {"name": "n2"}, {"launch_failures": 3, "topology": {"rack": "r1"}}
        )
        assert matched == 1
        # every equality must hold: no row is both n1 and at 5 failures
        matched = prebuilt.update_where(
            conn, s.nodes, {"name": "n1", "launch_failures": 5}, {"launch_failures": 9}
        )
        assert matched == 0
    with store.db.begin(write=False) as conn:
        rows = {
            r.name: (r.launch_failures, r.topology)
            for r in conn.execute(
                select(s.nodes.c.name, s.nodes.c.launch_failures, s.nodes.c.topology)
            )
        }
    assert rows["n2"] == (3, {"rack": "r1"})
    assert rows["n1"][0] == 0 and rows["n3"][0] == 0


def test_one_statement_per_shape() -> None:
    a = prebuilt._update(s.jobs, ("id", "state"), ("state", "reason"))
    assert prebuilt._update(s.jobs, ("id", "state"), ("state", "reason")) is a
    assert prebuilt._update(s.jobs, ("id", "state"), ("state", "reason", "end_time")) is not a


def test_select_where_orders_and_picks_columns(store: Store) -> None:
    add_node(store, "n1", cpus=8)
    add_node(store, "n2", cpus=8)
    job = submit1(store, nodes=2)
    att = start(store, job, ["n2", "n1"])  # ranks follow the order given
    with store.db.begin(write=False) as conn:
        by_rank = prebuilt.select_where(
            conn, s.tasks, {"attempt_id": att["id"]}, cols=["node", "rank"], order_by="rank"
        )
        whole = prebuilt.only(prebuilt.select_where(conn, s.attempts, {"id": att["id"]}))
        nothing = prebuilt.select_where(conn, s.attempts, {"id": -1})
    assert by_rank == [{"node": "n2", "rank": 0}, {"node": "n1", "rank": 1}]
    assert whole["token"] == att["token"] and whole["job_id"] == job
    assert nothing == []
    with pytest.raises(sa_exc.NoResultFound):
        prebuilt.only(nothing)
    with pytest.raises(sa_exc.MultipleResultsFound):
        prebuilt.only([whole, whole])


# the modules Store's own methods live in (steps and base hold their own statements)
_STORE_MODULES = (
    attempts,
    configs,
    exchange,
    history,
    job_control,
    leases,
    maintenance,
    nodes,
    reservations,
    scheduling,
    submission,
)


def _store_prebuilts() -> dict[str, prebuilt.Prebuilt]:
    return {
        name: v
        for module in _STORE_MODULES
        for name, v in vars(module).items()
        if isinstance(v, prebuilt.Prebuilt)
    }


def test_the_driver_path_returns_what_sqlalchemy_returns(store: Store) -> None:
    """Every statement the store builds once, on a node with a running 2-node job and a
    starting one (JSON lists and objects, booleans, floats and NULLs among the columns): the
    same rows, keys and values as `conn.execute(...).mappings()`."""
    add_node(store, "n1", cpus=8, gpus=2)
    add_node(store, "n2", cpus=8)
    running = start(store, submit1(store, nodes=2, group="g1"), ["n1", "n2"])
    starting = start(store, submit1(store, licenses="matlab:2"), ["n1"])
    store.apply_reports(
        "n1", [TaskReport(running["id"], running["token"], "running", started_at=time.time())], None
    )
    now = time.time()
    store.add_window("n2", now + 600, now + 1200, "firmware", "ops")
    store.create_reservation(
        "r1",
        start=now + 3600,
        end=now + 7200,
        nodes_expr="n2",
        node_count=None,
        users=["alice"],
        accounts=[],
        flags=[],
        partition=None,
        actor="ops",
    )
    params: dict[str, dict[str, Any]] = {
        "_JOB_SUMMARY_BY_ID": {"id": running["job_id"]},
        "_REPORTED_TASKS": {"node": "n1"},
        "_NODE_WORK": {"node": "n1"},
        # a scheduling pass's snapshot (scheduling.py, maintenance.py, reservations.py,
        # configs.py)
        "_NODES": {},
        "_PARTITIONS": {},
        "_ALLOCATIONS": {},
        "_ACTIVE_JOBS": {},
        "_GROUPS_ACTIVE": {},
        "_LICENSES_HELD": {},
        "_LIVE_WINDOWS": {},
        "_LIVE_RESERVATIONS": {"now": now},
        "_LATEST_VERSION": {},
    }
    found = _store_prebuilts()
    assert set(params) == set(found)
    per_shape = [
        prebuilt._select(s.attempts, None, ("id",), None),
        prebuilt._select(s.tasks, None, ("attempt_id",), "rank"),
        prebuilt._select(s.jobs, ("spec",), ("id",), None),
    ]
    with store.db.begin(write=False) as conn:
        for name, p in found.items():
            if name in params:
                mine = p.rows(conn, params[name])
                theirs = [dict(r) for r in conn.execute(p.statement, params[name]).mappings()]
                assert mine == theirs, name
                assert mine, name  # (a test of nothing would pass)
                if store.dialect == "sqlite":  # the hot statements do take the driver path
                    assert p._plan(conn.dialect) is not None, name
        for p, ps in zip(
            per_shape,
            [
                {"w_id": starting["id"]},
                {"w_attempt_id": running["id"]},
                {"w_id": running["job_id"]},
            ],
            strict=True,
        ):
            theirs = [dict(r) for r in conn.execute(p.statement, ps).mappings()]
            assert p.rows(conn, ps) == theirs and theirs


def test_the_driver_path_counts_what_it_updates(store: Store) -> None:
    for n in ("n1", "n2"):
        add_node(store, n)
    clear = prebuilt.Prebuilt(
        update(s.nodes)
        .where(s.nodes.c.name == bindparam("node"), s.nodes.c.launch_failures > 0)
        .values(launch_failures=0)
    )
    for n in ("n1", "n2"):
        with store.db.begin() as conn:
            prebuilt.update_where(conn, s.nodes, {"name": n}, {"launch_failures": 2})
    with store.db.begin() as conn:
        assert clear.run(conn, {"node": "n1"}) == 1
        assert clear.run(conn, {"node": "n1"}) == 0  # already cleared: `launch_failures > 0`
    with store.db.begin(write=False) as conn:
        failures = dict(conn.execute(select(s.nodes.c.name, s.nodes.c.launch_failures)).all())
    assert failures == {"n1": 0, "n2": 2}


def test_a_driver_error_is_raised_as_sqlalchemy_raises_it(store: Store) -> None:
    """The store maps SQLAlchemy's errors (on SQLite its OperationalError, e.g. a locked
    database, is "unavailable"): a statement on the driver path must fail as the same
    statement through SQLAlchemy does, not with sqlite3's own exception."""
    ghost = Table("no_such_table", MetaData(), Column("id", Integer))
    p = prebuilt.Prebuilt(select(ghost.c.id).where(ghost.c.id == bindparam("n")))
    failures: list[BaseException] = []
    for run in (
        lambda conn: p.rows(conn, {"n": 1}),
        lambda conn: conn.execute(p.statement, {"n": 1}).all(),
    ):
        with pytest.raises(Exception) as caught, store.db.begin() as conn:
            run(conn)
        failures.append(caught.value)
    mine, theirs = failures
    assert type(mine) is type(theirs)
    assert "no_such_table" in str(mine) and "no_such_table" in str(theirs)


def test_attempt_tokens_are_unique_and_sort_by_their_making(store: Store) -> None:
    add_node(store, "n1", cpus=64)
    tokens = []
    for _ in range(5):
        tokens.append(start(store, submit1(store), ["n1"])["token"])
        ms = time.time_ns() // 1_000_000
        while time.time_ns() // 1_000_000 == ms:  # the next token is of a later millisecond
            pass
    assert len(set(tokens)) == 5
    assert tokens == sorted(tokens)
    assert all(len(t) == 44 and int(t, 16) >= 0 for t in tokens)
    # 128 random bits after the time: two tokens of the same millisecond still differ
    assert len({t[12:] for t in tokens}) == 5


def test_work_generations_go_up_once_a_named_node_by_either_statement(store: Store) -> None:
    """`_bump_gen` runs one prebuilt UPDATE a node for a few nodes and one `IN` for many:
    each named node's work_gen goes up by exactly one per call, no other node's moves."""
    names = [f"n{i:02d}" for i in range(12)]
    for n in names:
        add_node(store, n)

    def gens() -> dict[str, int]:
        with store.db.begin(write=False) as conn:
            return dict(conn.execute(select(s.nodes.c.name, s.nodes.c.work_gen)).all())

    before = gens()
    for chosen in (names[:1], names[:3] + names[:1], names[:10]):  # a repeat counts once
        was = gens()
        with store.db.begin() as conn:
            store._bump_gen(conn, chosen)
        now = gens()
        assert {n: now[n] - was[n] for n in names} == {n: int(n in chosen) for n in names}
    after = gens()
    assert after["n00"] - before["n00"] == 3 and after["n11"] == before["n11"]
