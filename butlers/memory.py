"""A butler's long-term memory: short facts the person stated, kept in the butler's own
database and found again by meaning-preserving word search.

Why PostgreSQL full-text search and not embeddings: it runs in the database every butler
already has, needs no model and no download, and finds word forms ("tyres" finds "tyre")
through the language's stemmer. Trigram word similarity (pg_trgm, where the server has it)
adds misspellings. The search vector is stored (`memories.words`) under a GIN index, stemmed
with the butler's language; `open()` re-stems rows written under another language.

Bounds: a memory is at most MAX_MEMORY_BYTES; a butler keeps at most `max_memories`, and past
that the oldest unused one (remembered or last found longest ago) is evicted, and logged.

Whose a memory is decides who sees it (a stranger's words stored as a memory must not reach
the owner's sessions, which hold tools no stranger may use, nor may the owner's facts reach a
stranger's session):
- a memory written by a session a person's message started belongs to that person
  (`telegram:<chat>`, `email:<address>`): private to them, always. It is the owner's
  (`from_owner`) when that person is the owner ([switchboard.owner]) and the message was
  not forwarded (another's words, which sessions the owner started must not be handed);
- one written by the operator, a schedule or `trigger` is the owner's, private to the owner
  unless tagged `shared` (it was shared unless tagged `private`: every person's session was
  handed the owner's facts with its prompt, a red team found).
Readers: a person's session finds the shared memories and their own; a session the owner
started (a schedule, `trigger`) or the owner's own chat finds the shared ones and the owner's;
one acting on words the owner forwarded finds the shared ones and what such sessions kept,
never the owner's; the operator (the CLI, no session) finds all. A person's session may
forget only their own (a forward: only what forwards kept). A person may keep at
most PERSON_QUOTA memories, and when the butler is full the people's go before the owner's
(those of whoever holds the most first).
Other butlers never see any: they live in this butler's database only.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import asyncpg

from butlers.core_store import storable
from butlers.text import printable
from butlers.tool_errors import ToolRefusal

logger = logging.getLogger(__name__)

MAX_MEMORY_BYTES = 4096
MAX_TAGS = 16
MAX_TAG_CHARS = 64
MAX_QUERY_CHARS = 1000
DEFAULT_MAX_MEMORIES = 10_000
FALLBACK_LANGUAGE = "simple"
TRIGRAM_THRESHOLD = 0.5
# The query as tsqueries, written into the statement (not a CTE, which the planner cannot use
# as an index condition: 270 ms a search at 100,000 memories, a scan): all of its words as a
# web search reads them, and any of them.
EVERY_WORD = "websearch_to_tsquery($2::regconfig, $1)"
ANY_WORD = "replace(plainto_tsquery($2::regconfig, $1)::text, ' & ', ' | ')::tsquery"


# One step of a word search: its band (`score`: 2 for all the words, 1 for any of them) plus
# the rank of the words found (cover density, 0..1); those found by an earlier step ($5) left
# out; the privacy rule ($4: a routed session's conversation, NULL for everyone else).
def _whose(viewer: Viewer) -> str:
    """The columns that say whose a memory is: for the operator alone (`butlers memory`'s
    FOR, the dashboard's For; a search showed none, though its docs said so: a walkthrough)."""
    return ", conversation, person, private, from_owner" if viewer.kind == "operator" else ""


_WORD_SEARCH = """
    SELECT id, text, tags, created_at{whose}, {score} + ts_rank_cd(words, {query}, 32) AS score
    FROM memories
    WHERE words @@ {query}
      AND NOT id = ANY($5::bigint[])
      AND {visible}{excluded}
    ORDER BY score DESC, id DESC
    LIMIT $3
"""
# A web search's -word, for the bands that read words one by one ($7: those words): a memory
# with any of them is not found there either ("dentist -car" brought the car's memories in).
_EXCLUDED = " AND NOT words @@ " + ANY_WORD.replace("$1", "$7")
# "-word" (at the start, or after a space), as websearch_to_tsquery reads it.
NEGATED = re.compile(r"(?:^|(?<=\s))-(\w+)")
# A session's context: $1 a tsquery built here from the prompt's lexemes. Memories alike but
# for their numbers and punctuation (a receipt a month, a weight a day) count once, the best
# of them: equal in rank, the newest five such were all a session was given, and "Who is my
# dentist?" got five dentist's bills, not the dentist (a year of data's walkthrough).
# Of the best CONTEXT_CANDIDATES only: the shape of every match cost a one-word prompt
# matching 100,000 memories 647 ms and a sort on disk, 61 ms before (a review).
_CONTEXT_SEARCH = """
    SELECT id, text, tags, created_at, score FROM (
        SELECT DISTINCT ON (shape) id, text, tags, created_at, score FROM (
            SELECT id, text, tags, created_at, score,
                   regexp_replace(lower(text), '[[:digit:][:punct:][:space:]]+', ' ', 'g')
                       AS shape
            FROM (
                SELECT id, text, tags, created_at,
                       1 + ts_rank_cd(words, $1::tsquery, 32) AS score
                FROM memories
                WHERE words @@ $1::tsquery
                  AND {visible}
                ORDER BY score DESC, id DESC
                LIMIT {candidates}
            ) AS best
        ) AS found
        ORDER BY shape, score DESC, id DESC
    ) AS unlike
    ORDER BY score DESC, id DESC
    LIMIT $2
"""
# Memories a session's context is chosen from, best first: room for years of a monthly bill
# (or most of three years of a daily weight) above the one fact that is not like them.
CONTEXT_CANDIDATES = 1000
# A session's prompt is matched by this many of its longest words.
CONTEXT_WORDS = 8
WORD = re.compile(r"\w{3,40}")  # a longer "word" is cut: a query stays under MAX_QUERY_CHARS
# Misspellings are looked for in a query of a few words, not in a session's whole prompt.
TRIGRAM_QUERY_CHARS = 64
# A memory the operator, a schedule or trigger keeps is the owner's alone, unless tagged
# SHARED_TAG (then people's sessions find it too); PRIVATE_TAG keeps it the owner's whatever.
SHARED_TAG = "shared"
PRIVATE_TAG = "private"
# The person of a routed session that names no conversation (a credential of no running
# session, a reminder planted before conversations were recorded): no channel is called
# `none`, so it matches no stored person and sees the shared memories only; it keeps nothing
# (core_tools). It was "\x00none", which PostgreSQL refuses as a parameter: such a session
# failed before it started.
NO_PERSON = "none:"
# A memory core_0012 set aside: kept by someone's message before memories had an owner; whose
# it is (the owner's, or that person's) is settled by MemoryStore.open, which knows the owner.
UNSETTLED_PREFIX = "unsettled:"
# An advisory lock held while a memory is kept and the butler made room ("memory" in ASCII).
MEMORY_LOCK_KEY = 0x6D656D6F7279
# Memories one person (not the owner) may keep; past it their oldest unused one goes.
PERSON_QUOTA = 200
# The butler is full: one memory goes, the oldest unused of the sender (not the owner) who
# holds the most, else the owner's oldest unused. Not the people's oldest whoever's: one
# sender writing from many addresses (plus-addressing under an allowed domain) filled the
# butler and evicted everyone else's memories (a red team). A sender is a person with an
# address's +tag left out (mallory+1@ and mallory+2@ are one); between equals, the one who
# wrote last (a flood is newer than the people it would push out: a review).
_SENDER = r"regexp_replace(person, '^(email:[^@+]*)\+[^@]*@', '\1@')"
EVICT_ONE = f"""
    DELETE FROM memories WHERE id = coalesce(
        (SELECT id FROM memories
         WHERE NOT from_owner AND {_SENDER} = (
             SELECT {_SENDER} FROM memories WHERE NOT from_owner
             GROUP BY 1 ORDER BY count(*) DESC, max(created_at) DESC LIMIT 1)
         ORDER BY used_at, id LIMIT 1),
        (SELECT id FROM memories ORDER BY used_at, id LIMIT 1))
    RETURNING id
"""
# Many over at once (max_memories lowered): the people's oldest unused, then the owner's, in
# one statement (one EVICT_ONE a row took 26 s for 4,000: a review).
EVICT_MANY = """
    DELETE FROM memories WHERE id IN (
        SELECT id FROM memories ORDER BY from_owner, used_at, id LIMIT $1
    ) RETURNING id
"""
# Memories given to a session with its prompt, at most this many bytes.
MEMORY_CONTEXT_BYTES = 4096


@dataclass(frozen=True)
class Viewer:
    """Who is asking (see the module's rules): the `operator` (no session), an `owner`
    session (a schedule, trigger), or a `person`'s session (a routed message's)."""

    kind: Literal["operator", "owner", "person"] = "operator"
    person: str = ""
    # A person's session acting on a message they forwarded: what it keeps is never the
    # owner's, even in the owner's own conversation (another's words).
    forwarded: bool = False

    @classmethod
    def of_person(cls, conversation: str | None) -> Viewer:
        return cls("person", person_of(conversation) if conversation else NO_PERSON)

    def visible(self, kind: int, person: int) -> str:
        """The SQL condition on a memories row, with this viewer's kind and person as the
        statement's parameters number `kind` and `person`."""
        return (
            f"(${kind}::text = 'operator'"
            # The owner's sessions, and the owner writing from a chat or a mail
            # (MemoryStore.seen_as): theirs wherever they kept it (`butlers ask`, a schedule,
            # a chat), never what a forward kept in their chat (another's words, which
            # reached the owner's own sessions and their tools: a red team).
            f" OR (${kind}::text = 'owner' AND (NOT private OR from_owner))"
            # A person: theirs. A forward in the owner's chat (a person there): what forwards
            # kept, never what the owner's chat did (a red team: a stranger's forwarded words
            # read it, to copy where the stranger reads).
            f" OR (${kind}::text = 'person'"
            f" AND (NOT private OR (person = ${person}::text AND NOT from_owner))))"
        )


def person_of(conversation: str) -> str:
    """The person a conversation is with: `telegram:<chat>` (any topic), `email:<address>`
    (any thread)."""
    channel, _, rest = conversation.partition(":")
    who = rest.split(":", 1)[0]
    return f"{channel}:{who.lower() if channel == 'email' else who}"


UNRESTRICTED = Viewer()
OWNER_SESSION = Viewer("owner")


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
        if printable(tag) != tag:  # a terminal escape, a line break: a tag is a word or two
            raise ToolRefusal(
                f"tag {printable(tag, 20)!r} holds a control or invisible character, or a "
                "run of spaces: a tag is a word or a few"
            )
        if tag not in cleaned:
            cleaned.append(tag)
    return cleaned


def _tsquery_literal(lexeme: str) -> str:
    """A lexeme as a tsquery operand: quoted, its quotes and backslashes escaped (a lexeme
    is the person's own word)."""
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


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
        owner_persons: tuple[str, ...] = (),
    ) -> None:
        self.pool = pool
        # The owner's chat and address as persons (`telegram:<chat>`, `email:<address>`).
        self.owner_persons = frozenset(person_of(p) for p in owner_persons)
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
            # Not while no owner is known (the switchboard's butler.toml failed to load): the
            # owner's chat's would be settled as a person's, for good (a review).
            settled = "UPDATE 0"
            if self.owner_persons:
                settled = await conn.execute(
                    """
                    UPDATE memories SET person = substr(person, $2),
                           from_owner = substr(person, $2) = ANY($1::text[])
                    WHERE starts_with(person, $3)
                    """,
                    sorted(self.owner_persons),
                    len(UNSETTLED_PREFIX) + 1,
                    UNSETTLED_PREFIX,
                )
            if settled != "UPDATE 0":
                logger.info(
                    "memory: settled whose the memories kept before core_0007 are: %s", settled
                )

    async def remember(
        self,
        text: str,
        tags: list[str],
        *,
        writer: Viewer = UNRESTRICTED,
        conversation: str = "",
    ) -> dict[str, Any]:
        """Keep one memory for `writer` (see the module's rules for whose it is), then make
        room: past PERSON_QUOTA a person's oldest unused memory goes, past `max_memories` the
        butler's (the people's before the owner's)."""
        text, tags = check_text(text), check_tags(tags)
        if writer.kind == "person":
            person, private = writer.person, True
            from_owner = person in self.owner_persons and not writer.forwarded
        else:
            person, from_owner = "", True
            private = PRIVATE_TAG in tags or SHARED_TAG not in tags
        async with self.pool.acquire() as conn, conn.transaction():
            # One remember at a time counts and evicts: two at once evicted the same row, the
            # butler went over its cap, and the catch-all eviction took the wrong people's (a
            # review); several at once evicted too many.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MEMORY_LOCK_KEY)
            row = await conn.fetchrow(
                """
                INSERT INTO memories
                    (text, tags, conversation, private, language, words, person, from_owner)
                VALUES ($1, $2, $3, $4, $5::text, to_tsvector($5::text::regconfig, $1), $6, $7)
                RETURNING id, text, tags, conversation, private, created_at
                """,
                text,
                tags,
                storable(conversation) or "",
                private,
                self.language,
                person,
                from_owner,
            )
            assert row is not None  # INSERT ... RETURNING returns its row
            evicted = []
            if person and not from_owner:
                evicted += await conn.fetch(
                    """
                    DELETE FROM memories WHERE id IN (
                        SELECT id FROM memories WHERE person = $1 AND NOT from_owner
                        ORDER BY used_at DESC, id DESC OFFSET $2
                    ) RETURNING id
                    """,
                    person,
                    PERSON_QUOTA,
                )
            over = await conn.fetchval("SELECT count(*) FROM memories") - self.max_memories
            if over == 1:
                evicted += await conn.fetch(EVICT_ONE)
            elif over > 1:  # max_memories was lowered
                evicted += await conn.fetch(EVICT_MANY, over)
        if evicted:
            logger.warning(
                "memory: %d memories kept at most; evicted the oldest unused: %s",
                self.max_memories,
                ", ".join(str(r["id"]) for r in evicted),
                extra={"action": "memory_evicted"},
            )
        kept = _row(row)
        if SHARED_TAG in tags and private:
            # The model told the owner a fact was shared that was not (a walkthrough).
            kept["note"] = (
                "kept private all the same: what a chat's messages keep is that chat's alone; "
                "shared memories come from the owner's schedules, triggers and commands"
            )
        return kept

    def seen_as(self, viewer: Viewer) -> Viewer:
        """`viewer` as the rules read it: the owner's own conversation (not a message they
        forwarded: another's words) is the owner, who finds their memories wherever they were
        kept, and may forget them. Without it what the owner told `butlers ask` was not found
        when they asked from Telegram (a walkthrough)."""
        if viewer.kind == "person" and not viewer.forwarded and viewer.person in self.owner_persons:
            return Viewer("owner", viewer.person)
        return viewer

    async def context(self, prompt: str, limit: int, viewer: Viewer) -> list[dict[str, Any]]:
        """The memories that bear on a session's prompt: those sharing at least two of its
        CONTEXT_WORDS longest words (one, when it has one), best first. A prompt is a
        sentence: any one of its words matched thousands of memories, and ranking them took
        47 ms at 100,000 (bench/memory.py); a memory that shares a single word with it is a
        weak hint anyway. No misspellings."""
        viewer = self.seen_as(viewer)
        found = sorted(set(WORD.findall(prompt.lower())), key=lambda w: (-len(w), w))
        if not found:
            return []
        async with self.pool.acquire() as conn, conn.transaction():
            lexemes: list[str] = await conn.fetchval(
                "SELECT coalesce(array_agg(lexeme ORDER BY length(lexeme) DESC, lexeme), "
                "'{}') FROM unnest(to_tsvector($2::regconfig, $1))",
                " ".join(found[:CONTEXT_WORDS]),
                self.language,
            )
            if not lexemes:
                return []  # only stop words
            quoted = [_tsquery_literal(lexeme) for lexeme in lexemes[:CONTEXT_WORDS]]
            wanted = (
                quoted[0]
                if len(quoted) == 1
                else " | ".join(f"{a} & {b}" for a, b in itertools.combinations(quoted, 2))
            )
            rows = await conn.fetch(
                _CONTEXT_SEARCH.format(visible=viewer.visible(3, 4), candidates=CONTEXT_CANDIDATES),
                wanted,
                limit,
                viewer.kind,
                viewer.person,
            )
            await self._used(conn, rows)
        return [_row(r) for r in rows]

    async def search(
        self,
        query: str,
        limit: int = 10,
        viewer: Viewer = UNRESTRICTED,
        *,
        misspellings: bool = True,
    ) -> list[dict[str, Any]]:
        """Best first, in three bands, each asked only while fewer than `limit` are found:
        memories with all the query's words as a web search reads them ("quoted phrase",
        -word) score 2 plus the rank of their words (cover density, 0..1); those with any of
        its words, 1 plus that rank; then, when no word was found in a query of a few words,
        misspellings: trigram word similarity (0..1) where pg_trgm is there. Found memories
        count as used (eviction).

        Two steps rather than one OR: similarity computed for every candidate of a broad
        query cost 29 ms at 2,000 memories (bench/memory.py); words alone, a GIN lookup."""
        viewer = self.seen_as(viewer)
        query = (storable(query) or "").strip()
        if not query:
            raise ToolRefusal("search query must not be empty")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolRefusal(f"search query is longer than {MAX_QUERY_CHARS} characters")
        if not 1 <= limit <= 100:
            raise ToolRefusal(f"limit must be between 1 and 100, got {limit}")
        whose = _whose(viewer)
        async with self.pool.acquire() as conn, conn.transaction():
            # All the words first (a web search's reading: "quoted phrase", -word): the
            # narrowest, so the cheapest through the index; any of the words only to fill up.
            visible = viewer.visible(4, 6)
            rows = await conn.fetch(
                _WORD_SEARCH.format(
                    score=2, query=EVERY_WORD, visible=visible, excluded="", whose=whose
                ),
                query,
                self.language,
                limit,
                viewer.kind,
                [],
                viewer.person,
            )
            # The later bands read the words one by one: a -word is left out of what they
            # look for, and what has it out of what they find.
            negated = NEGATED.findall(query)
            wanted = NEGATED.sub(" ", query).strip() if negated else query
            exclusion, excluded_words = (_EXCLUDED, [" ".join(negated)]) if negated else ("", [])
            # Any of the words: only for a query of several (for one, the same memories again).
            if len(rows) < limit and len(WORD.findall(wanted)) > 1:
                rows += await conn.fetch(
                    _WORD_SEARCH.format(
                        score=1, query=ANY_WORD, visible=visible, excluded=exclusion, whose=whose
                    ),
                    wanted,
                    self.language,
                    limit - len(rows),
                    viewer.kind,
                    [r["id"] for r in rows],
                    viewer.person,
                    *excluded_words,
                )
            # Misspellings only when no word was found: similarity is the costly step (most
            # of a search's time at 100,000 when it ran whenever fewer than `limit` were).
            if (
                misspellings
                and self.trigrams
                and not rows
                and not negated  # what it must not have cannot be told by similarity
                and len(query) <= TRIGRAM_QUERY_CHARS
            ):
                # pg_trgm's default (0.6) misses one wrong letter in a 6-letter name
                # ("Okafer" for "Okafor" is 0.57); `<%` reads the threshold from here. The
                # planner prices word_similarity as cheap and scans a small table instead of
                # the trigram index: 16 ms at 2,000 memories, 2 ms through the index.
                await conn.execute(
                    f"SET LOCAL pg_trgm.word_similarity_threshold = {TRIGRAM_THRESHOLD}; "
                    "SET LOCAL enable_seqscan = off"
                )
                rows += await conn.fetch(
                    f"""
                    SELECT id, text, tags, created_at{whose}, word_similarity($1, text) AS score
                    FROM memories
                    WHERE $1 <% text AND NOT id = ANY($4::bigint[])
                      AND {viewer.visible(3, 5)}
                    ORDER BY score DESC, id DESC
                    LIMIT $2
                    """,
                    query,
                    limit - len(rows),
                    viewer.kind,
                    [r["id"] for r in rows],
                    viewer.person,
                )
            await self._used(conn, rows)
        return [_row(r) for r in rows]

    @staticmethod
    async def _used(conn: asyncpg.pool.PoolConnectionProxy, rows: list[asyncpg.Record]) -> None:
        """Found memories count as used: eviction takes the oldest unused."""
        if rows:
            # Not waited for on disk: a crash forgets that a memory was found, nothing else
            # (a search otherwise waits for a WAL flush: the larger part of its time).
            await conn.execute("SET LOCAL synchronous_commit = off")
            await conn.execute(
                "UPDATE memories SET used_at = now() WHERE id = ANY($1::bigint[])",
                [r["id"] for r in rows],
            )

    async def forget(self, memory_id: int, viewer: Viewer = UNRESTRICTED) -> bool:
        """Delete one: a person's session only their own (a forward in the owner's chat: only
        what forwards kept); others what they can see."""
        viewer = self.seen_as(viewer)
        own = (
            "($2::text = 'person' AND person = $3::text AND NOT from_owner)"
            if viewer.kind == "person"
            else viewer.visible(2, 3)
        )
        deleted = await self.pool.fetchval(
            f"DELETE FROM memories WHERE id = $1 AND {own} RETURNING id",
            memory_id,
            viewer.kind,
            viewer.person,
        )
        return deleted is not None

    async def list(
        self, limit: int = 50, viewer: Viewer = UNRESTRICTED, before: int | None = None
    ) -> list[dict[str, Any]]:
        """The newest memories first (with ids below `before`, when given: the next page);
        where each came from only for the operator."""
        viewer = self.seen_as(viewer)
        columns = "id, text, tags, created_at" + _whose(viewer)
        rows = await self.pool.fetch(
            f"SELECT {columns} FROM memories WHERE {viewer.visible(2, 3)} "
            "AND ($4::bigint IS NULL OR id < $4) ORDER BY id DESC LIMIT $1",
            limit,
            viewer.kind,
            viewer.person,
            before,
        )
        return [_row(r) for r in rows]

    async def count(self) -> int:
        return int(await self.pool.fetchval("SELECT count(*) FROM memories"))
