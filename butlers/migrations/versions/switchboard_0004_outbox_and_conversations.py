"""The durable outbox (every reply and notification until its channel has taken it) and
conversations (each inbox row's conversation key, and how it was classified).

Revision ID: switchboard_0004
Revises: switchboard_0003
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "switchboard_0004"
down_revision = "switchboard_0003"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    # telegram:<chat>[:<thread>] or email:<thread root Message-ID>; mcp: none.
    op.add_column("inbox", sa.Column("conversation", sa.Text))
    # triage | thread | claude | default | limit: how the message found its butler.
    op.add_column("inbox", sa.Column("classified_via", sa.Text))
    op.create_index("inbox_conversation", "inbox", ["conversation", "id"])
    op.create_index("routing_log_inbox", "routing_log", ["inbox_id"])  # a message's routes

    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),  # reply | notification
        sa.Column("inbox_id", sa.BigInteger),  # the message a reply answers
        sa.Column("butler", sa.Text),  # who answered or notified (affinity follows it)
        sa.Column("channel", sa.Text, nullable=False),  # telegram | email
        sa.Column("recipient", sa.Text, nullable=False),  # chat id, address
        sa.Column("conversation", sa.Text),
        sa.Column("text", sa.Text, nullable=False),
        # What the channel needs: subject, In-Reply-To/References, our Message-ID, the
        # Telegram message to reply to.
        sa.Column("meta", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column(
            "next_attempt_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW
        ),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("sent_at", sa.TIMESTAMP(timezone=True)),
        sa.Column("error", sa.Text),
        # The channel's own ids of what was sent (Telegram message ids, the mail's Message-ID):
        # a reply to one of them continues this conversation with `butler`.
        sa.Column("sent_ids", ARRAY(sa.Text), nullable=False, server_default=sa.text("'{}'")),
        sa.Column("trace_context", JSONB),
        sa.CheckConstraint(
            "status IN ('pending', 'sending', 'sent', 'failed')", name="outbox_status"
        ),
        sa.CheckConstraint("kind IN ('reply', 'notification')", name="outbox_kind"),
    )
    op.create_index(
        "outbox_due",
        "outbox",
        ["channel", "id"],
        postgresql_where=sa.text("status IN ('pending', 'sending')"),
    )
    op.create_index("outbox_recipient", "outbox", ["channel", "recipient", "id"])
    op.create_index("outbox_sent_ids", "outbox", ["sent_ids"], postgresql_using="gin")
    op.create_index("outbox_inbox", "outbox", ["inbox_id"])


def downgrade() -> None:
    op.drop_table("outbox")
    op.drop_index("routing_log_inbox", "routing_log")
    op.drop_index("inbox_conversation", "inbox")
    op.drop_column("inbox", "classified_via")
    op.drop_column("inbox", "conversation")
