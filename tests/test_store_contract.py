"""The worker side's store contract (butlers.switchboard.store), one set of tests run against
both implementations: PostgreSQL (InboxStore, OutboxStore, RoutingStore on a fresh database)
and the in-memory double (butlers.switchboard.memory_store). What the worker, the outbox sender
and the notification desk rely on: dedupe, claim order and one message of a conversation at a
time, leases and their takeover, release and requeue, finish, deferral, files, the outbox's
order and retries, pruning, and a transaction's all-or-nothing.

No test depends on the clock moving: "due" is asked with delays in the past (a negative lease
or delay) and "not yet" with an hour ahead, so PostgreSQL's now() and the double's clock give
the same answers. The in-memory half needs no database and no process: it is in the fast lane.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest

from butlers.media import Attachment
from butlers.switchboard.inbox import IncomingMessage
from butlers.switchboard.memory_store import (
    MemoryDatabase,
    MemoryInboxStore,
    MemoryOutboxStore,
    MemoryRoutingStore,
)
from butlers.switchboard.outbox import HELD_KEY, OutboxStore, Outgoing
from butlers.switchboard.routing_store import RouteRecord
from butlers.switchboard.store import InboxQueue, OutboxQueue, Pool, RoutingLog

if TYPE_CHECKING:
    from butlers.db import PostgresServer

_ids = itertools.count(1)
HOUR = 3600.0
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 24  # what the store keeps: bytes, as given
OGG = b"OggS\x00\x02" + b"\x00" * 24


@dataclass
class Stores:
    inbox: InboxQueue
    outbox: OutboxQueue
    routing: RoutingLog
    pool: Pool
    # One discovery (its write to the registry): these butlers, the others stale.
    register: Callable[..., Awaitable[None]]


class TickingClock:
    """The double's clock for the contract: the real time, but strictly later at each read,
    as PostgreSQL's now() is in each new transaction."""

    def __init__(self) -> None:
        self.last = datetime.now(UTC)

    def __call__(self) -> datetime:
        self.last = max(datetime.now(UTC), self.last + timedelta(microseconds=1))
        return self.last


@pytest.fixture
def memory_stores() -> Stores:
    database = MemoryDatabase(clock=TickingClock())
    routing = MemoryRoutingStore(database)

    async def register(*names: str) -> None:
        routing.register(*names)

    return Stores(
        MemoryInboxStore(database), MemoryOutboxStore(database), routing, database, register
    )


@pytest.fixture(scope="module")
async def _postgres_pool(
    pg_server: PostgresServer, switchboard_template: str
) -> AsyncIterator[asyncpg.Pool]:
    """One database for the module's PostgreSQL half, emptied before each test (a TRUNCATE
    takes milliseconds, a database of its own per test half a second)."""
    from butlers.db import create_pool
    from tests.conftest import drop_databases

    name = f"t_contract_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(pg_server.dsn("postgres"))
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{switchboard_template}"')
    finally:
        await conn.close()
    pool = await create_pool(pg_server, name)
    try:
        yield pool
    finally:
        await pool.close()
        await drop_databases(pg_server, name)


@pytest.fixture
async def postgres_stores(_postgres_pool: asyncpg.Pool) -> Stores:
    from butlers.switchboard.inbox import InboxStore
    from butlers.switchboard.routing_store import RegistryEntry, RoutingStore

    pool = _postgres_pool
    await pool.execute(
        "TRUNCATE inbox, inbox_attachments, outbox, outbox_attachments, routing_log, "
        "butler_registry RESTART IDENTITY CASCADE"
    )
    routing = RoutingStore(pool)

    async def register(*names: str) -> None:
        await routing.record_discovery(
            [RegistryEntry(name, f"http://127.0.0.1/{name}", "", []) for name in names]
        )

    return Stores(InboxStore(pool), OutboxStore(pool), routing, pool, register)


# The PostgreSQL half is `pg` (its fixture is asked for by name: the marker cannot be read off
# the test's fixtures), the in-memory half in the fast lane.
@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.pg)])
def stores(request: pytest.FixtureRequest) -> Stores:
    return request.getfixturevalue(f"{request.param}_stores")


def incoming(
    conversation: str | None = "telegram:1",
    text: str = "hi",
    *,
    channel: str = "telegram",
    external_id: str | None = None,
    source_id: str = "1",
    attachments: tuple[Attachment, ...] = (),
    meta: dict[str, Any] | None = None,
) -> IncomingMessage:
    return IncomingMessage(
        channel,
        external_id or f"u{next(_ids)}",
        text,
        source_id=source_id,
        conversation=conversation,
        attachments=attachments,
        meta=meta or {},
    )


async def queued(stores: Stores, conversation: str | None = "telegram:1", **kw: Any) -> int:
    inbox_id = await stores.inbox.accept(incoming(conversation, **kw), None)
    assert inbox_id is not None
    return inbox_id


async def claimed_id(stores: Stores, replica: str = "r1", lease_s: float = HOUR) -> int | None:
    message = await stores.inbox.claim_next(replica, lease_s)
    return None if message is None else message.id


async def finish(stores: Stores, inbox_id: int, replica: str = "r1", **kw: Any) -> bool:
    outcome = {"status": "done", "routed_to": "general", "reply": "ok", "error": None} | kw
    return await stores.inbox.finish(inbox_id, replica=replica, **outcome)


