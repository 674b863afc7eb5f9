"""Reservations in the store, on SQLite and PostgreSQL: create (with the checks that need the live
cluster: known nodes, a node count picked, overlaps, busy nodes, a duplicate name), update,
delete (refused while a job asks for it), list, each change an event with its actor; and the
scheduler reading them with its snapshot and the job's --reservation from its spec."""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_store_contract import (  # the contract suite's helpers and `store` fixture
    add_node,
    schedule,
    start,
    state,
    store,
    submit1,
)

from phalanx.errors import Conflict, InvalidSpec, NotFound
from phalanx.store.store import Store

__all__ = ["store"]


def nodes4(store: Store) -> None:
    for n in ("n1", "n2", "n3", "n4"):
        add_node(store, n)


def create(store: Store, name: str = "r1", **kw: Any) -> dict[str, Any]:
    now = time.time()
    args: dict[str, Any] = {
        "start": now - 1,
        "end": now + 3600,
        "nodes_expr": "n[1-2]",
        "node_count": None,
        "users": ["alice"],
        "accounts": [],
        "flags": [],
        "partition": None,
        "actor": "ops",
    }
    args.update(kw)
    return store.create_reservation(name, **args)


def test_round_trip_with_events(store: Store) -> None:
    nodes4(store)
    r = create(store, users=["alice", "bob"], accounts=["phys"], flags=["MAINT"])
    assert r["nodes"] == ["n1", "n2"] and r["nodes_expr"] == "n[1-2]"
    assert r["flags"] == ["MAINT", "SPEC_NODES"] and r["users"] == ["alice", "bob"]
    got = store.get_reservation("r1")
    assert {k: got[k] for k in ("name", "nodes", "users", "accounts", "flags", "created_by")} == {
        "name": "r1",
        "nodes": ["n1", "n2"],
        "users": ["alice", "bob"],
        "accounts": ["phys"],
        "flags": ["MAINT", "SPEC_NODES"],
        "created_by": "ops",
    }
    assert [x["name"] for x in store.list_reservations()] == ["r1"]

    up = store.update_reservation("r1", {"nodes_expr": "n3", "users": ["carol"]}, "admin")
    assert up["nodes"] == ["n3"] and up["users"] == ["carol"] and up["updated_by"] == "admin"
    assert store.get_reservation("r1")["nodes"] == ["n3"]
    # a new start alone keeps the duration
    before = store.get_reservation("r1")
    moved = store.update_reservation("r1", {"start": before["start"] + 600}, "admin")
    assert moved["end"] - moved["start"] == pytest.approx(before["end"] - before["start"])

    store.delete_reservation("r1", "admin")
    with pytest.raises(NotFound, match="Reservation r1 not found"):
        store.get_reservation("r1")
    assert store.list_reservations() == []
    ev = [(e["kind"], e["actor"]) for e in store.events() if e["kind"].startswith("resv.")]
    assert ev == [
        ("resv.create", "ops"),
        ("resv.update", "admin"),
        ("resv.update", "admin"),
        ("resv.delete", "admin"),
    ]


def test_refusals_name_what_to_change(store: Store) -> None:
    nodes4(store)
    create(store)
    with pytest.raises(Conflict, match="Duplicate reservation name r1"):
        create(store)
    with pytest.raises(Conflict, match=r"overlaps with another reservation \(r1 on n2"):
        create(store, "r2", nodes_expr="n[2-3]")
    create(store, "r2", nodes_expr="n[2-3]", flags=["OVERLAP"])  # allowed with the flag
    with pytest.raises(InvalidSpec, match=r"unknown nodes n\[5-6\]"):
        create(store, "r3", nodes_expr="n[4-6]")
    with pytest.raises(InvalidSpec, match="Either Users/Groups and/or Accounts"):
        create(store, "r3", nodes_expr="n4", users=[])
    with pytest.raises(InvalidSpec, match="which has passed"):
        create(store, "r3", nodes_expr="n4", start=time.time() - 60, end=time.time() - 1)
    with pytest.raises(NotFound):
        store.update_reservation("nope", {"users": ["x"]}, "ops")
    assert [x["name"] for x in store.list_reservations()] == ["r1", "r2"]


def test_node_count_picks_free_nodes_and_busy_nodes_are_refused(store: Store) -> None:
    nodes4(store)
    jid = submit1(store, cpus_per_task=4, time_limit_s=3600)
    start(store, jid, ["n1"])
    create(store, "held", nodes_expr="n2")
    r = create(store, "cnt", nodes_expr=None, node_count=2)
    assert r["nodes"] == ["n3", "n4"]  # n1 runs a job into it, n2 is in another reservation
    assert "SPEC_NODES" not in r["flags"]
    with pytest.raises(Conflict, match="Requested nodes are busy: n1"):
        create(store, "busy", nodes_expr="n1", flags=["OVERLAP"])
    create(store, "busy", nodes_expr="n1", flags=["OVERLAP", "IGNORE_JOBS"])
    # one that starts after the job's time limit ends is fine
    later = time.time() + 7200
    create(store, "later", nodes_expr="n1", start=later, end=later + 60, flags=["OVERLAP"])


def test_scheduling_honours_reservations_and_delete_waits_for_its_jobs(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    create(store, "r1", nodes_expr="n2", users=["alice"])
    outsider = submit1(store, user="bob", cpus_per_task=4)
    insider = submit1(store, user="alice", cpus_per_task=4, reservation="r1")
    other = submit1(store, user="bob", cpus_per_task=4)
    started = schedule(store)
    assert sorted(started) == [outsider, insider]
    assert store.attempts_of(outsider)[0]["nodes"] == ["n1"]
    assert store.attempts_of(insider)[0]["nodes"] == ["n2"]
    assert state(store, other) == "PENDING"
    with pytest.raises(Conflict, match=f"Requested reservation is in use: job {insider} asks"):
        store.delete_reservation("r1", "ops")
    # a job that asked for one and ended no longer holds it
    later = time.time() + 7200
    create(store, "r2", nodes_expr="n1", start=later, end=later + 60, users=["alice"])
    waiting = submit1(store, user="alice", cpus_per_task=4, reservation="r2")
    assert schedule(store) == [] and state(store, waiting) == "PENDING"
    with pytest.raises(Conflict, match="in use"):
        store.delete_reservation("r2", "ops")
    store.cancel([waiting], "alice")
    store.delete_reservation("r2", "ops")
