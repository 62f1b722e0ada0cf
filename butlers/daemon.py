"""A butler daemon (one FastMCP server on its own port) and the fleet that runs several.

Lifecycle: `ButlerDaemon.start()` opens the pool, binds the port and serves; `stop()` ends
serving within a few seconds (open SSE streams included) and closes the pool. The process
entry point (cli) owns the event loop and the signals; uvicorn is told not to touch them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import asyncpg
import uvicorn
from fastmcp import FastMCP

from butlers.approvals import (
    ApprovalGate,
    check_approval_globs,
    has_approvals,
    register_approval_execute,
)
from butlers.config import ButlerConfig, Placement, SwitchboardConfig, reached_at
from butlers.context import ButlerContext
from butlers.core_store import CoreStore
from butlers.core_tools import (
    database_status,
    module_report,
    register_core_tools,
    run_due_tasks,
)
from butlers.db import PostgresServer, create_pool, prepare_database
from butlers.errors import ButlersError, SchemaTooNew
from butlers.http import (
    ButlerApp,
    Listener,
    build_app,
    require_token_beyond_loopback,
)
from butlers.lifecycle import Background, Components
from butlers.logs import butler_context
from butlers.mcp_connection.proof import health_proof
from butlers.mcp_middleware import ButlerMiddleware, ClassificationFence, butler_server
from butlers.media import MAX_TOOL_ATTACHMENT_BYTES
from butlers.memory import MemoryStore
from butlers.modules import build_modules
from butlers.redact import Redactor
from butlers.session_policy import OwnerNotices, SessionPolicy
from butlers.settings import Settings
from butlers.spawner import Spawner
from butlers.switchboard.classifier import CLASSIFIER_TOOLS
from butlers.switchboard.component import Switchboard
from butlers.switchboard.inbox import InboxStore
from butlers.switchboard.routing_store import RoutingStore
from butlers.switchboard.tools import register_switchboard_tools
from butlers.switchboard.transcription import transcriber_from
from butlers.switchboard_link import SwitchboardLink, switchboard_url
from butlers.telemetry import Telemetry

if TYPE_CHECKING:  # loaded by a butler that has tool servers (the gateway's client code)
    from butlers.mcp_connection.pool import McpConnections
    from butlers.tool_servers import ToolServers

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 2
STOP_TIMEOUT_S = 8.0
PRUNE_EVERY_S = 3600.0  # retention runs with the ticker, at most this often
# An approved call whose tool server is still starting waits for it this long (an npx server's
# first start downloads it).
APPROVED_CALL_SERVER_WAIT_S = 60.0


# The alembic branch of the switchboard's own tables (registry, inbox, outbox...).
SWITCHBOARD_BRANCH = "switchboard"


def migration_branches(config: ButlerConfig) -> tuple[str, ...]:
    """Alembic branches a butler's database gets, in order: core for all, then the
    switchboard's for the butler whose butler.toml has a [switchboard] table."""
    return ("core", SWITCHBOARD_BRANCH) if config.is_switchboard else ("core",)


# What a request carrying the most files a `trigger` may carry adds around them: the prompt
# and the JSON.
ATTACHMENT_BODY_MARGIN = 1024 * 1024


def request_body_limit(config: ButlerConfig) -> int:
    """The largest request body this butler takes from anyone (bigger ones get 413):
    `[switchboard] max_request_bytes` (1 MiB by default). A request with the bearer token may
    carry files (FILES_REQUEST_BYTES: a routed `trigger` with a message's photos and PDFs, a
    butler's `notify` to the switchboard's `deliver`); one without it never holds more than
    this in memory before it is refused."""
    return (config.switchboard or SwitchboardConfig()).max_request_bytes


# A request carrying the most files a `trigger` or a `notify` may carry: base64 (4 bytes for
# 3) of MAX_TOOL_ATTACHMENT_BYTES, and a margin for the text and the JSON around them. The
# switchboard takes it only from a caller with the bearer token (a butler's `deliver`).
FILES_REQUEST_BYTES = MAX_TOOL_ATTACHMENT_BYTES * 4 // 3 + ATTACHMENT_BODY_MARGIN


