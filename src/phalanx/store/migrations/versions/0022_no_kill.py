"""attempts.membership and rendezvous: recovery inside the allocation (--no-kill)

`attempts.membership` records the node changes of a running attempt of a --no-kill job (a
node left, a spare joined; docs/elastic.md): null until the first. `rendezvous` holds the
torchrun rendezvous the controllers host (store/rendezvous.py): torch's rendezvous state with
its compare-and-set version, its members' nodes and the round's key-value store, per job
attempt and rendezvous id.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("attempts", sa.Column("membership", sa.JSON(), nullable=True))
    op.create_table(
        "rendezvous",
        sa.Column("job_id", _ID, autoincrement=False, nullable=False),
        sa.Column("attempt_id", _ID, autoincrement=False, nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("value", sa.LargeBinary(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "attempt_id", "run_id", "key"),
    )


def downgrade() -> None:
    op.drop_table("rendezvous")
    op.drop_column("attempts", "membership")
