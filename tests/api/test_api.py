"""The REST API end to end, in process: real app, real Controller, real SQLite store."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from api_auth import KEYS, AuthedClient, as_user
from fastapi.testclient import TestClient

from phalanx.agent.resources import parse_gpu_override
from phalanx.config import load_config
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller

USER = as_user("alice", "operator")  # operators may drain nodes and add windows


class Agent:
    """Speaks the agent protocol through the API, the way phalanx.agent does."""

    def __init__(self, client: TestClient, node: str) -> None:
        self.client = client
        self.node = node

    def register(
        self,
        cpus: int = 4,
        mem_mb: int = 8192,
        gpus: list[Any] | None = None,
        features: list[str] | None = None,
    ) -> dict[str, Any]:
        r = self.client.post(
            f"/v1/agents/{self.node}/register",
            json={
                "cpus": cpus,
                "mem_mb": mem_mb,
                "gpus": gpus or [],
                "features": features or [],
                "addr": "127.0.0.1",
                "boot_id": "boot-1",
                "version": "test",
            },
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def heartbeat(
        self, tasks: list[dict[str, Any]] | None = None, taken_at: float | None = None
    ) -> dict[str, Any]:
        r = self.client.post(
            f"/v1/agents/{self.node}/heartbeat",
            json={"tasks": tasks or [], "taken_at": taken_at, "wait": 0},
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    @staticmethod
    def report(start: dict[str, Any], state: str, **exit_: Any) -> dict[str, Any]:
        rep: dict[str, Any] = {
            "attempt_id": start["attempt_id"],
            "token": start["token"],
            "state": state,
            "started_at": time.time(),
        }
        if exit_:
            rep["exit"] = exit_
        return rep


@pytest.fixture
def agent(client: TestClient) -> Agent:
    return Agent(client, "n1")


def submit(client: TestClient, **spec: Any) -> list[int]:
    spec.setdefault("argv", ["/bin/true"])
    r = client.post("/v1/jobs", json=spec, headers=USER)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["job_id"] == body["job_ids"][0]
    return list(body["job_ids"])


def error_of(r: Any, status: int = 422) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return dict(r.json()["error"])


def job(client: TestClient, ref: int | str) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{ref}")
    assert r.status_code == 200, r.text
    (j,) = r.json()["jobs"]
    return dict(j)


def run_to_start(ctl: Controller, agent: Agent) -> dict[str, Any]:
    """Schedule, then heartbeat once: the reply must carry exactly one start."""
    assert ctl.schedule_tick().startswith("started 1 jobs")
    reply = agent.heartbeat()
    (start,) = reply["start"]
    return dict(start)


# --------------------------------------------------------------------------------------------
# health, cluster, schema
# --------------------------------------------------------------------------------------------


def test_healthz_cluster_and_openapi(client: TestClient, agent: Agent) -> None:
    h = client.get("/healthz").json()
    assert h["status"] == "ok" and h["controller"] == "t"
    assert set(h["leases"]) == {"cluster", "sched:batch", "sched:long"}
    agent.register()
    submit(client)
    c = client.get("/v1/cluster").json()
    assert c["jobs"] == {"PENDING": 1}
    assert c["nodes"] == {"total": 1, "down": 0, "drain": 0}
    assert {p["name"] for p in c["partitions"]} == {"batch", "long"}
    assert {x["name"]: x["holder"] for x in c["leases"]} == {
        "cluster": "t",
        "sched:batch": "t",
        "sched:long": "t",
    }
    assert c["this_controller"]["controller"] == "t"
    spec = client.get("/v1/openapi.json")
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    for p in (
        "/v1/jobs",
        "/v1/jobs/batch",
        "/v1/nodes/{name}/drain",
        "/v1/agents/{node}/heartbeat",
    ):
        assert p in paths
    assert client.get("/metrics").status_code == 200


# --------------------------------------------------------------------------------------------
# submit
# --------------------------------------------------------------------------------------------


def test_submit_one_batch_and_array(client: TestClient) -> None:
    (one,) = submit(client, name="one")
    arr = submit(client, name="arr", array="1-3")
    assert len(arr) == 3 and one not in arr
    r = client.post(
        "/v1/jobs/batch",
        json={
            "jobs": [{"argv": ["a"], "name": "b1"}, {"argv": ["b"], "name": "b2", "array": "0-1"}]
        },
        headers=USER,
    )
    assert r.status_code == 201, r.text
    out = r.json()["jobs"]
    assert [len(x["job_ids"]) for x in out] == [1, 2]
    j = job(client, one)
    assert j["state"] == "PENDING" and j["user"] == "alice" and j["partition"] == "batch"
    assert j["time_limit_s"] == 3600 and j["time_limit"] == "01:00:00"
    shown = client.get(f"/v1/jobs/{arr[0]}").json()["jobs"]
    assert [x["job_id"] for x in shown] == [f"{arr[0]}_{i}" for i in (1, 2, 3)]
    assert job(client, f"{arr[0]}_2")["id"] == arr[1]


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"nodes": 0}, "nodes", "greater than or equal to 1"),
        ({"partition": "nope"}, "partition", "unknown partition 'nope'"),
        ({"time_limit_s": 3 * 3600}, "time_limit_s", "exceeds the maximum of partition batch"),
        ({"array": "1-x"}, "array", "invalid array"),
        ({"dependency": "afterok:424242"}, "dependency", "424242"),
        ({"argv": [], "script": None}, "script", "nothing to run"),
        ({"bogus_field": 1}, "bogus_field", "Extra inputs are not permitted"),
    ],
)
def test_invalid_spec_names_the_field(
    client: TestClient, spec: dict[str, Any], field: str, words: str
) -> None:
    body = {"argv": ["/bin/true"], **spec}
    err = error_of(client.post("/v1/jobs", json=body, headers=USER))
    assert err["code"] == "invalid_spec"
    assert err["message"].startswith(field), err
    assert words in err["message"]
    assert err["details"]["field"] == field
    assert client.get("/v1/jobs").json()["jobs"] == []


def test_time_limit_fits_another_partition(client: TestClient) -> None:
    (jid,) = submit(client, partition="long", time_limit_s=3 * 3600)
    assert job(client, jid)["partition"] == "long"


def test_batch_error_names_the_item_and_inserts_nothing(client: TestClient) -> None:
    r = client.post("/v1/jobs/batch", json={"jobs": [{"argv": ["a"]}, {"argv": ["b"], "nodes": 0}]})
    err = error_of(r)
    assert "jobs.1.nodes" in err["message"]
    r = client.post(
        "/v1/jobs/batch", json={"jobs": [{"argv": ["a"]}, {"argv": ["b"], "array": "x"}]}
    )
    err = error_of(r)
    assert err["message"].startswith("job 1: array") and err["details"]["index"] == 1
    assert error_of(client.post("/v1/jobs/batch", json={"jobs": []}))["code"] == "invalid_spec"
    assert client.get("/v1/jobs").json()["jobs"] == []


def test_unsatisfiable_gpus(client: TestClient, agent: Agent) -> None:
    agent.register(cpus=4)  # no GPUs anywhere
    err = error_of(client.post("/v1/jobs", json={"argv": ["x"], "gpus_total": 1}))
    assert err["code"] == "unsatisfiable"
    assert "GPU" in err["message"] and "can never run" in err["message"]
    err = error_of(client.post("/v1/jobs", json={"argv": ["x"], "cpus_per_task": 64}))
    assert err["code"] == "unsatisfiable" and "CPU" in err["message"]
    # with a GPU node registered the same request is accepted
    Agent(client, "g1").register(cpus=8, gpus=[[0, "a100"], [1, "a100"]])
    submit(client, gpus_total=1)


@pytest.mark.parametrize("gpus", ["a100:2", "h100:8"])
def test_a_job_sees_the_gpus_of_an_overridden_node_as_0_to_n_minus_1(
    client: TestClient, ctl: Controller, gpus: str
) -> None:
    """`phalanx up --gpus a100:2` numbered them 0 and 2: CUDA_VISIBLE_DEVICES named devices
    that do not exist."""
    node = Agent(client, "g1")
    node.register(cpus=8, gpus=[list(g) for g in parse_gpu_override(gpus)])
    count = int(gpus.split(":")[1])
    submit(client, gpus_per_node=count)
    env = run_to_start(ctl, node)["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(str(i) for i in range(count))


# --------------------------------------------------------------------------------------------
# list / show / actions / events
# --------------------------------------------------------------------------------------------


def test_list_filters(client: TestClient, ctl: Controller, agent: Agent) -> None:
    (a,) = submit(client, name="train")
    (b,) = submit(client, name="eval", partition="long")
    r = client.post("/v1/jobs", json={"argv": ["x"], "name": "train"}, headers=as_user("bob"))
    c = r.json()["job_id"]

    def ids(**params: Any) -> list[int]:
        r = client.get("/v1/jobs", params=params)
        assert r.status_code == 200, r.text
        return [j["id"] for j in r.json()["jobs"]]

    assert ids() == [a, b, c]
    assert ids(user="alice") == [a, b]
    assert ids(name="train") == [a, c]
    assert ids(partition="long") == [b]
    assert ids(job=f"{a},{c}") == [a, c]
    assert ids(limit=1) == [a]
    agent.register(cpus=1, mem_mb=512)
    ctl.schedule_tick()
    assert ids(state="pending,starting") == [a, b, c]
    assert ids(state="STARTING") == [a]
    assert ids(node="n1") == [a]
    assert error_of(client.get("/v1/jobs", params={"limit": 0}))["code"] == "invalid_spec"


def test_show_missing_job_is_404(client: TestClient) -> None:
    err = error_of(client.get("/v1/jobs/999"), 404)
    assert err["code"] == "not_found"
    assert (
        error_of(client.post("/v1/jobs/cancel", json={"jobs": ["999"]}), 404)["code"] == "not_found"
    )
    assert error_of(client.get("/v1/jobs/abc"), 422)["code"] == "invalid_spec"


def test_hold_release_cancel_and_events(client: TestClient) -> None:
    (a,) = submit(client)
    arr = submit(client, array="0-1")
    r = client.post("/v1/jobs/hold", json={"jobs": [str(a), str(arr[0])]}, headers=USER)
    assert r.status_code == 200
    # results are keyed by the ids users type (an array task is ARRAY_TASK), never internal ids
    assert r.json()["results"] == {str(a): "held", f"{arr[0]}_0": "held", f"{arr[0]}_1": "held"}
    assert job(client, a)["state"] == "HELD"
    r = client.post("/v1/jobs/release", json={"jobs": [f"{arr[0]}_1"]}, headers=USER)
    assert r.json()["results"] == {f"{arr[0]}_1": "released"}
    r = client.post("/v1/jobs/cancel", json={"jobs": [str(a)], "reason": "oops"}, headers=USER)
    assert r.json()["results"] == {str(a): "cancelled"}
    j = job(client, a)
    assert j["state"] == "CANCELLED" and j["reason"] == "oops by alice"
    ev = client.get(f"/v1/jobs/{a}/events").json()["events"]
    assert [e["kind"] for e in ev] == ["job.submit", "job.held", "job.cancelled"]
    assert ev[1]["actor"] == "alice"
    arr_ev = client.get(f"/v1/jobs/{arr[0]}/events").json()["events"]
    assert [e["job_id"] for e in arr_ev if e["kind"] == "job.submit"] == arr
    assert [e["id"] for e in arr_ev] == sorted(e["id"] for e in arr_ev)
    assert (
        client.get("/v1/events", params={"since": ev[0]["id"]}).json()["events"][0]["id"]
        > ev[0]["id"]
    )


# --------------------------------------------------------------------------------------------
# nodes
# --------------------------------------------------------------------------------------------


def test_nodes_list_drain_resume(client: TestClient, agent: Agent) -> None:
    reg = agent.register(cpus=8, mem_mb=16000, gpus=[[0, "a100"]], features=["ib"])
    assert reg["node"] == "n1" and reg["controller"] == "t" and "node_down_timeout" in reg["timing"]
    (n,) = client.get("/v1/nodes").json()["nodes"]
    assert n["name"] == "n1" and n["state"] == "IDLE" and n["cpus"] == 8 and n["features"] == ["ib"]
    assert n["gpus"] == [[0, "a100"]]
    err = error_of(client.post("/v1/nodes/n1/drain", json={}))
    assert err["code"] == "invalid_spec" and "reason" in err["message"]
    assert (
        error_of(client.post("/v1/nodes/n1/drain", json={"reason": ""}))["details"]["field"]
        == "reason"
    )
    assert (
        error_of(client.post("/v1/nodes/n1/drain", json={"reason": "   "}))["code"]
        == "invalid_spec"
    )
    assert (
        error_of(client.post("/v1/nodes/zz/drain", json={"reason": "x"}), 404)["code"]
        == "not_found"
    )
    r = client.post("/v1/nodes/n1/drain", json={"reason": "bad DIMM"}, headers=USER)
    assert r.status_code == 200
    assert r.json()["state"] == "DRAINED" and r.json()["drain_reason"] == "bad DIMM"
    assert r.json()["drain_by"] == "alice"
    one = client.get("/v1/nodes/n1").json()
    assert [e["kind"] for e in one["events"]] == ["node.register", "node.drain"]
    r = client.post("/v1/nodes/n1/resume", headers=USER)
    assert r.status_code == 200 and r.json()["state"] == "IDLE" and not r.json()["drain"]
    assert error_of(client.post("/v1/nodes/n1/resume"), 409)["code"] == "invalid_state"
    assert error_of(client.get("/v1/nodes/zz"), 404)["code"] == "not_found"


def test_drained_node_gets_no_work(client: TestClient, ctl: Controller, agent: Agent) -> None:
    agent.register()
    client.post("/v1/nodes/n1/drain", json={"reason": "maintenance"})
    (jid,) = submit(client)
    assert ctl.schedule_tick() == "idle"
    assert job(client, jid)["reason"] == "Resources"
    assert agent.heartbeat()["start"] == []
    client.post("/v1/nodes/n1/resume")
    assert len(run_to_start(ctl, agent)["env"]) > 0


# --------------------------------------------------------------------------------------------
# the agent protocol
# --------------------------------------------------------------------------------------------


def test_heartbeat_start_env_and_completion(
    client: TestClient, ctl: Controller, agent: Agent
) -> None:
    agent.register(cpus=4)
    (jid,) = submit(
        client,
        name="train",
        cpus_per_task=2,
        submit_dir="/home/alice/proj",
        output="out-%j.log",
        env={"FOO": "bar"},
    )
    assert agent.heartbeat()["start"] == []  # nothing scheduled yet
    start = run_to_start(ctl, agent)
    env = start["env"]
    assert start["job_id"] == jid and start["node"] == "n1" and start["rank"] == 0
    assert start["cwd"] == "/home/alice/proj"
    assert start["stdout"] == f"/home/alice/proj/out-{jid}.log"
    assert start["command"] == {"argv": ["/bin/true"]}
    assert start["time_limit_s"] == 3600 and start["fence_term"] >= 1
    expected = {
        "SLURM_JOB_ID": str(jid),
        "PHX_JOB_ID": str(jid),
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_RESTART_COUNT": "0",
        "SLURM_SUBMIT_DIR": "/home/alice/proj",
        "SLURM_CPUS_PER_TASK": "2",
        "SLURM_JOB_PARTITION": "batch",
        "MASTER_ADDR": "n1",
        "FOO": "bar",
    }
    assert {k: env.get(k) for k in expected} == expected
    assert int(env["MASTER_PORT"]) >= 29500
    assert "SLURM_ARRAY_TASK_ID" not in env
    # the same heartbeat again (reply lost) starts it again: level-triggered
    assert [s["attempt_id"] for s in agent.heartbeat()["start"]] == [start["attempt_id"]]
    reply = agent.heartbeat([Agent.report(start, "running")])
    assert reply["start"] == [] and reply["stop"] == []
    assert job(client, jid)["state"] == "RUNNING"
    reply = agent.heartbeat([Agent.report(start, "exited", exit_code=0)])
    assert reply["forget"] == [start["attempt_id"]]
    j = job(client, jid)
    assert j["state"] == "COMPLETED" and j["exit_code"] == 0
    (att,) = j["attempts"]
    assert att["state"] == "ENDED" and att["result"] == "COMPLETED"
    assert [t["node"] for t in att["tasks"]] == ["n1"]
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{jid}/events").json()["events"]]
    assert kinds == ["job.submit", "job.starting", "job.running", "job.completed"]
    assert j["stdout"] == f"/home/alice/proj/out-{jid}.log"
    # the agent forgets the attempt; nothing more to do
    reply = agent.heartbeat()
    assert (reply["start"], reply["stop"], reply["forget"]) == ([], [], [])


def test_array_and_multi_node_env(client: TestClient, ctl: Controller) -> None:
    agents = {n: Agent(client, n) for n in ("n1", "n2")}
    for a in agents.values():
        a.register(cpus=2)
    arr = submit(client, array="5", cpus_per_task=2)
    assert ctl.schedule_tick().startswith("started 1 jobs")
    arr_node = job(client, arr[0])["nodelist"]
    other = "n2" if arr_node == "n1" else "n1"
    (start,) = agents[arr_node].heartbeat()["start"]
    env = start["env"]
    assert env["SLURM_ARRAY_TASK_ID"] == "5" and env["SLURM_ARRAY_JOB_ID"] == str(arr[0])
    assert env["PHX_ARRAY_TASK_ID"] == "5" and env["SLURM_JOB_ID"] == str(arr[0])
    assert start["stdout"] == f"/slurm-{arr[0]}_5.out"
    # a two-node job cannot start while one node is full
    (mj,) = submit(client, nodes=2, cpus_per_task=1)
    ctl.schedule_tick()
    assert job(client, mj)["state"] == "PENDING"
    assert agents[other].heartbeat()["start"] == []
    agents[arr_node].heartbeat([Agent.report(start, "exited", exit_code=0)])
    assert ctl.schedule_tick().startswith("started 1 jobs")
    (s1,) = agents["n1"].heartbeat()["start"]
    (s2,) = agents["n2"].heartbeat()["start"]
    assert s1["job_id"] == s2["job_id"] == mj
    assert (s1["env"]["SLURM_NODEID"], s2["env"]["SLURM_NODEID"]) == ("0", "1")
    for s in (s1, s2):
        assert s["env"]["SLURM_JOB_NODELIST"] == "n[1-2]"
        assert s["env"]["SLURM_NNODES"] == "2"
        assert s["env"]["MASTER_ADDR"] == "n1"
        assert "SLURM_ARRAY_TASK_ID" not in s["env"]
    assert s1["env"]["MASTER_PORT"] == s2["env"]["MASTER_PORT"]


def test_stale_token_gets_a_stop(client: TestClient, ctl: Controller, agent: Agent) -> None:
    agent.register()
    (jid,) = submit(client)
    start = run_to_start(ctl, agent)
    forged = {**start, "token": "stale-token"}
    reply = agent.heartbeat([Agent.report(forged, "running")])
    assert reply["stop"] == [
        {
            "attempt_id": start["attempt_id"],
            "token": "stale-token",
            "reason": "attempt is no longer current",
        }
    ]
    assert job(client, jid)["state"] == "STARTING"  # the report changed nothing
    # an attempt the controller never heard of is stopped too
    reply = agent.heartbeat([{"attempt_id": 777, "token": "x", "state": "running"}])
    assert [s["attempt_id"] for s in reply["stop"]] == [777]
    # and a finished unknown one is just forgotten
    reply = agent.heartbeat([{"attempt_id": 777, "token": "x", "state": "exited", "exit": {}}])
    assert reply["forget"] == [777]


def test_cancel_running_job_stops_it(client: TestClient, ctl: Controller, agent: Agent) -> None:
    agent.register()
    (jid,) = submit(client)
    start = run_to_start(ctl, agent)
    running = Agent.report(start, "running")
    assert agent.heartbeat([running])["stop"] == []
    r = client.post("/v1/jobs/cancel", json={"jobs": [str(jid)]}, headers=USER)
    assert r.json()["results"] == {str(jid): "stopping"}
    assert job(client, jid)["state"] == "COMPLETING"
    reply = agent.heartbeat([running])
    (stop,) = reply["stop"]
    assert stop["attempt_id"] == start["attempt_id"] and stop["token"] == start["token"]
    assert stop["reason"].startswith("cancel")
    reply = agent.heartbeat([Agent.report(start, "exited", exit_code=None, signal=15)])
    assert reply["stop"] == [] and reply["forget"] == [start["attempt_id"]]
    assert job(client, jid)["state"] == "CANCELLED"


def test_failed_job_and_lost_task_requeue(
    client: TestClient, ctl: Controller, agent: Agent
) -> None:
    agent.register()
    (bad,) = submit(client)
    start = run_to_start(ctl, agent)
    agent.heartbeat([Agent.report(start, "exited", exit_code=3)])
    j = job(client, bad)
    assert j["state"] == "FAILED" and j["exit_code"] == 3
    (rq,) = submit(client, requeue=True)
    start = run_to_start(ctl, agent)
    agent.heartbeat([Agent.report(start, "running")])
    # the agent restarted and no longer knows the task: it is lost, the job requeued
    agent.heartbeat([], taken_at=time.time() + 1)
    j = job(client, rq)
    assert j["state"] == "PENDING" and j["restart_count"] == 1
    again = run_to_start(ctl, agent)
    assert again["attempt_id"] != start["attempt_id"]
    assert again["env"]["SLURM_RESTART_COUNT"] == "1"
    assert start["open_mode"] == "truncate"
    assert again["open_mode"] == "append"  # a requeued job keeps its earlier output


def test_scheduler_needs_the_lease(
    client: TestClient, store: Any, config: Any, agent: Agent
) -> None:
    """A second controller without the scheduler lease schedules nothing."""
    agent.register()
    submit(client)
    other = Controller(store, config, cid="other")
    assert "took" not in other.leases.tick()
    assert other.schedule_tick() == "idle"
    assert client.get("/v1/jobs", params={"state": "PENDING"}).json()["jobs"] != []


def test_long_poll_wakes_on_new_work(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting heartbeat returns as soon as the scheduler gives its node work."""
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    # a long poll (20 s) against a wakeup within about a second: a busy 2-core machine may
    # take a second or two to submit and schedule, never the whole wait
    cfg = load_config(
        overrides={
            "timing": {
                "heartbeat_interval": 20.0,
                "fence_timeout": 70.0,
                "node_down_timeout": 120.0,
            }
        }
    )
    ctl = Controller(store, cfg, cid="lp")
    ctl.leases.tick()
    with AuthedClient(create_app(ctl, KEYS)) as client:
        Agent(client, "n1").register()
        out: dict[str, Any] = {}

        def poll() -> None:
            t0 = time.monotonic()
            r = client.post("/v1/agents/n1/heartbeat", json={"tasks": [], "wait": 20.0})
            out["elapsed"] = time.monotonic() - t0
            out["reply"] = r.json()

        t = threading.Thread(target=poll)
        t.start()
        time.sleep(0.3)  # the poll is now waiting
        submit(client)
        ctl.leases.tick()  # no loop renews it (TTL 3 s): a lapsed lease hung this test once
        assert ctl.schedule_tick().startswith("started 1 jobs")
        t.join(30)
    assert len(out["reply"]["start"]) == 1
    assert out["elapsed"] < 15.0, out["elapsed"]  # woken, not timed out


