"""node topology: the place in the network/power tree an agent reports at register
(`phalanx agent --topology switch=s1,rack=r1`); the config's [topology] rules win over it

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as b:
        b.add_column(sa.Column("topology", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as b:
        b.drop_column("topology")
