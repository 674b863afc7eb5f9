"""jobs metrics index: /metrics counts jobs by state, partition and user from an index alone

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_state_partitions_user", "jobs", ["state", "partitions", "user"])


def downgrade() -> None:
    op.drop_index("ix_jobs_state_partitions_user", table_name="jobs")
