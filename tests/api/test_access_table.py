"""The authorization table against the real app: every route has a rule, every rule a route,
and every route answers every kind of caller the way its rule says.

Then the rules that are not a role: ownership of jobs, private data, the identity events
record, jobs that would run as someone else or as root, admin tokens, and rate limits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_auth import ADMIN, ANONYMOUS, CLUSTER, KEYS, AuthedClient, as_agent, as_user
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from phalanx.auth import keys as keyfiles
from phalanx.auth.tokens import mint_local, mint_token
from phalanx.config import load_config
from phalanx.controller import access
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.store.store import Store
from schema_copy import fresh_db

ALICE = as_user("alice")
BOB = as_user("bob")
OPS = as_user("ops", "operator")
FORGED = {
    "Authorization": "Bearer "
    + mint_token(
        keyfiles.KeySet([keyfiles.new_key("test")]),  # the right kid, another cluster's secret
        user="admin",
        role="admin",
        cluster=CLUSTER,
        lifetime=3600,
    )
}
GARBAGE = {"Authorization": "Bearer not-a-jwt"}

CALLERS: dict[str, dict[str, str]] = {
    "anonymous": ANONYMOUS,
    "garbage": GARBAGE,
    "forged": FORGED,
    "alice": ALICE,
    "bob": BOB,
    "operator": OPS,
    "admin": ADMIN,
    "agent-n1": as_agent("n1"),
    "agent-n2": as_agent("n2"),
}
ROLE_OF = {"alice": "user", "bob": "user", "operator": "operator", "admin": "admin"}
PARTITIONS = [{"name": "batch", "default": True, "max_time": "2:00:00", "default_time": "1:00:00"}]
JOB = {"argv": ["/bin/true"], "time_limit_s": 60}


# ------------------------------------------------------------------ a cluster to call


def make_client(
    tmp_path: Path, schema_db: Path, **overrides: Any
) -> Iterator[tuple[AuthedClient, Controller]]:
    cfg = load_config(overrides={"cluster": {"partitions": PARTITIONS}, **overrides})
    st = Store(fresh_db(schema_db, tmp_path / "access.db"), actor="t")
    st.sync_partitions(partition_rows(cfg))
    ctl = Controller(st, cfg, cid="t")
    assert "took term" in ctl.leases.tick()
    try:
        with AuthedClient(create_app(ctl, KEYS)) as c:
            for node in ("n1", "n2"):
                r = c.post(f"/v1/agents/{node}/register", json={"cpus": 4, "mem_mb": 8192})
                assert r.status_code == 200, r.text
            yield c, ctl
    finally:
        st.close()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schema_db: Path) -> Iterator[Any]:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)

    def factory(**overrides: Any) -> tuple[AuthedClient, Controller]:
        gen = make_client(tmp_path / f"c{len(gens)}", schema_db, **overrides)
        (tmp_path / f"c{len(gens)}").mkdir()
        gens.append(gen)
        return next(gen)

    gens: list[Iterator[Any]] = []
    yield factory
    for g in gens:
        g.close()


def submit(c: TestClient, who: dict[str, str], **spec: Any) -> int:
    r = c.post("/v1/jobs", json={**JOB, **spec}, headers=who)
    assert r.status_code == 201, r.text
    return int(r.json()["job_id"])


def job_state(ctl: Controller, jid: int) -> str:
    return str(ctl.store.get_job(jid)["state"])


# ------------------------------------------------------------------ the table is complete


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every APIRoute, those of included routers too (FastAPI >= 0.16x
    keeps an included router as one `_IncludedRouter` entry of app.routes)."""
    out: set[tuple[str, str]] = set()

    def walk(routes: list[Any], prefix: str) -> None:
        for r in routes:
            if isinstance(r, APIRoute):
                out.update((m, prefix + r.path) for m in r.methods)
            elif hasattr(r, "original_router"):  # an included router
                walk(r.original_router.routes, prefix + r.include_context.prefix)

    walk(app.routes, "")
    return out


# routes that describe the API rather than being part of it: left out of the OpenAPI document
UNDOCUMENTED = {
    ("GET", "/v1/openapi.json"),
    ("GET", "/v1/docs"),
    ("GET", "/v1/redoc"),
    ("GET", "/v1/docs/assets/{name}"),
}


def test_every_route_has_a_rule_and_every_rule_a_route(client: TestClient) -> None:
    doc = client.get("/v1/openapi.json", headers=ANONYMOUS).json()
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routes = app_routes(client.app)
    assert documented == routes - UNDOCUMENTED, (
        "a route is hidden from (or only in) the OpenAPI document"
    )
    assert routes >= UNDOCUMENTED
    assert routes - set(access.RULES) == set(), "routes without a rule: nobody may call them"
    assert set(access.RULES) - routes == set(), "stale rules for routes that do not exist"
    assert len(routes) >= 25


