"""Which schedules a session started by a routed message created: their runs get that
session's restrictions too (butlers.session_policy), or a stranger's text could plant a
schedule whose unrestricted session reads everyone's sessions into `state` for the next
message to pick up.

Revision ID: core_0004
Revises: core_0003
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0004"
down_revision = "core_0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "scheduled_tasks",
        sa.Column("routed", sa.Boolean, nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("scheduled_tasks", "routed")
