"""controllers.flushed_through: the time through which a controller's heartbeats are stored

Each controller's heartbeat flush stamps, in the same transaction, the database time through
which every heartbeat it answered is in the store; the failure detector counts a node's
silence only up to the earliest such mark of the live controllers (domain/detector.py,
`heard_horizon`). Nullable: a controller of the previous release writes no mark and holds no
one back.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("controllers", sa.Column("flushed_through", sa.Float, nullable=True))


def downgrade() -> None:
    op.drop_column("controllers", "flushed_through")