def test_a_route_without_a_rule_is_refused_to_everyone() -> None:
    ident = access.Identity("admin", "admin", "token")
    with pytest.raises(access.Forbidden, match="no authorization rule"):
        access.decide(None, ident, {})


# ------------------------------------------------------------------ every route x every caller

# per route: (path with the parameters filled in, a minimal valid body), given the fixtures
# of one fresh setup: {job} is a pending job of alice's, {wid} a live maintenance window on n1,
# {resv} a reservation on n2 to come
BODIES: dict[tuple[str, str], tuple[str, Any]] = {
    ("GET", "/healthz"): ("/healthz", None),
    ("GET", "/healthz/live"): ("/healthz/live", None),
    ("GET", "/healthz/ready"): ("/healthz/ready", None),
    ("GET", "/metrics"): ("/metrics", None),
    ("GET", "/ui"): ("/ui", None),
    ("GET", "/ui/{asset}"): ("/ui/app.js", None),
    ("GET", "/v1/openapi.json"): ("/v1/openapi.json", None),
    ("GET", "/v1/docs"): ("/v1/docs", None),
    ("GET", "/v1/redoc"): ("/v1/redoc", None),
    ("GET", "/v1/docs/assets/{name}"): ("/v1/docs/assets/swagger-ui.css", None),
    ("GET", "/v1/whoami"): ("/v1/whoami", None),
    ("GET", "/v1/queue"): ("/v1/queue?state=all&user=alice", None),
    ("GET", "/v1/jobs/{ref}/output"): ("/v1/jobs/{job}/output", None),
    ("POST", "/v1/jobs"): ("/v1/jobs", JOB),
    ("POST", "/v1/jobs/batch"): ("/v1/jobs/batch", {"jobs": [JOB, JOB]}),
    ("GET", "/v1/jobs"): ("/v1/jobs", None),
    ("GET", "/v1/jobs/{ref}"): ("/v1/jobs/{job}", None),
    ("GET", "/v1/jobs/{ref}/events"): ("/v1/jobs/{job}/events", None),
    ("GET", "/v1/jobs/{ref}/explain"): ("/v1/jobs/{job}/explain", None),
    ("POST", "/v1/jobs/cancel"): ("/v1/jobs/cancel", {"jobs": ["{job}"]}),
    ("POST", "/v1/jobs/hold"): ("/v1/jobs/hold", {"jobs": ["{job}"]}),
    ("POST", "/v1/jobs/signal"): (
        "/v1/jobs/signal",
        {"jobs": ["{job}"], "signal": 10, "target": "batch"},
    ),
    ("POST", "/v1/jobs/release"): ("/v1/jobs/release", {"jobs": ["{job}"]}),
    ("POST", "/v1/jobs/requeue"): ("/v1/jobs/requeue", {"jobs": ["{job}"], "hold": True}),
    ("POST", "/v1/jobs/update"): ("/v1/jobs/update", {"jobs": ["{job}"], "time_limit": "0:30"}),
    ("POST", "/v1/jobs/{ref}/steps"): (
        "/v1/jobs/{job}/steps",
        {"argv": ["true"], "host": "127.0.0.1", "port": 9, "cookie": "c" * 32},
    ),
    ("GET", "/v1/jobs/{ref}/steps/{step_id}"): ("/v1/jobs/{job}/steps/0", None),
    ("GET", "/v1/jobs/{ref}/priority"): ("/v1/jobs/{job}/priority", None),
    ("GET", "/v1/jobs/{ref}/usage"): ("/v1/jobs/{job}/usage", None),
    ("GET", "/v1/share"): ("/v1/share", None),
    ("POST", "/v1/jobs/{ref}/steps/signal"): ("/v1/jobs/{job}/steps/signal", {"signal": 10}),
    ("POST", "/v1/jobs/{ref}/steps/cancel"): ("/v1/jobs/{job}/steps/cancel", {}),
    ("POST", "/v1/jobs/{ref}/steps/{step_id}/wake"): (
        "/v1/jobs/{job}/steps/0/wake",
        {"nodes": ["n1"]},
    ),
    ("POST", "/v1/jobs/{ref}/steps/{step_id}/attach"): ("/v1/jobs/{job}/steps/0/attach", None),
    ("GET", "/v1/jobs/{ref}/rendezvous/{run_id}/state"): (
        "/v1/jobs/{job}/rendezvous/r1/state",
        None,
    ),
    ("PUT", "/v1/jobs/{ref}/rendezvous/{run_id}/state"): (
        "/v1/jobs/{job}/rendezvous/r1/state",
        {"state": "AA=="},
    ),
    ("POST", "/v1/jobs/{ref}/rendezvous/{run_id}/kv"): (
        "/v1/jobs/{job}/rendezvous/r1/kv",
        {"op": "count"},
    ),
    ("GET", "/v1/nodes"): ("/v1/nodes", None),
    ("GET", "/v1/nodes/{name}"): ("/v1/nodes/n1", None),
    ("POST", "/v1/nodes/{name}/drain"): ("/v1/nodes/n1/drain", {"reason": "disk"}),
    ("POST", "/v1/nodes/{name}/resume"): ("/v1/nodes/n1/resume", None),
    ("GET", "/v1/cluster"): ("/v1/cluster", None),
    ("GET", "/v1/diag"): ("/v1/diag", None),
    ("GET", "/v1/report/usage"): ("/v1/report/usage?start=0&end=86400", None),
    ("GET", "/v1/licenses"): ("/v1/licenses", None),
    ("GET", "/v1/events"): ("/v1/events", None),
    ("GET", "/v1/maintenance"): ("/v1/maintenance", None),
    ("GET", "/v1/maintenance/{wid}"): ("/v1/maintenance/{wid}", None),
    ("POST", "/v1/maintenance"): (
        "/v1/maintenance",
        {"nodes": "n1", "start": "now+2h", "duration": 3600, "reason": "bios"},
    ),
    ("DELETE", "/v1/maintenance/{wid}"): ("/v1/maintenance/{wid}", None),
    ("GET", "/v1/reservations"): ("/v1/reservations", None),
    ("GET", "/v1/reservations/{name}"): ("/v1/reservations/{resv}", None),
    ("POST", "/v1/reservations"): (
        "/v1/reservations",
        {
            "name": "new{job}",
            "nodes": "n2",
            "start": "now+2h",
            "duration": 600,
            "users": ["alice"],
            "flags": ["OVERLAP"],
        },
    ),
    ("POST", "/v1/reservations/{name}/update"): (
        "/v1/reservations/{resv}/update",
        {"duration": 1200},
    ),
    ("DELETE", "/v1/reservations/{name}"): ("/v1/reservations/{resv}", None),
    ("POST", "/v1/tokens"): ("/v1/tokens", {"user": "carol", "role": "user"}),
    # the cluster configuration's versions (this store has none: 404 past the check)
    ("GET", "/v1/config"): ("/v1/config", None),
    ("GET", "/v1/config/history"): ("/v1/config/history", None),
    ("GET", "/v1/config/{version}"): ("/v1/config/1", None),
    ("POST", "/v1/config/check"): ("/v1/config/check", {"text": ""}),
    ("POST", "/v1/config/apply"): ("/v1/config/apply", {"text": "[priority]\nweight_age = 1\n"}),
    ("POST", "/v1/config/rollback"): ("/v1/config/rollback", {}),
    ("GET", "/v1/accounts"): ("/v1/accounts", None),
    ("POST", "/v1/accounts/add"): ("/v1/accounts/add", {"kind": "qos", "names": ["q{job}"]}),
    ("POST", "/v1/accounts/modify"): (
        "/v1/accounts/modify",
        {"kind": "qos", "where": {"names": ["normal"]}, "settings": {"priority": 1}},
    ),
    ("POST", "/v1/accounts/delete"): (
        "/v1/accounts/delete",
        {"kind": "qos", "where": {"names": ["q{job}"]}},
    ),
    ("POST", "/v1/accounts/import"): ("/v1/accounts/import", {"replace": True}),
    ("POST", "/v1/agents/{node}/register"): (
        "/v1/agents/n1/register",
        {"cpus": 4, "mem_mb": 8192},
    ),
    ("POST", "/v1/agents/{node}/heartbeat"): ("/v1/agents/n1/heartbeat", {"wait": 0}),
}

