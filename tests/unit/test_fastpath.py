"""`FastPaths` (controller/fastpath.py) routing: which requests its handlers see, with which
path parameters, and that everything else reaches the application with its body intact."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import PlainTextResponse, Response

from phalanx.controller.fastpath import FastPaths, FastRoute


class Recorder:
    """An inner ASGI app that records what reached it (the FastAPI app in production)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.bodies.append(body)
        await PlainTextResponse("route")(scope, receive, send)


def call(app: Any, method: str, path: str, body: bytes, **extra: Any) -> tuple[int, bytes]:
    headers = extra.pop("headers", [(b"content-type", b"application/json")])
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        **extra,
    }
    # the body in two parts: the middleware must join them, and replay both to the route
    parts = [
        {"type": "http.request", "body": body[:3], "more_body": True},
        {"type": "http.request", "body": body[3:], "more_body": False},
    ]
    sent: list[Any] = []

    async def receive() -> Any:
        return parts.pop(0)

    async def send(msg: Any) -> None:
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_routes_by_template_and_replays_what_it_declines() -> None:
    seen: list[tuple[str, bytes, dict[str, str]]] = []

    def handler(name: str, decline: bool = False) -> Any:
        async def h(body: bytes, auth: str | None, params: dict[str, str]) -> Response | None:
            seen.append((name, body, params))
            return None if decline else PlainTextResponse(name, status_code=201)

        return h

    inner = Recorder()
    app = FastPaths(
        inner,
        [
            FastRoute("/v1/jobs", handler("submit")),
            FastRoute("/v1/agents/{node}/heartbeat", handler("hb")),
            FastRoute("/v1/agents/{node}/register", handler("reg", decline=True)),
        ],
    )
    assert call(app, "POST", "/v1/jobs", b'{"argv": []}') == (201, b"submit")
    assert call(app, "POST", "/v1/agents/n7/heartbeat", b"{}") == (201, b"hb")
    assert seen == [("submit", b'{"argv": []}', {}), ("hb", b"{}", {"node": "n7"})]
    seen.clear()
    # declined by its handler: the route gets the whole body
    assert call(app, "POST", "/v1/agents/n7/register", b'{"cpus": 4}') == (200, b"route")
    assert seen == [("reg", b'{"cpus": 4}', {"node": "n7"})] and inner.bodies == [b'{"cpus": 4}']
    seen.clear()
    not_fast: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/jobs", {}),
        ("POST", "/v1/agents//heartbeat", {}),  # an empty segment matches no {node}
        ("POST", "/v1/agents/a/b/heartbeat", {}),
        ("POST", "/v1/jobs/batch", {}),
        ("POST", "/v1/jobs", {"query_string": b"x=1"}),
        ("POST", "/v1/agents/n%00/heartbeat", {}),  # the route refuses a NUL
        ("POST", "/v1/jobs", {"headers": [(b"content-type", b"text/plain")]}),
    ]
    for method, path, extra in not_fast:
        assert call(app, method, path, b"{}", **extra) == (200, b"route"), path
    assert seen == [] and inner.bodies[1:] == [b"{}"] * len(not_fast)
