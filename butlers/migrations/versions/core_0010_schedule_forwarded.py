"""scheduled_tasks.forwarded_from: a schedule planted by a session acting on a message the
owner forwarded (the author's name). Its runs act on those words as that session did: not
the owner's own (what they keep is not the owner's, they delete only what such sessions
planted). Without it the forward's mark was lost once it planted a reminder (a review).

Revision ID: core_0010
Revises: core_0009
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0010"
down_revision = "core_0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("scheduled_tasks", sa.Column("forwarded_from", sa.Text))


def downgrade() -> None:
    op.drop_column("scheduled_tasks", "forwarded_from")
