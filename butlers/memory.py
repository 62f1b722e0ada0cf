"""A butler's long-term memory: short facts the person stated, kept in the butler's own
database and found again by meaning-preserving word search.

Why PostgreSQL full-text search and not embeddings: it runs in the database every butler
already has, needs no model and no download, and finds word forms ("tyres" finds "tyre")
through the language's stemmer. Trigram word similarity (pg_trgm, where the server has it)
adds misspellings. The search vector is stored (`memories.words`) under a GIN index, stemmed
with the butler's language; `open()` re-stems rows written under another language.

Bounds: a memory is at most MAX_MEMORY_BYTES; a butler keeps at most `max_memories`, and past
that the oldest unused one (remembered or last found longest ago) is evicted, and logged.

Visibility (the one rule): a session started by a routed message sees the memories that are
not private, and the private ones of its own conversation. Every other caller (the operator,
a schedule the owner made, a trigger) sees them all. Other butlers never see them: they live in
this butler's database only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from butlers.core_store import storable
from butlers.tool_errors import ToolRefusal

logger = logging.getLogger(__name__)

MAX_MEMORY_BYTES = 4096
MAX_TAGS = 16
MAX_TAG_CHARS = 64
MAX_QUERY_CHARS = 1000
DEFAULT_MAX_MEMORIES = 10_000
FALLBACK_LANGUAGE = "simple"
TRIGRAM_THRESHOLD = 0.5
# Misspellings are looked for in a query of a few words, not in a session's whole prompt.
TRIGRAM_QUERY_CHARS = 64
# A memory marked with this tag is private to the conversation it came from.
PRIVATE_TAG = "private"
# The conversation of a routed session that names none: matches no stored conversation
# (storable() takes NUL out of what is stored), so it sees public memories only.
NO_CONVERSATION = "\x00none"
# Memories given to a session with its prompt, at most this many bytes.
MEMORY_CONTEXT_BYTES = 4096


@dataclass(frozen=True)
class Viewer:
    """Who is asking: `conversation` of a routed session (it sees public memories and its own
    conversation's private ones), or None for an unrestricted caller."""

    conversation: str | None = None

    @property
    def restricted(self) -> bool:
        return self.conversation is not None


UNRESTRICTED = Viewer()


def check_text(text: str) -> str:
    text = storable(text.strip()) or ""
    if not text:
        raise ToolRefusal("memory text must not be empty")
    size = len(text.encode())
    if size > MAX_MEMORY_BYTES:
        raise ToolRefusal(
            f"memory text is {size} bytes; the limit is {MAX_MEMORY_BYTES}: keep one fact "
            "per memory"
        )
    return text


def check_tags(tags: list[str]) -> list[str]:
    if len(tags) > MAX_TAGS:
        raise ToolRefusal(f"{len(tags)} tags; the limit is {MAX_TAGS}")
    cleaned: list[str] = []
    for tag in tags:
        tag = (storable(tag) or "").strip().lower()
        if not tag:
            raise ToolRefusal("a tag must not be empty")
        if len(tag) > MAX_TAG_CHARS:
            raise ToolRefusal(f"tag {tag[:20]!r}... is longer than {MAX_TAG_CHARS} characters")
        if tag not in cleaned:
            cleaned.append(tag)
    return cleaned


def _row(record: asyncpg.Record) -> dict[str, Any]:
    row = dict(record)
    if isinstance(row.get("created_at"), datetime):
        row["created_at"] = row["created_at"].isoformat()
    if "score" in row:
        row["score"] = round(float(row["score"]), 4)
    return row


class MemoryStore:
    """Named queries on `memories` (migration core_0005)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        language: str = "english",
        max_memories: int = DEFAULT_MAX_MEMORIES,
    ) -> None:
        self.pool = pool
        self.wanted_language = language
        self.language = FALLBACK_LANGUAGE
        self.max_memories = max_memories
        self.trigrams = False

    async def open(self) -> None:
        """Settle the language (the configured one if the server knows it, else `simple`),
        whether pg_trgm is there, and re-stem rows written under another language."""
        async with self.pool.acquire() as conn:
            known = await conn.fetchval(
                "SELECT cfgname::text FROM pg_ts_config WHERE cfgname = $1", self.wanted_language
            )
            if known is None:
                logger.warning(
                    "memory: text search language %r unknown to PostgreSQL; using %r",
                    self.wanted_language,
                    FALLBACK_LANGUAGE,
                )
            self.language = known or FALLBACK_LANGUAGE
            self.trigrams = bool(
                await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE indexname = 'memories_trigrams')"
                )
            )
            restemmed = await conn.execute(
                "UPDATE memories SET language = $1::text, "
                "words = to_tsvector($1::text::regconfig, text) WHERE language <> $1::text",
                self.language,
            )
            if restemmed != "UPDATE 0":
                logger.info("memory: re-stemmed for %s: %s", self.language, restemmed)

    async def remember(
        self, text: str, tags: list[str], *, conversation: str = "", private: bool = False
    ) -> dict[str, Any]:
        text, tags = check_text(text), check_tags(tags)
        private = private or PRIVATE_TAG in tags
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                """
                INSERT INTO memories (text, tags, conversation, private, language, words)
                VALUES ($1, $2, $3, $4, $5::text, to_tsvector($5::text::regconfig, $1))
                RETURNING id, text, tags, conversation, private, created_at
                """,
                text,
                tags,
                conversation,
                private,
                self.language,
            )
            assert row is not None  # INSERT ... RETURNING returns its row
            evicted = await conn.fetch(
                """
                DELETE FROM memories WHERE id IN (
                    SELECT id FROM memories ORDER BY used_at DESC, id DESC OFFSET $1
                ) RETURNING id
                """,
                self.max_memories,
            )
        if evicted:
            logger.warning(
                "memory: %d memories kept at most; evicted the oldest unused: %s",
                self.max_memories,
                ", ".join(str(r["id"]) for r in evicted),
                extra={"action": "memory_evicted"},
            )
        return _row(row)

    async def search(
        self, query: str, limit: int = 10, viewer: Viewer = UNRESTRICTED
    ) -> list[dict[str, Any]]:
        """Best first, in two bands. Words: a memory with any of the query's words (a
        session's prompt is a sentence, not keywords) scores 1 plus the rank of its words
        (cover density, 0..1), plus 1 more when it matches the whole query as a web search
        reads it ("quoted phrase", -word). Then, only when words found fewer than `limit`
        and the query is a few words, misspellings: trigram word similarity (0..1) where
        pg_trgm is there. Found memories count as used (eviction).

        Two steps rather than one OR: similarity computed for every candidate of a broad
        query cost 29 ms at 2,000 memories (bench/memory.py); words alone, a GIN lookup."""
        query = (storable(query) or "").strip()
        if not query:
            raise ToolRefusal("search query must not be empty")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolRefusal(f"search query is longer than {MAX_QUERY_CHARS} characters")
        if not 1 <= limit <= 100:
            raise ToolRefusal(f"limit must be between 1 and 100, got {limit}")
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                """
                WITH query AS (
                    SELECT websearch_to_tsquery($2::regconfig, $1) AS every_word,
                           replace(plainto_tsquery($2::regconfig, $1)::text, ' & ', ' | ')
                               ::tsquery AS any_word
                )
                SELECT id, text, tags, created_at,
                       1 + (words @@ every_word)::int + ts_rank_cd(words, any_word, 32) AS score
                FROM memories, query
                WHERE words @@ any_word
                  AND ($4::text IS NULL OR NOT private OR conversation = $4)
                ORDER BY score DESC, id DESC
                LIMIT $3
                """,
                query,
                self.language,
                limit,
                viewer.conversation,
            )
            if self.trigrams and len(rows) < limit and len(query) <= TRIGRAM_QUERY_CHARS:
                # pg_trgm's default (0.6) misses one wrong letter in a 6-letter name
                # ("Okafer" for "Okafor" is 0.57); `<%` reads the threshold from here. The
                # planner prices word_similarity as cheap and scans a small table instead of
                # the trigram index: 16 ms at 2,000 memories, 2 ms through the index.
                await conn.execute(
                    f"SET LOCAL pg_trgm.word_similarity_threshold = {TRIGRAM_THRESHOLD}; "
                    "SET LOCAL enable_seqscan = off"
                )
                rows += await conn.fetch(
                    """
                    SELECT id, text, tags, created_at, word_similarity($1, text) AS score
                    FROM memories
                    WHERE $1 <% text AND NOT id = ANY($4::bigint[])
                      AND ($3::text IS NULL OR NOT private OR conversation = $3)
                    ORDER BY score DESC, id DESC
                    LIMIT $2
                    """,
                    query,
                    limit - len(rows),
                    viewer.conversation,
                    [r["id"] for r in rows],
                )
            if rows:
                await conn.execute(
                    "UPDATE memories SET used_at = now() WHERE id = ANY($1::bigint[])",
                    [r["id"] for r in rows],
                )
        return [_row(r) for r in rows]

    async def forget(self, memory_id: int, viewer: Viewer = UNRESTRICTED) -> bool:
        deleted = await self.pool.fetchval(
            """
            DELETE FROM memories
            WHERE id = $1 AND ($2::text IS NULL OR NOT private OR conversation = $2)
            RETURNING id
            """,
            memory_id,
            viewer.conversation,
        )
        return deleted is not None

    async def list(self, limit: int = 50, viewer: Viewer = UNRESTRICTED) -> list[dict[str, Any]]:
        """The newest memories first."""
        rows = await self.pool.fetch(
            "SELECT id, text, tags, conversation, private, created_at FROM memories "
            "WHERE ($2::text IS NULL OR NOT private OR conversation = $2) "
            "ORDER BY id DESC LIMIT $1",
            limit,
            viewer.conversation,
        )
        return [_row(r) for r in rows]

    async def count(self) -> int:
        return int(await self.pool.fetchval("SELECT count(*) FROM memories"))
