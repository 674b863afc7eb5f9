"""task usage: what each task of an attempt used (CPU time, memory high-water mark, GPU samples),
reported by its agent with the task's exit, for `phalanx eff` and sacct's TotalCPU/MaxRSS

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tasks") as b:
        b.add_column(sa.Column("cpu_time_s", sa.Float(), nullable=True))
        b.add_column(sa.Column("max_rss_bytes", sa.BigInteger(), nullable=True))
        b.add_column(sa.Column("gpu_usage", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as b:
        b.drop_column("gpu_usage")
        b.drop_column("max_rss_bytes")
        b.drop_column("cpu_time_s")
