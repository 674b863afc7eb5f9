"""The local credential service: a Unix socket that hands each connecting process a short-lived
credential for the Unix user it runs as (the kernel says who, through SO_PEERCRED).

Every agent serves one (jobs and users on compute nodes), and `phalanx authd` serves one on
login hosts. This is MUNGE's model: nobody handles a secret, a user cannot get a credential for
another uid (the uid comes from the kernel, not from the request), and root's credential is
root's only because the peer really is uid 0.

Protocol: connect, read one JSON line, EOF. ``{"token": "...", "expires_at": 1.7e9, "user":
"alice"}`` or ``{"error": "..."}``. The client sends nothing, so there is nothing to parse
and nothing to spoof.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("phalanx.auth")

DEFAULT_SOCKET = "/run/phalanx/auth.sock"
ENV_SOCKET = "PHALANX_AUTH_SOCKET"
_SUN_PATH_MAX = 100  # sockaddr_un holds 108 bytes; longer paths go through /proc/self/fd


@contextlib.contextmanager
def reachable(path: Path) -> Iterator[str]:
    """A name for `path` that fits in sockaddr_un: the path itself if short, else the socket's
    name under /proc/self/fd/N of its open directory (test dirs can be deep)."""
    text = str(path)
    if len(text) <= _SUN_PATH_MAX:
        yield text
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end, from the kernel."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


Minter = Callable[[str, int, int], tuple[str, float]]  # (user, uid, gid) -> (token, expires_at)


class CredentialServer:
    """Serves credentials on `path` from a daemon thread; `mint` signs them."""

    def __init__(self, path: Path, mint: Minter) -> None:
        self.path = path
        self.mint = mint
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        # anyone may ask: the answer is only ever a credential for the asker's own uid
        sock = listen_at(self.path, 0o666)
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="phx-authd", daemon=True)
        self._thread.start()
        log.info("local credentials served on %s", self.path)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            with conn:
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    conn.sendall(self.answer(conn).encode() + b"\n")

    def answer(self, conn: socket.socket) -> str:
        try:
            _pid, uid, gid = peer_credentials(conn)
        except OSError as e:
            return json.dumps({"error": f"cannot tell who is asking: {e}"})
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            return json.dumps({"error": f"uid {uid} has no user name on this host"})
        try:
            token, expires = self.mint(user, uid, gid)
        except Exception as e:  # a bad key must not kill the service; say it and go on
            log.error("cannot mint a credential for %s: %s", user, e)
            return json.dumps({"error": f"this host cannot mint credentials: {e}"})
        return json.dumps({"token": token, "expires_at": expires, "user": user})


def listen_at(path: Path, mode: int, backlog: int = 512) -> socket.socket:
    """A Unix socket listening at `path` with permissions `mode`, its directory made. A socket
    file left by a process that is gone is replaced; one a live process serves is not
    (OSError): two services on one path would each get half the callers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket() or path.exists():
        if in_use(path):
            raise OSError(f"{path} is already served by another process")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with reachable(path) as name:
            sock.bind(name)
        os.chmod(path, mode)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def in_use(path: Path) -> bool:
    """Whether a process listens on the socket at `path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        with reachable(path) as name:
            s.connect(name)
        return True
    except OSError:
        return False
    finally:
        s.close()


def fetch(path: Path, timeout: float = 3.0) -> dict[str, object]:
    """Ask the service at `path` for a credential; raises OSError or ValueError with a reason."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        with reachable(path) as name:
            s.connect(name)
        chunks = []
        while True:
            data = s.recv(4096)
            if not data:
                break
            chunks.append(data)
    finally:
        s.close()
    reply = json.loads(b"".join(chunks) or b"{}")
    if not isinstance(reply, dict) or not ("token" in reply or "error" in reply):
        raise ValueError("the credential service sent no credential")
    return reply