# (route, caller) pairs that the role allows but ownership or private data refuses
OWNER_REFUSALS = {
    (("GET", "/v1/jobs/{ref}/events"), "bob"),  # private_data: her events are hers
    (("GET", "/v1/jobs/{ref}/output"), "bob"),  # her output is hers, private_data or not
    (("GET", "/v1/jobs/{ref}/explain"), "bob"),  # private_data: so is why her job waits
    (("POST", "/v1/jobs/cancel"), "bob"),
    (("POST", "/v1/jobs/hold"), "bob"),
    (("POST", "/v1/jobs/signal"), "bob"),
    (("POST", "/v1/jobs/release"), "bob"),
    (("POST", "/v1/jobs/requeue"), "bob"),
    (("POST", "/v1/jobs/update"), "bob"),
    (("POST", "/v1/jobs/{ref}/steps"), "bob"),
    (("GET", "/v1/jobs/{ref}/steps/{step_id}"), "bob"),
    (("POST", "/v1/jobs/{ref}/steps/signal"), "bob"),
    (("POST", "/v1/jobs/{ref}/steps/cancel"), "bob"),
    (("POST", "/v1/jobs/{ref}/steps/{step_id}/wake"), "bob"),
    (("POST", "/v1/jobs/{ref}/steps/{step_id}/attach"), "bob"),
    # attaching (her step's output, its stdin): her and admins, as slurmstepd lets the owner,
    # root and SlurmUser attach; operators act on her jobs but do not attach to them
    (("POST", "/v1/jobs/{ref}/steps/{step_id}/attach"), "operator"),
    (("GET", "/v1/jobs/{ref}/priority"), "bob"),
    (("GET", "/v1/jobs/{ref}/usage"), "bob"),
    (("GET", "/v1/jobs/{ref}/rendezvous/{run_id}/state"), "bob"),
    (("PUT", "/v1/jobs/{ref}/rendezvous/{run_id}/state"), "bob"),
    (("POST", "/v1/jobs/{ref}/rendezvous/{run_id}/kv"), "bob"),
}
# The matrix's jobs are pending: a step route that let the caller through then refuses on the
# job's state (no step can start in a pending job, it has no step 0): past authorization.
PAST_AUTH = {
    ("POST", "/v1/jobs/{ref}/steps"): {409},
    ("GET", "/v1/jobs/{ref}/steps/{step_id}"): {404},
    ("POST", "/v1/jobs/{ref}/steps/{step_id}/wake"): {404},
    ("POST", "/v1/jobs/{ref}/steps/{step_id}/attach"): {404},
    # a rendezvous is a running job's
    ("GET", "/v1/jobs/{ref}/rendezvous/{run_id}/state"): {409},
    ("PUT", "/v1/jobs/{ref}/rendezvous/{run_id}/state"): {409},
    ("POST", "/v1/jobs/{ref}/rendezvous/{run_id}/kv"): {409},
    ("POST", "/v1/accounts/delete"): {404},  # nothing of that name: past the check
    ("GET", "/v1/config"): {404},  # no version in this store yet
    ("GET", "/v1/config/{version}"): {404},
    ("POST", "/v1/config/rollback"): {404},
}
SUCCESS = {"POST": {200, 201}, "GET": {200}, "PUT": {200}, "DELETE": {200}}
PUBLIC_OK = {200, 503}  # health may say "not ready" (no loops run here), never "who are you"


