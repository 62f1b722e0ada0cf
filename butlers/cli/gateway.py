"""`butlers gateway`: the gateway's options to GatewayOptions, then serve, `--dry-run`,
`--report`, or `install` / `uninstall` / `approve` (butlers.gateway).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, Any

from butlers import logs
from butlers.cli.client import SwitchboardTarget, call_switchboard
from butlers.cli.process import collector_paused, install_stop_signals, keep_memory_private

if TYPE_CHECKING:
    from butlers.redact import Redactor
    from butlers.settings import Settings


async def gateway_command(
    args: argparse.Namespace, settings: Settings, redactor: Redactor | None = None
) -> int:
    if args.action in ("install", "uninstall"):
        from butlers.gateway import install

        act = install.install if args.action == "install" else install.uninstall
        for line in act(
            args.dir,
            host=args.target_host,
            scope=args.scope,
            config=args.config,
            environ=settings.environ,
        ):
            print(line)
        return 0
    if args.action == "approve":
        from butlers.gateway.approvals import approve

        for line in await asyncio.to_thread(
            approve,
            args.dir,
            args.config,
            args.names,
            settings.environ,
            record=not args.show,
            settings_only=args.settings,
        ):
            print(line)
        return 0
    with collector_paused():
        from butlers.gateway.report import dry_run, token_report
        from butlers.gateway.run import GatewayOptions, serve_gateway
        from butlers.settings import reveal

        logs.adopt_fastmcp_logging()
    telemetry = None
    if settings.otel_exporter_otlp_endpoint:  # (the tracing SDK loads only then)
        from butlers.telemetry import Telemetry

        telemetry = Telemetry.from_settings(
            settings, redact=redactor.clipped if redactor is not None else None
        )
    options = GatewayOptions(
        directory=args.dir,
        environ=settings.environ,
        transport=args.transport,
        host=args.host,
        port=args.port,
        prewarm=not args.lazy,
        auth_token=reveal(settings.auth_token),
        mode=args.mode,
        config_file=args.config,
        telemetry=telemetry.for_butler("gateway") if telemetry is not None else None,
        redactor=redactor,
    )
    target = SwitchboardTarget(args.url, options.auth_token)

    async def registry() -> list[dict[str, Any]]:
        return await call_switchboard(target, "list_butlers", {})  # CommandError if down

    fetch = None if args.no_butlers else registry
    if args.report:
        print(await token_report(options, fetch, as_json=args.json))
        return 0
    if args.dry_run:
        code, listing = await dry_run(options, fetch, as_json=args.json)
        print(listing)
        return code
    stop = asyncio.Event()
    # Over stdio the host ends us by closing our input, or with SIGTERM / SIGINT: either way
    # the children are ended before we go.
    install_stop_signals(stop)
    keep_memory_private()  # its environment holds the fleet's token and its children's secrets
    try:
        return await serve_gateway(options, fetch, stop)
    finally:
        if telemetry is not None:
            await asyncio.to_thread(telemetry.shutdown)  # the last spans go out
