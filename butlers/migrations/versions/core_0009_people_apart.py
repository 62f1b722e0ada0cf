"""People apart from the owner (a red team's findings):

- sessions.person: the person (not the owner) whose message started a session, or planted
  the schedule it runs; NULL for the owner's. People's scheduled runs have a share of the
  hourly cap of their own, so theirs cannot use up the owner's (`run_due_tasks`).
- memories the operator, a schedule or `trigger` kept are the owner's own unless tagged
  `shared`: they were shared unless tagged `private`, so every person's session was handed
  the owner's facts ("passport number ...") with its prompt. Those kept before are made
  private here, unless tagged `shared`.

Revision ID: core_0009
Revises: core_0008
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0009"
down_revision = "core_0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("person", sa.Text))
    op.execute(
        "UPDATE memories SET private = true "
        "WHERE person = '' AND NOT private AND NOT ('shared' = ANY(tags))"
    )


def downgrade() -> None:
    op.drop_column("sessions", "person")
