"""approvals.forwarded_from: whose words the asking session acted on, when its message was
forwarded (the author's name as the channel gave it). The owner's question said "answering
your own message" of a stranger's words the owner had forwarded (a red team).

Revision ID: switchboard_0012
Revises: switchboard_0011
"""

import sqlalchemy as sa
from alembic import op

revision = "switchboard_0012"
down_revision = "switchboard_0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("approvals", sa.Column("forwarded_from", sa.Text))


def downgrade() -> None:
    op.drop_column("approvals", "forwarded_from")
