"""Several switchboard processes on one database: leases on the messages being processed,
and notifications that wake the other processes.

A message being processed names the process that claimed it (`claimed_by`) and how long the
claim lasts (`lease_until`, renewed while it works); a message whose lease ran out is taken
over. PostgreSQL notifies `butlers_inbox` when a message is queued, `butlers_inbox_finished`
(payload: its id) when one is finished, and `butlers_outbox` (payload: the channel) when a
reply or notification is queued: triggers, so that whatever writes the row, every process
listening hears of it.

Revision ID: switchboard_0005
Revises: switchboard_0004
"""

import sqlalchemy as sa
from alembic import op

revision = "switchboard_0005"
down_revision = "switchboard_0004"
branch_labels = None
depends_on = None

# One statement each: the driver (asyncpg) prepares what it runs.
TRIGGERS = (
    """
CREATE FUNCTION butlers_inbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'queued' THEN
        PERFORM pg_notify('butlers_inbox', '');
    ELSIF NEW.status IN ('done', 'failed', 'skipped') THEN
        PERFORM pg_notify('butlers_inbox_finished', NEW.id::text);
    END IF;
    RETURN NULL;
END $$""",
    """CREATE TRIGGER inbox_notify AFTER INSERT OR UPDATE OF status ON inbox
    FOR EACH ROW EXECUTE FUNCTION butlers_inbox_notify()""",
    """
CREATE FUNCTION butlers_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('butlers_outbox', NEW.channel);
    RETURN NULL;
END $$""",
    """CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION butlers_outbox_notify()""",
)


def upgrade() -> None:
    op.add_column("inbox", sa.Column("claimed_by", sa.Text))
    op.add_column("inbox", sa.Column("lease_until", sa.TIMESTAMP(timezone=True)))
    # The claim looks for a conversation's pending messages.
    op.create_index(
        "inbox_conversation_pending",
        "inbox",
        ["conversation", "id"],
        postgresql_where=sa.text("status IN ('queued', 'processing')"),
    )
    for statement in TRIGGERS:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER outbox_notify ON outbox")
    op.execute("DROP FUNCTION butlers_outbox_notify()")
    op.execute("DROP TRIGGER inbox_notify ON inbox")
    op.execute("DROP FUNCTION butlers_inbox_notify()")
    op.drop_index("inbox_conversation_pending", "inbox")
    op.drop_column("inbox", "lease_until")
    op.drop_column("inbox", "claimed_by")
