"""scheduled_tasks.due_at: when a one-time reminder was asked for. Its `next_run_at` moves
when a run is retried (a failed session, the hourly cap, a claim lost with its process), and
its session was then told nothing of being late, nor of when it had been due (a
walkthrough). NULL for recurring schedules, and for reminders made before it (their
`next_run_at` stands in).

Revision ID: core_0011
Revises: core_0010
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0011"
down_revision = "core_0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("scheduled_tasks", sa.Column("due_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("scheduled_tasks", "due_at")
