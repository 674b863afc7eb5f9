"""reservations.phase and nodes.config_version

`reservations.phase`: how far the `cluster` duty has taken a reservation
(domain/reservations.py, `Phase`): `scheduled`, `active` (its `resv.start` event written),
`ended` (its `resv.end` event written; jobs still running in it are stopped at the end plus
`timing.reservation_overrun`), `closed` (ended, with no job of it left running). Each move is
a compare-and-set in a fenced write, so the events are written once whatever the number of
controllers. Reservations that had already ended when this migration ran are `closed`: their
end is not announced after the fact.

`nodes.config_version`: the cluster configuration version whose node settings the node's agent
last said it runs (heartbeats; `phalanx nodes`, `scontrol show node`).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "reservations",
        sa.Column("phase", sa.String(length=16), nullable=False, server_default="scheduled"),
    )
    resv = sa.table("reservations", sa.column("phase", sa.String), sa.column("end", sa.Float))
    op.execute(resv.update().where(resv.c.end <= time.time()).values(phase="closed"))
    op.add_column("nodes", sa.Column("config_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "config_version")
    op.drop_column("reservations", "phase")
