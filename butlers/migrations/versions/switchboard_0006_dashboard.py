"""The dashboard's filters, each an index scan newest first however many rows there are:
the inbox by status or by channel, the routing log by butler or by outcome.

Revision ID: switchboard_0006
Revises: switchboard_0005
"""

from alembic import op

revision = "switchboard_0006"
down_revision = "switchboard_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("inbox_status_id", "inbox", ["status", "id"])
    op.create_index("inbox_channel_id", "inbox", ["channel", "id"])
    op.create_index("routing_log_routed_to_created", "routing_log", ["routed_to", "created_at"])
    op.create_index("routing_log_success_created", "routing_log", ["success", "created_at"])


def downgrade() -> None:
    op.drop_index("routing_log_success_created", table_name="routing_log")
    op.drop_index("routing_log_routed_to_created", table_name="routing_log")
    op.drop_index("inbox_channel_id", table_name="inbox")
    op.drop_index("inbox_status_id", table_name="inbox")
