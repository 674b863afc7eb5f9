"""The local address this host reaches a controller from: what srun tells its tasks to
connect back to, and what an agent tells the controllers srun reaches it at.

Kept apart from the HTTP clients (no heavy imports: srun's start-up pays for what it imports).
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def local_address(url: str) -> str | None:
    """This host's address on the route to `url`'s host (a UDP socket's connect sends no
    packet), or None when there is no route."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, parts.port or 80))
            return str(s.getsockname()[0])
    except OSError:
        return None


def split_address(at: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ValueError if it is neither."""
    host, sep, port = at.rpartition(":")
    if not sep or not port.isdecimal() or not host:
        raise ValueError(f"not host:port: {at!r}")
    return host.strip("[]"), int(port)
