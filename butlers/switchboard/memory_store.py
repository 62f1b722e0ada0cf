"""memory_store: the worker side's stores (butlers.switchboard.store) held in memory.

The test double of the PostgreSQL stores: rows in dicts, the same columns, the same rules
(claim order, one message of a conversation at a time, leases, deferrals, attempts, statuses,
dedupe on (channel, external_id), files, the outbox's order and retries). It lets the worker's
logic be tested with no database and no process; tests/test_store_contract.py runs the same
tests against it and PostgreSQL, so that it stays honest.

Time is `MemoryDatabase.clock` (the PostgreSQL stores read `now()`): a test may move it.
Nothing here waits: every call runs to its end without giving the event loop up, so a call is
as atomic as one SQL statement. A transaction (`acquire()`, then `transaction()`) copies the
tables on entry and puts the copy back when its block raises: what the block wrote is undone.
Not for production: nothing survives the process.
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from butlers.core_store import storable, storable_json
from butlers.media import Attachment
from butlers.switchboard.inbox import InboxMessage, IncomingMessage, meta_listing
from butlers.switchboard.outbox import (
    ERROR_CHARS,
    FILES_KEY,
    HELD_KEY,
    SENDER_KEY,
    Delivery,
    Outgoing,
)
from butlers.switchboard.store import FINISHED

if TYPE_CHECKING:
    from butlers.switchboard.routing_store import RouteRecord

UNSENT = ("pending", "sending")
PENDING = ("queued", "processing")


def utc_now() -> datetime:
    return datetime.now(UTC)


def _json(value: Any) -> Any:
    """What a jsonb column gives back of `value`: a fresh copy, NULs gone, keys as text."""
    return json.loads(json.dumps(storable_json(value)))


@dataclass
class _Tables:
    """The rows, by table; ids come from counters that, as PostgreSQL's sequences, a rolled
    back transaction does not give back."""

    inbox: dict[int, dict[str, Any]] = field(default_factory=dict)
    inbox_files: dict[int, list[Attachment]] = field(default_factory=dict)
    outbox: dict[int, dict[str, Any]] = field(default_factory=dict)
    outbox_files: dict[int, list[Attachment]] = field(default_factory=dict)
    registry: dict[str, dict[str, Any]] = field(default_factory=dict)
    routing_log: list[dict[str, Any]] = field(default_factory=list)


class MemoryConnection:
    """A connection of a MemoryDatabase: what `finish(conn=...)` and `add(conn, ...)` take."""

    def __init__(self, database: MemoryDatabase) -> None:
        self.database = database

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[MemoryConnection]:
        """The block's writes, or none of them when it raises (savepoints nest the same)."""
        saved = copy.deepcopy(self.database.tables)
        try:
            yield self
        except BaseException:
            self.database.tables = saved
            raise


class MemoryDatabase:
    """The tables the in-memory stores share (as the PostgreSQL stores share one database),
    and their pool: `acquire()` gives a MemoryConnection."""

    def __init__(self, clock: Callable[[], datetime] = utc_now) -> None:
        self.clock = clock
        self.tables = _Tables()
        self._ids = {"inbox": itertools.count(1), "outbox": itertools.count(1)}

    def next_id(self, table: str) -> int:
        return next(self._ids[table])

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[MemoryConnection]:
        yield MemoryConnection(self)

    def check(self, conn: object) -> None:
        """A write `in the caller's transaction` must be given one of this database's
        connections: anything else is a bug of the caller, said as such."""
        if conn is not None and (
            not isinstance(conn, MemoryConnection) or conn.database is not self
        ):
            raise TypeError(f"not a connection of this in-memory database: {conn!r}")


def _files(message: IncomingMessage) -> list[Attachment]:
    return [Attachment(storable(a.name) or "", a.mime_type, a.data) for a in message.attachments]


def _message(row: dict[str, Any], earlier: int = 0, told: bool = False) -> InboxMessage:
    return InboxMessage(
        id=row["id"],
        channel=row["channel"],
        external_id=row["external_id"],
        source_id=row["source_id"],
        sender_name=row["sender_name"],
        subject=row["subject"],
        text=row["text"],
        meta=_json(row["meta"] or {}),
        attempts=row["attempts"],
        trace_context=_json(row["trace_context"]),
        conversation=row["conversation"],
        earlier_from_sender=earlier,
        sender_told=told,
    )


