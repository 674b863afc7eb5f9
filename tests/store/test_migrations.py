"""The Alembic migrations build exactly the schema the code uses, on both backends."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config as AlembicConfig
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from phalanx.store import schema
from phalanx.store.schema import metadata
from phalanx.store.store import Store


def schema_diff(url: str) -> list[object]:
    """Alembic's comparison of the database at `url` with the code's schema, on a plain
    connection: the store's own sessions end a transaction idle for 2 x db_op_timeout, and
    the comparison runs Python (reflection) between its statements."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), metadata))
    finally:
        engine.dispose()


def test_migrations_match_schema(db_url: str) -> None:
    store = Store(db_url, actor="test")
    try:
        store.migrate()
        store.migrate()  # idempotent: a second controller starting runs it again
    finally:
        store.close()
    assert schema_diff(db_url) == []


@pytest.mark.postgres
def test_a_slow_migration_is_not_ended_by_the_idle_limit(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controllers' sessions end a transaction left idle for 2 x db_op_timeout (1 s here):
    right for their short transactions, wrong for a migration, whose transaction waits on
    Python between statements (Alembic loading and running each revision). A loaded host
    stretches those gaps; here a revision step pauses 1.5 s, and the migration still
    completes instead of being ended half way by the server."""
    from alembic.runtime import migration

    run = migration.MigrationContext.run_migrations

    def slow(self: migration.MigrationContext, **kw: object) -> None:
        time.sleep(1.5)  # the gap a busy host puts between two statements of the migration
        run(self, **kw)

    monkeypatch.setattr(migration.MigrationContext, "run_migrations", slow)
    store = Store(pg_url, actor="test", op_timeout=0.5)
    try:
        store.migrate()
    finally:
        store.close()
    assert schema_diff(pg_url) == []


@pytest.mark.postgres
def test_the_hot_tables_leave_room_for_in_place_updates_on_postgresql(pg_url: str) -> None:
    """Migration 0015: the tables rewritten several times a second (heartbeat stamps, flush
    marks, lease renewals) keep half of each page free and are vacuumed after a fixed number of
    dead rows; the big ones after 2% of them. A downgrade takes the settings back."""
    store = Store(pg_url, actor="test")

    def options() -> dict[str, set[str]]:
        with store.db.write.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT relname, reloptions FROM pg_class WHERE relname IN "
                    "('nodes', 'controllers', 'leases', 'jobs', 'attempts', 'tasks')"
                )
            ).all()
        return {r.relname: set(r.reloptions or []) for r in rows}

    try:
        store.migrate()
        got = options()
        for table in ("nodes", "controllers", "leases"):
            assert {"fillfactor=50", "autovacuum_vacuum_scale_factor=0"} <= got[table], got
        for table in ("jobs", "attempts", "tasks"):
            assert "autovacuum_vacuum_scale_factor=0.02" in got[table], got
        cfg = AlembicConfig()
        cfg.set_main_option("script_location", str(Path(schema.__file__).parent / "migrations"))
        with store.db.begin(unbounded=True) as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0014")
        assert options() == {t: set() for t in got}, options()
    finally:
        store.close()
