"""Files kept with their message, on a real PostgreSQL: an inbox message's attachments (stored
with it in one transaction, the same bytes after a crash, pruned with it), a voice note's
transcript replacing its audio, a message deferred for a while (and its conversation waiting
behind it), and the files of an outbox row."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime

import asyncpg
import pytest

from butlers.db import create_pool
from butlers.media import Attachment, checked
from butlers.switchboard.inbox import InboxStore, IncomingMessage
from butlers.switchboard.outbox import FILES_KEY, OutboxStore, Outgoing
from tests.test_media import ogg_opus, pdf, png

_ids = itertools.count(1)
MB = 1024 * 1024


@pytest.fixture
async def database(make_database, switchboard_template: str) -> str:
    return await make_database(switchboard_template)


@pytest.fixture
async def pools(pg_server, database: str) -> AsyncIterator[Callable[[], Awaitable[asyncpg.Pool]]]:
    """Pools of their own: one per switchboard process (or per start of one)."""
    opened: list[asyncpg.Pool] = []

    async def make() -> asyncpg.Pool:
        pool = await create_pool(pg_server, database)
        opened.append(pool)
        return pool

    yield make
    for pool in opened:
        await pool.close()


@pytest.fixture
async def store(pools) -> InboxStore:
    return InboxStore(await pools())


def files() -> tuple[Attachment, ...]:
    """A voice note, a photo and a PDF, checked as a channel checks them."""
    return (
        checked(ogg_opus(), "voice.ogg", max_bytes=MB),
        checked(png(4, 4), "receipt.png", max_bytes=MB),
        checked(pdf("Take 5 mg daily"), "prescription.pdf", max_bytes=MB),
    )


def incoming(
    conversation: str | None = "telegram:1",
    attachments: tuple[Attachment, ...] = (),
    *,
    external_id: str | None = None,
    text: str = "see attached",
) -> IncomingMessage:
    return IncomingMessage(
        "telegram",
        external_id or f"u{next(_ids)}",
        text,
        source_id="1",
        meta={"message_id": 7},
        conversation=conversation,
        attachments=attachments,
    )


async def queue(store: InboxStore, message: IncomingMessage) -> int:
    inbox_id = await store.accept(message, None)
    assert inbox_id is not None
    return inbox_id


async def claim(store: InboxStore, replica: str = "a") -> int | None:
    message = await store.claim_next(replica, 30)
    return None if message is None else message.id


async def finish(store: InboxStore, inbox_id: int, replica: str = "a") -> None:
    assert await store.finish(
        inbox_id, replica=replica, status="done", routed_to=None, reply="ok", error=None
    )


async def stored_files(store: InboxStore) -> int:
    return await store.pool.fetchval("SELECT count(*) FROM inbox_attachments")


# -- the inbox ---------------------------------------------------------------------------------


async def test_a_message_s_files_come_back_the_same_after_a_crash(pools) -> None:
    """Stored with the message; after the process died mid-work and started again (a new
    pool, requeue_interrupted), the message is claimed again with the very same bytes, in the
    sender's order, and its meta lists them without the files being read."""
    before = InboxStore(await pools())
    sent = files()
    inbox_id = await queue(before, incoming(attachments=sent))
    assert await claim(before) == inbox_id
    await before.pool.close()  # the process is gone, its message still `processing`

    after = InboxStore(await pools())
    assert await after.requeue_interrupted(["a"]) == 1
    message = await after.claim_next("a", 30)
    assert message is not None and message.id == inbox_id
    assert message.meta["attachments"] == [
        {"name": a.name, "mime_type": a.mime_type, "size": a.size, "kind": a.kind} for a in sent
    ]
    assert message.meta["message_id"] == 7  # the channel's own meta is kept
    assert await after.attachments(inbox_id) == list(sent)
    rows = await after.pool.fetch(
        "SELECT position, size, sha256 FROM inbox_attachments WHERE inbox_id = $1 "
        "ORDER BY position",
        inbox_id,
    )
    assert [tuple(r) for r in rows] == [
        (n, a.size, hashlib.sha256(a.data).hexdigest()) for n, a in enumerate(sent)
    ]


async def test_a_message_without_files_lists_none(store: InboxStore) -> None:
    inbox_id = await queue(store, incoming())
    assert await store.attachments(inbox_id) == []
    row = await store.get(inbox_id)
    assert row is not None and "attachments" not in row["meta"]


