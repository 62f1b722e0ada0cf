"""The inbox worker's logic on the in-memory stores (butlers.switchboard.memory_store): no
database, no process, no socket. The stores keep PostgreSQL's promises (tests/
test_store_contract.py); the butlers are a stand-in router (what they answer is not under test
here), and the classifier is the triage rules (no Claude Code session).

What is under test: one message of a conversation at a time and in order, at most
`max_concurrent_messages` at once, the attempts limit, resuming what a crash left, a deferred
message woken when it is due, the reply queued to the outbox with the message's outcome, and a
failed route's reply; and the notification desk on the same stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace

from butlers.claude_code import OVERLOADED
from butlers.config import OwnerConfig, SwitchboardConfig, TranscriptionConfig, TriageRule
from butlers.errors import NotifyRefused, RouteError, TargetBusy, TranscriptionFailed
from butlers.media import Attachment
from butlers.switchboard import attachments as attachment_step
from butlers.switchboard import worker as worker_module
from butlers.switchboard.deliver import NotificationDesk
from butlers.switchboard.inbox import MAX_ATTEMPTS, InboxMessage, IncomingMessage
from butlers.switchboard.memory_store import (
    MemoryDatabase,
    MemoryInboxStore,
    MemoryOutboxStore,
    MemoryRoutingStore,
)
from butlers.switchboard.outbox import OutboxSender
from butlers.switchboard.replies import answer_lost, sorry
from butlers.switchboard.routing_store import RouteRecord
from butlers.switchboard.worker import InboxWorker
from tests.conftest import log_records
from tests.test_media import ogg_opus

REPLICA = "sb-1"
_ids = itertools.count(1)


class Unreachable(RouteError):
    kind = "unreachable"


@dataclass
class StandInRouter:
    """The butlers, as the worker reaches them: each route is recorded, held until `gate` is
    open, and answered "<butler> did: <text>" (or raises what `fail` says for that butler)."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    fail: dict[str, RouteError] = field(default_factory=dict)
    routed: list[tuple[str, str]] = field(default_factory=list)  # (butler, text), in order
    active: list[str] = field(default_factory=list)  # the texts being routed now
    most_at_once: int = 0
    overlapping: list[tuple[str, str]] = field(default_factory=list)  # same conversation
    entered: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def route(
        self, butler: str, tool: str, args: dict[str, Any], *, source: Any, request: str
    ) -> Any:
        # What the message asked, as the worker says it (the prompt is framed around it).
        assert f"\n{request}\n" in args["prompt"]
        text = request
        conversation = text.split("#")[0]
        self.overlapping += [
            (other, text) for other in self.active if other.split("#")[0] == conversation
        ]
        self.active.append(text)
        self.most_at_once = max(self.most_at_once, len(self.active))
        self.routed.append((butler, text))
        async with self.entered:
            self.entered.notify_all()
        try:
            await self.gate.wait()
            for _ in range(3):  # a butler's answer takes a while: others may run meanwhile
                await asyncio.sleep(0)
            if butler in self.fail:
                raise self.fail[butler]
            return {"result": f"{butler} did: {text}"}
        finally:
            self.active.remove(text)

    async def is_routable(self, butler: str) -> bool:
        return True

    async def until_active(self, count: int) -> None:
        async with self.entered:
            await self.entered.wait_for(lambda: len(self.active) >= count)


class StandInChannel:
    """A channel's sending half as the worker uses it: one row per reply; everyone may write
    but those in `gone` (unpaired, off the allowlist)."""

    def __init__(self) -> None:
        self.gone: set[str] = set()

    async def may_write(self, sender: str) -> bool:
        return sender not in self.gone

    def prepare(
        self,
        text: str,
        *,
        reply_to: InboxMessage | None,
        butler: str | None,
        subject: str | None = None,
    ) -> list[tuple[str, dict[str, Any]]]:
        return [(text, {"reply_to": reply_to.external_id if reply_to else None})]


@dataclass
class Parts:
    database: MemoryDatabase
    inbox: MemoryInboxStore
    outbox: MemoryOutboxStore
    router: StandInRouter
    make: Callable[..., InboxWorker]


