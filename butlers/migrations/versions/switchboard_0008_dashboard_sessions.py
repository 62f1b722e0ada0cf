"""Dashboard sessions that were signed out: a cookie is stateless (an id, when it was issued,
and an HMAC of both under a key derived from BUTLERS_AUTH_TOKEN), so ending one before it
expires needs a record that every switchboard process sharing this database reads, and that
survives a restart. A row is kept until the cookie would have expired anyway.

Revision ID: switchboard_0008
Revises: switchboard_0007
"""

import sqlalchemy as sa
from alembic import op

revision = "switchboard_0008"
down_revision = "switchboard_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dashboard_signed_out",
        sa.Column("session_id", sa.Text, primary_key=True),
        sa.Column("expires_at", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column(
            "signed_out_at",
            sa.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
    )
    op.create_index("dashboard_signed_out_expires", "dashboard_signed_out", ["expires_at"])


def downgrade() -> None:
    op.drop_index("dashboard_signed_out_expires", table_name="dashboard_signed_out")
    op.drop_table("dashboard_signed_out")
