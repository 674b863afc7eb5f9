"""Maintenance windows through the REST API, in process: bad windows are refused with 422 and
what to change, node listings show windows, and the controller's duty turns an approaching
window into a planned stop whose grace runs out at the window's start."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from test_api import USER, Agent, agent, error_of, run_to_start, submit

from phalanx.controller.runtime import Controller

__all__ = ["agent"]  # the fixture, shared with test_api


def test_bad_windows_are_refused_with_what_to_do(client: TestClient, agent: Agent) -> None:
    agent.register()
    cases = [
        ({"nodes": "n[1-9]", "start": "now+1h", "duration": "1h"}, "unknown nodes n[2-9]"),
        ({"nodes": "n1", "start": "now+1h", "duration": "0"}, "must be positive"),
        ({"nodes": "n1", "start": "now+1h", "duration": -60}, "must be positive"),
        ({"nodes": "n1", "start": time.time() - 7200, "duration": 60}, "already passed"),
        ({"nodes": "n1", "start": "whenever", "duration": "1h"}, "now+10min"),
        ({"nodes": "n1", "start": "now"}, "either a duration"),
        ({"nodes": "n1", "start": "now", "duration": "UNLIMITED"}, "needs an end"),
    ]
    for body, fragment in cases:
        err = error_of(client.post("/v1/maintenance", json=body, headers=USER))
        assert err["code"] == "invalid_spec" and fragment in err["message"], (body, err)
    assert client.get("/v1/maintenance").json()["windows"] == []


def test_window_lifecycle_through_the_api(
    client: TestClient, ctl: Controller, agent: Agent
) -> None:
    agent.register(cpus=4)
    Agent(client, "n2").register(cpus=4)
    (jid,) = submit(client, time_limit_s=3600, cpus_per_task=4, requeue=True)
    start = run_to_start(ctl, agent)
    running = agent.report(start, "running")
    agent.heartbeat([running])

    r = client.post(
        "/v1/maintenance",
        json={"nodes": "n1", "start": "now+20", "duration": "1min", "reason": "BIOS"},
        headers=USER,
    )
    assert r.status_code == 201, r.text
    w = r.json()["window"]
    assert "less than the lead time (30 s)" in r.json()["warnings"][0], r.json()
    assert w["nodes"] == "n1" and w["state"] == "scheduled" and w["created_by"] == "alice"
    assert w["duration_s"] == 60 and w["reason"] == "BIOS"
    nodes = {n["name"]: n for n in client.get("/v1/nodes").json()["nodes"]}
    assert [x["id"] for x in nodes["n1"]["maintenance"]] == [w["id"]]
    assert nodes["n2"]["maintenance"] == []
    assert client.get("/v1/nodes/n1").json()["maintenance"][0]["reason"] == "BIOS"

    # within the lead time (30 s by default): the job is asked to checkpoint and stop, with
    # a grace that ends when the window starts
    said = ctl.maintenance.tick()
    assert f"requeueing jobs [{jid}] before maintenance {w['id']}" in said, said
    (stop,) = agent.heartbeat([running])["stop"]
    assert stop["reason"].startswith(f"requeue: maintenance {w['id']} (BIOS) on n1 at ")
    assert 10 < stop["checkpoint_grace"] <= 20, stop
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{jid}/events").json()["events"]]
    assert "maint.signal" in kinds

    # removed before it starts: gone from the listings, 409 the second time
    r = client.delete(f"/v1/maintenance/{w['id']}", headers=USER)
    assert r.status_code == 200 and r.json()["window"]["state"] == "removed", r.text
    assert client.get("/v1/maintenance").json()["windows"] == []
    assert [x["state"] for x in client.get("/v1/maintenance?all=true").json()["windows"]] == [
        "removed"
    ]
    assert error_of(client.delete(f"/v1/maintenance/{w['id']}"), 409)["code"] == "invalid_state"
    assert error_of(client.delete("/v1/maintenance/999"), 404)["code"] == "not_found"


def test_an_active_window_drains_and_returns(
    client: TestClient, ctl: Controller, agent: Agent
) -> None:
    agent.register()

    def tick() -> str:
        """The maintenance duty's pass, its lease renewed first as the controller's loop does
        (the fixture took it once: on a busy machine this test outlived its TTL)."""
        ctl.leases.tick()
        return ctl.maintenance.tick()

    now = time.time()
    r = client.post(
        "/v1/maintenance", json={"nodes": "n1", "start": now - 1, "end": now + 4}, headers=USER
    )
    wid = r.json()["window"]["id"]
    assert tick() == f"maintenance {wid} started: drained n1"
    n1 = client.get("/v1/nodes/n1").json()
    assert n1["state"] == "DRAINED" and n1["drain_by"] == f"maint:{wid}", n1
    assert n1["drain_reason"].startswith(f"maintenance {wid} until ")
    (submitted,) = submit(client, time_limit_s=60)
    assert ctl.schedule_tick() == "idle"  # nothing starts on it meanwhile
    deadline = time.monotonic() + 15
    said = tick()
    while said == "idle" and time.monotonic() < deadline:  # until the window's end passes
        time.sleep(0.1)
        said = tick()
    assert time.time() >= now + 4, "not before its end"
    assert said == f"maintenance {wid} over: returned n1"
    assert client.get("/v1/nodes/n1").json()["drain"] is False
    assert ctl.schedule_tick().startswith("started 1 jobs")
    assert submitted