def expected(route: tuple[str, str], caller: str) -> str:
    """'ok', '401' or '403' for this caller on this route, from the rule alone."""
    rule = access.RULES[route]
    if rule.level == access.PUBLIC:
        return "ok"
    if caller in ("anonymous", "garbage", "forged"):
        return "401"
    if rule.level == access.AGENT:
        return "ok" if caller == "agent-n1" else "403"
    if caller.startswith("agent"):
        return "403"
    order = ["user", "operator", "admin"]
    if order.index(ROLE_OF[caller]) < order.index(rule.level):
        return "403"
    if (route, caller) in OWNER_REFUSALS:
        return "403"
    return "ok"


def fill(value: Any, params: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**params)
    if isinstance(value, list):
        return [fill(v, params) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, params) for k, v in value.items()}
    return value


def test_the_body_table_covers_every_rule() -> None:
    assert set(BODIES) == set(access.RULES)


# the policy, written out once more by hand: the matrix below derives its expectations from
# RULES, so a route moved to a weaker level there must also fail here
POLICY = {
    "public": {
        "/healthz",
        "/healthz/live",
        "/healthz/ready",
        "/metrics",
        "/ui",
        "/ui/{asset}",
        "/v1/openapi.json",
        "/v1/docs",
        "/v1/redoc",
        "/v1/docs/assets/{name}",
    },
    "operator": {
        "POST /v1/nodes/{name}/drain",
        "POST /v1/nodes/{name}/resume",
        "GET /v1/events",
        "POST /v1/maintenance",
        "DELETE /v1/maintenance/{wid}",
        "POST /v1/reservations",
        "POST /v1/reservations/{name}/update",
        "DELETE /v1/reservations/{name}",
    },
    "admin": {
        "POST /v1/tokens",
        "POST /v1/accounts/add",
        "POST /v1/accounts/modify",
        "POST /v1/accounts/delete",
        "POST /v1/accounts/import",
        "GET /v1/config",
        "GET /v1/config/history",
        "GET /v1/config/{version}",
        "POST /v1/config/check",
        "POST /v1/config/apply",
        "POST /v1/config/rollback",
    },
    "agent": {"POST /v1/agents/{node}/register", "POST /v1/agents/{node}/heartbeat"},
}
OWNED = {
    "GET /v1/jobs/{ref}",
    "GET /v1/jobs/{ref}/events",
    "GET /v1/jobs/{ref}/output",
    "GET /v1/jobs/{ref}/explain",
    "POST /v1/jobs/cancel",
    "POST /v1/jobs/hold",
    "POST /v1/jobs/release",
    "POST /v1/jobs/signal",
    "POST /v1/jobs/requeue",
    "POST /v1/jobs/update",
    "POST /v1/jobs/{ref}/steps",
    "GET /v1/jobs/{ref}/steps/{step_id}",
    "POST /v1/jobs/{ref}/steps/signal",
    "POST /v1/jobs/{ref}/steps/cancel",
    "POST /v1/jobs/{ref}/steps/{step_id}/wake",
    "POST /v1/jobs/{ref}/steps/{step_id}/attach",
    "GET /v1/jobs/{ref}/priority",
    "GET /v1/jobs/{ref}/usage",
    "GET /v1/jobs/{ref}/rendezvous/{run_id}/state",
    "PUT /v1/jobs/{ref}/rendezvous/{run_id}/state",
    "POST /v1/jobs/{ref}/rendezvous/{run_id}/kv",
}


