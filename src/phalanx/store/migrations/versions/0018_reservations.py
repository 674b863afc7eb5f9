"""reservations: nodes set aside for some users or accounts (`scontrol create reservation`)

One row per reservation (domain/reservations.py): its nodes, its window, who may use it and
its flags. Only jobs that ask for it (`--reservation`) run on its nodes while it lasts; others
are kept off them, also before it when their time limit would run into it. A deleted
reservation's row is deleted (its `resv.*` events stay); an ended one is ignored.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "reservations",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("nodes_expr", sa.String(length=1024), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("start", sa.Float(), nullable=False),
        sa.Column("end", sa.Float(), nullable=False),
        sa.Column("users", sa.JSON(), nullable=False),
        sa.Column("accounts", sa.JSON(), nullable=False),
        sa.Column("flags", sa.JSON(), nullable=False),
        sa.Column("partition", sa.String(length=128), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("reservations")
