"""jobs.held_by and jobs.hold_kind: who placed a job's hold, and whether its owner may release it

As in Slurm, a hold placed by an operator or admin (`scontrol hold`, `phalanx hold` by them,
`requeuehold` of someone else's job) is an admin hold that only an operator or admin may
release; a user's own hold (`phalanx hold`, `sbatch -H`, a requeuehold of their own job) is a
user hold they may release. `hold_kind` is 'user' or 'admin' while the job is HELD; NULL for a
hold placed before this revision, or by Phalanx itself (launch failures: the user fixes the
cause and releases the job), which the owner may release as before. Nullable columns only: a
controller of the previous release keeps running beside this one (it neither sets nor reads
them, so a hold it places is a user hold).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("held_by", sa.String(128), nullable=True))
    op.add_column("jobs", sa.Column("hold_kind", sa.String(8), nullable=True))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN, on SQLite too (3.35+): a batch would copy the jobs table,
    # and dropping the old one fails on the foreign keys that point at it
    op.drop_column("jobs", "hold_kind")
    op.drop_column("jobs", "held_by")
