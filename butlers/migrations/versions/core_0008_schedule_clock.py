"""The time zone the recurring schedules' next runs were reckoned in (`schedule_clock`, one
row): a butler started with another zone (its `timezone`, or the owner's, changed) moves
them to its new wall clock. Without it `0 8 * * *` kept firing at 08:00 of the old zone
until its next run had passed.

Revision ID: core_0008
Revises: core_0007
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0008"
down_revision = "core_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedule_clock",
        sa.Column("id", sa.Integer, primary_key=True, server_default=sa.text("1")),
        sa.Column("zone", sa.Text, nullable=False),
        sa.CheckConstraint("id = 1", name="schedule_clock_one_row"),
    )


def downgrade() -> None:
    op.drop_table("schedule_clock")
