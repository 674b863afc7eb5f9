"""Tests for the throwaway PostgreSQL helper and the database fixtures built on it.

Later outage and fail-over tests trust these pieces blindly, so their guarantees are pinned here:
a usable server, per-test database isolation, pause/resume behaving like a hung host, and
cleanup that leaves no processes or directories behind even when a graceful shutdown hangs.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
import sqlalchemy as sa

import pgserver
from pgserver import PgServer, PostgresNotAvailable

pytestmark = pytest.mark.postgres

_seen_pg_urls: list[str] = []


@pytest.fixture
def own_server() -> Iterator[PgServer]:
    """A private server for tests that pause or kill it, so the session server stays healthy."""
    server = PgServer.start()
    try:
        yield server
    finally:
        server.stop()


def _dbname(url: str) -> str:
    return sa.make_url(url).database or ""


def _all_gone(procs: list[psutil.Process]) -> bool:
    return not any(pgserver._alive(p) for p in procs)


def test_session_server_answers_select_1(pg_server: PgServer) -> None:
    engine = sa.create_engine(pg_server.url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("select 1")).scalar_one() == 1
            assert conn.execute(sa.text("select current_database()")).scalar_one() == "phalanx"
            assert conn.execute(sa.text("show fsync")).scalar_one() == "off"
            assert conn.execute(sa.text("show max_connections")).scalar_one() == "200"
    finally:
        engine.dispose()
    assert pg_server.url == f"postgresql+psycopg://postgres@127.0.0.1:{pg_server.port}/phalanx"
    assert pg_server.pid is not None and psutil.pid_exists(pg_server.pid)


@pytest.mark.parametrize("run", [1, 2])
def test_pg_url_is_a_fresh_distinct_database(pg_server: PgServer, pg_url: str, run: int) -> None:
    """Each test gets its own empty database, and the previous test's one is dropped."""
    name = _dbname(pg_url)
    assert name.startswith("t_") and name != "phalanx"
    assert pg_url not in _seen_pg_urls
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            assert sa.inspect(conn).get_table_names() == []
            conn.execute(sa.text("create table marker (run int)"))
            conn.execute(sa.text("insert into marker values (:run)"), {"run": run})
            existing = set(conn.execute(sa.text("select datname from pg_database")).scalars())
    finally:
        engine.dispose()  # left open on purpose in other tests; drop uses WITH (FORCE)
    assert name in existing
    assert not {_dbname(u) for u in _seen_pg_urls} & existing, "earlier pg_url not dropped"
    _seen_pg_urls.append(pg_url)


def test_db_url_round_trip(db_url: str) -> None:
    """Both backends of the ``db_url`` fixture accept the same basic SQL."""
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("create table t (id integer primary key, name text)"))
            conn.execute(sa.text("insert into t values (1, 'a')"))
        with engine.connect() as conn:
            assert conn.execute(sa.text("select name from t where id = 1")).scalar_one() == "a"
    finally:
        engine.dispose()


def test_pause_blocks_connections_until_resume(own_server: PgServer) -> None:
    dsn = own_server.dsn(connect_timeout=2)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select 1").fetchone() == (1,)

    with own_server.paused():
        assert own_server.is_paused
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn)
        assert time.monotonic() - started < 30
        engine = sa.create_engine(own_server.url, connect_args={"connect_timeout": 2})
        try:
            with pytest.raises(sa.exc.OperationalError), engine.connect():
                pass
        finally:
            engine.dispose()

    assert not own_server.is_paused
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_stop_removes_everything_and_is_idempotent(own_server: PgServer) -> None:
    procs = own_server._processes()
    assert len(procs) > 1  # postmaster plus background workers
    own_server.pause()  # stop() must cope with a frozen server
    own_server.stop()
    assert _all_gone(procs)
    assert not own_server.base_dir.exists()
    own_server.stop()  # idempotent
    assert "stopped" in repr(own_server)


def test_stop_falls_back_to_sigkill(own_server: PgServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A postmaster that ignores the fast shutdown (frozen behind our back) is killed."""
    monkeypatch.setattr(pgserver, "_STOP_TIMEOUT_S", 2)
    procs = own_server._processes()
    assert own_server.pid is not None
    os.kill(own_server.pid, signal.SIGSTOP)  # not via pause(): stop() does not know about it
    started = time.monotonic()
    own_server.stop()
    assert _all_gone(procs)
    assert not own_server.base_dir.exists()
    assert time.monotonic() - started < 30


def test_context_manager_stops() -> None:
    with PgServer.start(base_dir=Path("/tmp")) as server:
        base = server.base_dir
        with psycopg.connect(server.dsn()) as conn:
            assert conn.execute("select current_database()").fetchone() == ("phalanx",)
    assert not base.exists()


def test_missing_binaries_raise_postgres_not_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(pgserver.BINDIR_ENV, str(tmp_path))
    with pytest.raises(PostgresNotAvailable, match="lacks"):
        PgServer.start()
