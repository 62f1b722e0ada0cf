"""When the owner was last told that a flood limit stopped this butler (the hourly cap on
scheduled runs, the daily spend cap): one row per kind and window, so that the owner is told
once per window however many runs or sessions the limit refuses, whichever process (or
replica, or restart) refuses them.

Revision ID: core_0003
Revises: core_0002
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0003"
down_revision = "core_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "limit_notices",
        sa.Column("kind", sa.Text, primary_key=True),
        sa.Column("window_start", sa.TIMESTAMP(timezone=True), primary_key=True),
        sa.Column(
            "noticed_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )


def downgrade() -> None:
    op.drop_table("limit_notices")