class ButlerDaemon:
    """One butler: its pool, its FastMCP server, its HTTP listener and its background ticker."""

    def __init__(
        self,
        config: ButlerConfig,
        db_server: PostgresServer,
        *,
        data_dir: Path,
        settings: Settings,
        auth_token: str | None = None,
        session_env: Mapping[str, str] | None = None,
        config_dir: Path | None = None,
        telemetry: Telemetry | None = None,
        port_offset: int = 0,
    ) -> None:
        self.config = config
        # The process's environment settings (butlers.settings): credentials by name, the
        # switchboard's URL, the environment Claude Code's is chosen from.
        self.settings = settings
        # Where the butlers of the config directory listen and are registered, for what their
        # butler.toml leaves out (BUTLERS_HOST, BUTLERS_ENDPOINT_URL_TEMPLATE): what discover
        # registers and where notify finds the switchboard.
        self.placement = replace(
            Placement.from_environment(settings.environ), port_offset=port_offset
        )
        # Spans are always real (trace ids are recorded); exported only if the Telemetry does.
        self.telemetry = (telemetry or Telemetry()).for_butler(config.name)
        # The fleet's config directory: what the switchboard's discover() scans.
        self.config_dir = config_dir or (config.config_dir.parent if config.config_dir else None)
        self.switchboard: Switchboard | None = None
        self.tool_servers: ToolServers | None = None  # its [[mcp_servers]], proxied
        # Set by start_fleet: the servers start once every butler is up (starting `npx` and
        # the like beside the other butlers' start made `butlers up` slower to be ready).
        self.tool_servers_later = False
        # What the running parts add to /health (by key) and to retention (rows deleted per
        # table): the switchboard, the tool servers. Filled as they are built.
        self._health_reports: dict[str, Callable[[], Any]] = {}
        self._retention: list[Callable[[int], Awaitable[dict[str, int]]]] = []
        self.db_server = db_server
        # Absolute: a session's Claude Code runs in its work directory and is handed paths in
        # it (its MCP config); a relative BUTLERS_DATA_DIR (the default, `.butlers`) was
        # resolved twice, and every session of `make up` failed ("MCP config file not found").
        self.data_dir = data_dir.absolute()
        self.auth_token = auth_token
        # Configured secrets never go into sessions or routing_log rows (nor logs and spans,
        # which the process entry point redacts).
        self.redactor = Redactor.from_environment([config], environ=settings.environ)
        self.redactor.add([auth_token] if auth_token else [])
        self.session_env = dict(session_env or {})
        self.port: int | None = None
        self.context: ButlerContext | None = None
        self._pool: asyncpg.Pool | None = None
        self._app: ButlerApp | None = None
        self.mcp: FastMCP | None = None  # its server, while it runs
        # The switchboards' connection pools that reach `mcp` in this process (see
        # route_within_the_process): told first when it stops.
        self.served_locally_by: list[McpConnections] = []
        # What start opened, in order; stop closes it in reverse (butlers.lifecycle).
        self._components = Components(f"butler {config.name!r}")
        self._state = "new"

    @property
    def base_url(self) -> str:
        return f"http://{reached_at(self.config.host)}:{self.port}"

    @property
    def sse_url(self) -> str:
        return f"{self.base_url}/sse"

    async def start(self) -> None:
        if self._state != "new":
            raise RuntimeError(
                f"butler {self.config.name!r} daemon is {self._state}; start it once"
            )
        self._state = "starting"
        try:
            # Every record of this butler's start-up, and of every task it creates (its
            # server, ticker, worker, channels), names it (butlers.logs).
            with butler_context(self.config.name):
                await self._start()
        except BaseException:
            await self._close_resources()
            self._state = "stopped"
            raise
        self._state = "running"

    async def _start(self) -> None:
        """Build the parts and open them in order (butlers.lifecycle): each one added to
        `self._components` is closed, in reverse, by `stop` or by a start that failed."""
        config = self.config
        parts = self._components
        require_token_beyond_loopback(f"butler {config.name!r}", config.host, self.auth_token)
        limits = config.switchboard
        # The switchboard's messages in flight each hold a connection now and then.
        pool_size = max(5, limits.max_concurrent_messages + 4) if limits else 5
        self._pool = parts.adopt(
            "pool", await create_pool(self.db_server, config.database, max_size=pool_size)
        )
        store = CoreStore(self._pool)
        sock = self._bind()
        parts.on_close("socket", sock.close)  # the listener's own, once it serves
        self.port = sock.getsockname()[1]
        link = parts.adopt(
            "switchboard link",
            SwitchboardLink(
                config.name,
                await asyncio.to_thread(
                    switchboard_url,
                    config,
                    self.config_dir,
                    self.sse_url,
                    self.settings.switchboard_url,
                    self.placement,
                ),
                auth_token=self.auth_token,
            ),
        )
        spawner = Spawner(
            config,
            store,
            work_dir=self.data_dir / "sessions" / config.name,
            telemetry=self.telemetry,
            settings=self.settings,
            session_env=self.session_env,
            auth_token=self.auth_token,
            redact=self.redactor,
            notices=OwnerNotices(config.name, store, link),
        )
        await spawner.remove_leftovers()
        memory = MemoryStore(
            self._pool,
            language=config.runtime.memory_language,
            max_memories=config.runtime.max_memories,
            owner_persons=config.owner_persons,
        )
        await memory.open()
        spawner.memory = memory
        ctx = ButlerContext(
            config=config,
            store=store,
            spawner=spawner,
            self_url=self.sse_url,
            switchboard=link,
            memory=memory,
        )
        self.context = ctx
        middleware = ButlerMiddleware(config.name, self.telemetry.tracer)
        middleware.add_guard(SessionPolicy(spawner))
        mcp = butler_server(config.name, middleware, instructions=config.description or None)
        self.mcp = mcp
        register_core_tools(mcp, ctx)
        if has_approvals(config):
            # A session's call of a guarded tool waits for the owner (butlers.approvals).
            middleware.add_guard(ApprovalGate(config, spawner, link, store, mcp))
            register_approval_execute(
                mcp, link, spawner, self.redactor, ready=self._tool_server_ready
            )
        if config.is_switchboard:
            self.switchboard = await self._build_switchboard(mcp, ctx)
            # Which replica this is, and whether it leads; its inbox and routing_log age out.
            self._health_reports["switchboard"] = self.switchboard.health
            self._retention.append(self.switchboard.prune)
            # Whatever Claude Code's allowlist says, a classification session sees and calls
            # only route and list_butlers here (its `route` is then held to the classifier's
            # policy).
            middleware.add_guard(ClassificationFence(CLASSIFIER_TOOLS))
        switchboard = self.switchboard
        modules = build_modules(
            config, mcp, switchboard.worker if switchboard else None, self.settings, store
        )
        ctx.module_statuses = modules.statuses
        ctx.tool_names = [tool.name for tool in await mcp.list_tools(run_middleware=False)]
        check_approval_globs(config, ctx.tool_names)
        if config.mcp_servers:
            self.tool_servers = parts.adopt(
                "tool servers", self._tool_servers(mcp, ctx, middleware)
            )
            # A server that is down does not make the butler unready: shown, not counted.
            self._health_reports["tool_servers"] = self.tool_servers.statuses
        dashboard = None
        if switchboard is not None:
            switchboard.use_channels(modules)
            dashboard = switchboard.build_dashboard(
                sessions=store,
                auth_token=self.auth_token,
                allowed_hosts=self._allowed_hosts(),
                # No link to a trace that was never exported (it led to "trace not found").
                jaeger_ui_url=self.settings.jaeger_ui_url if self.telemetry.exporting else None,
                redact=self.redactor,
            )
        app, self._app = build_app(
            mcp,
            self._health,
            auth_token=self.auth_token,
            allowed_hosts=self._allowed_hosts(),
            webhooks=modules.webhooks,
            dashboard=dashboard.app if dashboard is not None else None,
            max_request_bytes=request_body_limit(config),
            # Files come with the token: a routed trigger, a notify to `deliver`.
            token_request_bytes=FILES_REQUEST_BYTES,
            health_proof=self._health_proof if self.auth_token else None,
        )
        forwarded_allow_ips = self.settings.variable("FORWARDED_ALLOW_IPS")
        uv_config = uvicorn.Config(
            app,
            # uvicorn's records propagate to the process's one stream, at its level
            # (butlers.logs), instead of its own handlers fixed at one level. Its access log
            # stays off: a line per MCP message (every tool call over SSE is a POST) says
            # less than the tool's own log and span, and costs the route hot path.
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            # X-Forwarded-* are believed only from the proxies FORWARDED_ALLOW_IPS names.
            # uvicorn's own default believes any loopback client: a DNS-rebinding page in
            # the owner's browser sent a new X-Forwarded-For with each guess of the token,
            # and the dashboard's throttle never held it (a red team).
            proxy_headers=forwarded_allow_ips is not None,
            forwarded_allow_ips=forwarded_allow_ips,
        )
        listener = Listener(
            uv_config,
            sock,
            name=config.name,
            drain=self._app.drain,
            stop_timeout_s=STOP_TIMEOUT_S,
        )
        await parts.open("http", listener)
        # The switchboard opens the channels between its worker and its leadership; another
        # butler's channels only send.
        if switchboard is not None:
            await parts.open("switchboard", switchboard)
        else:
            await parts.open("modules", modules)
        if self.tool_servers is not None and not self.tool_servers_later:
            await self.tool_servers.open()
        await self._declare_schedules()
        if config.runtime.tick_interval_s > 0:
            await parts.open("ticker", Background(f"butler:{config.name}:tick", self._tick_loop))
        logger.info(
            "butler %s serving on %s",
            config.name,
            self.base_url,
            extra={"action": "butler_started"},
        )

    async def start_tool_servers(self) -> None:
        """Its tool servers, in the background: the butler does not wait for them."""
        if self.tool_servers is not None:
            with butler_context(self.config.name):
                await self.tool_servers.open()

    def _tool_servers(
        self, mcp: FastMCP, ctx: ButlerContext, middleware: ButlerMiddleware
    ) -> ToolServers:
        """The `[[mcp_servers]]`, proxied on `mcp`; a session is allowed the butler's own
        tools and the servers' offered ones, as they are when it starts. A call of a tool of
        a server that is down says so (`middleware`'s hint)."""
        from butlers.session_policy import session_token
        from butlers.tool_servers import ToolServers

        own = list(ctx.tool_names)

        def tools_changed() -> None:
            ctx.tool_names = [*own, *(n for s in servers.servers for n in s.registered)]

        servers = ToolServers(
            self.config.mcp_servers,
            mcp=mcp,
            environ=self.settings.environ,
            data_dir=self.data_dir / "data" / self.config.name,
            butler_dir=self.config.config_dir,
            redact=self.redactor,
            on_tools_changed=tools_changed,
            answers_someone_else=lambda: ctx.spawner.answers_someone_else(session_token()),
        )
        ctx.tool_servers = servers.statuses
        middleware.unknown_tool_hint = servers.why_missing
        return servers

    async def _build_switchboard(self, mcp: FastMCP, ctx: ButlerContext) -> Switchboard:
        """The switchboard's parts, its tools on `mcp`, and the registry brought in step with
        the config directory."""
        if self.config_dir is None:
            raise ButlersError("the switchboard needs the config directory to discover butlers")
        assert self._pool is not None
        limits = self.config.switchboard
        assert limits is not None
        switchboard = Switchboard(
            RoutingStore(self._pool),
            InboxStore(self._pool),
            ctx.spawner,
            config_dir=self.config_dir,
            placement=self.placement,
            self_url=self.sse_url,
            tool_names=lambda: ctx.tool_names,
            triage_rules=self.config.triage,
            limits=limits,
            auth_token=self.auth_token,
            # Its name among switchboard processes on one database: the same after a restart.
            replica=f"{socket.gethostname()}:{self.port}",
            connect=self._connect,
            redact=self.redactor,
            # Voice notes to text ([switchboard.transcription]); None: they get a reply that
            # says a transcription service is needed.
            transcriber=transcriber_from(limits.transcription, self.settings.variable),
        )
        register_switchboard_tools(
            mcp,
            switchboard,
            jaeger_ui_url=self.settings.jaeger_ui_url if self.telemetry.exporting else None,
        )
        report = await switchboard.discover()
        for error in report["errors"]:
            # INFO: `butlers up` / `run` loaded the same directory and printed each of these
            # already; a later `discover` call returns them to whoever asked.
            logger.info("discover: %s: %s: %s", error["path"], error["key"], error["problem"])
        return switchboard

    async def _connect(self) -> asyncpg.Connection:
        """A connection outside the pool, for what holds one for good (the leader's lock,
        LISTEN)."""
        return await asyncpg.connect(self.db_server.dsn(self.config.database), timeout=10)

    def _allowed_hosts(self) -> list[str]:
        from urllib.parse import urlsplit

        hosts = {self.config.host, "127.0.0.1", "localhost"}
        if self.config.endpoint_url_override:
            hosts.add(urlsplit(self.config.endpoint_url_override).hostname or "")
        hosts.discard("")
        return sorted(h for h in hosts if h not in ("0.0.0.0", "::"))

    def _bind(self) -> socket.socket:
        host, port = self.config.host, self.config.port
        try:
            sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        except OSError as exc:
            raise ButlersError(
                f"butler {self.config.name!r} cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        # Accepted sockets inherit this. Without it every MCP reply over SSE waits ~40 ms for a
        # delayed ACK (Nagle): measured 44 ms per call instead of 4 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    async def _declare_schedules(self) -> None:
        """`[[schedules]]` of butler.toml become the table's declared schedules (created,
        updated, removed); what tools created stays. A declared cron is held to the same
        `min_schedule_interval_s` as one a tool makes: refused (logged), not fatal. First,
        every recurring schedule is put on this start's wall clock (its zone may have changed
        while the butler was down)."""
        from butlers import schedule_time
        from butlers.core_tools import check_schedule_interval
        from butlers.tool_errors import ToolRefusal

        assert self.context is not None
        config = self.config
        declared = []
        for schedule in config.schedules:
            try:
                await check_schedule_interval(
                    schedule.cron, config.runtime.min_schedule_interval_s, config.zone
                )
            except ToolRefusal as exc:
                logger.error(
                    "[[schedules]] %r not created: %s",
                    schedule.name,
                    exc,
                    extra={"action": "schedule_refused"},
                )
                continue
            declared.append((schedule.name, schedule.cron, schedule.prompt))
        now = datetime.now(UTC)
        was, moved = await self.context.store.schedules_rezone(
            config.zone, now, lambda cron, after: schedule_time.next_run(cron, after, config.zone)
        )
        if moved:
            logger.info(
                "schedules moved from %s's clock to %s's: %s",
                was,
                config.zone,
                ", ".join(moved),
                extra={"action": "schedules_rezoned"},
            )
        report = await self.context.store.schedules_declare(
            declared, lambda cron: schedule_time.next_run(cron, now, config.zone)
        )
        for change, names in report.items():
            if names:
                logger.info(
                    "declared schedules %s: %s",
                    change,
                    ", ".join(names),
                    extra={"action": "schedules_declared"},
                )

    async def _tick_loop(self) -> None:
        """Due schedules, first at start (runs missed while down: `catch_up_hours`), then
        every `tick_interval_s`."""
        assert self.context is not None
        interval = self.config.runtime.tick_interval_s
        pruned_at: float | None = None
        first = True
        while True:
            if not first:
                await asyncio.sleep(interval)
            first = False
            try:
                if pruned_at is None or time.monotonic() - pruned_at >= PRUNE_EVERY_S:
                    pruned_at = time.monotonic()
                    await self._prune()
                await run_due_tasks(self.context)
            except Exception:
                # Keep ticking on purpose: one bad tick must not stop the schedule for good.
                logger.exception("scheduled tick failed", extra={"action": "tick_failed"})

    async def _prune(self) -> None:
        """Retention (`[switchboard] retention_days` of the config directory): sessions, and
        on the switchboard its finished inbox rows and routing_log, older than that are
        deleted."""
        assert self.context is not None
        days = self.config.retention_days
        deleted = {"sessions": await self.context.store.prune_sessions(days)}
        deleted["session cache files"] = await self.context.spawner.prune_cache()
        for prune in self._retention:
            deleted.update(await prune(days))
        if any(deleted.values()):
            logger.info(
                "retention (%d days): deleted %s",
                days,
                ", ".join(f"{n} {table}" for table, n in deleted.items() if n),
                extra={"action": "retention"},
            )

    async def _tool_server_ready(self, tool_name: str) -> None:
        """Until the tool server of `tool_name` (when it is one's) runs, for an approved call
        (butlers.tool_servers.ToolServers.ready_for)."""
        if self.tool_servers is not None:
            await self.tool_servers.ready_for(tool_name, APPROVED_CALL_SERVER_WAIT_S)

    def _health_proof(self, nonce: str, port: int | None) -> str | None:
        """The proof for `port` (None: the one it listens on), when that port is its own: the
        one it listens on, or its registered address's (a reverse proxy, a Service, in front
        of it: docs/scaling.md). Another's port gets none: a process there relaying the
        question must not get an answer for itself."""
        assert self.auth_token is not None and self.port is not None  # served: both known
        registered = urlsplit(self.config.endpoint_url)
        own = {self.port, registered.port or (443 if registered.scheme == "https" else 80)}
        if port is not None and port not in own:
            return None
        return health_proof(self.auth_token, self.config.name, port or self.port, nonce)

    async def _health(self) -> tuple[int, dict]:
        assert self.context is not None
        database = await database_status(self.context)
        body = {
            "name": self.config.name,
            "status": "ok" if database["ok"] else "degraded",
            "database": database,
            "modules": module_report(self.context.module_statuses()),
        }
        for key, report in self._health_reports.items():
            body[key] = report()
        return (200 if database["ok"] else 503), body

    def stopping(self) -> None:
        """The butler is about to stop: a session cut short from now on says so."""
        if self.context is not None:
            self.context.spawner.stopping = True

    async def stop(self) -> None:
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            return
        self.stopping()
        self._state = "stopping"
        with butler_context(self.config.name):
            await self._close_resources()
        self._state = "stopped"
        logger.info("butler %s stopped", self.config.name, extra={"action": "butler_stopped"})

    async def _close_resources(self) -> None:
        if self.mcp is not None:
            for connections in self.served_locally_by:
                await connections.stop_serving_locally(self.mcp)
        self.served_locally_by.clear()
        await self._components.close()
        self.mcp = None
        self._health_reports.clear()
        self._retention.clear()
        self.switchboard = None
        self.tool_servers = None
        self._pool = None


@dataclass
class FleetReport:
    running: list[ButlerDaemon]
    failed: dict[str, str]
    # Butlers whose database a newer butlers migrated: this build is the wrong one for the
    # data (a rollback), and the fleet is not started half (`butlers up` refuses it whole).
    too_new: tuple[str, ...] = ()


async def start_fleet(
    configs: Sequence[ButlerConfig],
    db_server: PostgresServer,
    *,
    data_dir: Path,
    settings: Settings,
    auth_token: str | None = None,
    session_env: Mapping[str, str] | None = None,
    config_dir: Path | None = None,
    telemetry: Telemetry | None = None,
    progress: Callable[[str], None] | None = None,
    port_offset: int = 0,
) -> FleetReport:
    """Prepare every butler's database, then start the butlers; one failing butler never
    stops the others. `progress` is told each step (`butlers up` prints them)."""
    running: list[ButlerDaemon] = []
    failed: dict[str, str] = {}
    say = progress or (lambda _text: None)
    say(f"Migrating {len(configs)} database{'s' if len(configs) != 1 else ''}...")

    too_new: list[str] = []

    async def prepare(config: ButlerConfig) -> str | None:
        try:
            await prepare_database(db_server, config.database, migration_branches(config))
        except ButlersError as exc:
            if isinstance(exc, SchemaTooNew):
                too_new.append(config.name)
            return str(exc)
        return None

    # All at once: on a warm start each only connects twice and finds its database at its
    # heads, round trips that overlap (alembic itself runs one database at a time).
    async with asyncio.TaskGroup() as group:
        preparing = [group.create_task(prepare(config)) for config in configs]
    prepared = []
    for config, task in zip(configs, preparing, strict=True):
        if (error := task.result()) is not None:
            logger.error(
                "butler %s not started: %s", config.name, error, extra={"action": "butler_failed"}
            )
            failed[config.name] = error
        else:
            prepared.append(config)
    if too_new:  # an older build than the data: none of it starts (FleetReport.too_new)
        return FleetReport([], failed, tuple(too_new))
    say(f"Starting {len(prepared)} butler{'s' if len(prepared) != 1 else ''}...")
    for config in prepared:
        try:
            daemon = ButlerDaemon(
                config,
                db_server,
                data_dir=data_dir,
                settings=settings,
                auth_token=auth_token,
                session_env=session_env,
                telemetry=telemetry,
                port_offset=port_offset,
            )
            daemon.tool_servers_later = True
            await daemon.start()
        except ButlersError as exc:
            logger.error(
                "butler %s not started: %s", config.name, exc, extra={"action": "butler_failed"}
            )
            failed[config.name] = str(exc)
            continue
        running.append(daemon)
    for daemon in running:
        await daemon.start_tool_servers()
    route_within_the_process(running)
    return FleetReport(running, failed, tuple(too_new))


def route_within_the_process(daemons: Sequence[ButlerDaemon]) -> None:
    """A switchboard reaches the butlers of its own process without HTTP, at the URLs they
    listen on (butlers.mcp_connection.local: route's second hop cost as much as a direct
    call). A registry row that points elsewhere (a proxy, another host) still goes there."""
    for front in daemons:
        if front.switchboard is None:
            continue
        for daemon in daemons:
            if daemon is not front and daemon.mcp is not None:
                front.switchboard.connections.serve_locally(
                    [daemon.sse_url, f"{daemon.base_url}/mcp"], daemon.mcp
                )
                daemon.served_locally_by.append(front.switchboard.connections)


def hurry_fleet(daemons: Sequence[ButlerDaemon]) -> None:
    """Asked to stop again while stopping: the switchboards hand the messages under way back
    at once instead of letting them finish (`[switchboard] stop_drain_s`), and let no reply
    under way finish either (the outbox's STEP_DOWN_DRAIN_S)."""
    for daemon in daemons:
        if daemon.switchboard is not None:
            daemon.switchboard.worker.hurry()
            daemon.switchboard.outbox.hurry()


async def stop_fleet(daemons: Sequence[ButlerDaemon]) -> None:
    """The switchboard first (it holds MCP connections to the others), then the rest at once.
    Every butler knows at once that the fleet stops: a session cut short by the switchboard's
    stop is recorded as the fleet's stop, not as a caller that went away."""
    for daemon in daemons:
        daemon.stopping()
    front = [d for d in daemons if d.config.is_switchboard]
    rest = [d for d in daemons if not d.config.is_switchboard]
    await asyncio.gather(*(d.stop() for d in front), return_exceptions=True)
    await asyncio.gather(*(d.stop() for d in rest), return_exceptions=True)
