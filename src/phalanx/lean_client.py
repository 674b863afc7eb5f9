"""A small HTTP client for the commands that run many times inside jobs (``srun``).

A loop of ``srun true`` pays the interpreter and its imports on every step: ``httpx`` (and
the ``rich`` it pulls in) costs 100-200 ms a process on a 2-core node, several times a
trivial step.  This client speaks to the same API with the standard library only
(``http.client``), with the same credentials (``$PHALANX_TOKEN``, a token file, or the node's
local credential socket), the same failover over ``$PHALANX_URL`` and the same errors
(:mod:`phalanx.errors`, built from the API's error body).  Which controller it asks next is
:mod:`phalanx.failover`'s decision, the full client's too: a call that is not idempotent (creating
a step) is never repeated once it may have been applied; a local credential the controller
found expired is replaced once and the call repeated.
"""

from __future__ import annotations

import http.client
import json
import os
from typing import Any
from urllib.parse import urlencode, urlsplit

from phalanx.api_calls import ApiCalls
from phalanx.auth.credentials import default_source
from phalanx.errors import BY_CODE, ControllerUnavailable, PhalanxError, Unauthenticated
from phalanx.failover import Step, after_reply, after_transport_error, urls_from

TIMEOUT_S = 30.0
_ORJSON_FROM = 64 * 1024  # reply bytes from which orjson parses it (_loads)


class LeanClient(ApiCalls):
    def __init__(self, urls: str | None = None) -> None:
        self.urls = urls_from(urls)
        self.credentials = default_source(None)
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._current = 0

    def __enter__(self) -> LeanClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()

    def _conn(self, base: str) -> http.client.HTTPConnection:
        conn = self._conns.get(base)
        if conn is None:
            u = urlsplit(base)
            if u.scheme == "https":
                import ssl  # ~8 ms of start-up: only where a controller speaks TLS

                ca = os.environ.get("PHALANX_CA_FILE")
                ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
                conn = http.client.HTTPSConnection(
                    u.hostname or "", u.port or 443, timeout=TIMEOUT_S, context=ctx
                )
            else:
                conn = http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=TIMEOUT_S)
            self._conns[base] = conn
        return conn

    def get(self, path: str, **params: Any) -> Any:
        """GET, with query parameters as the full client sends them (a list repeats its key,
        None is left out)."""
        given = {k: v for k, v in params.items() if v is not None}
        if given:
            path += ("&" if "?" in path else "?") + urlencode(given, doseq=True)
        return self.request("GET", path, None, idempotent=True)

    def post(
        self, path: str, body: Any = None, *, idempotent: bool = False, timeout: float | None = None
    ) -> Any:
        return self.request(
            "POST", path, body if body is not None else {}, idempotent=idempotent, timeout=timeout
        )

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path, None, idempotent=False)

    def request(
        self,
        method: str,
        path: str,
        body: Any,
        *,
        idempotent: bool,
        timeout: float | None = None,
    ) -> Any:
        """Send with this client's credential; a local credential the controller found expired
        (clocks apart) is replaced once and the call repeated (a 401 changed nothing).
        `timeout`: seconds to wait for the answer, when not `TIMEOUT_S`."""
        try:
            return self._send(method, path, body, idempotent=idempotent, timeout=timeout)
        except Unauthenticated as e:
            if e.details.get("reason") != "expired":
                raise
            self.credentials.invalidate()
            try:
                return self._send(method, path, body, idempotent=idempotent, timeout=timeout)
            except Unauthenticated as again:
                raise Unauthenticated(
                    f"{again.message}; {self.credentials.renew_hint}", **again.details
                ) from None

    def _send(
        self, method: str, path: str, body: Any, *, idempotent: bool, timeout: float | None
    ) -> Any:
        token = self.credentials.token()
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else None
        errors = []
        n = len(self.urls)
        for i in range(n):
            idx = (self._current + i) % n
            base = self.urls[idx]
            conn = self._conn(base)
            conn.timeout = timeout or TIMEOUT_S
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            sent = False
            try:
                conn.request(method, path, body=data, headers=headers)
                sent = True  # written whole: from here the server may have applied it
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._conns.pop(base, None)
                if after_transport_error(sent=sent, idempotent=idempotent) is Step.UNKNOWN:
                    self._current = (idx + 1) % n
                    raise ControllerUnavailable(
                        f"{base} did not answer ({type(e).__name__}); the request may or may "
                        "not have been applied: check before retrying"
                    ) from None
                errors.append(f"{base}: {e}")
                continue
            if after_reply(resp.status, idempotent=idempotent) is Step.NEXT:
                errors.append(f"{base}: {_message(raw, resp.status)}")
                continue
            self._current = idx
            if resp.status >= 400:
                err = _error(raw, resp.status)
                if isinstance(err, Unauthenticated) and token is None:
                    # no credential was found: say why (the full client's message)
                    err = Unauthenticated(self.credentials.problem or err.message, **err.details)
                raise err
            return _loads(raw)
        raise ControllerUnavailable("no controller answered: " + "; ".join(errors))


def _loads(raw: bytes) -> Any:
    """A reply's JSON. A large one (a listing of thousands of jobs: squeue, sacct) is parsed
    by orjson, about three times faster than the standard parser; its import is paid only
    then (and never by the command server's workers, which have it loaded already)."""
    if len(raw) > _ORJSON_FROM:
        try:
            import orjson

            return orjson.loads(raw)
        except (ImportError, ValueError):  # not installed; a number past 64 bits
            pass
    return json.loads(raw or b"null")


def _message(raw: bytes, status: int) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


def _error(raw: bytes, status: int) -> PhalanxError:
    try:
        body = json.loads(raw)["error"]
        cls = BY_CODE.get(body.get("code"), PhalanxError)
        return cls(body.get("message", f"HTTP {status}"), **(body.get("details") or {}))
    except (ValueError, KeyError, TypeError, AttributeError):
        return PhalanxError(f"HTTP {status}: {raw[:200].decode(errors='replace')}")