def test_liveness_and_readiness_for_load_balancers(client: TestClient, ctl: Controller) -> None:
    assert client.get("/healthz/live").status_code == 200
    r = client.get("/healthz/ready")
    assert r.status_code == 200 and r.json()["ready"] is True
    # a loop that has not ticked for longer than the lease TTL: this controller is stuck
    ctl.last_tick["scheduler"] = time.monotonic() - ctl.timing.lease_ttl * 10
    r = client.get("/healthz/live")
    assert r.status_code == 503 and r.json()["stuck"] == ["scheduler"]
    r = client.get("/healthz/ready")
    assert r.status_code == 503
    assert "loop scheduler has not run recently" in r.json()["problems"]


def test_nul_characters_are_refused_before_the_store_sees_them(client: TestClient) -> None:
    """PostgreSQL cannot store NUL in text: such a request is a 422 saying so, on any store."""
    r = client.post("/v1/jobs", json={"argv": ["/bin/true"], "name": "a\u0000b"}, headers=USER)
    assert r.status_code == 422, r.text
    assert "NUL" in r.json()["error"]["message"]
    r = client.get("/v1/jobs", params={"name": "a\u0000b"}, headers=USER)
    assert r.status_code == 422, r.text
    assert client.get("/v1/jobs", headers=USER).json()["jobs"] == []


