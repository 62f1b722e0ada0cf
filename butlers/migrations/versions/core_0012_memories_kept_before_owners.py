"""Memories kept before core_0007 by a routed session (someone's message): theirs.

core_0007 gave every memory a `person` ('' for the butler's own) and `from_owner` (true by
default), but left the rows already there at the defaults though `conversation` said whose
message kept them; core_0009 then made every row of no person the owner's own. A stranger's
words kept in those releases thus reached the sessions the owner starts, and their tools, as
the owner's facts (a red team). Since core_0007 a row of no person has no conversation (the
owner's sessions keep none), so a row with one is such a row: it becomes its conversation's
person's, private to them, not the owner's. The owner's own chat's rows of then go the same
way (their sessions through that chat still find them; their schedules no longer do):
nothing then told the owner's chat apart from a forward in it.

Revision ID: core_0012
Revises: core_0011
"""

from alembic import op

revision = "core_0012"
down_revision = "core_0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The person as butlers.memory.person_of reads a conversation: `telegram:<chat>` (any
    # topic), `email:<address>` (any thread, lower-cased).
    op.execute(
        """
        UPDATE memories
        SET person = split_part(conversation, ':', 1) || ':' || CASE
                WHEN split_part(conversation, ':', 1) = 'email'
                THEN lower(split_part(conversation, ':', 2))
                ELSE split_part(conversation, ':', 2) END,
            from_owner = false,
            private = true
        WHERE person = '' AND conversation <> ''
        """
    )


def downgrade() -> None:
    pass  # whose they are stays known
