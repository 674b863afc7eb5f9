"""failure handling: health, launch-failure counters, nodes a job should avoid

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as b:
        b.add_column(sa.Column("health", sa.JSON(), nullable=True))
        b.add_column(sa.Column("launch_failures", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("launch_failures", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("avoid_nodes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as b:
        b.drop_column("avoid_nodes")
        b.drop_column("launch_failures")
    with op.batch_alter_table("nodes") as b:
        b.drop_column("launch_failures")
        b.drop_column("health")
