"""Failure handling in the store, on SQLite and PostgreSQL: planned stops (drain --now, health
checks), nodes coming back, launch failures that back off, hold and drain, and nodes a
requeued job avoids."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import update
from test_store_contract import (  # the contract suite's helpers and `store` fixture
    add_node,
    exited,
    heard,
    running,
    start,
    state,
    store,
    submit1,
)

from phalanx.domain import scheduling
from phalanx.store import schema
from phalanx.store.store import Store, TaskReport

__all__ = ["store"]


def launch_failed(
    att: dict[str, Any], error: str = "cannot open output file /x: No such file"
) -> TaskReport:
    return TaskReport(
        att["id"],
        att["token"],
        "exited",
        exit={"exit_code": None, "launch_failed": True, "error": error, "ended_at": time.time()},
    )


def test_drain_now_requeues_only_requeueable_jobs(store: Store) -> None:
    add_node(store, "n1")
    keep = submit1(store, requeue=False)
    move = submit1(store, requeue=True)
    a_keep, a_move = start(store, keep, ["n1"]), start(store, move, ["n1"])
    store.apply_reports("n1", [running(a_keep), running(a_move)], None)

    assert store.drain("n1", "replace PSU", "ops", now=True) == [move]
    node = store.get_node("n1")
    assert node["drain"] and node["drain_by"] == "ops"
    assert state(store, keep) == "RUNNING"
    assert state(store, move) == "COMPLETING"
    work = {w["attempt_id"]: w for w in store.node_work("n1")}
    assert work[a_move["id"]]["stop_reason"].startswith("requeue: node n1 drained by ops")

    # the job saves and exits after its checkpoint signal: it goes back to the queue
    store.apply_reports("n1", [exited(a_move, 0)], None)
    job = store.get_job(move)
    assert job["state"] == "PENDING" and job["restart_count"] == 1
    assert "drained by ops" in job["reason"]
    # and never lands on the drained node again while it is drained
    plan = scheduling.plan(store.sched_snapshot(), time.time())
    assert not plan.starts


def test_health_fail_drains_requeues_and_recovers(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, requeue=True)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)

    fail = {"status": "fail", "check": "gpu", "reason": "GPU 0: XID 79"}
    said = store.apply_health("n1", fail)
    assert said and "XID 79" in said
    node = store.get_node("n1")
    assert node["drain"] and node["drain_by"] == "health:gpu"
    assert "XID 79" in node["drain_reason"]
    assert state(store, jid) == "COMPLETING"
    # the same summary again changes nothing (no second requeue, no new event)
    n_events = len(store.events(node="n1"))
    store.apply_health("n1", fail)
    assert len(store.events(node="n1")) == n_events

    store.apply_reports("n1", [exited(att, 0)], None)
    assert state(store, jid) == "PENDING"

    assert store.apply_health("n1", {"status": "ok", "check": None, "reason": None})
    node = store.get_node("n1")
    assert not node["drain"]
    assert any(e["kind"] == "node.resume" for e in store.events(node="n1"))


def test_health_warning_only_stops_new_work(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, requeue=True)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.apply_health("n1", {"status": "warn", "check": "memory", "reason": "512 MB available"})
    assert store.get_node("n1")["drain"]
    assert state(store, jid) == "RUNNING"


def test_operator_drain_is_not_lifted_by_health(store: Store) -> None:
    add_node(store, "n1")
    store.drain("n1", "firmware update", "ops")
    store.apply_health("n1", {"status": "fail", "check": "disk", "reason": "/ckpt full"})
    store.apply_health("n1", {"status": "ok"})
    node = store.get_node("n1")
    assert node["drain"] and node["drain_by"] == "ops" and node["drain_reason"] == "firmware update"


def test_heartbeat_brings_a_down_node_back(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    assert store.mark_down("n1", "no heartbeat for 11s", None)
    assert store.record_heartbeats({"n2": 0.0}) == []
    assert store.record_heartbeats({"n1": 0.0}) == ["n1"]
    assert not store.get_node("n1")["down"]
    assert [e["kind"] for e in store.events(node="n1")][-1] == "node.up"


def test_launch_failures_back_off_then_hold(store: Store) -> None:
    for n in ("n1", "n2", "n3"):
        add_node(store, n)
    jid = submit1(store)
    for i, node in enumerate(("n1", "n2", "n3")):
        att = start(store, jid, [node])
        store.apply_reports(node, [launch_failed(att)], None)
        job = store.get_job(jid)
        if i < 2:
            assert job["state"] == "PENDING", job
            assert job["eligible_time"] > time.time()  # backoff: not right away
            assert node in job["avoid_nodes"]
            assert "launch failed on" in job["reason"]
            # make it eligible again for the next round, as time passing would
            with store.db.begin() as conn:
                conn.execute(
                    schema.jobs.update().where(schema.jobs.c.id == jid).values(eligible_time=None)
                )
    job = store.get_job(jid)
    assert job["state"] == "HELD"
    assert "launch failed 3 times, last on n3" in job["reason"]
    assert "phalanx release" in job["reason"]
    # one failure on each node: none of them is drained for it
    assert not any(n["drain"] for n in store.list_nodes())


def test_repeated_launch_failures_drain_the_node(store: Store) -> None:
    add_node(store, "n1")
    for _ in range(3):
        jid = submit1(store)
        att = start(store, jid, ["n1"])
        store.apply_reports(
            "n1", [launch_failed(att, "cannot start the shepherd: fork failed")], None
        )
    node = store.get_node("n1")
    assert node["drain"] and node["drain_by"] == "phalanx"
    assert "3 launch failures in a row" in node["drain_reason"]
    assert "fork failed" in node["drain_reason"]


def test_a_successful_start_resets_the_node_failure_count(store: Store) -> None:
    add_node(store, "n1")
    for _ in range(2):
        att = start(store, submit1(store), ["n1"])
        store.apply_reports("n1", [launch_failed(att)], None)
    ok = start(store, submit1(store), ["n1"])
    store.apply_reports("n1", [running(ok)], None)
    for _ in range(2):
        att = start(store, submit1(store), ["n1"])
        store.apply_reports("n1", [launch_failed(att)], None)
    assert not store.get_node("n1")["drain"]


def test_node_failure_requeue_avoids_the_failed_node(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, requeue=True)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.fail_node_tasks("n1", "node n1 is DOWN", None)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["avoid_nodes"] == ["n1"]
    store.mark_down("n2", "test", None)  # only n1 would be schedulable: it must not be used
    store.record_heartbeats({"n1": 0.0})
    plan = scheduling.plan(store.sched_snapshot(), time.time())
    assert not plan.starts


def test_avoiding_is_dropped_when_it_would_leave_too_few_nodes(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, requeue=True)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.fail_node_tasks("n1", "node n1 is DOWN", None)
    assert store.get_job(jid)["avoid_nodes"] is None  # the only node: the job may come back there


def test_a_node_the_job_asks_for_by_name_is_never_avoided(store: Store) -> None:
    """-w/--nodelist n1: avoiding n1 after a failure there left the job pending
    ("Resources") for ever on a healthy cluster; it comes back to n1 instead."""
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, requeue=True, nodelist=["n1"])
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.fail_node_tasks("n1", "node n1 is DOWN", None)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and not job["avoid_nodes"], job
    store.record_heartbeats({"n1": 0.0})
    plan = scheduling.plan(store.sched_snapshot(), time.time())
    assert [(p.job_id, list(p.nodes)) for p in plan.starts] == [(jid, ["n1"])]


def _start_on(
    store: Store, job_id: int, nodes: list[str], *, cpus: int = 1, gpus=None, exclusive=False
) -> list[int]:
    job = store.get_job(job_id)
    return store.start_attempts(
        [
            {
                "job_id": job_id,
                "partition": job["partition"],
                "nodes": nodes,
                "cpus_per_node": cpus,
                "mem_per_node_mb": [job["mem_per_node_mb"]] * len(nodes),
                "gpu_ids": gpus or [[] for _ in nodes],
                "exclusive": exclusive,
            }
        ],
        None,
    )


def test_starts_are_rechecked_against_the_nodes_in_the_write(store: Store) -> None:
    """A plan made on a stale snapshot never double-books a node or uses a drained one."""
    add_node(store, "n1", cpus=4, gpus=2)
    add_node(store, "n2", cpus=4)
    a, b, c, d = (submit1(store) for _ in range(4))
    assert _start_on(store, a, ["n1"], cpus=3, gpus=[[0]]) == [a]
    assert _start_on(store, b, ["n1"], cpus=2) == []  # 3 + 2 > 4 cpus
    assert _start_on(store, b, ["n1"], cpus=1, gpus=[[0]]) == []  # GPU 0 is taken
    assert _start_on(store, b, ["n1"], cpus=1, gpus=[[1]]) == [b]
    assert _start_on(store, c, ["n1", "n2"], cpus=1) == []  # all-or-nothing: n1 is full
    assert state(store, c) == "PENDING"
    store.drain("n2", "maintenance", "ops")
    assert _start_on(store, c, ["n2"], cpus=1) == []  # drained after the snapshot
    store.resume("n2", "ops")
    assert _start_on(store, c, ["n2"], cpus=1, exclusive=True) == [c]
    assert _start_on(store, d, ["n2"], cpus=1) == []  # n2 runs an exclusive job


def test_a_job_error_fails_the_job_and_leaves_the_node_alone(store: Store) -> None:
    add_node(store, "n1")
    for _ in range(3):  # more than node_launch_failures_to_drain
        jid = submit1(store)
        att = start(store, jid, ["n1"])
        report = launch_failed(att, "user al is unknown on n1")
        assert report.exit is not None
        report.exit["job_error"] = True
        store.apply_reports("n1", [report], None)
        job = store.get_job(jid)
        assert job["state"] == "FAILED", job
        assert job["reason"].startswith("user al is unknown on n1"), job
        assert job["restart_count"] == 0
    node = store.get_node("n1")
    assert not node["drain"] and node["launch_failures"] == 0, node


def test_the_failure_detector_fails_live_tasks_left_on_a_down_node(
    store: Store, monkeypatch: Any
) -> None:
    """A DOWN node still holding a RUNNING task (what an older controller left when it died
    between marking the node and failing its tasks) is repaired by the next detector tick:
    the ghost attempt ends and its resources are free again."""
    from sqlalchemy import update

    from grace import pass_the_grace
    from phalanx.clock import FakeClock
    from phalanx.config import load_config
    from phalanx.controller.runtime import Controller

    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    add_node(store, "n1")
    ghost = submit1(store, requeue=True)
    att = start(store, ghost, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    with store.db.begin() as conn:
        conn.execute(update(schema.nodes).where(schema.nodes.c.name == "n1").values(down=True))
    clock = FakeClock()
    ctl = Controller(store, load_config(), cid="t", clock=clock)
    assert "took term" in ctl.leases.tick()
    assert ctl.cluster.judge_nodes() == "idle"  # a new holder's grace first
    pass_the_grace(ctl, clock)
    assert "live tasks failed on DOWN node n1" in ctl.cluster.judge_nodes()
    job = store.get_job(ghost)
    assert job["state"] == "PENDING" and job["restart_count"] == 1
    assert store.down_nodes_with_tasks() == []
    assert "live tasks failed" not in ctl.cluster.judge_nodes()  # once


def test_a_late_heartbeat_flush_never_moves_the_stamp_back(store: Store) -> None:
    """A controller paused between answering a heartbeat and writing it flushes an older
    stamp than another controller already wrote: the node must not look silent since then
    (the chaos soak saw a node declared DOWN this way while its agent's fence, freshened by
    the later replies, still let a just-launched job run)."""
    add_node(store, "n1")
    store.record_heartbeats({"n1": 0.0})
    fresh = store.get_node("n1")["last_heartbeat"]
    store.record_heartbeats({"n1": 30.0})  # held 30 s by a paused controller
    assert store.get_node("n1")["last_heartbeat"] == fresh
    assert store.silent_node_rows(store.db_time() - 6.0) == []


def test_a_stale_heartbeat_brings_no_down_node_back(store: Store) -> None:
    add_node(store, "n1")
    heard(store, "n1", 12.0)
    assert store.mark_down("n1", "no heartbeat for 12s", None)
    assert store.record_heartbeats({"n1": 20.0}) == []  # heard before it fell silent
    assert store.get_node("n1")["down"]
    assert store.record_heartbeats({"n1": 0.0}) == ["n1"]
    assert not store.get_node("n1")["down"]


def test_the_detector_verdict_is_checked_again_in_its_write(store: Store) -> None:
    """The detector reads the silent nodes, then writes each verdict: a heartbeat written by
    another controller in between keeps the node up, and its tasks run on."""
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    heard(store, "n1", 10.0)
    heard(store, "n2", 10.0)
    assert [r["name"] for r in store.silent_node_rows(store.db_time() - 6.0)] == ["n1", "n2"]
    store.record_heartbeats({"n1": 0.0})  # another controller's flush, after the read
    assert not store.mark_down("n1", "no heartbeat for 10s", None, silent_for=6.0)
    assert not store.get_node("n1")["down"] and state(store, jid) == "RUNNING"
    assert "node.down" not in [e["kind"] for e in store.events(node="n1")]
    assert store.mark_down("n2", "no heartbeat for 10s", None, silent_for=6.0)
    assert store.get_node("n2")["down"]


def marks(store: Store) -> dict[str, float | None]:
    return {c["id"]: c["flushed_through"] for c in store.list_controllers()}


def lag(store: Store, cid: str, seconds: float) -> None:
    """Controller `cid` last flushed `seconds` ago (its mark), as if it stopped flushing."""
    with store.db.begin() as conn:
        conn.execute(
            update(schema.controllers)
            .where(schema.controllers.c.id == cid)
            .values(flushed_through=store.db_time() - seconds)
        )


def test_a_controller_that_has_not_flushed_holds_the_detector_back(store: Store) -> None:
    """Controller c2 answered n1's heartbeats but has not written them (paused, slow, cut off
    from the store): the store says n1 is silent, but no DOWN verdict may be written while c2
    is behind, within the timeout. Once c2 flushes, or has been behind for longer than the
    timeout (its agents fenced since), the verdict stands. A stopping controller's last flush
    clears its mark."""
    for cid in ("c1", "c2"):
        store.register_controller(cid, None)
    add_node(store, "n1")
    heard(store, "n1", 10.0)
    lag(store, "c2", 5.0)
    store.record_heartbeats({}, controller="c1", flushed_age=0.0)
    db_now, horizon = store.heard_horizon(8.0)
    assert horizon == marks(store)["c2"] and horizon <= db_now - 5.0  # c2's mark, the earliest
    assert not store.mark_down("n1", "no heartbeat for 10s", None, silent_for=8.0)
    assert not store.get_node("n1")["down"]
    store.record_heartbeats({}, controller="c2", flushed_age=0.0)  # c2 catches up
    ahead = marks(store)["c2"]
    store.record_heartbeats({}, controller="c2", flushed_age=30.0)  # an older batch, late
    assert marks(store)["c2"] == ahead  # a mark never moves back
    assert store.mark_down("n1", "no heartbeat for 10s", None, silent_for=8.0)

    add_node(store, "n2")
    heard(store, "n2", 10.0)
    lag(store, "c2", 9.0)  # behind by longer than the timeout: it holds nothing back
    store.record_heartbeats({}, controller="c1", flushed_age=0.0)
    assert store.heard_horizon(8.0)[1] == marks(store)["c1"]
    assert store.mark_down("n2", "no heartbeat for 10s", None, silent_for=8.0)

    store.record_heartbeats({"n1": 0.0}, controller="c2", flushed_age=0.0, retire=True)
    assert marks(store)["c2"] is None
    assert not store.get_node("n1")["down"]  # its last batch was stored with it
    store.register_controller("c2", None)  # a restart: nothing heard, nothing held back
    assert marks(store)["c2"] is not None


def test_a_flush_that_waited_for_its_turn_stamps_the_time_it_stands_for(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush that waits 3 s for its turn to write (behind the process's bulk writes) must
    not stamp a heartbeat, or its controller's mark, 3 s later than it was heard."""
    store.register_controller("c1", None)
    add_node(store, "n1")
    begin = store.db.begin

    def slow_begin(*args: Any, **kwargs: Any) -> Any:
        time.sleep(3.0)  # the wait for the write turn (what is measured, not a condition)
        return begin(*args, **kwargs)

    monkeypatch.setattr(store.db, "begin", slow_begin)
    before = store.db_time()
    store.record_heartbeats({"n1": 0.0}, controller="c1", flushed_age=0.0)
    monkeypatch.undo()
    assert store.get_node("n1")["last_heartbeat"] < before + 1.5
    mark = marks(store)["c1"]
    assert mark is not None and mark < before + 1.5
