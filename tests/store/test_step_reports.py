"""A heartbeat's step reports are applied together (JobSteps.apply_step_reports): a loop of
short steps brings several per heartbeat, each node's end is recorded, and a step ends once
its every node has reported, with the worst task's exit, on both backends."""

from __future__ import annotations

import time
from typing import Any

from test_store_contract import add_node, running, start, store, submit1

from phalanx.domain.steps import StepRequest
from phalanx.store.steps import StepReport, _node_step_work_query
from phalanx.store.store import Store

__all__ = ["store"]


def two_node_job(store: Store) -> tuple[int, dict[str, Any]]:
    add_node(store, "n1")
    add_node(store, "n2")
    job = submit1(store, nodes=2)
    att = start(store, job, ["n1", "n2"])
    store.apply_reports("n1", [running(att)], time.time())
    return job, att


def step(store: Store, job: int) -> int:
    made = store.create_step(job, StepRequest(nodes=2), {"argv": ["true"]}, "true", "alice")
    return int(made["step_id"])


def ended(att: dict[str, Any], sid: int, task: int, code: int, **kw: Any) -> StepReport:
    exits = [{"task": task, "exit_code": code, "signal": None}]
    return StepReport(att["id"], sid, att["token"], "exited", started_at=1.0, exits=exits, **kw)


def test_several_steps_end_in_one_heartbeat_each(store: Store) -> None:
    job, att = two_node_job(store)
    sids = [step(store, job) for _ in range(3)]
    assert store.apply_step_reports("n1", [ended(att, sid, 0, 0) for sid in sids])
    # n2 has not reported: every step still runs
    assert [st["state"] for st in store.steps_of(job)] == ["RUNNING"] * 3
    codes = {sids[0]: 0, sids[1]: 3, sids[2]: 0}
    assert store.apply_step_reports("n2", [ended(att, sid, 1, codes[sid]) for sid in sids])
    steps = {st["step_id"]: st for st in store.steps_of(job)}
    assert [steps[sid]["state"] for sid in sids] == ["COMPLETED", "FAILED", "COMPLETED"]
    assert steps[sids[1]]["exit_code"] == 3
    assert all(steps[sid]["end_time"] and steps[sid]["start_time"] == 1.0 for sid in sids)
    ends = [e for e in store.events(job_id=job) if e["kind"] == "step.end"]
    assert sorted(e["data"]["step_id"] for e in ends) == sids
    # the same reports again change nothing (a heartbeat repeats its step list)
    assert not store.apply_step_reports("n2", [ended(att, sid, 1, 0) for sid in sids])
    assert store.steps_of(job)[1]["state"] == "FAILED"


def test_a_steps_usage_is_folded_from_its_tasks_exit_records(store: Store) -> None:
    """sacct's N.0 line: the tasks' CPU seconds summed, the largest RSS with where it was."""
    job, att = two_node_job(store)
    sid = step(store, job)

    def with_usage(task: int, cpu: float, rss: int) -> StepReport:
        rep = ended(att, sid, task, 0)
        rep.exits[0]["usage"] = {"cpu_s": cpu, "max_rss_bytes": rss, "source": "rusage"}
        return rep

    store.apply_step_reports("n1", [with_usage(0, 1.25, 50 << 20)])
    assert store.steps_of(job)[0]["usage"] is None  # still running on n2
    store.apply_step_reports("n2", [with_usage(1, 2.5, 80 << 20)])
    (done,) = store.steps_of(job)
    assert done["state"] == "COMPLETED"
    assert done["usage"] == {
        "cpu_s": 3.75,
        "max_rss_bytes": 80 << 20,
        "max_rss_node": "n2",
        "max_rss_task": 1,
    }
    # records without figures (an older agent): no usage, not zeros
    other = step(store, job)
    for node, task in (("n1", 0), ("n2", 1)):
        store.apply_step_reports(node, [ended(att, other, task, 0)])
    assert store.steps_of(job)[1]["usage"] is None


def test_a_running_report_starts_the_step_and_a_stale_token_is_ignored(store: Store) -> None:
    job, att = two_node_job(store)
    sid = step(store, job)
    stale = StepReport(att["id"], sid, "not-the-token", "exited", exits=[{"task": 0}])
    assert not store.apply_step_reports("n1", [stale])
    started = StepReport(att["id"], sid, att["token"], "running", started_at=5.0)
    assert store.apply_step_reports("n1", [started])
    assert store.get_step(job, sid)["start_time"] == 5.0
    # a later node's start does not move the step's start
    assert store.apply_step_reports("n2", [StepReport(**{**started.__dict__, "started_at": 9.0})])
    assert store.get_step(job, sid)["start_time"] == 5.0
    assert store.apply_step_reports("n1", [ended(att, sid, 0, 0)])
    lost = StepReport(att["id"], sid, att["token"], "lost")
    assert store.apply_step_reports("n2", [lost])
    done = store.get_step(job, sid)
    assert done["state"] != "RUNNING" and done["end_time"] is not None


def test_the_node_step_work_read_takes_the_driver_path_and_keeps_live_steps_only(
    store: Store,
) -> None:
    """Every heartbeat of a node with a live job reads its step work (steps._node_step_work_
    query): on SQLite straight through the driver (store/prebuilt.py), with the rows SQLAlchemy
    returns; a step ended on a node is no longer that node's work."""
    job, att = two_node_job(store)
    done, live = step(store, job), step(store, job)
    started = StepReport(att["id"], live, att["token"], "running", started_at=5.0)
    assert store.apply_step_reports("n1", [ended(att, done, 0, 0), started])
    query = _node_step_work_query()
    with store.db.begin(write=False) as conn:
        if store.dialect == "sqlite":
            assert query._plan(conn.dialect) is not None
        for node, want in (("n1", [live]), ("n2", [done, live])):
            mine = query.rows(conn, {"node": node})
            theirs = [dict(r) for r in conn.execute(query.statement, {"node": node}).mappings()]
            assert mine == theirs
            assert sorted(r["step_id"] for r in mine) == want, node
