"""`butlers gateway`: assemble the children, serve the gateway, and reload the servers' files
when they change while it serves (butlers.gateway.reload)."""

from __future__ import annotations

import asyncio
import difflib
import logging
import warnings
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from mcp.shared.exceptions import MCPDeprecationWarning
from starlette.middleware import Middleware

from butlers.errors import ButlersError
from butlers.gateway.approvals import StartTrust, pending_detail, start_trust
from butlers.gateway.children import ChildSpec, Skipped, butler_children, log_skipped
from butlers.gateway.config import GatewayConfig
from butlers.gateway.control import Mode
from butlers.gateway.redaction import install_argument_redaction, server_secrets
from butlers.gateway.reload import Reloader
from butlers.gateway.server import Gateway
from butlers.gateway.sources import ServerFiles
from butlers.gateway.stdio import serve_stdio
from butlers.http import (
    DEFAULT_MAX_REQUEST_BYTES,
    BearerTokenMiddleware,
    BodyLimitMiddleware,
    EmbeddedUvicorn,
    require_token_beyond_loopback,
)
from butlers.tasks import cancel_and_wait

if TYPE_CHECKING:
    from butlers.redact import Redactor
    from butlers.telemetry import ButlerTelemetry

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 2
RegistryFetch = Callable[[], Awaitable[list[dict[str, Any]]]]


@dataclass(frozen=True)
class GatewayOptions:
    directory: Path  # gateway.toml / switchboard.config.json, and the base of the globs
    environ: Mapping[str, str]  # the process's (Settings.environ): children get its base
    transport: str = "stdio"
    host: str = "127.0.0.1"
    port: int = 8110
    prewarm: bool = True
    auth_token: str | None = None
    mode: Mode | None = None  # None: gateway.toml's
    config_file: Path | None = None  # --config: claude_desktop_config.json or servers.json
    telemetry: ButlerTelemetry | None = None  # spans, when tracing is on
    # A first start for the project records what it approved (not --dry-run, not --report).
    record_first_start: bool = True
    # The process's (its log records'): the servers' secrets join it (gateway.redaction).
    redactor: Redactor | None = None


async def build_gateway(
    options: GatewayOptions, fetch_registry: RegistryFetch | None
) -> tuple[Gateway, list[Skipped]]:
    """The gateway over every declared server, and what was declared but left out (a file,
    or one server in it, that could not be read: logged here, listed by `--dry-run`)."""
    if not options.directory.is_dir():  # else a typo serves nothing, and says nothing
        raise ButlersError(
            f"--dir {options.directory}: "
            + ("not a directory" if options.directory.exists() else "no such directory")
            + ": name the project whose .mcp.json (and gateway.toml) the gateway reads"
        )
    files_read: list[tuple[list[ChildSpec], list[Skipped]]] = []

    def read_servers(config: GatewayConfig) -> list[ChildSpec]:
        files_read.append(server_files(options, config).read())
        return files_read[-1][0]

    # What a person approved: the settings, and which declared servers may start.
    trust = await asyncio.to_thread(
        start_trust,
        options.directory,
        options.config_file,
        options.environ,
        read_servers,
        record=options.record_first_start,
    )
    config = trust.config
    specs: list[ChildSpec] = []
    butlers_missing = None
    if fetch_registry is not None:
        try:
            specs += butler_children(await fetch_registry())
        except ButlersError as exc:
            logger.warning("no butlers behind the gateway: %s", exc, extra={"action": "registry"})
            butlers_missing = (
                f"no butlers behind the gateway: {exc}; start the fleet (`butlers up`) and "
                "restart this MCP server, or run it with --no-butlers"
            )
    # Where a name comes twice, the first wins and the gateway warns, naming both files:
    # the butlers, --config, .mcp.json, what install moved, then the seed-000 globs.
    declared, skipped = files_read[-1] if files_read else server_files(options, config).read()
    for problem in skipped:
        if problem.server is None and problem.error.path == options.config_file:
            raise problem.error  # the file --config names must be readable (a reload: keeps)
    log_skipped(skipped)
    held = {spec.name for spec in trust.held}
    specs += [spec for spec in declared if spec.name not in held]
    if butlers_missing is None:  # else a butler's [suites.<name>] would look like a typo
        _warn_of_unknown_suites(config, [s.name for s in specs] + sorted(held), options.directory)
    telemetry = options.telemetry
    gateway = Gateway(
        config,
        specs,
        environ=options.environ,
        auth_token=options.auth_token,
        mode=options.mode,
        tracer=telemetry.tracer if telemetry is not None else None,
        cli_env=telemetry.cli_env if telemetry is not None else None,
        directory=options.directory,  # roots/list: a child asking is given --dir
        redactor=options.redactor,
    )
    if options.redactor is not None:
        files = server_files(options, config)
        running = [spec for spec in declared if spec.name not in held]
        gateway.learn_secrets(await asyncio.to_thread(server_secrets, files, running))
    gateway.butlers_missing = butlers_missing
    gateway.settings_note = trust.settings_note
    gateway.started_settings = trust.current
    gateway.held_at_start = trust.held
    gateway.pending = {
        spec.name: pending_detail(
            spec,
            options.directory,
            options.config_file,
            changed=spec.name in trust.changed,
            running=False,
        )
        for spec in trust.held
    }
    _log_trust(trust, gateway, options)
    if gateway.pending or gateway.settings_note:
        # Told to the host's model with the instructions, which a host reads once: a server
        # the user added went missing without a word where they look (a walkthrough).
        waiting = ", ".join(gateway.pending) or "none"
        gateway.mcp.instructions = (
            f"{gateway.mcp.instructions or ''}\n\nNot approved yet, so not started: servers "
            f"{waiting}"
            + ("; and changes to gateway.toml" if gateway.settings_note else "")
            + ". Tell the user: gateway_status says what and the command that lets it in, "
            "which is theirs to run, never yours."
        ).strip()
    return gateway, skipped


