"""POST /v1/jobs after its tuning (docs/architecture.md, "Store"): the reply the route builds
itself, the submit event in the same transaction, and satisfiability verdicts remembered only
for the node view they were reached on.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from api_auth import ADMIN, ANONYMOUS, as_agent, as_user
from fastapi.testclient import TestClient

from phalanx.controller.api_models import HeartbeatIn
from phalanx.controller.runtime import Controller
from phalanx.domain import placement_reasons

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
    real = placement_reasons.unsatisfiable_reason

    def counting(*args: Any, **kw: Any) -> str | None:
        calls.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(placement_reasons, "unsatisfiable_reason", counting)
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


def raw_post(client: TestClient, body: bytes, content_type: str, headers: dict[str, str]) -> Any:
    return client.post("/v1/jobs", content=body, headers={**headers, "Content-Type": content_type})


def test_fast_path_answers_as_the_route(client: TestClient) -> None:
    """`application/json` takes the fast path (controller/fastpath.py); with a charset
    parameter the same request takes the FastAPI route: both must answer alike, for good
    bodies and for every kind of refusal the fast path hands back to the route."""
    good = b'{"argv": ["/bin/true"], "hold": true, "name": "fp"}'
    replies = [raw_post(client, good, ct, ALICE) for ct in FAST_AND_ROUTE]
    assert [r.status_code for r in replies] == [201, 201]
    a, b = (r.json() for r in replies)
    assert b["job_id"] == a["job_id"] + 1 and a == {
        **b,
        "job_id": a["job_id"],
        "job_ids": [a["job_id"]],
    }
    cases = [
        (b'{"argv": ["/bin/true"]', ALICE, 422),  # not JSON
        (b'["/bin/true"]', ALICE, 422),  # JSON, not an object
        (b'{"argv": ["/bin/true"], "nodes": 0}', ALICE, 422),  # not a valid JobSpec
        (b'{"argv": ["/bin/true"], "user": "bob"}', ALICE, 403),  # another user's name
        (b'{"argv": ["/bin/t\\u0000rue"]}', ALICE, 422),  # NUL
        (good, {"Authorization": "Bearer forged"}, 401),
        (good, {"Authorization": "Basic x"}, 401),
        (good, ANONYMOUS, 401),
        (good, as_agent("n1"), 403),  # an agent may not submit
        (good, as_user("root"), 403),  # jobs as root are refused by default
    ]
    for body, headers, status in cases:
        fast, route = (raw_post(client, body, ct, headers) for ct in FAST_AND_ROUTE)
        assert (fast.status_code, fast.json()) == (route.status_code, route.json()), body
        assert fast.status_code == status, (body, fast.text)
        assert fast.headers.get("www-authenticate") == route.headers.get("www-authenticate")


FAST_AND_ROUTE = ("application/json", "application/json; charset=utf-8")


def test_group_commit_answers_each_request_after_one_commit(
    client: TestClient, ctl: Controller
) -> None:
    """Requests queued while a group is being stored go into the next transaction together,
    each answered with its own ids once that transaction committed; one refused request
    (an unknown dependency, found only inside the transaction) fails alone."""
    q = ctl.submitq
    real = q.store_group
    release = threading.Event()
    sizes: list[int] = []

    def gated(requests: list[Any]) -> list[Any]:
        sizes.append(len(requests))
        if len(sizes) == 1:
            release.wait(120)  # the first group holds the writer while the others queue up
        return real(requests)

    q.store_group = gated
    good = {"argv": ["/bin/true"], "hold": True}
    bad = {**good, "dependency": "afterok:999999"}
    bodies = [good, good, bad, good, good]
    users = ["alice", "bob", "carol", "alice", "bob"]
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        first = pool.submit(client.post, "/v1/jobs", json=good, headers=ALICE)
        deadline = time.monotonic() + 60  # generous: a busy 2-core machine
        while not sizes and time.monotonic() < deadline:
            time.sleep(0.01)
        rest = [
            pool.submit(client.post, "/v1/jobs", json=b, headers=as_user(u))
            for b, u in zip(bodies, users, strict=True)
        ]
        while len(q._waiting) < len(bodies) and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        replies = [first.result(), *(f.result() for f in rest)]
    assert sizes == [1, len(bodies)]
    codes = [r.status_code for r in replies]
    assert codes == [201, 201, 201, 422, 201, 201], [r.text for r in replies]
    assert "dependency: job 999999 does not exist" in replies[3].json()["error"]["message"]
    stored = {
        r.json()["job_id"]: u
        for r, u in zip(replies, ["alice", *users], strict=True)
        if r.status_code == 201
    }
    for jid, user in stored.items():
        job = client.get(f"/v1/jobs/{jid}", headers=ADMIN).json()["jobs"][0]
        assert (job["user"], job["state"]) == (user, "HELD")
        events = client.get(f"/v1/jobs/{jid}/events", headers=ADMIN).json()["events"]
        assert [(e["kind"], e["actor"]) for e in events] == [("job.submit", user)]


def raw_heartbeat(
    client: TestClient, node: str, body: bytes, content_type: str, headers: dict[str, str]
) -> Any:
    return client.post(
        f"/v1/agents/{node}/heartbeat",
        content=body,
        headers={**headers, "Content-Type": content_type},
    )


def test_heartbeat_fast_path_answers_as_the_route(
    client: TestClient, ctl: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A heartbeat takes the fast path too (controller/fastpath.py): its answer, and every
    refusal it hands back to the route, are the route's."""
    register(client, "n1", cpus=4)
    jid = client.post("/v1/jobs", json={"argv": ["/bin/true"]}, headers=ALICE).json()["job_id"]
    ctl.schedule_tick()  # placed on n1: the reply carries its launch
    good = b'{"tasks": [], "wait": 0}'
    # the fast path validates the body itself (FastAPI's route validates it another way)
    validated: list[Any] = []
    real = HeartbeatIn.model_validate.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        HeartbeatIn, "model_validate", classmethod(lambda c, d: validated.append(d) or real(c, d))
    )
    fast, route = (raw_heartbeat(client, "n1", good, ct, as_agent("n1")) for ct in FAST_AND_ROUTE)
    assert validated == [{"tasks": [], "wait": 0}]  # the first only
    assert (fast.status_code, route.status_code) == (200, 200)
    a, b = fast.json(), route.json()
    assert [s["job_id"] for s in a["start"]] == [jid]
    assert a.keys() == b.keys() and a["start"] == b["start"] and a["controller"] == ctl.cid
    cases = [
        (b'{"tasks": [', as_agent("n1"), 422),  # not JSON
        (b"[]", as_agent("n1"), 422),  # JSON, not an object
        (b'{"wait": 100}', as_agent("n1"), 422),  # not a valid heartbeat
        (b'{"steps_at": "h\\u0000:1"}', as_agent("n1"), 422),  # NUL
        (good, as_agent("n2"), 403),  # another node's agent
        (good, ALICE, 403),  # a user is not an agent
        (good, {"Authorization": "Bearer forged"}, 401),
        (good, ANONYMOUS, 401),
    ]
    for body, headers, status in cases:
        fast, route = (raw_heartbeat(client, "n1", body, ct, headers) for ct in FAST_AND_ROUTE)
        assert (fast.status_code, fast.json()) == (route.status_code, route.json()), body
        assert fast.status_code == status, (body, fast.text)
