"""Client failover over real HTTP, for both clients: which answers move on to the next
controller and which surface. The full client (`phalanx.client.Client`, httpx) and the lean one
`srun` uses inside jobs (`lean_client.LeanClient`, http.client) share one policy
(`phalanx.failover`); every scenario here runs against both and must end the same way.

Tiny HTTP servers on loopback stand in for controllers: one that lost its database mid-commit
(504, outcome unknown), one that cannot reach it (503), one that reads the request and hangs
up without answering, a closed port, one that finds the credential expired once, and a healthy
one that answers.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from phalanx import failover
from phalanx.client import Client
from phalanx.errors import ControllerUnavailable, PhalanxError, StoreOutcomeUnknown
from phalanx.lean_client import LeanClient

OUTCOME_UNKNOWN = (
    504,
    {"error": {"code": "store_outcome_unknown", "message": "the database stopped mid-commit"}},
)
NO_STORE = (503, {"error": {"code": "store_unavailable", "message": "cannot reach the store"}})
EXPIRED = (
    401,
    {
        "error": {
            "code": "unauthenticated",
            "message": "credential expired",
            "details": {"reason": "expired"},
        }
    },
)
OK = (200, {"ok": True})
HANG_UP = None  # read the request, close without a reply


class Controller:
    """A loopback HTTP server answering each request with the next of `answers` (the last
    one repeats), recording the paths it was asked."""

    def __init__(self, *answers: tuple[int, dict[str, Any]] | None) -> None:
        self.answers = list(answers)
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.hits.append(self.path)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answer = outer.answers[min(len(outer.hits), len(outer.answers)) - 1]
                if answer is None:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, body = answer
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def start() -> Iterator[Callable[..., Controller]]:
    made: list[Controller] = []

    def make(*answers: tuple[int, dict[str, Any]] | None) -> Controller:
        made.append(Controller(*answers))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


def full(urls: str, idempotent: bool) -> Any:
    with Client(urls) as c:
        return c.post("/v1/thing", {"x": 1}, idempotent=idempotent)


def lean(urls: str, idempotent: bool) -> Any:
    with LeanClient(urls) as c:
        return c.post("/v1/thing", {"x": 1}, idempotent=idempotent)


CLIENTS = pytest.mark.parametrize("call", [full, lean], ids=["full", "lean"])


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_TOKEN", "t")


@CLIENTS
@pytest.mark.parametrize("idempotent", [True, False])
def test_no_store_and_a_closed_port_move_on(
    call: Callable[..., Any], idempotent: bool, start: Callable[..., Controller]
) -> None:
    """Nothing was applied: any call moves on, a submission included."""
    no_store, ok = start(NO_STORE), start(OK)
    assert call(f"{closed_port()},{no_store.url},{ok.url}", idempotent) == {"ok": True}
    assert len(no_store.hits) == 1 and len(ok.hits) == 1


@CLIENTS
def test_an_idempotent_call_moves_on_after_outcome_unknown_or_no_answer(
    call: Callable[..., Any], start: Callable[..., Controller]
) -> None:
    unknown, silent, ok = start(OUTCOME_UNKNOWN), start(HANG_UP), start(OK)
    assert call(f"{unknown.url},{silent.url},{ok.url}", True) == {"ok": True}
    assert (len(unknown.hits), len(silent.hits), len(ok.hits)) == (1, 1, 1)


@CLIENTS
def test_a_call_that_may_have_been_applied_is_not_repeated(
    call: Callable[..., Any], start: Callable[..., Controller]
) -> None:
    """Repeating it on another controller could create the job twice: the caller must look."""
    unknown, ok = start(OUTCOME_UNKNOWN), start(OK)
    with pytest.raises(StoreOutcomeUnknown, match="mid-commit"):
        call(f"{unknown.url},{ok.url}", False)
    silent = start(HANG_UP)
    with pytest.raises(ControllerUnavailable, match="may or may not have been applied"):
        call(f"{silent.url},{ok.url}", False)
    assert ok.hits == []


@CLIENTS
def test_an_expired_credential_is_replaced_once(
    call: Callable[..., Any], start: Callable[..., Controller]
) -> None:
    c = start(EXPIRED, OK)
    assert call(c.url, False) == {"ok": True}
    assert len(c.hits) == 2
    always = start(EXPIRED)
    with pytest.raises(PhalanxError, match="credential expired"):
        call(always.url, False)
    assert len(always.hits) == 2  # once, then once more with a fresh credential: no loop


@CLIENTS
def test_nobody_answering_names_every_controller(
    call: Callable[..., Any], start: Callable[..., Controller]
) -> None:
    a, b = closed_port(), start(NO_STORE)
    with pytest.raises(ControllerUnavailable, match="no controller answered") as e:
        call(f"{a},{b.url}", True)
    assert a in str(e.value) and b.url in str(e.value)


def test_the_policy_table() -> None:
    Step = failover.Step
    assert failover.after_transport_error(sent=False, idempotent=False) is Step.NEXT
    assert failover.after_transport_error(sent=True, idempotent=True) is Step.NEXT
    assert failover.after_transport_error(sent=True, idempotent=False) is Step.UNKNOWN
    assert failover.after_reply(503, idempotent=False) is Step.NEXT
    assert failover.after_reply(504, idempotent=True) is Step.NEXT
    assert failover.after_reply(504, idempotent=False) is Step.ANSWER
    assert failover.after_reply(400, idempotent=True) is Step.ANSWER
    assert failover.after_reply(200, idempotent=False) is Step.ANSWER


def test_both_clients_read_the_same_controller_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_URL", " http://a:1/ ,http://b:2")
    with Client() as c, LeanClient() as lc:
        assert c.urls == lc.urls == ["http://a:1", "http://b:2"]
    with pytest.raises(PhalanxError, match="must start with http"):
        LeanClient("ftp://x")