async def test_a_duplicate_stores_its_files_once(store: InboxStore) -> None:
    first = incoming(attachments=files(), external_id="update-1")
    assert await store.accept(first, None) is not None
    again = incoming(attachments=files()[:1], external_id="update-1")
    assert await store.accept(again, None) is None
    assert await stored_files(store) == 3
    assert await store.pool.fetchval("SELECT count(*) FROM inbox") == 1


async def test_a_message_whose_files_cannot_be_stored_is_not_stored(store: InboxStore) -> None:
    """One transaction: when a file's row is refused, the message is not there either (the
    channel does not acknowledge it, and it comes again), rather than a message missing its
    files."""
    await store.pool.execute(
        """CREATE FUNCTION refuse_files() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
               RAISE EXCEPTION 'inbox_attachments is refusing rows (test)';
           END $$"""
    )
    await store.pool.execute(
        """CREATE TRIGGER refuse_files AFTER INSERT ON inbox_attachments
           FOR EACH ROW EXECUTE FUNCTION refuse_files()"""
    )
    message = incoming(attachments=files(), external_id="update-2")
    with pytest.raises(asyncpg.RaiseError, match="refusing rows"):
        await store.accept(message, None)
    assert await store.pool.fetchval("SELECT count(*) FROM inbox") == 0
    await store.pool.execute("DROP TRIGGER refuse_files ON inbox_attachments")
    # Sent again (the channel's retry), it is stored whole.
    inbox_id = await queue(store, message)
    assert len(await store.attachments(inbox_id)) == 3


async def test_prune_takes_the_files_with_their_message(store: InboxStore) -> None:
    old = await queue(store, incoming("telegram:1", files()))
    waiting = await queue(store, incoming("telegram:2", files()[1:]))
    assert await claim(store) == old
    await finish(store, old)
    await store.pool.execute(
        "UPDATE inbox SET finished_at = now() - interval '40 days' WHERE id = $1", old
    )
    assert await store.prune(30) == 1
    assert await store.attachments(old) == []
    assert len(await store.attachments(waiting)) == 2  # still to be processed: kept
    assert await stored_files(store) == 2


async def test_transcribed_replaces_the_text_and_drops_the_audio(store: InboxStore) -> None:
    voice, photo, scan = files()
    inbox_id = await queue(store, incoming(attachments=(voice, photo, scan), text=""))
    assert await claim(store) == inbox_id
    assert await store.transcribed(
        inbox_id, replica="a", text="Log my weight: 75 kg", keep_audio=False
    )
    row = await store.get(inbox_id)
    assert row is not None
    assert row["text"] == "Log my weight: 75 kg"
    assert row["meta"]["voice"] is True
    assert [a["name"] for a in row["meta"]["attachments"]] == ["receipt.png", "prescription.pdf"]
    assert row["meta"]["message_id"] == 7
    assert await store.attachments(inbox_id) == [photo, scan]


async def test_transcribed_keeps_the_audio_when_configured(store: InboxStore) -> None:
    sent = files()
    inbox_id = await queue(store, incoming(attachments=sent))
    assert await claim(store) == inbox_id
    assert await store.transcribed(inbox_id, replica="a", text="heard", keep_audio=True)
    row = await store.get(inbox_id)
    assert row is not None and row["text"] == "heard" and row["meta"]["voice"] is True
    assert len(row["meta"]["attachments"]) == 3
    assert await store.attachments(inbox_id) == list(sent)


async def test_transcribed_only_while_the_claim_is_held(store: InboxStore) -> None:
    """Another process took the message over (or it is not claimed at all): its work counts,
    this one changes nothing."""
    inbox_id = await queue(store, incoming(attachments=files(), text="caption"))
    assert not await store.transcribed(inbox_id, replica="a", text="x", keep_audio=False)
    assert await claim(store, "b") == inbox_id
    assert not await store.transcribed(inbox_id, replica="a", text="x", keep_audio=False)
    row = await store.get(inbox_id)
    assert row is not None and row["text"] == "caption" and "voice" not in row["meta"]
    assert len(await store.attachments(inbox_id)) == 3


# -- deferring ---------------------------------------------------------------------------------


async def make_due(store: InboxStore, inbox_id: int) -> None:
    """The deferral's time has come (moved, rather than waited for)."""
    await store.pool.execute(
        "UPDATE inbox SET not_before = now() - interval '1 second' WHERE id = $1", inbox_id
    )


