"""Switchboard tables: butler_registry and routing_log (applied after core, switchboard only).

Revision ID: switchboard_0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "switchboard_0001"
down_revision = None
branch_labels = ("switchboard",)
depends_on = "core_0001"

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "butler_registry",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("endpoint_url", sa.Text, nullable=False),
        sa.Column("description", sa.Text),
        sa.Column("modules", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("last_seen_at", sa.TIMESTAMP(timezone=True)),
        sa.Column("registered_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_table(
        "routing_log",
        sa.Column("id", UUID, primary_key=True, server_default=sa.text("gen_random_uuid()")),
        sa.Column("source_channel", sa.Text, nullable=False),
        sa.Column("source_id", sa.Text),
        sa.Column("routed_to", sa.Text, nullable=False),
        sa.Column("prompt_summary", sa.Text),
        sa.Column("trace_id", sa.Text),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("tool_name", sa.Text),
        sa.Column("success", sa.Boolean),
        sa.Column("error", sa.Text),
        sa.Column("duration_ms", sa.Integer),
    )
    op.create_index("routing_log_created_at", "routing_log", [sa.text("created_at DESC")])
    op.create_index("routing_log_trace_id", "routing_log", ["trace_id"])


def downgrade() -> None:
    op.drop_table("routing_log")
    op.drop_table("butler_registry")
