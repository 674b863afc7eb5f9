"""cluster_config: the cluster-wide configuration in the store, versioned

One row per version of the cluster-wide part of the configuration (config/versioned.py): its
document (JSON text), when, by whom and how it was made (create, apply, rollback), the version
it replaced and, for a rollback, the version it restores. The highest version is the one in
force; every controller reads it each loop and records the version it runs in its
`controllers` row (`config_version`), or why it cannot run it (`config_problem`).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cluster_config",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("document", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("source", sa.Integer(), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("version"),
    )
    op.add_column("controllers", sa.Column("config_version", sa.Integer(), nullable=True))
    op.add_column("controllers", sa.Column("config_problem", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("controllers", "config_problem")
    op.drop_column("controllers", "config_version")
    op.drop_table("cluster_config")