@pytest.fixture
async def parts() -> AsyncIterator[Parts]:
    database = MemoryDatabase()
    inbox, outbox = MemoryInboxStore(database), MemoryOutboxStore(database)
    router = StandInRouter()
    workers: list[InboxWorker] = []

    def make(max_concurrent: int = 2, transcriber: Any = None, **limits: Any) -> InboxWorker:
        sender = OutboxSender(
            outbox, tracer=trace.get_tracer("test"), retry_hours=1, replica="test"
        )
        sender.channels["telegram"] = StandInChannel()
        worker = InboxWorker(
            inbox=inbox,
            routing_store=MemoryRoutingStore(database),
            router=router,
            spawner=SimpleNamespace(config=SimpleNamespace(name="switchboard")),
            # Every telegram message goes to `general`, one "to:health" to health: triage only.
            triage_rules=[
                TriageRule(butler="health", pattern="to:health"),
                TriageRule(butler="general", channel="telegram"),
            ],
            # No history in the prompts: the stand-in router reads the message's text alone.
            limits=SwitchboardConfig(
                max_concurrent_messages=max_concurrent, context_messages=0, **limits
            ),
            switchboard_url="http://127.0.0.1:9/sse",  # never used: no classification session
            switchboard_tools=lambda: [],
            tracer=trace.get_tracer("test"),
            outbox=sender,
            replica=REPLICA,
            transcriber=transcriber,
        )
        workers.append(worker)
        return worker

    yield Parts(database, inbox, outbox, router, make)
    for worker in workers:
        await worker.close()


def message(conversation: str, n: int, **kw: Any) -> IncomingMessage:
    """Text "<conversation>#<n>": the stand-in router tells conversations apart by it."""
    return IncomingMessage(
        "telegram",
        f"m{next(_ids)}",
        f"{conversation}#{n}",
        source_id=conversation,
        conversation=f"telegram:{conversation}",
        **kw,
    )


async def done(worker: InboxWorker, ids: list[int]) -> list[dict[str, Any]]:
    async with asyncio.timeout(10):
        return [await worker.wait_for(inbox_id) for inbox_id in ids]


async def test_a_conversation_goes_one_at_a_time_in_order(parts: Parts) -> None:
    parts.router.gate.set()  # every butler answers at once (after giving the loop up)
    worker = parts.make(max_concurrent=3)
    await worker.open(resume=[REPLICA])
    ids = [
        await worker.accept(message(conversation, n))
        for n in range(3)
        for conversation in ("a", "b")
    ]
    rows = await done(worker, [i for i in ids if i is not None])
    assert {row["status"] for row in rows} == {"done"}
    assert parts.router.overlapping == []
    for conversation in ("a", "b"):
        assert [text for _, text in parts.router.routed if text.startswith(conversation)] == [
            f"{conversation}#{n}" for n in range(3)
        ]


async def test_no_more_than_max_concurrent_messages_at_once(parts: Parts) -> None:
    worker = parts.make(max_concurrent=2)
    await worker.open(resume=[REPLICA])
    ids = [await worker.accept(message(c, 0)) for c in "abcde"]
    await parts.router.until_active(2)
    # The worker claims in one go, without giving the loop up: had it taken a third, the
    # third would be in flight by now.
    assert worker.in_flight == 2
    assert [(await parts.inbox.get(i) or {})["status"] for i in ids].count("processing") == 2
    parts.router.gate.set()
    await done(worker, [i for i in ids if i is not None])
    assert parts.router.most_at_once == 2


async def test_the_reply_is_queued_to_the_outbox_with_the_outcome(parts: Parts) -> None:
    parts.router.gate.set()
    worker = parts.make()
    await worker.open(resume=[REPLICA])
    inbox_id = await worker.accept(message("a", 0, meta={"k": 1}))
    assert inbox_id is not None
    (row,) = await done(worker, [inbox_id])
    assert (row["status"], row["routed_to"], row["classified_via"]) == ("done", "general", "triage")
    assert row["reply"] == "general did: a#0"
    delivery = await parts.outbox.claim("telegram", "test", 60)
    assert delivery is not None
    assert (delivery.kind, delivery.recipient, delivery.text, delivery.inbox_id) == (
        "reply",
        "a",
        "general did: a#0",
        inbox_id,
    )
    assert delivery.butler == "general"  # a reply to it goes back there


async def test_a_failed_route_is_answered_with_a_sorry_and_the_error_kept(parts: Parts) -> None:
    parts.router.gate.set()
    parts.router.fail["health"] = Unreachable("health: connection refused at 127.0.0.1:1")
    worker = parts.make()
    await worker.open(resume=[REPLICA])
    inbox_id = await worker.accept(
        IncomingMessage("telegram", "m-fail", "to:health", source_id="a", conversation="c:a")
    )
    assert inbox_id is not None
    (row,) = await done(worker, [inbox_id])
    assert row["status"] == "failed"
    assert row["reply"] == sorry("unreachable", "health")
    assert "health: connection refused" in row["error"]
    delivery = await parts.outbox.claim("telegram", "test", 60)
    assert delivery is not None and delivery.text == sorry("unreachable", "health")
    # The person's text never reaches the reply.
    assert "127.0.0.1" not in delivery.text


