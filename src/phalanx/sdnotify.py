"""systemd's service notification protocol (sd_notify), for `Type=notify` units.

The protocol is one datagram of newline-separated ``KEY=value`` lines sent to the Unix socket
named by ``$NOTIFY_SOCKET`` (a path, or an abstract-namespace name when it starts with ``@``);
see sd_notify(3). ``$WATCHDOG_USEC`` (with ``$WATCHDOG_PID``, when set, naming the process it is
meant for) asks for ``WATCHDOG=1`` more often than that.

Why our own forty lines rather than a package: the protocol is a single ``sendto``, and the
PyPI candidates are either unmaintained (``sdnotify``, last release 2017, which also swallows
every error silently and leaves the variables for children to inherit) or bind libsystemd
through C (``systemd-python``, ``cysystemd``: a compiler and libsystemd headers on every node
for one datagram). What matters here is what the packages do not do: take the variables out
of the environment at start, so that the jobs an agent starts (and the shepherds between)
never inherit the daemon's notify socket, as libsystemd's ``sd_notify(unset_environment=1)``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import MutableMapping

log = logging.getLogger("phalanx.sdnotify")

ENV_SOCKET = "NOTIFY_SOCKET"
ENV_WATCHDOG_USEC = "WATCHDOG_USEC"
ENV_WATCHDOG_PID = "WATCHDOG_PID"


def socket_address(name: str) -> str | bytes:
    """The address to send to for a ``$NOTIFY_SOCKET`` value: ``@name`` is the abstract
    namespace (a leading NUL byte on Linux), anything else a filesystem path."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


def watchdog_seconds(env: MutableMapping[str, str], pid: int) -> float | None:
    """The watchdog timeout systemd asks this process to honour, in seconds, or None.

    ``WATCHDOG_PID``, when present, must be our PID: a child that inherited the variables from a
    supervised parent is not the process systemd watches."""
    usec = env.get(ENV_WATCHDOG_USEC)
    if not usec:
        return None
    owner = env.get(ENV_WATCHDOG_PID)
    if owner and owner.strip() != str(pid):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring %s=%r: not a number of microseconds", ENV_WATCHDOG_USEC, usec)
        return None
    return value / 1e6 if value > 0 else None


def format_message(fields: dict[str, str]) -> bytes:
    """``KEY=value`` lines; a value never spans lines (STATUS= is one line by definition)."""
    lines = []
    for key, value in fields.items():
        one_line = " ".join(str(value).splitlines())
        lines.append(f"{key}={one_line}")
    return "\n".join(lines).encode()


class Notifier:
    """Sends notifications to systemd; does nothing when the daemon is not run by systemd.

    `from_environment` reads and removes the variables (see the module's docstring). A send
    that fails is logged once, never raised: systemd being away must not stop a daemon.
    """

    def __init__(self, address: str | None, watchdog: float | None) -> None:
        self.address = address
        self.watchdog = watchdog  # seconds systemd waits for a WATCHDOG=1, or None
        self._sock: socket.socket | None = None
        # reentrant: STOPPING=1 is sent from signal handlers, which run on the main thread,
        # possibly while that thread is inside send() itself (READY=1 at start)
        self._lock = threading.RLock()
        self._warned = False
        self.stopping = False

    @classmethod
    def from_environment(cls, env: MutableMapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        address = env.pop(ENV_SOCKET, None) or None
        watchdog = watchdog_seconds(env, os.getpid())
        env.pop(ENV_WATCHDOG_USEC, None)
        env.pop(ENV_WATCHDOG_PID, None)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """Send one datagram (``send(READY="1", STATUS="...")``); True if it was sent."""
        if self.address is None:
            return False
        data = format_message(fields)
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)  # a full queue must never stall a daemon
                self._sock.sendto(data, socket_address(self.address))
                return True
            except OSError as e:
                if not self._warned:
                    self._warned = True
                    log.warning("cannot notify systemd at %s: %s", self.address, e)
                return False

    def ready(self, status: str) -> bool:
        return self.send(READY="1", STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def ping(self) -> bool:
        return self.send(WATCHDOG="1")

    def stop(self, status: str = "stopping") -> bool:
        """``STOPPING=1`` once (a signal handler and the normal exit path may both call it)."""
        if self.stopping:
            return False
        self.stopping = True
        return self.send(STOPPING="1", STATUS=status)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
