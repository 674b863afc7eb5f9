"""Elastic jobs and hot spares in the store, on SQLite and PostgreSQL: a node failure puts the
job back to PENDING with its surviving nodes reserved (one retry used, no backoff), the next
scheduling pass restarts it there before anyone else, spares hold resources but are never
sent to an agent, and a spare takes a failed rank's place with the rank layout kept."""

from __future__ import annotations

import time
from typing import Any

from test_store_contract import (  # the contract suite's helpers and `store` fixture
    add_node,
    exited,
    kinds,
    running,
    state,
    store,
    submit1,
)

from phalanx.domain import scheduling
from phalanx.store.store import Store

__all__ = ["store"]


def schedule(store: Store) -> list[int]:
    """One scheduling pass as the controller runs it (spares included)."""
    plan = scheduling.plan(store.sched_snapshot(), time.time())
    return store.start_attempts(
        [p.start_item() for p in plan.starts],
        None,
    )


def run_everywhere(store: Store, att: dict[str, Any]) -> None:
    for t in att["tasks"]:
        if not t["spare"]:
            store.apply_reports(t["node"], [running(att)], None)


def kill_node(store: Store, node: str, att: dict[str, Any]) -> None:
    """The node dies; the job's tasks on the other nodes are stopped and exit."""
    assert store.mark_down(node, "silent", None)
    store.fail_node_tasks(node, f"node {node} is DOWN", None)
    for t in att["tasks"]:
        if t["node"] != node and not t["spare"]:
            store.apply_reports(t["node"], [exited(att, None, signal=15)], None)


def test_elastic_job_restarts_on_survivors_before_anyone_else(store: Store) -> None:
    for i in range(1, 6):
        add_node(store, f"n{i}", cpus=1)
    store.drain("n5", "kept out of the first placement", "test")
    jid = submit1(store, nodes=2, nodes_max=4, requeue=True)
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    assert att["nodes"] == ["n1", "n2", "n3", "n4"]  # every free node, up to MAX
    run_everywhere(store, att)

    # a competitor with a higher priority waits for nodes
    rival = submit1(store, nodes=2, priority=100, requeue=True)
    kill_node(store, "n2", att)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["restart_count"] == 1
    assert job["retries"] == 1 and job["eligible_time"] is None  # a retry, with no backoff
    assert job["reserved_nodes"] == ["n1", "n3", "n4"]
    assert time.time() + 30 < job["reserved_until"] <= time.time() + 61
    assert "job.restart" in kinds(store, jid) and "job.requeue" not in kinds(store, jid)

    store.resume("n5", "test")  # a free node appears: the elastic job may grow onto it
    started = schedule(store)
    assert started == [jid], started
    att2 = store.attempts_of(jid)[-1]
    assert att2["nodes"] == ["n1", "n3", "n4", "n5"]  # survivors keep their order, then growth
    assert state(store, rival) == "PENDING"
    job = store.get_job(jid)
    assert job["reserved_nodes"] is None and job["reserved_until"] is None


def test_elastic_job_below_min_goes_through_the_usual_requeue(store: Store) -> None:
    for i in range(1, 4):
        add_node(store, f"n{i}", cpus=1)
    jid = submit1(store, nodes=3, nodes_max=4, requeue=True)
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    run_everywhere(store, att)
    kill_node(store, "n3", att)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["reserved_nodes"] is None
    assert "job.requeue" in kinds(store, jid)


