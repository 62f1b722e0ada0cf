"""The durable inbox: a message is in PostgreSQL before its channel is told it was received.

`accept()` is idempotent on the channel's own id (Telegram update_id, email Message-ID), so a
redelivered message is stored once, with its files (`inbox_attachments`) in the same
transaction. Workers (in one or several switchboard processes) claim messages in arrival
order, the messages of one conversation one at a time; a message put back for a while
(`defer`) is not claimed before its time, and its conversation waits behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg

from butlers.core_store import storable, storable_json
from butlers.media import Attachment
from butlers.switchboard import queries as sql

MAX_ATTEMPTS = 3  # a message that took the process down this often is failed, not retried
# A sender's name as kept: Telegram's are at most 129 characters; a mail's display name has no
# limit, and one of 3000 made every page that shows it scroll sideways (a red team).
MAX_SENDER_NAME_CHARS = 200


@dataclass(frozen=True)
class IncomingMessage:
    """What a channel hands to the inbox."""

    channel: str  # telegram | email | mcp
    external_id: str  # the channel's own id: the idempotency key
    text: str
    source_id: str | None = None  # chat id, sender address
    sender_name: str | None = None
    subject: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # what the reply needs (Message-ID...)
    # telegram:<chat>[:<topic>] or email:<thread root Message-ID>: what history and replies
    # belong together.
    conversation: str | None = None
    # The files it carries, checked (butlers.media.checked), in the sender's order.
    attachments: tuple[Attachment, ...] = ()
    # The album it is part of (Telegram's media_group_id): a person's photos sent together
    # arrive as a message each, and are answered as one (`InboxStore.accept`); `album_more`:
    # the channel already holds more of its photos (the rest of one getUpdates answer).
    album: str | None = None
    album_more: bool = False


def meta_listing(attachments: Sequence[Attachment]) -> list[dict[str, Any]]:
    """What an inbox row's meta says of its files ("attachments"), so that its readers (the
    worker, the dashboard) know what it carries without reading the files."""
    return [
        {"name": a.name, "mime_type": a.mime_type, "size": a.size, "kind": a.kind}
        for a in attachments
    ]


@dataclass(frozen=True)
class InboxMessage:
    id: int
    channel: str
    external_id: str
    source_id: str | None
    sender_name: str | None
    subject: str | None
    text: str
    meta: dict[str, Any]
    attempts: int
    trace_context: dict[str, str] | None
    conversation: str | None = None
    # How many messages the same sender sent in the hour before this one, and whether one of
    # them was already skipped for that (the sender has been told): the per-sender limit.
    earlier_from_sender: int = 0
    sender_told: bool = False

    def deferred_for_s(self) -> float:
        """How long it has waited since it was first put back in the queue (meta
        "deferred_since", `InboxStore.defer`): 0 when it never was."""
        value = self.meta.get("deferred_since")
        if not isinstance(value, str):
            return 0.0
        try:
            since = datetime.fromisoformat(value)
        except ValueError:
            return 0.0
        since = since if since.tzinfo is not None else since.replace(tzinfo=UTC)
        return max(0.0, (datetime.now(UTC) - since).total_seconds())

    def requeued_at(self) -> datetime | None:
        """When the operator last queued it again (`butlers retry`: meta "retries"), or
        None: what it became before then is an earlier outcome, not this one's."""
        retries = self.meta.get("retries")
        last = retries[-1] if isinstance(retries, list) and retries else None
        value = last.get("retried_at") if isinstance(last, dict) else None
        if not isinstance(value, str):
            return None
        try:
            at = datetime.fromisoformat(value)
        except ValueError:
            return None
        return at if at.tzinfo is not None else at.replace(tzinfo=UTC)

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> InboxMessage:
        return cls(
            id=row["id"],
            channel=row["channel"],
            external_id=row["external_id"],
            source_id=row["source_id"],
            sender_name=row["sender_name"],
            subject=row["subject"],
            text=row["text"],
            meta=row["meta"] or {},
            attempts=row["attempts"],
            trace_context=row["trace_context"],
            conversation=row["conversation"],
            earlier_from_sender=row["earlier_from_sender"],
            sender_told=row["sender_told"],
        )


class InboxStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def accept(
        self,
        message: IncomingMessage,
        trace_context: dict[str, str] | None,
        *,
        album_wait_s: float = 0.0,
        max_files: int | None = None,
    ) -> int | None:
        """Store a message; returns its id, or None when it was already there (a duplicate).

        A message with files is stored with them in one transaction (a duplicate stores
        nothing), its meta listing them ("attachments": name, type, size, kind). One without
        (nearly all) is the one statement it always was: the intake's hot path. A part of an
        album joins the album's first message (InboxQueue.accept says how)."""
        if message.album is not None and message.conversation is not None:
            return await self._accept_album_part(message, trace_context, album_wait_s, max_files)
        if not message.attachments:
            return await self.pool.fetchval(
                sql.INBOX_ACCEPT, *self._accept_args(message, trace_context), None
            )
        async with self.pool.acquire() as conn, conn.transaction():
            return await self._insert(conn, message, trace_context, None)

    async def _insert(
        self,
        conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy,
        message: IncomingMessage,
        trace_context: dict[str, str] | None,
        wait_s: float | None,
    ) -> int | None:
        """A queued row and its files, in the caller's transaction; None: a duplicate."""
        meta = {**message.meta, "attachments": meta_listing(message.attachments)}
        if message.album is not None:
            meta["album"] = message.album
        inbox_id: int | None = await conn.fetchval(
            sql.INBOX_ACCEPT, *self._accept_args(message, trace_context, meta), wait_s
        )
        if inbox_id is not None:
            await self._add_files(conn, inbox_id, 0, message.attachments)
        return inbox_id

    @staticmethod
    async def _add_files(
        conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy,
        inbox_id: int,
        first_position: int,
        attachments: Sequence[Attachment],
    ) -> None:
        await conn.executemany(
            sql.INBOX_ATTACHMENT_ADD,
            [
                (inbox_id, position, storable(a.name), a.mime_type, a.data)
                for position, a in enumerate(attachments, start=first_position)
            ],
        )

    async def album_part_dropped(
        self, message: IncomingMessage, wait_s: float, *, max_files: int | None = None
    ) -> bool:
        """A part of an album that will not be stored (its file was refused once downloaded):
        the album's first message, while it still waits queued, waits `wait_s` from now, as
        for a part that came (InboxQueue.album_part_dropped)."""
        if message.album is None or message.conversation is None:
            return False
        key = (message.channel, storable(message.conversation), storable(message.album))
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.INBOX_ALBUM_LOCK, *key)
            first = await conn.fetchrow(sql.INBOX_ALBUM_FIRST, *key)
            if first is None:
                return False
            if max_files is not None and first["files"] >= max_files:
                await conn.execute(sql.INBOX_ALBUM_FULL, first["id"])  # it waits for no part
            else:
                await conn.execute(sql.INBOX_ALBUM_JOIN, first["id"], "", [], False, wait_s)
        return True

    async def _accept_album_part(
        self,
        message: IncomingMessage,
        trace_context: dict[str, str] | None,
        wait_s: float,
        max_files: int | None,
    ) -> int | None:
        assert message.album is not None and message.conversation is not None
        key = (message.channel, storable(message.conversation), storable(message.album))
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.INBOX_ALBUM_LOCK, *key)
            first = await conn.fetchrow(sql.INBOX_ALBUM_FIRST, *key)
            if first is None:  # the album's first message
                return await self._insert(conn, message, trace_context, wait_s)
            if max_files is not None and first["files"] + len(message.attachments) > max_files:
                await conn.execute(sql.INBOX_ALBUM_FULL, first["id"])
                return await self._insert(conn, message, trace_context, wait_s)  # the next
            meta = {**message.meta, "album": message.album}
            part_id: int | None = await conn.fetchval(
                sql.INBOX_ALBUM_PART, *self._accept_args(message, trace_context, meta), first["id"]
            )
            if part_id is None:
                return None  # a redelivery
            await self._add_files(conn, first["id"], first["next_position"], message.attachments)
            await conn.execute(
                sql.INBOX_ALBUM_JOIN,
                first["id"],
                storable(message.text),
                storable_json(meta_listing(message.attachments)),
                bool(message.meta.get("voice")),
                wait_s,
            )
            return part_id

    @staticmethod
    def _accept_args(
        message: IncomingMessage,
        trace_context: dict[str, str] | None,
        meta: dict[str, Any] | None = None,
    ) -> tuple[Any, ...]:
        """The row's columns: INBOX_ACCEPT's and INBOX_ALBUM_PART's $1-$9."""
        return (
            message.channel,
            storable(message.external_id),
            storable(message.source_id),
            storable(message.sender_name and message.sender_name[:MAX_SENDER_NAME_CHARS]),
            storable(message.subject),
            storable(message.text),
            storable_json(message.meta if meta is None else meta),
            trace_context,
            storable(message.conversation),
        )

    async def attachments(self, inbox_id: int) -> list[Attachment]:
        """A message's files, in the sender's order: the same bytes on every attempt."""
        rows = await self.pool.fetch(sql.INBOX_ATTACHMENTS, inbox_id)
        return [Attachment(r["name"], r["mime_type"], r["data"]) for r in rows]

    async def transcribed(
        self, inbox_id: int, *, replica: str, text: str, keep_audio: bool, transcript_at: int = 0
    ) -> bool:
        """A voice note heard: `text` becomes the message's text (meta "voice" and
        "transcribed": true, so that a resumed attempt does not transcribe it again;
        "transcript_at": where in it the transcript begins, after the words typed with it), and its
        audio files go (their rows, and their lines in meta "attachments") unless `keep_audio`.
        Only while `replica` holds the claim; False when it does not (another process took the
        message over: its work counts). One statement: the text and the audio go together."""
        done = await self.pool.fetchval(
            sql.INBOX_TRANSCRIBED,
            inbox_id,
            storable(text),
            replica,
            keep_audio,
            transcript_at,
        )
        return bool(done)

    async def defer(
        self, inbox_id: int, *, replica: str, delay_s: float, error: str, timed_out: bool = False
    ) -> bool:
        """Put a message `replica` holds back in the queue until `delay_s` from now (its voice
        note's transcription service is failing): not claimed before then, its conversation's
        later messages waiting behind it. The attempt does not count (as in `release`: nothing
        crashed); `error` says why it waits; meta "deferred_since" keeps the first deferral's
        time, from which the worker gives up after `retry_hours`; "timeouts" counts the
        deferrals in a row that `timed_out` (the service did not answer in time). False: not
        held."""
        result = await self.pool.execute(
            sql.INBOX_DEFER,
            inbox_id,
            replica,
            delay_s,
            storable(error),
            timed_out,
        )
        return result.split()[-1] == "1"

    async def record_failed(
        self, message: IncomingMessage, error: str, *, conn: Any = None
    ) -> int | None:
        """Keep a message that cannot be processed (a mail that failed to store N times) as a
        `failed` row, so that its channel may let it go and an operator still sees it. Only
        the envelope is kept: the content is what failed. None when the row already exists.
        `conn`: in that connection's transaction."""
        return await (conn or self.pool).fetchval(
            sql.INBOX_RECORD_FAILED,
            message.channel,
            storable(message.external_id),
            storable(message.source_id),
            storable(message.subject),
            storable(error),
        )

    async def requeue_interrupted(self, claimants: Sequence[str]) -> int:
        """At start-up: what `claimants` (processes gone: butlers.switchboard.process_name)
        left `processing` when they crashed goes back to the queue, in its place. A row
        claimed by nobody in particular is from before leases: requeued too. Other processes'
        rows are theirs until their leases run out."""
        result = await self.pool.execute(sql.INBOX_REQUEUE_INTERRUPTED, list(claimants))
        return int(result.split()[-1])

    async def claimants_under_way(self, name: str) -> list[str]:
        """The claimants with messages `processing` among the processes named `name`."""
        rows = await self.pool.fetch(sql.INBOX_CLAIMANTS_UNDER_WAY, name)
        return [row["claimed_by"] for row in rows]

    async def claim_next(
        self, replica: str, lease_s: float, exclude: Sequence[int] = ()
    ) -> InboxMessage | None:
        """The oldest message that may start now, `processing` for `replica` until its lease
        ends, with its sender's last hour (in the same round trip); None when none may.

        A message may start when it is queued and not deferred past now (`not_before`), or its
        claim's lease ran out (its process died), and its conversation has nothing older
        pending and nothing in flight: the messages of one conversation go one at a time, in
        order, whichever process takes them (a deferred one, still queued, holds back the
        later ones of its conversation). One statement: FOR UPDATE SKIP LOCKED makes two
        processes claiming at once take different messages, and a conversation's next message
        is not claimable while an older one is still queued, so neither can take it out of
        turn.
        """
        row = await self.pool.fetchrow(sql.INBOX_CLAIM_NEXT, replica, lease_s, list(exclude))
        return None if row is None else InboxMessage.from_row(row)

    async def renew(self, replica: str, inbox_ids: Sequence[int], lease_s: float) -> set[int]:
        """Extend the leases of the messages `replica` is working on; returns the ids it
        still holds: a message missing was taken over after its lease ran out. One that
        `replica` itself finished meanwhile (its worker is between that commit and letting
        go of it) is still its own, not lost: counted as held, so that its worker is not
        told to stop what has already succeeded."""
        rows = await self.pool.fetch(
            sql.INBOX_RENEW,
            replica,
            list(inbox_ids),
            lease_s,
        )
        return {row["id"] for row in rows}

    async def release(self, replica: str, inbox_ids: Sequence[int]) -> int:
        """A process stopping on purpose hands its messages back to the queue, in their
        place, for another process (or itself, restarted) to start afresh: that attempt
        does not count as one a crash interrupted."""
        result = await self.pool.execute(sql.INBOX_RELEASE, replica, list(inbox_ids))
        return int(result.split()[-1])

    async def finish(
        self,
        inbox_id: int,
        *,
        replica: str,
        status: str,
        routed_to: str | None,
        reply: str | None,
        error: str | None,
        classified_via: str | None = None,
        conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy | None = None,
    ) -> bool:
        """The message's outcome, if `replica` still holds its claim (False: another process
        took it over; its outcome is the one that counts). `conn`: in the caller's
        transaction (with its outbox rows)."""
        result = await (conn or self.pool).execute(
            sql.INBOX_FINISH,
            inbox_id,
            status,
            routed_to,
            storable(reply),
            storable(error),
            classified_via,
            replica,
        )
        return result.split()[-1] == "1"

    async def holds_channel(self, channel: str) -> bool:
        return bool(await self.pool.fetchval(sql.INBOX_HOLDS_CHANNEL, channel))

    async def sent_last_hour(
        self, channel: str, source_id: str, *, besides_album: str | None = None
    ) -> int:
        """How many messages a sender sent in the last hour, as the worker counts them."""
        return await self.pool.fetchval(
            sql.INBOX_SENDER_LAST_HOUR, channel, source_id, besides_album
        )

    async def history(self, message: InboxMessage, exchanges: int) -> list[dict[str, Any]]:
        """The last `exchanges` handled messages of the message's conversation before it,
        oldest first: who said what, and which butler answered what."""
        if not message.conversation or exchanges <= 0:
            return []
        rows = await self.pool.fetch(sql.INBOX_HISTORY, message.conversation, message.id, exchanges)
        return [dict(r) for r in reversed(rows)]

    async def last_of_conversation(self, conversation: str) -> InboxMessage | None:
        """The newest message of a conversation (whom a notification to it goes to)."""
        row = await self.pool.fetchrow(sql.INBOX_LAST_OF_CONVERSATION, conversation)
        return None if row is None else InboxMessage.from_row(row)

    async def prune(self, older_than_days: int) -> int:
        """Delete finished messages older than that, their files with them (the cascade of
        inbox_attachments); queued and processing ones stay."""
        result = await self.pool.execute(sql.INBOX_PRUNE, older_than_days)
        return int(result.split()[-1])

    async def get(self, inbox_id: int) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(sql.INBOX_GET, inbox_id)
        return None if row is None else dict(row)
