"""Recovery inside the allocation (--no-kill) in the store, on SQLite and PostgreSQL: a node's
death is written in the same transaction as the job's regroup: its other tasks and its attempt
go on (no stop, no requeue, no retry spent), a spare takes the lost rank (a STARTING task its
agent is sent), the running steps' tasks there move to the spare with the same task ids, and
the attempt's membership records what changed. Without --no-kill, or losing the batch host,
or below an elastic job's MIN, the usual paths apply."""

from __future__ import annotations

from typing import Any

from test_elastic_store import run_everywhere, schedule
from test_store_contract import add_node, exited, kinds, state, store, submit1

from phalanx.domain.steps import StepRequest
from phalanx.store.steps import StepReport
from phalanx.store.store import Store

__all__ = ["store"]


def cluster(store: Store, n: int) -> None:
    for i in range(1, n + 1):
        add_node(store, f"n{i}", cpus=1)


def started(store: Store, jid: int) -> dict[str, Any]:
    assert schedule(store) == [jid]
    att = store.attempts_of(jid)[-1]
    run_everywhere(store, att)
    assert state(store, jid) == "RUNNING"
    return att


def tasks_by_node(store: Store, jid: int) -> dict[str, dict[str, Any]]:
    return {t["node"]: t for t in store.attempts_of(jid)[-1]["tasks"]}


def test_a_spare_takes_the_lost_rank_and_the_job_goes_on(store: Store) -> None:
    cluster(store, 3)
    jid = submit1(store, nodes=2, spares=1, requeue=True, no_kill=True)
    att = started(store, jid)
    assert att["nodes"] == ["n1", "n2"]
    sid = int(
        store.create_step(jid, StepRequest(nodes=2), {"argv": ["torchrun"]}, "torchrun", "alice")[
            "step_id"
        ]
    )
    for node in ("n1", "n2"):
        report = StepReport(att["id"], sid, att["token"], "running", started_at=1.0)
        store.apply_step_reports(node, [report])

    assert store.mark_down("n2", "no heartbeat", None)

    job = store.get_job(jid)
    assert job["state"] == "RUNNING" and job["restart_count"] == 0 and job["retries"] == 0
    (att1,) = store.attempts_of(jid)  # the same attempt, no new one
    assert att1["state"] == "RUNNING" and att1["nodes"] == ["n1", "n3"]
    assert att1["membership"]["gen"] == 1
    (change,) = att1["membership"]["changes"]
    assert change["left"] == ["n2"] and change["nodes"] == ["n1", "n3"]
    assert change["joined"] == [{"node": "n3", "rank": 1, "replaces": "n2"}]
    tasks = tasks_by_node(store, jid)
    assert tasks["n1"]["state"] == "RUNNING"  # the survivor is left alone
    assert tasks["n2"]["state"] == "LOST" and tasks["n2"]["detail"]["left"] is True
    assert tasks["n3"]["spare"] is False and tasks["n3"]["rank"] == 1
    assert tasks["n3"]["state"] == "STARTING"
    # the survivor's agent is asked to stop nothing; the spare's agent starts the rank;
    # the dead node's agent, back one day, sees nothing of the job (its attempt is stale)
    assert [w["stop_reason"] for w in store.node_work("n1")] == [None]
    (w3,) = store.node_work("n3")
    assert w3["task_state"] == "STARTING" and w3["rank"] == 1
    assert w3["attempt_nodes"] == ["n1", "n3"]
    assert store.node_work("n2") == []
    # the step's task of n2 starts on n3 as the step's second node: same task id
    step = store.get_step(jid, sid)
    assert step["nodes"] == ["n1", "n3"] and step["state"] == "RUNNING"
    (sw,) = store.node_step_work("n3")
    assert sw["step_id"] == sid and sw["node_state"] == "STARTING"
    assert store.node_step_work("n2") == []
    ks = kinds(store, jid)
    assert "job.node_left" in ks and "job.node_joined" in ks
    assert "job.requeue" not in ks and "job.restart" not in ks
    assert state(store, jid) == "RUNNING"

    # the spare's task runs, the step's task there reports to it; then the batch step ends
    store.apply_reports("n3", [running(att1)], None)
    report = StepReport(
        att1["id"],
        sid,
        att1["token"],
        "exited",
        started_at=1.0,
        exits=[{"task": 1, "exit_code": 0, "signal": None}],
    )
    store.apply_step_reports("n3", [report])
    report = StepReport(
        att1["id"],
        sid,
        att1["token"],
        "exited",
        started_at=1.0,
        exits=[{"task": 0, "exit_code": 0, "signal": None}],
    )
    store.apply_step_reports("n1", [report])
    assert store.get_step(jid, sid)["state"] == "COMPLETED"
    store.apply_reports("n1", [exited(att1, 0)], None)
    store.apply_reports("n3", [exited(att1, None, signal=15, stop_requested=True)], None)
    job = store.get_job(jid)
    assert job["state"] == "COMPLETED", job  # the lost node's task is no part of the outcome