def test_spare_holds_resources_and_takes_the_failed_rank(store: Store) -> None:
    for i in range(1, 5):
        add_node(store, f"n{i}", cpus=1)
    store.drain("n4", "not yet", "test")
    jid = submit1(store, nodes=2, spares=1, requeue=True)
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    assert att["nodes"] == ["n1", "n2"]  # ranks only
    spares = [t for t in att["tasks"] if t["spare"]]
    assert [(t["node"], t["rank"]) for t in spares] == [("n3", -1)]
    assert store.node_work("n3") == []  # the agent of a spare is sent nothing
    nodes = {n["name"]: n for n in store.list_nodes()}
    assert nodes["n3"]["used"]["cpus"] == 1 and nodes["n3"]["spare_for"] == [jid]
    # the spare's node is full: another job cannot use it
    other = submit1(store, requeue=True)
    assert schedule(store) == []
    run_everywhere(store, att)
    assert state(store, jid) == "RUNNING"
    assert {t["state"] for t in store.attempts_of(jid)[-1]["tasks"] if t["spare"]} == {"RUNNING"}
    # the agent on the spare's node reports nothing: the spare is not LOST for that
    store.apply_reports("n3", [], time.time() + 1)
    assert state(store, jid) == "RUNNING"

    kill_node(store, "n1", att)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["reserved_nodes"] == ["n3", "n2"]
    assert store.attempts_of(jid)[0]["tasks"][0]["state"] == "EXITED"  # the spare let go
    store.resume("n4", "test")
    assert schedule(store) == [jid]  # only the restart: n4 becomes its new spare
    att2 = store.attempts_of(jid)[-1]
    assert att2["nodes"] == ["n3", "n2"]  # rank 0 moved to the spare, rank 1 stayed
    assert [t["node"] for t in att2["tasks"] if t["spare"]] == ["n4"]
    assert state(store, other) == "PENDING"


def test_lost_spare_does_not_stop_the_job(store: Store) -> None:
    for i in range(1, 4):
        add_node(store, f"n{i}", cpus=1)
    jid = submit1(store, nodes=2, spares=1, requeue=True)
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    run_everywhere(store, att)
    assert store.mark_down("n3", "silent", None)
    store.fail_node_tasks("n3", "node n3 is DOWN", None)
    assert state(store, jid) == "RUNNING"
    assert "job.spare_lost" in kinds(store, jid)


def test_draining_a_spare_node_leaves_the_job_running(store: Store) -> None:
    for i in range(1, 4):
        add_node(store, f"n{i}", cpus=1)
    jid = submit1(store, nodes=2, spares=1, requeue=True)
    assert schedule(store) == [jid]
    run_everywhere(store, store.attempts_of(jid)[-1])
    assert store.drain("n3", "bad fan", "ops", now=True) == []
    assert state(store, jid) == "RUNNING"


def test_a_spent_budget_ends_the_elastic_job_instead_of_restarting_it(store: Store) -> None:
    """A job whose nodes keep dying cannot restart forever just because it is elastic."""
    for i in range(1, 5):
        add_node(store, f"n{i}", cpus=1)
    jid = submit1(store, nodes=1, nodes_max=4, requeue=True, retries=1)
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    run_everywhere(store, att)
    kill_node(store, "n1", att)
    assert state(store, jid) == "PENDING"
    assert store.get_job(jid)["retries"] == 1
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    run_everywhere(store, att)
    kill_node(store, att["nodes"][0], att)
    job = store.get_job(jid)
    assert job["state"] == "NODE_FAIL", job
    assert "retries used" in (job["reason"] or "") or "retr" in (job["reason"] or ""), job
    assert job["reserved_nodes"] is None


def test_a_spare_job_does_not_avoid_itself_out_of_the_cluster(store: Store) -> None:
    """Found by the chaos soak: a --spares=1 job on three nodes restarted on its spare, lost
    that node too and was requeued avoiding both failed nodes; one node left for a job that
    needs two (its rank and its spare), so it waited for ever ("Resources") on a healthy
    cluster. Avoiding is dropped when it would leave too few nodes for ranks and spares."""
    for i in range(1, 4):
        add_node(store, f"n{i}", cpus=1)
    store.drain("n3", "kept out of the first placement", "test")
    jid = submit1(store, nodes=1, spares=1, requeue=True)
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    assert att["nodes"] == ["n1"]
    run_everywhere(store, att)
    kill_node(store, "n1", att)  # the spare n2 takes over
    assert store.get_job(jid)["reserved_nodes"] == ["n2"]
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    assert att["nodes"] == ["n2"]  # no spare left to hold: n1 is DOWN, n3 drained
    run_everywhere(store, att)
    store.resume("n3", "test")
    store.record_heartbeats({"n1": 0.0})  # n1 is back
    kill_node(store, "n2", att)
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["avoid_nodes"] is None, job
    store.record_heartbeats({"n2": 0.0})
    assert schedule(store) == [jid]  # it runs again, on a healthy cluster