def test_a_step_of_an_arrays_first_task_is_created_in_that_task(
    client: TestClient, ctl: Controller
) -> None:
    """srun in an array's first task sends $SLURM_JOB_ID, which is also the array's id (as in
    Slurm): the step goes to that task, not refused as naming every task of the array."""
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    arr = submit(client, array="0-1")
    assert ctl.schedule_tick().startswith("started 2 jobs")
    starts = agent.heartbeat()["start"]
    agent.heartbeat([Agent.report(s, "running") for s in starts])
    body = {"argv": ["true"], "host": "127.0.0.1", "port": 9, "cookie": "c" * 32}
    for ref, jid in ((str(arr[0]), arr[0]), (f"{arr[0]}_1", arr[1])):
        r = client.post(f"/v1/jobs/{ref}/steps", json=body, headers=USER)
        assert r.status_code == 201, r.text
        assert r.json()["job_id"] == jid, r.json()
    # the array as a whole is still every task where a command means it
    assert [j["id"] for j in client.get(f"/v1/jobs/{arr[0]}").json()["jobs"]] == arr


def test_a_direct_step_comes_with_signed_launches_and_wakes_only_what_srun_cannot_reach(
    client: TestClient, ctl: Controller
) -> None:
    """srun asking for a direct launch gets, per node whose agent told its address, that node's
    launch signed with the node's key (and no long-poll is woken for it); a node without an
    address is woken at once; `.../wake` wakes the nodes srun names, of that step only."""
    from phalanx.auth import launchcred
    from phalanx.auth.keys import KeySet, derive

    n1, n2 = Agent(client, "n1"), Agent(client, "n2")
    for a in (n1, n2):
        a.register(cpus=4)
    jid = submit(client, nodes=2)[0]
    assert ctl.schedule_tick().startswith("started 1 jobs")
    for a in (n1, n2):
        starts = a.heartbeat()["start"]
        a.heartbeat([Agent.report(s, "running") for s in starts])
    r = client.post(
        "/v1/agents/n1/heartbeat", json={"wait": 0, "steps_at": "127.0.0.1:7001"}
    )  # n1's agent takes direct launches; n2's has told no address
    assert r.status_code == 200, r.text
    woken: list[list[str]] = []
    ctl.waiters.notify = woken.append  # type: ignore[method-assign]
    body = {"argv": ["hostname"], "host": "127.0.0.1", "port": 9, "cookie": "c" * 32}
    r = client.post(f"/v1/jobs/{jid}/steps", json={**body, "direct": True}, headers=USER)
    assert r.status_code == 201, r.text
    step = r.json()
    (launch,) = step["launch"]
    assert launch["node"] == "n1" and launch["at"] == "127.0.0.1:7001"
    keys = KeySet([derive(KEYS.signing, "node", "n1")])
    item = launchcred.verify(keys, "n1", launch, now=time.time())
    assert item["argv"] == ["hostname"] and item["step_id"] == step["step_id"]
    assert item["tasks"][0]["env"]["SLURM_PROCID"] == "0"
    assert woken == [["n2"]], "only the node without an address is woken"
    # srun could not reach n1 after all: it asks for n1 (and names a node not in the step)
    r = client.post(
        f"/v1/jobs/{jid}/steps/{step['step_id']}/wake", json={"nodes": ["n1", "n9"]}, headers=USER
    )
    assert r.status_code == 200, r.text
    assert r.json()["woken"] == ["n1"] and woken[-1] == ["n1"]
    assert (
        client.post(
            f"/v1/jobs/{jid}/steps/99/wake", json={"nodes": ["n1"]}, headers=USER
        ).status_code
        == 404
    )
    # without `direct` (an older srun), the step wakes every node as before
    r = client.post(f"/v1/jobs/{jid}/steps", json=body, headers=USER)
    assert "launch" not in r.json() and sorted(woken[-1]) == ["n1", "n2"]


