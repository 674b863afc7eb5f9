"""A small HTTP client for the commands that run many times inside jobs (``srun``).

A loop of ``srun true`` pays the interpreter and its imports on every step: ``httpx`` (and
the ``rich`` it pulls in) costs 100-200 ms a process on a 2-core node, several times a
trivial step.  This client speaks to the same API with the standard library only
(``http.client``), with the same credentials (``$PHALANX_TOKEN``, a token file, or the node's
local credential socket), the same failover over ``$PHALANX_URL`` and the same errors
(:mod:`phalanx.errors`, built from the API's error body).  Only calls that are safe to repeat
on another controller after a connection failure go through it: creating a step is not
repeated once sent (the error says so, as :class:`phalanx.client.Client` does).
"""

from __future__ import annotations

import http.client
import json
import os
from typing import Any
from urllib.parse import urlsplit

from phalanx.auth.credentials import default_source
from phalanx.errors import BY_CODE, ControllerUnavailable, PhalanxError

DEFAULT_URL = "http://127.0.0.1:6817"
TIMEOUT_S = 30.0


class LeanClient:
    def __init__(self, urls: str | None = None) -> None:
        text = urls or os.environ.get("PHALANX_URL") or DEFAULT_URL
        self.urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise PhalanxError(f"controller address '{u}' must start with http:// or https://")
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

    def get(self, path: str) -> Any:
        return self.request("GET", path, None, idempotent=True)

    def post(self, path: str, body: Any, *, idempotent: bool = False) -> Any:
        return self.request("POST", path, body, idempotent=idempotent)

    def request(self, method: str, path: str, body: Any, *, idempotent: bool) -> Any:
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
            sent = False
            try:
                conn.request(method, path, body=data, headers=headers)
                sent = True
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._conns.pop(base, None)
                if sent and not idempotent:
                    raise ControllerUnavailable(
                        f"{base} did not answer ({type(e).__name__}); the request may or may "
                        "not have been applied: check before retrying"
                    ) from None
                errors.append(f"{base}: {e}")
                continue
            if resp.status == 503:
                errors.append(f"{base}: {_message(raw, resp.status)}")
                continue
            self._current = idx
            if resp.status >= 400:
                raise _error(raw, resp.status)
            return json.loads(raw or b"null")
        raise ControllerUnavailable("no controller answered: " + "; ".join(errors))


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