def _log_trust(trust: StartTrust, gateway: Gateway, options: GatewayOptions) -> None:
    """What the start ran that a person did not approve, or approved for the first time."""
    if trust.first and options.record_first_start:
        logger.warning(
            "gateway: first start for %s: what is declared now is approved (recorded outside the "
            "project); a server added or changed later starts once `butlers gateway approve` "
            "says so",
            options.directory,
            extra={"action": "approved_first_start"},
        )
    if trust.settings_note is not None:
        logger.warning("gateway: %s", trust.settings_note, extra={"action": "settings_pending"})
    for name, detail in gateway.pending.items():
        logger.warning("gateway: server %r %s", name, detail, extra={"action": "server_pending"})


def _warn_of_unknown_suites(config: GatewayConfig, servers: list[str], directory: Path) -> None:
    """A `[suites.<name>]` of gateway.toml that names no server (a typo): its redaction,
    pass_env or exposure would quietly apply to nothing."""
    for name in config.suites:
        if name in servers:
            continue
        close = difflib.get_close_matches(name, servers, n=1)
        logger.warning(
            "%s: [suites.%s] names no server behind the gateway (%s): its settings apply to "
            "nothing",
            directory / "gateway.toml",
            name,
            f"did you mean {close[0]!r}?" if close else f"servers: {', '.join(servers) or 'none'}",
            extra={"action": "suite_unknown"},
        )


def server_files(options: GatewayOptions, config: GatewayConfig) -> ServerFiles:
    """The files the servers behind the gateway are declared in, for its start and reloads."""
    return ServerFiles(
        directory=options.directory,
        environ=options.environ,
        config_file=options.config_file,
        discover_globs=config.discover_globs,
        base_dir=config.base_dir,
    )


async def serve_gateway(
    options: GatewayOptions, fetch_registry: RegistryFetch | None, stop: asyncio.Event
) -> int:
    """Serve until the host goes away (stdio: end of input) or `stop` is set (a signal); the
    children end with the gateway either way."""
    if options.transport != "stdio":
        require_token_beyond_loopback("the gateway", options.host, options.auth_token)
    # A child's log messages go to its caller through FastMCP's context, on the logging
    # capability the 2026-07-28 revision deprecates (still delivered to a host that asks):
    # warned once per process otherwise, in the middle of the gateway's own log.
    warnings.filterwarnings("ignore", category=MCPDeprecationWarning, module="fastmcp")
    gateway, _ = await build_gateway(options, fetch_registry)
    install_argument_redaction(k for s in gateway.config.suites.values() for k in s.redact)
    reloading: asyncio.Task[None] | None = None
    try:
        if options.prewarm:
            gateway.start_warming()
        # Editing .mcp.json or the --config file while the host runs us changes only the
        # servers that changed (gateway.toml is read once, at start).
        files = server_files(options, gateway.config)
        reloader = Reloader(gateway, files, warm=options.prewarm)
        reloading = asyncio.create_task(reloader.watch(), name="gateway:reload")
        if options.transport == "stdio":
            serving = asyncio.create_task(serve_stdio(gateway.mcp))
            await _until(serving, stop)
            await cancel_and_wait(serving)
        else:
            app = gateway.mcp.http_app(
                transport="sse" if options.transport == "sse" else "http",
                middleware=[
                    Middleware(BodyLimitMiddleware, max_bytes=DEFAULT_MAX_REQUEST_BYTES),
                    *_bearer(options.auth_token),
                ],
                host_origin_protection=True,
            )
            server = EmbeddedUvicorn(
                uvicorn.Config(
                    app,
                    host=options.host,
                    port=options.port,
                    log_config=None,  # to the process's one log stream (butlers.logs)
                    access_log=False,
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                )
            )
            serving = asyncio.create_task(server.serve())
            await _until(serving, stop)
            server.should_exit = True
            await serving
    finally:
        await cancel_and_wait(reloading)  # before the children it would change are closed
        await gateway.close()
    return 0


async def _until(serving: asyncio.Task[Any], stop: asyncio.Event) -> None:
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(stopping)
    if serving.done():
        serving.result()  # what went wrong, if anything


def _bearer(token: str | None) -> list[Middleware]:
    """Over the network the gateway asks for the same BUTLERS_AUTH_TOKEN as the butlers."""
    return [Middleware(BearerTokenMiddleware, token=token)] if token else []
