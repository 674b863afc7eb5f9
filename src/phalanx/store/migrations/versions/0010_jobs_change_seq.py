"""jobs change sequence: every insert and update of a job row stamps `change_seq`, so the
scheduling loop reads only the pending jobs changed since its last pass (store/pending.py)
instead of re-reading the whole queue each second

SQLite: a counter that only grows (`job_change_counter`, one row), set by AFTER triggers
(SQLite cannot change the row in a BEFORE trigger); its writers take turns, so stamps grow in
commit order. (Not the largest stamp plus one: after the row holding the largest was purged,
that would repeat a stamp below a mark the scheduler already read past.)
PostgreSQL: the writing transaction's id (`pg_current_xact_id()`, 64-bit, never wraps), set
by a BEFORE trigger; transactions commit out of id order, and the reader allows for that
with the oldest transaction still running (store/pending.py).

The state index becomes (state, id): the reader's whole read walks the pending rows in id
order, a chunk a statement.

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

_SQLITE_STAMP = """
    UPDATE job_change_counter SET seq = seq + 1 WHERE id = 1;
    UPDATE jobs SET change_seq = (SELECT seq FROM job_change_counter WHERE id = 1)
    WHERE id = NEW.id;"""

SQLITE_TRIGGERS = (
    f"""CREATE TRIGGER jobs_change_seq_insert AFTER INSERT ON jobs
BEGIN{_SQLITE_STAMP}
END""",
    # the WHEN keeps the trigger's own UPDATE from firing it again (recursive triggers are
    # off by default in SQLite; this holds even where they are on)
    f"""CREATE TRIGGER jobs_change_seq_update AFTER UPDATE ON jobs
WHEN NEW.change_seq IS OLD.change_seq
BEGIN{_SQLITE_STAMP}
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
    op.drop_index("ix_jobs_state", table_name="jobs")
    op.create_index("ix_jobs_state", "jobs", ["state", "id"])
    counter = op.create_table(
        "job_change_counter",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)
    else:
        op.bulk_insert(counter, [{"id": 1, "seq": 0}])
        for ddl in SQLITE_TRIGGERS:
            op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS jobs_change_seq ON jobs")
        op.execute("DROP FUNCTION IF EXISTS phalanx_jobs_change_seq()")
    else:
        op.execute("DROP TRIGGER IF EXISTS jobs_change_seq_insert")
        op.execute("DROP TRIGGER IF EXISTS jobs_change_seq_update")
    op.drop_table("job_change_counter")
    op.drop_index("ix_jobs_change_seq", table_name="jobs")
    op.drop_index("ix_jobs_state", table_name="jobs")
    op.create_index("ix_jobs_state", "jobs", ["state"])
    with op.batch_alter_table("jobs") as b:
        b.drop_column("change_seq")
