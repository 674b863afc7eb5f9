"""The PostgreSQL round-trip deadline (`db_op_timeout`, store/engine.py `Watchdog`).

A frozen server (SIGSTOP: its kernel still acknowledges every packet, so no TCP timeout ever
fires) must turn into StoreUnavailable within the deadline wherever the call is stuck: in a
statement, in the commit, or in a query that is merely slow. A cut transaction must leave no
trace, a cut commit must say that its outcome is unknown (HTTP 504, so that no client retries a
submission that may exist), and the store must work again once the server answers.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, text

from phalanx.errors import StoreOutcomeUnknown, StoreUnavailable
from phalanx.store.engine import Engines
from phalanx.store.pgwatch import Watchdog
from phalanx.store.store import Store

OP_TIMEOUT = 0.5  # short, so the tests are quick; the cut must come well within LIMIT
LIMIT = 4.0  # seconds a cut call may take at most on a loaded machine


# --------------------------------------------------------------------------------------------
# the watchdog on its own, with a real socket pair standing in for a database connection
# --------------------------------------------------------------------------------------------


class _Conn:
    """Anything with fileno() can be watched; here one end of a socket pair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()


def test_watchdog_cuts_a_round_trip_that_gets_no_answer() -> None:
    a, b = socket.socketpair()
    watch = Watchdog(0.2)
    try:
        conn = _Conn(a)
        watch.arm(conn, "statement")
        t0 = time.monotonic()
        a.settimeout(10)
        assert a.recv(1) == b""  # the peer never writes: only the cut ends this read
        took = time.monotonic() - t0
        assert 0.15 < took < LIMIT
        assert watch.disarm(conn) is True
        assert watch.take_cut() is True
        assert watch.take_cut() is False  # the mark is taken once
        assert watch.cuts == 1
    finally:
        watch.stop()
        a.close()
        b.close()


def test_watchdog_leaves_answered_round_trips_alone() -> None:
    a, b = socket.socketpair()
    watch = Watchdog(0.2)
    try:
        conn = _Conn(a)
        for _ in range(50):  # many quick round trips, together longer than the timeout
            watch.arm(conn, "statement")
            b.sendall(b"x")
            assert a.recv(1) == b"x"
            assert watch.disarm(conn) is False
            time.sleep(0.01)
        time.sleep(0.4)  # nothing armed: nothing is cut, however long it stays idle
        b.sendall(b"y")
        assert a.recv(1) == b"y"
        assert watch.cuts == 0
    finally:
        watch.stop()
        a.close()
        b.close()


def test_watchdog_spares_an_answer_that_is_waiting_to_be_read() -> None:
    """A stalled caller (SIGSTOP, CPU starvation) whose answer has arrived is not cut."""
    a, b = socket.socketpair()
    watch = Watchdog(0.5)
    try:
        conn = _Conn(a)
        watch.arm(conn, "statement")
        b.sendall(b"x")  # answered at once, but the caller reads only after the deadline
        time.sleep(0.6)
        assert a.recv(1) == b"x"
        assert watch.disarm(conn) is False
        assert watch.cuts == 0
    finally:
        watch.stop()
        a.close()
        b.close()


def test_watchdog_only_disarms_the_connection_it_armed() -> None:
    a, b = socket.socketpair()
    other = _Conn(b)
    watch = Watchdog(0.2)
    try:
        conn = _Conn(a)
        watch.arm(conn, "statement")
        assert watch.disarm(other) is False  # e.g. another connection checked in meanwhile
        a.settimeout(10)
        assert a.recv(1) == b""  # still watched, so still cut
        assert watch.disarm(conn) is True
    finally:
        watch.stop()
        a.close()
        b.close()


def test_watchdog_works_again_after_stop() -> None:
    """A store used again after close() (dispose) is still watched."""
    a, b = socket.socketpair()
    watch = Watchdog(0.2)
    try:
        conn = _Conn(a)
        watch.arm(conn, "statement")
        watch.disarm(conn)
        watch.stop()
        watch.arm(conn, "statement")
        a.settimeout(10)
        assert a.recv(1) == b""
        assert watch.disarm(conn) is True
    finally:
        watch.stop()
        a.close()
        b.close()


def test_sqlite_has_no_round_trip_deadline(tmp_path: Any) -> None:
    """SQLite waits for local locks, bounded by its busy timeout instead."""
    db = Engines(f"sqlite:///{tmp_path}/x.db", op_timeout=0.1)
    try:
        assert db.watchdog is None
        with db.begin() as conn:
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        db.dispose()


# --------------------------------------------------------------------------------------------
# a real PostgreSQL server, frozen at chosen points
# --------------------------------------------------------------------------------------------


@pytest.fixture
def pg_store(migrated_pg_url: str) -> Iterator[Store]:
    st = Store(migrated_pg_url, connect_timeout=2, op_timeout=OP_TIMEOUT)
    yield st
    st.close()


