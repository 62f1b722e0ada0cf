"""The switchboard's own MCP tools (route, deliver, list_butlers, routing_log_entry, discover,
ask; the operator's come from butlers.switchboard.operator), and `attach_switchboard`, which
builds the parts they use (Switchboard) and registers them on the butler's FastMCP server.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastmcp import FastMCP
from pydantic import JsonValue

from butlers.config import Placement, SwitchboardConfig, TriageRule
from butlers.errors import NotifyRefused, RouteError, RoutePolicyError, RouteRefused
from butlers.mcp_connection.pool import McpConnections
from butlers.mcp_middleware import classification_claim
from butlers.spawner import Spawner
from butlers.switchboard.approvals import ApprovalDesk, ApprovalStore, register_approval_tools
from butlers.switchboard.dispatch import Dispatch, Dispatcher
from butlers.switchboard.inbox import InboxStore, IncomingMessage
from butlers.switchboard.leadership import Connect, LeaderDuty, Leadership
from butlers.switchboard.notify import Notifier
from butlers.switchboard.operator import register_operator_tools
from butlers.switchboard.outbox import OutboxSender, OutboxStore
from butlers.switchboard.pairing import PairingDesk, PairingStore, register_pairing_tools
from butlers.switchboard.registry import discover
from butlers.switchboard.route import OwnEndpoints, Router
from butlers.switchboard.routing_store import RoutingStore
from butlers.switchboard.transcription import Transcriber
from butlers.switchboard.wakeups import WakeupHandlers, Wakeups
from butlers.switchboard.worker import InboxWorker
from butlers.tool_errors import ToolRefusal

MAX_ASK_CHARS = 200_000


@dataclass
class Switchboard:
    """What the switchboard has beyond a plain butler; opened and closed with its daemon."""

    routing_store: RoutingStore
    router: Router
    connections: McpConnections  # to the other butlers (route)
    worker: InboxWorker
    outbox: OutboxSender
    config_dir: Path
    placement: Placement  # what discover fills in for what a butler.toml leaves out
    leadership: Leadership | None = None  # once started: pollers and outbox on one process
    wakeups: Wakeups | None = None  # once started: the other processes' notifications
    approvals: ApprovalDesk | None = None  # calls waiting for the owner's yes
    pairing: PairingDesk | None = None  # strangers' codes and paired senders

    async def ask(self, text: str, *, source_id: str = "ask") -> dict[str, Any]:
        """`text` through the whole inbox -> classify -> route path as a message of the `mcp`
        channel from `source_id` (`ask`, the dashboard's form), and what came of it.
        ToolRefusal for an empty or oversized text."""
        if not text.strip():
            raise ToolRefusal("text must not be empty")
        if len(text) > MAX_ASK_CHARS:
            raise ToolRefusal(f"text is {len(text)} characters; the limit is {MAX_ASK_CHARS}")
        inbox_id = await self.worker.accept(
            IncomingMessage(
                channel="mcp", external_id=str(uuid.uuid4()), text=text, source_id=source_id
            )
        )
        assert inbox_id is not None  # a fresh uuid is never a duplicate
        row = await self.worker.wait_for(inbox_id)
        return {
            "inbox_id": inbox_id,
            "status": row.get("status"),
            "routed_to": row.get("routed_to"),
            "reply": row.get("reply"),
            "error": row.get("error"),
        }

    async def discover(self) -> dict[str, Any]:
        report = await discover(self.routing_store, self.config_dir, self.placement)
        self.router.forget_endpoints()
        return report

    async def start_worker(self) -> None:
        """Once the switchboard serves: the classifier's sessions connect back to it."""
        await self.worker.start()

    async def start_leadership(self, connect: Connect, duties: Sequence[LeaderDuty]) -> None:
        """Once the channel modules (registered in `outbox.channels`) have started: listen to
        the other switchboard processes, and run `duties` (the channels' pollers) and the
        outbox if this process is, or becomes, the leader. `connect`: a connection of their
        own to the switchboard's database."""
        self.wakeups = Wakeups(
            connect,
            WakeupHandlers(
                queued=self.worker.wake,
                finished=self.worker.finished_elsewhere,
                outbox=lambda _channel: self.outbox.wake(),
            ),
        )
        await self.wakeups.start()
        leader_only: list[LeaderDuty] = [*duties, self.outbox]
        if self.approvals is not None:  # its sweep: expiry, calls whose butler was down
            leader_only.append(self.approvals)
        self.leadership = Leadership(connect, leader_only, replica=self.worker.replica)
        await self.leadership.start()

    async def close(self) -> None:
        if self.leadership is not None:  # the pollers and the outbox stop; the lock is let go
            await self.leadership.stop()
        if self.wakeups is not None:
            await self.wakeups.stop()
        if self.approvals is not None:
            await self.approvals.close()
        await self.worker.stop()
        await self.connections.close()


def _classification_of_caller(dispatcher: Dispatcher) -> Dispatch | None:
    """The message whose classification session is calling, or None for any other caller.

    A session proves it is one by this message's credential; a claim to be one without the
    right credential (or naming an inbox id, as sessions once did) is refused rather than
    treated as an ordinary caller.
    """
    claim = classification_claim()
    if claim is None:
        return None
    if claim.credential is None:
        raise ToolRefusal(f"{claim.where} is not accepted: it proves nothing")
    dispatch = dispatcher.find(claim.credential)
    if dispatch is None:
        raise ToolRefusal(f"{claim.where} names no message being classified")
    return dispatch


def attach_switchboard(
    mcp: FastMCP,
    routing_store: RoutingStore,
    inbox: InboxStore,
    spawner: Spawner,
    *,
    config_dir: Path,
    placement: Placement,
    self_url: str,
    tool_names: Callable[[], Sequence[str]],
    triage_rules: Sequence[TriageRule] = (),
    limits: SwitchboardConfig,
    auth_token: str | None,
    replica: str,
    redact: Callable[[str], str] = str,
    transcriber: Transcriber | None = None,
) -> Switchboard:
    """Create the switchboard's parts and register its tools: route, deliver, list_butlers,
    routing_log_entry, discover, ask, the operator's inbox_list, inbox_retry,
    routing_log_list and outbox_list, the approvals' (butlers.switchboard.approvals) and
    pairing's (butlers.switchboard.pairing)."""
    connections = McpConnections(auth_token=auth_token)
    tracer = spawner.telemetry.tracer
    # The switchboard is whichever butler has a [switchboard] table: routing to it is refused
    # by its configured name and by its addresses (a stale row of an old name points here).
    router = Router(
        routing_store,
        connections,
        tracer=tracer,
        redact=redact,
        switchboard_name=spawner.config.name,
        own=OwnEndpoints.of_switchboard(spawner.config, self_url),
    )
    outbox = OutboxSender(
        OutboxStore(routing_store.pool), tracer=tracer, retry_hours=limits.reply_retry_hours
    )
    worker = InboxWorker(
        inbox=inbox,
        routing_store=routing_store,
        router=router,
        spawner=spawner,
        triage_rules=triage_rules,
        limits=limits,
        switchboard_url=self_url,
        switchboard_tools=tool_names,
        tracer=tracer,
        outbox=outbox,
        replica=replica,
        transcriber=transcriber,
    )
    switchboard = Switchboard(
        routing_store, router, connections, worker, outbox, config_dir, placement
    )

    @mcp.tool
    async def route(
        butler_name: str, tool_name: str, args: dict[str, Any] | None = None
    ) -> JsonValue:
        """Call `tool_name` with `args` on the butler `butler_name`; returns its answer.

        From a classification session: only `trigger` with `{"prompt": ...}`, answered with
        "accepted" at once; the switchboard delivers it and replies to the sender."""
        classification = _classification_of_caller(worker.dispatcher)
        if classification is not None:
            try:
                return await classification.accept(butler_name, tool_name, args)
            except RoutePolicyError as exc:
                # What a message talked its classifier into: an operator wants to see that.
                raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
        try:
            return await router.route(butler_name, tool_name, args)
        except RouteError as exc:  # a target that failed is worth a warning; a typo is not
            level = logging.INFO if isinstance(exc, RouteRefused) else logging.WARNING
            raise ToolRefusal(str(exc), log_level=level) from exc

    notifier = Notifier(limits=limits, inbox=inbox, routing_store=routing_store, outbox=outbox)

    @mcp.tool
    async def deliver(
        text: str,
        butler: str,
        channel: str | None = None,
        conversation: str | None = None,
        attachments: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Send a butler's notification to its person: to `conversation` (a routed message's,
        e.g. "telegram:12345"), else to the owner ([switchboard.owner]) on `channel`
        (telegram | email) or the owner's preferred one; with `attachments` (images, PDFs,
        text files: [{name, mime_type, data (base64)}]) as photos, documents or mail
        attachments. Through the outbox: it waits out a channel that is down."""
        if _classification_of_caller(worker.dispatcher) is not None:
            # A message's classifier may only route it (it is not shown this tool either).
            raise ToolRefusal(
                "deliver is not for classification sessions", log_level=logging.WARNING
            )
        try:
            return await notifier.deliver(text, butler, channel, conversation, attachments)
        except NotifyRefused as exc:
            raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc

    @mcp.tool
    async def list_butlers() -> list[dict[str, Any]]:
        """Every registered butler: name, endpoint_url, description, modules, last_seen_at,
        registered_at; `stale` when the last discover did not find it (not routed to until
        one does) and `is_switchboard` when it had a [switchboard] table."""
        return await routing_store.registry()

    @mcp.tool
    async def routing_log_entry(id: str) -> dict[str, Any]:
        """One routing_log row by its id: where the call went, whether it worked, and the
        trace_id to look it up in Jaeger."""
        try:
            entry_id = uuid.UUID(id)
        except ValueError:
            raise ToolRefusal(f"id must be a routing_log id (a UUID), got {id!r}") from None
        row = await routing_store.routing_entry(entry_id)
        if row is None:
            raise ToolRefusal(f"no routing_log row with id {id}")
        return row

    @mcp.tool(name="discover")
    async def discover_tool() -> dict[str, Any]:
        """Re-scan the butler config directory: add new butlers, update changed ones, report
        stale ones (never deleted) and broken configs."""
        return await switchboard.discover()

    @mcp.tool
    async def ask(text: str) -> dict[str, Any]:
        """Send `text` through the whole inbox -> classify -> route path, as a message from
        this MCP client, and return the reply (what Telegram or email would have sent)."""
        return await switchboard.ask(text)

    register_operator_tools(mcp, switchboard, jaeger_ui_url=spawner.settings.jaeger_ui_url)
    switchboard.approvals = ApprovalDesk(
        ApprovalStore(routing_store.pool),
        router=router,
        routing_store=routing_store,
        notifier=notifier,
        outbox=outbox,
        owner=limits.owner,
        tracer=tracer,
        redact=redact,
        check_interval_s=spawner.config.approvals.check_interval_s,
        retention_days=limits.retention_days,
    )
    register_approval_tools(mcp, switchboard.approvals)
    switchboard.pairing = PairingDesk(
        PairingStore(routing_store.pool),
        config=limits.pairing,
        owner=limits.owner,
        outbox=outbox,
        secret=switchboard.approvals.store.secret,  # one key signs every button
    )
    register_pairing_tools(mcp, switchboard.pairing)
    return switchboard
