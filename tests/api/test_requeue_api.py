"""`POST /v1/jobs/requeue`, `POST /v1/jobs/update` and the history filters of `GET /v1/jobs`
against the real app and store: what scontrol requeue/requeuehold/update and sacct rely on."""

from __future__ import annotations

import time
from typing import Any

from api_auth import ADMIN, as_user
from fastapi.testclient import TestClient
from test_api import Agent, job, run_to_start, submit

from phalanx.controller.runtime import Controller

ALICE = as_user("alice")
BOB = as_user("bob")


def requeue(client: TestClient, jid: int, who: dict[str, str], hold: bool = False) -> Any:
    return client.post("/v1/jobs/requeue", json={"jobs": [str(jid)], "hold": hold}, headers=who)


def running(client: TestClient, ctl: Controller, agent: Agent) -> tuple[int, dict[str, Any]]:
    agent.register(cpus=4)
    (jid,) = submit(client, signal="B:USR1@30")
    start = run_to_start(ctl, agent)
    agent.heartbeat([Agent.report(start, "running")])
    assert job(client, jid)["state"] == "RUNNING"
    return jid, start


def test_a_running_job_requeues_without_a_checkpoint_signal_and_restarts(
    client: TestClient, ctl: Controller
) -> None:
    agent = Agent(client, "n1")
    jid, start = running(client, ctl, agent)
    r = requeue(client, jid, ADMIN)
    assert r.status_code == 200 and r.json()["results"] == {str(jid): "requeued"}, r.text
    assert job(client, jid)["state"] == "COMPLETING"
    (stop,) = agent.heartbeat([Agent.report(start, "running")])["stop"]
    # the job asked for this itself: it is stopped, not given its --signal/checkpoint signal
    assert stop["reason"].startswith("requeue: requested by ")
    assert "checkpoint_signal" not in stop
    # a second requeue while it stops is the same request: accepted, nothing changes
    assert requeue(client, jid, ADMIN).json()["results"] == {str(jid): "requeued"}
    # the job exits 0 right after its requeue call: the requeue wins over COMPLETED
    agent.heartbeat([Agent.report(start, "exited", exit_code=0)])
    j = job(client, jid)
    assert j["state"] == "PENDING" and j["restart_count"] == 1 and j["retries"] == 0, j
    second = run_to_start(ctl, agent)
    assert second["env"]["SLURM_RESTART_COUNT"] == "1"
    agent.heartbeat([Agent.report(second, "exited", exit_code=0)])
    assert job(client, jid)["state"] == "COMPLETED"


def test_requeuehold_leaves_it_held(client: TestClient, ctl: Controller) -> None:
    agent = Agent(client, "n1")
    jid, start = running(client, ctl, agent)
    assert requeue(client, jid, ADMIN, hold=True).json()["results"] == {
        str(jid): "requeued and held"
    }
    agent.heartbeat([Agent.report(start, "exited", exit_signal=15)])
    j = job(client, jid)
    assert j["state"] == "HELD" and j["restart_count"] == 1, j
    assert ctl.schedule_tick() == "idle"  # held: nothing starts until a release


def test_another_stop_is_not_turned_into_a_requeue(client: TestClient, ctl: Controller) -> None:
    agent = Agent(client, "n1")
    jid, start = running(client, ctl, agent)
    client.post("/v1/jobs/cancel", json={"jobs": [str(jid)]})
    res = requeue(client, jid, ADMIN).json()["results"][str(jid)]
    assert res.startswith("completing: the job is already stopping (cancel: "), res
    agent.heartbeat([Agent.report(start, "exited", exit_signal=15)])
    assert job(client, jid)["state"] == "CANCELLED"


