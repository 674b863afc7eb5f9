"""nodes.steps_at: where the node's agent takes direct step launches and usage requests

An agent tells every heartbeat's controller the host:port of its step listener
(agent/step_listener.py), and that controller keeps it in memory; with several controllers,
one that the node does not heartbeat had no way to reach the agent. The agent now also gives
it at registration, and the store keeps it, so that any controller can ask a node for the
live usage of a job's tasks (`sstat`, controller/taskusage.py). Nullable: agents of the
previous release, and agents that take no direct launches, give none.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("steps_at", sa.String(300), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "steps_at")