async def test_a_deferred_message_waits_and_its_conversation_behind_it(store: InboxStore) -> None:
    voice = await queue(store, incoming("telegram:1", files()[:1]))
    later_same_chat = await queue(store, incoming("telegram:1"))
    other_chat = await queue(store, incoming("telegram:2"))
    no_conversation = await queue(store, incoming(None))
    assert await claim(store) == voice

    assert await store.defer(voice, replica="a", delay_s=3600, error="transcription: 503")
    row = await store.get(voice)
    assert row is not None
    assert (row["status"], row["claimed_by"], row["lease_until"]) == ("queued", None, None)
    assert row["attempts"] == 0  # the deferred attempt does not count
    assert row["error"] == "transcription: 503"
    first_deferral = row["meta"]["deferred_since"]  # the database's clock, ISO 8601
    deferred_at = datetime.fromisoformat(first_deferral)
    assert row["received_at"] <= deferred_at <= await store.pool.fetchval("SELECT now()")

    # Not before its time; the same chat's later message waits behind it; others go on.
    assert await claim(store) == other_chat
    assert await claim(store) == no_conversation
    assert await claim(store) is None
    assert await claim(store, "b") is None  # nor for another process

    await make_due(store, voice)
    assert await claim(store, "b") == voice
    # Deferred again: the first deferral's time is kept (retry_hours count from it).
    assert await store.defer(voice, replica="b", delay_s=60, error="transcription: timeout")
    row = await store.get(voice)
    assert row is not None and row["meta"]["deferred_since"] == first_deferral
    assert row["error"] == "transcription: timeout"
    assert await claim(store) is None

    await make_due(store, voice)
    assert await claim(store) == voice
    assert await claim(store) is None  # the later message still waits for it to finish
    await finish(store, voice)
    assert await claim(store) == later_same_chat
    assert len(await store.attachments(voice)) == 1  # the same file, whatever the waits


async def test_defer_only_while_the_claim_is_held(store: InboxStore) -> None:
    inbox_id = await queue(store, incoming())
    assert not await store.defer(inbox_id, replica="a", delay_s=60, error="x")
    assert await claim(store, "b") == inbox_id
    assert not await store.defer(inbox_id, replica="a", delay_s=60, error="x")
    row = await store.get(inbox_id)
    assert row is not None and row["status"] == "processing" and row["claimed_by"] == "b"
    assert row["not_before"] is None and "deferred_since" not in row["meta"]


# -- the outbox --------------------------------------------------------------------------------


async def test_an_outbox_row_s_files_go_with_it(store: InboxStore) -> None:
    outbox = OutboxStore(store.pool)
    photo, scan = files()[1:]
    async with store.pool.acquire() as conn, conn.transaction():
        await outbox.add(
            conn,
            [
                Outgoing("reply", "telegram", "1", "before", meta={"reply_to": 3}),
                Outgoing("notification", "telegram", "1", "here", attachments=(photo, scan)),
                Outgoing("reply", "telegram", "1", "after"),
            ],
            None,
        )
    first = await outbox.claim("telegram", "r1", 60)
    assert first is not None and first.text == "before" and first.attachments == ()
    assert FILES_KEY not in first.meta and first.meta["reply_to"] == 3
    await outbox.sent(first.id, ["1"])

    second = await outbox.claim("telegram", "r1", 60)
    assert second is not None and second.text == "here"
    assert second.attachments == (photo, scan)
    assert second.meta[FILES_KEY] == 2
    count = "SELECT count(*) FROM outbox_attachments"
    assert await store.pool.fetchval(count) == 2
    await outbox.sent(second.id, ["2"])
    assert await store.pool.fetchval(count) == 0  # taken: not kept for retention_days

    third = await outbox.claim("telegram", "r1", 60)
    assert third is not None and third.text == "after" and third.attachments == ()
    await outbox.sent(third.id, ["3"])

    await store.pool.execute("UPDATE outbox SET created_at = now() - interval '40 days'")
    assert await outbox.prune(30) == 3
    assert await store.pool.fetchval("SELECT count(*) FROM outbox_attachments") == 0


async def test_outbox_files_are_written_with_the_rows_or_not_at_all(store: InboxStore) -> None:
    """In the caller's transaction: when it rolls back, neither rows nor files remain."""
    outbox = OutboxStore(store.pool)

    class Abandoned(Exception):
        pass

    with pytest.raises(Abandoned):
        async with store.pool.acquire() as conn, conn.transaction():
            await outbox.add(
                conn, [Outgoing("reply", "telegram", "1", "x", attachments=files()[1:])], None
            )
            raise Abandoned
    assert await store.pool.fetchval("SELECT count(*) FROM outbox") == 0
    assert await store.pool.fetchval("SELECT count(*) FROM outbox_attachments") == 0
