"""steps.usage: what a step's tasks used, from their exit records (sacct's step lines)

Each step task's shepherd reports the CPU time and the largest resident set of the processes
it waited for with the task's exit; the step's end folds them (domain/steps.py `step_usage`)
so that `sacct -j N` prints MaxRSS and TotalCPU on the `N.0` lines as Slurm does. Nullable:
steps that ended before this release, or with their attempt (no exit records), have none.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("steps", sa.Column("usage", sa.JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("steps", "usage")
