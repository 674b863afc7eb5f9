"""tasks.held: true until the task's attempt ends, with an index on (node, held)

A heartbeat reads its node's tasks whose attempt still holds resources (`Store.node_work`,
and `Store.apply_reports` when it writes). By the node alone that walked every task the node
had ever run, each joined to its attempt to find the few not ENDED: the cost of every
heartbeat grew with the node's history (measured: `bench/sim.py placements` fell from 225
to 50 jobs/s within two minutes, a tenth of the controller's time in that query). The
attempt's end clears the flag on its tasks (`Store._advance_attempt`, the one place an
attempt ends), so the index range holds the node's live tasks only.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tasks") as b:
        b.add_column(sa.Column("held", sa.Boolean(), nullable=False, server_default=sa.true()))
    op.execute(
        "UPDATE tasks SET held = false WHERE attempt_id IN "
        "(SELECT id FROM attempts WHERE state = 'ENDED')"
        if op.get_bind().dialect.name == "postgresql"
        else "UPDATE tasks SET held = 0 WHERE attempt_id IN "
        "(SELECT id FROM attempts WHERE state = 'ENDED')"
    )
    op.create_index("ix_tasks_node_held", "tasks", ["node", "held"])


def downgrade() -> None:
    op.drop_index("ix_tasks_node_held", table_name="tasks")
    with op.batch_alter_table("tasks") as b:
        b.drop_column("held")
