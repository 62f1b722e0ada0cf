"""An index on the trace id of an approval's session (the expression
butlers.switchboard.queries.TRACE_OF_CONTEXT reads from its trace context): a message's
approvals were found by a scan of every approval, on each `inbox_list` call and message
page (36 ms at 3000 approvals: a year of data's walkthrough).

Revision ID: switchboard_0013
Revises: switchboard_0012
"""

from alembic import op

revision = "switchboard_0013"
down_revision = "switchboard_0012"
branch_labels = None
depends_on = None

# As the queries write it, character for character: the planner matches the expression.
TRACE_ID = "substring(trace_context->>'traceparent' FROM '^[0-9a-f]{2}-([0-9a-f]{32})-')"


def upgrade() -> None:
    op.execute(f"CREATE INDEX approvals_trace_id ON approvals (({TRACE_ID}))")


def downgrade() -> None:
    op.execute("DROP INDEX approvals_trace_id")
