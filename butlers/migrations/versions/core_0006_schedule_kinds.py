"""Schedules that run once (`at`: no cron, deleted after their run) and schedules declared in
butler.toml (`[[schedules]]`: created, updated and removed at start; those tools made are
left alone).

Revision ID: core_0006
Revises: core_0005
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0006"
down_revision = "core_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.alter_column("scheduled_tasks", "cron", nullable=True)
    op.add_column(
        "scheduled_tasks",
        sa.Column("once", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.add_column(
        "scheduled_tasks",
        sa.Column("declared", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_check_constraint(
        "scheduled_tasks_cron_or_once", "scheduled_tasks", "(cron IS NULL) = once"
    )


def downgrade() -> None:
    op.execute("DELETE FROM scheduled_tasks WHERE once")
    op.drop_constraint("scheduled_tasks_cron_or_once", "scheduled_tasks")
    op.drop_column("scheduled_tasks", "declared")
    op.drop_column("scheduled_tasks", "once")
    op.alter_column("scheduled_tasks", "cron", nullable=False)
