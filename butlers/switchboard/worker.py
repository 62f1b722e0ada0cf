"""The inbox worker: classify -> route -> reply, up to `max_concurrent_messages` at once,
the messages of one conversation one at a time and in order.

Channels hand messages to `accept()`, which stores them (and only then may the channel
acknowledge them) and wakes the worker. Several switchboard processes may work on one
database: each claims messages for itself (butlers.switchboard.inbox), holds a lease on each
one it works on and renews it; a process that died has its messages taken over when their
leases run out, and one that lost a lease drops that message (the process that took it over
answers it). Whatever a crash of this process interrupted is requeued when it starts again.
A message is finished when every route its classification asked for has answered.
Finishing a message writes its reply to the outbox in the same transaction
(butlers.switchboard.outbox): from then on delivering it is the outbox's job.

Its stores are what butlers.switchboard.store says it asks of them: PostgreSQL's in a
switchboard, the in-memory ones (butlers.switchboard.memory_store) in tests/test_worker_logic.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode, Tracer

from butlers.backoff import Backoff
from butlers.channels import MCP_CHANNEL
from butlers.claude_code import known_reasons
from butlers.config import SwitchboardConfig, TriageRule
from butlers.errors import LeaseLost, RouteError
from butlers.logs import progress
from butlers.media import Attachment
from butlers.spawner import Spawner
from butlers.switchboard.attachments import (
    AttachmentStep,
    Carried,
    NotNow,
    descriptions,
    quoted,
)
from butlers.switchboard.classifier import classify_with_claude, message_body, triage
from butlers.switchboard.conversation import (
    answered_ids,
    command_of,
    help_text,
    history_text,
    is_owners,
)
from butlers.switchboard.dispatch import Dispatcher, trigger_arguments
from butlers.switchboard.handoff import Handoff
from butlers.switchboard.inbox import MAX_ATTEMPTS, InboxMessage, IncomingMessage
from butlers.switchboard.outbox import OutboxSender, Outgoing
from butlers.switchboard.replies import (
    RATE_LIMITED,
    Answer,
    answer_lost,
    combine,
    reply_text,
    sorry,
)
from butlers.switchboard.route import Router, RouteSource
from butlers.switchboard.store import InboxQueue, RoutingLog
from butlers.tasks import cancel_and_wait, within
from butlers.telemetry import context_from_carrier, current_carrier
from butlers.text import printable
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from butlers.switchboard.transcription import Transcriber

logger = logging.getLogger(__name__)

FALLBACK_NOTE_CHARS = 600  # why a message went to the default butler, as its note says
OWNER_LIMIT_FACTOR = 10  # the owner's messages an hour: ten times a sender's
IDLE_POLL_S = 5.0  # a fallback: accept() and the other processes' notifications wake it
# How long an album's first message waits after its latest part came for the next one:
# Telegram sends an album's photos as a message each, at once, but each is downloaded before it
# is stored (one at a time when polling), and a photo of a few MB can take a second to come.
# When the channel already holds more of them (`album_more`), up to ALBUM_MORE_WAIT_S: a
# download that fails is tried again after a pause (the last part then says 2 s again).
ALBUM_WAIT_S = 2.0
ALBUM_MORE_WAIT_S = 30.0


# A message whose butlers could not get to it for a reason that passes (TargetBusy: the
# Messages API overloaded, the disk full) goes back in the queue, waiting as long as it has
# waited so far (at least BUSY_RETRY_MIN_S, at most BUSY_RETRY_MAX_S), for BUSY_RETRY_S in
# all; then it fails, its sender told. Claude Code itself retries an overloaded API for a few
# seconds only.
BUSY_RETRY_S = 3600.0
BUSY_RETRY_MIN_S = 30.0
BUSY_RETRY_MAX_S = 600.0
DATABASE_RETRY_S = 60.0
# Between tries to write a message's outcome while the database fails.
FINISH_BACKOFF = Backoff((1.0, 2.0, 5.0, 10.0, 30.0, 60.0))


def busy_later(message: InboxMessage, error: str) -> NotNow | None:
    """When to try a message again whose butlers were all busy (`busy_later`'s constants),
    or None: it has waited BUSY_RETRY_S already."""
    waited = message.deferred_for_s()
    if waited >= BUSY_RETRY_S:
        return None
    delay = min(BUSY_RETRY_MAX_S, max(BUSY_RETRY_MIN_S, waited))
    logger.warning(
        "message %s: its butlers could not get to it (%s); trying again in %.0f s",
        message.id,
        error,
        delay,
        extra={"action": "busy_deferred"},
    )
    return NotNow("queued", None, f"{error} (trying again in {delay:.0f} s)", retry_in_s=delay)


def database_trouble(exc: BaseException) -> bool:
    """Whether `exc` is the database failing (or unreachable), not the message: its
    server out of disk, memory or connections, shutting down or restarting, the connection
    gone. Looked for along what it was raised from: a connection dropped within a
    transaction comes out of its end as a plain InterfaceError ("the underlying connection is
    closed"), the drop in its context (a review)."""
    import asyncpg

    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if isinstance(
            seen,
            asyncpg.InsufficientResourcesError
            | asyncpg.OperatorInterventionError
            | asyncpg.PostgresConnectionError
            | asyncpg.ConnectionDoesNotExistError
            | ConnectionError,
        ) or (isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.ECONNREFUSED)):
            return True
        if type(seen) is asyncpg.InterfaceError and "connection is closed" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def said_once(parts: Sequence[str | None]) -> str | None:
    """A message's error from what went wrong on its way (the classifier's note, each failed
    butler's error), joined with "; ". When Claude Code could not run for one known reason
    (no credentials, say) in several of its sessions, that reason is said once, first, and
    the parts say only where: "<reason> (classifier; routed to general; general: ... session
    ... failed)", not the same sentence twice."""
    said = [part for part in parts if part]
    for reason in known_reasons():
        if sum(reason in part for part in said) > 1:
            where = [part.replace(f": {reason}", "").replace(reason, "") for part in said]
            return f"{reason} ({'; '.join(where)})"
    return "; ".join(said) or None


class InboxWorker:
    def __init__(
        self,
        *,
        inbox: InboxQueue,
        routing_store: RoutingLog,
        router: Router,
        spawner: Spawner,
        triage_rules: Sequence[TriageRule],
        limits: SwitchboardConfig,
        switchboard_url: str,
        switchboard_tools: Callable[[], Sequence[str]],
        tracer: Tracer,
        outbox: OutboxSender,
        replica: str,
        transcriber: Transcriber | None = None,
    ) -> None:
        self.tracer = tracer
        self.inbox = inbox
        self.outbox = outbox
        self.outbox_store = outbox.store
        self.routing_store = routing_store
        self.router = router
        self.spawner = spawner
        self.triage_rules = tuple(triage_rules)
        self.limits = limits
        self.dispatcher = Dispatcher(router, max_routes=limits.max_routes_per_message)
        self.switchboard_url = switchboard_url
        self.switchboard_tools = switchboard_tools
        # This process's own name in `inbox.claimed_by` (butlers.switchboard.process_name:
        # `host:port/<random>`, never another live process's).
        self.replica = replica
        self.max_concurrent = limits.max_concurrent_messages
        # Voice notes to text, files loaded (butlers.switchboard.attachments); the worker owns
        # the transcriber and closes it when it stops.
        self.transcriber = transcriber
        self.attachments = AttachmentStep(inbox, transcriber, limits.transcription, replica=replica)
        self.lease_s = limits.message_lease_s
        # The classifier's sessions are bounded by the messages in flight, not by the
        # switchboard's own max_concurrent_sessions.
        self._classifier_slots = asyncio.Semaphore(self.max_concurrent)
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()  # a second Ctrl-C: the drain of a stop is cut short
        self._waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._in_flight: dict[int, asyncio.Task[None]] = {}
        # When each's lease was last confirmed (claimed, renewed): monotonic seconds.
        self._held_at: dict[int, float] = {}
        # Messages of `_in_flight` whose butlers were asked (one may have acted on it).
        self._routing: set[int] = set()

    # -- intake side ------------------------------------------------------------------------

    async def accept(self, message: IncomingMessage) -> int | None:
        """Store a message durably; returns its inbox id, or None for a duplicate.

        When this returns, the message survives a crash: the channel may acknowledge it. A
        part of an album joins the album's first message (InboxQueue.accept), which starts
        ALBUM_WAIT_S after the latest part came (ALBUM_MORE_WAIT_S while more are known to
        follow).
        """
        with self.tracer.start_as_current_span(
            "switchboard.receive",
            attributes={
                "channel": message.channel,
                "source_id": message.source_id or "",
                "message_id": message.external_id,
            },
        ):
            album_wait_s = ALBUM_MORE_WAIT_S if message.album_more else ALBUM_WAIT_S
            inbox_id = await self.inbox.accept(
                message,
                current_carrier() or None,
                album_wait_s=album_wait_s,
                max_files=self.limits.max_attachments_per_message,
            )
        if inbox_id is not None:
            self._wake.set()
            if message.album is not None and not message.album_more:  # it may start then
                asyncio.get_running_loop().call_later(album_wait_s + 0.05, self._wake.set)
        return inbox_id

    async def record_unread(
        self, message: IncomingMessage, error: str, reply: str | None = None
    ) -> int | None:
        """Keep a message its channel could not read as a failed row (its envelope, and
        `error` for the operator), and tell its sender `reply`, as a reply to it, queued in
        the same transaction: an owner whose too-big mail was not read heard nothing (a
        walkthrough). None when the row existed already (nothing is sent again). Within the
        sender's hourly limit only, as every answer is: a forged From of an allowed sender
        made us send a reply per crafted mail (a review)."""
        if reply is not None and not await self._within_sender_limit(
            message.channel, message.source_id
        ):
            reply = None
        async with self.inbox.pool.acquire() as conn, conn.transaction():
            inbox_id = await self.inbox.record_failed(message, error, conn=conn)
            if inbox_id is None or reply is None:
                return inbox_id
            stored = InboxMessage(
                id=inbox_id,
                channel=message.channel,
                external_id=message.external_id,
                source_id=message.source_id,
                sender_name=message.sender_name,
                subject=message.subject,
                text="",
                meta=message.meta,
                attempts=0,
                trace_context=None,
                conversation=message.conversation,
            )
            if outgoing := self._replies(stored, reply, None):
                await self.outbox_store.add(conn, outgoing, None)
        if outgoing:
            self.outbox.wake()
        return inbox_id

    async def files_welcome(
        self,
        channel: str,
        source_id: str | None,
        album: str | None = None,
        *,
        verified: bool = False,
    ) -> bool:
        """Whether a sender's files may be fetched and stored now: not while they are over
        `max_messages_per_sender_per_hour`. Their message is then skipped unclassified
        (`_over_sender_limit`); its files would only have filled the disk, a forwarded
        20 MiB document a hundred times over (a red team did), and held up the channel's
        other chats while they downloaded. A part of `album` counts as the album, one
        message: an album sent as the hour's last allowed message lost every photo but
        its first (a walkthrough). `verified`: a mail's sender was vouched for (the owner's
        limit then, as for their messages)."""
        return await self._within_sender_limit(channel, source_id, album, verified=verified)

    async def _within_sender_limit(
        self,
        channel: str,
        source_id: str | None,
        album: str | None = None,
        *,
        verified: bool = False,
    ) -> bool:
        """Whether the sender is within `max_messages_per_sender_per_hour` now (`album`'s
        rows, but one, not counted: the album is one message)."""
        limit = self._sender_limit(channel, source_id, verified)
        if not limit or source_id is None:
            return True
        return await self.inbox.sent_last_hour(channel, source_id, besides_album=album) < limit

    def _sender_limit(self, channel: str, source_id: str | None, verified: bool = False) -> int:
        """`max_messages_per_sender_per_hour`, OWNER_LIMIT_FACTOR times it for the owner: a
        chatty hour with their own butlers, or a morning's catch-up after the fleet was down,
        left the owner unanswered like a stranger (a walkthrough). By mail only when the
        sender was verified (`require_authentication_results`): a forged From of the owner's
        would get ten times a stranger's sessions (a review); a chat's sender is Telegram's
        to vouch for."""
        limit = self.limits.max_messages_per_sender_per_hour
        vouched = channel != "email" or verified
        if vouched and source_id is not None:
            if is_owners(f"{channel}:{source_id}", self.limits.owner):
                return limit * OWNER_LIMIT_FACTOR
        return limit

    async def album_part_dropped(self, message: IncomingMessage) -> None:
        """A part of an album its channel refused once downloaded (`message`: the part as it
        would have been stored): the album's first message waits for it no longer
        (InboxQueue.album_part_dropped), and starts when the parts that did come allow."""
        wait_s = ALBUM_MORE_WAIT_S if message.album_more else ALBUM_WAIT_S
        max_files = self.limits.max_attachments_per_message
        if (
            await self.inbox.album_part_dropped(message, wait_s, max_files=max_files)
            and not message.album_more
        ):
            asyncio.get_running_loop().call_later(wait_s + 0.05, self._wake.set)

    def wake(self) -> None:
        """Look at the queue now (a message was queued by other means, e.g. a retry)."""
        self._wake.set()

    async def wait_for(self, inbox_id: int) -> dict[str, Any]:
        """Wait until the message is done, failed or skipped; returns its inbox row."""
        # Registered before the row is read: a message that finishes meanwhile resolves it.
        future = self._waiters.setdefault(inbox_id, asyncio.get_running_loop().create_future())
        row = await self.inbox.get(inbox_id)
        if row is not None and row["status"] in ("done", "failed", "skipped"):
            if self._waiters.get(inbox_id) is future:
                del self._waiters[inbox_id]
            return row
        return await asyncio.shield(future)

    def finished_elsewhere(self, inbox_id: int) -> None:
        """Another process finished a message (its notification): an `ask` here may be
        waiting for it."""
        future = self._waiters.get(inbox_id)
        if future is not None and not future.done():
            asyncio.get_running_loop().create_task(self._resolve(inbox_id))

    async def _resolve(self, inbox_id: int) -> None:
        future = self._waiters.get(inbox_id)
        if future is None or future.done():
            return
        try:
            row = await self.inbox.get(inbox_id)
        except Exception as exc:  # the waiter hears why rather than waiting for ever
            if not future.done():
                future.set_exception(exc)
            return
        if row is not None and row["status"] in ("done", "failed", "skipped"):
            self._waiters.pop(inbox_id, None)
            if not future.done():
                future.set_result(row)

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self, *, resume: Sequence[str]) -> None:
        """Start taking messages; first, what the claimants `resume` (processes gone:
        butlers.switchboard.process_name) left under way."""
        resumed = await self.inbox.requeue_interrupted(resume)
        if resumed:
            logger.warning(
                "resuming %d message(s) left under way when the switchboard last stopped (a "
                "crash, or a stop that could not hand them back)",
                resumed,
                extra={"action": "inbox_resume"},
            )
        self._task = asyncio.create_task(self._run(), name="switchboard:inbox-worker")
        self._renewer = asyncio.create_task(self._renew_leases(), name="switchboard:leases")

    async def prune(self, older_than_days: int) -> dict[str, int]:
        """Retention: finished inbox rows and routing_log rows older than that go."""
        return {
            "inbox": await self.inbox.prune(older_than_days),
            "routing_log": await self.routing_store.prune(older_than_days),
            "outbox": await self.outbox_store.prune(older_than_days),
        }

    def hurry(self) -> None:
        """The owner stopped again (a second Ctrl-C): the messages under way are handed back
        now instead of at the end of `stop_drain_s`."""
        self._hurry.set()

    @property
    def hurried(self) -> bool:
        return self._hurry.is_set()

    async def close(self) -> int:
        """Stop: no new message is taken; those under way may finish for `stop_drain_s` (their
        leases still renewed), and the rest go back to the queue, for another process (or this
        one, started again) to take. How many `ask` calls were waiting (answered meanwhile, or
        told their message stays queued): their answers have yet to go out."""
        await cancel_and_wait(self._task)
        waiting = sum(not future.done() for future in self._waiters.values())
        under_way = [task for task in self._in_flight.values() if not task.done()]
        if under_way and self.limits.stop_drain_s > 0 and not self._hurry.is_set():
            # For the person who pressed Ctrl-C and now waits (an INFO record in a JSON log).
            them = "it" if len(under_way) == 1 else "them"
            progress(
                f"{len(under_way)} message{'s' * (len(under_way) != 1)} under way: up to "
                f"{self.limits.stop_drain_s:g} s to finish (Ctrl-C again hands {them} back to "
                "the queue now)",
                action="worker_drain",
            )
            finished = asyncio.create_task(asyncio.wait(under_way))
            hurried = asyncio.create_task(self._hurry.wait())
            await asyncio.wait(
                (finished, hurried),
                timeout=self.limits.stop_drain_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            for waiting_on in (finished, hurried):  # neither cancels a message's task
                await cancel_and_wait(waiting_on)
        await cancel_and_wait(self._renewer)
        self._task = self._renewer = None
        in_flight = dict(self._in_flight)
        for task in in_flight.values():
            await cancel_and_wait(task)
        if in_flight:
            try:
                await self.inbox.release(self.replica, list(in_flight))
            except Exception:  # their leases run out instead
                logger.warning("could not hand back messages %s", sorted(in_flight))
        told = 0
        for inbox_id, future in self._waiters.items():
            if not future.done():
                told += 1
                # Said to the caller as it is (a RuntimeError reached an `ask` as FastMCP's
                # "Error calling tool"): the message is not lost, and sending it again would
                # answer it twice.
                future.set_exception(
                    ToolRefusal(
                        f"this switchboard process stopped before message {inbox_id} was "
                        "answered; it stays queued for another switchboard process, or this "
                        f"one once started again (do not send it again: `butlers inbox` "
                        "shows it)"
                    )
                )
        self._waiters.clear()
        if self.transcriber is not None:
            await self.transcriber.aclose()
        return max(told, waiting)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            while len(self._in_flight) < self.max_concurrent:
                try:
                    message = await self.inbox.claim_next(
                        self.replica, self.lease_s, exclude=list(self._in_flight)
                    )
                except Exception:
                    logger.exception("cannot read the inbox", extra={"action": "inbox_error"})
                    break
                if message is None:
                    break
                task = asyncio.create_task(
                    self._work_on(message), name=f"switchboard:message:{message.id}"
                )
                self._in_flight[message.id] = task
                self._held_at[message.id] = time.monotonic()
            # A message finishing, one arriving (here or in another process) or a lease
            # ending elsewhere: look again.
            with contextlib.suppress(TimeoutError):
                await within(self._wake.wait(), IDLE_POLL_S)

    async def _work_on(self, message: InboxMessage) -> None:
        try:
            await self._process(message)
        except LeaseLost:
            logger.warning(
                "message %s was taken over by another switchboard process; its outcome here "
                "is dropped",
                message.id,
                extra={"action": "lease_lost"},
            )
        except Exception as exc:
            # Keep the queue moving on purpose: one message's bug must not stop the others.
            logger.exception(
                "processing inbox message %s failed",
                message.id,
                extra={"action": "inbox_process_failed"},
            )
            try:
                # Put back only if no butler was asked yet: one may have acted on it.
                later = message.id not in self._routing and message.channel != MCP_CHANNEL
                if later and database_trouble(exc) and await self._put_back(message, exc):
                    return
                # (Not held for an hour: it is already a failure's record.)
                await self._finish(
                    message, "failed", None, sorry("internal"), "internal error", hold=False
                )
            except LeaseLost:
                pass
            except Exception:
                # The database itself is failing: the message stays `processing` until its
                # lease runs out (or this process starts again), then it is resumed.
                logger.exception(
                    "cannot record inbox message %s as failed",
                    message.id,
                    extra={"action": "inbox_error"},
                )
                await asyncio.sleep(IDLE_POLL_S)
        finally:
            self._in_flight.pop(message.id, None)
            self._held_at.pop(message.id, None)
            self._routing.discard(message.id)
            self._wake.set()

    async def _put_back(self, message: InboxMessage, exc: BaseException) -> bool:
        """A message its database failed under (disk full, the server restarting: not the
        message's doing) back in the queue for DATABASE_RETRY_S, its cause on its row; not
        past BUSY_RETRY_S of such waits. It was "failed" with "internal error" and a sorry
        (a bad day's walkthrough), or lost its answer when even that could not be written.
        False: not put back (too long already; the caller fails it)."""
        if message.deferred_for_s() >= BUSY_RETRY_S:
            return False
        error = f"the database failed under it ({type(exc).__name__}: {exc})"[:500]
        put_back = await self.inbox.defer(
            message.id, replica=self.replica, delay_s=DATABASE_RETRY_S, error=error
        )
        if not put_back:
            raise LeaseLost(message.id)
        logger.warning(
            "message %s: %s; trying again in %.0f s",
            message.id,
            error,
            DATABASE_RETRY_S,
            extra={"action": "inbox_deferred"},
        )
        asyncio.get_running_loop().call_later(DATABASE_RETRY_S, self._wake.set)
        return True

    async def _renew_leases(self) -> None:
        """Every third of a lease: extend the leases of the messages in flight; a message
        whose lease another process took over is stopped here."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            ids = list(self._in_flight)
            if not ids:
                continue
            try:
                held = await self.inbox.renew(self.replica, ids, self.lease_s)
                now = time.monotonic()
                for inbox_id in held & self._held_at.keys():
                    self._held_at[inbox_id] = now
            except Exception as exc:  # tried again in a third of a lease
                logger.warning("cannot renew message leases: %s", exc)
                continue
            for inbox_id in set(ids) - held:
                self._stop_lost(inbox_id)

    def _stop_lost(self, inbox_id: int) -> None:
        """Another process took the message over: stop working on it here."""
        task = self._in_flight.get(inbox_id)
        if task is not None and not task.done():
            logger.warning(
                "message %s: the lease was lost; stopping work on it",
                inbox_id,
                extra={"action": "lease_lost"},
            )
            task.cancel()

    async def still_ours(self, message: InboxMessage) -> None:
        """Right before a butler is asked (the step that acts): the message is still this
        process's, its lease renewed; LeaseLost if another process took it over. A process
        paused past its lease (a frozen VM, SIGSTOP) woke to its classifier's `route` while
        another replica had taken the message and routed it: the butler was asked twice, the
        lease renewal only noticed after (a red team). A database that cannot say: it goes
        on only while its last renewal's lease has not run out here (a review: a paused
        process woke to a database restart as well)."""
        try:
            held = await self.inbox.renew(self.replica, [message.id], self.lease_s)
        except Exception as exc:
            since = time.monotonic() - self._held_at.get(message.id, float("-inf"))
            logger.warning("message %s: cannot renew its lease: %s", message.id, exc)
            if since < self.lease_s / 2:  # (renewed every third: well within its lease)
                return
            self._stop_lost(message.id)
            raise LeaseLost(message.id) from exc
        if message.id not in held:
            self._stop_lost(message.id)
            raise LeaseLost(message.id)
        self._held_at[message.id] = time.monotonic()

    # -- one message ------------------------------------------------------------------------

    async def _process(self, message: InboxMessage) -> None:
        parent = context_from_carrier(message.trace_context)
        token = otel_context.attach(parent) if parent is not None else None
        try:
            if await self._answered_before(message):
                return
            if message.attempts > MAX_ATTEMPTS:
                error = f"gave up after {MAX_ATTEMPTS} interrupted attempts"
                await self._finish(message, "failed", None, sorry("gave_up"), error)
                return
            if await self._over_sender_limit(message):
                return
            # A command is a message of its own: a photo captioned "/help what is this?" is
            # the photo's question (it got the help text, the photo unread: a walkthrough).
            if not descriptions(message.meta) and command_of(message.channel, message.text):
                reply = help_text(
                    await self.routing_store.registry(), switchboard=self.spawner.config.name
                )
                await self._finish(message, "done", None, reply, None, via="command")
                return
            async with self._working(message):
                carried = await self.attachments.prepare(message)
                if isinstance(carried, NotNow):
                    await self._not_now(message, carried)
                    return
                message = carried.message  # a voice note's text is its transcript
                history = history_text(
                    await self.inbox.history(message, self.limits.context_messages)
                )
                handoff = Handoff.of(
                    message,
                    carried.files,
                    owner=self.limits.owner,
                    history=history,
                    body=message_body(message),
                )
                self._routing.add(message.id)
                answers, note, via = await self._classify_and_route(carried, history, handoff)
            failures = [f"{a.butler}: {a.error}" for a in answers if not a.ok]
            # (Not `ask`'s: its caller waits for the answer, and is told why at once.)
            busy = answers and all(a.failure == "busy" for a in answers)
            if busy and message.channel != MCP_CHANNEL:
                later = busy_later(message, said_once([note, *failures]) or "busy")
                if later is not None:
                    await self._not_now(message, later)
                    return
            routed_to = ",".join(dict.fromkeys(a.butler for a in answers)) or None
            reply = combine(answers)  # people get fixed sentences; the error is the operator's
            if failures and is_owners(message.conversation, self.limits.owner):  # can read why
                reply += f"\n\n(Message {message.id}: `butlers inbox` says why.)"
            await self._finish(
                message,
                "done" if any(a.ok for a in answers) else "failed",
                routed_to,
                quoted(carried.heard, reply) if carried.heard else reply,
                said_once([note, *failures]),
                via=via,
            )
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _answered_before(self, message: InboxMessage) -> bool:
        """A message its butlers already took and answered, claimed again because the
        process at work on it was interrupted before it wrote the outcome (killed, stopped
        while the database was down, its lease lapsed in an outage): finished with a reply
        saying the answer was lost, not handed to them again (which would do it twice). The
        routing_log says who answered; a message the operator queued again (`butlers retry`)
        counts only what came after. A fresh message costs one indexed lookup."""
        handed = await self.routing_store.handed_before(message.id, message.requeued_at())
        answered = [butler for butler, ok in handed if ok]
        if not answered:
            return False
        # Another butler of it that had not answered (cancelled by the stop, failed) is named:
        # not asked again either (its own part may be done), but the sender knows to ask.
        missed = [butler for butler, ok in handed if not ok]
        error = f"answered by {', '.join(answered)} before an interruption, its answer lost"
        if missed:
            error += f"; {', '.join(missed)} had not answered"
        error += ": not asked again"
        logger.warning("message %s: %s", message.id, error, extra={"action": "answered_before"})
        reply = answer_lost(answered, missed)
        await self._finish(message, "done", ",".join(answered), reply, error)
        return True

    async def _over_sender_limit(self, message: InboxMessage) -> bool:
        """A sender over `max_messages_per_sender_per_hour` is told once, and the message is
        kept (`skipped`) but not classified: nobody can run the fleet's sessions in a loop.
        The operator's own `ask` (channel mcp) is not limited."""
        verified = bool(message.meta.get("sender_verified"))
        limit = self._sender_limit(message.channel, message.source_id, verified)
        if not limit or message.channel == "mcp" or message.source_id is None:
            return False
        if message.meta.get("retries"):  # the operator queued it again on purpose
            return False
        if message.earlier_from_sender < limit:
            return False
        error = f"over max_messages_per_sender_per_hour ({limit})"
        logger.warning(
            "message %s from %s %s: %s; not classified",
            message.id,
            message.channel,
            message.source_id,
            error,
            extra={"action": "sender_limited"},
        )
        reply = None if message.sender_told else RATE_LIMITED
        await self._finish(message, "skipped", None, reply, error, via="limit")
        return True

    async def _not_now(self, message: InboxMessage, outcome: NotNow) -> None:
        """A message its attachments stop for now: back in the queue until the transcription
        service may answer, or finished saying why."""
        if outcome.retry_in_s is None:
            await self._finish(
                message, outcome.status, None, outcome.reply, outcome.error, via="attachments"
            )
            return
        deferred = await self.inbox.defer(
            message.id,
            replica=self.replica,
            delay_s=outcome.retry_in_s,
            error=outcome.error,
            timed_out=outcome.timed_out,
        )
        if not deferred:
            raise LeaseLost(message.id)
        # Looked at again when it is due, not at the next idle poll (IDLE_POLL_S later).
        asyncio.get_running_loop().call_later(outcome.retry_in_s, self._wake.set)

    def _working(self, message: InboxMessage) -> contextlib.AbstractAsyncContextManager[None]:
        """While a message is processed, its channel may show it (Telegram: "typing...")."""
        channel = self.outbox.channels.get(message.channel)
        working = getattr(channel, "working", None)  # optional for a channel
        if working is None or message.source_id is None:
            return contextlib.nullcontext()
        return working(message.source_id)

    async def _classify_and_route(
        self, carried: Carried, history: str, handoff: Handoff
    ) -> tuple[list[Answer], str | None, str]:
        """The answers of every butler the message went to, a note on how it got there (why
        it went to the default butler, what went wrong in classification), and how it was
        classified: triage | thread | claude | default."""
        message, files = carried.message, carried.files
        with self.tracer.start_as_current_span(
            "switchboard.classify", attributes={"channel": message.channel}
        ) as span:
            via, butler = "triage", triage(self.triage_rules, message)
            if butler is None:  # a reply to one of our messages: the butler that sent it
                via, butler = "thread", await self._answering_butler(message)
            if butler is not None:
                span.set_attribute("via", via)
                span.set_attribute("butler", butler)
                answer = await self._route_one(butler, message, handoff, files)
                gone = answer.failure in ("unreachable", "refused")
                if not (via == "thread" and gone):
                    if not answer.ok:
                        span.set_status(Status(StatusCode.ERROR, (answer.error or "")[:200]))
                    return [answer], None, via
                # The butler that answered before is gone: the classifier decides afresh.
                span.set_attribute("thread_butler_gone", butler)

            span.set_attribute("via", "claude")
            async with self.dispatcher.open(
                message, handoff, files, still_ours=self.still_ours
            ) as dispatch:
                outcome = await classify_with_claude(
                    self.spawner,
                    message,
                    await self.routing_store.registry(),
                    credential=dispatch.credential,
                    default_butler=self.limits.default_butler,
                    switchboard_url=self.switchboard_url,
                    switchboard_tools=self.switchboard_tools(),
                    history=history,
                    slots=self._classifier_slots,
                )
                if dispatch.routed:
                    answers = await dispatch.answers()
                    span.set_attribute("butler", ",".join(a.butler for a in answers))
                    note = f"classifier: {outcome.error}" if outcome.error else None
                    return answers, note, "claude"
                refused = dispatch.refusals
            # It may have tried: "did not route" alone hid a route to a made-up butler. The
            # names are the model's (a stranger may have chosen them): cut, and the note too.
            tried = "; to ".join(f"{printable(b, 60)!r} was {r}" for b, r in refused[:3])
            why = outcome.error or (
                self.router.redact(printable(f"its route to {tried}", FALLBACK_NOTE_CHARS))
                if refused
                else "the classifier did not route the message"
            )
            span.set_attribute("fallback", why[:200])
        # Nothing was routed: hand the message to the default butler directly.
        default = self.limits.default_butler
        logger.warning(
            "message %s: %s; routing to %s",
            message.id,
            why,
            default,
            extra={"action": "classify_fallback"},
        )
        answer = await self._route_one(default, message, handoff, files)
        return [answer], f"classifier: {why}; routed to {default}", "default"

    async def _answering_butler(self, message: InboxMessage) -> str | None:
        """Thread affinity: the butler whose message (sent within thread_affinity_days) this
        one replies to, if it is still a butler we can route to."""
        if message.source_id is None:
            return None
        butler = await self.outbox_store.butler_answering(
            message.channel,
            message.source_id,
            answered_ids(message.channel, message.meta),
            self.limits.thread_affinity_days,
        )
        if butler is None or not await self.router.is_routable(butler):
            return None
        return butler

    async def _route_one(
        self,
        butler: str,
        message: InboxMessage,
        handoff: Handoff,
        files: Sequence[Attachment] = (),
    ) -> Answer:
        request = message_body(message)
        await self.still_ours(message)
        try:
            result = await self.router.route(
                butler,
                "trigger",
                trigger_arguments(handoff.prompt(request), files),
                source=RouteSource.of_message(message),
                request=request,
            )
        except RouteError as exc:
            return Answer(butler, failure=exc.kind, error=str(exc))
        return Answer(butler, text=reply_text(result))

    async def _finish(
        self,
        message: InboxMessage,
        status: str,
        routed_to: str | None,
        reply: str | None,
        error: str | None,
        *,
        via: str | None = None,
        hold: bool = True,
    ) -> None:
        """The message's outcome and its reply's outbox rows, in one transaction: a crash
        leaves the message either to be processed again or answered, never both. `hold`:
        tried again while the database fails (up to BUSY_RETRY_S)."""
        outgoing = self._replies(message, reply, routed_to)

        async def write() -> None:
            async with self.inbox.pool.acquire() as conn, conn.transaction():
                finished = await self.inbox.finish(
                    message.id,
                    replica=self.replica,
                    status=status,
                    routed_to=routed_to,
                    reply=reply,
                    error=error,
                    classified_via=via,
                    conn=conn,
                )
                if not finished:  # rolled back: the process that took it over answers it
                    raise LeaseLost(message.id)
                if outgoing:
                    await self.outbox_store.add(conn, outgoing, message.trace_context)

        started = time.monotonic()
        for failures in itertools.count():
            try:
                await asyncio.shield(write())
                break
            except LeaseLost:
                # After a failed try: its COMMIT may have gone through, the answer lost with
                # the connection. Then the outcome is ours, written: not "taken over".
                if failures and await self._finished_here(message.id):
                    break
                raise
            except Exception as exc:
                # The outcome is held here until the database takes it: given up, the
                # message was claimed again once its lease ran out, and its butlers asked
                # again (a review of a bad day). Not past BUSY_RETRY_S.
                waited = time.monotonic() - started
                if not hold or not database_trouble(exc) or waited > BUSY_RETRY_S:
                    raise
                delay = FINISH_BACKOFF.delay(failures)
                logger.warning(
                    "message %s: its outcome cannot be written yet (%s: %s); trying again in "
                    "%.0f s",
                    message.id,
                    type(exc).__name__,
                    exc,
                    delay,
                    extra={"action": "inbox_finish_deferred"},
                )
                await asyncio.sleep(delay)
        if outgoing:
            self.outbox.wake()
        future = self._waiters.pop(message.id, None)
        if future is not None and not future.done():
            row = await self.inbox.get(message.id)
            # This process's own notification of the finish may have resolved it meanwhile
            # (`_resolve`, which took the waiter before it was popped here).
            if not future.done():
                future.set_result(row or {})

    async def _finished_here(self, inbox_id: int) -> bool:
        """Whether this replica finished the message (its row done, failed or skipped)."""
        row = await self.inbox.get(inbox_id)
        return (
            row is not None
            and row.get("claimed_by") == self.replica
            and row.get("status") in ("done", "failed", "skipped")
        )

    def _replies(
        self, message: InboxMessage, reply: str | None, routed_to: str | None
    ) -> list[Outgoing]:
        """The outbox rows of a reply on the message's channel (none for `ask`, whose caller
        reads the reply from the inbox row)."""
        channel = self.outbox.channels.get(message.channel)
        if reply is None or channel is None or message.source_id is None:
            return []
        # A single butler answered: a reply to this reply goes back to it (thread affinity).
        butler = routed_to if routed_to and "," not in routed_to else None
        return [
            Outgoing(
                kind="reply",
                channel=message.channel,
                recipient=message.source_id,
                text=text,
                meta=meta,
                inbox_id=message.id,
                butler=butler,
                conversation=message.conversation,
            )
            for text, meta in channel.prepare(reply, reply_to=message, butler=butler)
        ]
