"""Pairing: an unknown sender gets a one-time code the owner approves (`[switchboard.pairing]`).

`pairing_requests` holds each code given out: the channel and sender it was given to, the name
they showed (cleaned and cut), the code (shown to the owner) and its SHA-256 (what a decision
looks it up by), and its fate: pending -> approved | denied, or expired. At most one pending
code per sender; the newest row of a sender says when they were last answered (at most once an
hour). `paired_senders` is the allowlist the owner grew this way (the TOML allowlists still
count); `pairing_failures` the wrong codes of the last hour (their number is limited).

Revision ID: switchboard_0010
Revises: switchboard_0009
"""

import sqlalchemy as sa
from alembic import op

revision = "switchboard_0010"
down_revision = "switchboard_0009"
branch_labels = None
depends_on = None

NOW = sa.text("now()")
STATUSES = "('pending', 'approved', 'denied', 'expired')"


def upgrade() -> None:
    op.create_table(
        "pairing_requests",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("channel", sa.Text, nullable=False),
        sa.Column("sender", sa.Text, nullable=False),  # a chat id, an address (lower case)
        sa.Column("name", sa.Text, nullable=False, server_default=""),
        sa.Column("code", sa.Text, nullable=False),
        sa.Column("code_digest", sa.LargeBinary, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("expires_at", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("decided_at", sa.TIMESTAMP(timezone=True)),
        sa.Column("decided_by", sa.Text),
        sa.CheckConstraint(f"status IN {STATUSES}", name="pairing_requests_status"),
    )
    op.create_index("pairing_requests_code", "pairing_requests", ["code_digest"], unique=True)
    # One pending code per sender; its prefix counts a channel's pending codes (the cap).
    op.create_index(
        "pairing_requests_one_pending",
        "pairing_requests",
        ["channel", "sender"],
        unique=True,
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "pairing_requests_sender_newest",
        "pairing_requests",
        ["channel", "sender", sa.text("created_at DESC")],
    )
    op.create_table(
        "paired_senders",
        sa.Column("channel", sa.Text, primary_key=True),
        sa.Column("sender", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, nullable=False, server_default=""),
        sa.Column("approved_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("approved_by", sa.Text, nullable=False),
    )
    op.create_table(
        "pairing_failures",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("by", sa.Text),
    )
    op.create_index("pairing_failures_at", "pairing_failures", ["at"])
    # The code to the sender and the question to the owner go through the outbox.
    op.drop_constraint("outbox_kind", "outbox", type_="check")
    op.create_check_constraint(
        "outbox_kind", "outbox", "kind IN ('reply', 'notification', 'approval', 'pairing')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM outbox WHERE kind = 'pairing'")
    op.drop_constraint("outbox_kind", "outbox", type_="check")
    op.create_check_constraint(
        "outbox_kind", "outbox", "kind IN ('reply', 'notification', 'approval')"
    )
    op.drop_table("pairing_failures")
    op.drop_table("paired_senders")
    op.drop_table("pairing_requests")