def running(att: dict[str, Any]) -> Any:
    from test_store_contract import running as r

    return r(att)


def test_without_no_kill_the_job_restarts_as_before(store: Store) -> None:
    cluster(store, 3)
    jid = submit1(store, nodes=2, spares=1, requeue=True)
    started(store, jid)
    assert store.mark_down("n2", "no heartbeat", None)
    job = store.get_job(jid)
    assert job["state"] == "COMPLETING"  # the survivors are being stopped
    assert "job.node_left" not in kinds(store, jid)


def test_losing_the_batch_host_takes_the_usual_path(store: Store) -> None:
    cluster(store, 3)
    jid = submit1(store, nodes=2, spares=1, requeue=True, no_kill=True)
    started(store, jid)
    assert store.mark_down("n1", "no heartbeat", None)
    assert store.get_job(jid)["state"] == "COMPLETING"
    assert "job.node_left" not in kinds(store, jid)


def test_with_every_node_running_the_script_rank_0_is_replaced_too(store: Store) -> None:
    cluster(store, 3)
    jid = submit1(store, nodes=2, spares=1, requeue=True, no_kill=True, all_nodes=True)
    started(store, jid)
    assert store.mark_down("n1", "no heartbeat", None)
    (att,) = store.attempts_of(jid)
    assert att["nodes"] == ["n3", "n2"] and state(store, jid) == "RUNNING"


def test_an_elastic_job_without_spares_shrinks_to_min_then_stops(store: Store) -> None:
    cluster(store, 3)
    jid = submit1(store, nodes=2, nodes_max=3, requeue=True, no_kill=True)
    att = started(store, jid)
    assert att["nodes"] == ["n1", "n2", "n3"]
    sid = int(store.create_step(jid, StepRequest(), {"argv": ["x"]}, "x", "alice")["step_id"])
    assert store.mark_down("n3", "no heartbeat", None)
    (att1,) = store.attempts_of(jid)
    assert att1["nodes"] == ["n1", "n2"] and state(store, jid) == "RUNNING"
    assert att1["membership"]["changes"][0]["joined"] == []
    assert "LOST" in {r["state"] for r in _step_nodes(store, att1["id"], sid)}
    # one more loss would leave fewer than MIN: the usual path (a restart is not possible
    # either: too few nodes), the job stops
    assert store.mark_down("n2", "no heartbeat", None)
    assert state(store, jid) == "COMPLETING"


def _step_nodes(store: Store, aid: int, sid: int) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from phalanx.store import schema as s

    with store.db.begin(write=False) as conn:
        return [
            dict(r)
            for r in conn.execute(
                select(s.step_nodes).where(
                    s.step_nodes.c.attempt_id == aid, s.step_nodes.c.step_id == sid
                )
            ).mappings()
        ]


def test_a_fixed_size_job_without_a_spare_goes_on_smaller(store: Store) -> None:
    cluster(store, 2)
    jid = submit1(store, nodes=2, requeue=True, no_kill=True)
    started(store, jid)
    assert store.mark_down("n2", "no heartbeat", None)
    (att,) = store.attempts_of(jid)
    assert att["nodes"] == ["n1"] and state(store, jid) == "RUNNING"


def test_a_task_stopped_by_self_fencing_leaves_the_job_too(store: Store) -> None:
    """The node's agent lost the controllers and its shepherd stopped the job there; it
    reports that when it is back (before anyone declared the node DOWN): the node left."""
    cluster(store, 3)
    jid = submit1(store, nodes=2, spares=1, requeue=True, no_kill=True)
    att = started(store, jid)
    store.apply_reports("n2", [exited(att, None, signal=9, fenced=True)], None)
    (att1,) = store.attempts_of(jid)
    assert att1["nodes"] == ["n1", "n3"] and state(store, jid) == "RUNNING"
    tasks = tasks_by_node(store, jid)
    assert tasks["n2"]["state"] == "EXITED" and tasks["n2"]["detail"]["left"] is True
    assert tasks["n3"]["state"] == "STARTING"
    # the rendezvous names its members on n2 as departed
    assert tasks["n2"]["held"] is False, tasks["n2"]
    store.rdzv_cas(jid, "r", "state", b"s", None, member=("h_2_0", "n2"))
    assert store.rdzv_get(jid, "r", [], departed=True).departed == ["h_2_0"]
