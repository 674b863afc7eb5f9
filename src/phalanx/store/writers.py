"""This process's write transactions take turns (`WriterQueue`), with a queue-jumping urgent turn.

One module because the reason is one story, told in the class's docstring: on SQLite a
waiting writer sleeps in the busy handler, on PostgreSQL it holds its row locks while it waits
for the GIL, and either way a lease renewal behind a dozen busy writers could miss its TTL.
Both engines take their write transactions through it (store/engine.py, `Engines.begin`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from phalanx.errors import StoreUnavailable
from phalanx.store.dburl import describe_url


class WriterQueue:
    """This process's write transactions take turns on a lock (on SQLite before BEGIN IMMEDIATE).

    SQLite admits one writer at a time; the others wait in its busy handler, which sleeps in
    steps of up to 100 ms and does not wake when the lock frees. With a dozen threads writing
    at once (heartbeat reports, submissions, the scheduler) a write transaction of a few
    milliseconds then waited seconds (measured: 2.1 s on average with 1,000 simulated nodes,
    docs/sim.md), and the controller idled while its queue grew. Waiting here instead wakes
    the next writer as soon as the last one commits. Writers of other processes (a second
    controller on the same file) still meet in SQLite's busy handler.

    An `urgent` turn (lease renewals and takes, the controller's presence stamp, the
    heartbeat flush, whose failure restarts the failure detector's grace) jumps the queue:
    while one waits, no ordinary writer starts, so it waits for at most the transaction in
    progress. A plain lock gives no such bound: its waiters are woken in no set order, and
    a writer that just committed and asks again usually gets it back before any waiter wakes,
    so a renewal behind a dozen busy writers waited past its lease's TTL and the controller
    lost its duties to its own write load (docs/architecture.md, "Leases and fencing").
    Ordinary writers are woken one at a time but not served in order: one 1,000-node
    simulation run with first-come-first-served hand-over (the next waiter owns the turn
    before it wakes, so the lock idles until that thread gets the GIL) did no better (write
    transactions 1.75 s on average against 1.2 s, and the cluster loop went 164 s without
    completing a tick), so the simpler order stays.
    Re-entrant: a write transaction opened inside another on the same thread waits for
    SQLite as before instead of deadlocking here.

    PostgreSQL too: its writers do not queue in a busy handler, but a controller's
    concurrent write transactions meet on the same few rows (the lease row every fenced
    write locks FOR UPDATE, the nodes' work generations and heartbeat stamps), and with a
    dozen threads sharing one interpreter each transaction spent most of its life waiting
    for the GIL between statements, holding those locks for seconds: the rest queued on
    them past `db_op_timeout`, were cut, retried, and the lease renewals behind them failed
    (200 simulated nodes, `bench/sim.py placements`: 227 lock waits over 0.5 s a minute, the
    `sched:batch` lease lost, placements 125/s then 0/s; with turns taken here, none, and
    68/s). The one writer at a time holds its locks only while it runs.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        lock = threading.Lock()
        # waiters of each kind wait on their own condition, and a freed turn wakes one waiter
        # (an urgent one first), not every waiter on each commit
        self._ordinary = threading.Condition(lock)
        self._first = threading.Condition(lock)
        self._owner: int | None = None  # the thread whose turn it is
        self._depth = 0  # its nested turns
        self._urgent = 0  # urgent turns waiting

    @contextlib.contextmanager
    def turn(self, url: str, *, urgent: bool = False) -> Iterator[None]:
        me = threading.get_ident()
        with self._ordinary:
            if self._owner == me:
                self._depth += 1
            else:
                self._wait(url, me, urgent)
        try:
            yield
        finally:
            with self._ordinary:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                    self._pass_on()

    def _pass_on(self) -> None:
        """The turn is free (lock held): wake one waiter, an urgent one if any waits."""
        if self._urgent > 0:
            self._first.notify()
        else:
            self._ordinary.notify()

    def _wait(self, url: str, me: int, urgent: bool) -> None:
        """Wait (lock held) until this thread may write: nobody writes, and for an ordinary
        writer no urgent one waits."""
        deadline = time.monotonic() + self.timeout
        cond = self._first if urgent else self._ordinary
        if urgent:
            self._urgent += 1
        try:
            while self._owner is not None or (not urgent and self._urgent > 0):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(
                        f"database unavailable ({describe_url(url)}): database is locked (no "
                        f"turn to write within {self.timeout:g}s)"
                    )
                cond.wait(left)
        except BaseException:
            if urgent:
                self._urgent -= 1
            if self._owner is None:
                self._pass_on()  # a wake-up this waiter may have taken goes on to another
            raise
        if urgent:
            self._urgent -= 1
        self._owner = me
        self._depth = 1
