"""An index on a butler's notifications by time: each `notify` counts its butler's last hour
(OUTBOX_NOTIFICATIONS_LAST_HOUR, the hourly cap), which scanned the whole outbox (58,000 rows
after a year of replies: a walkthrough). Partial: notifications are a tenth of the rows.

Revision ID: switchboard_0014
Revises: switchboard_0013
"""

from alembic import op

revision = "switchboard_0014"
down_revision = "switchboard_0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX outbox_notifications ON outbox (butler, created_at) "
        "WHERE kind = 'notification'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX outbox_notifications")
