"""What the dashboard shows of sessions: what each cost, by Claude Code's own figure
(`total_cost_usd` of its result; NULL when the run reported none, having failed before a
result), and the sessions of one trace (a message's page finds each butler's by trace id).

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
    op.create_index(
        "sessions_trace_id",
        "sessions",
        ["trace_id"],
        postgresql_where=sa.text("trace_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("sessions_trace_id", table_name="sessions")
    op.drop_column("sessions", "cost_usd")