async def status(stores: Stores, inbox_id: int) -> str:
    row = await stores.inbox.get(inbox_id)
    assert row is not None
    return row["status"]


# -- the inbox ------------------------------------------------------------------------------


async def test_accept_stores_once_per_channel_and_id(stores: Stores) -> None:
    first = await stores.inbox.accept(incoming(external_id="m-1", text="a\x00b"), {"t": "1"})
    assert first is not None
    assert await stores.inbox.accept(incoming(external_id="m-1", text="again"), None) is None
    other = await stores.inbox.accept(incoming(channel="email", external_id="m-1"), None)
    assert other is not None and other != first
    row = await stores.inbox.get(first)
    assert row is not None
    assert (row["status"], row["text"], row["attempts"], row["trace_context"]) == (
        "queued",
        "ab",  # NUL cannot be stored: gone
        0,
        {"t": "1"},
    )
    assert await stores.inbox.get(10**9) is None


async def test_claims_go_in_arrival_order_one_per_conversation(stores: Stores) -> None:
    a1 = await queued(stores, "telegram:a")
    a2 = await queued(stores, "telegram:a")
    b1 = await queued(stores, "telegram:b")
    message = await stores.inbox.claim_next("r1", HOUR)
    assert message is not None and (message.id, message.attempts) == (a1, 1)
    # a2 waits for a1, whichever replica asks; b1 does not.
    assert await claimed_id(stores, "r2") == b1
    assert await claimed_id(stores, "r2") is None
    row = await stores.inbox.get(a1)
    assert row is not None and (row["status"], row["claimed_by"]) == ("processing", "r1")
    assert await finish(stores, a1)
    assert await claimed_id(stores, "r2") == a2


async def test_messages_without_a_conversation_are_not_serialised(stores: Stores) -> None:
    first, second = await queued(stores, None), await queued(stores, None)
    assert [await claimed_id(stores), await claimed_id(stores)] == [first, second]


async def test_a_lease_that_ran_out_is_taken_over_and_the_old_holder_loses_it(
    stores: Stores,
) -> None:
    a1 = await queued(stores, "telegram:a")
    a2 = await queued(stores, "telegram:a")
    assert await claimed_id(stores, "r1", lease_s=-HOUR) == a1  # its process died
    # The conversation's older message is taken over first, not skipped.
    message = await stores.inbox.claim_next("r2", HOUR)
    assert message is not None and (message.id, message.attempts) == (a1, 2)
    assert await stores.inbox.renew("r1", [a1], HOUR) == set()
    assert await stores.inbox.renew("r2", [a1], HOUR) == {a1}
    assert not await finish(stores, a1, "r1")  # its outcome does not count
    assert await claimed_id(stores, "r3") is None  # a2 still waits behind a1's live lease
    assert await finish(stores, a1, "r2")
    assert await stores.inbox.renew("r2", [a1], HOUR) == {a1}  # finished by itself: held
    assert await claimed_id(stores, "r3") == a2


async def test_a_replica_does_not_claim_what_it_is_still_at_work_on(stores: Stores) -> None:
    """Its lease ran out while it worked on the message (the database could not renew it):
    claimed again by the same replica, a second task asked its butler twice, and each claim
    counted an attempt (reviews). What it is at work on is left out; another replica may
    still take it over."""
    a1 = await queued(stores, "telegram:a")
    assert await claimed_id(stores, "r1", lease_s=-HOUR) == a1
    assert await stores.inbox.claim_next("r1", HOUR, exclude=[a1]) is None
    other = await stores.inbox.claim_next("r2", HOUR)
    assert other is not None and (other.id, other.attempts) == (a1, 2)


async def test_a_live_lease_is_not_taken_over(stores: Stores) -> None:
    await queued(stores, "telegram:a")
    assert await claimed_id(stores, "r1") is not None
    assert await claimed_id(stores, "r2") is None


async def test_requeue_takes_back_only_this_replicas_interrupted_messages(
    stores: Stores,
) -> None:
    mine = [await queued(stores, "telegram:a"), await queued(stores, "telegram:b")]
    theirs = await queued(stores, "telegram:c")
    assert {await claimed_id(stores, "r1"), await claimed_id(stores, "r1")} == set(mine)
    assert await claimed_id(stores, "r2") == theirs
    assert await stores.inbox.requeue_interrupted(["r1"]) == 2
    for inbox_id in mine:
        row = await stores.inbox.get(inbox_id)
        assert row is not None
        assert (row["status"], row["claimed_by"], row["attempts"]) == ("queued", None, 1)
    assert await status(stores, theirs) == "processing"
    message = await stores.inbox.claim_next("r1", HOUR)
    assert message is not None and (message.id, message.attempts) == (mine[0], 2)


async def test_a_names_claimants_under_way_and_requeueing_only_those_given(
    stores: Stores,
) -> None:
    """A process claims as `name/<random>` (butlers.switchboard.process_name); a restart
    asks who of its name has messages under way (the bare name too: claims of older
    releases), not a longer name nor another, and puts back only the claimants it gives."""
    names = ["host:8100/aa", "host:8100", "host:8100/bb", "host:81000/cc", "host:8101/dd"]
    ids = [await queued(stores, f"telegram:{n}") for n in range(len(names))]
    for name, inbox_id in zip(names, ids, strict=True):
        assert await claimed_id(stores, name) == inbox_id
    under_way = await stores.inbox.claimants_under_way("host:8100")
    assert sorted(under_way) == ["host:8100", "host:8100/aa", "host:8100/bb"]
    assert await stores.inbox.requeue_interrupted(["host:8100", "host:8100/aa"]) == 2
    statuses = [await status(stores, i) for i in ids]
    assert statuses == ["queued", "queued", "processing", "processing", "processing"]
    assert await stores.inbox.claimants_under_way("host:8100") == ["host:8100/bb"]


