"""A short way through the ASGI stack for the requests sent most: submissions and heartbeats.

FastAPI's routing, request object, dependency solving and body handling cost a one-job
submission about as much CPU as storing it, and agents' heartbeats (up to 300 a second at
the default heartbeat budget, whatever else the cluster does) about a sixth of the
controller's busy time in the placement runs of bench/sim.py. `FastPaths` is an ASGI
middleware that takes a plain POST to one of its routes (`POST /v1/jobs`,
`POST /v1/agents/{node}/heartbeat`; no query string, `Content-Type: application/json`) off
that path: it reads the body and hands
it to the route's fast handler (api.py's `fast_submit`, `fast_heartbeat`), which does what
the route does, in the same order, when the request is the common case: valid JSON, a
credential allowed to make it, a body that validates. For anything else the handler returns
None before it has changed anything (no rate-limit token taken, nothing stored), and the
request goes down the ordinary FastAPI route with its body replayed: every refusal, error
message and status is the route's own, and the OpenAPI document is the route's, untouched.

The request guard (guard.py) stands in front of this middleware: by the time a body reaches a
fast handler its size is within http.max_body_bytes, its credential has been verified (before
the body was read) and its JSON is no deeper than http.max_json_depth.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from starlette.responses import Response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: (body, Authorization header or None, path parameters) -> the response, or None: take the
#: ordinary route
Handler = Callable[[bytes, str | None, dict[str, str]], Awaitable[Response | None]]


def first_headers(scope: Scope, *names: bytes) -> list[bytes | None]:
    """The first value of each of these (lower-case) headers, None where absent: what
    Starlette's ``Headers.get`` returns, without building a Headers per request."""
    found: list[bytes | None] = [None] * len(names)
    for name, value in scope["headers"]:
        if name in names:
            i = names.index(name)
            if found[i] is None:
                found[i] = value
    return found


@dataclass(frozen=True)
class FastRoute:
    """A route template such as `/v1/agents/{node}/heartbeat` (POST) and its fast handler.

    A `{name}` part matches one non-empty path segment, as Starlette's default converter."""

    template: str
    handler: Handler

    def match(self, path: str) -> dict[str, str] | None:
        want = self.template.split("/")
        got = path.split("/")
        if len(got) != len(want):
            return None
        params: dict[str, str] = {}
        for w, g in zip(want, got, strict=True):
            if w.startswith("{") and w.endswith("}"):
                if not g:
                    return None
                params[w[1:-1]] = g
            elif w != g:
                return None
        return params


class FastPaths:
    def __init__(self, app: ASGIApp, routes: list[FastRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope.get("query_string")
            or scope.get("root_path")
            or b"%00" in (scope.get("raw_path") or b"")  # the route's NUL refusal
        ):
            await self.app(scope, receive, send)
            return
        for route in self.routes:
            params = route.match(scope["path"])
            if params is not None:
                break
        else:
            await self.app(scope, receive, send)
            return
        content_type, authorization = first_headers(scope, b"content-type", b"authorization")
        if content_type is None or content_type.lower() != b"application/json":
            await self.app(scope, receive, send)
            return
        received: list[Message] = []
        chunks: list[bytes] = []
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":  # the client went away: the route's business
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                response = await route.handler(
                    b"".join(chunks),
                    None if authorization is None else authorization.decode("latin-1"),
                    params,
                )
                if response is not None:
                    # the route it stands in for, for the request metrics outside (metrics.py)
                    scope.setdefault("route", SimpleNamespace(path=route.template))
                    await response(scope, receive, send)
                    return
                break

        async def replay() -> Message:
            if received:
                return received.pop(0)
            return await receive()

        await self.app(scope, replay, send)
