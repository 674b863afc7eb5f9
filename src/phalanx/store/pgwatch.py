"""The PostgreSQL round-trip deadline: a connection whose answer is late is cut.

On PostgreSQL every round trip (a statement, a commit, the pool's connection check) has a
client-side deadline, `op_timeout` (the `db_op_timeout` timing parameter). A hung database host
(a frozen server, a dead host whose kernel state is gone, a stalled failover) keeps a pooled
connection open and never answers: libpq would wait forever, and TCP keepalives do not help
while the peer's kernel still acknowledges. A `Watchdog` thread therefore shuts down the socket
of a round trip that passed its deadline; the blocked call fails at once, SQLAlchemy drops the
connection, and the store raises `StoreUnavailable` (HTTP 503). A commit cut this way may or may
not have been applied: that raises `StoreOutcomeUnknown` (HTTP 504), so that nobody retries a
submission that might already exist (store/engine.py maps the errors). Used by the engines'
events (store/pgengine.py) and by the work listener's own connection (store/notify.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from phalanx.store.dburl import describe_url

# the engines' logger, as before store/engine.py was split: log filters may name it
log = logging.getLogger("phalanx.store.engine")


def no_answer(url: str, what: str, op_timeout: float) -> str:
    """The message for a round trip cut at its deadline."""
    return (
        f"database unavailable ({describe_url(url)}): no answer to a {what} within "
        f"{op_timeout:g}s (db_op_timeout); the connection was closed"
    )


@dataclass
class _Wait:
    """One round trip in flight on one thread: which connection, until when."""

    conn: Any  # the DBAPI (psycopg) connection
    fd: int  # its socket
    deadline: float  # monotonic
    what: str  # "statement", "commit", ... for the log
    cut: bool = False
    grace: bool = False  # given once: the answer was already waiting to be read


class Watchdog:
    """Cuts database connections whose round trip is not answered within `timeout` seconds.

    A thread calls `arm(conn)` before it sends something and `disarm(conn)` once the answer (or
    an error) is back. A round trip still armed at its deadline gets its socket shut down
    (`shutdown(SHUT_RDWR)` on a duplicate of the descriptor, so the driver still owns and
    closes the original): the blocked driver call returns at once with "server closed the
    connection", whatever the state of the peer. Only armed connections are ever cut, under
    the same lock that disarms them, so a connection that answered in time is never touched.

    One round trip per thread at a time (database calls are synchronous), so waits are keyed by
    thread. The checking thread starts on the first `arm` and sleeps while nothing is armed.
    """

    def __init__(self, timeout: float, *, name: str = "phx-db-watchdog") -> None:
        if timeout <= 0:
            raise ValueError(f"watchdog timeout must be positive, not {timeout}")
        self.timeout = timeout
        self.name = name
        self._waits: dict[int, _Wait] = {}
        self._cut_threads: set[int] = set()  # threads whose last round trip was cut
        self._exempt: set[int] = set()  # threads that wait as long as it takes (migrations)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wake_at: float | None = None  # when the checking thread looks next; None: idle
        self._stopping = False
        self.cuts = 0  # how many round trips were cut (for tests and /healthz)

    def arm(self, conn: Any, what: str) -> None:
        """The calling thread is about to wait for `conn` to answer."""
        try:
            fd = int(conn.fileno())
        except Exception:
            return  # closed already: the call fails by itself, there is nothing to cut
        tid = threading.get_ident()
        with self._cond:
            if tid in self._exempt:
                return
            self._waits[tid] = _Wait(conn, fd, time.monotonic() + self.timeout, what)
            self._cut_threads.discard(tid)
            if self._stopping or self._thread is None or not self._thread.is_alive():
                # (a thread told to stop may still be alive: start a fresh one regardless; two
                # checking threads for a moment are harmless, a wait nobody checks is not)
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            elif self._wake_at is None:
                self._cond.notify()  # asleep with nothing to watch: a context switch only then

    def disarm(self, conn: Any = None) -> bool:
        """The calling thread's wait on `conn` (any connection if None) is over.

        Returns True if that round trip was cut (it then also counts for `take_cut`)."""
        tid = threading.get_ident()
        with self._cond:
            w = self._waits.get(tid)
            if w is None or (conn is not None and w.conn is not conn):
                return False
            del self._waits[tid]
            if w.cut:
                self._cut_threads.add(tid)
            return w.cut

    def take_cut(self) -> bool:
        """Whether the calling thread's last round trip was cut; clears the mark."""
        tid = threading.get_ident()
        with self._cond:
            if tid in self._cut_threads:
                self._cut_threads.discard(tid)
                return True
            return False

    def forget_cut(self) -> None:
        self.take_cut()

    @contextlib.contextmanager
    def exempt(self) -> Iterator[None]:
        """No deadline for the calling thread's round trips inside this block."""
        tid = threading.get_ident()
        with self._cond:
            self._exempt.add(tid)
        try:
            yield
        finally:
            with self._cond:
                self._exempt.discard(tid)

    def stop(self) -> None:
        """Let the checking thread end (a later `arm` starts it again)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    def _run(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                pending = []
                for w in self._waits.values():
                    if w.cut:
                        continue
                    if w.deadline <= now and not w.grace and _readable(w.fd):
                        # the answer is there, only not read yet (this process was stalled,
                        # e.g. SIGSTOP, or starved of CPU): let the caller read it
                        w.grace = True
                        w.deadline = now + min(1.0, self.timeout)
                    if w.deadline <= now:
                        self._cut(w)
                    else:
                        pending.append(w.deadline)
                # while busy this wakes about once per timeout, not once per round trip
                self._wake_at = min(pending) if pending else None
                self._cond.wait(None if self._wake_at is None else self._wake_at - now)
            self._wake_at = None

    def _cut(self, w: _Wait) -> None:
        """Shut the socket down (called with the lock held, so `w` is still armed)."""
        w.cut = True
        self.cuts += 1
        log.warning(
            "database did not answer a %s within %gs: closing that connection", w.what, self.timeout
        )
        try:
            sock = socket.socket(fileno=os.dup(w.fd))
        except OSError:
            return  # not a socket any more: nothing to cut
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()


def _readable(fd: int) -> bool:
    """Whether the socket has something to read right now (poll, not select: any fd number)."""
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return any(ev & select.POLLIN for _, ev in p.poll(0))
    except (OSError, ValueError):
        return False