async def test_release_hands_back_in_place_without_counting_the_attempt(stores: Stores) -> None:
    a1 = await queued(stores, "telegram:a")
    await queued(stores, "telegram:a")
    assert await claimed_id(stores, "r1") == a1
    assert await stores.inbox.release("r2", [a1]) == 0  # not its own
    assert await stores.inbox.release("r1", [a1]) == 1
    message = await stores.inbox.claim_next("r2", HOUR)
    assert message is not None and (message.id, message.attempts) == (a1, 1)


@pytest.mark.parametrize("outcome", ["done", "failed", "skipped"])
async def test_finish_records_the_outcome_once(stores: Stores, outcome: str) -> None:
    inbox_id = await queued(stores)
    assert await claimed_id(stores) == inbox_id
    assert not await finish(stores, inbox_id, "r2", status=outcome)
    assert await finish(
        stores,
        inbox_id,
        status=outcome,
        routed_to=None,
        reply="the reply",
        error="why",
        classified_via="triage",
    )
    row = await stores.inbox.get(inbox_id)
    assert row is not None
    assert {k: row[k] for k in ("status", "routed_to", "reply", "error", "classified_via")} == {
        "status": outcome,
        "routed_to": None,
        "reply": "the reply",
        "error": "why",
        "classified_via": "triage",
    }
    assert row["finished_at"] is not None and row["lease_until"] is None
    assert not await finish(stores, inbox_id)  # finished: not again
    assert await claimed_id(stores) is None


async def test_a_deferred_message_waits_with_its_conversation(stores: Stores) -> None:
    a1 = await queued(stores, "telegram:a")
    a2 = await queued(stores, "telegram:a")
    b1 = await queued(stores, "telegram:b")
    assert await claimed_id(stores) == a1
    assert not await stores.inbox.defer(a1, replica="r2", delay_s=HOUR, error="x")
    assert await stores.inbox.defer(a1, replica="r1", delay_s=HOUR, error="busy", timed_out=True)
    row = await stores.inbox.get(a1)
    assert row is not None
    assert (row["status"], row["attempts"], row["error"], row["claimed_by"]) == (
        "queued",
        0,
        "busy",
        None,
    )
    assert datetime.fromisoformat(row["meta"]["deferred_since"]).tzinfo is not None
    assert row["meta"]["timeouts"] == 1
    assert await claimed_id(stores) == b1  # a1 is not due, and a2 waits behind it
    assert await claimed_id(stores) is None
    assert not await stores.inbox.defer(a1, replica="r1", delay_s=-1, error="x")  # not held
    assert await status(stores, a2) == "queued"


async def test_a_deferral_that_is_due_is_claimed_again_and_keeps_its_first_time(
    stores: Stores,
) -> None:
    a1 = await queued(stores, "telegram:a")
    a2 = await queued(stores, "telegram:a")
    assert await claimed_id(stores) == a1
    assert await stores.inbox.defer(a1, replica="r1", delay_s=-1, error="x", timed_out=True)
    first_since = (await stores.inbox.get(a1) or {})["meta"]["deferred_since"]
    message = await stores.inbox.claim_next("r2", HOUR)  # due: before a2, by anyone
    assert message is not None and (message.id, message.attempts) == (a1, 1)
    assert message.meta["timeouts"] == 1
    assert await stores.inbox.defer(a1, replica="r2", delay_s=-1, error="y", timed_out=True)
    row = await stores.inbox.get(a1)
    assert row is not None
    assert (row["meta"]["deferred_since"], row["meta"]["timeouts"]) == (first_since, 2)
    assert await claimed_id(stores, "r2") == a1
    assert await stores.inbox.defer(a1, replica="r2", delay_s=-1, error="z")
    assert (await stores.inbox.get(a1) or {})["meta"]["timeouts"] == 0  # not a timeout
    assert await claimed_id(stores, "r2") == a1
    assert await finish(stores, a1, "r2")
    assert await claimed_id(stores, "r2") == a2


async def test_files_are_stored_with_the_message_and_audio_goes_once_heard(
    stores: Stores,
) -> None:
    photo, voice = Attachment("p.png", "image/png", PNG), Attachment("v.ogg", "audio/ogg", OGG)
    inbox_id = await queued(stores, attachments=(photo, voice), external_id="with-files")
    assert await stores.inbox.accept(incoming(external_id="with-files"), None) is None
    row = await stores.inbox.get(inbox_id)
    assert row is not None
    assert [(a["name"], a["kind"], a["size"]) for a in row["meta"]["attachments"]] == [
        ("p.png", "image", len(PNG)),
        ("v.ogg", "audio", len(OGG)),
    ]
    assert [(a.name, a.data) for a in await stores.inbox.attachments(inbox_id)] == [
        ("p.png", PNG),
        ("v.ogg", OGG),
    ]
    assert await claimed_id(stores) == inbox_id
    assert not await stores.inbox.transcribed(
        inbox_id, replica="r2", text="heard", keep_audio=False
    )
    assert await stores.inbox.transcribed(inbox_id, replica="r1", text="heard", keep_audio=False)
    row = await stores.inbox.get(inbox_id)
    assert row is not None and row["text"] == "heard"
    assert row["meta"]["voice"] is True and row["meta"]["transcribed"] is True
    assert [a["name"] for a in row["meta"]["attachments"]] == ["p.png"]
    assert [a.name for a in await stores.inbox.attachments(inbox_id)] == ["p.png"]


