"""What a session cost: Claude Code's own figure (`total_cost_usd` of its result), for the
operator's view of spend; NULL when the run reported none (it failed before a result).

Revision ID: core_0002
Revises: core_0001
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0002"
down_revision = "core_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("cost_usd", sa.Float))


def downgrade() -> None:
    op.drop_column("sessions", "cost_usd")
