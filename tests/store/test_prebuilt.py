"""Statements built once per shape (store/prebuilt.py) do what the statements they replaced
did, on both backends; and attempt tokens are unique and sort by their making."""

from __future__ import annotations

import time

from sqlalchemy import select
from test_store_contract import add_node, start, store, submit1

from phalanx.store import prebuilt
from phalanx.store import schema as s
from phalanx.store.store import Store

__all__ = ["store"]


def test_update_where_changes_the_matching_rows_only(store: Store) -> None:
    for n in ("n1", "n2", "n3"):
        add_node(store, n)
    with store.db.begin() as conn:
        res = prebuilt.update_where(
            conn, s.nodes, {"name": "n2"}, {"launch_failures": 3, "topology": {"rack": "r1"}}
        )
        assert res.rowcount == 1
        # every equality must hold: no row is both n1 and at 5 failures
        res = prebuilt.update_where(
            conn, s.nodes, {"name": "n1", "launch_failures": 5}, {"launch_failures": 9}
        )
        assert res.rowcount == 0
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
        ).all()
        whole = prebuilt.select_where(conn, s.attempts, {"id": att["id"]}).mappings().one()
    assert [(r.node, r.rank) for r in by_rank] == [("n2", 0), ("n1", 1)]
    assert whole["token"] == att["token"] and whole["job_id"] == job


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