class MemoryInboxStore:
    """InboxQueue in memory (see butlers.switchboard.inbox.InboxStore for each call)."""

    def __init__(self, database: MemoryDatabase) -> None:
        self.database = database

    @property
    def pool(self) -> MemoryDatabase:
        return self.database

    @property
    def _rows(self) -> dict[int, dict[str, Any]]:
        return self.database.tables.inbox

    def _held(self, inbox_id: int, replica: str) -> dict[str, Any] | None:
        row = self._rows.get(inbox_id)
        if row is None or row["claimed_by"] != replica or row["status"] != "processing":
            return None
        return row

    async def accept(
        self,
        message: IncomingMessage,
        trace_context: dict[str, str] | None,
        *,
        album_wait_s: float = 0.0,
        max_files: int | None = None,
    ) -> int | None:
        channel, external_id = message.channel, storable(message.external_id)
        if any(
            r["channel"] == channel and r["external_id"] == external_id for r in self._rows.values()
        ):
            return None
        meta = message.meta
        if message.attachments:
            meta = {**meta, "attachments": meta_listing(message.attachments)}
        if message.album is not None:
            meta = {**meta, "album": message.album}
        if message.album is None or message.conversation is None:
            return self._insert(message, meta, trace_context)
        first = self._album_first(message)
        files = len(first["meta"].get("attachments", [])) if first else 0
        if (
            first is not None
            and max_files is not None
            and files + len(message.attachments) > max_files
        ):
            self._start_now(first)  # full: it waits for no part
            first = None
        if first is None:
            inbox_id = self._insert(message, meta, trace_context)
            self._rows[inbox_id]["not_before"] = self._after(album_wait_s)
            return inbox_id
        part_meta = {**message.meta, "album": message.album, "album_of": first["id"]}
        part_id = self._insert(message, part_meta, trace_context, files=False)
        self._rows[part_id].update(
            status="done", classified_via="album", finished_at=self.database.clock()
        )
        text = storable(message.text) or ""
        if text:
            first["text"] = f"{first['text']}\n{text}" if first["text"] else text
        listed = first["meta"].get("attachments", []) + meta_listing(message.attachments)
        first["meta"] = {**first["meta"], "attachments": _json(listed)}
        if message.meta.get("voice"):
            first["meta"]["voice"] = True
        self._wait_for_parts(first, album_wait_s)
        self.database.tables.inbox_files.setdefault(first["id"], []).extend(_files(message))
        return part_id

    def _insert(
        self,
        message: IncomingMessage,
        meta: dict[str, Any],
        trace_context: dict[str, str] | None,
        *,
        files: bool = True,
    ) -> int:
        """A queued row of `message` (with its files, unless not `files`)."""
        inbox_id = self.database.next_id("inbox")
        self._rows[inbox_id] = {
            "id": inbox_id,
            "channel": message.channel,
            "external_id": storable(message.external_id),
            "source_id": storable(message.source_id),
            "sender_name": storable(message.sender_name),
            "subject": storable(message.subject),
            "text": storable(message.text),
            "meta": _json(meta),
            "received_at": self.database.clock(),
            "status": "queued",
            "attempts": 0,
            "routed_to": None,
            "reply": None,
            "error": None,
            "trace_context": _json(trace_context),
            "finished_at": None,
            "conversation": storable(message.conversation),
            "classified_via": None,
            "claimed_by": None,
            "lease_until": None,
            "not_before": None,
        }
        if files and message.attachments:
            self.database.tables.inbox_files[inbox_id] = _files(message)
        return inbox_id

    def _after(self, seconds: float) -> datetime:
        return self.database.clock() + timedelta(seconds=seconds)

    async def album_part_dropped(
        self, message: IncomingMessage, wait_s: float, *, max_files: int | None = None
    ) -> bool:
        if message.album is None or message.conversation is None:
            return False
        first = self._album_first(message)
        if first is None:
            return False
        if max_files is not None and len(first["meta"].get("attachments", [])) >= max_files:
            self._start_now(first)  # full: it waits for no part
            return True
        self._wait_for_parts(first, wait_s)
        return True

    def _start_now(self, first: dict[str, Any]) -> None:
        """An album's first message that takes no more parts (INBOX_ALBUM_FULL): claimable
        now, unless put back for a while (its voice service failing)."""
        if "deferred_since" not in first["meta"]:
            first["not_before"] = min(first["not_before"] or self._after(0), self._after(0))

    def _wait_for_parts(self, first: dict[str, Any], wait_s: float) -> None:
        """`wait_s` from now, as INBOX_ALBUM_JOIN sets it (a deferral is never shortened)."""
        first["not_before"] = (
            max(first["not_before"] or self._after(0), self._after(wait_s))
            if "deferred_since" in first["meta"]
            else self._after(wait_s)
        )

    def _album_first(self, message: IncomingMessage) -> dict[str, Any] | None:
        """The newest queued first message of `message`'s album (channel, conversation,
        album) whose voice notes were not heard yet."""
        for _, row in sorted(self._rows.items(), reverse=True):
            if (
                row["channel"] == message.channel
                and row["conversation"] == storable(message.conversation)
                and row["meta"].get("album") == storable(message.album)
                and row["status"] == "queued"
                and not row["meta"].get("transcribed")
            ):
                return row
        return None

    async def record_failed(
        self, message: IncomingMessage, error: str, *, conn: Any = None
    ) -> int | None:
        self.database.check(conn)
        inbox_id = await self.accept(
            IncomingMessage(
                channel=message.channel,
                external_id=message.external_id,
                text="",
                source_id=message.source_id,
                subject=message.subject,
            ),
            None,
        )
        if inbox_id is not None:
            self._rows[inbox_id].update(
                status="failed", error=storable(error), finished_at=self.database.clock()
            )
        return inbox_id

    async def get(self, inbox_id: int) -> dict[str, Any] | None:
        row = self._rows.get(inbox_id)
        return None if row is None else copy.deepcopy(row)

    def _may_start(self, row: dict[str, Any], now: datetime) -> bool:
        if row["status"] == "queued":
            return row["not_before"] is None or row["not_before"] <= now
        return (
            row["status"] == "processing"
            and row["lease_until"] is not None
            and row["lease_until"] < now
        )

    def _waits(self, row: dict[str, Any], now: datetime) -> bool:
        """Another row of its conversation is before it, or holds a live lease."""
        if row["conversation"] is None:  # NULL equals nothing, as in SQL
            return False
        return any(
            other["conversation"] == row["conversation"]
            and other["id"] != row["id"]
            and other["status"] in PENDING
            and (
                other["id"] < row["id"]
                or (other["lease_until"] is not None and other["lease_until"] >= now)
            )
            for other in self._rows.values()
        )

    async def claim_next(
        self, replica: str, lease_s: float, exclude: Sequence[int] = ()
    ) -> InboxMessage | None:
        now = self.database.clock()
        row = next(
            (
                self._rows[i]
                for i in sorted(self._rows)
                if i not in exclude
                and self._may_start(self._rows[i], now)
                and not self._waits(self._rows[i], now)
            ),
            None,
        )
        if row is None:
            return None
        row.update(
            status="processing",
            attempts=row["attempts"] + 1,
            claimed_by=replica,
            lease_until=now + timedelta(seconds=lease_s),
        )
        earlier = [
            other
            for other in self._rows.values()
            if row["source_id"] is not None
            and other["channel"] == row["channel"]
            and other["source_id"] == row["source_id"]
            and other["received_at"] > row["received_at"] - timedelta(hours=1)
            and other["id"] < row["id"]
            and other["classified_via"] != "album"
        ]
        return _message(row, len(earlier), any(o["status"] == "skipped" for o in earlier))

    async def renew(self, replica: str, inbox_ids: Sequence[int], lease_s: float) -> set[int]:
        until = self.database.clock() + timedelta(seconds=lease_s)
        held: set[int] = set()
        for inbox_id in inbox_ids:
            row = self._rows.get(inbox_id)
            if row is None or row["claimed_by"] != replica:
                continue
            if row["status"] == "processing":
                row["lease_until"] = until
                held.add(inbox_id)
            elif row["status"] in FINISHED:
                held.add(inbox_id)
        return held

    async def release(self, replica: str, inbox_ids: Sequence[int]) -> int:
        released = 0
        for inbox_id in set(inbox_ids):
            row = self._held(inbox_id, replica)
            if row is not None:
                row.update(
                    status="queued",
                    claimed_by=None,
                    lease_until=None,
                    attempts=max(row["attempts"] - 1, 0),
                )
                released += 1
        return released

    async def claimants_under_way(self, name: str) -> list[str]:
        return sorted(
            {
                row["claimed_by"]
                for row in self._rows.values()
                if row["status"] == "processing"
                and row["claimed_by"] is not None
                and (row["claimed_by"] == name or row["claimed_by"].startswith(f"{name}/"))
            }
        )

    async def requeue_interrupted(self, claimants: Sequence[str]) -> int:
        requeued = 0
        for row in self._rows.values():
            if row["status"] == "processing" and (
                row["claimed_by"] is None or row["claimed_by"] in claimants
            ):
                row.update(status="queued", claimed_by=None, lease_until=None)
                requeued += 1
        return requeued

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
        conn: Any = None,
    ) -> bool:
        self.database.check(conn)
        row = self._held(inbox_id, replica)
        if row is None:
            return False
        row.update(
            status=status,
            routed_to=row["routed_to"] if routed_to is None else routed_to,
            reply=storable(reply),
            error=storable(error),
            classified_via=row["classified_via"] if classified_via is None else classified_via,
            finished_at=self.database.clock(),
            lease_until=None,
        )
        return True

    async def defer(
        self, inbox_id: int, *, replica: str, delay_s: float, error: str, timed_out: bool = False
    ) -> bool:
        row = self._held(inbox_id, replica)
        if row is None:
            return False
        now = self.database.clock()
        meta = dict(row["meta"])
        meta.setdefault("deferred_since", now.isoformat())
        timeouts = meta.get("timeouts")
        meta["timeouts"] = (timeouts if isinstance(timeouts, int) else 0) + 1 if timed_out else 0
        row.update(
            status="queued",
            claimed_by=None,
            lease_until=None,
            attempts=max(row["attempts"] - 1, 0),
            not_before=now + timedelta(seconds=delay_s),
            error=storable(error),
            meta=_json(meta),
        )
        return True

    async def attachments(self, inbox_id: int) -> list[Attachment]:
        return list(self.database.tables.inbox_files.get(inbox_id, ()))

    async def transcribed(
        self, inbox_id: int, *, replica: str, text: str, keep_audio: bool, transcript_at: int = 0
    ) -> bool:
        row = self._held(inbox_id, replica)
        if row is None:
            return False
        meta = {
            **row["meta"],
            "voice": True,
            "transcribed": True,
            "transcript_at": transcript_at,
        }
        listed = meta.get("attachments")
        if not keep_audio and isinstance(listed, list):
            meta["attachments"] = [
                a for a in listed if not (isinstance(a, dict) and a.get("kind") == "audio")
            ]
        row.update(text=storable(text), meta=_json(meta))
        if not keep_audio and inbox_id in self.database.tables.inbox_files:
            self.database.tables.inbox_files[inbox_id] = [
                a
                for a in self.database.tables.inbox_files[inbox_id]
                if not a.mime_type.startswith("audio/")
            ]
        return True

    async def holds_channel(self, channel: str) -> bool:
        return any(row["channel"] == channel for row in self._rows.values())

    async def sent_last_hour(
        self, channel: str, source_id: str, *, besides_album: str | None = None
    ) -> int:
        since = self.database.clock() - timedelta(hours=1)
        return sum(
            1
            for row in self._rows.values()
            if row["channel"] == channel
            and row["source_id"] == source_id
            and row["received_at"] > since
            and row["classified_via"] != "album"
            and (besides_album is None or row["meta"].get("album") != besides_album)
        )

    async def history(self, message: InboxMessage, exchanges: int) -> list[dict[str, Any]]:
        if not message.conversation or exchanges <= 0:
            return []
        rows = [
            row
            for i, row in sorted(self._rows.items())
            if row["conversation"] == message.conversation
            and i < message.id
            and row["status"] == "done"
            and row["classified_via"] != "album"
        ][-exchanges:]
        keys = ("sender_name", "source_id", "subject", "text", "routed_to", "reply")
        return [
            {**{key: row[key] for key in keys}, "forwarded_from": row["meta"].get("forwarded_from")}
            for row in rows
        ]

    async def last_of_conversation(self, conversation: str) -> InboxMessage | None:
        ids = [i for i, row in self._rows.items() if row["conversation"] == conversation]
        return _message(self._rows[max(ids)]) if ids else None

    async def prune(self, older_than_days: int) -> int:
        before = self.database.clock() - timedelta(days=older_than_days)
        gone = [
            i
            for i, row in self._rows.items()
            if row["status"] in FINISHED
            and row["finished_at"] is not None
            and row["finished_at"] < before
        ]
        for i in gone:
            del self._rows[i]
            self.database.tables.inbox_files.pop(i, None)
        return len(gone)


