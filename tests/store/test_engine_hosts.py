"""Multi-host URLs (a primary and its standbys): which hosts a new connection tries.

A dead database host does not refuse connections (no RST), so libpq waits its connect timeout
for it before trying the next host; on every new connection, on the request's time. The store
gives each host 2 s, tries the host that served last first, and leaves a host that timed out
out of the list for a while (store/engine.py, HostChooser). Here: the choice itself (pure), and
real connections with a "silent" host (a socket that listens and never answers) listed first.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import text

from pgserver import PgServer
from phalanx.errors import StoreUnavailable
from phalanx.store.engine import Engines
from phalanx.store.pghosts import HOST_CONNECT_TIMEOUT, HostChooser, host_failures

TIMEOUT_MSG = (
    'connection failed: connection to server at "10.0.0.3", port 5432 failed: session is '
    "read-only\nMultiple connection attempts failed. All failures were:\n"
    "- host: 'db1', port: '5432', hostaddr: '10.0.0.1': connection timeout expired\n"
    "- host: 'db2', port: '5432', hostaddr: '10.0.0.2': connection failed: connection to "
    'server at "10.0.0.2", port 5432 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?\n"
    "- host: 'db3', port: '5432', hostaddr: '10.0.0.3': connection failed: connection to "
    'server at "10.0.0.3", port 5432 failed: session is read-only'
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_each_host_failure_is_read() -> None:
    assert host_failures(TIMEOUT_MSG) == [
        ("db1", "5432", "connection timeout expired"),
        ("db2", "5432", "Connection refused"),
        ("db3", "5432", "session is read-only"),
    ]


def test_a_silent_host_is_left_out_for_a_while_then_tried_again() -> None:
    clock = Clock()
    ch = HostChooser(["db1", "db2", "db3"], ["5432"], retry_after=30, clock=clock)
    assert ch.order() == [("db1", "5432"), ("db2", "5432"), ("db3", "5432")]
    ch.failed(TIMEOUT_MSG, ch.order())
    # only the host that timed out: a refusal or a standby's answer is quick
    assert ch.order() == [("db2", "5432"), ("db3", "5432")]
    assert ch.left_out() == ["db1:5432"]
    clock.t += 29
    assert ("db1", "5432") not in ch.order()
    clock.t += 2
    assert ch.order()[0] == ("db1", "5432")
    assert ch.left_out() == []


def test_the_host_that_served_last_comes_first() -> None:
    ch = HostChooser(["db1", "db2"], ["5432", "5433"], clock=Clock())
    ch.connected("db2", "5433")  # e.g. after a failover
    params: dict[str, object] = {"host": "db1,db2", "port": "5432,5433"}
    assert ch.apply(params) == [("db2", "5433"), ("db1", "5432")]
    assert params == {"host": "db2,db1", "port": "5433,5432", "connect_timeout": 2}
    assert ch.trying == {}  # apply alone (the LISTEN connection's parameters) tracks nothing


def test_a_host_another_attempt_waits_for_is_left_out_meanwhile() -> None:
    """When a host goes silent, one connection waits for it; the others go elsewhere."""
    clock = Clock()
    ch = HostChooser(["db1", "db2"], ["1", "2"], clock=clock)
    ch.connected("db1", "1")
    result: list[list[tuple[str, str]]] = []
    waiting = threading.Thread(target=lambda: result.append(ch.attempt({})))
    waiting.start()
    waiting.join()  # its attempt (db1 first) is now in flight
    assert result == [[("db1", "1"), ("db2", "2")]]
    assert ch.order()[0] == ("db1", "1")  # only just started: it may well answer
    clock.t += 0.5
    assert ch.order() == [("db2", "2")]
    ch.trying.clear()  # that attempt ended (its thread calls connected or failed)
    assert ch.order()[0] == ("db1", "1")


def test_every_host_silent_tries_them_all() -> None:
    ch = HostChooser(["db1", "db2"], ["1", "2"], clock=Clock())
    ch.failed("connection timeout expired", [("db1", "1")])  # one host tried: its message
    ch.failed("connection timeout expired", [("db2", "2")])
    assert ch.order() == [("db1", "1"), ("db2", "2")]


def test_one_host_needs_no_chooser() -> None:
    assert HostChooser.for_params({"host": "db1", "port": "5432"}) is None
    assert HostChooser.for_params({"host": "db1,db2", "hostaddr": "a,b"}) is None
    ch = HostChooser.for_params({"host": "db1,db2"})
    assert ch is not None and ch.order() == [("db1", ""), ("db2", "")]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts TCP connections (the kernel does) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])


def _timed_connect(engines: Engines) -> float:
    engines.write.dispose()  # a new connection, not a pooled one
    t0 = time.monotonic()
    with engines.begin() as conn:
        conn.execute(text("SELECT 1"))
    return time.monotonic() - t0


@pytest.mark.postgres
def test_a_silent_host_costs_one_timeout_not_one_per_connection(
    pg_server: PgServer, silent_port: int
) -> None:
    """Listed first, a silent host costs the first connection HOST_CONNECT_TIMEOUT (not the
    5 s connect timeout); later connections go to the server that answered, at once."""
    url = (
        f"postgresql://postgres@127.0.0.1:{silent_port},127.0.0.1:{pg_server.port}/"
        f"{pg_server.dbname}?target_session_attrs=read-write"
    )
    engines = Engines(url)
    try:
        first = _timed_connect(engines)
        assert HOST_CONNECT_TIMEOUT - 0.5 < first < HOST_CONNECT_TIMEOUT + 2.5, first
        later = [_timed_connect(engines) for _ in range(3)]
        assert max(later) < 1.5, later
    finally:
        engines.dispose()


@pytest.mark.postgres
def test_while_no_host_is_writable_a_silent_one_is_not_waited_for_each_time(
    pg_server: PgServer, silent_port: int
) -> None:
    """The failover gap: the old primary silent, the standby read-only. The first attempt
    waits for the silent host; the next ones fail at once, saying which host was left out."""
    name = "t_readonly_hosts"
    pg_server.create_database(name)
    try:
        with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as c:
            c.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        url = (
            f"postgresql://postgres@127.0.0.1:{silent_port},127.0.0.1:{pg_server.port}/"
            f"{name}?target_session_attrs=read-write"
        )
        engines = Engines(url)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as first:
                _timed_connect(engines)
            assert time.monotonic() - t0 > HOST_CONNECT_TIMEOUT - 0.5
            assert "timeout" in str(first.value) and "read-only" in str(first.value)
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable) as again:
                    _timed_connect(engines)
                assert time.monotonic() - t0 < 1.5
                assert "read-only" in str(again.value), again.value
                assert f"not tried: 127.0.0.1:{silent_port}" in str(again.value), again.value
        finally:
            engines.dispose()
    finally:
        pg_server.drop_database(name)
