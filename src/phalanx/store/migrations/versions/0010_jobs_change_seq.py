"""jobs change sequence: every insert and update of a job row stamps `change_seq`, so the
scheduling loop reads only the pending jobs changed since its last pass (store/pending.py)
instead of re-reading the whole queue each second

SQLite: a counter, the largest stamp plus one, set by AFTER triggers (SQLite cannot change
the row in a BEFORE trigger); its writers take turns, so stamps grow in commit order.
PostgreSQL: the writing transaction's id (`pg_current_xact_id()`, 64-bit, never wraps), set
by a BEFORE trigger; transactions commit out of id order, and the reader allows for that
with the oldest transaction still running (store/pending.py).

Rows written before this revision have no stamp; the reader's first read of each run is a
whole read, which covers them, and any later change stamps them.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_SQLITE_NEXT = "(SELECT COALESCE(MAX(change_seq), 0) + 1 FROM jobs)"

SQLITE_TRIGGERS = (
    f"""CREATE TRIGGER jobs_change_seq_insert AFTER INSERT ON jobs
BEGIN
    UPDATE jobs SET change_seq = {_SQLITE_NEXT} WHERE id = NEW.id;
END""",
    # the WHEN keeps the trigger's own UPDATE from firing it again (recursive triggers are
    # off by default in SQLite; this holds even where they are on)
    f"""CREATE TRIGGER jobs_change_seq_update AFTER UPDATE ON jobs
WHEN NEW.change_seq IS OLD.change_seq
BEGIN
    UPDATE jobs SET change_seq = {_SQLITE_NEXT} WHERE id = NEW.id;
END""",
)

POSTGRES_FUNCTION = """CREATE OR REPLACE FUNCTION phalanx_jobs_change_seq() RETURNS trigger AS $$
BEGIN
    NEW.change_seq := pg_current_xact_id()::text::bigint;
    RETURN NEW;
END
$$ LANGUAGE plpgsql"""

POSTGRES_TRIGGER = """CREATE TRIGGER jobs_change_seq BEFORE INSERT OR UPDATE ON jobs
FOR EACH ROW EXECUTE FUNCTION phalanx_jobs_change_seq()"""


def upgrade() -> None:
    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("change_seq", sa.BigInteger(), nullable=True))
    op.create_index("ix_jobs_change_seq", "jobs", ["change_seq"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)
    else:
        for ddl in SQLITE_TRIGGERS:
            op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS jobs_change_seq ON jobs")
        op.execute("DROP FUNCTION IF EXISTS phalanx_jobs_change_seq()")
    else:
        op.execute("DROP TRIGGER IF EXISTS jobs_change_seq_insert")
        op.execute("DROP TRIGGER IF EXISTS jobs_change_seq_update")
    op.drop_index("ix_jobs_change_seq", table_name="jobs")
    with op.batch_alter_table("jobs") as b:
        b.drop_column("change_seq")
