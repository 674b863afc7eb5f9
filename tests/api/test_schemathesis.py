"""Property-based API tests with Schemathesis: requests generated from the app's own OpenAPI
document (valid and invalid ones) must never get a server error.

The app is the real one (create_app over a real SQLite store and Controller, as conftest
builds it), called in process over ASGI. Each operation runs twice, once as an admin (who may
call everything) and once as a normal user (who is refused much, and must be refused cleanly:
401/403/404/422, never 500). Agent routes need the credential of the node in their path; the
test brings it per case, as a real agent would.

Bounded: a fixed number of examples per operation, derandomized, so a run is reproducible and
takes well under a minute or two on two cores.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from api_auth import ADMIN, KEYS, AuthedClient, as_agent, as_user
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from phalanx.auth.keys import NAME_RE
from phalanx.config import load_config
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.store.store import Store

PARTITIONS = [
    {"name": "batch", "default": True, "max_time": "2:00:00", "default_time": "1:00:00"},
    {"name": "long", "max_time": "UNLIMITED"},
]
# generated cases per operation and role: 25 in `make test` (the API has ~80 operations, 50
# took 3.5 minutes of one worker), more in `make soak` (PHX_API_FUZZ_EXAMPLES, the Makefile)
EXAMPLES = int(os.environ.get("PHX_API_FUZZ_EXAMPLES", "25"))
AGENT_PATH = re.compile(r"^/v1/agents/(?P<node>[^/]+)/")


def build(path: Path) -> tuple[Any, Store]:
    """The real app over a fresh store in `path`, with something for generated ids and names
    to find: nodes, jobs of two users, a maintenance window."""
    config = load_config(
        overrides={
            "cluster": {"partitions": PARTITIONS},
            # long-polls end at once: generated heartbeats ask to wait up to 60 s
            "timing": {"heartbeat_interval": 0.05},
        }
    )
    store = Store(f"sqlite:///{path}/schema.db", actor="t")
    store.migrate()
    store.sync_partitions(partition_rows(config))
    ctl = Controller(store, config, cid="t")
    assert "took term" in ctl.leases.tick()
    return create_app(ctl, KEYS), store


def openapi_document() -> dict[str, Any]:
    os.environ.pop("PHALANX_CONFIG", None)
    with tempfile.TemporaryDirectory() as tmp:
        app, store = build(Path(tmp))
        try:
            return dict(app.openapi())
        finally:
            store.close()


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("every call names its app (app=api_app)")


# The document is the app's own. Loaded at import (as parametrize needs it) from a scratch
# app; each test then calls a fresh app of its own (`app=`), so runs do not share state.
# (schemathesis.pytest.from_fixture would be the natural way, but 4.32 sets
# `request.node._nodeid`, which pytest 9 no longer has.)
schema = schemathesis.openapi.from_dict(openapi_document())
schema.app = _no_app  # an ASGI app: calls go in process, through the ASGI transport


@pytest.fixture
def api_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    app, store = build(tmp_path)
    with AuthedClient(app) as c:
        for node in ("n1", "n2"):
            r = c.post(f"/v1/agents/{node}/register", json={"cpus": 4, "mem_mb": 4096})
            assert r.status_code == 200, r.text
        for user in ("alice", "bob"):
            r = c.post("/v1/jobs", json={"argv": ["/bin/true"]}, headers=as_user(user))
            assert r.status_code == 201, r.text
        r = c.post("/v1/maintenance", json={"nodes": "n2", "start": "now+1h", "duration": 60})
        assert r.status_code == 201, r.text
    try:
        yield app
    finally:
        store.close()


def headers_for(case: Any, default: dict[str, str]) -> dict[str, str]:
    """An agent route gets the agent credential of the node in its path (when the generated
    name could be a node at all; otherwise the default, which is refused with 403)."""
    m = AGENT_PATH.match(case.formatted_path)
    if m and NAME_RE.match(m.group("node")):
        return as_agent(m.group("node"))
    return default


SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@SETTINGS
def test_no_server_error_as_admin(case: Any, api_app: Any) -> None:
    case.call_and_validate(
        headers=headers_for(case, ADMIN), checks=[not_a_server_error], app=api_app
    )


@schema.parametrize()
@SETTINGS
def test_no_server_error_as_user(case: Any, api_app: Any) -> None:
    case.call_and_validate(
        headers=headers_for(case, as_user("carol")), checks=[not_a_server_error], app=api_app
    )


# What the runs above found (each was a 500), kept as plain regression tests: a number no
# 64-bit column holds, or a time no clock can show, is the caller's mistake (4xx), not ours.
BIG = 2**63
FOUND = [
    ("GET", f"/v1/maintenance/{BIG}", None, 422),
    ("DELETE", f"/v1/maintenance/{BIG}", None, 422),
    ("POST", "/v1/agents/n1/register", {"cpus": 4, "mem_mb": BIG}, 422),
    ("POST", "/v1/agents/n1/register", {"cpus": BIG, "mem_mb": 4096}, 422),
    (
        "POST",
        "/v1/agents/n1/heartbeat",
        {"wait": 0, "tasks": [{"attempt_id": BIG, "token": "x", "state": "exited"}]},
        422,
    ),
    ("GET", f"/v1/events?since={BIG}", None, 422),
    ("GET", f"/v1/jobs/{BIG}", None, 404),
    ("GET", f"/v1/jobs/{BIG}/events", None, 404),
    ("GET", f"/v1/jobs/1_{BIG}", None, 404),
    ("POST", "/v1/jobs/cancel", {"jobs": [str(BIG)]}, 404),
    ("POST", "/v1/jobs/hold", {"jobs": [f"{BIG}_1"]}, 404),
    ("POST", "/v1/maintenance", {"nodes": "n1", "start": BIG, "duration": 60}, 422),
    ("POST", "/v1/maintenance", {"nodes": "n1", "start": 1e300, "duration": 60}, 422),
    ("POST", "/v1/maintenance", {"nodes": "n1", "start": "now", "end": 1e300}, 422),
    ("POST", "/v1/jobs", {"argv": ["/bin/true"], "nodes_max": BIG}, 422),
]


@pytest.mark.parametrize(("method", "url", "body", "status"), FOUND, ids=lambda v: str(v)[:40])
def test_what_schemathesis_found(
    api_app: Any, method: str, url: str, body: Any, status: int
) -> None:
    with AuthedClient(api_app, raise_server_exceptions=False) as c:
        r = c.request(method, url, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] in ("invalid_spec", "not_found") and err["message"]
    with AuthedClient(api_app) as c:  # and nothing else broke: the listing still works
        assert c.get(f"/v1/jobs?job={BIG}").json() == {"jobs": []}


# ------------------------------------------------------------------ hostile sizes and depths
# Every operation of the document that takes a body, with what no generator tries: JSON nested
# 100,000 levels deep (a RecursionError in Python's parser: a 500, before guard.py), a
# Content-Length far over the body limit (refused before a byte is read), and each string
# field of the body given a megabyte. None may be a server error.
DOC = openapi_document()
PARAMS = {
    "ref": "1",
    "node": "n1",
    "name": "n1",
    "wid": "1",
    "step_id": "0",
    "asset": "x",
    "run_id": "r1",
}


def _resolve(node: Any) -> Any:
    while isinstance(node, dict) and "$ref" in node:
        node = DOC["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _stringy(prop: Any) -> bool:
    """Whether a property may be a string (`str` or `str | None`, pydantic's anyOf)."""
    prop = _resolve(prop)
    return prop.get("type") == "string" or any(_stringy(p) for p in prop.get("anyOf", []))


def _body_operations() -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for path, ops in DOC["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {})
            if "application/json" in content:
                schema = _resolve(content["application/json"]["schema"])
                out.append((method.upper(), path.format(**PARAMS), schema))
    return out


BODY_OPS = _body_operations()


def test_the_hostile_walk_covers_the_posts() -> None:
    assert len(BODY_OPS) >= 15
    assert ("POST", "/v1/jobs") in {(m, p) for m, p, _ in BODY_OPS}


@pytest.mark.parametrize(("method", "path", "schema"), BODY_OPS, ids=lambda v: str(v)[:40])
def test_hostile_depths_and_sizes_never_get_a_server_error(
    api_app: Any, method: str, path: str, schema: dict[str, Any]
) -> None:
    from test_request_limits import call, never

    agent = AGENT_PATH.match(path)
    who = as_agent(agent.group("node")) if agent else ADMIN
    with AuthedClient(api_app, raise_server_exceptions=False) as c:
        for depth in (100_000, 65):
            deep = b"[" * depth + b"]" * depth
            r = c.request(
                method, path, content=deep, headers={**who, "content-type": "application/json"}
            )
            assert r.status_code == 400, (depth, r.text)
            assert r.json()["error"]["code"] == "bad_request"
        props = schema.get("properties") or {}
        big = {k: "s" * (1 << 20) for k, v in props.items() if _stringy(v)}
        if big:
            r = c.request(method, path, json=big, headers=who)
            assert r.status_code < 500, r.text
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(1 << 30).encode()),
        (b"authorization", who["Authorization"].encode()),
    ]
    status, body, _ = call(api_app, method, path, headers, never)
    assert status == 413, body
