"""The store's engines and transactions, on SQLite (WAL, embedded) or PostgreSQL (psycopg 3).

`Engines` builds a write engine and a read engine (the same one on PostgreSQL) and runs every
transaction of the store (`begin`, and `driver_write` for SQLite's submission path): this
process's writers take turns (store/writers.py), and database errors that mean "cannot reach
or use the database" become `StoreUnavailable`, a commit whose outcome was lost
`StoreOutcomeUnknown`. What each database needs lives beside it: SQLite's file, connection
settings and WAL checkpoints in store/sqliteengine.py; PostgreSQL's engine events in
store/pgengine.py, its round-trip deadline in store/pgwatch.py and its multi-host choice in
store/pghosts.py; URLs in store/dburl.py, JSON columns in store/jsoncol.py.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from sqlalchemy import Connection, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from phalanx.errors import StoreOutcomeUnknown, StoreUnavailable
from phalanx.store.dburl import describe_url, normalize_url
from phalanx.store.pgengine import postgres_engine
from phalanx.store.pghosts import HOST_CONNECT_TIMEOUT, HostChooser, host_failures
from phalanx.store.pgwatch import Watchdog, no_answer
from phalanx.store.sqliteengine import Checkpointer, sqlite_engine, sqlite_file
from phalanx.store.writers import WriterQueue

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

#: Default `op_timeout`: the longest a controller waits for PostgreSQL to answer one round trip
#: (config: `timing.db_op_timeout`).
DEFAULT_OP_TIMEOUT = 2.0


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
            self.checkpointer = Checkpointer(sqlite_file(u.database))
            self.writers = WriterQueue(max(connect_timeout, 10.0))
            self.write = sqlite_engine(self.url, immediate=True, timeout=max(connect_timeout, 10.0))
            self.read = sqlite_engine(self.url, immediate=False, timeout=max(connect_timeout, 10.0))
            self.snapshot = self.read  # a SQLite transaction always reads one snapshot
        elif self.dialect == "postgresql":
            self.watchdog = Watchdog(op_timeout)
            self.writers = WriterQueue(max(connect_timeout, 10.0))
            self.write = postgres_engine(
                self.url,
                pool_size=pool_size,
                connect_timeout=connect_timeout,
                op_timeout=op_timeout,
                watch=self.watchdog,
                local=self._local,
                hosts=lambda: self.hosts,
            )
            # reads outside a snapshot run in autocommit: under READ COMMITTED each statement
            # of a read transaction sees its own snapshot anyway, so a transaction gave them
            # nothing but two more round trips (BEGIN, COMMIT). Same pool, same events.
            self.read = self.write.execution_options(isolation_level="AUTOCOMMIT")
            # snapshot reads: BEGIN ISOLATION LEVEL REPEATABLE READ in one statement
            self.snapshot = self.write.execution_options(isolation_level="REPEATABLE READ")
            # a multi-host URL: which hosts new connections try, in which order (HostChooser)
            self.hosts = HostChooser.for_params(
                self.write.dialect.create_connect_args(self.write.url)[1]
            )
        else:
            raise StoreUnavailable(
                f"unsupported database URL {describe_url(url)}: use sqlite:///PATH or postgresql://..."
            )

    @contextlib.contextmanager
    def begin(
        self,
        *,
        write: bool = True,
        unbounded: bool = False,
        urgent: bool = False,
        snapshot: bool = False,
        single: bool = False,
    ) -> Iterator[Connection]:
        """One transaction; database-level failures become StoreUnavailable.

        `single` (PostgreSQL): a write of one statement, run in autocommit: the statement is
        its own transaction, and it saves BEGIN and COMMIT. Its statement is its commit, so a
        connection lost while it runs is StoreOutcomeUnknown as a lost COMMIT is.

        `snapshot` (PostgreSQL): every statement of the transaction sees the same snapshot
        (REPEATABLE READ; under the default READ COMMITTED each statement sees its own). A
        SQLite transaction always does.

        `urgent`: a write transaction that jumps this process's writer queue
        (`WriterQueue`): lease renewals, which must not wait behind bulk writes.

        On PostgreSQL a connection lost while the commit was in flight becomes
        StoreOutcomeUnknown: the server may have committed before the connection broke. `unbounded` lifts the
        round-trip deadline (schema migrations, which may rewrite large tables).
        """
        single = single and self.dialect == "postgresql"
        # PostgreSQL's `read` runs in autocommit; SQLite's `write` locks at BEGIN (IMMEDIATE)
        if single:
            engine = self.read
        elif write:
            engine = self.write
        else:
            engine = self.snapshot if snapshot else self.read
        watch = self.watchdog
        mode = "write" if write else "read"
        started = time.perf_counter()
        self._local.committing = single  # (see `single`)
        self._local.check_always = single  # its connection is checked (pgengine.PING_IDLE_AFTER)
        if watch is not None:
            watch.forget_cut()
        try:
            with contextlib.ExitStack() as stack:
                if write and self.writers is not None:
                    stack.enter_context(self.writers.turn(self.url, urgent=urgent))
                if unbounded and watch is not None:
                    stack.enter_context(watch.exempt())
                conn = stack.enter_context(engine.begin())
                if snapshot and write and self.dialect == "postgresql":
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
                no_answer(self.url, what, self.op_timeout)
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
        separate = self.read.pool is not self.write.pool  # PostgreSQL's reads share the pool
        self.write.dispose()
        if separate:
            self.read.dispose()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.checkpointer is not None:
            self.checkpointer.stop()


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
