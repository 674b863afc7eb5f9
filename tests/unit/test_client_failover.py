"""Client failover over real HTTP: which answers move on to the next controller, which surface.

Two tiny HTTP servers on loopback stand in for controllers: one answers like a controller whose
database dropped the connection mid-commit (504, outcome unknown), the other answers normally.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from phalanx.client import Client
from phalanx.errors import StoreOutcomeUnknown


def _server(status: int, body: dict[str, Any], hits: list[str]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            hits.append(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def controllers() -> Iterator[tuple[str, list[str], list[str]]]:
    unknown_hits: list[str] = []
    ok_hits: list[str] = []
    unknown = _server(
        504,
        {
            "error": {
                "code": "store_outcome_unknown",
                "message": "the database stopped answering mid-commit",
            }
        },
        unknown_hits,
    )
    ok = _server(200, {"ok": True}, ok_hits)
    urls = ",".join(f"http://127.0.0.1:{s.server_address[1]}" for s in (unknown, ok))
    try:
        yield urls, unknown_hits, ok_hits
    finally:
        for s in (unknown, ok):
            s.shutdown()
            s.server_close()


def test_an_idempotent_call_moves_on_after_outcome_unknown(
    controllers: tuple[str, list[str], list[str]],
) -> None:
    urls, unknown_hits, ok_hits = controllers
    with Client(urls) as c:
        assert c.post("/v1/nodes/n1/heartbeat", {}, idempotent=True) == {"ok": True}
    assert len(unknown_hits) == 1 and len(ok_hits) == 1


def test_a_submit_is_not_repeated_elsewhere_when_its_outcome_is_unknown(
    controllers: tuple[str, list[str], list[str]],
) -> None:
    """Repeating it on another controller could create the job twice: the caller must look."""
    urls, unknown_hits, ok_hits = controllers
    with Client(urls) as c, pytest.raises(StoreOutcomeUnknown, match="mid-commit"):
        c.submit({"wrap": "true"})
    assert len(unknown_hits) == 1 and ok_hits == []
