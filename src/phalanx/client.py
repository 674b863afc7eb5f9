"""HTTP client for the REST API with client-side failover over a list of controllers.

Requests go to the controller that answered last; on a connection failure or a 503 the client
tries the next one. A POST is retried elsewhere only when it surely never reached a server
(connection refused/failed) or the server said it could not reach the store (503), so a
submission is never made twice. Errors come back as the same exception classes the server
raised (phalanx.errors).
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import httpx

from phalanx.api_calls import ApiCalls
from phalanx.auth.credentials import CredentialSource, default_source
from phalanx.errors import (
    BY_CODE,
    ControllerUnavailable,
    InvalidSpec,
    PhalanxError,
    RateLimited,
    StoreUnavailable,
    Unauthenticated,
)
from phalanx.failover import (
    Step,
    after_reply,
    after_transport_error,
    urls_from,
)

DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=3.0)
ENV_CA = "PHALANX_CA_FILE"


class Timed(NamedTuple):
    """A reply and when the request that got it was sent (time.monotonic(), on the attempt
    that was answered, after any failover). An agent's fence counts from there: a reply only
    vouches for the moment its request left, whatever delayed its reading (DESIGN.md §4)."""

    body: Any
    sent_at: float


class Client(ApiCalls):
    def __init__(
        self,
        urls: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        credentials: CredentialSource | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        verify: str | bool = True,
    ) -> None:
        """`token` or `credentials` say who the client is (default: `default_source()`:
        $PHALANX_TOKEN, a token file, or this host's local credential service). `verify` is
        a CA file for https controllers (default: $PHALANX_CA_FILE, else the system's CAs)."""
        self.urls = urls_from(urls)
        self.credentials = credentials or default_source(token)
        if verify is True and os.environ.get(ENV_CA):
            verify = os.environ[ENV_CA]
        tls: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        )
        if not any(u.startswith("https://") for u in self.urls):
            tls = False  # loading the system's CA bundle costs 20-40 ms a CLI call, for nothing
        self._http = httpx.Client(timeout=timeout, transport=transport, verify=tls)
        self._current = 0

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport
    def request(self, method: str, path: str, *, idempotent: bool | None = None, **kw: Any) -> Any:
        return self.request_timed(method, path, idempotent=idempotent, **kw).body

    def request_timed(
        self, method: str, path: str, *, idempotent: bool | None = None, **kw: Any
    ) -> Timed:
        """Send with this client's credential; a local credential the controller found expired
        (clocks apart) is replaced once and the call repeated (a 401 changed nothing)."""
        try:
            return self._send(method, path, idempotent=idempotent, **kw)
        except Unauthenticated as e:
            if e.details.get("reason") != "expired":
                raise
            self.credentials.invalidate()
            try:
                return self._send(method, path, idempotent=idempotent, **kw)
            except Unauthenticated as again:
                raise Unauthenticated(
                    f"{again.message}; {self.credentials.renew_hint}", **again.details
                ) from None

    def _send(self, method: str, path: str, *, idempotent: bool | None = None, **kw: Any) -> Timed:
        """Send to the current controller, failing over on connection errors and 503s.

        `idempotent` (default: GET only) also allows failing over after a request was sent
        but not answered, which is safe for level-triggered calls such as heartbeats.
        """
        token = self.credentials.token()
        if token is not None:
            kw["headers"] = {**(kw.get("headers") or {}), "Authorization": f"Bearer {token}"}
        if idempotent is None:
            idempotent = method == "GET"
        errors: list[str] = []
        refused = 0  # controllers whose host answered "nothing listens here"
        no_store = 0  # controllers that answered that they cannot reach the database
        n = len(self.urls)
        for i in range(n):
            idx = (self._current + i) % n
            base = self.urls[idx]
            sent_at = time.monotonic()
            try:
                resp = self._http.request(method, base + path, **kw)
            except (httpx.InvalidURL, UnicodeError) as e:  # a user's value in the path
                raise InvalidSpec(f"cannot send {method} {path!r}: {e}") from None
            except httpx.TransportError as e:
                # a connect error never reached a server; anything later may have
                sent = not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                if after_transport_error(sent=sent, idempotent=idempotent) is Step.UNKNOWN:
                    # the next request starts with the next controller, not this silent one
                    self._current = (idx + 1) % n
                    raise ControllerUnavailable(
                        f"{base} did not answer ({type(e).__name__}); the request may or may not "
                        "have been applied: check before retrying"
                    ) from None
                errors.append(f"{base}: {(e if not sent else '') or type(e).__name__}")
                refused += _is_refused(e)
                continue
            if after_reply(resp.status_code, idempotent=idempotent) is Step.NEXT:
                errors.append(f"{base}: {_message(resp)}")
                # a 504: it lost its database, as good as "cannot reach the store"
                no_store += resp.status_code == 504 or _code(resp) == StoreUnavailable.code
                continue
            self._current = idx
            if resp.status_code >= 400:
                err = _to_error(resp)
                if isinstance(err, Unauthenticated) and token is None:
                    err = Unauthenticated(self.credentials.problem or err.message, **err.details)
                if isinstance(err, RateLimited):
                    err.details.setdefault("retry_after", resp.headers.get("Retry-After"))
                raise err
            try:
                return Timed(resp.json(), sent_at)
            except ValueError:
                raise PhalanxError(
                    f"{base} answered {method} {path} with HTTP {resp.status_code} and no JSON "
                    f"({resp.text[:80]!r}): is {base} a Phalanx controller?"
                ) from None
        raise ControllerUnavailable(
            "no controller answered: " + "; ".join(errors),
            all_refused=refused == n,
            # no controller can change anything: each is down or cannot reach the database
            control_plane_down=refused + no_store == n,
        )

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(
        self, path: str, body: Any = None, *, idempotent: bool = False, timeout: float | None = None
    ) -> Any:
        return self.post_timed(path, body, idempotent=idempotent, timeout=timeout).body

    def post_timed(
        self, path: str, body: Any = None, *, idempotent: bool = False, timeout: float | None = None
    ) -> Timed:
        """POST, and say when the answered request was sent (see `Timed`)."""
        kw: dict[str, Any] = {"json": body if body is not None else {}}
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=min(3.0, timeout))
        return self.request_timed("POST", path, idempotent=idempotent, **kw)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)


def _is_refused(e: BaseException) -> bool:
    """A connection refused by the controller's host (its process is not running there)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _code(resp: httpx.Response) -> str | None:
    """The error code of an error reply (`store_unavailable`, ...), if it has one."""
    try:
        return str(resp.json()["error"]["code"])
    except Exception:
        return None


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except Exception:
        return f"HTTP {resp.status_code}"


def _to_error(resp: httpx.Response) -> PhalanxError:
    try:
        body = resp.json()["error"]
        cls = BY_CODE.get(body.get("code"), PhalanxError)
        err = cls(body.get("message", f"HTTP {resp.status_code}"), **(body.get("details") or {}))
    except Exception:
        err = PhalanxError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return err