def album_part(
    n: int,
    album: str = "g1",
    conversation: str = "telegram:1",
    text: str = "",
    data: bytes = PNG,
    **kw: Any,
) -> IncomingMessage:
    """Photo `n` of an album, as the Telegram intake hands it over."""
    return replace(
        incoming(conversation, text, attachments=(Attachment(f"p{n}.png", "image/png", data),)),
        album=album,
        **kw,
    )


async def test_an_albums_parts_are_answered_as_its_first_message(stores: Stores) -> None:
    first = await stores.inbox.accept(album_part(1, text="Which is best?"), None)
    parts = [
        await stores.inbox.accept(album_part(2, data=PNG + b"2"), None),
        await stores.inbox.accept(album_part(3, text="or this one", data=PNG + b"3"), None),
    ]
    assert first is not None and None not in parts
    other_album = await stores.inbox.accept(album_part(4, album="g2"), None)
    other_chat = await stores.inbox.accept(album_part(5, conversation="telegram:2"), None)
    assert len({first, *parts, other_album, other_chat}) == 5  # a row each

    row = await stores.inbox.get(first)
    assert row is not None and row["text"] == "Which is best?\nor this one"
    assert [a["name"] for a in row["meta"]["attachments"]] == ["p1.png", "p2.png", "p3.png"]
    assert [(a.name, a.data) for a in await stores.inbox.attachments(first)] == [
        ("p1.png", PNG),
        ("p2.png", PNG + b"2"),
        ("p3.png", PNG + b"3"),
    ]
    for part in parts:
        row = await stores.inbox.get(part)
        assert row is not None
        assert (row["status"], row["meta"]["album_of"]) == ("done", first)
        assert await stores.inbox.attachments(part) == []
    # A redelivered part is a duplicate, whether it was joined or is the first.
    part_2 = album_part(2)
    seen = (await stores.inbox.get(parts[0]) or {})["external_id"]
    assert await stores.inbox.accept(replace(part_2, external_id=seen), None) is None
    assert len(await stores.inbox.attachments(first)) == 3

    # The first message goes as one; the parts are never claimed, and are neither history
    # nor messages the sender sent.
    claimed = [await stores.inbox.claim_next("r1", HOUR) for _ in range(3)]
    assert [m.id if m else None for m in claimed] == [first, other_chat, None]
    assert claimed[0] is not None and claimed[0].earlier_from_sender == 0
    assert await finish(stores, first)
    assert await claimed_id(stores) == other_album  # its chat's next message, after the album
    assert await finish(stores, other_album)
    later = await queued(stores, "telegram:1", text="thanks")
    message = await stores.inbox.claim_next("r1", HOUR)
    assert message is not None and message.id == later
    history = await stores.inbox.history(message, 10)
    assert [h["text"] for h in history] == ["Which is best?\nor this one", ""]
    assert message.earlier_from_sender == 3  # the album, the other album, the other chat
    # What the channels ask before fetching a file counts the same (and this one too).
    assert await stores.inbox.sent_last_hour("telegram", "1") == 4


async def test_an_albums_first_message_waits_for_the_rest(stores: Stores) -> None:
    first = await stores.inbox.accept(album_part(1), None, album_wait_s=HOUR)
    elsewhere = await queued(stores, "telegram:2")
    assert await claimed_id(stores) == elsewhere  # the album waits; other chats do not
    assert await claimed_id(stores) is None
    # The latest part says how long: more to come, then the last one.
    assert await stores.inbox.accept(album_part(2), None, album_wait_s=HOUR) is not None
    assert await claimed_id(stores) is None
    assert await stores.inbox.accept(album_part(3), None, album_wait_s=-1) is not None
    assert await claimed_id(stores) == first
    row = await stores.inbox.get(first or 0)
    assert row is not None and len(row["meta"]["attachments"]) == 3


async def test_a_dropped_part_ends_the_wait_for_it(stores: Stores) -> None:
    """The first message was told more would come (an hour's wait); the part that came next
    was refused once downloaded: dropped, it sets the wait as a part would, and nothing of
    the first message changes. A part of no waiting album, or put back for a while, does
    nothing to it."""
    first = await stores.inbox.accept(album_part(1, text="look"), None, album_wait_s=HOUR)
    assert first is not None and await claimed_id(stores) is None
    dropped = album_part(2, text="refused", data=b"MZ")
    assert await stores.inbox.album_part_dropped(replace(dropped, attachments=()), -1)
    row = await stores.inbox.get(first)
    assert row is not None and row["text"] == "look"
    assert [a["name"] for a in row["meta"]["attachments"]] == ["p1.png"]
    assert "voice" not in row["meta"]
    assert await claimed_id(stores) == first
    # No album waiting (the first is claimed now), or no album at all: nothing to do.
    assert not await stores.inbox.album_part_dropped(album_part(3), -1)
    assert not await stores.inbox.album_part_dropped(replace(album_part(4), album=None), -1)
    # A first message put back for an hour keeps its hour.
    assert await stores.inbox.defer(first, replica="r1", delay_s=HOUR, error="svc down")
    assert await stores.inbox.album_part_dropped(album_part(5), -1)
    assert await claimed_id(stores) is None
    # A full first message (max_files) waits for no part: a dropped one lets it start now.
    full = await stores.inbox.accept(
        album_part(6, album="g3", conversation="telegram:3"), None, album_wait_s=HOUR, max_files=1
    )
    assert full is not None
    seventh = album_part(7, album="g3", conversation="telegram:3")
    assert await stores.inbox.album_part_dropped(seventh, HOUR, max_files=1)
    assert await claimed_id(stores) == full
    # Nothing of the dropped part was stored: its channel id is free.
    plain = replace(dropped, album=None, attachments=(), conversation="telegram:2")
    assert await stores.inbox.accept(plain, None) is not None


