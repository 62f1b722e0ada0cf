"""Core tables every butler has: state, scheduled_tasks, sessions.

Revision ID: core_0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "core_0001"
down_revision = None
branch_labels = ("core",)
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "state",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("value", JSONB, nullable=False),
        sa.Column("updated_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_table(
        "scheduled_tasks",
        sa.Column("id", UUID, primary_key=True, server_default=sa.text("gen_random_uuid()")),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("cron", sa.Text, nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("next_run_at", sa.TIMESTAMP(timezone=True)),
        sa.Column("last_run_at", sa.TIMESTAMP(timezone=True)),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_index(
        "scheduled_tasks_due",
        "scheduled_tasks",
        ["next_run_at"],
        postgresql_where=sa.text("enabled"),
    )
    op.create_table(
        "sessions",
        sa.Column("id", UUID, primary_key=True, server_default=sa.text("gen_random_uuid()")),
        sa.Column("trigger_source", sa.Text, nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("result", sa.Text),
        sa.Column("success", sa.Boolean),
        sa.Column("error", sa.Text),
        sa.Column("tool_calls", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("duration_ms", sa.Integer),
        sa.Column("trace_id", sa.Text),
        sa.Column("started_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("finished_at", sa.TIMESTAMP(timezone=True)),
    )
    op.create_index("sessions_started_at", "sessions", [sa.text("started_at DESC")])


def downgrade() -> None:
    op.drop_table("sessions")
    op.drop_table("scheduled_tasks")
    op.drop_table("state")
