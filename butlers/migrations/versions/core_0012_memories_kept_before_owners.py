"""Memories kept before core_0007 by a routed session (someone's message): theirs.

core_0007 gave every memory a `person` ('' for the butler's own) and `from_owner` (true by
default), but left the rows already there at the defaults though `conversation` said whose
message kept them; core_0009 then made every row of no person the owner's own. A stranger's
words kept in those releases thus reached the sessions the owner starts, and their tools, as
the owner's facts (a red team). Since core_0007 a row of no person has no conversation (the
owner's sessions keep none), so a row with one is such a row.

Whose it is depends on who the owner is, which only the configuration knows: here such a row
is set aside (`person` = 'unsettled:' + its conversation's person, private, not the
owner's: no session finds it, the operator does), and butlers.memory.MemoryStore.open
settles it at the next start: the owner's chat's or address's rows become the owner's, the
others' that person's own. Making them all their conversation's person's (the first version)
handed the owner's chat's rows to sessions acting on forwards there (a review).

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
        SET person = 'unsettled:' || split_part(conversation, ':', 1) || ':' || CASE
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
