"""reply, durably: the outbox holds every reply and notification until its channel took it.

A reply is written in the same transaction that finishes its inbox row, so a message is
either still to be processed or has its reply on record: a crash can no longer make the
switchboard route a message again and answer it twice. A sender task per channel then
delivers the channel's rows strictly in order, retrying with backoff while the channel is
down (Bot API 5xx or unreachable, SMTP refusing) for up to `reply_retry_hours`, and marks
each row sent once the channel has taken it.

One exception to the order: a refusal that concerns one recipient only (`RecipientDeferred`:
a mail server's 4xx to RCPT TO, a full mailbox or greylisting) holds back that recipient's
rows, not the channel's. The row is marked (HELD_KEY in its meta) and retried with the
backoff; the channel's rows to others go out meanwhile, each recipient's still in order. Else
one bad address would stop every reply for up to `reply_retry_hours`.

A row may carry files (a butler sending a photo or a document back): they are written with
it, in `outbox_attachments`, and its meta counts them (FILES_KEY), so that only such a row
costs the sender a second query.

The one window left: a crash after the channel took a message and before its row was marked
sent (a database away meanwhile is waited out), or a channel that read the request but did
not answer in time (a Telegram request timed out, a connection cut before its answer): the
row is sent again, rather than lost. One duplicate per such crash or timeout. Telegram has no
idempotency key to prevent it; a mail is sent again with the same Message-ID, which mail
clients use to drop the copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import asyncpg
from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode, Tracer

from butlers.backoff import Backoff
from butlers.core_store import storable, storable_json
from butlers.errors import DeliveryError, RecipientDeferred
from butlers.media import Attachment
from butlers.switchboard import queries as sql
from butlers.switchboard.queries import HELD_KEY as HELD_KEY
from butlers.switchboard.queries import SENDER_KEY as SENDER_KEY
from butlers.tasks import cancel_and_wait, within
from butlers.telemetry import context_from_carrier

if TYPE_CHECKING:
    from butlers.channels.base import ChannelModule
    from butlers.switchboard.store import OutboxQueue

logger = logging.getLogger(__name__)

DELIVERY_BACKOFF = Backoff((1, 2, 5, 10, 30, 60, 120, 300))  # while a channel is down
IDLE_POLL_S = 30.0  # a fallback: new rows wake their sender at once
# A channel failing in a way it does not explain (a bug) is not waited out for a day: the
# channel's later messages queue behind the row (delivery is in order).
MAX_INTERNAL_ERRORS = 3
ERROR_CHARS = 1000
# How long a row another sender has is left to it: its lease, renewed every
# LEASE_RENEW_S while it delivers (a delivery may take long: PTB's rate limiter waits out a
# 429's retry_after), so that one whose process died or paused holds its channel up for this
# long at most. A red team: a leader whose lock's connection alone was cut sent on until it
# noticed, while the next one, leading a second later, took its row again: the reply went
# out twice.
SENDING_LEASE_S = 30.0
LEASE_RENEW_S = 10.0
# How long a leader stepping down lets a delivery under way finish (a Bot API that is well
# answers within a second): with the worker's stop_drain_s and REPLIES_OUT_S, a stop stays
# within a Kubernetes grace period's default 30 s.
STEP_DOWN_DRAIN_S = 10.0
# A row the channel took is marked sent, however long the database is away: tried again this
# often, for up to this long. A red team: a database restarting just after Telegram took a
# reply left its row `sending`, and this process took it again at once and sent it twice.
RECORD_SENT_EVERY_S = 1.0
RECORD_SENT_FOR_S = 600.0
# In a row's meta: how many files it carries (none: the key is absent).
FILES_KEY = "files"


@dataclass(frozen=True)
class Outgoing:
    """A message to send: a reply to an inbox message, or a butler's notification."""

    kind: str  # reply | notification
    channel: str
    recipient: str  # chat id, address
    text: str
    meta: dict[str, Any] = field(default_factory=dict)  # what the channel needs to send it
    inbox_id: int | None = None
    butler: str | None = None  # who answered or notified: a reply to it goes back there
    conversation: str | None = None
    # Files sent with the text (a Telegram photo or document, a mail's attachments).
    attachments: tuple[Attachment, ...] = ()


