"""`GET /v1/jobs/{ref}/explain` and the usage figures against the real app and store: what
`phalanx explain`, `phalanx eff` and sacct's MaxRSS/TotalCPU read."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient
from test_api import Agent, job, run_to_start, submit

from phalanx.controller.runtime import Controller

MB = 2**20


def explain(client: TestClient, ref: int | str, status: int = 200) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{ref}/explain")
    assert r.status_code == status, r.text
    return dict(r.json())


def test_a_failed_job_is_explained_and_its_usage_kept(client: TestClient, ctl: Controller) -> None:
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    (jid,) = submit(client, cpus_per_task=2, mem_mb=1024)
    start = run_to_start(ctl, agent)
    usage = {"cpu_s": 7.5, "max_rss_bytes": 300 * MB, "source": "cgroup"}
    gpu = {"samples": 5, "util_mean": 42.0, "mem_peak_bytes": 2 * 2**30}
    began = time.time() - 10  # the shepherd's exit record says when the job started
    agent.heartbeat(
        [Agent.report(start, "exited", exit_code=3, started_at=began, usage=usage, gpu=gpu)]
    )
    out = explain(client, jid)
    assert out["job"] == str(jid) and out["state"] == "FAILED"
    assert out["summary"].startswith("FAILED (exit code 3)"), out
    assert out["lines"][0].startswith("attempt 1 on n1"), out
    assert "  n1: exit code 3" in out["lines"], out
    u = job(client, jid)["usage"]
    assert u["cpu_time_s"] == 7.5 and u["max_rss_bytes"] == 300 * MB, u
    assert u["cpus"] == 2 and u["mem_requested_bytes"] == 1024 * MB
    assert u["gpu_util_mean"] == 42.0 and u["gpu_mem_peak_bytes"] == 2 * 2**30
    # sacct's query (the list with detail) carries the same figures
    (listed,) = client.get("/v1/jobs", params={"job": str(jid), "detail": "true"}).json()["jobs"]
    assert listed["usage"]["cpu_time_s"] == 7.5


def test_a_report_with_nonsense_usage_is_still_recorded(
    client: TestClient, ctl: Controller
) -> None:
    agent = Agent(client, "n1")
    agent.register(cpus=4)
    (jid,) = submit(client)
    start = run_to_start(ctl, agent)
    bad = {"cpu_s": "a lot", "max_rss_bytes": -5}
    rep = Agent.report(start, "exited", exit_code=0, started_at=time.time(), usage=bad, gpu=[1])
    agent.heartbeat([rep])
    j = job(client, jid)
    assert j["state"] == "COMPLETED"
    assert j["usage"]["cpu_time_s"] is None and j["usage"]["max_rss_bytes"] is None


def test_held_pending_and_array_refs(client: TestClient, ctl: Controller) -> None:
    Agent(client, "n1").register(cpus=4)
    (jid,) = submit(client, cpus_per_task=2)
    out = explain(client, jid)
    assert out["state"] == "PENDING" and out["verdict"] == "start", out
    assert out["summary"] == "would start now on n1 (partition batch)", out
    client.post("/v1/jobs/hold", json={"jobs": [str(jid)]})
    out = explain(client, jid)
    assert out["state"] == "HELD" and out["verdict"] == "held", out
    assert out["summary"].startswith("held: held by "), out
    # an array id names every task: one must be chosen, said in one line
    ids = submit(client, array="0-2")
    arr = client.get(f"/v1/jobs/{ids[0]}").json()["jobs"][0]["array_job_id"]
    r = client.get(f"/v1/jobs/{arr}_1/explain")
    assert r.status_code == 200 and r.json()["job"] == f"{arr}_1", r.text
    r = client.get("/v1/jobs/999999/explain")
    assert r.status_code == 404 and "999999" in r.text
