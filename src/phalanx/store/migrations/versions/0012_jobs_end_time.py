"""An index on jobs.end_time: the accounting purge finds what is old enough by it

`Store.purge_finished` (the cluster duty, every purge interval) asks for the jobs that ended
before the retention's cut-off. By the state index it read every finished job's row to look
at its end time and sorted them all, to find, most of the time, none: a cost that grew with
the whole history kept (30 days by default). Measured in a 30-minute placements run
(`bench/sim.py`, 250,000 jobs): the purge went from 0.3% to 5.9% of the controller's busy
time, most of it reading pages. By this index the query reads the old-enough range only, in
the order it purges (oldest end first).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_end_time", "jobs", ["end_time"])


def downgrade() -> None:
    op.drop_index("ix_jobs_end_time", table_name="jobs")
