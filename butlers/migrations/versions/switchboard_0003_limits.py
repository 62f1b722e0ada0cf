"""Limits: a message over its sender's hourly limit is stored but `skipped` (not classified);
an index to count a sender's recent messages, and one to find finished rows to delete.

Revision ID: switchboard_0003
Revises: switchboard_0002
"""

import sqlalchemy as sa
from alembic import op

revision = "switchboard_0003"
down_revision = "switchboard_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_constraint("inbox_status", "inbox", type_="check")
    op.create_check_constraint(
        "inbox_status", "inbox", "status IN ('queued', 'processing', 'done', 'failed', 'skipped')"
    )
    op.create_index("inbox_sender_received", "inbox", ["channel", "source_id", "received_at"])
    op.create_index(
        "inbox_finished_at",
        "inbox",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("inbox_finished_at", "inbox")
    op.drop_index("inbox_sender_received", "inbox")
    op.execute("UPDATE inbox SET status = 'failed' WHERE status = 'skipped'")
    op.drop_constraint("inbox_status", "inbox", type_="check")
    op.create_check_constraint(
        "inbox_status", "inbox", "status IN ('queued', 'processing', 'done', 'failed')"
    )
