"""PostgreSQL: storage settings for the tables the controllers update all the time

`nodes` (every heartbeat flush stamps each node heard), `controllers` (every flush's mark and
presence) and `leases` (every renewal) are small tables whose rows are rewritten several
times a second. With room left on each page (`fillfactor`) PostgreSQL can rewrite a row in
place (a HOT update: none of these columns is indexed) instead of moving it and touching
every index, and with a fixed threshold autovacuum cleans them up after a few hundred dead
rows instead of after a share of a table that never grows. `jobs`, `attempts` and `tasks`
grow to millions of rows (`accounting.keep_finished`), and the default scale factor (20%)
would let hundreds of thousands of dead rows pile up before a vacuum: 2% there.
SQLite has no such settings: nothing to do. docs/deploy.md, "PostgreSQL settings".

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

HOT = ("nodes", "controllers", "leases")
HOT_SETTINGS = {
    "fillfactor": "50",
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "500",
    "autovacuum_analyze_scale_factor": "0",
    "autovacuum_analyze_threshold": "500",
}
BIG = ("jobs", "attempts", "tasks")
BIG_SETTINGS = {"autovacuum_vacuum_scale_factor": "0.02", "autovacuum_analyze_scale_factor": "0.02"}


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if not _postgresql():
        return
    for tables, settings in ((HOT, HOT_SETTINGS), (BIG, BIG_SETTINGS)):
        values = ", ".join(f"{k} = {v}" for k, v in settings.items())
        for table in tables:
            op.execute(f"ALTER TABLE {table} SET ({values})")


def downgrade() -> None:
    if not _postgresql():
        return
    for tables, settings in ((HOT, HOT_SETTINGS), (BIG, BIG_SETTINGS)):
        for table in tables:
            op.execute(f"ALTER TABLE {table} RESET ({', '.join(settings)})")