def test_finished_pending_and_no_requeue_jobs(client: TestClient, ctl: Controller) -> None:
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    (done,) = submit(client)
    start = run_to_start(ctl, agent)
    agent.heartbeat([Agent.report(start, "exited", exit_code=3)])
    assert job(client, done)["state"] == "FAILED"
    # a finished job goes back to the queue, as Slurm allows
    assert requeue(client, done, ADMIN).json()["results"] == {str(done): "requeued"}
    j = job(client, done)
    assert (j["state"], j["restart_count"], j["end_time"]) == ("PENDING", 1, None)
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{done}/events").json()["events"]]
    assert kinds[-1] == "job.requeue"
    # a pending job: nothing to requeue (an error), requeuehold holds it
    res = requeue(client, done, ADMIN).json()["results"][str(done)]
    assert res.startswith("pending:")
    assert requeue(client, done, ADMIN, hold=True).json()["results"] == {str(done): "held"}
    # --no-requeue: refused, as Slurm refuses it
    (never,) = submit(client, requeue=False)
    res = requeue(client, never, ADMIN).json()["results"][str(never)]
    assert res.startswith("not requeue-able"), res
    # an unknown job: 404
    r = client.post("/v1/jobs/requeue", json={"jobs": ["99999"]})
    assert r.status_code == 404


def test_users_requeue_only_their_own_jobs(client: TestClient, ctl: Controller) -> None:
    r = client.post("/v1/jobs", json={"argv": ["/bin/true"]}, headers=ALICE)
    jid = int(r.json()["job_id"])
    r = requeue(client, jid, BOB, hold=True)
    assert r.status_code == 403 and "belongs to alice" in r.json()["error"]["message"]
    assert job(client, jid)["state"] == "PENDING"
    assert requeue(client, jid, ALICE, hold=True).json()["results"] == {str(jid): "held"}


def test_update_pending_jobs(client: TestClient, ctl: Controller) -> None:
    r = client.post("/v1/jobs", json={"argv": ["/bin/true"], "time_limit_s": 1800}, headers=ALICE)
    jid = int(r.json()["job_id"])

    def update(who: dict[str, str], **changes: Any) -> Any:
        return client.post("/v1/jobs/update", json={"jobs": [str(jid)], **changes}, headers=who)

    assert update(ALICE, time_limit="10:00").json()["results"] == {str(jid): "updated"}
    assert job(client, jid)["time_limit_s"] == 600
    # a user may not raise it; an operator (admin) may, within the partition's maximum
    res = update(ALICE, time_limit="20:00").json()["results"][str(jid)]
    assert res.startswith("time limit: a user may only lower"), res
    assert update(ADMIN, time_limit="20:00").json()["results"] == {str(jid): "updated"}
    res = update(ADMIN, time_limit="3:00:00").json()["results"][str(jid)]
    assert "partition's maximum" in res
    assert update(ALICE, partition="long", nodes=2).json()["results"] == {str(jid): "updated"}
    j = job(client, jid)
    assert (j["partition"], j["nodes"]) == ("long", 2)
    r = update(ALICE, partition="nope")
    assert r.status_code == 422 and "partition nope does not exist" in r.json()["error"]["message"]
    r = client.post("/v1/jobs", json={"argv": ["/bin/true"]}, headers=ALICE)
    other = int(r.json()["job_id"])
    assert update(ALICE, dependency=f"afterok:{other}").json()["results"] == {str(jid): "updated"}
    assert job(client, jid)["dependency"] == [{"type": "afterok", "jobs": [other]}]
    assert update(ALICE, dependency="").json()["results"] == {str(jid): "updated"}
    assert job(client, jid)["dependency"] == []
    r = update(ALICE)
    assert r.status_code == 422 and "nothing to change" in r.json()["error"]["message"]
    r = update(ALICE, shared=1)
    assert r.status_code == 422


def test_a_running_job_cannot_be_updated(client: TestClient, ctl: Controller) -> None:
    agent = Agent(client, "n1")
    jid, _ = running(client, ctl, agent)
    r = client.post("/v1/jobs/update", json={"jobs": [str(jid)], "time_limit": "5:00"})
    res = r.json()["results"][str(jid)]
    assert res.endswith("only a pending job can be changed here (its allocation is already made)")
    # with a label beside it, the whole change is refused: nothing half done
    r = client.post(
        "/v1/jobs/update", json={"jobs": [str(jid)], "time_limit": "5:00", "comment": "x"}
    )
    assert r.json()["results"][str(jid)].startswith("running: only a pending job")
    assert job(client, jid).get("comment") in (None, "")


