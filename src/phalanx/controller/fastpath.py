"""A short way through the ASGI stack for the one request sent most: POST /v1/jobs.

FastAPI's routing, request object, dependency solving and body handling cost a one-job
submission about as much CPU as storing it. `SubmitFastPath` is an ASGI middleware that
takes a plain `POST /v1/jobs` (no query string, `Content-Type: application/json`) off that
path: it reads the body and hands it to a handler (api.py's `fast_submit`), which does what
the route does, in the same order, when the request is the common case: valid JSON, a
credential allowed to submit, a body that validates as a `JobSpec`. For anything else the
handler returns None before it has changed anything (no rate-limit token taken, nothing
stored), and the request goes down the ordinary FastAPI route with its body replayed: every
refusal, error message and status is the route's own, and the OpenAPI document is the
route's, untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from types import SimpleNamespace
from typing import Any

from starlette.responses import Response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: (body, Authorization header or None) -> the response, or None: take the ordinary route
Handler = Callable[[bytes, str | None], Awaitable[Response | None]]

PATH = "/v1/jobs"
_ROUTE = SimpleNamespace(path=PATH)  # what a matched route leaves in the scope: its template


class SubmitFastPath:
    def __init__(self, app: ASGIApp, handler: Handler) -> None:
        self.app = app
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != PATH
            or scope["method"] != "POST"
            or scope.get("query_string")
            or scope.get("root_path")
        ):
            await self.app(scope, receive, send)
            return
        content_type = authorization = None
        for name, value in scope["headers"]:  # the first of each, as Starlette's Headers.get
            if name == b"content-type" and content_type is None:
                content_type = value
            elif name == b"authorization" and authorization is None:
                authorization = value
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
                response = await self.handler(
                    b"".join(chunks),
                    None if authorization is None else authorization.decode("latin-1"),
                )
                if response is not None:
                    # the route it stands in for, for the request metrics outside (metrics.py)
                    scope.setdefault("route", _ROUTE)
                    await response(scope, receive, send)
                    return
                break

        async def replay() -> Message:
            if received:
                return received.pop(0)
            return await receive()

        await self.app(scope, replay, send)
