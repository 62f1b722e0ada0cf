"""What `route` needs to know of a registry row beyond the spec's six columns.

`is_switchboard`: the butler had a [switchboard] table when discover last saw it. Rows are
never deleted, so after the switchboard's directory is renamed its old name still points at
the switchboard itself; route refuses such a row whatever it is called now.

`missing_since`: when discover first found the butler's directory gone (NULL: it was there
at the last discover). A stale butler is not routed to until a discover sees it again.

Revision ID: switchboard_0007
Revises: switchboard_0006
"""

import sqlalchemy as sa
from alembic import op

revision = "switchboard_0007"
down_revision = "switchboard_0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "butler_registry",
        sa.Column("is_switchboard", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column(
        "butler_registry", sa.Column("missing_since", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("butler_registry", "missing_since")
    op.drop_column("butler_registry", "is_switchboard")
