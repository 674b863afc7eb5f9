"""The API's first line against hostile clients: what a request may cost before anyone knows
who sent it (docs/deploy.md, "Hostile clients").

`RequestGuard` is an ASGI middleware outside everything but the request metrics, the fast
paths (controller/fastpath.py) included. For every request, in this order:

1. **Size, before anything is read.** A `Content-Length` over `http.max_body_bytes` is
   answered 413 at once, the body unread (and the connection closed, so that the server does
   not go on reading it to throw it away).
2. **Who, before the body is read.** A request that carries a body (any method but GET, HEAD
   and OPTIONS; every public route is a GET, `tests/api/test_access_table.py` checks it) must
   bring a credential that verifies: without one the answer is 401, again with the body unread.
   Whether the caller may use the route is decided later, by the route's rule (access.py); the
   identity found here is left in the scope (`IDENTITY`) so it is not verified twice.
3. **Size, while it streams.** The body is read chunk by chunk and counted: past the limit
   (a chunked body has no Content-Length) the answer is 413 and what was read is dropped. At
   most `max_body_bytes` of an authenticated caller's request is ever held.
4. **Depth.** A JSON body nested deeper than `http.max_json_depth` is answered 400. Python's
   `json` (FastAPI's routes, the fast paths) recurses once a level and fails near 1,000 levels
   with a RecursionError: a 500 with a traceback before this check. A body with no more
   brackets than the limit cannot be too deep and is not looked at again (every ordinary
   request); one with more is parsed by orjson (C, which stops at 1,024 levels by itself)
   and its containers walked.

Then the body goes on to the app as one message, as if the client had sent it at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import JSONResponse

from phalanx.auth.tokens import Identity
from phalanx.controller.fastpath import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    first_headers,
)
from phalanx.errors import BadRequest, PhalanxError, TooLarge, Unauthenticated

#: where the identity verified from the headers is kept in the ASGI scope
IDENTITY = "phalanx.identity"
NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})


def error_response(e: PhalanxError, *, close: bool = False) -> JSONResponse:
    """The API's error body (api.py's `_error`), optionally closing the connection: a
    request refused with its body unread must not leave the server reading it."""
    headers: dict[str, str] = {}
    if e.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if close:
        headers["Connection"] = "close"
    return JSONResponse({"error": e.to_body()}, status_code=e.http_status, headers=headers)


def too_large(size: int | None, limit: int) -> TooLarge:
    said = f"is {size} bytes long" if size is not None else f"is longer than {limit} bytes"
    return TooLarge(
        f"the request body {said}; this controller accepts at most {limit} bytes "
        "(http.max_body_bytes in the controllers' config; split a batch of jobs into several "
        "requests)",
        limit=limit,
        setting="http.max_body_bytes",
    )


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels in `data` (no recursion)."""
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        children = obj.values() if isinstance(obj, dict) else obj
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def depth_problem(body: bytes, limit: int) -> str | None:
    """Why `body` may not be parsed by a recursive parser, or None: JSON nested more than
    `limit` levels (or not JSON at all, with more brackets than that: a parser that recurses
    could fail on it before it finds the error)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None  # every ordinary request: so few brackets cannot nest deeper
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e):
            return f"the JSON body nests arrays and objects more than {limit} levels deep"
        return f"the body is not valid JSON: {e}"
    if isinstance(data, (dict, list)) and _deeper_than(data, limit):
        return f"the JSON body nests arrays and objects more than {limit} levels deep"
    return None


def _json_body(scope: Scope) -> bool:
    """Whether the app may parse this request's body as JSON (FastAPI does with no
    Content-Type or a JSON one): the bodies whose depth is checked."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return b"json" in value.lower()
    return True


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        max_json_depth: int,
        authenticate: Callable[[str | None], Identity | None],
    ) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.max_depth = max_json_depth
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length, authorization = first_headers(scope, b"content-length", b"authorization")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = -1
            if size > self.max_body:
                await error_response(too_large(size, self.max_body), close=True)(
                    scope, receive, send
                )
                return
        if scope["method"] in NO_BODY:
            await self.app(scope, receive, send)
            return
        try:
            ident = self.authenticate(
                None if authorization is None else authorization.decode("latin-1")
            )
            if ident is None:
                raise Unauthenticated("no credential", reason="missing")
        except PhalanxError as e:
            await error_response(e, close=True)(scope, receive, send)
            return
        scope[IDENTITY] = ident
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone: the app sees it as it always has
                await self.app(scope, _replay(chunks, message, receive), send)
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                chunks.clear()
                await error_response(too_large(None, self.max_body), close=True)(
                    scope, receive, send
                )
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if body and _json_body(scope):
            problem = depth_problem(body, self.max_depth)
            if problem is not None:
                err = BadRequest(
                    f"{problem}; at most {self.max_depth} (http.max_json_depth)",
                    limit=self.max_depth,
                    setting="http.max_json_depth",
                )
                await error_response(err)(scope, receive, send)
                return
        whole: Message = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay([], whole, receive), send)


def _replay(chunks: list[bytes], last: Message, receive: Receive) -> Receive:
    """A receive that gives the body read so far (as one message, then `last`), then goes on
    with the client's own receive (a disconnect, for apps that listen for it)."""
    pending: list[Message] = []
    if chunks:
        pending.append({"type": "http.request", "body": b"".join(chunks), "more_body": True})
    pending.append(last)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