def test_the_rules_are_the_policy() -> None:
    for (method, path), rule in access.RULES.items():
        name = f"{method} {path}"
        level = next(
            (lvl for lvl, names in POLICY.items() if name in names or path in names), "user"
        )
        if level == "public":
            assert method == "GET", name
        assert rule.level == level, name
        assert rule.owner == (name in OWNED), name
        assert rule.what, name


@pytest.mark.parametrize("route", sorted(access.RULES), ids=lambda r: f"{r[0]} {r[1]}")
def test_every_caller_gets_what_the_rule_says(cluster: Any, route: tuple[str, str]) -> None:
    c, ctl = cluster()
    path, body = BODIES[route]
    for caller, headers in CALLERS.items():
        # fresh objects for each caller, so an earlier caller's cancel or delete cannot
        # turn a later one's answer into a 404 or 409
        jid = submit(c, ALICE)
        if route == ("POST", "/v1/jobs/release"):
            # her own hold (a user hold): an operator's she could not release (test_policy_rules)
            r = c.post("/v1/jobs/hold", json={"jobs": [str(jid)]}, headers=ALICE)
            assert r.status_code == 200
        r = c.post("/v1/maintenance", json={"nodes": "n1", "start": "now+3h", "duration": 600})
        assert r.status_code == 201, r.text
        params = {"job": str(jid), "wid": str(r.json()["window"]["id"]), "resv": f"rv{jid}"}
        r = c.post(
            "/v1/reservations",
            json={
                "name": f"rv{jid}",
                "nodes": "n2",
                "start": "now+3h",
                "duration": 600,
                "users": ["alice"],
                "flags": ["OVERLAP"],
            },
        )
        assert r.status_code == 201, r.text
        if route == ("POST", "/v1/nodes/{name}/resume"):
            c.post("/v1/nodes/n1/drain", json={"reason": "to resume"})
        if route == ("POST", "/v1/nodes/{name}/drain"):
            c.post("/v1/nodes/n1/resume")
        url = fill(path, params)
        r = c.request(route[0], url, headers=headers, json=fill(body, params))
        want = expected(route, caller)
        where = f"{route[0]} {url} as {caller}: {r.status_code} {r.text[:300]}"
        if want == "ok":
            allowed = PUBLIC_OK if access.RULES[route].level == access.PUBLIC else SUCCESS[route[0]]
            allowed = allowed | PAST_AUTH.get(route, set())
            assert r.status_code in allowed, where
        else:
            assert r.status_code == int(want), where
            err = r.json()["error"]
            assert err["code"] == ("unauthenticated" if want == "401" else "forbidden"), where
            assert err["message"], where
            if want == "401":
                assert r.headers.get("WWW-Authenticate") == "Bearer", where
        if want != "ok" and route[0] != "GET":
            # a refused call changed nothing
            assert job_state(ctl, jid) in ("PENDING", "HELD")
            if route == ("POST", "/v1/nodes/{name}/drain"):
                assert not ctl.store.get_node("n1")["drain"], where


def test_agent_of_another_node_is_told_which_node(client: TestClient) -> None:
    r = client.post("/v1/agents/n1/heartbeat", json={"wait": 0}, headers=as_agent("n2"))
    assert r.status_code == 403
    msg = r.json()["error"]["message"]
    assert "n2" in msg and "n1" in msg


def test_refusals_say_why(client: TestClient) -> None:
    r = client.post("/v1/nodes/n1/drain", json={"reason": "x"}, headers=BOB)
    assert r.status_code == 403
    assert r.json()["error"]["message"] == "draining a node needs the operator role; bob is a user"
    r = client.get("/v1/whoami", headers=ANONYMOUS)
    assert r.status_code == 401
    assert r.json()["error"]["details"]["reason"] == "missing"
    r = client.get("/v1/whoami", headers=FORGED)
    assert r.json()["error"]["details"]["reason"] == "signature"
    r = client.get("/v1/whoami", headers={"Authorization": "Basic YWxpY2U6cHc="})
    assert r.status_code == 401
    assert r.json()["error"]["details"]["reason"] == "malformed"
    r = client.get("/v1/jobs", headers=as_agent("n1"))
    assert r.status_code == 403
    assert "agent credentials (n1)" in r.json()["error"]["message"]


# ------------------------------------------------------------------ ownership