def test_sattach_learns_where_a_steps_io_flows_with_a_token_for_its_owner_and_admins(
    client: TestClient, ctl: Controller
) -> None:
    """`POST .../steps/N/attach`: the step's layout and its srun's address with a token derived
    from the step's cookie (never the cookie); the tasks read srun's stdin only when srun said
    it forwards one and their output is streamed. Another user is refused, and so is an
    operator (Slurm's slurmstepd lets the owner, root and SlurmUser attach); an admin is not."""
    from api_auth import ADMIN

    from phalanx.auth.attachcred import attach_token

    n1 = Agent(client, "n1")
    n1.register(cpus=4)
    jid = submit(client)[0]
    assert ctl.schedule_tick().startswith("started 1 jobs")
    starts = n1.heartbeat()["start"]
    n1.heartbeat([Agent.report(s, "running") for s in starts])
    cookie = "c" * 32
    body = {"argv": ["cat"], "host": "10.0.0.7", "port": 4242, "cookie": cookie, "stdin": True}
    sid = client.post(f"/v1/jobs/{jid}/steps", json=body, headers=USER).json()["step_id"]
    # srun forwards its stdin: the task's stdin is its stdout connection (agent/shepherd_start)
    assert ctl.store.step_io(jid, sid)["io"]["stdin"] is True
    r = client.post(f"/v1/jobs/{jid}/steps/{sid}/attach", headers=as_user("alice"))
    assert r.status_code == 200, r.text
    info = r.json()
    assert cookie not in r.text
    assert (info["state"], info["nodes"], info["task_ids"]) == ("RUNNING", ["n1"], [[0]])
    assert info["attach"] == {
        "host": "10.0.0.7",
        "port": 4242,
        "token": attach_token(cookie),
        "stdout": True,
        "stderr": True,
        "stdin": True,
        "pty": False,
    }
    for who, status in ((as_user("bob"), 403), (as_user("olga", "operator"), 403), (ADMIN, 200)):
        assert client.post(f"/v1/jobs/{jid}/steps/{sid}/attach", headers=who).status_code == status
    assert client.post(f"/v1/jobs/{jid}/steps/7/attach", headers=USER).status_code == 404
    # output to files (srun -o): nothing streams, so no stdin either
    r = client.post(f"/v1/jobs/{jid}/steps", json={**body, "output": "out-%t"}, headers=USER)
    files = client.post(f"/v1/jobs/{jid}/steps/{r.json()['step_id']}/attach", headers=USER)
    assert files.json()["attach"]["stdin"] is False and files.json()["attach"]["stdout"] is False
