"""The Alembic migrations build exactly the schema the code uses, on both backends."""

from __future__ import annotations

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
