"""The inbox worker: one message at a time, in arrival order, classify -> route -> reply.

Channels hand messages to `accept()`, which stores them (and only then may the channel
acknowledge them) and wakes the worker. Whatever a crash interrupts is requeued at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode, Tracer

from butlers.config import TriageRule
from butlers.spawner import Spawner
from butlers.switchboard.classifier import (
    DEFAULT_BUTLER,
    classify_with_claude,
    message_body,
    triage,
)
from butlers.switchboard.inbox import MAX_ATTEMPTS, InboxMessage, InboxStore, IncomingMessage
from butlers.switchboard.route import RouteError, Router, RouteSource
from butlers.switchboard.store import SwitchboardStore
from butlers.tasks import cancel_and_wait
from butlers.telemetry import context_from_carrier, current_carrier

logger = logging.getLogger(__name__)

Replier = Callable[[InboxMessage, str], Awaitable[None]]
IDLE_POLL_S = 5.0  # a fallback: accept() wakes the worker at once
ERROR_REPLY = "Sorry, I could not handle your message: {error}"


def reply_text(result: Any) -> str:
    """What the person reads: a butler's `trigger` answer, or the result as text."""
    if isinstance(result, dict) and isinstance(result.get("result"), str):
        return result["result"]
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)


def source_of(message: InboxMessage) -> RouteSource:
    return RouteSource(channel=message.channel, source_id=message.source_id, inbox_id=message.id)


class InboxWorker:
    def __init__(
        self,
        *,
        inbox: InboxStore,
        store: SwitchboardStore,
        router: Router,
        spawner: Spawner,
        triage_rules: Sequence[TriageRule],
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

    async def wait_for(self, inbox_id: int) -> dict[str, Any]:
        """Wait until the message is done or failed; returns its inbox row."""
        row = await self.inbox.get(inbox_id)
        if row is not None and row["status"] in ("done", "failed"):
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

    # -- one message ------------------------------------------------------------------------

    async def _process(self, message: InboxMessage) -> None:
        parent = context_from_carrier(message.trace_context)
        token = otel_context.attach(parent) if parent is not None else None
        try:
            if message.attempts > MAX_ATTEMPTS:
                error = f"gave up after {MAX_ATTEMPTS} interrupted attempts"
                await self._reply(message, ERROR_REPLY.format(error=error))
                await self._finish(message, "failed", None, None, error)
                return
            routed_to, reply, error = await self._classify_and_route(message)
            if reply is None:
                await self._reply(message, ERROR_REPLY.format(error=error))
                await self._finish(message, "failed", routed_to, None, error)
                return
            reply_error = await self._reply(message, reply)
            if reply_error:
                await self._finish(message, "failed", routed_to, reply, reply_error)
            else:
                await self._finish(message, "done", routed_to, reply, error)
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _classify_and_route(
        self, message: InboxMessage
    ) -> tuple[str | None, str | None, str | None]:
        """(routed_to, reply, note): reply None means it failed, and note says why."""
        prompt = message_body(message)
        with self.tracer.start_as_current_span(
            "switchboard.classify", attributes={"channel": message.channel}
        ) as span:
            butler = triage(self.triage_rules, message)
            span.set_attribute("via", "triage" if butler else "claude")
            if butler is not None:
                try:
                    result = await self.router.route(
                        butler, "trigger", {"prompt": prompt}, source=source_of(message)
                    )
                except RouteError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
                    return butler, None, str(exc)
                return butler, reply_text(result), None

            outcome = await classify_with_claude(
                self.spawner,
                message,
                await self.store.registry(),
                switchboard_url=self.switchboard_url,
                switchboard_tools=self.switchboard_tools(),
            )
            routed_to, reply = await self.inbox.routed(message.id)
            if routed_to is not None and reply is not None:
                span.set_attribute("butler", routed_to)
                return routed_to, reply, None
            why = outcome.error or "the classifier did not route the message"
            span.set_attribute("fallback", why[:200])
        # Not routed by the classifier: hand it to the default butler directly.
        logger.warning(
            "message %s: %s; routing to %s",
            message.id,
            why,
            DEFAULT_BUTLER,
            extra={"action": "classify_fallback"},
        )
        try:
            result = await self.router.route(
                DEFAULT_BUTLER, "trigger", {"prompt": prompt}, source=source_of(message)
            )
        except RouteError as exc:
            return DEFAULT_BUTLER, None, f"{why}; routing to {DEFAULT_BUTLER} failed: {exc}"
        return DEFAULT_BUTLER, reply_text(result), f"classifier: {why}; routed to {DEFAULT_BUTLER}"

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
