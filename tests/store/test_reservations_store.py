"""Reservations in the store, on SQLite and PostgreSQL: create (with the checks that need the live
cluster: known nodes, a node count picked, overlaps, busy nodes, a duplicate name), update,
delete (refused while a job asks for it), list, each change an event with its actor; the
scheduler reading them with its snapshot and the job's --reservation from its spec; and the
cluster duty's fenced writes: a phase moved once (its resv.start/resv.end event written once),
the jobs still running in an ended reservation stopped, ending TIMEOUT."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import update
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

from phalanx.domain import reservations as rules
from phalanx.errors import Conflict, Fenced, InvalidSpec, NotFound
from phalanx.store import schema
from phalanx.store.store import Fence, Store

__all__ = ["store"]


def fence(store: Store, holder: str = "ctl") -> Fence:
    term = store.acquire_lease("cluster", holder, ttl=60)
    assert term is not None
    return Fence("cluster", holder, term)


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


def test_phase_moves_are_compare_and_set_and_fenced(store: Store) -> None:
    nodes4(store)
    r = create(store, "r1")
    watched = store.watched_reservations()
    assert [(w["name"], w["phase"]) for w in watched] == [("r1", "scheduled")]
    P = rules.Phase
    f = fence(store)
    said = "reservation r1 on n[1-2] started"
    assert store.move_reservation(r["id"], P.SCHEDULED, P.ACTIVE, f, message=said)
    # a second controller (or a second tick) that read the old phase writes nothing
    assert not store.move_reservation(r["id"], P.SCHEDULED, P.ACTIVE, f, message=said)
    starts = [e for e in store.events() if e["kind"] == "resv.start"]
    assert [e["message"] for e in starts] == [said]
    # a holder whose lease was taken over writes nothing either
    store.release_lease("cluster", "ctl", f.term)
    other = fence(store, "other")
    with pytest.raises(Fenced):
        store.move_reservation(r["id"], P.ACTIVE, P.ENDED, f, message="ended")
    assert store.move_reservation(r["id"], P.ACTIVE, P.ENDED, other, message="ended")
    assert store.move_reservation(r["id"], P.ENDED, P.CLOSED, other)
    kinds = [e["kind"] for e in store.events() if e["kind"].startswith("resv.")]
    assert kinds == ["resv.create", "resv.start", "resv.end"]  # closing writes no event
    assert store.watched_reservations() == []


def test_an_update_moving_an_active_start_later_schedules_it_again(store: Store) -> None:
    nodes4(store)
    r = create(store, "r1")
    assert store.move_reservation(r["id"], rules.Phase.SCHEDULED, rules.Phase.ACTIVE, None)
    later = time.time() + 600
    store.update_reservation("r1", {"start": later}, "ops")
    assert store.watched_reservations()[0]["phase"] == "scheduled"
    store.update_reservation("r1", {"duration": 60}, "ops")  # other changes keep the phase
    assert store.watched_reservations()[0]["phase"] == "scheduled"


def test_jobs_still_running_when_their_reservation_ends_are_stopped_and_end_timeout(
    store: Store,
) -> None:
    nodes4(store)
    now = time.time()
    r = create(store, "r1", users=["alice"])
    inside = submit1(store, user="alice", cpus_per_task=4, reservation="r1", time_limit_s=7200)
    outside = submit1(store, user="bob", cpus_per_task=4)
    a_in, a_out = start(store, inside, ["n1"]), start(store, outside, ["n3"])
    store.apply_reports("n1", [running(a_in)], None)
    store.apply_reports("n3", [running(a_out)], None)
    live = store.attempts_in_reservations(["r1"])
    mine = {"attempt_id": a_in["id"], "job_id": inside, "nodes": ["n1"], "reservation": "r1"}
    assert live == [{**mine, "stopping": False}]
    assert store.attempts_in_reservations(["other"]) == []
    assert store.reservation_end("r1") == pytest.approx(now + 3600, abs=5)
    assert store.reservation_end("nope") is None

    f = fence(store)
    why = rules.end_stop_reason(rules.Reservation.from_row(r), 0.0, now)
    assert store.stop_at_reservation_end([(a_in["id"], "r1", why)], f) == [inside]
    assert store.stop_at_reservation_end([(a_in["id"], "r1", why)], f) == []  # once
    # still in it until it ended (the reservation closes after that), but being stopped
    assert store.attempts_in_reservations(["r1"]) == [{**mine, "stopping": True}]
    assert state(store, inside) == "COMPLETING" and state(store, outside) == "RUNNING"
    work = {x["attempt_id"]: x for x in store.node_work("n1")}
    assert work[a_in["id"]]["stop_reason"] == why
    stops = [e for e in store.events(job_id=inside) if e["kind"] == "resv.stop"]
    assert (
        len(stops) == 1
        and "Reservation r1, which this job was running under" in (stops[0]["message"])
    )

    # SIGTERM at the end of its grace: TIMEOUT with Slurm's reason, no retry, no requeue
    store.apply_reports("n1", [exited(a_in, None, signal=15)], None)
    assert store.attempts_in_reservations(["r1"]) == []
    job = store.get_job(inside)
    assert (job["state"], job["reason"]) == ("TIMEOUT", why.removeprefix("timeout: "))
    assert job["restart_count"] == 0 and job["retries"] == 0

    # its name is free again once no job runs in it; while one does, a new one is refused
    again = submit1(store, user="alice", cpus_per_task=4, reservation="r1")
    a2 = start(store, again, ["n2"])
    store.apply_reports("n2", [running(a2)], None)
    with store.db.begin() as conn:  # ended a second ago (UNLIMITED overrun: it runs on)
        conn.execute(
            update(schema.reservations)
            .where(schema.reservations.c.name == "r1")
            .values(end=time.time() - 1)
        )
    with pytest.raises(Conflict, match=f"job {again} still runs in it"):
        create(store, "r1", nodes_expr="n4")
    store.apply_reports("n2", [exited(a2, 0)], None)
    assert create(store, "r1", nodes_expr="n4")["nodes"] == ["n4"]
