"""uvicorn's HTTP protocol with what it lacks against slow and idle clients (docs/deploy.md,
"Hostile clients").

uvicorn 0.54 closes a kept-alive connection that stays idle (`timeout_keep_alive`) and can
answer 503 past a number of connections (`limit_concurrency`), but it has no time limit on a
request's headers or body: a connection that sends half a request line and nothing more is
kept for ever, and 20,000 of them ("slowloris") fill the process's file descriptors and keep
everyone else out. Nor does it bound the headers' size with httptools (its
`h11_max_incomplete_event_size` is the h11 parser's). `GuardedProtocol` adds, per connection:

* **header timeout** (`http.header_timeout`): from the moment a connection is made, or the
  first byte of its next request arrives, to the end of that request's headers. Past it the
  client gets `408 Request Timeout` and the connection is closed. Trickling a byte now and
  then does not extend it.
* **body timeout** (`http.body_timeout`): from the end of the headers to the end of the body.
  Past it the connection is closed (408 if no response has started); the app reading the
  body sees the client gone.
* **header size** (`http.max_header_bytes`): bytes received while a request's headers are
  incomplete; past it `431` and the connection closed.
* **connection cap** (`http.max_connections`): a request that arrives while more connections
  than that are open, or as many requests are in progress, is answered `503` with a JSON
  error at once, without reaching the app (clients try the next controller: nothing was done),
  and that connection is closed. Idle connections do not hold their slots for ever: the
  timeouts above close them.

Nothing here runs per byte in Python: one timer per connection and phase, and a length added
per chunk received while headers are awaited.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from phalanx.config import HttpConfig


def _raw_response(status: int, phrase: str, code: str, message: str, **details: Any) -> bytes:
    body = json.dumps(
        {"error": {"code": code, "message": message, "details": details}}, separators=(",", ":")
    ).encode()
    return (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class GuardedProtocol(HttpToolsProtocol):
    """See the module docstring; the limits are class attributes (`guarded_protocol`)."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 16384

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True
        self._header_bytes = 0

    # ------------------------------------------------------------------ timers
    def _arm(self, seconds: float, handler: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, handler)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(
                _raw_response(
                    408,
                    "Request Timeout",
                    "request_timeout",
                    f"the request's headers did not arrive within {self.header_timeout:g} s "
                    "(http.header_timeout)",
                    setting="http.header_timeout",
                )
            )
        self.transport.close()

    def _body_late(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self.transport.write(
                _raw_response(
                    408,
                    "Request Timeout",
                    "request_timeout",
                    f"the request's body did not arrive within {self.body_timeout:g} s of its "
                    "headers (http.body_timeout)",
                    setting="http.body_timeout",
                )
            )
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's writes go nowhere; its receive says so
            cycle.message_event.set()
        self.transport.close()

    # ------------------------------------------------------------------ the connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if (
            self._awaiting_headers
            and self._header_bytes > self.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._disarm()
            self.transport.write(
                _raw_response(
                    431,
                    "Request Header Fields Too Large",
                    "too_large",
                    f"the request's headers are longer than {self.max_header_bytes} bytes "
                    "(http.max_header_bytes)",
                    limit=self.max_header_bytes,
                    setting="http.max_header_bytes",
                )
            )
            self.transport.close()

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = True
        if self._timer is None:  # the first byte of a next request (kept alive, pipelined)
            self._arm(self.header_timeout, self._headers_late)

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._header_bytes = 0
        self._arm(self.body_timeout, self._body_late)
        if len(self.connections) > self.max_connections or len(self.tasks) >= self.max_connections:
            app, self.app = self.app, self._busy
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()  # the app has the request; how long it answers is its own business
        self._awaiting_headers = True
        super().on_message_complete()

    async def _busy(self, scope: Any, receive: Any, send: Any) -> None:
        """The answer past `max_connections`: 503, which clients retry on another controller
        (nothing was done), and the connection closed."""
        body = json.dumps(
            {
                "error": {
                    "code": "unavailable",
                    "message": f"this controller is at its limit of {self.max_connections} "
                    "connections (http.max_connections); try another controller or again later",
                    "details": {"setting": "http.max_connections"},
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", b"1"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


def guarded_protocol(http: HttpConfig) -> type[GuardedProtocol]:
    """The protocol class uvicorn instantiates per connection, with these limits."""
    return type(
        "PhalanxHttpProtocol",
        (GuardedProtocol,),
        {
            "header_timeout": http.header_timeout,
            "body_timeout": http.body_timeout,
            "max_header_bytes": http.max_header_bytes,
            "max_connections": http.max_connections,
        },
    )
