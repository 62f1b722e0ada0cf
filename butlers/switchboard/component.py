"""The switchboard as one component of its butler's daemon (butlers.lifecycle).

`Switchboard(...)` builds every part (router, worker, outbox, notifier, approvals, pairing,
wakeups, leadership, dashboard) and registers nothing; butlers.switchboard.tools registers the
MCP tools on them. `use_channels` hands it the butler's channel modules, which it opens
between its worker and its leadership. `open()` runs them in that order, once; `close()`
stops them in reverse.

Why this order: the process takes its name's lock (butlers.switchboard.process_name), then
the worker resumes what a crash of a process of that name left, before anything new comes
in; the channels then take messages (their intake writes to the inbox and wakes the worker);
only then may this process lead, since leading starts the channels' pollers and the outbox,
which sends through them. Closing: the worker stops first, its messages under way finishing
(or handed back) while this process still leads, so that their replies go out; then the
leader's lock is let go, so another process takes over the pollers at once; the name last.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers.config import Placement, SwitchboardConfig, TriageRule, load_config_dir
from butlers.dashboard.app import Dashboard, DashboardParts
from butlers.dashboard.fleet import FleetProbe
from butlers.dashboard.store import DashboardStore
from butlers.lifecycle import Once
from butlers.mcp_connection.pool import McpConnections
from butlers.switchboard.approvals import ApprovalDesk, ApprovalStore
from butlers.switchboard.deliver import NotificationDesk
from butlers.switchboard.inbox import InboxStore, IncomingMessage
from butlers.switchboard.leadership import Connect, LeaderDuty, Leadership
from butlers.switchboard.outbox import OutboxSender, OutboxStore
from butlers.switchboard.pairing import PairingDesk, PairingStore
from butlers.switchboard.process_name import ProcessName
from butlers.switchboard.registry import answers_there, discover
from butlers.switchboard.route import OwnEndpoints, Router
from butlers.switchboard.routing_store import RoutingStore
from butlers.switchboard.transcription import Transcriber
from butlers.switchboard.wakeups import WakeupHandlers, Wakeups
from butlers.switchboard.worker import InboxWorker
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from butlers.core_store import CoreStore
    from butlers.modules import Modules
    from butlers.spawner import Spawner

MAX_ASK_CHARS = 200_000
ANSWERS_OUT_S = 0.2  # at a stop, for the answers of `ask` calls still waiting to go out
# At a stop, for the replies of the messages that finished while it drained (a Bot API call or
# an SMTP send each, well under a second when the channel is up).
REPLIES_OUT_S = 5.0


class Switchboard:
    """What the switchboard has beyond a plain butler: built whole, opened and closed with
    its daemon (see the module docstring for the order)."""

    def __init__(
        self,
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
        connect: Connect,
        redact: Callable[[str], str] = str,
        transcriber: Transcriber | None = None,
    ) -> None:
        self._once = Once(f"switchboard {spawner.config.name!r}")
        self.name = spawner.config.name
        self.zone = spawner.config.zone  # the owner's, unless the switchboard names its own
        self.config_dir = config_dir
        self.placement = placement  # what discover fills in for what a butler.toml leaves out
        self.routing_store = routing_store
        self.connections = McpConnections(auth_token=auth_token)  # to the other butlers
        self._auth_token = auth_token  # proves a registered endpoint to discover
        tracer = spawner.telemetry.tracer
        # The switchboard is whichever butler has a [switchboard] table: routing to it is
        # refused by its configured name and by its addresses (a stale row of an old name
        # points here).
        self.router = Router(
            routing_store,
            self.connections,
            tracer=tracer,
            redact=redact,
            switchboard_name=self.name,
            own=OwnEndpoints.of_switchboard(spawner.config, self_url),
        )
        # A butler not reached where the registry says: the config's endpoints again.
        self.router.rediscover = self._rediscover_if_moved
        self.outbox = OutboxSender(
            OutboxStore(routing_store.pool),
            tracer=tracer,
            retry_hours=limits.reply_retry_hours,
            replica=replica,
        )
        # Its name among the processes on this database (`replica`: host and port) and its
        # own claims' (the name and a random suffix).
        self.process = ProcessName(connect, replica)
        self.worker = InboxWorker(
            inbox=inbox,
            routing_store=routing_store,
            router=self.router,
            spawner=spawner,
            triage_rules=triage_rules,
            limits=limits,
            switchboard_url=self_url,
            switchboard_tools=tool_names,
            tracer=tracer,
            outbox=self.outbox,
            replica=self.process.claimant,
            transcriber=transcriber,
        )
        self.notifier = NotificationDesk(
            limits=limits, inbox=inbox, routing_store=routing_store, outbox=self.outbox
        )
        self.approvals = ApprovalDesk(  # calls waiting for the owner's yes
            ApprovalStore(routing_store.pool),
            router=self.router,
            routing_store=routing_store,
            notifier=self.notifier,
            outbox=self.outbox,
            owner=limits.owner,
            tracer=tracer,
            redact=redact,
            check_interval_s=spawner.config.approvals.check_interval_s,
            retention_days=limits.retention_days,
        )
        self.pairing = PairingDesk(  # strangers' codes and paired senders
            PairingStore(routing_store.pool),
            config=limits.pairing,
            owner=limits.owner,
            outbox=self.outbox,
            secret=self.approvals.store.secret,  # one key signs every button
        )
        # The other switchboard processes' notifications; the leader's lock (pollers, outbox).
        self.wakeups = Wakeups(
            connect,
            WakeupHandlers(
                queued=self.worker.wake,
                finished=self.worker.finished_elsewhere,
                outbox=lambda _channel: self.outbox.wake(),
            ),
        )
        self.leadership = Leadership(connect, self._leader_duties(()), replica=replica)
        self.modules: Modules | None = None
        self.dashboard: Dashboard | None = None

    def _leader_duties(self, channel_duties: Sequence[LeaderDuty]) -> list[LeaderDuty]:
        # The approvals' sweep: expiry, calls whose butler was down.
        return [*channel_duties, self.outbox, self.approvals]

    def use_channels(self, modules: Modules) -> None:
        """The butler's channel modules: replies go out through them, the owner's answers to
        approvals and strangers' pairing codes come in through them, and their pollers run
        on the leader only."""
        self.modules = modules
        for module in modules.channels:
            self.outbox.channels[module.name] = module
            module.approvals = self.approvals
            module.pairing = self.pairing
        duties = [m for m in modules.channels if isinstance(m, LeaderDuty)]
        self.leadership.duties = tuple(self._leader_duties(duties))

    def build_dashboard(
        self,
        *,
        sessions: CoreStore,
        auth_token: str | None,
        allowed_hosts: Sequence[str],
        jaeger_ui_url: str | None,
        redact: Callable[[str], str],
    ) -> Dashboard:
        """The operator's /ui on this switchboard's data (served by the daemon's app)."""

        async def ask(text: str) -> dict[str, Any]:
            return await self.ask(text, source_id="dashboard")

        parts = DashboardParts(
            store=DashboardStore.redacting(self.routing_store.pool, redact),
            probe=FleetProbe(self.connections),
            sessions=sessions,
            switchboard_name=self.name,
            ask=ask,
            jaeger_ui_url=jaeger_ui_url,
            approvals=self.approvals,
            pairing=self.pairing,
            zone=self.zone,
        )
        self.dashboard = Dashboard(
            parts, auth_token=auth_token, allowed_hosts=list(allowed_hosts), redact=redact
        )
        return self.dashboard

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        """Once the butler serves (a classification session connects back to it)."""
        self._once.opening()
        await self.process.open()  # its claims' lock, held while it runs
        await self.worker.open(resume=await self.process.resumable(self.worker.inbox))
        if self.modules is not None:
            await self.modules.open()
        await self.wakeups.open()
        await self.leadership.open()

    async def close(self) -> None:
        if not self._once.closing():
            return
        if self.dashboard is not None:
            await self.dashboard.parts.probe.close()
        # The messages under way finish first (stop_drain_s) while this process still leads,
        # and their replies go out before it stops: they waited for the next `butlers up`
        # (a walkthrough). A stop with nothing under way lets the lock go at once, as before.
        under_way = self.worker.in_flight
        waiting = await self.worker.close()
        if under_way and self.leadership.is_leader and not self.worker.hurried:
            await self.outbox.settle(REPLIES_OUT_S)  # (a second Ctrl-C: no more waiting)
        await self.leadership.close()  # the pollers and the outbox stop; the lock is let go
        await self.wakeups.close()
        if self.modules is not None:
            await self.modules.close()
        await self.approvals.close()
        await self.connections.close()
        await self.process.close()  # the name goes last: its messages were handed back
        if waiting:
            # Those `ask` calls' answers (the reply, or: the message stays queued) go out over
            # their SSE streams, which the HTTP listener ends right after this: without the
            # pause the callers heard only that the connection closed.
            await asyncio.sleep(ANSWERS_OUT_S)

    # -- what the daemon and the tools ask of it ----------------------------------------

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
        report = await discover(
            self.routing_store, self.config_dir, self.placement, self._auth_token
        )
        self.router.forget_endpoints()
        return report

    async def _rediscover_if_moved(self, butler: str, endpoint: str) -> None:
        """Discover again when `butler`, not reached at `endpoint`, is configured to listen
        elsewhere and answers there (another fleet on this database registered its own,
        then stopped). A butler that is down where its config says is left so (a discover
        would stamp it seen), and so is one a replica's config places where it does not
        answer (a replica started without the fleet's --port-offset would move its route
        there while it restarted: a review)."""
        fleet = await asyncio.to_thread(load_config_dir, self.config_dir, self.placement)
        for config in fleet.butlers:
            if config.name == butler and config.endpoint_url != endpoint:
                if await answers_there(self.routing_store, config, self._auth_token):
                    await self.discover()
                return

    def health(self) -> dict[str, Any]:
        """Which replica this is, and whether it leads (the butler's /health)."""
        return {
            "replica": self.worker.replica,
            "leader": self.leadership.is_leader,
            "messages_in_flight": self.worker.in_flight,
        }

    async def prune(self, older_than_days: int) -> dict[str, int]:
        """Retention: its finished inbox rows, routing_log and sent outbox rows."""
        return await self.worker.prune(older_than_days)