def test_labels_of_pending_and_running_jobs_can_be_changed(
    client: TestClient, ctl: Controller
) -> None:
    """scontrol update JobId=N Comment=... / JobName=...: scripts tag running jobs."""
    agent = Agent(client, "n1")
    jid, start = running(client, ctl, agent)

    def update(**changes: Any) -> Any:
        return client.post("/v1/jobs/update", json={"jobs": [str(jid)], **changes})

    assert update(comment="stage 2 of 3", name="train-b").json()["results"] == {str(jid): "updated"}
    j = job(client, jid)
    assert (j["name"], j["state"]) == ("train-b", "RUNNING")
    (detail,) = client.get("/v1/jobs", params={"job": str(jid), "detail": "true"}).json()["jobs"]
    assert detail["comment"] == "stage 2 of 3"
    assert update(comment="").json()["results"] == {str(jid): "updated"}  # cleared
    (detail,) = client.get("/v1/jobs", params={"job": str(jid), "detail": "true"}).json()["jobs"]
    assert detail["comment"] is None
    r = update(comment="\x1b[2Jgotcha")  # others see comments: no terminal escapes
    assert r.status_code == 422
    agent.heartbeat([Agent.report(start, "exited", exit_code=0)])
    res = update(comment="too late").json()["results"][str(jid)]
    assert res == "completed: a finished job cannot be changed", res


def test_history_window_and_detail(client: TestClient, ctl: Controller) -> None:
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    (old,) = submit(client, workdir="/tmp/w", account="physics")
    start = run_to_start(ctl, agent)
    agent.heartbeat([Agent.report(start, "exited", exit_code=0)])
    ended = job(client, old)["end_time"]
    (new,) = submit(client)

    def ids(**params: Any) -> list[int]:
        r = client.get("/v1/jobs", params=params)
        assert r.status_code == 200, r.text
        return [int(j["id"]) for j in r.json()["jobs"]]

    assert ids(active_after=ended - 1) == [old, new]
    assert ids(active_after=ended + 1) == [new]  # ended before the window: not in it
    assert ids(submitted_before=time.time() - 3600) == []
    assert ids(job=f"{old},{new}") == [old, new]
    (j,) = client.get("/v1/jobs", params={"job": str(old), "detail": "true"}).json()["jobs"]
    assert (j["workdir"], j["account"]) == ("/tmp/w", "physics")


def test_excluded_nodes_and_an_arrays_throttle_change_while_pending(
    client: TestClient, ctl: Controller
) -> None:
    """scontrol update JobId=N ExcNodeList=... (pending jobs) and ArrayTaskThrottle=N
    (an array's pending and running tasks): what the scheduler then does."""
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    (jid,) = submit(client, cpus_per_task=1)

    def update(ref: int | str, **changes: Any) -> Any:
        return client.post("/v1/jobs/update", json={"jobs": [str(ref)], **changes}, headers=ADMIN)

    assert update(jid, exclude="n[1-2]").json()["results"] == {str(jid): "updated"}
    assert job(client, jid)["exclude"] == ["n1", "n2"]
    ctl.leases.tick()
    assert not ctl.schedule_tick().startswith("started")  # its only node is excluded now
    assert job(client, jid)["state"] == "PENDING"
    r = update(jid, exclude="n[1-")
    assert r.status_code == 422 and "exclude" in r.text, r.text
    assert update(jid, exclude="").json()["results"] == {str(jid): "updated"}
    run_to_start(ctl, agent)
    res = update(jid, exclude="n1").json()["results"][str(jid)]
    assert res.endswith("only a pending job can be changed here (its allocation is already made)")
    # a throttle is for arrays only; an array's tasks take it whatever their state
    assert update(jid, array_throttle=1).json()["results"][str(jid)].startswith("not a job array")
    ids = submit(client, array="1-4%4", cpus_per_task=1)
    assert update(ids[0], array_throttle=1).json()["results"] == {
        f"{ids[0]}_{t}": "updated" for t in range(1, 5)
    }

    def limits() -> set[int | None]:
        tasks = client.get("/v1/jobs", params={"job": str(ids[0])}).json()["jobs"]
        assert len(tasks) == 4, tasks
        return {t["array_limit"] for t in tasks}

    assert limits() == {1}
    ctl.leases.tick()
    assert ctl.schedule_tick().startswith("started 1 jobs")  # the other three wait
    assert update(ids[0], array_throttle=0).json()["results"] == {
        f"{ids[0]}_{t}": "updated" for t in range(1, 5)
    }
    assert limits() == {None}