class MemoryOutboxStore:
    """OutboxQueue in memory (see butlers.switchboard.outbox.OutboxStore for each call)."""

    def __init__(self, database: MemoryDatabase) -> None:
        self.database = database

    @property
    def pool(self) -> MemoryDatabase:
        return self.database

    @property
    def _rows(self) -> dict[int, dict[str, Any]]:
        return self.database.tables.outbox

    async def add(self, conn: Any, messages: Sequence[Outgoing], trace_context: Any) -> None:
        self.database.check(conn)
        now = self.database.clock()  # now(): one time for the transaction's rows
        for m in messages:
            meta = {**m.meta, FILES_KEY: len(m.attachments)} if m.attachments else m.meta
            outbox_id = self.database.next_id("outbox")
            self._rows[outbox_id] = {
                "id": outbox_id,
                "kind": m.kind,
                "inbox_id": m.inbox_id,
                "butler": m.butler,
                "channel": m.channel,
                "recipient": storable(m.recipient),
                "conversation": storable(m.conversation),
                "text": storable(m.text),
                "meta": _json(meta),
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": now,
                "created_at": now,
                "sent_at": None,
                "error": None,
                "sent_ids": [],
                "trace_context": _json(trace_context),
            }
            if m.attachments:
                self.database.tables.outbox_files[outbox_id] = [
                    Attachment(storable(a.name) or "", a.mime_type, a.data) for a in m.attachments
                ]

    def _may_go(self, channel: str) -> list[dict[str, Any]]:
        """Each recipient's first unsent row, up to the channel's first one that is not held
        for its recipient only (outbox._MAY_GO)."""
        heads: dict[str, int] = {}
        for i, row in sorted(self._rows.items()):
            if row["channel"] == channel and row["status"] in UNSENT:
                heads.setdefault(row["recipient"], i)
        unheld = [i for i in heads.values() if self._rows[i]["meta"].get(HELD_KEY) is not True]
        limit = min(unheld, default=None)
        return [self._rows[i] for i in sorted(heads.values()) if limit is None or i <= limit]

    async def claim(self, channel: str, sender: str, lease_s: float) -> Delivery | None:
        now = self.database.clock()
        row = next(
            (r for r in self._may_go(channel) if r["next_attempt_at"] <= now),
            None,
        )
        if row is None:
            return None
        row.update(
            status="sending",
            attempts=row["attempts"] + 1,
            next_attempt_at=now + timedelta(seconds=lease_s),
            meta={**row["meta"], SENDER_KEY: sender},
        )
        files = self.database.tables.outbox_files.get(row["id"], ())
        return Delivery(
            id=row["id"],
            kind=row["kind"],
            channel=row["channel"],
            recipient=row["recipient"],
            text=row["text"],
            meta=_json(row["meta"]),
            attempts=row["attempts"],
            created_at=row["created_at"],
            trace_context=_json(row["trace_context"]),
            inbox_id=row["inbox_id"],
            butler=row["butler"],
            attachments=tuple(files) if row["meta"].get(FILES_KEY) else (),
        )

    async def head_due_in_s(self, channel: str) -> float | None:
        due = [row["next_attempt_at"] for row in self._may_go(channel)]
        if not due:
            return None
        return max(0.0, (min(due) - self.database.clock()).total_seconds())

    async def sent(self, delivery_id: int, sent_ids: Sequence[str]) -> None:
        row = self._rows.get(delivery_id)
        if row is not None:
            row.update(
                status="sent",
                sent_at=self.database.clock(),
                sent_ids=[storable(str(i)) for i in sent_ids],
                error=None,
            )
            self.database.tables.outbox_files.pop(delivery_id, None)

    def _still_sending(self, delivery_id: int, sender: str | None) -> dict[str, Any] | None:
        row = self._rows.get(delivery_id)
        if row is None or sender is None:
            return row
        if row["status"] != "sending" or row["meta"].get(SENDER_KEY) != sender:
            return None
        return row

    async def later(
        self,
        delivery_id: int,
        error: str,
        delay_s: float,
        *,
        held_for_recipient: bool = False,
        sender: str | None = None,
    ) -> None:
        row = self._still_sending(delivery_id, sender)
        if row is None:
            return
        meta = {k: v for k, v in row["meta"].items() if k != HELD_KEY}
        if held_for_recipient:
            meta[HELD_KEY] = True
        row.update(
            status="pending",
            error=storable(error[:ERROR_CHARS]),
            next_attempt_at=self.database.clock() + timedelta(seconds=delay_s),
            meta=meta,
        )

    async def failed(self, delivery_id: int, error: str, *, sender: str | None = None) -> None:
        row = self._still_sending(delivery_id, sender)
        if row is not None:
            row.update(status="failed", error=storable(error[:ERROR_CHARS]))

    async def renew(self, delivery_id: int, sender: str, lease_s: float) -> bool:
        row = self._still_sending(delivery_id, sender)
        if row is None:
            return False
        row["next_attempt_at"] = self.database.clock() + timedelta(seconds=lease_s)
        return True

    async def butler_answering(
        self, channel: str, recipient: str, sent_ids: Sequence[str], within_days: int
    ) -> str | None:
        if not sent_ids or within_days <= 0:
            return None
        since = self.database.clock() - timedelta(days=within_days)
        wanted = {str(i) for i in sent_ids}
        for _, row in sorted(self._rows.items(), reverse=True):
            if (
                row["channel"] == channel
                and row["recipient"] == recipient
                and wanted & set(row["sent_ids"])
                and row["butler"] is not None
                and row["status"] == "sent"
                and row["created_at"] > since
            ):
                return str(row["butler"])
        return None

    async def notifications_last_hour(self, butler: str) -> int:
        since = self.database.clock() - timedelta(hours=1)
        return len(
            {
                (row["conversation"], row["created_at"])
                for row in self._rows.values()
                if row["kind"] == "notification"
                and row["butler"] == butler
                and row["created_at"] > since
            }
        )

    async def prune(self, older_than_days: int) -> int:
        before = self.database.clock() - timedelta(days=older_than_days)
        gone = [
            i
            for i, row in self._rows.items()
            if row["status"] in ("sent", "failed") and row["created_at"] < before
        ]
        for i in gone:
            del self._rows[i]
            self.database.tables.outbox_files.pop(i, None)
        return len(gone)


