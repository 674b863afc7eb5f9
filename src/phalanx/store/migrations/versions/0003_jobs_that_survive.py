"""jobs that survive: retry budget, fast-restart reservations, checkpoints, progress, spares,
maintenance windows

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("retries", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("reserved_nodes", sa.JSON(), nullable=True))
        b.add_column(sa.Column("reserved_until", sa.Float(), nullable=True))
        b.add_column(sa.Column("checkpoint", sa.JSON(), nullable=True))
    with op.batch_alter_table("attempts") as b:
        b.add_column(sa.Column("progress", sa.JSON(), nullable=True))
    with op.batch_alter_table("tasks") as b:
        b.add_column(sa.Column("spare", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        "maintenance",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("nodes_expr", sa.String(length=1024), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("start", sa.Float(), nullable=False),
        sa.Column("end", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("maintenance") as b:
        b.create_index("ix_maintenance_state", ["state"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("maintenance") as b:
        b.drop_index("ix_maintenance_state")
    op.drop_table("maintenance")
    with op.batch_alter_table("tasks") as b:
        b.drop_column("spare")
    with op.batch_alter_table("attempts") as b:
        b.drop_column("progress")
    with op.batch_alter_table("jobs") as b:
        b.drop_column("checkpoint")
        b.drop_column("reserved_until")
        b.drop_column("reserved_nodes")
        b.drop_column("retries")
