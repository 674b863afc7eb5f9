"""PostgreSQL: the pooled psycopg engine, every round trip of it under the deadline.

`postgres_engine` builds the one engine a controller uses on PostgreSQL (reads and writes)
and hooks its events: each statement, commit, rollback and the pool's connection check is
armed on the `Watchdog` (store/pgwatch.py) and disarmed when answered; a new session asks the
server to end it if it idles in a transaction (`idle_in_transaction_ms`), so a controller cut
off mid-transaction never keeps its row locks; with several hosts, each connection tries them
in the `HostChooser`'s order (store/pghosts.py). store/engine.py runs the transactions.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

from phalanx.errors import StoreUnavailable
from phalanx.store.jsoncol import json_loads
from phalanx.store.pghosts import HostChooser
from phalanx.store.pgwatch import Watchdog, no_answer

# Seconds a pooled connection goes without the check at checkout after it was last checked
# in. The check (a round trip) finds connections a restarted or failed-over server closed while
# they sat in the pool; one that was in use a moment ago is as good as checked, and under load
# every transaction would otherwise pay one more round trip (HikariCP's aliveBypassWindowMs,
# 500 ms, is the same idea). A server that dies within this window fails the next transaction
# on that connection with store_unavailable, as it would fail one in flight. Not so for a
# write of one statement in autocommit (Engines.begin, `single`): its statement is its commit,
# so a connection found dead then would make it StoreOutcomeUnknown; it is always checked.
PING_IDLE_AFTER = 1.0

# each engine's watchdog, by its dialect (shared by the engine's execution-option copies): the
# statements run straight on the driver (`pg_driver_execute`) arm it as the events do
_WATCHDOGS: weakref.WeakKeyDictionary[Dialect, Watchdog] = weakref.WeakKeyDictionary()


def watchdog_of(dialect: Dialect) -> Watchdog | None:
    """The watchdog of the engine built by `postgres_engine` with this dialect, if any."""
    return _WATCHDOGS.get(dialect)


def pg_driver_execute(conn: Connection, sql: str, params: dict[str, Any]) -> Any:
    """Run one statement on the psycopg connection under `conn`, in its transaction, under the
    round-trip deadline; its cursor, answered (the caller closes it).

    The job path's prebuilt statements (store/prebuilt.py) skip SQLAlchemy's execution (its
    context, events and result set-up, about 45 microseconds of a 110-microsecond statement
    here). What the events do for them is done here: the watchdog is armed for the round trip
    and disarmed when it is answered; a failure is raised as SQLAlchemy would raise it, and a
    connection that was cut, or that broke, is invalidated so that the pool never hands it out
    again (engine.Engines.begin then maps the error as for any statement)."""
    dbapi_conn: Any = conn.connection.dbapi_connection
    watch = _WATCHDOGS[conn.dialect]
    cursor = dbapi_conn.cursor()
    watch.arm(dbapi_conn, "statement")
    try:
        cursor.execute(sql, params)
    except psycopg.Error as e:
        cut = watch.disarm(dbapi_conn)
        cursor.close()
        broken = cut or isinstance(e, psycopg.OperationalError) or dbapi_conn.closed
        if broken:
            conn.invalidate(e)
        raise sa_exc.DBAPIError.instance(
            sql, params, e, psycopg.Error, connection_invalidated=bool(broken)
        ) from e
    watch.disarm(dbapi_conn)
    return cursor


def idle_in_transaction_ms(op_timeout: float) -> int:
    """`idle_in_transaction_session_timeout` for the controllers' sessions, in milliseconds.

    Phalanx's transactions are short and every round trip of one is answered within
    `op_timeout`, so a session idle inside a transaction for twice that long belongs to a
    controller that lost its connection (or is frozen); ending it releases its locks.
    """
    return max(1000, int(2 * op_timeout * 1000))


def postgres_engine(
    url: str,
    *,
    pool_size: int,
    connect_timeout: float,
    op_timeout: float,
    watch: Watchdog,
    local: threading.local,
    hosts: Callable[[], HostChooser | None],
) -> Engine:
    """A pooled psycopg engine whose every round trip is under `watch`.

    `local`: the engines' per-thread state (`committing` is set when a commit is sent,
    `check_always` when the next checkout must be checked whatever PING_IDLE_AFTER says);
    `hosts`: the multi-host chooser, asked for at each new connection (None: one host).

    The pool's connection check (pre-ping) is done here, in the checkout event, so that it
    too is under the deadline: SQLAlchemy's own `pool_pre_ping` runs before any event and
    would wait forever on a hung host.
    """
    engine = create_engine(
        url,
        json_deserializer=json_loads,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=connect_timeout,
        connect_args={"connect_timeout": max(1, int(connect_timeout))},
    )
    dialect = engine.dialect
    _WATCHDOGS[dialect] = watch
    idle_ms = idle_in_transaction_ms(op_timeout)

    @event.listens_for(engine, "do_connect")
    def _session_options(d: Any, _rec: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        # The server ends a session of ours that sits in an open transaction this long: a
        # controller cut off (or frozen) mid-transaction would otherwise keep its row locks,
        # the lease row included, until TCP gives up (hours), and no peer could take over.
        extra = f"-c idle_in_transaction_session_timeout={idle_ms}"
        cparams["options"] = f"{cparams.get('options') or ''} {extra}".strip()
        chooser = hosts()
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
        recent = time.monotonic() - rec.info.get("phx_used", -PING_IDLE_AFTER) < PING_IDLE_AFTER
        if recent and not getattr(local, "check_always", False):
            return  # it answered a moment ago (see PING_IDLE_AFTER)
        watch.arm(dbapi_conn, "connection check")
        try:
            dialect.do_ping(dbapi_conn)
        except Exception as e:
            if watch.disarm(dbapi_conn):
                raise StoreUnavailable(no_answer(url, "connection check", op_timeout)) from e
            # closed under us (a restarted or failed-over server): so are the other pooled
            # connections; the pool drops them all and this checkout reconnects
            raise sa_exc.InvalidatePoolError(f"pooled connection is dead: {e}") from e
        if watch.disarm(dbapi_conn):
            raise StoreUnavailable(no_answer(url, "connection check", op_timeout))

    @event.listens_for(engine, "before_cursor_execute")
    def _send(_conn: Any, cursor: Any, _stmt: Any, _params: Any, _ctx: Any, _many: Any) -> None:
        watch.arm(cursor.connection, "statement")

    @event.listens_for(engine, "after_cursor_execute")
    def _answered(_conn: Any, cursor: Any, _stmt: Any, _params: Any, _ctx: Any, _many: Any) -> None:
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
    def _checkin(dbapi_conn: Any, rec: Any) -> None:
        if dbapi_conn is not None:
            watch.disarm(dbapi_conn)
            rec.info["phx_used"] = time.monotonic()

    @event.listens_for(engine, "invalidate")
    def _invalidated(dbapi_conn: Any, _rec: Any, _exc: Any) -> None:
        if dbapi_conn is not None:
            watch.disarm(dbapi_conn)

    return engine


def _dbapi_of(conn: Connection) -> Any:
    """The DBAPI connection under a SQLAlchemy connection, or None when it has none now
    (closed or invalidated: asking for it would reconnect)."""
    if conn.closed or conn.invalidated:
        return None
    return conn.connection.dbapi_connection
