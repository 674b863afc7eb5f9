"""job signals: the signals asked of a running attempt (scancel --signal), delivered by agents

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as b:
        b.add_column(sa.Column("signals", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as b:
        b.drop_column("signals")
