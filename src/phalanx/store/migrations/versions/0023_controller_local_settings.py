"""controllers.local_settings: the process-local settings a controller's rules read

What each controller's own file sets of the values that the configuration's rules read across
sections (`timing.db_op_timeout`, `[watchdog]`: config/versioned.py, `local_part`), as JSON,
written when it registers. `phalanx config apply` holds a new version to every live
controller's rules with them, not only the serving controller's (controller/confversions.py).
NULL: a controller of a release before it (not checked; the apply says so).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("controllers", sa.Column("local_settings", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("controllers", "local_settings")
