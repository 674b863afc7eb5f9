"""The Alembic migrations build exactly the schema the code uses, on both backends."""

from __future__ import annotations

import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from phalanx.store.schema import metadata
from phalanx.store.store import Store


def test_migrations_match_schema(db_url: str) -> None:
    store = Store(db_url, actor="test")
    try:
        store.migrate()
        store.migrate()  # idempotent: a second controller starting runs it again
        with store.db.write.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == []
    finally:
        store.close()


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
        with store.db.write.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), metadata) == []
    finally:
        store.close()