async def test_a_full_first_message_waits_for_no_more_parts(stores: Stores) -> None:
    """More photos were said to follow, but the first message took all it may: the next part
    starts a message of its own, and the full one may start now."""
    ids = [
        await stores.inbox.accept(album_part(n), None, album_wait_s=HOUR, max_files=2)
        for n in (1, 2, 3)
    ]
    assert [await status(stores, i or 0) for i in ids] == ["queued", "done", "queued"]
    assert await claimed_id(stores) == ids[0]
    assert await claimed_id(stores) is None  # the next waits for the rest of the album


async def test_a_part_does_not_bring_forward_a_message_put_back_for_a_while(
    stores: Stores,
) -> None:
    """Deferred for an hour (its voice service failing), the first message takes a part but
    keeps its time; a full one keeps it too."""
    first = await stores.inbox.accept(album_part(1), None, max_files=2)
    assert first is not None and await claimed_id(stores) == first
    assert await stores.inbox.defer(first, replica="r1", delay_s=HOUR, error="svc down")
    assert await stores.inbox.accept(album_part(2), None, album_wait_s=-1, max_files=2)
    assert await claimed_id(stores) is None
    later = await stores.inbox.accept(album_part(3), None, album_wait_s=-1, max_files=2)
    assert later is not None and await status(stores, later) == "queued"  # the first is full
    assert await claimed_id(stores) is None  # it keeps its hour; the next waits behind it


async def test_a_joined_part_is_a_row_of_its_own_not_a_copy_of_the_first(stores: Stores) -> None:
    """The first message claimed and put back with an error (its voice service failing):
    a part's row says nothing of that, and keeps its own trace context."""
    first = await stores.inbox.accept(album_part(1), {"traceparent": "first"})
    assert first is not None and await claimed_id(stores) == first
    assert await stores.inbox.defer(first, replica="r1", delay_s=HOUR, error="svc down")
    part = await stores.inbox.accept(album_part(2), {"traceparent": "part"})
    row = await stores.inbox.get(part or 0)
    assert row is not None
    assert {k: row[k] for k in ("status", "error", "attempts", "claimed_by", "lease_until")} == {
        "status": "done",
        "error": None,
        "attempts": 0,
        "claimed_by": None,
        "lease_until": None,
    }
    assert (row["trace_context"], row["classified_via"], row["meta"]["album_of"]) == (
        {"traceparent": "part"},
        "album",
        first,
    )
    assert row["finished_at"] is not None and row["received_at"] is not None


async def test_an_audio_part_does_not_join_a_message_already_heard(stores: Stores) -> None:
    """Its voice notes transcribed, then handed back (a process stopping): an audio part
    joining it would never be heard (the transcript is taken as done), so a part is a message
    of its own there."""
    voice = Attachment("a1.ogg", "audio/ogg", OGG)
    first = await stores.inbox.accept(replace(incoming(attachments=(voice,)), album="g1"), None)
    assert first is not None and await claimed_id(stores) == first
    assert await stores.inbox.transcribed(first, replica="r1", text="heard", keep_audio=True)
    assert await stores.inbox.release("r1", [first]) == 1
    audio = replace(album_part(2), attachments=(Attachment("a2.ogg", "audio/ogg", OGG + b"2"),))
    second = await stores.inbox.accept(audio, None)
    assert second is not None and await status(stores, second) == "queued"
    assert [a.name for a in await stores.inbox.attachments(second)] == ["a2.ogg"]
    assert [a.name for a in await stores.inbox.attachments(first)] == ["a1.ogg"]


async def test_an_album_past_max_files_or_its_first_message_starts_anew(stores: Stores) -> None:
    ids = [await stores.inbox.accept(album_part(n), None, max_files=2) for n in range(1, 5)]
    rows = [await stores.inbox.get(i or 0) for i in ids]
    assert [r["status"] if r else None for r in rows] == ["queued", "done", "queued", "done"]
    assert rows[1] is not None and rows[1]["meta"]["album_of"] == ids[0]
    assert rows[3] is not None and rows[3]["meta"]["album_of"] == ids[2]
    assert [len(await stores.inbox.attachments(i or 0)) for i in ids] == [2, 0, 2, 0]
    # A part that comes once the first message was taken is a message of its own.
    assert await claimed_id(stores) == ids[0]
    assert await finish(stores, ids[0])
    assert await claimed_id(stores) == ids[2]
    late = await stores.inbox.accept(album_part(5), None)
    assert late is not None and await status(stores, late) == "queued"
    assert len(await stores.inbox.attachments(late)) == 1


