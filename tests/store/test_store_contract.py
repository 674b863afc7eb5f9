"""The store's contract, written once and run against SQLite and PostgreSQL (`db_url`).

Every behaviour the controller relies on is pinned here: leases and fencing, submission and
arrays, the events trail, user actions, the attempt lifecycle driven by agent reports, node
bookkeeping, and the difference between "the database is down" (StoreUnavailable) and everything
else.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from phalanx.config import load_config
from phalanx.controller.runtime import partition_rows
from phalanx.domain import scheduling
from phalanx.domain.spec import JobSpec, normalize
from phalanx.domain.states import AttemptState, JobState
from phalanx.errors import Fenced, InvalidSpec, InvalidTransition, NotFound, StoreUnavailable
from phalanx.store import arrayinsert, schema
from phalanx.store.store import Fence, Store, TaskReport

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll `cond` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def item(store: Store, **kw: Any) -> tuple[Any, dict[str, Any]]:
    kw.setdefault("argv", ["/bin/true"])
    spec = JobSpec(**kw)
    resolved = normalize(
        spec, store.partition_infos(), default_mem_per_cpu_mb=512, default_requeue=True
    )
    return resolved, spec.model_dump(exclude={"ignored"})


def submit1(store: Store, user: str = "alice", **kw: Any) -> int:
    (ids,) = store.submit([item(store, **kw)], user)
    assert len(ids) == 1
    return ids[0]


def add_node(store: Store, name: str, cpus: int = 4, mem_mb: int = 4096, gpus: int = 0) -> None:
    store.register_node(
        name,
        cpus=cpus,
        mem_mb=mem_mb,
        gpus=[[i, "a100"] for i in range(gpus)],
        features=[],
        addr="127.0.0.1",
        boot_id="b1",
        version="test",
    )


def start(
    store: Store, job_id: int, nodes: list[str], fence: Fence | None = None
) -> dict[str, Any]:
    """Start one attempt of `job_id` on `nodes` (explicit placement) and return it."""
    job = store.get_job(job_id)
    started = store.start_attempts(
        [
            {
                "job_id": job_id,
                "partition": job["partition"],
                "nodes": nodes,
                "cpus_per_node": job["cpus_per_node"],
                "mem_per_node_mb": [job["mem_per_node_mb"]] * len(nodes),
                "gpu_ids": [[] for _ in nodes],
                "exclusive": False,
            }
        ],
        fence,
    )
    assert started == [job_id]
    return store.attempts_of(job_id)[-1]


def schedule(store: Store, fence: Fence | None = None) -> list[int]:
    """One scheduling pass the way the controller does it: plan, then start in one write."""
    snap = store.sched_snapshot()
    plan = scheduling.plan(snap, time.time())
    for jid, why in plan.never:
        store.end_pending(jid, JobState.CANCELLED, why, fence)
    return store.start_attempts(
        [p.start_item() for p in plan.starts],
        fence,
    )


def heard(store: Store, node: str, ago: float) -> None:
    """Set a node's last heartbeat to `ago` seconds ago (database clock), as the failure
    detector would find a node that fell silent then (record_heartbeats never moves a stamp
    back)."""
    with store.db.begin() as conn:
        conn.execute(
            schema.nodes.update()
            .where(schema.nodes.c.name == node)
            .values(last_heartbeat=store.db_time() - ago)
        )


def running(att: dict[str, Any]) -> TaskReport:
    return TaskReport(att["id"], att["token"], "running", started_at=time.time())


def exited(att: dict[str, Any], code: int | None = 0, **extra: Any) -> TaskReport:
    return TaskReport(att["id"], att["token"], "exited", exit={"exit_code": code, **extra})


def kinds(store: Store, job_id: int) -> list[str]:
    return [e["kind"] for e in store.events(job_id=job_id)]


def state(store: Store, job_id: int) -> str:
    return str(store.get_job(job_id)["state"])


@pytest.fixture
def store(migrated_db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    st = Store(migrated_db_url, actor="test")
    st.sync_partitions(partition_rows(load_config()))
    try:
        yield st
    finally:
        st.close()


# --------------------------------------------------------------------------------------------
# schema
# --------------------------------------------------------------------------------------------


def test_migrate_is_idempotent_and_partitions_sync(store: Store) -> None:
    store.migrate()  # a second controller starting up runs it again
    assert set(store.partitions()) == {"batch"}
    info = store.partition_infos()["batch"]
    assert info.default and info.default_time_s == 3600 and info.max_time_s is None
    cfg = load_config(
        overrides={
            "cluster": {
                "partitions": [
                    {"name": "gpu", "nodes": "g*", "max_time": "2:00:00"},
                    {
                        "name": "short",
                        "default": True,
                        "max_time": "30:00",
                        "default_time": "10:00",
                    },
                ]
            }
        }
    )
    store.sync_partitions(partition_rows(cfg))
    infos = store.partition_infos()
    assert set(infos) == {"gpu", "short"}  # batch removed
    assert infos["short"].default and not infos["gpu"].default
    assert infos["gpu"].max_time_s == 7200 and infos["short"].default_time_s == 600


# --------------------------------------------------------------------------------------------
# leases
# --------------------------------------------------------------------------------------------


def test_lease_acquire_hold_and_keep(store: Store) -> None:
    assert store.acquire_lease("sched", "a", ttl=30) == 1
    assert store.acquire_lease("sched", "b", ttl=30) is None  # held and valid
    assert store.acquire_lease("sched", "a", ttl=30) == 1  # the holder keeps its term
    assert store.acquire_lease("cluster", "b", ttl=30) == 1  # leases are independent
    lease = store.get_lease("sched")
    assert lease is not None and lease["holder"] == "a" and lease["term"] == 1
    valid = {x["name"]: x["valid"] for x in store.list_leases()}
    assert valid == {"cluster": True, "sched": True}


def test_lease_takeover_after_expiry_bumps_term(store: Store) -> None:
    assert store.acquire_lease("sched", "a", ttl=0.3) == 1
    assert store.acquire_lease("sched", "b", ttl=30) is None
    term = wait_for(lambda: store.acquire_lease("sched", "b", ttl=30), timeout=10)
    assert term == 2
    # the old holder can neither renew nor re-take the lease while b holds it
    assert store.renew_lease("sched", "a", 1, ttl=30) is False
    assert store.acquire_lease("sched", "a", ttl=30) is None
    assert store.renew_lease("sched", "b", 2, ttl=30) is True
    assert store.renew_lease("sched", "b", 1, ttl=30) is False  # stale term, right holder
    lease = store.get_lease("sched")
    assert lease is not None and (lease["holder"], lease["term"]) == ("b", 2)


def test_lease_release_lets_another_take_over_at_once(store: Store) -> None:
    assert store.acquire_lease("sched", "a", ttl=30) == 1
    assert store.release_lease("sched", "a", 2) is False  # wrong term releases nothing
    assert store.acquire_lease("sched", "b", ttl=30) is None
    assert store.release_lease("sched", "a", 1) is True
    assert store.acquire_lease("sched", "b", ttl=30) == 2
    assert store.renew_lease("sched", "a", 1, ttl=30) is False


def _fenced_pair(store: Store) -> tuple[Fence, Fence]:
    """a held term 1 and lost the lease; b holds term 2."""
    assert store.acquire_lease("sched", "a", ttl=30) == 1
    assert store.release_lease("sched", "a", 1)
    assert store.acquire_lease("sched", "b", ttl=30) == 2
    return Fence("sched", "a", 1), Fence("sched", "b", 2)


def test_stale_fence_writes_nothing(store: Store) -> None:
    add_node(store, "n1")
    old, new = _fenced_pair(store)
    jid = submit1(store)
    events_before = len(store.events())
    job = store.get_job(jid)
    st = {
        "job_id": jid,
        "partition": "batch",
        "nodes": ["n1"],
        "cpus_per_node": 1,
        "mem_per_node_mb": [512],
        "gpu_ids": [[]],
        "exclusive": False,
    }
    with pytest.raises(Fenced):
        store.start_attempts([st], old)
    with pytest.raises(Fenced):
        store.end_pending(jid, JobState.CANCELLED, "never", old)
    with pytest.raises(Fenced):
        store.mark_down("n1", "silent", old)
    with pytest.raises(Fenced):
        store.start_attempts([st], Fence("sched", "b", 1))  # right holder, stale term
    with pytest.raises(Fenced):
        store.start_attempts([st], Fence("nope", "b", 2))  # a lease that does not exist
    assert store.get_job(jid) == job
    assert store.attempts_of(jid) == []
    assert store.list_nodes()[0]["down"] is False
    assert len(store.events()) == events_before
    # the current holder's fence works
    assert store.start_attempts([st], new) == [jid]
    att = store.attempts_of(jid)[0]
    assert att["fence_term"] == 2
    assert store.get_job(jid)["state"] == "STARTING"
    with pytest.raises(Fenced):
        store.fail_node_tasks("n1", "dead", old)
    assert store.attempts_of(jid)[0]["state"] == "STARTING"
    with pytest.raises(Fenced):
        store.requeue_lost_launch(att["id"], "timeout", old)
    assert store.attempts_of(jid)[0]["state"] == "STARTING"


# --------------------------------------------------------------------------------------------
# submit / list / get
# --------------------------------------------------------------------------------------------


def test_submit_single_and_get(store: Store) -> None:
    jid = submit1(store, name="train", cpus_per_task=2, nodes=1, time_limit_s=120)
    job = store.get_job(jid)
    assert job["state"] == "PENDING"
    assert job["name"] == "train" and job["user"] == "alice"
    assert job["partition"] == "batch" and job["partitions"] == "batch"
    assert job["cpus_per_node"] == 2 and job["mem_per_node_mb"] == 1024
    assert job["time_limit_s"] == 120 and job["restart_count"] == 0
    assert job["array_job_id"] is None and job["attempt_id"] is None
    assert job["spec"]["argv"] == ["/bin/true"]
    with pytest.raises(NotFound):
        store.get_job(jid + 1000)


def test_array_expands_to_one_row_per_task(store: Store) -> None:
    (ids,) = store.submit([item(store, array="0-6:2%2", name="arr")], "bob")
    assert len(ids) == 4 and ids == sorted(ids)
    rows = store.list_jobs(ids=ids)
    assert [r["array_task_id"] for r in rows] == [0, 2, 4, 6]
    assert {r["array_job_id"] for r in rows} == {ids[0]}
    assert {r["array_limit"] for r in rows} == {2}
    assert all(r["state"] == "PENDING" and r["user"] == "bob" for r in rows)
    # references: the whole array, or one task
    assert store.resolve_refs([str(ids[0])]) == ids
    assert store.resolve_refs([f"{ids[0]}_4"]) == [ids[2]]
    assert store.resolve_refs([f"{ids[0]}_5"]) == []
    with pytest.raises(InvalidSpec):
        store.resolve_refs(["abc"])
    # one submit event per task
    assert all(kinds(store, i) == ["job.submit"] for i in ids)


def test_array_tasks_are_the_first_task_but_for_their_index(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tasks after the first are expanded by the database from one template row
    (store/arrayinsert.py), a few per statement here: each row, spec and dependency included,
    must be the first task's row but for its id and index, and ids follow the indices."""
    monkeypatch.setattr(arrayinsert, "TASKS_PER_STATEMENT", 3)
    dep = submit1(store)
    (ids,) = store.submit(
        [
            item(
                store,
                array="9,1-4,20-30:5%3",
                name="sweep",
                dependency=f"afterok:{dep}",
                nice=5,
                account="physics",
                env={"A": "b c"},
                licenses="matlab:2",
                time_limit_s=3600,
            )
        ],
        "bob",
    )
    assert len(ids) == 8 and ids == sorted(ids)
    jobs = [store.get_job(i) for i in ids]
    assert [j["array_task_id"] for j in jobs] == [1, 2, 3, 4, 9, 20, 25, 30]
    first = jobs[0]
    assert first["array_job_id"] == ids[0] and first["array_limit"] == 3
    assert first["dependency"][0]["jobs"] == [dep] and first["spec"]["env"] == {"A": "b c"}
    assert first["nice"] == 5 and first["account"] == "physics"
    assert first["time_limit_s"] == 3600 and first["state"] == "PENDING"
    unlike = {"id", "array_task_id", "change_seq"}
    for job in jobs[1:]:
        assert {k: v for k, v in job.items() if k not in unlike} == {
            k: v for k, v in first.items() if k not in unlike
        }
    assert all(kinds(store, i) == ["job.submit"] for i in ids)