async def test_a_crash_is_resumed_and_a_message_that_keeps_crashing_is_given_up(
    parts: Parts,
) -> None:
    parts.router.gate.set()
    crashing = await parts.inbox.accept(message("b", 0), None)
    resumed = await parts.inbox.accept(message("a", 0), None)
    # `crashing` took this replica down each time it was tried...
    for _ in range(MAX_ATTEMPTS):
        claimed = await parts.inbox.claim_next(REPLICA, 60)
        assert claimed is not None and claimed.id == crashing
        await parts.inbox.requeue_interrupted([REPLICA])
    # ...and both were in flight when it last died.
    for expected in (crashing, resumed):
        claimed = await parts.inbox.claim_next(REPLICA, 60)
        assert claimed is not None and claimed.id == expected
    worker = parts.make()
    await worker.open(resume=[REPLICA])  # requeues both: they are this replica's
    first, second = await done(worker, [resumed, crashing])
    assert (first["status"], first["reply"]) == ("done", "general did: a#0")
    assert (second["status"], second["reply"]) == ("failed", sorry("gave_up"))
    assert second["error"] == f"gave up after {MAX_ATTEMPTS} interrupted attempts"
    assert [text for _, text in parts.router.routed] == ["a#0"]  # the given-up one: never


def a_route(inbox_id: int | None, *, butler: str = "general", success: bool = True) -> RouteRecord:
    return RouteRecord(
        source_channel="telegram",
        source_id="a",
        routed_to=butler,
        tool_name="trigger",
        prompt_summary=None,
        trace_id=None,
        success=success,
        error=None if success else "unreachable",
        duration_ms=5,
        inbox_id=inbox_id,
    )


async def test_a_message_its_butlers_answered_before_an_interruption_is_not_handed_over_again(
    parts: Parts,
) -> None:
    """A message whose butlers had answered when its process was interrupted (killed;
    stopped while the database was down and its outcome could not be written; its lease
    lapsed in an outage) was handed to them again when claimed again: a reminder set twice,
    a mail sent twice. The routing_log says they answered: the message is finished with a
    reply saying the answer was lost. A route that failed does not count, nor one from
    before the operator queued the message again on purpose (`butlers retry`)."""
    parts.router.gate.set()
    routing = MemoryRoutingStore(parts.database)
    answered = await parts.inbox.accept(message("a", 0), None)
    failed = await parts.inbox.accept(message("b", 0), None)
    retried = await parts.inbox.accept(message("c", 0), None)
    for inbox_id in (answered, failed, retried):
        claimed = await parts.inbox.claim_next(REPLICA, 60)
        assert claimed is not None and claimed.id == inbox_id
    await routing.record_route(a_route(answered, butler="health"))
    await routing.record_route(a_route(answered))
    await routing.record_route(a_route(answered))  # one butler asked twice is named once
    # One of its butlers had not answered (cancelled by the stop): named, not asked again.
    await routing.record_route(a_route(answered, butler="relationship", success=False))
    await routing.record_route(a_route(failed, success=False))
    await routing.record_route(a_route(retried))
    assert retried is not None
    later = parts.database.clock() + timedelta(seconds=1)
    parts.database.tables.inbox[retried]["meta"]["retries"] = [
        {"retried_at": later.isoformat(), "status": "done"}
    ]
    worker = parts.make(max_concurrent=3)
    await worker.open(resume=[REPLICA])  # requeues all three: they are this replica's
    rows = await done(worker, [i for i in (answered, failed, retried) if i is not None])
    first, second, third = rows
    assert (first["status"], first["routed_to"]) == ("done", "health,general")
    assert first["reply"] == answer_lost(["health", "general"], ["relationship"])
    assert first["reply"].startswith("Sorry, the health and general butlers took your message")
    assert first["reply"].endswith(
        " The relationship butler had not answered: ask again for that part."
    )
    assert "relationship had not answered: not asked again" in first["error"]
    assert (second["status"], second["reply"]) == ("done", "general did: b#0")
    assert (third["status"], third["reply"]) == ("done", "general did: c#0")
    assert sorted(text for _, text in parts.router.routed) == ["b#0", "c#0"]
    delivery = await parts.outbox.claim("telegram", "test", 60)
    assert delivery is not None and delivery.text == first["reply"]


async def test_close_hands_the_messages_in_flight_back(parts: Parts) -> None:
    """What is still under way when the drain ends (here at once: the lane stays fast)."""
    worker = parts.make(stop_drain_s=0)
    await worker.open(resume=[REPLICA])
    inbox_id = await worker.accept(message("a", 0))
    assert inbox_id is not None
    await parts.router.until_active(1)
    await worker.close()
    row = await parts.inbox.get(inbox_id)
    assert row is not None and (row["status"], row["attempts"]) == ("queued", 0)


class FlakyTranscriber:
    """A transcription service that is down for its first call, then hears "to:health"."""

    def __init__(self) -> None:
        self.calls = 0

    async def transcribe(self, file: Attachment) -> str:
        self.calls += 1
        if self.calls == 1:
            raise TranscriptionFailed("503 from the service", transient=True)
        return "to:health heard"

    async def aclose(self) -> None:
        pass


