"""Fresh databases at the latest schema without running the Alembic chain each time.

Migrating a new database cost every store and API test about 0.2 s of CPU on SQLite (some
twenty revision scripts loaded and run, several of them rebuilding tables) and more on
PostgreSQL (the server's catalog work besides); a copy of one database migrated once a
session (tests/conftest.py's `schema_db` and `pg_schema`) costs a millisecond on SQLite and a
server-side file copy on PostgreSQL, and holds the same schema, so each test still starts
from its own empty database. The migrations themselves are tested from an empty database
(`db_url`, tests/store/test_migrations.py).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from phalanx.store.store import Store


def migrate_new(path: Path) -> Path:
    """Create the database at `path` and bring it to the latest revision."""
    migrate_url(f"sqlite:///{path}")
    return path


def migrate_url(url: str) -> None:
    """Bring the database at `url` to the latest revision, leaving no connection open (a
    PostgreSQL template must have none when it is copied)."""
    st = Store(url, actor="t")
    try:
        st.migrate()
    finally:
        st.close()


def fresh_db(schema_db: Path, path: Path) -> str:
    """A new database at `path`, a copy of `schema_db` made with SQLite's backup API (whole
    whatever the journal mode); return its SQLAlchemy URL."""
    src, dst = sqlite3.connect(schema_db), sqlite3.connect(path)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return f"sqlite:///{path}"
