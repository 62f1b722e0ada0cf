"""A butler's long-term memory: what the person told it, searchable by PostgreSQL full-text
search (a stored tsvector under a GIN index; `websearch_to_tsquery` at search time), and by
trigram word similarity for misspellings where the server has pg_trgm (the embedded PostgreSQL
18 ships it; a server without it searches by words only).

Revision ID: core_0005
Revises: core_0004
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "core_0005"
down_revision = "core_0004"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "memories",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("tags", ARRAY(sa.Text), nullable=False, server_default=sa.text("'{}'")),
        # The conversation it came from ('' when none: a schedule, an operator's trigger).
        sa.Column("conversation", sa.Text, nullable=False, server_default=""),
        # Private to that conversation: other routed conversations do not find it.
        sa.Column("private", sa.Boolean, nullable=False, server_default=sa.false()),
        # The text search configuration its words were stemmed with (the butler's language).
        sa.Column("language", sa.Text, nullable=False, server_default="simple"),
        sa.Column("words", sa.dialects.postgresql.TSVECTOR, nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
        # Eviction takes the oldest unused: remembered or last found longest ago.
        sa.Column("used_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_index("memories_words", "memories", ["words"], postgresql_using="gin")
    op.create_index("memories_used_at", "memories", ["used_at"])
    op.execute(
        """
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm') THEN
            CREATE EXTENSION IF NOT EXISTS pg_trgm;
            CREATE INDEX memories_trigrams ON memories USING gin (text gin_trgm_ops);
          END IF;
        EXCEPTION WHEN insufficient_privilege THEN
          RAISE NOTICE 'pg_trgm not created (%): memories are searched by words only', SQLERRM;
        END
        $$
        """
    )


def downgrade() -> None:
    op.drop_table("memories")