@pytest.mark.parametrize("action", ["cancel", "hold", "release", "requeue", "update"])
def test_bob_cannot_act_on_alices_job(cluster: Any, action: str) -> None:
    c, ctl = cluster()
    jid = submit(c, ALICE)
    mine = submit(c, BOB)
    if action == "release":  # each held by its owner: user holds (operators' are admin holds)
        assert c.post("/v1/jobs/hold", json={"jobs": [str(jid)]}, headers=ALICE).status_code == 200
        assert c.post("/v1/jobs/hold", json={"jobs": [str(mine)]}, headers=BOB).status_code == 200
    before = {j: job_state(ctl, j) for j in (jid, mine)}
    events_before = len(ctl.store.events())
    extra = {"requeue": {"hold": True}, "update": {"nodes": 2}}.get(action, {})
    for refs in ([str(jid)], [str(mine), str(jid)]):  # one of his own does not let it through
        r = c.post(f"/v1/jobs/{action}", json={"jobs": refs, **extra}, headers=BOB)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["message"].startswith(
            f"job {jid} belongs to alice; bob may act only on their own jobs"
        )
        assert err["details"]["owner"] == "alice"
    assert {j: job_state(ctl, j) for j in (jid, mine)} == before
    assert len(ctl.store.events()) == events_before
    # alice may, and so may an operator
    r = c.post(f"/v1/jobs/{action}", json={"jobs": [str(jid)], **extra}, headers=ALICE)
    assert r.status_code == 200, r.text
    r = c.post(f"/v1/jobs/{action}", json={"jobs": [str(mine)], **extra}, headers=OPS)
    assert r.status_code == 200, r.text


def test_bob_cannot_signal_alices_job(cluster: Any) -> None:
    c, ctl = cluster()
    jid = submit(c, ALICE)
    events_before = len(ctl.store.events())
    body = {"jobs": [str(jid)], "signal": 10, "target": "full"}
    r = c.post("/v1/jobs/signal", json=body, headers=BOB)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["message"] == (
        f"job {jid} belongs to alice; bob may act only on their own jobs (signal)"
    )
    assert len(ctl.store.events()) == events_before
    # alice may ask (her job is still pending: refused as Slurm refuses it, not forbidden)
    r = c.post("/v1/jobs/signal", json=body, headers=ALICE)
    assert r.status_code == 200 and r.json()["results"] == {str(jid): "pending"}, r.text


def test_array_tasks_belong_to_their_submitter(cluster: Any) -> None:
    c, _ = cluster()
    jid = submit(c, ALICE, array="0-3")
    r = c.post("/v1/jobs/cancel", json={"jobs": [f"{jid}_2"]}, headers=BOB)
    assert r.status_code == 403
    assert "belongs to alice" in r.json()["error"]["message"]
    assert all(j["state"] == "PENDING" for j in c.get(f"/v1/jobs/{jid}").json()["jobs"])


PRIVATE = ("command", "workdir", "stdout", "stderr", "submit_dir", "comment")


def test_others_see_a_redacted_job_and_not_its_events(cluster: Any) -> None:
    c, _ = cluster()
    jid = submit(c, ALICE, workdir="/home/alice/secret", comment="key in argv", name="t1")
    listed = c.get("/v1/jobs", headers=BOB).json()["jobs"]
    assert [j["id"] for j in listed] == [jid]
    shown = c.get(f"/v1/jobs/{jid}", headers=BOB).json()["jobs"][0]
    assert shown["private"] is True
    assert shown["user"] == "alice" and shown["state"] == "PENDING"
    for field in PRIVATE:
        assert field not in shown
    assert "/home/alice" not in json.dumps(shown)
    r = c.get(f"/v1/jobs/{jid}/events", headers=BOB)
    assert r.status_code == 403
    assert "private to alice" in r.json()["error"]["message"]
    # the owner and operators see everything
    for who in (ALICE, OPS, ADMIN):
        full = c.get(f"/v1/jobs/{jid}", headers=who).json()["jobs"][0]
        assert full["command"] == "/bin/true"
        assert full["workdir"] == "/home/alice/secret"
        assert "private" not in full
        r = c.get(f"/v1/jobs/{jid}/events", headers=who)
        assert r.status_code == 200 and r.json()["events"]


def test_without_private_data_everyone_sees_everything(cluster: Any) -> None:
    c, _ = cluster(auth={"private_data": False})
    jid = submit(c, ALICE, workdir="/home/alice/w")
    shown = c.get(f"/v1/jobs/{jid}", headers=BOB).json()["jobs"][0]
    assert shown["command"] == "/bin/true" and shown["workdir"] == "/home/alice/w"
    assert "private" not in shown
    r = c.get(f"/v1/jobs/{jid}/events", headers=BOB)
    assert r.status_code == 200 and r.json()["events"]
    # seeing is not acting
    assert c.post("/v1/jobs/cancel", json={"jobs": [str(jid)]}, headers=BOB).status_code == 403


# ------------------------------------------------------------------ identity in events


