"""Cross-controller wakeups through PostgreSQL LISTEN/NOTIFY.

An agent long-polls one controller; the work for its node may be placed by another (the holder
of the partition's scheduling lease) or changed by any controller (a cancel, a drain). Every
such write bumps `nodes.work_gen` (`Store._bump_gen`), and on PostgreSQL it also sends
`NOTIFY phalanx_work, '<node names>'` in the same transaction, so the notification goes out
exactly when the change is committed and visible. Each controller runs one `WorkListener`: a
thread with its own connection (not from the pool: LISTEN belongs to a session) that wakes
the long-polls of the named nodes as soon as the notification arrives.

Polling `work_gen` stays as the fallback: fast while the listener is down (SQLite, a database
outage, a reconnect in progress), slow while it is healthy. After every (re)connect the
listener reports "anything may have changed" (`None`), because notifications sent while it
was away are lost.

The listener never takes the process down and never holds it: connection errors are logged
once per outage and retried with a capped backoff, the connection is checked with a ping under
the same round-trip deadline as the store (`db_op_timeout`), and the thread is a daemon that
notices `stop()` within a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg import sql

from phalanx.store.pgwatch import Watchdog

log = logging.getLogger(__name__)

#: The channel every work_gen bump notifies.
WORK_CHANNEL = "phalanx_work"
#: The channel a controller notifies when it has new work for a scheduling pass (a
#: submission, a job's end, a node back) but does not itself hold every scheduling lease:
#: the holders run their pass at once instead of at their next interval.
SCHED_CHANNEL = "phalanx_sched"
#: Payload meaning "any node" (the list of names did not fit).
ALL_NODES = "*"
#: PostgreSQL refuses payloads of 8000 bytes or more; stay well below.
MAX_PAYLOAD = 7000

#: Seconds between liveness pings while no notification arrives.
PING_EVERY = 5.0
#: Longest wait between reconnect attempts (the first is after RETRY_FIRST).
RETRY_FIRST = 0.2
RETRY_MAX = 5.0
#: How long one wait for notifications lasts before the stop flag is looked at again.
WAIT_SLICE = 0.25


def encode_nodes(nodes: Iterable[str]) -> str:
    """The NOTIFY payload for a bump of these nodes' work_gen (a JSON list, or "*")."""
    payload = json.dumps(sorted(set(nodes)), separators=(",", ":"))
    return payload if len(payload.encode()) <= MAX_PAYLOAD else ALL_NODES


def decode_nodes(payload: str) -> list[str] | None:
    """The node names in a payload; None means "any node" (also for a payload we cannot read,
    e.g. from a newer controller: waking every waiter is always safe)."""
    if payload == ALL_NODES:
        return None
    try:
        names = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names


class WorkListener:
    """One thread, one dedicated connection: LISTEN, and call `on_nodes` for each notification.

    `on_nodes(names)` gets the node names of a notification, or None after a (re)connect or an
    unreadable payload ("any node may have work"). It runs on the listener thread and must be
    quick (the controller hands it to its event loop). `on_sched`, when given, is called for
    each notification on SCHED_CHANNEL, and after every (re)connect too.
    """

    def __init__(
        self,
        connect_args: tuple[list[Any], dict[str, Any]],
        on_nodes: Callable[[list[str] | None], None],
        *,
        op_timeout: float,
        channel: str = WORK_CHANNEL,
        on_sched: Callable[[], None] | None = None,
        ping_every: float = PING_EVERY,
        name: str = "phx-listen",
    ) -> None:
        self._cargs, self._cparams = connect_args
        self.on_nodes = on_nodes
        self.channel = channel
        self.on_sched = on_sched
        self.ping_every = ping_every
        self.watchdog = Watchdog(op_timeout, name=f"{name}-watchdog")
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._healthy = threading.Event()
        self.connects = 0  # successful LISTENs (the first one and every reconnect)
        self.received = 0  # notifications handed to on_nodes

    @property
    def healthy(self) -> bool:
        """Connected and listening (as of the last ping or notification)."""
        return self._healthy.is_set()

    def wait_healthy(self, timeout: float) -> bool:
        return self._healthy.wait(timeout)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait a little; a daemon thread never holds the process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.watchdog.stop()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        delay = RETRY_FIRST
        failing_since: float | None = None
        while not self._stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._connect()
                self._healthy.set()
                self.connects += 1
                if failing_since is not None:
                    log.info(
                        "listening for work notifications again (after %.1fs)",
                        time.monotonic() - failing_since,
                    )
                failing_since = None
                delay = RETRY_FIRST
                # whatever was sent while we were away is lost: re-check
                self._deliver(None)
                self._deliver_sched()
                self._listen(conn)
            except Exception as e:  # psycopg errors, a cut socket, a bug in a callback
                self._healthy.clear()
                if self._stop.is_set():
                    break
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning(
                        "work notifications unavailable (controllers poll instead): %s",
                        _first_line(e),
                    )
                else:
                    log.debug("work notifications still unavailable: %s", _first_line(e))
            finally:
                self._healthy.clear()
                if conn is not None:
                    _close_quietly(conn)
            self._stop.wait(delay)
            delay = min(delay * 2, RETRY_MAX)

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(*self._cargs, **{**self._cparams, "autocommit": True})
        try:
            self._round_trip(conn, sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            if self.on_sched is not None:
                self._round_trip(conn, sql.SQL("LISTEN {}").format(sql.Identifier(SCHED_CHANNEL)))
        except BaseException:
            _close_quietly(conn)
            raise
        return conn

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            got = False
            for n in conn.notifies(timeout=WAIT_SLICE):
                got = True
                if n.channel == self.channel:
                    self._deliver(decode_nodes(n.payload))
                elif n.channel == SCHED_CHANNEL:
                    self._deliver_sched()
            now = time.monotonic()
            if got:
                quiet_since = now
            elif now - quiet_since >= self.ping_every:
                # a silent channel and a dead server look alike: ask the server
                self._round_trip(conn, sql.SQL("SELECT 1"))
                quiet_since = time.monotonic()

    def _round_trip(self, conn: psycopg.Connection[Any], query: sql.Composed | sql.SQL) -> None:
        """One statement under the round-trip deadline (a hung server gets the socket cut)."""
        self.watchdog.arm(conn, "listener check")
        try:
            conn.execute(query)
        finally:
            if self.watchdog.disarm(conn):
                raise ConnectionError(
                    f"the database did not answer within {self.watchdog.timeout:g}s"
                )

    def _deliver_sched(self) -> None:
        if self.on_sched is None:
            return
        try:
            self.on_sched()
        except Exception:
            log.exception("scheduling notification handler failed; going on")

    def _deliver(self, nodes: list[str] | None) -> None:
        self.received += nodes is not None
        try:
            self.on_nodes(nodes)
        except Exception:
            log.exception("work notification handler failed; going on")


def _close_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.close()
    except Exception as e:
        log.debug("closing the listener connection: %s", e)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
