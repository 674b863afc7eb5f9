"""fair share: jobs' account, QOS and nice; attempts' charging marks; usage per association

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("account", sa.String(64), nullable=True))
        b.add_column(sa.Column("qos", sa.String(64), nullable=True))
        b.add_column(sa.Column("nice", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("attempts") as b:
        b.add_column(sa.Column("charged_until", sa.Float(), nullable=True))
        b.add_column(sa.Column("uncharged", sa.Boolean(), nullable=False, server_default=sa.true()))
    # jobs still to run or running keep the account and QOS they named (kept in their spec)
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.Integer()),
        sa.column("state", sa.String()),
        sa.column("spec", sa.JSON()),
        sa.column("account", sa.String()),
        sa.column("qos", sa.String()),
    )
    bind = op.get_bind()
    live = ("PENDING", "HELD", "STARTING", "RUNNING", "COMPLETING")
    named = [
        (r.id, r.spec.get("account"), r.spec.get("qos"))
        for r in bind.execute(sa.select(jobs.c.id, jobs.c.spec).where(jobs.c.state.in_(live)))
        if isinstance(r.spec, dict) and (r.spec.get("account") or r.spec.get("qos"))
    ]
    for jid, account, qos in named:
        bind.execute(sa.update(jobs).where(jobs.c.id == jid).values(account=account, qos=qos))
    # attempts that ended before fair share existed are not charged: nothing is owed for them
    op.execute(sa.text("UPDATE attempts SET uncharged = false WHERE state = 'ENDED'"))
    op.create_index("ix_attempts_uncharged", "attempts", ["uncharged"])
    op.create_table(
        "assoc_usage",
        sa.Column("account", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(128), primary_key=True),
        sa.Column("usage", sa.Float(), nullable=False),
        sa.Column("decayed_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("assoc_usage")
    op.drop_index("ix_attempts_uncharged", "attempts")
    with op.batch_alter_table("attempts") as b:
        b.drop_column("uncharged")
        b.drop_column("charged_until")
    with op.batch_alter_table("jobs") as b:
        b.drop_column("nice")
        b.drop_column("qos")
        b.drop_column("account")