async def test_album_parts_arriving_at_once_make_one_message(stores: Stores) -> None:
    """Webhook posts come concurrently: whichever is stored first, the others join it."""
    ids = await asyncio.gather(*(stores.inbox.accept(album_part(n), None) for n in range(6)))
    statuses = [await status(stores, i or 0) for i in ids]
    assert sorted(statuses) == ["done"] * 5 + ["queued"], statuses
    [first] = [i for i, st in zip(ids, statuses, strict=True) if st == "queued"]
    assert len(await stores.inbox.attachments(first or 0)) == 6


async def test_history_is_the_conversations_earlier_answered_messages(stores: Stores) -> None:
    ids = [
        await queued(
            stores,
            "telegram:a",
            text=f"m{n}",
            meta={"forwarded_from": "Mallory"} if n == 2 else None,
        )
        for n in range(4)
    ]
    await queued(stores, "telegram:b", text="elsewhere")
    for n, inbox_id in enumerate(ids[:3]):
        assert await claimed_id(stores) == inbox_id
        assert await finish(stores, inbox_id, status="failed" if n == 1 else "done")
    message = await stores.inbox.claim_next("r1", HOUR)
    assert message is not None and message.id == ids[3]
    history = await stores.inbox.history(message, 5)
    assert [(h["text"], h["routed_to"], h["reply"]) for h in history] == [
        ("m0", "general", "ok"),
        ("m2", "general", "ok"),
    ]
    assert [h["text"] for h in await stores.inbox.history(message, 1)] == ["m2"]
    assert [h["forwarded_from"] for h in history] == [None, "Mallory"]  # whose words they were
    last = await stores.inbox.last_of_conversation("telegram:a")
    assert last is not None and last.id == ids[3]
    assert await stores.inbox.last_of_conversation("telegram:none") is None


async def test_the_claim_counts_the_senders_last_hour(stores: Stores) -> None:
    first = await queued(stores, None, source_id="7")
    await queued(stores, None, source_id="8")
    second = await queued(stores, None, source_id="7")
    message = await stores.inbox.claim_next("r1", HOUR)
    assert message is not None and message.id == first
    assert (message.earlier_from_sender, message.sender_told) == (0, False)
    assert await finish(stores, first, status="skipped")
    await claimed_id(stores)  # the other sender's
    message = await stores.inbox.claim_next("r1", HOUR)
    assert message is not None and message.id == second
    assert (message.earlier_from_sender, message.sender_told) == (1, True)
    counts = [await stores.inbox.sent_last_hour("telegram", who) for who in ("7", "8", "9")]
    assert counts == [2, 1, 0]
    assert await stores.inbox.sent_last_hour("email", "7") == 0


async def test_a_failed_intake_is_kept_as_a_failed_row(stores: Stores) -> None:
    message = incoming(external_id="broken", text="the content")
    inbox_id = await stores.inbox.record_failed(message, "cannot store")
    assert inbox_id is not None
    assert await stores.inbox.record_failed(message, "again") is None
    row = await stores.inbox.get(inbox_id)
    assert row is not None
    assert (row["status"], row["text"], row["error"]) == ("failed", "", "cannot store")
    assert row["finished_at"] is not None
    assert await claimed_id(stores) is None


async def test_prune_deletes_only_finished_messages(stores: Stores) -> None:
    done = await queued(stores, None)
    waiting = await queued(stores, None)
    assert await claimed_id(stores) == done
    assert await finish(stores, done)
    assert await stores.inbox.prune(1) == 0  # finished just now: kept for a day
    assert await stores.inbox.prune(-1) == 1  # "older than tomorrow"
    assert await stores.inbox.get(done) is None
    assert await status(stores, waiting) == "queued"


# -- a transaction across the stores --------------------------------------------------------


def reply(recipient: str = "1", text: str = "hello", **kw: Any) -> Outgoing:
    return Outgoing(kind="reply", channel="telegram", recipient=recipient, text=text, **kw)


async def add(stores: Stores, *messages: Outgoing) -> None:
    async with stores.pool.acquire() as conn, conn.transaction():
        await stores.outbox.add(conn, messages, None)


async def test_a_transaction_finishes_and_queues_the_reply_together_or_not_at_all(
    stores: Stores,
) -> None:
    inbox_id = await queued(stores)
    assert await claimed_id(stores) == inbox_id
    with pytest.raises(RuntimeError, match="crash"):
        async with stores.pool.acquire() as conn, conn.transaction():
            assert await finish(stores, inbox_id, conn=conn)
            await stores.outbox.add(conn, [reply(inbox_id=inbox_id)], None)
            raise RuntimeError("crash")
    assert await status(stores, inbox_id) == "processing"
    assert await stores.outbox.claim("telegram", "r1", HOUR) is None
    async with stores.pool.acquire() as conn, conn.transaction():
        assert await finish(stores, inbox_id, conn=conn)
        await stores.outbox.add(conn, [reply(inbox_id=inbox_id)], None)
    assert await status(stores, inbox_id) == "done"
    delivery = await stores.outbox.claim("telegram", "r1", HOUR)
    assert delivery is not None and delivery.inbox_id == inbox_id


# -- the outbox ------------------------------------------------------------------------------


