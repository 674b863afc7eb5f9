"""accounts: accounts, user associations and QOS at run time (`sacctmgr`)

The fair share tree and its limits move from the configuration file into the store, so an
administrator changes them with `sacctmgr` and every controller sees the change within one
loop. Empty here: on a store without `acct_meta`'s row a controller imports its configuration
file's `[fairshare]` once (controller/fairshare.py); from then on the tables are the source.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def _limits() -> list[sa.Column[int]]:
    return [
        sa.Column("max_running_jobs", sa.Integer(), nullable=True),
        sa.Column("max_submit_jobs", sa.Integer(), nullable=True),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.Column("max_wall_s", sa.Integer(), nullable=True),
    ]


def _stamps() -> list[sa.Column[object]]:
    return [
        sa.Column("updated_by", sa.String(length=128), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "acct_accounts",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("parent", sa.String(length=64), nullable=False),
        sa.Column("shares", sa.Integer(), nullable=False),
        sa.Column("description", sa.String(length=256), nullable=False),
        sa.Column("organization", sa.String(length=256), nullable=False),
        *_limits(),
        *_stamps(),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "acct_users",
        sa.Column("account", sa.String(length=64), nullable=False),
        sa.Column("user", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("shares", sa.Integer(), nullable=False),
        sa.Column("default", sa.Boolean(), nullable=False),
        *_limits(),
        *_stamps(),
        sa.PrimaryKeyConstraint("account", "user"),
    )
    op.create_table(
        "acct_qos",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("description", sa.String(length=256), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("priority_tier", sa.Integer(), nullable=True),
        sa.Column("preempt_mode", sa.String(length=16), nullable=True),
        *_limits(),
        *_stamps(),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "acct_meta",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("declared", sa.Boolean(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("imported_by", sa.String(length=128), nullable=False),
        sa.Column("imported_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    for table in ("acct_meta", "acct_qos", "acct_users", "acct_accounts"):
        op.drop_table(table)
