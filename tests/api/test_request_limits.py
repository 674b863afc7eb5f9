"""What a request may cost (controller/guard.py, domain/spec.py limits, domain/text.py): bodies
over the size limit refused before they are read, callers without a credential refused before
their body is read, JSON nested too deep refused with a 400 (not a 500) on every path, fields
over their limits and names with terminal escapes refused with a 422 naming the field.

The app is the real one (conftest.py); the size and credential checks are also called at the
ASGI level, with a `receive` that fails the test if the app reads anything.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from api_auth import ANONYMOUS, as_agent, as_user
from fastapi.testclient import TestClient

from phalanx.controller.guard import depth_problem
from phalanx.domain import spec as specs
from phalanx.domain.text import escape

ALICE = as_user("alice")
JOB: dict[str, Any] = {"argv": ["/bin/true"], "time_limit_s": 60}
DEFAULT_LIMIT = 64 * 1024 * 1024


# ------------------------------------------------------------------ ASGI-level: nothing read


def call(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], body: Any) -> Any:
    """Run one request through the ASGI app; `body` is a list of chunks, or a callable that
    is the `receive` itself. Returns (status, JSON body, response headers)."""
    sent: list[dict[str, Any]] = []
    chunks = list(body) if isinstance(body, list) else None

    async def receive() -> dict[str, Any]:
        if callable(body):
            return await body()
        assert chunks is not None
        if chunks:
            c = chunks.pop(0)
            return {"type": "http.request", "body": c, "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 6817),
        "state": {},
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(raw), dict(start["headers"])


async def never() -> dict[str, Any]:
    raise AssertionError("the body was read")


def test_a_content_length_over_the_limit_is_413_before_anything_is_read(
    client: TestClient,
) -> None:
    for who in ([], [(b"authorization", ALICE["Authorization"].encode())]):
        headers = [(b"content-type", b"application/json"), *who]
        headers.append((b"content-length", str(96 * 1024 * 1024).encode()))
        for path in ("/v1/jobs", "/v1/jobs/batch", "/v1/agents/n1/heartbeat", "/v1/jobs/cancel"):
            status, body, resp_headers = call(client.app, "POST", path, headers, never)
            assert status == 413, (path, body)
            err = body["error"]
            assert err["code"] == "too_large"
            assert "http.max_body_bytes" in err["message"]
            assert str(DEFAULT_LIMIT) in err["message"]
            assert err["details"] == {"limit": DEFAULT_LIMIT, "setting": "http.max_body_bytes"}
            assert resp_headers[b"connection"] == b"close"  # nor read later, to be thrown away


def test_a_post_without_a_credential_is_401_before_its_body_is_read(client: TestClient) -> None:
    for auth in ([], [(b"authorization", b"Bearer not-a-jwt")]):
        headers = [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]
        for path in ("/v1/jobs", "/v1/jobs/batch", "/v1/tokens", "/v1/agents/n1/register"):
            status, body, resp_headers = call(client.app, "POST", path, headers + auth, never)
            assert status == 401, (path, body)
            assert body["error"]["code"] == "unauthenticated"
            assert resp_headers[b"connection"] == b"close"


def test_a_streamed_body_is_cut_off_at_the_limit(client: TestClient) -> None:
    """No Content-Length: the chunks are counted as they come, and reading stops past the
    limit (the rest of 96 MiB is never asked for)."""
    piece = b"x" * (1024 * 1024)
    asked = 0

    async def stream() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        return {"type": "http.request", "body": piece, "more_body": asked < 96}

    headers = [
        (b"content-type", b"application/json"),
        (b"authorization", ALICE["Authorization"].encode()),
    ]
    status, body, _ = call(client.app, "POST", "/v1/jobs", headers, stream)
    assert status == 413, body
    assert body["error"]["details"]["setting"] == "http.max_body_bytes"
    assert asked == DEFAULT_LIMIT // len(piece) + 1  # one chunk past the limit, not 96


def test_a_body_within_the_limit_in_chunks_reaches_the_fast_path(client: TestClient) -> None:
    raw = json.dumps(JOB).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"authorization", ALICE["Authorization"].encode()),
    ]
    status, body, _ = call(client.app, "POST", "/v1/jobs", headers, [raw[:5], raw[5:], b""])
    assert status == 201, body


def test_the_body_limit_is_configurable_and_checked() -> None:
    from phalanx.config import load_config
    from phalanx.errors import ConfigError

    assert load_config(overrides={"http": {"max_body_bytes": 16 << 20}}).http.max_body_bytes == (
        16 << 20
    )
    with pytest.raises(ConfigError, match=r"http\.max_body_bytes"):
        load_config(overrides={"http": {"max_body_bytes": 1 << 20}})  # under one job's worth
    with pytest.raises(ConfigError, match=r"http\.max_json_depth"):
        load_config(overrides={"http": {"max_json_depth": 100_000}})
    with pytest.raises(ConfigError, match=r"http\.header_timeout"):
        load_config(overrides={"http": {"header_timeout": 0}})


# ------------------------------------------------------------------ JSON depth

DEEP = b"[" * 100_000 + b"]" * 100_000


def nested(levels: int) -> dict[str, Any]:
    """A job whose env holds `levels` - 1 more levels (a body `levels` deep; 422 at most)."""
    inner: Any = 1
    for _ in range(levels - 2):
        inner = [inner]
    return {**JOB, "env": {"X": inner}}


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/jobs", ALICE),  # the fast path
        ("/v1/jobs/batch", ALICE),
        ("/v1/jobs/cancel", ALICE),
        ("/v1/jobs/update", ALICE),
        ("/v1/maintenance", {}),
        ("/v1/nodes/n1/drain", {}),
        ("/v1/agents/n1/heartbeat", as_agent("n1")),  # the other fast path
        ("/v1/agents/n1/register", as_agent("n1")),
    ],
)
def test_deep_json_is_400_not_500_on_every_path(
    client: TestClient, path: str, headers: dict[str, str]
) -> None:
    for ctype in ("application/json", None):
        h = {**headers, **({"content-type": ctype} if ctype else {})}
        r = client.post(path, content=DEEP, headers=h)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "bad_request"
        assert "64" in err["message"] and "http.max_json_depth" in err["message"]


def test_depth_up_to_the_limit_is_the_routes_business(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=nested(64), headers=ALICE)
    assert r.status_code == 422 and "env" in r.text  # a list is no string: the route says so
    r = client.post("/v1/jobs", json=nested(65), headers=ALICE)
    assert r.status_code == 400, r.text


def test_depth_problem() -> None:
    assert depth_problem(b'{"a": [[1]]}', 3) is None
    assert depth_problem(b'{"a": [[[1]]]}', 3) is not None
    # brackets inside strings do not count
    assert depth_problem(json.dumps({"s": "[" * 1000}).encode(), 3) is None
    # invalid JSON with many brackets: refused here, before a recursive parser sees it
    assert "not valid JSON" in str(depth_problem(b"[" * 100 + b"x", 8))
    assert "levels deep" in str(depth_problem(b"[" * 5000, 8))


# ------------------------------------------------------------------ field limits


def refused(r: Any, field: str, limit: object | None = None) -> str:
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_spec"
    assert err["details"]["field"].split(".")[0] == field, err
    assert field in err["message"]
    if limit is not None:
        assert str(limit) in err["message"], err["message"]
    return str(err["message"])


@pytest.mark.parametrize(
    ("extra", "field", "limit"),
    [
        ({"comment": "c" * (specs.MAX_COMMENT + 1)}, "comment", specs.MAX_COMMENT),
        ({"name": "n" * (specs.MAX_NAME + 1)}, "name", specs.MAX_NAME),
        ({"argv": ["a"] * (specs.MAX_ARGV + 1)}, "argv", specs.MAX_ARGV),
        ({"argv": ["a" * (specs.MAX_ARG + 1)]}, "argv", specs.MAX_ARG),
        ({"argv": ["a" * specs.MAX_ARG] * 9}, "argv", specs.MAX_ARGV_TOTAL),
        ({"env": {"BIG": "v" * specs.MAX_ARG}}, "env", specs.MAX_ARG),
        ({"env": {f"V{i}": "v" * 100_000 for i in range(11)}}, "env", specs.MAX_ENV_TOTAL),
        ({"env": {f"V{i}": "" for i in range(specs.MAX_ENV_VARS + 1)}}, "env", specs.MAX_ENV_VARS),
        ({"env": {"A=B": "x"}}, "env", None),  # execve would refuse it on the node
        ({"script": "#!/bin/sh\n" + "#" * specs.MAX_SCRIPT_BYTES}, "script", None),
        ({"workdir": "/" + "d" * specs.MAX_PATH}, "workdir", specs.MAX_PATH),
        ({"dependency": "afterok:" + "1:" * specs.MAX_DEPENDENCY}, "dependency", None),
        ({"wrap": "w" * (specs.MAX_WRAP + 1)}, "wrap", specs.MAX_WRAP),
    ],
    ids=lambda v: str(v)[:30],
)
def test_fields_over_their_limits_are_422_naming_the_field(
    client: TestClient, extra: dict[str, Any], field: str, limit: object | None
) -> None:
    body = {**JOB, **extra}
    r = client.post("/v1/jobs", json=body, headers=ALICE)  # the fast path's route
    refused(r, field, limit)
    r = client.post("/v1/jobs/batch", json={"jobs": [JOB, body]}, headers=ALICE)
    assert r.status_code == 422 and field in r.json()["error"]["message"], r.text


def test_a_32_mib_comment_is_refused_and_nothing_is_stored(client: TestClient, ctl: Any) -> None:
    r = client.post("/v1/jobs", json={**JOB, "comment": "c" * (32 << 20)}, headers=ALICE)
    refused(r, "comment", specs.MAX_COMMENT)
    assert ctl.store.list_jobs() == []


def test_the_steps_environment_and_argv_have_the_same_limits(client: TestClient) -> None:
    jid = client.post("/v1/jobs", json=JOB, headers=ALICE).json()["job_id"]
    step = {"argv": ["true"], "host": "127.0.0.1", "port": 9, "cookie": "c" * 32}
    for extra, field in (
        ({"env": {"BIG": "v" * specs.MAX_ARG}}, "env"),
        ({"argv": ["a" * (specs.MAX_ARG + 1)]}, "argv"),
        ({"name": "x\x1b]52;c;aGk=\x07"}, "name"),
    ):
        r = client.post(f"/v1/jobs/{jid}/steps", json={**step, **extra}, headers=ALICE)
        refused(r, field)


# ------------------------------------------------------------------ control characters

ESCAPES = ["evil\x1b[2J\x1b[H", "two\nlines", "back\rwrite", "csi\x9b31m", "rtl\u202egnp.exe"]


@pytest.mark.parametrize("bad", ESCAPES, ids=repr)
@pytest.mark.parametrize(
    "field", ["name", "comment", "partition", "account", "qos", "constraint", "mail_user"]
)
def test_control_characters_in_names_are_422_naming_the_field(
    client: TestClient, field: str, bad: str
) -> None:
    r = client.post("/v1/jobs", json={**JOB, field: bad}, headers=ALICE)
    msg = refused(r, field)
    assert "control character" in msg
    assert "\x1b" not in r.text  # the refusal itself carries no escape to a terminal


def test_control_characters_in_reasons_are_refused(client: TestClient) -> None:
    jid = str(client.post("/v1/jobs", json=JOB, headers=ALICE).json()["job_id"])
    bad = "bye\x1b[31m"
    refused(client.post("/v1/jobs/cancel", json={"jobs": [jid], "reason": bad}), "reason")
    refused(client.post("/v1/nodes/n1/drain", json={"reason": bad}), "reason")
    r = client.post(
        "/v1/maintenance",
        json={"nodes": "n1", "start": "now+1h", "duration": 60, "reason": bad},
    )
    refused(r, "reason")
    refused(client.post("/v1/jobs/update", json={"jobs": [jid], "partition": bad}), "partition")
    # the job is untouched, and plain text still goes through
    r = client.post("/v1/jobs/cancel", json={"jobs": [jid], "reason": "done: tab-free"})
    assert r.status_code == 200


def test_anonymous_posts_never_reach_validation(client: TestClient) -> None:
    r = client.post("/v1/jobs", json={**JOB, "name": "\x1b"}, headers=ANONYMOUS)
    assert r.status_code == 401


def test_escape() -> None:
    assert escape("plain name_1.sh") == "plain name_1.sh"
    assert escape("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert escape("x\ny\tz\r") == "x\\x0ay\\x09z\\x0d"
    assert escape("\x9b\x7f\u202e") == "\\x9b\\x7f\\u202e"
    assert escape("héllo ✓ 日本") == "héllo ✓ 日本"
    assert escape(None) == "None" and escape(12) == "12"