class MemoryRoutingStore:
    """RoutingLog in memory: the registry's rows (written by `register`) and the log's."""

    def __init__(self, database: MemoryDatabase) -> None:
        self.database = database

    def register(self, *names: str) -> None:
        """One discovery (RoutingStore.record_discovery): these butlers, seen now; every
        other one stale from now on."""
        now = self.database.clock()
        registry = self.database.tables.registry
        for row in registry.values():
            row["stale"] = row["stale"] or row["name"] not in names
        for name in names:
            registry[name] = {
                "name": name,
                "endpoint_url": f"memory://{name}",
                "description": "",
                "modules": [],
                "last_seen_at": now,
                "registered_at": registry.get(name, {}).get("registered_at", now),
                "stale": False,
                "is_switchboard": False,
            }

    async def registry(self) -> list[dict[str, Any]]:
        registry = self.database.tables.registry
        return [copy.deepcopy(registry[name]) for name in sorted(registry)]

    @property
    def log(self) -> list[dict[str, Any]]:
        """The routing_log's rows, oldest first."""
        return self.database.tables.routing_log

    async def record_route(self, record: RouteRecord) -> uuid.UUID:
        now = self.database.clock()
        entry_id = uuid.uuid4()
        self.log.append(
            {
                "id": entry_id,
                "created_at": now,
                "source_channel": storable(record.source_channel),
                "source_id": storable(record.source_id),
                "routed_to": storable(record.routed_to),
                "tool_name": storable(record.tool_name),
                "prompt_summary": storable(record.prompt_summary),
                "trace_id": storable(record.trace_id),
                "success": record.success,
                "error": storable(record.error),
                "duration_ms": record.duration_ms,
                "inbox_id": record.inbox_id,
            }
        )
        seen = self.database.tables.registry.get(record.routed_to)
        if record.success and seen is not None:
            seen["last_seen_at"] = now
        return entry_id

    async def handed_before(self, inbox_id: int, since: datetime | None) -> list[tuple[str, bool]]:
        answered: dict[str, bool] = {}
        for row in self.log:
            if (
                row["inbox_id"] == inbox_id
                and row["tool_name"] == "trigger"
                and (since is None or row["created_at"] > since)
            ):
                answered[row["routed_to"]] = answered.get(row["routed_to"], False) or row["success"]
        return list(answered.items())

    async def prune(self, older_than_days: int) -> int:
        before = self.database.clock() - timedelta(days=older_than_days)
        kept = [row for row in self.log if row["created_at"] >= before]
        gone = len(self.log) - len(kept)
        self.database.tables.routing_log = kept
        return gone


if TYPE_CHECKING:
    from butlers.switchboard.store import InboxQueue, OutboxQueue, RoutingLog

    def _implements(
        inbox: MemoryInboxStore, outbox: MemoryOutboxStore, routing: MemoryRoutingStore
    ) -> tuple[InboxQueue, OutboxQueue, RoutingLog]:
        return inbox, outbox, routing
