"""Where a client's credential comes from (CLI, SDK, agents).

In order: an explicit token; `$PHALANX_TOKEN`; a token file (`$PHALANX_TOKEN_FILE`, else
`~/.config/phalanx/token` if it exists); otherwise the host's local credential service
(`$PHALANX_AUTH_SOCKET`, else /run/phalanx/auth.sock), which needs no setup at all.

Tokens from the local service are short-lived: a source caches one and fetches a new one
shortly before it expires, or when the controller says it expired (clock differences).
Nothing here imports the JWT library: a client only carries tokens, it never checks them.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from phalanx.auth import localsock

ENV_TOKEN = "PHALANX_TOKEN"
ENV_TOKEN_FILE = "PHALANX_TOKEN_FILE"
DEFAULT_TOKEN_FILE = "~/.config/phalanx/token"
RENEW_BEFORE = 30.0  # seconds before expiry a cached credential is replaced
# How long a client waits for the local credential service to come back (an agent or authd
# being restarted) before it fails: $PHALANX_AUTH_WAIT seconds, 0 to fail at once.
ENV_AUTH_WAIT = "PHALANX_AUTH_WAIT"
DEFAULT_AUTH_WAIT = 5.0
MAX_AUTH_WAIT = 300.0
SAY_WAITING_AFTER = 1.0  # a wait longer than this is said on stderr, once
# nobody listens on the socket right now (its service restarting): worth waiting for
_GONE = (errno.ECONNREFUSED, errno.EAGAIN, errno.ECONNRESET)


def auth_wait() -> float:
    """$PHALANX_AUTH_WAIT in seconds (default 5); ValueError naming the variable if bad."""
    raw = os.environ.get(ENV_AUTH_WAIT)
    if raw is None or not raw.strip():
        return DEFAULT_AUTH_WAIT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= MAX_AUTH_WAIT:
        raise ValueError(
            f"${ENV_AUTH_WAIT} must be a number of seconds from 0 to {MAX_AUTH_WAIT:g} (how long "
            f"to wait for the local credential service), not {raw!r}"
        )
    return value


class CredentialSource(Protocol):
    def token(self) -> str | None:
        """The credential to send, or None (then `problem` says why there is none)."""

    def invalidate(self) -> None:
        """The controller refused the last token as expired: get a fresh one next time."""

    @property
    def problem(self) -> str | None:
        """Why no credential could be had, for the error a 401 turns into."""

    @property
    def renew_hint(self) -> str:
        """What to do about an expired or refused credential from this source."""


class StaticToken:
    def __init__(self, token: str, origin: str) -> None:
        self._token = token.strip()
        self.origin = origin
        self.problem: str | None = None if self._token else f"{origin} is empty"

    def token(self) -> str | None:
        return self._token or None

    def invalidate(self) -> None:
        pass

    @property
    def renew_hint(self) -> str:
        return (
            f"the token comes from {self.origin}; get a new one with "
            "`phalanx token create --user USER` (run by an admin)"
        )


class LocalService:
    """Credentials from this host's credential service (agent or `phalanx authd`).

    A service that is not there (its agent or authd restarting: no socket, or nobody
    listening) is waited for up to `wait` seconds ($PHALANX_AUTH_WAIT, default 5), so a
    restart does not fail every command on the host; a wait past a second is said once on
    stderr, and the error after the wait says how long it waited."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, wait: float | None = None
    ) -> None:
        self.path = Path(path or os.environ.get(localsock.ENV_SOCKET) or localsock.DEFAULT_SOCKET)
        self._token: str | None = None
        self._expires = 0.0
        self._lock = threading.Lock()
        self.problem: str | None = None
        self._wait = wait

    def _fetch(self) -> dict[str, object]:
        """One credential from the service, waiting for it while it is gone."""
        wait = auth_wait() if self._wait is None else self._wait
        deadline = time.monotonic() + wait
        pause, said = 0.05, False
        while True:
            try:
                return localsock.fetch(self.path)
            except OSError as e:
                left = deadline - time.monotonic()
                if not self._worth_waiting(e) or left <= 0:
                    if wait > 0 and self._worth_waiting(e):
                        e.strerror = f"{e.strerror or e}; waited {wait:g}s for it"
                    raise
                if not said and wait - left >= SAY_WAITING_AFTER:
                    said = True
                    print(
                        f"phalanx: waiting up to {wait:g}s for the local credential service "
                        f"at {self.path} ({e.strerror or e})",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)

    def _worth_waiting(self, e: OSError) -> bool:
        """Whether the service may be back in a moment: nobody listens on its socket, or
        the socket is gone from a directory that exists (a restart removes and recreates
        it). No directory at all is a host without the service: no point waiting."""
        if e.errno in _GONE:
            return True
        return e.errno == errno.ENOENT and self.path.parent.is_dir()

    def token(self) -> str | None:
        with self._lock:
            if self._token is not None and time.time() < self._expires - RENEW_BEFORE:
                return self._token
            try:
                reply = self._fetch()
            except (OSError, ValueError) as e:
                why = getattr(e, "strerror", None) or str(e) or type(e).__name__
                if isinstance(e, ValueError) and ENV_AUTH_WAIT in str(e):
                    self.problem = f"no credential: {e}"
                else:
                    self.problem = (
                        f"no credential: the local credential service at {self.path} did not "
                        f"answer ({why}); on a cluster host start the agent or `phalanx "
                        f"authd`, elsewhere set {ENV_TOKEN} or {ENV_TOKEN_FILE}"
                    )
                self._token = None
                return None
            if "error" in reply:
                self.problem = f"no credential: {self.path}: {reply['error']}"
                self._token = None
                return None
            self._token = str(reply["token"])
            expires = reply.get("expires_at")
            self._expires = float(expires) if isinstance(expires, int | float) else 0.0
            self.problem = None
            return self._token

    def invalidate(self) -> None:
        with self._lock:
            self._token = None

    @property
    def renew_hint(self) -> str:
        return f"local credentials come from {self.path}; check that this host's clock is right"


def default_source(token: str | None = None) -> CredentialSource:
    if token:
        return StaticToken(token, "the token given")
    env = os.environ.get(ENV_TOKEN)
    if env:
        return StaticToken(env, f"${ENV_TOKEN}")
    file = os.environ.get(ENV_TOKEN_FILE)
    path = Path(file) if file else Path(DEFAULT_TOKEN_FILE).expanduser()
    if file or path.is_file():
        try:
            return StaticToken(path.read_text(), f"token file {path}")
        except OSError as e:
            bad = StaticToken("", f"token file {path}")
            bad.problem = f"cannot read token file {path}: {e.strerror or e}"
            return bad
    return LocalService()