def test_events_record_the_verified_caller(cluster: Any) -> None:
    c, ctl = cluster()
    jid = submit(c, ALICE)
    assert c.post("/v1/jobs/hold", json={"jobs": [str(jid)]}, headers=ALICE).status_code == 200
    assert c.post("/v1/jobs/release", json={"jobs": [str(jid)]}, headers=OPS).status_code == 200
    assert c.post("/v1/jobs/cancel", json={"jobs": [str(jid)]}, headers=ALICE).status_code == 200
    actors = {e["kind"]: e["actor"] for e in ctl.store.events(job_id=jid)}
    assert actors.get("job.held") == "alice", actors
    assert actors.get("job.pending") == "ops", actors  # released
    assert [e["actor"] for e in ctl.store.events(job_id=jid) if "cancel" in e["kind"]] == [
        "alice"
    ], ctl.store.events(job_id=jid)

    assert c.post("/v1/nodes/n1/drain", json={"reason": "fan"}, headers=OPS).status_code == 200
    assert c.post("/v1/nodes/n1/resume", headers=as_user("root2", "admin")).status_code == 200
    node_events = ctl.store.events(node="n1")
    drain = [e for e in node_events if "drain" in e["kind"]]
    resume = [e for e in node_events if "resum" in e["kind"]]
    assert drain and drain[-1]["actor"] == "ops", node_events
    assert resume and resume[-1]["actor"] == "root2", node_events

    r = c.post(
        "/v1/maintenance",
        json={"nodes": "n2", "start": "now+1h", "duration": 60},
        headers=OPS,
    )
    assert r.json()["window"]["created_by"] == "ops"


def test_drain_by_records_the_operator(cluster: Any) -> None:
    c, ctl = cluster()
    assert c.post("/v1/nodes/n2/drain", json={"reason": "fan"}, headers=OPS).status_code == 200
    assert ctl.store.get_node("n2")["drain_by"] == "ops"


def test_a_client_cannot_claim_a_body_actor(cluster: Any) -> None:
    """The body is never where the actor comes from: an unknown field is refused."""
    c, ctl = cluster()
    jid = submit(c, ALICE)
    r = c.post("/v1/jobs/cancel", json={"jobs": [str(jid)], "actor": "bob"}, headers=ALICE)
    if r.status_code == 200:
        assert all(e["actor"] != "bob" for e in ctl.store.events(job_id=jid))
    else:
        assert r.status_code == 422


# ------------------------------------------------------------------ who a job runs as


@pytest.mark.parametrize("field", ["user", "uid", "gid"])
def test_a_job_runs_as_its_submitter(cluster: Any, field: str) -> None:
    c, ctl = cluster()
    for url, body in (
        ("/v1/jobs", {**JOB, field: "bob" if field == "user" else 1001}),
        ("/v1/jobs/batch", {"jobs": [JOB, {**JOB, field: 0}]}),
    ):
        r = c.post(url, json=body, headers=ALICE)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert "a job runs as the user who submits it" in err["message"]
        assert err["details"]["field"] == field
    assert ctl.store.list_jobs() == []
    # without it, the job is the submitter's
    jid = submit(c, ALICE)
    assert ctl.store.get_job(jid)["user"] == "alice"


def test_root_jobs_are_refused_unless_allowed(cluster: Any) -> None:
    c, ctl = cluster()
    root_token = as_user("root", "admin")
    local_root = {
        "Authorization": "Bearer "
        + mint_local(
            KEYS.for_scope("host", "login1"),
            user="root",
            uid=0,
            gid=0,
            cluster=CLUSTER,
            lifetime=300,
        )
    }
    assert c.get("/v1/whoami", headers=local_root).json()["role"] == "admin"
    for who in (root_token, local_root):
        for url, body in (("/v1/jobs", JOB), ("/v1/jobs/batch", {"jobs": [JOB]})):
            r = c.post(url, json=body, headers=who)
            assert r.status_code == 403, r.text
            assert "allow_root_jobs" in r.json()["error"]["message"]
    assert ctl.store.list_jobs() == []

    c2, ctl2 = cluster(auth={"allow_root_jobs": True})
    r = c2.post("/v1/jobs", json=JOB, headers=root_token)
    assert r.status_code == 201, r.text
    assert ctl2.store.get_job(r.json()["job_id"])["user"] == "root"


# ------------------------------------------------------------------ tokens