async def test_the_outbox_sends_in_order_and_waits_for_a_row_not_taken(stores: Stores) -> None:
    await add(stores, reply("x", "x1"), reply("x", "x2"), reply("y", "y1"))
    first = await stores.outbox.claim("telegram", "r1", HOUR)
    assert first is not None and (first.text, first.attempts) == ("x1", 1)
    assert await stores.outbox.claim("email", "r1", HOUR) is None
    await stores.outbox.sent(first.id, ["101"])
    second = await stores.outbox.claim("telegram", "r1", HOUR)
    assert second is not None and second.text == "x2"
    # Not taken: the channel's later rows wait for it, whoever they go to.
    await stores.outbox.later(second.id, "telegram is down", HOUR)
    assert await stores.outbox.claim("telegram", "r1", HOUR) is None
    due_in = await stores.outbox.head_due_in_s("telegram")
    assert due_in is not None and HOUR - 60 < due_in <= HOUR
    # Refused for its recipient only: only that recipient's rows wait.
    await stores.outbox.later(second.id, "mailbox full", HOUR, held_for_recipient=True)
    third = await stores.outbox.claim("telegram", "r1", HOUR)
    assert third is not None and third.text == "y1"
    await stores.outbox.failed(third.id, "refused")
    assert await stores.outbox.claim("telegram", "r1", HOUR) is None
    await stores.outbox.later(second.id, "again", -1)  # due
    assert await stores.outbox.head_due_in_s("telegram") == 0
    again = await stores.outbox.claim("telegram", "r1", HOUR)
    assert again is not None and (again.id, again.attempts) == (second.id, 2)
    assert HELD_KEY not in again.meta
    await stores.outbox.sent(again.id, ["102"])


async def test_nothing_to_send_is_no_due_time(stores: Stores) -> None:
    """The outbox sender waits IDLE_POLL_S (or a wake-up) when there is nothing to send; a
    due time of 0 made it ask again at once, for ever (PostgreSQL's greatest(0, NULL) is 0:
    an idle leader's sender ran ~6,000 claims a second, measured)."""
    assert await stores.outbox.head_due_in_s("telegram") is None
    await add(stores, reply("x"))
    delivery = await stores.outbox.claim("telegram", "r1", HOUR)
    assert delivery is not None
    await stores.outbox.sent(delivery.id, ["1"])
    assert await stores.outbox.head_due_in_s("telegram") is None


async def test_a_row_being_sent_blocks_its_recipient_and_is_sent_again_by_the_next_leader(
    stores: Stores,
) -> None:
    await add(stores, reply("x", "x1"), reply("x", "x2"))
    first = await stores.outbox.claim("telegram", "r1", HOUR)
    assert first is not None
    # Not at once by its own sender either: its send, cut short or unrecorded (the database
    # away when it was to be marked sent), may have reached the channel: taken again at
    # once, it went out twice (a red team).
    assert await stores.outbox.claim("telegram", "r1", HOUR) is None
    # Once its lease is up, it is sent again, first.
    assert await stores.outbox.renew(first.id, "r1", -1)  # (its lease up)
    again = await stores.outbox.claim("telegram", "r1", HOUR)
    assert again is not None and (again.id, again.attempts) == (first.id, 2)


async def test_another_replica_takes_a_row_being_sent_only_once_its_lease_is_up(
    stores: Stores,
) -> None:
    """A leader whose lock's connection alone was cut sends on until it notices, while the
    next leader leads a second later: had it taken the row at once, it went out twice (a
    red team). It waits the lease out, the other's rows to other people too."""
    await add(stores, reply("x", "x1"), reply("x", "x2"), reply("y", "y1"))
    first = await stores.outbox.claim("telegram", "r1", HOUR)
    assert first is not None and first.text == "x1"
    assert await stores.outbox.claim("telegram", "r2", HOUR) is None
    due_in = await stores.outbox.head_due_in_s("telegram")
    assert due_in is not None and HOUR - 60 < due_in <= HOUR
    await stores.outbox.sent(first.id, ["1"])  # the first leader finished it
    second = await stores.outbox.claim("telegram", "r2", -1)  # a lease already up
    assert second is not None and second.text == "x2"
    # r2 died with it: r1, leading again, takes it as its lease is up, not before.
    assert await stores.outbox.claim("telegram", "r1", HOUR) is not None


async def test_a_sender_whose_lease_ran_out_changes_nothing_and_a_renewed_one_keeps_it(
    stores: Stores,
) -> None:
    """A leader paused mid-send past its lease: another sent the row meanwhile; the first,
    woken, put it back to `pending` (its request timed out) and it went out again, or
    failed a row that was sent (a review). Only the row's sender may put it back or fail
    it; one that renews its lease while it sends keeps the row."""
    await add(stores, reply("x", "x1", butler="general"))
    first = await stores.outbox.claim("telegram", "r1", -1)  # its lease ran out at once
    assert first is not None
    again = await stores.outbox.claim("telegram", "r2", HOUR)
    assert again is not None and (again.id, again.attempts) == (first.id, 2)
    assert not await stores.outbox.renew(first.id, "r1", HOUR)
    await stores.outbox.sent(again.id, ["1"])
    await stores.outbox.later(first.id, "timed out", -1, sender="r1")
    assert await stores.outbox.claim("telegram", "r2", HOUR) is None  # not sent again
    await stores.outbox.failed(first.id, "gave up", sender="r1")
    assert await stores.outbox.butler_answering("telegram", "x", ["1"], 7) == "general"  # sent
    # Renewed while it sends: nobody else takes it, and its sender may put it back.
    await add(stores, reply("y", "y1"))
    held = await stores.outbox.claim("telegram", "r1", -1)
    assert held is not None and await stores.outbox.renew(held.id, "r1", HOUR)
    assert await stores.outbox.claim("telegram", "r2", HOUR) is None
    await stores.outbox.later(held.id, "down", -1, sender="r1")
    back = await stores.outbox.claim("telegram", "r2", HOUR)
    assert back is not None and back.id == held.id


