"""POST /v1/jobs after its tuning (docs/architecture.md, "Store"): the reply the route builds
itself, the submit event in the same transaction, and satisfiability verdicts remembered only
for the node view they were reached on.
"""

from __future__ import annotations

from typing import Any

import pytest
from api_auth import as_user
from fastapi.testclient import TestClient

from phalanx.controller.runtime import Controller
from phalanx.domain import placement

ALICE = as_user("alice")


def register(client: TestClient, node: str, cpus: int) -> None:
    body = {"cpus": cpus, "mem_mb": 8192, "gpus": [], "features": [], "addr": "127.0.0.1"}
    r = client.post(f"/v1/agents/{node}/register", json=body)
    assert r.status_code == 200, r.text


def test_reply_and_event(client: TestClient) -> None:
    r = client.post("/v1/jobs", json={"argv": ["/bin/true"], "hold": True}, headers=ALICE)
    assert r.status_code == 201 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body == {"job_id": body["job_ids"][0], "job_ids": [body["job_id"]], "array": False}
    r = client.post("/v1/jobs", json={"argv": ["/bin/true"], "array": "0-2"}, headers=ALICE)
    arr = r.json()
    assert r.status_code == 201 and arr["array"] is True and len(arr["job_ids"]) == 3
    jid = body["job_id"]
    job = client.get(f"/v1/jobs/{jid}", headers=ALICE).json()["jobs"][0]
    assert (job["user"], job["state"]) == ("alice", "HELD")
    events = client.get(f"/v1/jobs/{jid}/events", headers=ALICE).json()["events"]
    assert [e["kind"] for e in events] == ["job.submit"] and events[0]["actor"] == "alice"


def test_verdicts_per_node_view(
    client: TestClient, ctl: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    real = placement.unsatisfiable_reason

    def counting(*args: Any, **kw: Any) -> str | None:
        calls.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(placement, "unsatisfiable_reason", counting)
    register(client, "n1", cpus=4)
    big = {"argv": ["/bin/true"], "cpus_per_task": 8, "hold": True}
    for _ in range(2):  # refused both times, judged once
        r = client.post("/v1/jobs", json=big, headers=ALICE)
        assert r.status_code == 422 and r.json()["error"]["code"] == "unsatisfiable"
    assert len(calls) == 1
    small = {"argv": ["/bin/true"], "cpus_per_task": 2, "hold": True}
    for _ in range(3):
        assert client.post("/v1/jobs", json=small, headers=ALICE).status_code == 201
    assert len(calls) == 2  # another shape: judged once more
    # a node that could hold it registers: a new view, judged afresh, and accepted
    register(client, "n2", cpus=16)
    assert client.post("/v1/jobs", json=big, headers=ALICE).status_code == 201
    assert len(calls) == 3