def test_admin_tokens_work_and_are_never_recorded(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    c, ctl = cluster()
    r = c.post("/v1/tokens", json={"user": "carol", "role": "operator", "lifetime_s": 600})
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    assert r.json()["user"] == "carol" and r.json()["role"] == "operator"
    who = c.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"}).json()
    assert who == {
        "user": "carol",
        "role": "operator",
        "kind": "token",
        "uid": None,
        "cluster": "phalanx",
    }
    # operator: may drain, and the drain is carol's
    r = c.post(
        "/v1/nodes/n2/drain",
        json={"reason": "x"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 200 and r.json()["drain_by"] == "carol"

    events = c.get("/v1/events").json()["events"]
    assert any(e["kind"] == "auth.token" for e in events)
    assert token not in json.dumps(events)
    assert token not in json.dumps(ctl.store.events())
    for part in token.split("."):  # not even the signature or the claims
        assert part not in caplog.text
        assert part not in json.dumps(events)
    assert all(token not in str(rec.args) for rec in caplog.records)


def test_only_admins_create_tokens(cluster: Any) -> None:
    c, ctl = cluster()
    for who in (ALICE, OPS, as_agent("n1")):
        r = c.post("/v1/tokens", json={"user": "alice", "role": "admin"}, headers=who)
        assert r.status_code == 403, r.text
        assert "token" not in r.json()
    assert not [e for e in ctl.store.events() if e["kind"] == "auth.token"]


def test_token_lifetime_is_bounded(cluster: Any) -> None:
    c, _ = cluster(auth={"token_max_lifetime": 3600})
    r = c.post("/v1/tokens", json={"user": "carol", "lifetime_s": 7200})
    assert r.status_code == 422
    assert "auth.token_max_lifetime" in r.json()["error"]["message"]


# ------------------------------------------------------------------ rate limits

TINY = {"api_rate": 0.001, "api_burst": 3, "submit_rate": 0.001, "submit_burst": 4}


def test_a_user_over_the_api_limit_gets_429_with_retry_after(cluster: Any) -> None:
    c, _ = cluster(limits=TINY)
    codes = [c.get("/v1/whoami", headers=ALICE).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = c.get("/v1/jobs", headers=ALICE)
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "rate_limited"
    assert "alice is over the API call rate limit" in err["message"]
    # limits are per user: bob still has his burst
    assert c.get("/v1/whoami", headers=BOB).status_code == 200


def test_admins_and_agents_are_not_limited(cluster: Any) -> None:
    c, _ = cluster(limits=TINY)
    for _ in range(10):
        assert c.get("/v1/whoami", headers=ADMIN).status_code == 200
        r = c.post("/v1/agents/n1/heartbeat", json={"wait": 0}, headers=as_agent("n1"))
        assert r.status_code == 200
    r = c.post("/v1/jobs/batch", json={"jobs": [JOB] * 10}, headers=ADMIN)
    assert r.status_code == 201


def test_exempt_roles_are_configurable(cluster: Any) -> None:
    c, _ = cluster(limits={**TINY, "exempt_roles": ["operator"]})
    assert [c.get("/v1/whoami", headers=OPS).status_code for _ in range(6)] == [200] * 6
    assert c.get("/v1/whoami", headers=ADMIN).status_code == 200
    assert [c.get("/v1/whoami", headers=ADMIN).status_code for _ in range(3)][-1] == 429


def test_a_batch_of_n_jobs_counts_n(cluster: Any) -> None:
    c, ctl = cluster(limits={**TINY, "api_burst": 100})
    r = c.post("/v1/jobs/batch", json={"jobs": [JOB] * 3}, headers=ALICE)
    assert r.status_code == 201
    r = c.post("/v1/jobs/batch", json={"jobs": [JOB] * 2}, headers=ALICE)  # 1 left, 2 asked
    assert r.status_code == 429, r.text
    assert "job submission rate limit" in r.json()["error"]["message"]
    assert "Retry-After" in r.headers
    assert len(ctl.store.list_jobs()) == 3
    assert c.post("/v1/jobs", json=JOB, headers=ALICE).status_code == 201  # the one left
    assert c.post("/v1/jobs", json=JOB, headers=ALICE).status_code == 429


def test_a_batch_larger_than_the_burst_spends_the_bucket(cluster: Any) -> None:
    """A batch bigger than the burst may go when the bucket is full (else it never could),
    but then it has used the bucket up: it is not a way around the limit."""
    c, ctl = cluster(limits={**TINY, "api_burst": 100})
    assert c.post("/v1/jobs/batch", json={"jobs": [JOB] * 10}, headers=ALICE).status_code == 201
    for _ in range(3):
        r = c.post("/v1/jobs/batch", json={"jobs": [JOB] * 10}, headers=ALICE)
        assert r.status_code == 429, r.text
    assert c.post("/v1/jobs", json=JOB, headers=ALICE).status_code == 429
    assert len(ctl.store.list_jobs()) == 10


def test_refused_submissions_do_not_spend_the_submit_bucket(cluster: Any) -> None:
    c, _ = cluster(limits={**TINY, "api_burst": 100})
    for _ in range(6):  # invalid: refused before any job is counted
        r = c.post("/v1/jobs", json={**JOB, "nodes": 0}, headers=ALICE)
        assert r.status_code == 422
    assert c.post("/v1/jobs/batch", json={"jobs": [JOB] * 4}, headers=ALICE).status_code == 201