@dataclass(frozen=True)
class Delivery:
    """An outbox row being sent."""

    id: int
    kind: str
    channel: str
    recipient: str
    text: str
    meta: dict[str, Any]
    attempts: int
    created_at: datetime
    trace_context: dict[str, str] | None
    inbox_id: int | None
    butler: str | None
    attachments: tuple[Attachment, ...] = ()  # the files to send with the text, in order

    @classmethod
    def from_row(cls, row: asyncpg.Record, attachments: Sequence[Attachment] = ()) -> Delivery:
        return cls(
            id=row["id"],
            kind=row["kind"],
            channel=row["channel"],
            recipient=row["recipient"],
            text=row["text"],
            meta=row["meta"] or {},
            attempts=row["attempts"],
            created_at=row["created_at"],
            trace_context=row["trace_context"],
            inbox_id=row["inbox_id"],
            butler=row["butler"],
            attachments=tuple(attachments),
        )


class OutboxStore:
    """Every SQL statement on the outbox."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def add(
        self,
        conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy,
        messages: Sequence[Outgoing],
        trace_context: dict[str, str] | None,
    ) -> None:
        """Queue messages, in the caller's transaction (with the inbox row they answer).

        Messages with files are written row by row (their ids are needed for the files, and
        row order is delivery order), all in one transaction (a savepoint inside the
        caller's); without any, in one round trip as always."""
        if not any(m.attachments for m in messages):
            await conn.executemany(
                sql.OUTBOX_ADD, [self._row_args(m, trace_context) for m in messages]
            )
            return
        async with conn.transaction():
            for m in messages:
                if not m.attachments:
                    await conn.execute(sql.OUTBOX_ADD, *self._row_args(m, trace_context))
                    continue
                meta = {**m.meta, FILES_KEY: len(m.attachments)}
                outbox_id = await conn.fetchval(
                    sql.OUTBOX_ADD_RETURNING_ID, *self._row_args(m, trace_context, meta)
                )
                await conn.executemany(
                    sql.OUTBOX_ATTACHMENT_ADD,
                    [
                        (outbox_id, position, storable(a.name), a.mime_type, a.data)
                        for position, a in enumerate(m.attachments)
                    ],
                )

    @staticmethod
    def _row_args(
        m: Outgoing, trace_context: dict[str, str] | None, meta: dict[str, Any] | None = None
    ) -> tuple[Any, ...]:
        return (
            m.kind,
            m.inbox_id,
            m.butler,
            m.channel,
            storable(m.recipient),
            storable(m.conversation),
            storable(m.text),
            storable_json(m.meta if meta is None else meta),
            trace_context,
        )

    async def claim(self, channel: str, sender: str, lease_s: float) -> Delivery | None:
        """The channel's oldest unsent row, now `sending` by `sender` (a replica), if it is
        due. Rows go out strictly in order: while the oldest waits for its next attempt, the
        ones after it wait too, unless it is held for its recipient only (HELD_KEY): then
        only that recipient's do. A row with files (FILES_KEY) comes with them. A row another
        sender has is due `lease_s` after it took it (see OUTBOX_CLAIM)."""
        row = await self.pool.fetchrow(sql.OUTBOX_CLAIM, channel, sender, lease_s)
        if row is None:
            return None
        if not (row["meta"] or {}).get(FILES_KEY):
            return Delivery.from_row(row)
        files = await self.pool.fetch(sql.OUTBOX_ATTACHMENTS, row["id"])
        return Delivery.from_row(
            row, [Attachment(f["name"], f["mime_type"], f["data"]) for f in files]
        )

    async def head_due_in_s(self, channel: str) -> float | None:
        """Seconds until the next row `claim` may take is due; None when there is none."""
        return await self.pool.fetchval(sql.OUTBOX_HEAD_DUE_IN_S, channel)

    async def sent(self, delivery_id: int, sent_ids: Sequence[str]) -> None:
        await self.pool.execute(
            sql.OUTBOX_SENT,
            delivery_id,
            [storable(str(i)) for i in sent_ids],
        )

    async def later(
        self,
        delivery_id: int,
        error: str,
        delay_s: float,
        *,
        held_for_recipient: bool = False,
        sender: str | None = None,
    ) -> None:
        """Try the row again in `delay_s`; `held_for_recipient`: only its recipient's later
        rows wait for it (RecipientDeferred), not the channel's. `sender`: only while it
        still has the row (see _STILL_SENDING)."""
        await self.pool.execute(
            sql.OUTBOX_LATER,
            delivery_id,
            sender,
            storable(error[:ERROR_CHARS]),
            delay_s,
            held_for_recipient,
        )

    async def failed(self, delivery_id: int, error: str, *, sender: str | None = None) -> None:
        await self.pool.execute(
            sql.OUTBOX_FAILED,
            delivery_id,
            sender,
            storable(error[:ERROR_CHARS]),
        )

    async def renew(self, delivery_id: int, sender: str, lease_s: float) -> bool:
        """`sender` is still sending the row: its lease runs `lease_s` from now. False when
        it no longer has it."""
        done = await self.pool.execute(sql.OUTBOX_RENEW, delivery_id, sender, lease_s)
        return done.endswith(" 1")

    async def butler_answering(
        self, channel: str, recipient: str, sent_ids: Sequence[str], within_days: int
    ) -> str | None:
        """The butler whose reply or notification (one of `sent_ids`, the channel's own ids)
        this person is answering, if we sent it in the last `within_days`: thread affinity."""
        if not sent_ids or within_days <= 0:
            return None
        return await self.pool.fetchval(
            sql.OUTBOX_BUTLER_ANSWERING,
            channel,
            recipient,
            [str(i) for i in sent_ids],
            within_days,
        )

    async def notifications_last_hour(self, butler: str) -> int:
        return await self.pool.fetchval(sql.OUTBOX_NOTIFICATIONS_LAST_HOUR, butler)

    async def prune(self, older_than_days: int) -> int:
        """Delete sent and failed rows older than that, their files with them (the cascade of
        outbox_attachments); what is still to send stays."""
        result = await self.pool.execute(sql.OUTBOX_PRUNE, older_than_days)
        return int(result.split()[-1])


class OutboxSender:
    """One task per channel, delivering its outbox rows in order. Channels are registered by
    their modules before it leads. Of several switchboard processes, only the leader sends
    (butlers.switchboard.leadership): `lead()` and `step_down()` start and stop it."""

    name = "outbox"

    def __init__(
        self, store: OutboxQueue, *, tracer: Tracer, retry_hours: float, replica: str
    ) -> None:
        self.store = store
        # Whose `sending` rows are its own (OutboxQueue.claim): this process's, not its
        # replica name's: two processes may share one (a host name a container was given, a
        # restart while the old process still runs elsewhere), and each would take the
        # other's row at once (a review).
        self.sender = f"{replica}/{secrets.token_hex(4)}"
        self.tracer = tracer
        self.retry_budget_s = retry_hours * 3600
        self.channels: dict[str, ChannelModule] = {}  # their sending half
        self._wakes: dict[str, asyncio.Event] = {}
        self._idle: dict[str, asyncio.Event] = {}  # set while a channel has nothing due
        self._tasks: list[asyncio.Task[None]] = []
        self._stepping_down = False
        self._hurry = asyncio.Event()  # a second Ctrl-C: no drain at a step-down
        # Rows a channel took that are not marked sent yet (the database away), by id: their
        # channel: its sender takes no other row meanwhile, even after a step-down and a new
        # lead (the marking outlives the sender that began it: a review).
        self._unrecorded: dict[int, str] = {}

    def hurry(self) -> None:
        """The owner stopped again (a second Ctrl-C): a step-down no longer lets the reply
        under way finish (it stays `sending`, sent again at the next start)."""
        self._hurry.set()

    def wake(self) -> None:
        for name, event in self._wakes.items():
            self._idle[name].clear()
            event.set()

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every channel has sent what is due: at a stop,
        the replies of the messages that finished while it drained."""
        self.wake()
        idle = [event.wait() for event in self._idle.values()]
        with contextlib.suppress(TimeoutError):
            await within(asyncio.gather(*idle), timeout_s)

    async def lead(self) -> None:
        """This process leads: a task per channel sends its rows."""
        for name, channel in self.channels.items():
            self._wakes[name] = asyncio.Event()
            self._idle[name] = asyncio.Event()
            self._tasks.append(
                asyncio.create_task(self._run(name, channel), name=f"switchboard:outbox:{name}")
            )

    async def step_down(self) -> None:
        """No row is taken any more; one being sent may finish (STEP_DOWN_DRAIN_S). Cut
        short, its channel may have it all the same (a request Telegram had read), and the
        next leader would send it again: a leader that only lost its lock's connection sent
        a reply twice so (a red team). A row still `sending` after that stays so, and is
        sent again (by this process or another) once its lease is up; one the channel took
        is still marked sent (`_record_sent` outlives the step-down)."""
        self._stepping_down = True
        for wake in self._wakes.values():
            wake.set()
        try:
            if self._tasks and not self._hurry.is_set():
                drained = asyncio.ensure_future(asyncio.wait(self._tasks))
                hurried = asyncio.ensure_future(self._hurry.wait())
                try:
                    with contextlib.suppress(TimeoutError):
                        await within(
                            asyncio.wait({drained, hurried}, return_when=asyncio.FIRST_COMPLETED),
                            STEP_DOWN_DRAIN_S,
                        )
                finally:
                    await cancel_and_wait(hurried)
                    await cancel_and_wait(drained)  # (not the senders: they are cancelled next)
        finally:
            for task in self._tasks:
                await cancel_and_wait(task)
            self._tasks.clear()
            self._wakes.clear()
            self._idle.clear()
            self._stepping_down = False

    async def _run(self, name: str, channel: ChannelModule) -> None:
        wake = self._wakes[name]
        while not self._stepping_down:
            wake.clear()
            if name in self._unrecorded.values():  # sent, not yet marked: nothing else
                with contextlib.suppress(TimeoutError):
                    await within(wake.wait(), RECORD_SENT_EVERY_S)
                continue
            try:
                delivery = await self.store.claim(name, self.sender, SENDING_LEASE_S)
                if delivery is not None:
                    await self._deliver(channel, delivery)
                    continue
                if not wake.is_set():  # (woken meanwhile: a row may have come)
                    self._idle[name].set()
                due_s = await self.store.head_due_in_s(name)
            except Exception:
                # Keep delivering on purpose: a database hiccup must not end the outbox.
                logger.exception("outbox %s: cannot read the outbox", name)
                due_s = DELIVERY_BACKOFF.delay(2)
            wait_s = IDLE_POLL_S if due_s is None else min(due_s, IDLE_POLL_S)
            with contextlib.suppress(TimeoutError):
                await within(wake.wait(), wait_s)

    async def _deliver(self, channel: ChannelModule, delivery: Delivery) -> None:
        parent = context_from_carrier(delivery.trace_context)
        token = otel_context.attach(parent) if parent is not None else None
        try:
            with self.tracer.start_as_current_span(
                "switchboard.reply",
                attributes={
                    "channel": delivery.channel,
                    "kind": delivery.kind,
                    "attempt": delivery.attempts,
                },
            ) as span:
                try:
                    sent_ids = await self._delivered(channel, delivery)
                except DeliveryError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
                    await self._not_taken(
                        delivery,
                        str(exc),
                        permanent=exc.permanent,
                        held_for_recipient=isinstance(exc, RecipientDeferred),
                    )
                    return
                except Exception as exc:  # a bug in a channel: retried a few times, logged
                    logger.exception("outbox: delivering row %s failed", delivery.id)
                    span.record_exception(exc)
                    await self._not_taken(
                        delivery,
                        f"internal error ({type(exc).__name__})",
                        permanent=delivery.attempts >= MAX_INTERNAL_ERRORS,
                    )
                    return
                # The channel has it: marking it must survive our own cancellation, and a
                # database that is away for a while.
                await asyncio.shield(self._record_sent(delivery, sent_ids))
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _record_sent(self, delivery: Delivery, sent_ids: list[str]) -> None:
        """Mark a row its channel took as sent, trying again while the database cannot (up
        to RECORD_SENT_FOR_S), its lease renewed meanwhile. Its channel's next row waits (it
        would not be marked either), also in a sender started after a step-down."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + RECORD_SENT_FOR_S
        self._unrecorded[delivery.id] = delivery.channel
        try:
            await self._mark_sent(delivery, sent_ids, give_up_at, loop)
        finally:
            self._unrecorded.pop(delivery.id, None)

    async def _mark_sent(
        self,
        delivery: Delivery,
        sent_ids: list[str],
        give_up_at: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        for tries in itertools.count():
            try:
                await self.store.sent(delivery.id, sent_ids)
                return
            except Exception as exc:
                if loop.time() >= give_up_at:
                    logger.error(
                        "outbox: row %s was sent but cannot be marked so (%s); it may be "
                        "sent again once its lease is up",
                        delivery.id,
                        exc,
                        extra={"action": "delivery_unrecorded"},
                    )
                    return
                if tries % 60 == 0:  # (not a line a second while the database is away)
                    logger.warning(
                        "outbox: row %s was sent; marking it so failed (%s), trying again",
                        delivery.id,
                        exc,
                    )
                await asyncio.sleep(RECORD_SENT_EVERY_S)
                # Another replica takes a row whose lease is up: kept while it can be.
                with contextlib.suppress(Exception):
                    await self.store.renew(delivery.id, self.sender, SENDING_LEASE_S)

    async def _delivered(self, channel: ChannelModule, delivery: Delivery) -> list[str]:
        """The channel's ids of what it sent, its lease renewed meanwhile."""
        renewing = asyncio.create_task(
            self._renew(delivery.id), name=f"switchboard:outbox:lease:{delivery.id}"
        )
        try:
            return list(await channel.deliver(delivery))
        finally:
            await cancel_and_wait(renewing)

    async def _renew(self, delivery_id: int) -> None:
        while True:
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                if not await self.store.renew(delivery_id, self.sender, SENDING_LEASE_S):
                    return  # (another took it: its process was paused past the lease)
            except Exception as exc:  # the database away: the lease may run out, as if dead
                logger.warning("outbox: row %s's lease not renewed: %s", delivery_id, exc)

    async def _not_taken(
        self,
        delivery: Delivery,
        error: str,
        *,
        permanent: bool = False,
        held_for_recipient: bool = False,
    ) -> None:
        age_s = (datetime.now(UTC) - delivery.created_at).total_seconds()
        if permanent or age_s >= self.retry_budget_s:
            why = "refused" if permanent else f"still failing after {age_s / 3600:.1f} h"
            logger.warning(
                "outbox: %s to %s %s %s: %s",
                delivery.kind,
                delivery.channel,
                delivery.recipient,
                why,
                error,
                extra={"action": "delivery_failed"},
            )
            await self.store.failed(delivery.id, error, sender=self.sender)
            return
        delay_s = DELIVERY_BACKOFF.delay(delivery.attempts - 1)  # attempts counts this one
        logger.warning(
            "outbox: %s channel did not take row %s (%s); again in %ss",
            delivery.channel,
            delivery.id,
            error,
            delay_s,
            extra={"action": "delivery_retry"},
        )
        await self.store.later(
            delivery.id,
            error,
            delay_s,
            held_for_recipient=held_for_recipient,
            sender=self.sender,
        )
