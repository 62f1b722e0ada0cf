"""deliver: butlers speak first. A butler's session calls its own `notify` tool, its daemon
calls the switchboard's `deliver`, and the notification goes through the outbox like any
reply: to the conversation the session is serving (a routed message's), or else to the
owner (`[switchboard.owner]`), on the channel asked for or the owner's preferred one.

Each notification is a `routing_log` row (`source_channel = 'butler'`, `tool_name =
'notify'`) in the session's trace, and a butler may send at most `max_notifications_per_hour`
(a reminder loop gone wrong must not flood its person).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from butlers.channels import CHANNELS, spec_of
from butlers.config import MAX_ATTACHMENT_BYTES, SwitchboardConfig
from butlers.core_store import storable
from butlers.errors import AttachmentRefused, NotifyRefused
from butlers.media import Attachment, as_its_type, check_count, checked, from_wire
from butlers.memory import person_of
from butlers.switchboard.conversation import is_owners
from butlers.switchboard.inbox import InboxMessage
from butlers.switchboard.outbox import OutboxSender, Outgoing
from butlers.switchboard.route import summarize
from butlers.switchboard.routing_store import RouteRecord
from butlers.switchboard.store import InboxQueue, RoutingLog
from butlers.telemetry import current_carrier, current_trace_id
from butlers.text import printable

MAX_NOTIFICATION_CHARS = 32_000
NOTIFY_TOOL = "notify"
# Where the owner is reached, one key per channel under [switchboard.owner].
OWNER_KEYS = tuple(spec.owner_key for spec in CHANNELS if spec.owner_key)


@dataclass(frozen=True)
class Destination:
    channel: str
    recipient: str
    conversation: str | None
    reply_to: InboxMessage | None  # a mail conversation: continue its thread


class NotificationDesk:
    def __init__(
        self,
        *,
        limits: SwitchboardConfig,
        inbox: InboxQueue,
        routing_store: RoutingLog,
        outbox: OutboxSender,
    ) -> None:
        self.limits = limits
        self.inbox = inbox
        self.routing_store = routing_store
        self.outbox = outbox

    async def deliver(
        self,
        text: str,
        butler: str,
        channel: str | None,
        conversation: str | None,
        attachments: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Queue a notification, with the files it carries (`attachments`: the wire form,
        butlers.media); what it was queued for. Raises NotifyRefused."""
        started = time.monotonic()
        destination: Destination | None = None
        error: str | None = None
        try:
            # Reading the files' types and sizes may take a while: off the event loop.
            files = await asyncio.to_thread(self._files, attachments) if attachments else ()
            destination = await self._check(text, butler, channel, conversation)
            spec = spec_of(destination.channel)
            carried = spec.carries if spec is not None else frozenset()
            if refused := [f.name for f in files if f.kind not in carried]:
                raise NotifyRefused(
                    f"attachments: the {destination.channel} channel cannot carry {refused}"
                )
            chunks = self.outbox.channels[destination.channel].prepare(
                text, reply_to=destination.reply_to, butler=butler
            )
            placed = (
                spec.with_files(chunks, files)
                if spec is not None
                else [(chunk, meta, ()) for chunk, meta in chunks]
            )
            outgoing = [
                Outgoing(
                    kind="notification",
                    channel=destination.channel,
                    recipient=destination.recipient,
                    text=chunk,
                    meta=meta,
                    butler=butler,
                    conversation=destination.conversation,
                    attachments=row_files,
                )
                for chunk, meta, row_files in placed
            ]
            async with self.outbox.store.pool.acquire() as conn, conn.transaction():
                await self.outbox.store.add(conn, outgoing, current_carrier() or None)
            self.outbox.wake()
            return {
                "queued": len(outgoing),
                "files": len(files),
                "channel": destination.channel,
                "to": "conversation" if destination.conversation else "owner",
            }
        except NotifyRefused as exc:
            error = str(exc)
            raise
        finally:
            await self.routing_store.record_route(
                RouteRecord(
                    source_channel="butler",
                    source_id=butler,
                    routed_to=destination.channel if destination else (channel or "owner"),
                    tool_name=NOTIFY_TOOL,
                    prompt_summary=storable(summarize({"prompt": text})),
                    trace_id=current_trace_id(),
                    success=error is None,
                    error=error,
                    duration_ms=int((time.monotonic() - started) * 1000),
                )
            )

    def _files(self, attachments: Sequence[Mapping[str, Any]] | None) -> tuple[Attachment, ...]:
        """The files checked as an incoming one is: the type read from the bytes, the size
        within MAX_ATTACHMENT_BYTES, at most `max_attachments_per_message`. A butler's session
        may have been talked into sending a file, but only to the person it serves (or the
        owner), and only what a person could have sent us."""
        if not attachments:
            return ()
        try:
            check_count(len(attachments), self.limits.max_attachments_per_message)
            files = tuple(
                as_its_type(checked(file.data, file.name, max_bytes=MAX_ATTACHMENT_BYTES))
                for file in from_wire(attachments)
            )
        except AttachmentRefused as exc:
            raise NotifyRefused(f"attachments: {exc}") from None
        return files

    async def _check(
        self, text: str, butler: str, channel: str | None, conversation: str | None
    ) -> Destination:
        if not text.strip():
            raise NotifyRefused("the text must not be empty")
        if len(text) > MAX_NOTIFICATION_CHARS:
            raise NotifyRefused(
                f"the text is {len(text)} characters; the limit is {MAX_NOTIFICATION_CHARS}"
            )
        limit = self.limits.max_notifications_per_hour
        if limit and await self.outbox.store.notifications_last_hour(butler) >= limit:
            raise NotifyRefused(
                f"{butler} already sent {limit} notifications in the last hour, the limit "
                "(max_notifications_per_hour): send fewer, or say more in one"
            )
        # `channel` picks one of the owner's channels: for a conversation with someone else it
        # is ignored (it once sent a person's session's text, and their reminders', to the
        # owner, who would read it as their butler's own words).
        destination = (
            await self._conversation(conversation)
            if conversation and (channel is None or not is_owners(conversation, self.limits.owner))
            else self._owner(channel)
        )
        if destination.channel not in self.outbox.channels:
            raise NotifyRefused(f"the {destination.channel} channel is not running here")
        return destination

    async def _conversation(self, conversation: str) -> Destination:
        """The conversation a routed message belongs to: its channel and its person."""
        last = await self.inbox.last_of_conversation(conversation)
        if last is None or last.source_id is None:
            raise NotifyRefused(f"no conversation {conversation!r} to notify")
        if await self.may_write(conversation) is False:
            # Unpaired or taken off the allowlist: what they planted (a reminder) no longer
            # reaches them.
            raise NotifyRefused(
                f"{printable(conversation, 120)!r} may no longer write to the {last.channel} "
                "channel (not allowlisted, not paired): not notified"
            )
        spec = spec_of(last.channel)
        # A mail continues its thread; a chat message stands on its own.
        reply_to = last if spec is not None and spec.continues_thread else None
        return Destination(last.channel, last.source_id, conversation, reply_to)

    async def may_write(self, conversation: str) -> bool | None:
        """Whether the person of `conversation` may still write here (the owner, or one
        allowlisted or paired on its channel): a butler asks before it runs a reminder their
        message planted, which could reach them no more. None: cannot say (its channel is
        not running here: a switchboard started without its credentials)."""
        if is_owners(conversation, self.limits.owner):
            return True
        # The person is the conversation's: `telegram:<chat>`, `email:<address>` (the inbox
        # keeps their messages only for retention_days; a yearly reminder outlives them).
        name, _, sender = person_of(conversation).partition(":")
        channel = self.outbox.channels.get(name)
        if channel is None:
            return None
        return bool(sender) and await channel.may_write(sender)

    def _owner(self, channel: str | None) -> Destination:
        reachable = self.limits.owner.channels()
        if not reachable:
            raise NotifyRefused(
                f"no owner to notify: set {' or '.join(OWNER_KEYS)} under [switchboard.owner] "
                "in the switchboard's butler.toml"
            )
        if channel is not None:
            reachable = [c for c in reachable if c[0] == channel]
            if not reachable:
                raise NotifyRefused(f"the owner has no {channel} set under [switchboard.owner]")
        chosen, recipient = reachable[0]
        return Destination(chosen, recipient, None, None)
