"""job steps: srun inside an allocation (steps, step_nodes)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "steps",
        sa.Column("attempt_id", Id, sa.ForeignKey("attempts.id"), primary_key=True),
        sa.Column("step_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("job_id", Id, sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("tasks", sa.JSON(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("signals", sa.JSON(), nullable=False),
        sa.Column("stop_reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("start_time", sa.Float(), nullable=True),
        sa.Column("end_time", sa.Float(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("exit_signal", sa.Integer(), nullable=True),
    )
    op.create_index("ix_steps_job", "steps", ["job_id"])
    op.create_table(
        "step_nodes",
        sa.Column("attempt_id", Id, primary_key=True),
        sa.Column("step_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("node", sa.String(128), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("exits", sa.JSON(), nullable=True),
    )
    op.create_index("ix_step_nodes_node_state", "step_nodes", ["node", "state"])


def downgrade() -> None:
    op.drop_index("ix_step_nodes_node_state", "step_nodes")
    op.drop_table("step_nodes")
    op.drop_index("ix_steps_job", "steps")
    op.drop_table("steps")