async def test_a_deferred_message_is_taken_up_when_it_is_due(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker wakes itself when the deferral ends: no message arriving, no idle poll."""
    monkeypatch.setattr(worker_module, "IDLE_POLL_S", 3600.0)
    monkeypatch.setattr(attachment_step, "RETRY_MIN_S", 0.05)
    # The stores' clock is the event loop's: the worker's timer and the deferral's end agree.
    loop = asyncio.get_running_loop()
    base = datetime.now(UTC) - timedelta(seconds=loop.time())
    parts.database.clock = lambda: base + timedelta(seconds=loop.time())
    parts.router.gate.set()
    transcriber = FlakyTranscriber()
    worker = parts.make(transcriber=transcriber, transcription=TranscriptionConfig())
    await worker.open(resume=[REPLICA])
    voice = Attachment("v.ogg", "audio/ogg", ogg_opus())  # measured before it is heard
    inbox_id = await worker.accept(message("a", 0, attachments=(voice,)))
    later = await worker.accept(message("a", 1))  # waits behind the deferred one
    assert inbox_id is not None and later is not None
    first, second = await done(worker, [inbox_id, later])
    assert transcriber.calls == 2
    assert first["status"] == "done"
    # Its typed words first, the transcript labelled where it begins.
    assert "health did: a#0\n\n(A voice note, transcribed.) to:health heard" in first["reply"]
    assert second["status"] == "done"
    assert [butler for butler, _ in parts.router.routed] == ["health", "general"]


async def test_a_notification_reaches_the_conversations_person_within_the_hourly_limit(
    parts: Parts,
) -> None:
    """The notification desk on the same stores: to the conversation's person through the
    outbox, logged, and refused past max_notifications_per_hour."""
    sender = parts.make().outbox
    await parts.inbox.accept(message("a", 0), None)
    routing = MemoryRoutingStore(parts.database)
    desk = NotificationDesk(
        limits=SwitchboardConfig(max_notifications_per_hour=1),
        inbox=parts.inbox,
        routing_store=routing,
        outbox=sender,
    )
    queued = await desk.deliver("your reminder", "health", None, "telegram:a")
    assert queued == {"queued": 1, "files": 0, "channel": "telegram", "to": "conversation"}
    delivery = await parts.outbox.claim("telegram", "test", 60)
    assert delivery is not None
    assert (delivery.kind, delivery.recipient, delivery.text, delivery.butler) == (
        "notification",
        "a",
        "your reminder",
        "health",
    )
    with pytest.raises(NotifyRefused, match="max_notifications_per_hour"):
        await desk.deliver("and again", "health", None, "telegram:a")
    assert [(row["tool_name"], row["success"]) for row in routing.log] == [
        ("notify", True),
        ("notify", False),
    ]


async def test_a_notification_to_someone_who_may_no_longer_write_is_refused(
    parts: Parts,
) -> None:
    """Unpaired or taken off the allowlist: their reminders no longer reach them."""
    sender = parts.make().outbox
    await parts.inbox.accept(message("a", 0), None)
    channel = sender.channels["telegram"]
    assert isinstance(channel, StandInChannel)
    channel.gone.add("a")
    desk = NotificationDesk(
        limits=SwitchboardConfig(),
        inbox=parts.inbox,
        routing_store=MemoryRoutingStore(parts.database),
        outbox=sender,
    )
    with pytest.raises(NotifyRefused, match="'telegram:a' may no longer write"):
        await desk.deliver("your reminder", "health", None, "telegram:a")
    assert await parts.outbox.claim("telegram", "test", 60) is None
    assert await desk.may_write("telegram:a:topic") is False
    assert await desk.may_write("telegram:b") is True
    # A channel not running here cannot say: its people's reminders are not disabled for it
    # (a switchboard started without the channel's credentials: a review).
    assert await desk.may_write("email:x@example.com:<t@x>") is None


async def test_a_worker_woken_as_it_is_closed_still_stops(parts: Parts) -> None:
    """Woken in the same turn of the event loop as it is cancelled, the worker still stops:
    Python 3.11's `asyncio.wait_for` handed back the wake instead of the cancellation, and the
    worker looked at the queue again and waited on, so `close()` (and `butlers up`'s stop)
    never returned (seen as a fleet that ignored SIGTERM)."""
    worker = parts.make()
    await worker.open(resume=[REPLICA])
    for _ in range(5):
        await asyncio.sleep(0)  # idle: waiting for a wake
    worker.wake()
    async with asyncio.timeout(5):
        await worker.close()


class BusyFirst(StandInRouter):
    """A butler whose session meets an overloaded Messages API the first `times` it is
    asked, before doing anything (its `trigger` said "failed before acting")."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    async def route(self, butler: str, tool: str, args: dict[str, Any], **kw: Any) -> Any:
        answer = await super().route(butler, tool, args, **kw)
        if len(self.routed) <= self.times:
            raise TargetBusy(f"session 1 failed before acting: {OVERLOADED}")
        return answer


@pytest.mark.parametrize("channel", ["telegram", "mcp"])
async def test_a_message_its_butlers_were_too_busy_for_waits_and_is_answered_later(
    parts: Parts, monkeypatch: pytest.MonkeyPatch, channel: str
) -> None:
    """Put back in the queue, said on its row, nobody told; answered once the butler can.
    `ask`'s caller (channel mcp) waits for the answer: it is told at once instead. Past
    BUSY_RETRY_S of waiting, the sender is told too."""
    monkeypatch.setattr(worker_module, "BUSY_RETRY_MIN_S", 0.05)
    router = parts.router = BusyFirst(times=2)
    router.gate.set()
    worker = parts.make()
    worker.router = router
    await worker.open(resume=[REPLICA])
    # (To health by triage on any channel: `ask`'s would go to a classifier.)
    incoming = IncomingMessage(channel, "m-busy", "to:health", source_id="a", conversation="t:a")
    inbox_id = await worker.accept(incoming)
    assert inbox_id is not None
    (row,) = await done(worker, [inbox_id])
    if channel == "mcp":
        assert (row["status"], row["reply"]) == ("failed", sorry("busy", "health"))
        assert len(router.routed) == 1
        return
    assert (row["status"], row["reply"]) == ("done", "health did: to:health")
    assert len(router.routed) == 3 and row["attempts"] == 1
    assert "deferred_since" in row["meta"]
    delivery = await parts.outbox.claim("telegram", "test", 60)
    # The first reply queued is the answer: no sorry went before it.
    assert delivery is not None and delivery.text == "health did: to:health"

    # One that has waited an hour already: its sender is told.
    router.times = 10**6
    old = (datetime.now(UTC) - timedelta(seconds=worker_module.BUSY_RETRY_S)).isoformat()
    late = IncomingMessage(
        "telegram", "m-late", "a#1", source_id="a", conversation="t:a",
        meta={"deferred_since": old},
    )  # fmt: skip
    late_id = await worker.accept(late)
    assert late_id is not None
    (row,) = await done(worker, [late_id])
    assert (row["status"], row["reply"]) == ("failed", sorry("busy", "general"))
    assert OVERLOADED in row["error"]


async def test_the_database_failing_before_any_butler_was_asked_puts_the_message_back(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its database failed under a message (disk full, a restart): it was "failed" with
    "internal error" and a sorry, or left unanswered (a bad day's walkthrough). Before a
    butler was asked, it goes back in the queue; after, a butler may have acted, and it
    fails as before (its butler is not asked twice)."""
    import asyncpg

    monkeypatch.setattr(worker_module, "DATABASE_RETRY_S", 0.05)
    parts.router.gate.set()
    worker = parts.make()
    await worker.open(resume=[REPLICA])
    history, failures = parts.inbox.history, []

    async def failing_once(*args: Any) -> Any:
        if not failures:
            failures.append(1)
            raise asyncpg.DiskFullError("could not extend file: No space left on device")
        return await history(*args)

    monkeypatch.setattr(parts.inbox, "history", failing_once)
    inbox_id = await worker.accept(message("a", 0))
    assert inbox_id is not None
    (row,) = await done(worker, [inbox_id])
    assert (row["status"], row["reply"]) == ("done", "general did: a#0")
    assert failures == [1] and len(parts.router.routed) == 1

    add = parts.outbox.add

    async def add_failing_once(*args: Any) -> Any:
        if len(failures) == 1:
            failures.append(2)
            # A connection dropped within a transaction, as asyncpg ends it: a plain
            # InterfaceError, the drop in its context (taken for the message's: a review).
            try:
                raise asyncpg.ConnectionDoesNotExistError("closed in the middle of operation")
            except asyncpg.ConnectionDoesNotExistError:
                raise asyncpg.InterfaceError(
                    "cannot call Transaction.__aexit__(): the underlying connection is closed"
                ) from None
        return await add(*args)

    # After its butler answered, the outcome is held until the database takes it (given up,
    # the message was claimed again and its butler asked twice: a review).
    monkeypatch.setattr(worker_module, "FINISH_BACKOFF", worker_module.Backoff((0.05,)))
    monkeypatch.setattr(parts.outbox, "add", add_failing_once)
    after = await worker.accept(message("a", 1))
    assert after is not None
    (row,) = await done(worker, [after])
    assert (row["status"], row["reply"]) == ("done", "general did: a#1")
    assert failures == [1, 2]
    assert [text for _, text in parts.router.routed] == ["a#0", "a#1"]  # asked once


async def test_an_outcome_whose_commit_went_through_unanswered_is_not_taken_for_lost(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish's COMMIT went through but its answer was lost with the connection: the
    retry found the row finished and took it for another process's ("taken over; its
    outcome here is dropped"), and its `ask` caller and the outbox were not told. Now the
    row finished by this replica is the outcome written."""
    import asyncpg

    monkeypatch.setattr(worker_module, "FINISH_BACKOFF", worker_module.Backoff((0.05,)))
    parts.router.gate.set()
    worker = parts.make()
    await worker.open(resume=[REPLICA])
    acquire, dropped = parts.database.acquire, []

    @contextlib.asynccontextmanager
    async def dropped_after_commit() -> AsyncIterator[Any]:
        async with acquire() as conn:
            yield conn
        if not dropped and parts.router.routed:  # the finish's, after the commit
            dropped.append(1)
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle")

    monkeypatch.setattr(parts.database, "acquire", dropped_after_commit)
    with log_records("butlers.switchboard.worker") as records:
        inbox_id = await worker.accept(message("a", 0))
        assert inbox_id is not None
        (row,) = await done(worker, [inbox_id])
    assert dropped == [1]
    assert (row["status"], row["reply"]) == ("done", "general did: a#0")
    assert not [r for r in records if "taken over" in r.getMessage()]
    delivery = await parts.outbox.claim("telegram", "test", 60)
    assert delivery is not None and delivery.text == "general did: a#0"


async def test_a_message_whose_lease_ran_out_here_is_not_worked_on_twice(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database could not renew the lease of a message at work (down, full): once it
    ran out, this process claimed the message again and started a second task on it, which
    asked its butler a second time (a review)."""
    import asyncpg

    monkeypatch.setattr(worker_module, "IDLE_POLL_S", 0.05)

    async def cannot(*_args: Any) -> Any:
        raise asyncpg.ConnectionFailureError("connection refused")

    monkeypatch.setattr(parts.inbox, "renew", cannot)
    worker = parts.make(message_lease_s=1)
    await worker.open(resume=[REPLICA])
    inbox_id = await worker.accept(message("a", 0))
    assert inbox_id is not None
    await parts.router.until_active(1)
    # The lease runs out (the database's clock moved past it, not a wait: the fast lane),
    # and the idle polls look again.
    clock = parts.database.clock
    parts.database.clock = lambda: clock() + timedelta(seconds=2)
    await asyncio.sleep(0.3)
    row = await parts.inbox.get(inbox_id)
    assert row is not None and row["lease_until"] < parts.database.clock()  # it ran out
    assert len(parts.router.routed) == 1
    parts.router.gate.set()
    (row,) = await done(worker, [inbox_id])
    assert (row["status"], row["reply"]) == ("done", "general did: a#0")
    assert len(parts.router.routed) == 1
    assert row["attempts"] == 1  # one attempt, however often its lease was taken again


async def test_a_message_not_read_is_answered_within_the_senders_hourly_limit(
    parts: Parts,
) -> None:
    """A mail the intake will not read is answered saying why, in the same transaction as
    its failed row; but each crafted mail under a forged From of an allowed sender had us
    send a reply (a review): past `max_messages_per_sender_per_hour` the row is kept and
    nothing is sent."""
    worker = parts.make(max_messages_per_sender_per_hour=2)
    for n in range(3):
        inbox_id = await worker.record_unread(
            IncomingMessage("telegram", f"big{n}", "", source_id="a", conversation="telegram:a"),
            "too big (IMAP 127.0.0.1 UID 7)",
            "Sorry, your mail was not read: it is too big.",
        )
        assert inbox_id is not None
        row = await parts.inbox.get(inbox_id)
        assert row is not None and row["status"] == "failed"
    told = []
    while (delivery := await parts.outbox.claim("telegram", "test", 60)) is not None:
        told.append(delivery.text)
        await parts.outbox.sent(delivery.id, ["x"])
    assert told == ["Sorry, your mail was not read: it is too big."] * 2


async def test_the_owner_may_send_ten_times_a_senders_hourly_limit(parts: Parts) -> None:
    """A chatty hour with their own butlers, or the catch-up after the fleet was down, left
    the owner unanswered like a stranger past max_messages_per_sender_per_hour (a
    walkthrough); a stranger is still held to it."""
    parts.router.gate.set()
    worker = parts.make(
        max_messages_per_sender_per_hour=2, owner=OwnerConfig(telegram_chat_id="owner")
    )
    await worker.open(resume=[REPLICA])
    ids = [await worker.accept(message(who, n)) for who in ("owner", "ada") for n in range(4)]
    rows = await done(worker, [i for i in ids if i is not None])
    statuses = [(row["source_id"], row["status"]) for row in rows]
    assert statuses == [("owner", "done")] * 4 + [("ada", "done")] * 2 + [("ada", "skipped")] * 2
    await worker.close()


def test_by_mail_only_a_verified_owner_gets_the_owners_limit(parts: Parts) -> None:
    """A From is anyone's to write: without `require_authentication_results` a forged owner's
    mail got ten times a stranger's sessions (a review). A chat's sender is Telegram's."""
    owner = OwnerConfig(email="me@example.com", telegram_chat_id="7")
    worker = parts.make(max_messages_per_sender_per_hour=2, owner=owner)
    assert worker._sender_limit("email", "me@example.com") == 2
    assert worker._sender_limit("email", "Me@Example.com", verified=True) == 20
    assert worker._sender_limit("email", "eve@example.com", verified=True) == 2
    assert worker._sender_limit("telegram", "7") == 20


async def test_a_verified_owners_files_have_the_owners_limit_too(parts: Parts) -> None:
    """Their 3rd mail of the hour was read, its files stripped "over the hourly limit"
    (a review)."""
    worker = parts.make(max_messages_per_sender_per_hour=2, owner=OwnerConfig(email="me@x.com"))
    for n in range(3):
        await parts.inbox.accept(
            IncomingMessage("email", f"m{n}", "note", source_id="me@x.com", conversation="e:1"),
            None,
        )
    assert not await worker.files_welcome("email", "me@x.com")
    assert await worker.files_welcome("email", "me@x.com", verified=True)


async def test_a_second_stop_does_not_wait_for_the_reply_under_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leader stepping down lets a reply under way finish (outbox.STEP_DOWN_DRAIN_S); a
    second Ctrl-C (hurry) stops waiting for it, as it does for the messages under way."""
    from butlers.switchboard import outbox as outbox_module
    from butlers.switchboard.outbox import Outgoing
    from butlers.tasks import within

    monkeypatch.setattr(outbox_module, "STEP_DOWN_DRAIN_S", 600.0)

    class Hanging:
        def __init__(self) -> None:
            self.started = asyncio.Event()

        async def deliver(self, delivery: Any) -> list[str]:
            self.started.set()
            await asyncio.Event().wait()  # Telegram never answers
            return []

    database = MemoryDatabase()
    store = MemoryOutboxStore(database)
    async with store.pool.acquire() as conn, conn.transaction():
        await store.add(conn, [Outgoing("reply", "telegram", "1", "hello")], None)
    sender = OutboxSender(store, tracer=trace.get_tracer("test"), retry_hours=1, replica="t")
    channel = Hanging()
    sender.channels["telegram"] = channel  # type: ignore[assignment]
    await sender.lead()
    await within(channel.started.wait(), 10)
    stopping = asyncio.create_task(sender.step_down())
    await asyncio.sleep(0.2)
    assert not stopping.done()  # it lets the reply finish
    sender.hurry()
    await within(stopping, 10)  # not the 600 s


async def work_on_one(
    worker: InboxWorker,
    monkeypatch: pytest.MonkeyPatch,
    first: Callable[[InboxMessage], Awaitable[None]],
) -> tuple[int | None, list[logging.LogRecord]]:
    """One message accepted and worked on, `first` run as its work begins (in its task, as
    if the process paused there); its inbox id and what the worker logged until it ended."""
    started = asyncio.Event()
    working: list[asyncio.Task[Any] | None] = []
    original = worker._answered_before

    async def begin(message: InboxMessage) -> bool:
        await first(message)
        working.append(asyncio.current_task())
        started.set()
        return await original(message)

    monkeypatch.setattr(worker, "_answered_before", begin)
    await worker.open(resume=[REPLICA])
    with log_records("butlers.switchboard.worker") as records:
        inbox_id = await worker.accept(message("a", 0))
        async with asyncio.timeout(5):
            await started.wait()
            await asyncio.wait([task for task in working if task is not None])
    return inbox_id, records


async def test_a_message_taken_over_while_this_process_was_paused_is_not_routed_again(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process paused past its lease (a frozen VM, SIGSTOP) woke and went on asking the
    butler while another replica had taken the message over (and asked it): the renewal
    noticed only after (a red team). The claim is checked right before a butler is asked."""
    worker = parts.make(message_lease_s=30)

    async def pause_past_the_lease(message: InboxMessage) -> None:
        # While this process is "paused", the lease runs out and sb-2 takes the message.
        clock = parts.database.clock
        parts.database.clock = lambda: clock() + timedelta(seconds=31)
        taken = await parts.inbox.claim_next("sb-2", 30)
        assert taken is not None and taken.id == message.id

    inbox_id, records = await work_on_one(worker, monkeypatch, pause_past_the_lease)
    assert parts.router.routed == []  # the butler was not asked by this process
    assert inbox_id is not None
    row = await parts.inbox.get(inbox_id)
    assert row is not None and (row["status"], row["claimed_by"]) == ("processing", "sb-2")
    assert any("taken over by another switchboard process" in r.getMessage() for r in records)


async def test_a_classifiers_route_is_not_forwarded_once_the_message_was_taken_over(
    parts: Parts,
) -> None:
    """The same check for a route a classification session asks for (Dispatch.accept): its
    session's `route` reached a process that no longer held the message."""
    from butlers.config import OwnerConfig
    from butlers.errors import LeaseLost
    from butlers.switchboard.dispatch import Dispatcher
    from butlers.switchboard.handoff import Handoff

    class Router(StandInRouter):
        async def refusal_of(self, butler: str) -> str | None:
            return None

    worker, router = parts.make(message_lease_s=30), Router()
    router.gate.set()
    await parts.inbox.accept(message("a", 0), None)
    mine = await parts.inbox.claim_next(REPLICA, 30)
    assert mine is not None
    dispatcher = Dispatcher(router, max_routes=3)  # type: ignore[arg-type]
    handoff = Handoff.of(mine, owner=OwnerConfig(), body=mine.text)
    async with dispatcher.open(mine, handoff, still_ours=worker.still_ours) as dispatch:
        said = await dispatch.accept("general", "trigger", {"prompt": "a#0"})
        assert said.startswith("accepted") and len(await dispatch.answers()) == 1
        clock = parts.database.clock
        parts.database.clock = lambda: clock() + timedelta(seconds=31)
        assert await parts.inbox.claim_next("sb-2", 30) is not None
        with pytest.raises(LeaseLost):
            await dispatch.accept("health", "trigger", {"prompt": "a#0"})
    assert [butler for butler, _ in router.routed] == ["general"]


async def test_a_reply_taken_but_not_marked_is_not_sent_again_after_a_step_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The database restarting just after the channel took a reply: marking it sent fails,
    the leader (its lock's connection gone too) steps down and leads again once the lease
    is up, and its new sender took the row and sent it again (a review). The marking
    outlives the step-down, and the channel takes nothing else until it is done."""
    from butlers.switchboard import outbox as outbox_module
    from butlers.switchboard.outbox import Outgoing
    from butlers.tasks import within

    monkeypatch.setattr(outbox_module, "STEP_DOWN_DRAIN_S", 0.1)
    monkeypatch.setattr(outbox_module, "RECORD_SENT_EVERY_S", 0.05)

    class Counting:
        def __init__(self) -> None:
            self.sent: list[str] = []
            self.changed = asyncio.Condition()

        async def deliver(self, delivery: Any) -> list[str]:
            self.sent.append(delivery.text)
            async with self.changed:
                self.changed.notify_all()
            return [str(len(self.sent))]

        async def until_sent(self, count: int) -> None:
            async with asyncio.timeout(10), self.changed:
                await self.changed.wait_for(lambda: len(self.sent) >= count)

    database = MemoryDatabase()
    store = MemoryOutboxStore(database)
    async with store.pool.acquire() as conn, conn.transaction():
        await store.add(conn, [Outgoing("reply", "telegram", "1", "hello")], None)
    database_away = asyncio.Event()
    database_away.set()
    marked = store.sent

    async def sent(delivery_id: int, sent_ids: Any) -> None:
        if database_away.is_set():
            raise ConnectionResetError("the database restarts")
        await marked(delivery_id, sent_ids)

    monkeypatch.setattr(store, "sent", sent)
    sender = OutboxSender(store, tracer=trace.get_tracer("test"), retry_hours=1, replica="t")
    channel = Counting()
    sender.channels["telegram"] = channel  # type: ignore[assignment]
    await sender.lead()
    await channel.until_sent(1)
    await sender.step_down()  # the lock went with the database
    clock = database.clock
    database.clock = lambda: clock() + timedelta(seconds=31)  # its lease is up
    await sender.lead()  # leading again before the database is back
    await asyncio.sleep(0.3)
    assert channel.sent == ["hello"]
    database_away.clear()
    async with store.pool.acquire() as conn, conn.transaction():
        await store.add(conn, [Outgoing("reply", "telegram", "1", "next")], None)
    sender.wake()
    await channel.until_sent(2)
    await within(sender.step_down(), 10)
    assert channel.sent == ["hello", "next"]


async def test_a_claim_the_database_cannot_confirm_goes_on_only_within_its_lease(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right before a butler is asked the claim is checked; when the database cannot say
    (a restart as the process woke from a pause), it went on all the same, and the process
    that had taken the message over asked the butler too (a review). It goes on only while
    its last confirmation is recent; past half a lease, it stops."""
    worker = parts.make(message_lease_s=30)

    async def cannot(*_args: Any) -> Any:
        raise ConnectionResetError("the database restarts")

    async def paused_then_the_database_away(message: InboxMessage) -> None:
        worker._held_at[message.id] -= 20  # confirmed 20 s ago: a pause
        monkeypatch.setattr(parts.inbox, "renew", cannot)

    _, records = await work_on_one(worker, monkeypatch, paused_then_the_database_away)
    assert parts.router.routed == []
    assert any("taken over by another switchboard process" in r.getMessage() for r in records)
