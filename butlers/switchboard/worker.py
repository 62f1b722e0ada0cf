"""The inbox worker: one message at a time, in arrival order, classify -> route -> reply.

Channels hand messages to `accept()`, which stores them (and only then may the channel
acknowledge them) and wakes the worker. Whatever a crash interrupts is requeued at start-up.
A message is replied to before the next one starts, also when the classifier routed it to
several butlers: the worker waits for every route the classification session asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode, Tracer

from butlers.config import SwitchboardConfig, TriageRule
from butlers.spawner import Spawner
from butlers.switchboard.classifier import classify_with_claude, message_body, triage
from butlers.switchboard.dispatch import Dispatcher
from butlers.switchboard.inbox import MAX_ATTEMPTS, InboxMessage, InboxStore, IncomingMessage
from butlers.switchboard.replies import RATE_LIMITED, Answer, combine, reply_text, sorry
from butlers.switchboard.route import RouteError, Router, RouteSource
from butlers.switchboard.store import SwitchboardStore
from butlers.tasks import cancel_and_wait
from butlers.telemetry import context_from_carrier, current_carrier

logger = logging.getLogger(__name__)

Replier = Callable[[InboxMessage, str], Awaitable[None]]
IDLE_POLL_S = 5.0  # a fallback: accept() wakes the worker at once


class InboxWorker:
    def __init__(
        self,
        *,
        inbox: InboxStore,
        store: SwitchboardStore,
        router: Router,
        spawner: Spawner,
        triage_rules: Sequence[TriageRule],
        limits: SwitchboardConfig,
        switchboard_url: str,
        switchboard_tools: Callable[[], Sequence[str]],
        tracer: Tracer,
    ) -> None:
        self.tracer = tracer
        self.inbox = inbox
        self.store = store
        self.router = router
        self.spawner = spawner
        self.triage_rules = tuple(triage_rules)
        self.limits = limits
        self.dispatcher = Dispatcher(router, max_routes=limits.max_routes_per_message)
        self.switchboard_url = switchboard_url
        self.switchboard_tools = switchboard_tools
        self.repliers: dict[str, Replier] = {}
        self._wake = asyncio.Event()
        self._waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None

    # -- intake side ------------------------------------------------------------------------

    async def accept(self, message: IncomingMessage) -> int | None:
        """Store a message durably; returns its inbox id, or None for a duplicate.

        When this returns, the message survives a crash: the channel may acknowledge it.
        """
        with self.tracer.start_as_current_span(
            "switchboard.receive",
            attributes={
                "channel": message.channel,
                "source_id": message.source_id or "",
                "message_id": message.external_id,
            },
        ):
            inbox_id = await self.inbox.accept(message, current_carrier() or None)
        if inbox_id is not None:
            self._wake.set()
        return inbox_id

    def wake(self) -> None:
        """Look at the queue now (a message was queued by other means, e.g. a retry)."""
        self._wake.set()

    async def wait_for(self, inbox_id: int) -> dict[str, Any]:
        """Wait until the message is done, failed or skipped; returns its inbox row."""
        row = await self.inbox.get(inbox_id)
        if row is not None and row["status"] in ("done", "failed", "skipped"):
            return row
        future = self._waiters.setdefault(inbox_id, asyncio.get_running_loop().create_future())
        return await asyncio.shield(future)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        resumed = await self.inbox.requeue_interrupted()
        if resumed:
            logger.warning(
                "resuming %d message(s) interrupted by a crash",
                resumed,
                extra={"action": "inbox_resume"},
            )
        self._task = asyncio.create_task(self._run(), name="switchboard:inbox-worker")

    async def prune(self, older_than_days: int) -> dict[str, int]:
        """Retention: finished inbox rows and routing_log rows older than that go."""
        return {
            "inbox": await self.inbox.prune(older_than_days),
            "routing_log": await self.store.prune(older_than_days),
        }

    async def stop(self) -> None:
        """Stop now; a message being processed stays `processing` and is resumed next start."""
        await cancel_and_wait(self._task)
        self._task = None
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(RuntimeError("the switchboard is stopping"))
        self._waiters.clear()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                message = await self.inbox.claim_next()
            except Exception:
                logger.exception("cannot read the inbox", extra={"action": "inbox_error"})
                message = None
            if message is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                continue
            try:
                await self._process(message)
            except Exception:
                # Keep the queue moving on purpose: one message's bug must not stop the others.
                logger.exception(
                    "processing inbox message %s failed",
                    message.id,
                    extra={"action": "inbox_process_failed"},
                )
                await self._finish(message, "failed", None, None, "internal error")
                with contextlib.suppress(Exception):
                    await self._reply(message, sorry("internal"))

    # -- one message ------------------------------------------------------------------------

    async def _process(self, message: InboxMessage) -> None:
        parent = context_from_carrier(message.trace_context)
        token = otel_context.attach(parent) if parent is not None else None
        try:
            if message.attempts > MAX_ATTEMPTS:
                error = f"gave up after {MAX_ATTEMPTS} interrupted attempts"
                reply = sorry("gave_up")
                await self._finish(
                    message, "failed", None, reply, await self._reply(message, reply) or error
                )
                return
            if await self._over_sender_limit(message):
                return
            answers, note = await self._classify_and_route(message)
            reply = combine(answers)
            failures = [f"{a.butler}: {a.error}" for a in answers if not a.ok]
            error = "; ".join(filter(None, [note, *failures])) or None
            routed_to = ",".join(dict.fromkeys(a.butler for a in answers)) or None
            await self.inbox.store_reply(message.id, routed_to, reply)
            reply_error = await self._reply(message, reply)
            status = "done" if any(a.ok for a in answers) and reply_error is None else "failed"
            await self._finish(message, status, routed_to, reply, reply_error or error)
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _over_sender_limit(self, message: InboxMessage) -> bool:
        """A sender over `max_messages_per_sender_per_hour` is told once, and the message is
        kept (`skipped`) but not classified: nobody can run the fleet's sessions in a loop.
        The operator's own `ask` (channel mcp) is not limited."""
        limit = self.limits.max_messages_per_sender_per_hour
        if not limit or message.channel == "mcp" or message.source_id is None:
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
        reply = None
        if not message.sender_told:
            reply = RATE_LIMITED
            await self.inbox.store_reply(message.id, None, reply)
            error = await self._reply(message, reply) or error
        await self._finish(message, "skipped", None, reply, error)
        return True

    async def _classify_and_route(self, message: InboxMessage) -> tuple[list[Answer], str | None]:
        """The answers of every butler the message went to, and a note on how it got there
        (why it went to the default butler, what went wrong in classification)."""
        with self.tracer.start_as_current_span(
            "switchboard.classify", attributes={"channel": message.channel}
        ) as span:
            butler = triage(self.triage_rules, message)
            span.set_attribute("via", "triage" if butler else "claude")
            if butler is not None:
                answer = await self._route_one(butler, message)
                if not answer.ok:
                    span.set_status(Status(StatusCode.ERROR, (answer.error or "")[:200]))
                return [answer], None

            async with self.dispatcher.open(message) as dispatch:
                outcome = await classify_with_claude(
                    self.spawner,
                    message,
                    await self.store.registry(),
                    credential=dispatch.credential,
                    default_butler=self.limits.default_butler,
                    switchboard_url=self.switchboard_url,
                    switchboard_tools=self.switchboard_tools(),
                )
                if dispatch.routed:
                    answers = await dispatch.answers()
                    span.set_attribute("butler", ",".join(a.butler for a in answers))
                    return answers, (f"classifier: {outcome.error}" if outcome.error else None)
            why = outcome.error or "the classifier did not route the message"
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
        return [await self._route_one(default, message)], f"classifier: {why}; routed to {default}"

    async def _route_one(self, butler: str, message: InboxMessage) -> Answer:
        try:
            result = await self.router.route(
                butler,
                "trigger",
                {"prompt": message_body(message)},
                source=RouteSource.of_message(message),
            )
        except RouteError as exc:
            return Answer(butler, failure=exc.kind, error=str(exc))
        return Answer(butler, text=reply_text(result))

    async def _reply(self, message: InboxMessage, text: str) -> str | None:
        """Send the reply on the message's channel; returns an error text if that failed."""
        replier = self.repliers.get(message.channel)
        if replier is None:
            return None  # e.g. `ask`: the caller reads the reply from the inbox row
        with self.tracer.start_as_current_span(
            "switchboard.reply", attributes={"channel": message.channel}
        ) as span:
            try:
                await replier(message, text)
            except Exception as exc:
                logger.exception(
                    "reply to inbox message %s failed", message.id, extra={"action": "reply_failed"}
                )
                span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
                return f"reply failed: {exc}"
        return None

    async def _finish(
        self,
        message: InboxMessage,
        status: str,
        routed_to: str | None,
        reply: str | None,
        error: str | None,
    ) -> None:
        await asyncio.shield(
            self.inbox.finish(
                message.id, status=status, routed_to=routed_to, reply=reply, error=error
            )
        )
        future = self._waiters.pop(message.id, None)
        if future is not None and not future.done():
            row = await self.inbox.get(message.id)
            future.set_result(row or {})
