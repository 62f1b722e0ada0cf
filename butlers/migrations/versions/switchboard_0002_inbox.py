"""The durable inbox: every message accepted from a channel, stored before it is acknowledged.

Revision ID: switchboard_0002
Revises: switchboard_0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "switchboard_0002"
down_revision = "switchboard_0001"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "inbox",
        # Arrival order is the processing order.
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
        sa.Column("channel", sa.Text, nullable=False),
        sa.Column("external_id", sa.Text, nullable=False),
        sa.Column("source_id", sa.Text),
        sa.Column("sender_name", sa.Text),
        sa.Column("subject", sa.Text),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("meta", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("received_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("status", sa.Text, nullable=False, server_default="queued"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("routed_to", sa.Text),
        sa.Column("reply", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("trace_context", JSONB),
        sa.Column("finished_at", sa.TIMESTAMP(timezone=True)),
        sa.UniqueConstraint("channel", "external_id", name="inbox_channel_external_id"),
        sa.CheckConstraint(
            "status IN ('queued', 'processing', 'done', 'failed')", name="inbox_status"
        ),
    )
    op.create_index(
        "inbox_pending",
        "inbox",
        ["id"],
        postgresql_where=sa.text("status IN ('queued', 'processing')"),
    )
    op.add_column("routing_log", sa.Column("inbox_id", sa.BigInteger))


def downgrade() -> None:
    op.drop_column("routing_log", "inbox_id")
    op.drop_table("inbox")
