"""Attachments: the files a message carries, and the files a reply or notification sends.

`inbox_attachments` holds each file of an inbox message (a voice note, a photo, a PDF, a text
file) as the channel downloaded and checked it (butlers.media.checked), written in the same
transaction as its message: a retry or a resume after a crash reads the same bytes, and a
message refused for its files stores nothing. `position` keeps the sender's order; `sha256`
says which bytes they were (the dashboard, an operator comparing copies). The rows go with
their message (ON DELETE CASCADE): pruning the inbox prunes them.

`inbox.not_before`: a message put back in the queue for a while (its voice note's
transcription service is down) is not claimed before then; the later messages of its
conversation wait behind it, in order.

`outbox_attachments` holds the files of an outbox row (a butler sending a photo or a document
back), written with the row and pruned with it.

Revision ID: switchboard_0011
Revises: switchboard_0010
"""

import sqlalchemy as sa
from alembic import op

revision = "switchboard_0011"
down_revision = "switchboard_0010"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "inbox_attachments",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column(
            "inbox_id",
            sa.BigInteger,
            sa.ForeignKey("inbox.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("name", sa.Text, nullable=False),  # the sender's, cleaned: shown, never a path
        sa.Column("mime_type", sa.Text, nullable=False),  # read from the bytes
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("sha256", sa.Text, nullable=False),  # hex
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
    )
    # A message's files in order; also what the cascade from inbox looks them up by.
    op.create_index(
        "inbox_attachments_message", "inbox_attachments", ["inbox_id", "position"], unique=True
    )
    op.add_column("inbox", sa.Column("not_before", sa.TIMESTAMP(timezone=True)))
    op.create_table(
        "outbox_attachments",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column(
            "outbox_id",
            sa.BigInteger,
            sa.ForeignKey("outbox.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("mime_type", sa.Text, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_index(
        "outbox_attachments_row", "outbox_attachments", ["outbox_id", "position"], unique=True
    )


def downgrade() -> None:
    op.drop_table("outbox_attachments")
    op.drop_column("inbox", "not_before")
    op.drop_table("inbox_attachments")