def test_batch_submit_and_list_filters(store: Store) -> None:
    out = store.submit(
        [
            item(store, name="a"),
            item(store, name="b", array="1-2"),
            item(store, name="c", hold=True),
        ],
        "carol",
    )
    assert [len(x) for x in out] == [1, 2, 1]
    flat = [i for ids in out for i in ids]
    assert len(set(flat)) == 4
    other = submit1(store, user="dave", name="a")
    assert [r["id"] for r in store.list_jobs()] == [*flat, other]
    assert [r["id"] for r in store.list_jobs(user="carol", name="a")] == [out[0][0]]
    assert [r["id"] for r in store.list_jobs(name="a")] == [out[0][0], other]
    assert [r["id"] for r in store.list_jobs(states=["HELD"])] == out[2]
    held = store.get_job(out[2][0])
    assert held["reason"] == "held by user"
    assert len(store.list_jobs(states=["PENDING", "HELD"], user="carol")) == 4
    assert store.list_jobs(partition="nope") == []
    assert len(store.list_jobs(limit=2)) == 2


def test_list_by_node_applies_the_limit_after_the_filter(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    early = [submit1(store) for _ in range(3)]
    late = [submit1(store) for _ in range(2)]
    for jid in early:
        start(store, jid, ["n1"])
    for jid in late:
        start(store, jid, ["n2"])
    assert [r["id"] for r in store.list_jobs(node="n2")] == late
    assert [r["id"] for r in store.list_jobs(node="n2", limit=1)] == late[:1]
    assert [r["id"] for r in store.list_jobs(node="n1", limit=2)] == early[:2]


def test_dependency_resolution_and_unknown_job(store: Store) -> None:
    first = submit1(store)
    (arr,) = store.submit([item(store, array="0-1")], "alice")
    dep = submit1(store, dependency=f"afterok:{first}:{arr[0]},afterany:{arr[0]}_1")
    assert store.get_job(dep)["dependency"] == [
        {"type": "afterok", "jobs": [first, *arr]},
        {"type": "afterany", "jobs": [arr[1]]},
    ]
    before = len(store.list_jobs())
    with pytest.raises(InvalidSpec) as err:
        submit1(store, dependency="afterok:99999")
    assert err.value.details["field"] == "dependency"
    assert "99999" in err.value.message
    # a batch with one bad item inserts nothing at all
    with pytest.raises(InvalidSpec):
        store.submit([item(store), item(store, dependency=f"afterok:{arr[0]}_7")], "alice")
    assert len(store.list_jobs()) == before


# --------------------------------------------------------------------------------------------
# user actions and events
# --------------------------------------------------------------------------------------------


def test_hold_release_cancel_outcomes_and_events(store: Store) -> None:
    a, b = submit1(store), submit1(store)
    assert store.hold([a, 999_999], "ops") == {a: "held", 999_999: "not found"}
    assert state(store, a) == "HELD" and store.get_job(a)["reason"] == "held by ops"
    assert store.hold([a], "ops") == {a: "not pending (state HELD)"}
    assert store.release([b], "ops") == {b: "not held (state PENDING)"}
    assert store.release([a], "ops") == {a: "released"}
    assert state(store, a) == "PENDING" and store.get_job(a)["reason"] is None
    assert store.cancel([a, b, 999_999], "ops", "no longer needed") == {
        a: "cancelled",
        b: "cancelled",
        999_999: "not found",
    }
    job = store.get_job(a)
    assert job["state"] == "CANCELLED" and job["reason"] == "no longer needed by ops"
    assert job["end_time"] is not None
    assert store.cancel([a], "ops") == {a: "already CANCELLED"}
    assert store.hold([a], "ops") == {a: "not pending (state CANCELLED)"}
    assert kinds(store, a) == ["job.submit", "job.held", "job.pending", "job.cancelled"]
    assert kinds(store, b) == ["job.submit", "job.cancelled"]
    ev = store.events(job_id=a)[1]
    assert ev["actor"] == "ops" and ev["data"] == {"from": "PENDING", "to": "HELD"}
    # a held job can be cancelled directly
    c = submit1(store, hold=True)
    assert store.cancel([c], "ops") == {c: "cancelled"}
    assert state(store, c) == "CANCELLED"


def test_events_filters_and_add_event(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    store.add_event("custom.thing", "hello", node="n1", job_id=jid)
    node_events = store.events(node="n1")
    assert [e["kind"] for e in node_events] == ["node.register", "custom.thing"]
    first = store.events()[0]["id"]
    assert all(e["id"] > first for e in store.events(since_id=first))
    assert len(store.events(limit=1)) == 1
    assert store.events(job_id=jid)[-1]["message"] == "hello"
    for i in range(5):
        store.add_event("custom.more", f"m{i}", node="n1")
    newest = store.events(node="n1", limit=2, newest=True)  # the last two, oldest first
    assert [e["message"] for e in newest] == ["m3", "m4"]
    assert [e["kind"] for e in store.events(node="n1", limit=2)] == [
        "node.register",
        "custom.thing",
    ]


# --------------------------------------------------------------------------------------------
# attempts and agent reports
# --------------------------------------------------------------------------------------------


def test_lifecycle_to_completed(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, time_limit_s=600)
    gen0, total0 = store.node_gens()["n1"], store.node_gens_total()
    assert schedule(store) == [jid]
    job = store.get_job(jid)
    assert job["state"] == "STARTING" and job["nodelist_run"] == ["n1"]
    assert store.node_gens()["n1"] > gen0  # the agent's long-poll is woken
    assert store.node_gens_total() > total0  # ... and a poll of the sum alone sees it
    (att,) = store.attempts_of(jid)
    assert job["attempt_id"] == att["id"]
    assert att["state"] == "STARTING" and att["seq"] == 0 and att["nodes"] == ["n1"]
    assert [t["state"] for t in att["tasks"]] == ["STARTING"]
    work = store.node_work("n1")
    assert [(w["job_id"], w["task_state"], w["token"]) for w in work] == [
        (jid, "STARTING", att["token"])
    ]

    store.apply_reports("n1", [running(att)], time.time())
    job = store.get_job(jid)
    att = store.attempts_of(jid)[0]
    assert job["state"] == "RUNNING" and job["start_time"] is not None
    assert att["state"] == "RUNNING" and att["expected_end"] == pytest.approx(
        att["start_time"] + 600
    )
    # a repeated report changes nothing and adds no event
    n_events = len(store.events(job_id=jid))
    store.apply_reports("n1", [running(att)], time.time())
    assert len(store.events(job_id=jid)) == n_events

    store.apply_reports("n1", [exited(att, 0)], time.time())
    job = store.get_job(jid)
    assert job["state"] == "COMPLETED" and job["exit_code"] == 0 and job["end_time"] is not None
    att = store.attempts_of(jid)[0]
    assert att["state"] == "ENDED" and att["result"] == "COMPLETED"
    assert store.node_work("n1") == []
    assert kinds(store, jid) == ["job.submit", "job.starting", "job.running", "job.completed"]
    assert store.list_nodes()[0]["used"] == {"cpus": 0, "mem_mb": 0, "gpus": 0, "jobs": []}


def test_exit_code_three_is_failed(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    assert [w["attempt_id"] for w in store.node_work("n1")] == [att["id"]]  # still live
    store.apply_reports("n1", [exited(att, 3)], None)
    job = store.get_job(jid)
    assert job["state"] == "FAILED" and job["exit_code"] == 3
    assert "exited with code 3" in job["reason"]
    assert kinds(store, jid)[-1] == "job.failed"


def test_exit_without_running_report_still_completes(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [exited(att, 0, started_at=time.time() - 1)], None)
    assert state(store, jid) == "COMPLETED"


def test_timed_out_is_timeout(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, time_limit_s=60)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.apply_reports("n1", [exited(att, None, signal=9, timed_out=True)], None)
    job = store.get_job(jid)
    assert job["state"] == "TIMEOUT" and job["exit_signal"] == 9
    assert store.attempts_of(jid)[0]["result"] == "TIMEOUT"


def test_oom_is_out_of_memory(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [exited(att, None, signal=9, oom=True)], None)
    assert state(store, jid) == "OUT_OF_MEMORY"


def test_wrong_token_report_is_ignored(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    bogus = {**att, "token": "not-the-token"}
    store.apply_reports("n1", [running(bogus)], None)
    assert state(store, jid) == "STARTING"
    store.apply_reports("n1", [exited(bogus, 0)], None)
    assert state(store, jid) == "STARTING"
    # and a report from a node the attempt does not run on is ignored too
    add_node(store, "n2")
    store.apply_reports("n2", [exited(att, 0)], None)
    assert state(store, jid) == "STARTING"


def test_multi_node_failure_stops_peers_then_fails(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, nodes=2)
    att = start(store, jid, ["n1", "n2"])
    store.apply_reports("n1", [running(att)], None)
    assert state(store, jid) == "RUNNING"  # one started task is enough to be running
    store.apply_reports("n2", [running(att)], None)
    gens = store.node_gens()
    store.apply_reports("n1", [exited(att, 1)], None)
    att_row = store.attempts_of(jid)[0]
    assert att_row["state"] == "STOPPING"
    assert "n1" in att_row["stop_reason"] and "stopping the other nodes" in att_row["stop_reason"]
    assert state(store, jid) == "COMPLETING"
    new_gens = store.node_gens()
    assert new_gens["n2"] > gens["n2"] and new_gens["n1"] > gens["n1"]
    # n2's work now shows a stopping attempt (the reply will tell the agent to kill it)
    (w,) = store.node_work("n2")
    assert w["attempt_state"] == "STOPPING"
    store.apply_reports("n2", [exited(att, None, signal=15)], None)
    job = store.get_job(jid)
    assert job["state"] == "FAILED" and job["exit_code"] == 1
    assert kinds(store, jid) == [
        "job.submit",
        "job.starting",
        "job.running",
        "job.completing",
        "job.failed",
    ]


def test_batch_step_ends_the_job_and_releases_the_other_nodes(store: Store) -> None:
    """Slurm's batch step: the script on the first node decides the job; when it ends the
    other nodes' holders are stopped, and their being stopped is no failure."""
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, nodes=2)
    att = start(store, jid, ["n1", "n2"])
    store.apply_reports("n2", [running(att)], None)
    gens = store.node_gens()
    store.apply_reports("n1", [exited(att, 0, started_at=time.time() - 1)], None)
    assert state(store, jid) == "COMPLETING"
    assert store.attempts_of(jid)[0]["state"] == "STOPPING"
    assert store.node_gens()["n2"] > gens["n2"]  # the holder's agent is woken to stop it
    store.apply_reports(
        "n2", [exited(att, None, signal=15, cancelled=True, stop_requested=True)], None
    )
    job = store.get_job(jid)
    assert (job["state"], job["exit_code"]) == ("COMPLETED", 0)
    # the batch step's own failure is the job's, with its code
    jid = submit1(store, nodes=2)
    att = start(store, jid, ["n1", "n2"])
    store.apply_reports("n1", [exited(att, 3, started_at=time.time() - 1)], None)
    store.apply_reports("n2", [exited(att, None, signal=15, cancelled=True)], None)
    job = store.get_job(jid)
    assert (job["state"], job["exit_code"]) == ("FAILED", 3)


def test_batch_step_node_lost_under_a_holder_is_a_node_failure(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, nodes=2)
    att = start(store, jid, ["n1", "n2"])
    store.apply_reports("n1", [running(att)], None)
    store.apply_reports(
        "n2", [TaskReport(att["id"], att["token"], "lost", exit={"error": "gone"})], None
    )
    assert store.attempts_of(jid)[0]["state"] == "STOPPING"  # the batch step is stopped
    store.apply_reports("n1", [exited(att, None, signal=15, cancelled=True)], None)
    assert store.attempts_of(jid)[0]["result"] == "NODE_FAIL"
    assert state(store, jid) == "PENDING"  # requeued, as any node failure


def test_multi_node_all_succeed(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    jid = submit1(store, nodes=2, all_nodes=True)  # the script on every node
    att = start(store, jid, ["n1", "n2"])
    store.apply_reports("n1", [exited(att, 0, started_at=time.time() - 1)], None)
    assert state(store, jid) == "RUNNING"  # the other task is still going
    assert store.attempts_of(jid)[0]["state"] == "RUNNING"
    store.apply_reports("n2", [exited(att, 0)], None)
    assert state(store, jid) == "COMPLETED"


def test_cancel_running_job(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    assert store.cancel([jid], "ops") == {jid: "stopping"}
    job = store.get_job(jid)
    assert job["state"] == "COMPLETING"
    att_row = store.attempts_of(jid)[0]
    assert att_row["state"] == "STOPPING" and att_row["stop_reason"].startswith("cancel")
    assert store.cancel([jid], "ops") == {jid: "stopping"}  # idempotent
    assert kinds(store, jid).count("job.completing") == 1
    store.apply_reports("n1", [exited(att, None, signal=15)], None)
    job = store.get_job(jid)
    assert job["state"] == "CANCELLED" and job["reason"] == "cancelled by ops"


def test_signal_is_recorded_on_the_running_attempt_for_its_nodes(store: Store) -> None:
    add_node(store, "n1")
    add_node(store, "n2")
    pending, jid = submit1(store), submit1(store, nodes=2)
    assert store.signal([pending, 999_999], 10, "batch", "alice") == {
        pending: "pending",
        999_999: "not found",
    }
    att = start(store, jid, ["n1", "n2"])
    gens = store.node_gens()
    assert store.signal([jid], 10, "batch", "alice") == {jid: "signalled"}
    assert store.signal([jid], 12, "full", "alice") == {jid: "signalled"}
    assert all(store.node_gens()[n] > gens[n] for n in ("n1", "n2"))  # wakes their long-polls
    want = [
        {"seq": 1, "signum": 10, "target": "batch"},
        {"seq": 2, "signum": 12, "target": "full"},
    ]
    for n in ("n1", "n2"):
        (work,) = store.node_work(n)
        assert work["attempt_signals"] == want
    assert store.attempts_of(jid)[0]["signals"] == want
    ev = [e for e in store.events(job_id=jid) if e["kind"] == "job.signal"]
    assert [e["actor"] for e in ev] == ["alice", "alice"] and ev[0]["data"]["seq"] == 1
    # completing or ended: refused; the signals stay with their attempt, not the next one
    store.apply_reports("n1", [running(att)], None)
    assert store.cancel([jid], "ops") == {jid: "stopping"}
    assert store.signal([jid], 10, "batch", "alice") == {jid: "done"}


def test_cancel_before_launch_is_cleaned_up_by_report(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    start(store, jid, ["n1"])
    assert store.cancel([jid], "ops") == {jid: "stopping"}
    # the agent never launched it: a heartbeat that does not mention it finishes it
    store.apply_reports("n1", [], time.time())
    assert state(store, jid) == "CANCELLED"
    assert store.node_work("n1") == []


@pytest.mark.parametrize("requeue", [True, False])
def test_lost_task(store: Store, requeue: bool) -> None:
    add_node(store, "n1")
    jid = submit1(store, requeue=requeue)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)
    store.apply_reports(
        "n1", [TaskReport(att["id"], att["token"], "lost", exit={"error": "gone"})], None
    )
    job = store.get_job(jid)
    att_row = store.attempts_of(jid)[0]
    assert att_row["state"] == "ENDED" and att_row["result"] == "NODE_FAIL"
    if requeue:
        assert job["state"] == "PENDING" and job["restart_count"] == 1
        assert job["reason"].startswith("requeued after node failure")
        assert kinds(store, jid)[-1] == "job.requeue"
        # it runs again as attempt seq 1
        att2 = start(store, jid, ["n1"])
        assert att2["seq"] == 1 and att2["id"] != att["id"] and att2["token"] != att["token"]
        # a late report about the old attempt changes nothing
        store.apply_reports("n1", [exited(att, 0)], None)
        assert state(store, jid) == "STARTING"
    else:
        assert job["state"] == "NODE_FAIL" and job["restart_count"] == 0
        assert kinds(store, jid)[-1] == "job.node_fail"


def test_task_unknown_to_agent_is_lost(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, requeue=False)
    att = start(store, jid, ["n1"])
    t0 = time.time()
    store.apply_reports("n1", [running(att)], None)
    # a report taken before the task started does not count against it
    store.apply_reports("n1", [], t0 - 10)
    assert state(store, jid) == "RUNNING"
    store.apply_reports("n1", [], time.time() + 1)
    assert state(store, jid) == "NODE_FAIL"
    assert "no longer knows" in store.get_job(jid)["reason"]


def test_fail_node_tasks(store: Store) -> None:
    for n in ("n1", "n2"):
        add_node(store, n)
    single = submit1(store, requeue=True)
    multi = submit1(store, nodes=2, requeue=True)
    other = submit1(store, requeue=False)
    a_single = start(store, single, ["n1"])
    a_multi = start(store, multi, ["n1", "n2"])
    a_other = start(store, other, ["n2"])
    for att, nodes in ((a_single, ["n1"]), (a_multi, ["n1", "n2"]), (a_other, ["n2"])):
        for n in nodes:
            store.apply_reports(n, [running(att)], None)
    assert store.mark_down("n1", "silent", None) is True  # and, in the same write, its tasks
    s1 = store.get_job(single)
    assert s1["state"] == "PENDING" and s1["restart_count"] == 1
    # the multi-node job waits for its surviving task to be killed
    assert state(store, multi) == "COMPLETING"
    assert store.attempts_of(multi)[0]["state"] == "STOPPING"
    assert state(store, other) == "RUNNING"  # untouched
    assert store.fail_node_tasks("n1", "again", None) == []  # nothing left there
    store.apply_reports("n2", [exited(a_multi, None, signal=15)], None)
    m = store.get_job(multi)
    assert m["state"] == "PENDING" and m["restart_count"] == 1
    assert store.attempts_of(multi)[0]["result"] == "NODE_FAIL"
    assert state(store, other) == "RUNNING"


def test_node_death_is_one_transaction(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store error while a dead node's tasks are failed undoes the DOWN mark too: never a
    DOWN node whose tasks still RUN (the detector only looks at nodes not yet DOWN)."""
    add_node(store, "n1")
    jid = submit1(store, requeue=True)
    att = start(store, jid, ["n1"])
    store.apply_reports("n1", [running(att)], None)

    def store_error(*_: Any) -> None:
        raise StoreUnavailable("the database went away mid-transaction")

    with monkeypatch.context() as m:
        m.setattr(store, "_advance_attempt", store_error)
        with pytest.raises(StoreUnavailable):
            store.mark_down("n1", "silent", None)
    assert store.get_node("n1")["down"] is False
    assert store.attempts_of(jid)[0]["tasks"][0]["state"] == "RUNNING"
    assert [e["kind"] for e in store.events(node="n1")].count("node.down") == 0
    # retried by the next detector tick: both happen, together
    assert store.mark_down("n1", "silent", None) is True
    assert store.attempts_of(jid)[0]["tasks"][0]["state"] == "LOST"
    assert store.get_job(jid)["state"] == "PENDING"
    assert store.down_nodes_with_tasks() == []


def test_a_down_node_left_with_live_tasks_is_found_and_repaired(store: Store) -> None:
    """Rows an older version could leave (DOWN marked, its tasks never failed) are listed for
    the failure detector, and failing them ends the ghost attempt."""
    from sqlalchemy import update

    from phalanx.store import schema as s

    for n in ("n1", "n2"):
        add_node(store, n)
    ghost = submit1(store, requeue=False)
    fine = submit1(store, requeue=False)
    a_ghost = start(store, ghost, ["n1"])
    a_fine = start(store, fine, ["n2"])
    store.apply_reports("n1", [running(a_ghost)], None)
    store.apply_reports("n2", [running(a_fine)], None)
    assert store.down_nodes_with_tasks() == []
    with store.db.begin() as conn:  # the split an older controller's death left behind
        conn.execute(update(s.nodes).where(s.nodes.c.name == "n1").values(down=True))
    assert store.down_nodes_with_tasks() == ["n1"]
    assert store.fail_node_tasks("n1", "node n1 is DOWN", None) == [a_ghost["id"]]
    assert state(store, ghost) == "NODE_FAIL"
    assert state(store, fine) == "RUNNING"
    assert store.down_nodes_with_tasks() == []


def test_requeue_lost_launch(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    assert store.stale_starting_attempts(time.time() + 1)[0]["id"] == att["id"]
    assert store.stale_starting_attempts(time.time() - 60) == []
    assert store.requeue_lost_launch(att["id"], "no agent confirmed", None) is True
    job = store.get_job(jid)
    assert job["state"] == "PENDING" and job["restart_count"] == 1
    assert store.requeue_lost_launch(att["id"], "again", None) is False


def test_start_attempts_skips_non_pending(store: Store) -> None:
    add_node(store, "n1")
    jid = submit1(store, hold=True)
    st = {
        "job_id": jid,
        "partition": "batch",
        "nodes": ["n1"],
        "cpus_per_node": 1,
        "mem_per_node_mb": [512],
        "gpu_ids": [[]],
        "exclusive": False,
    }
    assert store.start_attempts([st, {**st, "job_id": 99_999}], None) == []
    assert store.attempts_of(jid) == []


def test_scheduler_snapshot_and_end_pending(store: Store) -> None:
    add_node(store, "n1", cpus=2)
    a = submit1(store, cpus_per_task=2)
    b = submit1(store, dependency=f"afterok:{a}")
    c = submit1(store, priority=10, cpus_per_task=2, hold=True)
    snap = store.sched_snapshot()
    assert [j["id"] for j in snap.pending] == [a, b]  # held jobs are not pending
    assert snap.dep_states == {a: JobState.PENDING}
    assert schedule(store) == [a]
    snap = store.sched_snapshot()
    assert [(x["job_id"], x["node"], x["cpus"]) for x in snap.allocations] == [(a, "n1", 2)]
    assert "script" not in {n for n, _ in snap.active_names}
    att = store.attempts_of(a)[0]
    store.apply_reports("n1", [exited(att, 1)], None)
    assert state(store, a) == "FAILED"
    store.release([c], "ops")
    assert schedule(store) == [c]  # b can never run: cancelled, c starts
    job_b = store.get_job(b)
    assert job_b["state"] == "CANCELLED" and "can never be satisfied" in job_b["reason"]
    assert store.end_pending(b, JobState.CANCELLED, "again", None) is False


def test_set_pending_reasons(store: Store) -> None:
    a = submit1(store)
    b = submit1(store, hold=True)
    n = len(store.events())
    store.set_pending_reasons({a: "Resources", b: "Priority"})
    assert store.get_job(a)["reason"] == "Resources"
    assert store.get_job(b)["reason"] == "held by user"  # only pending jobs
    assert len(store.events()) == n  # not a state change


# --------------------------------------------------------------------------------------------
# nodes
# --------------------------------------------------------------------------------------------


def test_register_heartbeat_down_and_back(store: Store) -> None:
    row = store.register_node(
        "n1",
        cpus=8,
        mem_mb=16000,
        gpus=[[0, "h100"], [1, "h100"]],
        features=["ib", "ib", "avx"],
        addr="10.0.0.1",
        boot_id="b",
        version="1",
    )
    assert row["registered"] and row["cpus"] == 8 and row["features"] == ["avx", "ib"]
    assert row["gpus"] == [[0, "h100"], [1, "h100"]] and row["down"] is False
    heard(store, "n1", 60.0)  # silent for a minute since it registered
    store.record_heartbeats({"n1": 5.0, "ghost": 1.0})  # an unknown node is harmless
    hb = store.list_nodes()[0]["last_heartbeat"]
    assert store.db_time() - hb == pytest.approx(5.0, abs=2.0)
    assert store.mark_down("n1", "no heartbeat", None) is True
    assert store.mark_down("n1", "no heartbeat", None) is False  # already down: no new event
    node = store.get_node("n1")
    assert node["down"] and node["down_reason"] == "no heartbeat"
    assert store.cluster_counts()["nodes"] == {"total": 1, "down": 1, "drain": 0}
    store.register_node(
        "n1", cpus=8, mem_mb=16000, gpus=[], features=[], addr=None, boot_id="c", version="1"
    )
    node = store.get_node("n1")
    assert not node["down"] and node["down_reason"] is None and node["gpus"] == []
    assert [e["kind"] for e in store.events(node="n1")] == ["node.register", "node.down", "node.up"]
    with pytest.raises(NotFound):
        store.get_node("ghost")


def test_the_failure_detector_reads_only_silent_nodes(store: Store) -> None:
    for name in ("quiet", "fresh", "gone"):
        add_node(store, name)
        heard(store, name, 600.0)  # a stamp only moves forward: start from long ago
    store.record_heartbeats({"quiet": 60.0, "fresh": 1.0, "gone": 60.0})  # seconds ago
    assert store.mark_down("gone", "no heartbeat", None)
    rows = store.silent_node_rows(store.db_time() - 30.0)
    assert [r["name"] for r in rows] == ["quiet"]
    assert store.db_time() - rows[0]["last_heartbeat"] == pytest.approx(60.0, abs=5.0)
    assert store.silent_node_rows(store.db_time() - 120.0) == []


def test_drain_and_resume(store: Store) -> None:
    add_node(store, "n1")
    with pytest.raises(InvalidSpec):
        store.drain("n1", "  ", "ops")
    with pytest.raises(NotFound):
        store.drain("ghost", "maintenance", "ops")
    with pytest.raises(InvalidTransition):
        store.resume("n1", "ops")  # neither drained nor down
    store.drain("n1", "maintenance", "ops")
    node = store.get_node("n1")
    assert node["drain"] and node["drain_reason"] == "maintenance" and node["drain_by"] == "ops"
    # a drained node gets no new work
    submit1(store)
    assert schedule(store) == []
    store.resume("n1", "ops")
    node = store.get_node("n1")
    assert not node["drain"] and node["drain_reason"] is None
    assert len(schedule(store)) == 1
    assert [e["kind"] for e in store.events(node="n1")] == [
        "node.register",
        "node.drain",
        "node.resume",
    ]
    with pytest.raises(NotFound):
        store.resume("ghost", "ops")


def test_node_usage_and_cluster_counts(store: Store) -> None:
    add_node(store, "n1", cpus=8, mem_mb=8192)
    jid = submit1(store, cpus_per_task=3, mem_mb=2000)
    start(store, jid, ["n1"])
    used = store.get_node("n1")["used"]
    assert used == {"cpus": 3, "mem_mb": 2000, "gpus": 0, "jobs": [jid]}
    submit1(store, hold=True)
    counts = store.cluster_counts()
    assert counts["jobs"] == {"STARTING": 1, "HELD": 1}
    assert counts["nodes"] == {"total": 1, "down": 0, "drain": 0}


def test_controllers_registry(store: Store) -> None:
    store.register_controller("c1", "http://a:1")
    store.register_controller("c1", "http://a:2")
    store.register_controller("c2", None)
    store.touch_controller("c2")
    rows = store.list_controllers()
    assert [(r["id"], r["url"]) for r in rows] == [("c1", "http://a:2"), ("c2", None)]
    assert [e["kind"] for e in store.events()].count("controller.start") == 3


# --------------------------------------------------------------------------------------------
# the database cannot be reached
# --------------------------------------------------------------------------------------------


def test_sqlite_missing_directory_is_store_unavailable(tmp_path: Any) -> None:
    with pytest.raises(StoreUnavailable) as err:
        st = Store(f"sqlite:///{tmp_path}/missing/dir/phalanx.db")
        st.get_lease("sched")
    assert "does not exist" in err.value.message


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.postgres
def test_postgres_closed_port_is_store_unavailable() -> None:
    st = Store(f"postgresql://postgres@127.0.0.1:{_closed_port()}/phalanx", connect_timeout=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as err:
            st.acquire_lease("sched", "a", ttl=5)
        assert time.monotonic() - t0 < 10
        assert err.value.http_status == 503
        with pytest.raises(StoreUnavailable):
            st.get_job(1)
    finally:
        st.close()


@pytest.mark.postgres
def test_postgres_paused_server_is_store_unavailable(pg_url: str, pg_server: Any) -> None:
    setup = Store(pg_url)
    setup.migrate()
    setup.close()  # no pooled connections: the next store must connect while the host hangs
    st = Store(pg_url, connect_timeout=1)
    try:
        with pg_server.paused():
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                st.acquire_lease("sched", "a", ttl=5)
            assert time.monotonic() - t0 < 10
        # and once the database is back the same store works again
        assert st.acquire_lease("sched", "a", ttl=5) == 1
    finally:
        st.close()


def test_integrity_problems_are_not_store_unavailable(store: Store) -> None:
    """A bug or a lost race must not masquerade as an outage (and be retried forever)."""
    add_node(store, "n1")
    jid = submit1(store)
    att = start(store, jid, ["n1"])
    assert att["state"] == AttemptState.STARTING
    from sqlalchemy import insert
    from sqlalchemy.exc import IntegrityError

    from phalanx.store import schema as s

    with pytest.raises(IntegrityError), store.db.begin() as conn:  # duplicate primary key
        conn.execute(insert(s.tasks).values(**{k: v for k, v in att["tasks"][0].items()}))


@pytest.mark.postgres
def test_postgres_hung_host_with_pooled_connection_is_store_unavailable(
    pg_url: str, pg_server: Any
) -> None:
    """A pooled connection to a frozen server is cut after db_op_timeout (engine.Watchdog)."""
    import threading

    st = Store(pg_url, connect_timeout=1)
    st.migrate()
    st.get_lease("sched")  # leaves a connection in the pool
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            st.get_lease("sched")
            outcome["result"] = "answered"
        except StoreUnavailable as e:
            outcome["result"] = e

    try:
        with pg_server.paused():
            worker = threading.Thread(target=call, daemon=True)
            worker.start()
            worker.join(3.0)
            got = outcome.get("result")
        worker.join(10.0)  # resumed: the stuck call finishes
        assert isinstance(got, StoreUnavailable), f"no StoreUnavailable within 3 s (got {got!r})"
    finally:
        st.close()
