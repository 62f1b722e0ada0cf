"""Approvals: a session's call that waits for the owner's yes (`[approvals] tools`, a tool
server's `approval` globs). The row holds the exact call (butler, tool, arguments), who asked
(session, conversation, trace), and its fate: pending -> approved -> done | failed, or denied,
or expired. `claimed_at` is set, once, when the butler takes the approved call to run it: a
second press, a second replica or a retry after a restart find it taken and run nothing.

`approval_keys` holds the secret the switchboard signs its Telegram buttons with (created on
first use, one per database: every replica signs and checks alike).

Revision ID: switchboard_0009
Revises: switchboard_0008
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "switchboard_0009"
down_revision = "switchboard_0008"
branch_labels = None
depends_on = None

NOW = sa.text("now()")
STATUSES = "('pending', 'approved', 'denied', 'expired', 'done', 'failed')"


def upgrade() -> None:
    op.create_table(
        "approvals",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("butler", sa.Text, nullable=False),
        sa.Column("tool", sa.Text, nullable=False),
        sa.Column("arguments", JSONB, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("requested_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        sa.Column("expires_at", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("decided_at", sa.TIMESTAMP(timezone=True)),
        sa.Column("decided_by", sa.Text),
        sa.Column("claimed_at", sa.TIMESTAMP(timezone=True)),  # the butler took it to run
        sa.Column("finished_at", sa.TIMESTAMP(timezone=True)),
        sa.Column("result", sa.Text),
        sa.Column("conversation", sa.Text),  # whom the session was answering (None: the owner)
        sa.Column("session_id", sa.Text),  # the butler's sessions row that asked
        sa.Column("trace_context", JSONB),  # the asking session's trace: decisions join it
        sa.Column("asked", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.CheckConstraint(f"status IN {STATUSES}", name="approvals_status"),
    )
    op.create_index("approvals_status_id", "approvals", ["status", "id"])
    op.create_table(
        "approval_keys",
        sa.Column("id", sa.SmallInteger, primary_key=True),
        sa.Column("secret", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
    )
    # The owner's question goes through the outbox like any message, as its own kind.
    op.drop_constraint("outbox_kind", "outbox", type_="check")
    op.create_check_constraint(
        "outbox_kind", "outbox", "kind IN ('reply', 'notification', 'approval')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM outbox WHERE kind = 'approval'")
    op.drop_constraint("outbox_kind", "outbox", type_="check")
    op.create_check_constraint("outbox_kind", "outbox", "kind IN ('reply', 'notification')")
    op.drop_table("approval_keys")
    op.drop_index("approvals_status_id", table_name="approvals")
    op.drop_table("approvals")