def _freeze_on(store: Store, pg_server: Any, name: str, match: str | None = None) -> None:
    """Freeze the server right before the next `name` event (whose SQL contains `match`)."""
    engine = store.db.write
    fired = threading.Event()

    if name == "commit":

        def on_commit(_conn: Any) -> None:
            if not fired.is_set():
                fired.set()
                pg_server.pause()

        event.listen(engine, "commit", on_commit)
    else:

        def on_execute(_c: Any, _cur: Any, statement: str, *_rest: Any) -> None:
            if not fired.is_set() and match is not None and match in statement:
                fired.set()
                pg_server.pause()

        event.listen(engine, "before_cursor_execute", on_execute)


def _markers(store: Store) -> list[str]:
    return [e["message"] for e in store.events() if e["kind"] == "test.marker"]


@pytest.mark.postgres
def test_frozen_server_mid_transaction_is_unavailable_and_leaves_no_trace(
    pg_store: Store, pg_server: Any
) -> None:
    pg_store.add_event("test.marker", "before")
    with pg_store.db.begin() as conn:  # a pooled connection for the next call
        conn.execute(text("SELECT 1"))
    _freeze_on(pg_store, pg_server, "statement", match="pg_sleep(0)")
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable) as err, pg_store.db.begin() as conn:
            pg_store._event(conn, "test.marker", "cut")  # applied on the server, not committed
            conn.execute(text("SELECT pg_sleep(0)"))  # the server freezes before this one
        took = time.monotonic() - t0
    finally:
        pg_server.resume()
    assert not isinstance(err.value, StoreOutcomeUnknown)  # nothing was committing
    assert err.value.http_status == 503
    assert "db_op_timeout" in err.value.message
    assert OP_TIMEOUT * 0.9 < took < LIMIT
    # the server rolls the cut transaction back; the same store goes on working
    assert wait_until(lambda: _markers(pg_store) == ["before"])
    pg_store.add_event("test.marker", "after")
    assert _markers(pg_store) == ["before", "after"]


@pytest.mark.postgres
def test_frozen_server_during_commit_is_outcome_unknown(pg_store: Store, pg_server: Any) -> None:
    with pg_store.db.begin() as conn:
        conn.execute(text("SELECT 1"))
    _freeze_on(pg_store, pg_server, "commit")
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreOutcomeUnknown) as err:
            pg_store.add_event("test.marker", "in doubt")
        took = time.monotonic() - t0
    finally:
        pg_server.resume()
    assert isinstance(err.value, StoreUnavailable)  # the controller's loops treat it alike
    assert err.value.http_status == 504  # but a client must not retry it as "not applied"
    assert "may or may not have been applied" in err.value.message
    assert OP_TIMEOUT * 0.9 < took < LIMIT
    # the COMMIT had reached the frozen server's socket buffer, so it was applied once the
    # server resumed: a 503 ("surely not applied") would have been a lie
    got = wait_until(lambda: _markers(pg_store) or None, timeout=10.0)
    assert got == ["in doubt"]
    pg_store.add_event("test.marker", "after")
    assert _markers(pg_store)[-1] == "after"


@pytest.mark.postgres
def test_slow_query_is_cut_without_a_trace_and_the_pool_recovers(pg_store: Store) -> None:
    """A live server that takes longer than db_op_timeout is treated like a hung one."""
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as err, pg_store.db.begin() as conn:
        pg_store._event(conn, "test.marker", "slow")
        conn.execute(text("SELECT pg_sleep(5)"))
    took = time.monotonic() - t0
    assert not isinstance(err.value, StoreOutcomeUnknown)
    assert OP_TIMEOUT * 0.9 < took < LIMIT
    # the backend notices the closed socket when its sleep ends and rolls back: never applied
    time.sleep(5.5 - (time.monotonic() - t0))  # past the sleep: a duration, not a condition
    assert _markers(pg_store) == []
    for i in range(20):  # every pooled connection still works
        pg_store.add_event("test.marker", f"m{i}")
    assert len(_markers(pg_store)) == 20
    assert pg_store.db.watchdog is not None and pg_store.db.watchdog.cuts == 1


@pytest.mark.postgres
def test_migrations_have_no_deadline(pg_store: Store) -> None:
    """Schema migrations may rewrite large tables: they wait as long as it takes."""
    with pg_store.db.begin(unbounded=True) as conn:
        conn.execute(text("SELECT pg_sleep(:s)"), {"s": OP_TIMEOUT * 2})
    with pytest.raises(StoreUnavailable), pg_store.db.begin() as conn:  # and the rest have
        conn.execute(text("SELECT pg_sleep(:s)"), {"s": OP_TIMEOUT * 3})


def wait_until(cond: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except StoreUnavailable:
            got = None
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_config_keeps_a_renewal_retry_inside_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.config import Timing, load_config
    from phalanx.errors import ConfigError

    for key in Timing.model_fields:
        monkeypatch.delenv(f"PHALANX_TIMING_{key.upper()}", raising=False)
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    assert load_config().timing.db_op_timeout == 2.0
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"timing": {"db_op_timeout": 2.5}})  # 0.75 + 2.5 > 3.0
    assert "renew_interval + db_op_timeout < lease_ttl" in err.value.message
    ok = load_config(overrides={"timing": {"db_op_timeout": 5.0, "lease_ttl": 8.0}})
    assert ok.timing.db_op_timeout == 5.0
