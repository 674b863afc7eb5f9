"""Engines and transactions for SQLite (WAL, embedded) and PostgreSQL (psycopg 3).

SQLite writers take the write lock at BEGIN (`BEGIN IMMEDIATE`), so two controllers sharing one
file serialise their writes instead of failing on a lock upgrade; readers use a separate engine
with deferred transactions and never block writers (WAL). Database errors that mean "cannot
reach or use the database" become `StoreUnavailable`.

On PostgreSQL every round trip (a statement, a commit, the pool's connection check) has a
client-side deadline, `op_timeout` (the `db_op_timeout` timing parameter). A hung database host
(a frozen server, a dead host whose kernel state is gone, a stalled failover) keeps a pooled
connection open and never answers: libpq would wait forever, and TCP keepalives do not help
while the peer's kernel still acknowledges. A `Watchdog` thread therefore shuts down the socket
of a round trip that passed its deadline; the blocked call fails at once, SQLAlchemy drops the
connection, and the store raises `StoreUnavailable` (HTTP 503). A commit cut this way may or may
not have been applied: that raises `StoreOutcomeUnknown` (HTTP 504), so that nobody retries a
submission that might already exist.

With a multi-host URL (a primary and its standbys, docs/patroni.md) libpq tries the hosts in
order and waits `connect_timeout` for each. A dead host does not refuse (its kernel is gone: no
RST), so every new connection would first wait for it, on the request's time: during a
failover every request then outlasts its client's timeout, agents cannot tell "the database is
away" from "I am cut off", and their jobs self-fence. `HostChooser` therefore gives each host
`HOST_CONNECT_TIMEOUT` (libpq's smallest), tries the host that last served a session first, and
leaves a host that timed out out of the list for `SILENT_HOST_RETRY` seconds while another
remains to try.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import orjson
from prometheus_client import Counter, Histogram
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from phalanx.errors import StoreOutcomeUnknown, StoreUnavailable

# Process-local (docs/metrics.md): every transaction this process ran, and those that failed
# because the database could not be reached or answered too late.
STORE_SECONDS = Histogram(
    "phalanx_store_transaction_seconds",
    "Duration of store transactions (begin to commit), this process",
    ["mode"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
STORE_ERRORS = Counter(
    "phalanx_store_errors_total", "Store transactions that failed: database unavailable", ["mode"]
)

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` and use psycopg 3; accept a bare path for SQLite."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    url = _hosts_to_query(url)
    if "://" not in url:
        url = f"sqlite:///{Path(url).absolute()}"
    return url


_MULTI_HOST = re.compile(
    r"^(?P<scheme>postgresql(?:\+\w+)?)://(?P<auth>[^@/?]*@)?(?P<hosts>[^/?@]*,[^/?@]*)"
    r"(?P<path>/[^?]*)?(?:\?(?P<query>.*))?$"
)


def _hosts_to_query(url: str) -> str:
    """Rewrite libpq's multi-host form for SQLAlchemy, which cannot parse it.

    `postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write` (what PostgreSQL's
    documentation shows, and what an operator pointing controllers at a primary and its standby
    writes) becomes `postgresql://u@/db?host=h1:5432&host=h2:5432&target_session_attrs=...`,
    which SQLAlchemy hands to libpq as the same list of hosts, tried in order.
    """
    m = _MULTI_HOST.match(url)
    if m is None:
        return url
    hosts = "&".join(f"host={h.strip()}" for h in m["hosts"].split(",") if h.strip())
    query = f"{hosts}&{m['query']}" if m["query"] else hosts
    return f"{m['scheme']}://{m['auth'] or ''}{m['path'] or '/'}?{query}"


def describe_url(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        # shown to people: `host=db1:5432`, not `host=db1%3A5432`
        return unquote(make_url(_hosts_to_query(url)).render_as_string(hide_password=True))
    except Exception:
        return "<invalid url>"


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


#: Default `op_timeout`: the longest a controller waits for PostgreSQL to answer one round trip
#: (config: `timing.db_op_timeout`).
DEFAULT_OP_TIMEOUT = 2.0


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


#: Pages a SQLite connection lets the WAL grow to before a commit checkpoints it itself: only a
#: backstop, for when the `Checkpointer` thread cannot keep up or is not running (SQLite's own
#: default is 1000, which makes every hundredth or so commit pay for a checkpoint and its fsync).
WAL_BACKSTOP_PAGES = 10_000


class Checkpointer:
    """Runs SQLite's WAL checkpoints on a thread of their own, off the commit path.

    With SQLite's default (`wal_autocheckpoint` = 1000 pages) the commit that fills the WAL
    copies it into the database file and fsyncs both, inside the request that made it: a
    submission that usually commits in ~50 us then takes milliseconds, and on average that
    was more than half of all commit time. Here the engines' connections checkpoint only past
    `WAL_BACKSTOP_PAGES`, and this thread runs a PASSIVE checkpoint (it waits for no reader or
    writer) every `interval` seconds after a write. Durability is unchanged: a commit is
    durable (against a process crash; with `synchronous=NORMAL` not against power loss) once
    it is in the WAL, whether or not it was checkpointed yet.
    """

    def __init__(self, path: str, *, interval: float = 0.5, timeout: float = 10.0) -> None:
        self.path = path
        self.interval = interval
        self.timeout = timeout
        self.dirty = False  # set by each write transaction; a clean WAL needs no checkpoint
        self.checkpoints = 0  # completed checkpoint calls (for tests)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def wrote(self) -> None:
        """A write transaction committed: checkpoint on the next round (starts the thread)."""
        self.dirty = True
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(
                        target=self._run, name="phx-wal-checkpoint", daemon=True
                    )
                    self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout + 2.0)

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            log.warning("WAL checkpoints fall back to commits: cannot open %s: %s", self.path, e)
            return
        try:
            while not self._stop.wait(self.interval):
                if not self.dirty:
                    continue
                self.dirty = False
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.checkpoints += 1
                except sqlite3.Error as e:  # busy, or the file went away: try again later
                    self.dirty = True
                    log.debug("WAL checkpoint of %s failed: %s", self.path, e)
        finally:
            conn.close()


def idle_in_transaction_ms(op_timeout: float) -> int:
    """`idle_in_transaction_session_timeout` for the controllers' sessions, in milliseconds.

    Phalanx's transactions are short and every round trip of one is answered within
    `op_timeout`, so a session idle inside a transaction for twice that long belongs to a
    controller that lost its connection (or is frozen); ending it releases its locks.
    """
    return max(1000, int(2 * op_timeout * 1000))


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


class Engines:
    """A write engine and a read engine (the same one on PostgreSQL).

    `op_timeout` is the PostgreSQL round-trip deadline (see the module docstring); SQLite
    ignores it: its waits are for local locks, bounded by the busy timeout.
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 5.0,
        pool_size: int = 8,
        op_timeout: float = DEFAULT_OP_TIMEOUT,
    ) -> None:
        self.url = normalize_url(url)
        u = make_url(self.url)
        self.dialect = u.get_backend_name()
        self.connect_timeout = connect_timeout
        self.op_timeout = op_timeout
        self.watchdog: Watchdog | None = None
        self.checkpointer: Checkpointer | None = None  # SQLite: WAL checkpoints off the commits
        self.writers: WriterQueue | None = None  # this process's writers take turns
        self.hosts: HostChooser | None = None  # PostgreSQL with several hosts
        self._local = threading.local()  # per thread: is a commit in flight?
        if self.dialect == "sqlite":
            db = u.database
            if not db or db == ":memory:":
                raise StoreUnavailable(
                    "SQLite needs a file path, e.g. sqlite:////var/lib/phalanx/phalanx.db"
                )
            parent = Path(db).absolute().parent
            if not parent.is_dir():
                raise StoreUnavailable(
                    f"cannot open database {db}: directory {parent} does not exist"
                )
            # the store holds every job's command, environment and paths: a new database file
            # is the controller's only (SQLite gives its -wal and -shm files the same mode)
            with contextlib.suppress(FileExistsError, PermissionError):
                os.close(os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self.checkpointer = Checkpointer(str(Path(db).absolute()))
            self.writers = WriterQueue(max(connect_timeout, 10.0))
            self.write = self._sqlite_engine(immediate=True, timeout=max(connect_timeout, 10.0))
            self.read = self._sqlite_engine(immediate=False, timeout=max(connect_timeout, 10.0))
        elif self.dialect == "postgresql":
            self.watchdog = Watchdog(op_timeout)
            self.writers = WriterQueue(max(connect_timeout, 10.0))
            self.write = self._postgres_engine(pool_size, connect_timeout, self.watchdog)
            self.read = self.write
            # a multi-host URL: which hosts new connections try, in which order (HostChooser)
            self.hosts = HostChooser.for_params(
                self.write.dialect.create_connect_args(self.write.url)[1]
            )
        else:
            raise StoreUnavailable(
                f"unsupported database URL {describe_url(url)}: use sqlite:///PATH or postgresql://..."
            )

    def _postgres_engine(self, pool_size: int, connect_timeout: float, watch: Watchdog) -> Engine:
        """A pooled psycopg engine whose every round trip is under `watch`.

        The pool's connection check (pre-ping) is done here, in the checkout event, so that it
        too is under the deadline: SQLAlchemy's own `pool_pre_ping` runs before any event and
        would wait forever on a hung host.
        """
        engine = create_engine(
            self.url,
            json_deserializer=json_loads,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_timeout=connect_timeout,
            connect_args={"connect_timeout": max(1, int(connect_timeout))},
        )
        dialect = engine.dialect
        local = self._local
        idle_ms = idle_in_transaction_ms(self.op_timeout)

        @event.listens_for(engine, "do_connect")
        def _session_options(d: Any, _rec: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
            # The server ends a session of ours that sits in an open transaction this long: a
            # controller cut off (or frozen) mid-transaction would otherwise keep its row locks,
            # the lease row included, until TCP gives up (hours), and no peer could take over.
            extra = f"-c idle_in_transaction_session_timeout={idle_ms}"
            cparams["options"] = f"{cparams.get('options') or ''} {extra}".strip()
            chooser = self.hosts
            if chooser is None:
                return None  # SQLAlchemy connects as usual
            tried = chooser.attempt(cparams)
            try:
                conn = d.connect(*cargs, **cparams)
            except Exception as e:
                chooser.failed(str(e), tried)
                raise
            chooser.connected(str(conn.info.host), str(conn.info.port))
            return conn

        @event.listens_for(engine, "connect")
        def _fresh(_dbapi_conn: Any, rec: Any) -> None:
            rec.info["phx_fresh"] = True  # just connected: no need to check it

        @event.listens_for(engine, "checkout")
        def _check(dbapi_conn: Any, rec: Any, _proxy: Any) -> None:
            if rec.info.pop("phx_fresh", False):
                return
            watch.arm(dbapi_conn, "connection check")
            try:
                dialect.do_ping(dbapi_conn)
            except Exception as e:
                if watch.disarm(dbapi_conn):
                    raise StoreUnavailable(self._no_answer("connection check")) from e
                # closed under us (a restarted or failed-over server): so are the other pooled
                # connections; the pool drops them all and this checkout reconnects
                raise sa_exc.InvalidatePoolError(f"pooled connection is dead: {e}") from e
            if watch.disarm(dbapi_conn):
                raise StoreUnavailable(self._no_answer("connection check"))

        @event.listens_for(engine, "before_cursor_execute")
        def _send(_conn: Any, cursor: Any, _stmt: Any, _params: Any, _ctx: Any, _many: Any) -> None:
            watch.arm(cursor.connection, "statement")

        @event.listens_for(engine, "after_cursor_execute")
        def _answered(
            _conn: Any, cursor: Any, _stmt: Any, _params: Any, _ctx: Any, _many: Any
        ) -> None:
            watch.disarm(cursor.connection)

        @event.listens_for(engine, "handle_error")
        def _failed(ctx: Any) -> None:
            if watch.disarm():
                ctx.is_disconnect = True  # never return a cut connection to the pool

        @event.listens_for(engine, "commit")
        def _commit(conn: Connection) -> None:
            local.committing = True
            dbapi_conn = _dbapi_of(conn)
            if dbapi_conn is not None:
                watch.arm(dbapi_conn, "commit")  # disarmed when the connection is checked in

        @event.listens_for(engine, "rollback")
        def _rollback(conn: Connection) -> None:
            dbapi_conn = _dbapi_of(conn)
            if dbapi_conn is not None:
                watch.arm(dbapi_conn, "rollback")

        @event.listens_for(engine, "reset")
        def _reset(dbapi_conn: Any, _rec: Any, _state: Any) -> None:
            watch.arm(dbapi_conn, "rollback")

        @event.listens_for(engine, "checkin")
        def _checkin(dbapi_conn: Any, _rec: Any) -> None:
            if dbapi_conn is not None:
                watch.disarm(dbapi_conn)

        @event.listens_for(engine, "invalidate")
        def _invalidated(dbapi_conn: Any, _rec: Any, _exc: Any) -> None:
            if dbapi_conn is not None:
                watch.disarm(dbapi_conn)

        return engine

    def _no_answer(self, what: str) -> str:
        return (
            f"database unavailable ({describe_url(self.url)}): no answer to a {what} within "
            f"{self.op_timeout:g}s (db_op_timeout); the connection was closed"
        )

    def _sqlite_engine(self, *, immediate: bool, timeout: float) -> Engine:
        engine = create_engine(
            self.url,
            json_deserializer=json_loads,
            connect_args={"timeout": timeout, "check_same_thread": False},
            pool_size=8,
            max_overflow=8,
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")  # see Checkpointer
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            cur.close()

        begin_sql = "BEGIN IMMEDIATE" if immediate else "BEGIN"

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # straight to the driver: a SQLAlchemy statement here (exec_driver_sql) costs every
            # transaction more than the BEGIN itself
            try:
                conn.connection.driver_connection.execute(begin_sql)  # type: ignore[union-attr]
            except sqlite3.Error as e:  # e.g. "database is locked": as SQLAlchemy would raise it
                raise sa_exc.DBAPIError.instance(begin_sql, None, e, sqlite3.Error) from e

        return engine

    @contextlib.contextmanager
    def begin(
        self,
        *,
        write: bool = True,
        unbounded: bool = False,
        urgent: bool = False,
        snapshot: bool = False,
    ) -> Iterator[Connection]:
        """One transaction; database-level failures become StoreUnavailable.

        `snapshot` (PostgreSQL): every statement of the transaction sees the same snapshot
        (REPEATABLE READ; under the default READ COMMITTED each statement sees its own). A
        SQLite transaction always does.

        `urgent`: a write transaction that jumps this process's writer queue
        (`WriterQueue`): lease renewals, which must not wait behind bulk writes.

        On PostgreSQL a connection lost while the commit was in flight becomes
        StoreOutcomeUnknown: the server may have committed before the connection broke. `unbounded` lifts the
        round-trip deadline (schema migrations, which may rewrite large tables).
        """
        engine = self.write if write else self.read
        watch = self.watchdog
        mode = "write" if write else "read"
        started = time.perf_counter()
        self._local.committing = False
        if watch is not None:
            watch.forget_cut()
        try:
            with contextlib.ExitStack() as stack:
                if write and self.writers is not None:
                    stack.enter_context(self.writers.turn(self.url, urgent=urgent))
                if unbounded and watch is not None:
                    stack.enter_context(watch.exempt())
                conn = stack.enter_context(engine.begin())
                if snapshot and self.dialect == "postgresql":
                    conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
                yield conn
            if write and self.checkpointer is not None:
                self.checkpointer.wrote()  # committed: the WAL has something to checkpoint
            STORE_SECONDS.labels(mode).observe(time.perf_counter() - started)
        except sa_exc.TimeoutError as e:  # the pool: every connection busy for pool_timeout
            STORE_ERRORS.labels(mode).inc()
            raise StoreUnavailable(
                f"database unavailable ({describe_url(self.url)}): no free connection within "
                f"{self.connect_timeout:g}s ({_first_line(e)})"
            ) from e
        except (OperationalError, DBAPIError) as e:
            cut = watch is not None and watch.take_cut()
            # integrity errors and the like are bugs or races, not outages
            if (
                not cut
                and not isinstance(e, OperationalError)
                and not e.connection_invalidated
                and "database is locked" not in str(e.orig)
            ):
                raise
            STORE_ERRORS.labels(mode).inc()
            what = "commit" if self._local.committing else "statement"
            message = (
                self._no_answer(what)
                if cut
                else f"database unavailable ({describe_url(self.url)}): {_first_line(e)}"
            )
            silent = self.hosts.left_out() if self.hosts is not None else []
            if silent and not cut:
                message += (
                    f" (not tried: {', '.join(silent)}, which did not answer within "
                    f"{HOST_CONNECT_TIMEOUT}s lately)"
                )
            # an error answer to COMMIT means it was rolled back; a commit whose connection
            # broke, or was cut, may have been applied before the answer was lost
            lost = cut or e.connection_invalidated
            if self._local.committing and lost and self.dialect == "postgresql":
                raise StoreOutcomeUnknown(
                    message + "; the change may or may not have been applied: check before retrying"
                ) from e
            raise StoreUnavailable(message) from e

    @contextlib.contextmanager
    def driver_write(self) -> Iterator[sqlite3.Connection]:
        """SQLite only: one write transaction (`BEGIN IMMEDIATE` ... `COMMIT`) on a pooled
        connection's sqlite3 driver, without a SQLAlchemy Connection around it (its set-up,
        events and teardown cost a one-job submission more than SQLite's own work: see
        rowinsert.py). It commits when the block ends without an exception, and the commit has
        returned when this does; failures are mapped as `begin` maps them (a locked or
        unusable database is StoreUnavailable; an integrity error is raised as SQLAlchemy
        would raise it)."""
        assert self.dialect == "sqlite" and self.writers is not None
        with self.writers.turn(self.url), self._driver_write() as driver:
            yield driver

    @contextlib.contextmanager
    def _driver_write(self) -> Iterator[sqlite3.Connection]:
        try:
            fairy = self.write.raw_connection()  # the pool's checkout (and its reset on return)
        except sa_exc.TimeoutError as e:
            raise StoreUnavailable(
                f"database unavailable ({describe_url(self.url)}): no free connection within "
                f"{self.connect_timeout:g}s ({_first_line(e)})"
            ) from e
        try:
            driver = fairy.driver_connection
            assert isinstance(driver, sqlite3.Connection)
            try:
                driver.execute("BEGIN IMMEDIATE")
                try:
                    yield driver
                except BaseException:
                    driver.rollback()
                    raise
                driver.commit()
            except sqlite3.OperationalError as e:
                raise StoreUnavailable(
                    f"database unavailable ({describe_url(self.url)}): {_first_line(e)}"
                ) from e
            except sqlite3.Error as e:
                raise sa_exc.DBAPIError.instance(None, None, e, sqlite3.Error) from e
        except OperationalError as e:  # from a RowInsert inside the block: as `begin` maps it
            raise StoreUnavailable(
                f"database unavailable ({describe_url(self.url)}): {_first_line(e)}"
            ) from e
        finally:
            fairy.close()
        if self.checkpointer is not None:
            self.checkpointer.wrote()

    def db_now_sql(self) -> Any:
        if self.dialect == "sqlite":
            return text("(julianday('now') - 2440587.5) * 86400.0")
        return text("extract(epoch from clock_timestamp())")

    def connect_args(self) -> tuple[list[Any], dict[str, Any]]:
        """What the pool passes to psycopg.connect, for a dedicated connection (LISTEN)."""
        cargs, cparams = self.write.dialect.create_connect_args(self.write.url)
        cparams.setdefault("connect_timeout", max(1, int(self.connect_timeout)))
        if self.hosts is not None:
            self.hosts.apply(cparams)  # the primary of the moment first, 2 s a host
        return list(cargs), dict(cparams)

    def dispose(self) -> None:
        self.write.dispose()
        if self.read is not self.write:
            self.read.dispose()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.checkpointer is not None:
            self.checkpointer.stop()


def json_loads(text: str | bytes) -> Any:
    """Decode a JSON column (the engines' `json_deserializer`): orjson, about 2.5x faster than
    the standard library on a job's spec, and the heartbeat's read of a node's work decodes
    every live task's spec each time (a tenth of a busy controller's time went to `json`).

    Values orjson refuses fall back to the standard decoder, which wrote them: `json.dumps`
    (the columns' serializer) writes NaN and Infinity, and integers beyond 64 bits, which are
    not strict JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def _readable(fd: int) -> bool:
    """Whether the socket has something to read right now (poll, not select: any fd number)."""
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return any(ev & select.POLLIN for _, ev in p.poll(0))
    except (OSError, ValueError):
        return False


def _dbapi_of(conn: Connection) -> Any:
    """The DBAPI connection under a SQLAlchemy connection, or None when it has none now
    (closed or invalidated: asking for it would reconnect)."""
    if conn.closed or conn.invalidated:
        return None
    return conn.connection.dbapi_connection


def _first_line(e: BaseException) -> str:
    """The database error in one line; with a multi-host URL, every host's failure.

    psycopg's first line names only the last host it tried ("session is read-only" for a
    standby), which hides the one that matters after a failover (the primary refused)."""
    orig = getattr(e, "orig", None) or e
    lines = [ln.strip() for ln in str(orig).strip().splitlines()]
    hosts = host_failures(str(orig))
    if len(hosts) > 1:
        each = "; ".join(f"{h}:{p}: {why}" for h, p, why in hosts)
        return f"no usable server among {len(hosts)} hosts: {each}"
    return (lines or [type(orig).__name__])[0]