async def test_a_rows_files_come_with_it(stores: Stores) -> None:
    photo = Attachment("p.png", "image/png", PNG)
    await add(stores, reply(text="see", attachments=(photo,)), reply(text="plain"))
    with_file = await stores.outbox.claim("telegram", "r1", HOUR)
    assert with_file is not None
    assert [(a.name, a.data) for a in with_file.attachments] == [("p.png", PNG)]
    await stores.outbox.sent(with_file.id, ["1"])
    plain = await stores.outbox.claim("telegram", "r1", HOUR)
    assert plain is not None and plain.attachments == ()


async def test_thread_affinity_finds_the_butler_whose_sent_message_is_answered(
    stores: Stores,
) -> None:
    await add(stores, reply("x", butler="health"), reply("x", butler="general"))
    for sent_id in ("501", "502"):
        delivery = await stores.outbox.claim("telegram", "r1", HOUR)
        assert delivery is not None
        await stores.outbox.sent(delivery.id, [sent_id])
    answering = stores.outbox.butler_answering
    assert await answering("telegram", "x", ["501"], 7) == "health"
    assert await answering("telegram", "x", ["999", "502"], 7) == "general"
    assert await answering("telegram", "y", ["501"], 7) is None
    assert await answering("telegram", "x", ["501"], 0) is None
    assert await answering("telegram", "x", [], 7) is None


async def test_notifications_are_counted_once_per_notification(stores: Stores) -> None:
    def note(text: str) -> Outgoing:
        return Outgoing("notification", "telegram", "1", text, butler="health", conversation="c")

    await add(stores, note("part 1"), note("part 2"))  # one notification, split in two rows
    await add(stores, note("another"))
    await add(stores, reply(butler="health"))
    assert await stores.outbox.notifications_last_hour("health") == 2
    assert await stores.outbox.notifications_last_hour("general") == 0


async def test_outbox_prune_keeps_what_is_still_to_send(stores: Stores) -> None:
    await add(stores, reply("x"), reply("y"), reply("z"))
    sent = await stores.outbox.claim("telegram", "r1", HOUR)
    assert sent is not None
    await stores.outbox.sent(sent.id, ["1"])
    failed = await stores.outbox.claim("telegram", "r1", HOUR)
    assert failed is not None
    await stores.outbox.failed(failed.id, "refused")
    assert await stores.outbox.prune(1) == 0
    assert await stores.outbox.prune(-1) == 2
    left = await stores.outbox.claim("telegram", "r1", HOUR)
    assert left is not None and left.recipient == "z"


# -- the registry and the routing log --------------------------------------------------------


async def test_the_registry_and_the_routing_log(stores: Stores) -> None:
    await stores.register("health", "general")
    await stores.register("general")  # health missed by the last discovery: stale
    registry = await stores.routing.registry()
    assert [(b["name"], b["stale"], b["is_switchboard"]) for b in registry] == [
        ("general", False, False),
        ("health", True, False),
    ]
    record = RouteRecord("telegram", "1", "health", "trigger", "hi", None, True, None, 5)
    await stores.routing.record_route(record)
    assert await stores.routing.prune(1) == 0
    assert await stores.routing.prune(-1) == 1


async def test_the_butlers_a_message_was_handed_to_are_named_in_order(stores: Stores) -> None:
    """What the worker asks of a message claimed again (its process interrupted): whom it was
    handed to, and whether they answered. Other tools and other messages' routes do not
    count, nor what came before `since` (the operator's requeue)."""
    await stores.register("health", "general")

    def route(inbox_id: int | None, butler: str, tool: str = "trigger", ok: bool = True):
        return RouteRecord("telegram", "1", butler, tool, "hi", None, ok, None, 5, inbox_id)

    mine, other = await queued(stores), await queued(stores, "telegram:2")
    assert await stores.routing.handed_before(mine, None) == []
    for record in (
        route(mine, "health"),
        route(mine, "general", ok=False),
        route(mine, "relationship", ok=False),
        route(mine, "general", tool="state_get"),
        route(other, "general"),
        route(None, "general"),
        route(mine, "general"),
        route(mine, "health"),
    ):
        await stores.routing.record_route(record)
    assert await stores.routing.handed_before(mine, None) == [
        ("health", True),
        ("general", True),  # it failed once, then answered
        ("relationship", False),
    ]
    assert await stores.routing.handed_before(other, None) == [("general", True)]
    since = datetime.now(UTC) + timedelta(hours=1)
    assert await stores.routing.handed_before(mine, since) == []


async def test_whether_a_channel_has_messages_stored(stores: Stores) -> None:
    """The email intake's first start on a fleet that ran before reads all unread mail."""
    assert not await stores.inbox.holds_channel("email")
    await queued(stores, channel="email", source_id="a@example.com")
    assert await stores.inbox.holds_channel("email")
    assert not await stores.inbox.holds_channel("telegram")
