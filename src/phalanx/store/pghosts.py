"""PostgreSQL with several hosts (a primary and its standbys): which host a connection tries.

With a multi-host URL (docs/patroni.md) libpq tries the hosts in order and waits
`connect_timeout` for each. A dead host does not refuse (its kernel is gone: no RST), so every
new connection would first wait for it, on the request's time: during a failover every request
then outlasts its client's timeout, agents cannot tell "the database is away" from "I am cut
off", and their jobs self-fence. `HostChooser` therefore gives each host
`HOST_CONNECT_TIMEOUT` (libpq's smallest), tries the host that last served a session first,
and leaves a host that timed out out of the list for `SILENT_HOST_RETRY` seconds while another
remains to try. `host_failures` reads each host's failure out of psycopg's error, for the
chooser and for messages.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

#: Seconds each host of a multi-host URL gets to accept a connection (libpq's smallest
#: `connect_timeout`): longer only delays the next host, and a session that slow to start would
#: not answer within `db_op_timeout` either.
HOST_CONNECT_TIMEOUT = 2
#: Seconds a host whose connection attempt timed out is left out of a multi-host URL's attempts
#: (while another host remains): then one attempt tries it again.
SILENT_HOST_RETRY = 30.0
#: Seconds after which a host that an attempt in flight still waits for is left out of other
#: attempts: when a host goes silent, one connection waits for it, not every one at once.
SILENT_HOST_SUSPECT = 0.25

_HOST_LINE = re.compile(r"^- host: '([^']*)', port: '([^']*)'(?:, hostaddr: '[^']*')?: (.*)$")
_SERVER_PREFIX = re.compile(r"^connection failed: connection to server at .*?failed: ")


def host_failures(message: str) -> list[tuple[str, str, str]]:
    """(host, port, reason) of each host in psycopg's error for a multi-host connection."""
    out = []
    for line in message.splitlines():
        m = _HOST_LINE.match(line.strip())
        if m is not None:
            out.append((m[1], m[2], _SERVER_PREFIX.sub("", m[3]).strip()))
    return out


class HostChooser:
    """Which hosts of a multi-host URL a new connection tries, in which order.

    The host that served the last session comes first (after a failover, the new primary: no
    wait for the dead one); a host whose attempt timed out (a dead or frozen host: nothing
    refused) is left out for `retry_after` seconds unless no other host is left, and so is,
    meanwhile, a host that another attempt has been waiting for longer than
    `SILENT_HOST_SUSPECT` (so that when a host goes silent one connection waits for it, not
    every one at once). Refusals and "read-only" answers are quick and say nothing bad about a
    host's reachability. `apply` and then `connected` or `failed` are called by one thread.
    """

    def __init__(
        self,
        hosts: list[str],
        ports: list[str],
        *,
        retry_after: float = SILENT_HOST_RETRY,
        clock: Any = time.monotonic,
    ) -> None:
        if len(ports) <= 1:
            ports = [ports[0] if ports else ""] * len(hosts)
        if len(ports) != len(hosts):
            raise ValueError(f"{len(hosts)} hosts but {len(ports)} ports")
        self.hosts = list(zip(hosts, ports, strict=True))
        self.retry_after = retry_after
        self.clock = clock
        self.last_good: tuple[str, str] | None = None
        self.silent_until: dict[tuple[str, str], float] = {}
        # attempts in flight: thread -> (the host it tries first, so waits for, since when)
        self.trying: dict[int, tuple[tuple[str, str], float]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_params(cls, cparams: Mapping[str, Any]) -> HostChooser | None:
        """A chooser for the connection parameters' `host` list, or None with one host (or a
        `hostaddr` list, which would have to be kept in step)."""
        hosts = str(cparams.get("host") or "").split(",")
        if len(hosts) < 2 or "hostaddr" in cparams:
            return None
        ports = str(cparams.get("port") or "").split(",")
        try:
            return cls([h.strip() for h in hosts], [p.strip() for p in ports])
        except ValueError:
            return None

    def order(self) -> list[tuple[str, str]]:
        """The hosts to try now: the last good one first, then the others in the URL's order,
        without those left out (all of them if every one is)."""
        now = self.clock()
        with self._lock:
            first = [h for h in self.hosts if h == self.last_good]
            ordered = first + [h for h in self.hosts if h != self.last_good]
            waited = {h for h, t0 in self.trying.values() if now - t0 > SILENT_HOST_SUSPECT}
            usable = [
                h for h in ordered if self.silent_until.get(h, 0.0) <= now and h not in waited
            ]
        return usable or ordered

    def apply(self, cparams: MutableMapping[str, Any]) -> list[tuple[str, str]]:
        """Set `cparams`' host and port lists (and per-host timeout) to `order()`; return it."""
        hosts = self.order()
        cparams["host"] = ",".join(h for h, _ in hosts)
        if any(p for _, p in hosts):
            cparams["port"] = ",".join(p for _, p in hosts)
        cparams["connect_timeout"] = HOST_CONNECT_TIMEOUT
        return hosts

    def attempt(self, cparams: MutableMapping[str, Any]) -> list[tuple[str, str]]:
        """`apply`, for an attempt the calling thread makes now and ends with `connected` or
        `failed`: meanwhile the host it waits for first counts as in flight."""
        hosts = self.apply(cparams)
        with self._lock:
            self.trying[threading.get_ident()] = (hosts[0], self.clock())
        return hosts

    def connected(self, host: str, port: str) -> None:
        with self._lock:
            self.trying.pop(threading.get_ident(), None)
            self.last_good = (host, port)
            self.silent_until.pop((host, port), None)

    def failed(self, message: str, tried: list[tuple[str, str]]) -> None:
        """Leave out every host whose attempt timed out (psycopg names each host's failure;
        with one host tried, its message is that host's)."""
        each = [((h, p), why) for h, p, why in host_failures(message)]
        if not each and len(tried) == 1:
            each = [(tried[0], message)]
        until = self.clock() + self.retry_after
        with self._lock:
            self.trying.pop(threading.get_ident(), None)
            for key, why in each:
                if "timeout" in why and key in self.hosts:
                    self.silent_until[key] = until

    def left_out(self) -> list[str]:
        """`host:port` of the hosts left out now, for messages."""
        now = self.clock()
        with self._lock:
            return [f"{h}:{p}" for (h, p), t in self.silent_until.items() if t > now]
