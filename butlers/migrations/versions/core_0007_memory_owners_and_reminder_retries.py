"""Whose a memory is, and reminders that are not lost.

- memories.person: the person a routed session's memory came from (`telegram:<chat>`,
  `email:<address>`; '' for the butler's own: the operator, schedules, trigger), and
  from_owner: the owner's (their chat or address, or no person), which alone reach the
  sessions the owner starts. A stranger's words stored as a memory must not become the
  instructions of a session that holds tools no stranger may use.
- Both GIN indexes without the pending list (fastupdate): memories come one at a time, and
  every search scanned the list whole (55 ms at 100,000 memories after a bulk load, 2 ms
  without; bench/memory.py).
- No index on used_at, and room on each page (fillfactor 90): a search marks what it found
  as used, and an update of an indexed column rewrote every index entry of the row, GIN ones
  included (most of a search's time at 100,000). Now it stays on its page (a HOT update);
  eviction sorts, on the rare remember that needs it.
- scheduled_tasks.conversation: a routed session's reminder answers in its conversation;
  attempts: a one-time reminder whose run failed or was skipped is tried again, not lost.

Revision ID: core_0007
Revises: core_0006
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0007"
down_revision = "core_0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("memories", sa.Column("person", sa.Text, nullable=False, server_default=""))
    op.add_column(
        "memories", sa.Column("from_owner", sa.Boolean, nullable=False, server_default=sa.true())
    )
    op.create_index("memories_person", "memories", ["person"])
    op.drop_index("memories_used_at", "memories")
    op.execute("ALTER TABLE memories SET (fillfactor = 90)")
    op.execute("ALTER INDEX memories_words SET (fastupdate = off)")
    op.execute("SELECT gin_clean_pending_list('memories_words'::regclass)")
    op.execute(
        """
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_class WHERE relname = 'memories_trigrams') THEN
            ALTER INDEX memories_trigrams SET (fastupdate = off);
            PERFORM gin_clean_pending_list('memories_trigrams'::regclass);
          END IF;
        END
        $$
        """
    )
    op.add_column("scheduled_tasks", sa.Column("conversation", sa.Text))
    op.add_column(
        "scheduled_tasks",
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    op.drop_column("scheduled_tasks", "attempts")
    op.drop_column("scheduled_tasks", "conversation")
    op.execute("ALTER INDEX memories_words SET (fastupdate = on)")
    op.execute("ALTER TABLE memories RESET (fillfactor)")
    op.create_index("memories_used_at", "memories", ["used_at"])
    op.drop_index("memories_person", "memories")
    op.drop_column("memories", "from_owner")
    op.drop_column("memories", "person")
