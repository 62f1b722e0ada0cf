"""`butlers gateway`: the gateway's options to GatewayOptions, then serve, `--dry-run`,
`--report`, or `install` / `uninstall` / `approve` (butlers.gateway).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers import logs
from butlers.cli.client import DEFAULT_SWITCHBOARD_URL, SwitchboardTarget, call_switchboard
from butlers.cli.process import collector_paused, install_stop_signals, keep_memory_private

if TYPE_CHECKING:
    from butlers.redact import Redactor
    from butlers.settings import Settings


async def gateway_command(
    args: argparse.Namespace, settings: Settings, redactor: Redactor | None = None
) -> int:
    if args.action in ("install", "uninstall"):
        from butlers.gateway import install

        where = {
            "host": args.target_host,
            "scope": args.scope,
            "config": args.config,
            "environ": settings.environ,
        }
        env_file = getattr(args, "env_file", None)
        if args.action == "install":
            if env_file is not None:
                fleet_env(env_file)  # refused now, not each time the host starts it
            lines = install.install(args.dir, **where, env_file=env_file)
        else:
            lines = install.uninstall(args.dir, **where)
        for line in lines:
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
    token, url = reveal(settings.auth_token), settings.switchboard_url
    if args.env_file is not None:
        from_file = fleet_env(args.env_file)
        token = from_file.get("BUTLERS_AUTH_TOKEN") or token
        url = from_file.get("BUTLERS_SWITCHBOARD_URL") or url
        if redactor is not None and token:
            redactor.add([token])  # never logged, as the environment's is not
    url = args.url or url or DEFAULT_SWITCHBOARD_URL
    options = GatewayOptions(
        directory=args.dir,
        environ=settings.environ,
        transport=args.transport,
        host=args.host,
        port=args.port,
        prewarm=not args.lazy,
        auth_token=token,
        mode=args.mode,
        config_file=args.config,
        telemetry=telemetry.for_butler("gateway") if telemetry is not None else None,
        redactor=redactor,
    )
    target = SwitchboardTarget(url, options.auth_token)

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


# What --env-file takes from the fleet's .env: nothing else of it (its other secrets are the
# fleet's, not the gateway's).
FLEET_ENV_KEYS = ("BUTLERS_AUTH_TOKEN", "BUTLERS_SWITCHBOARD_URL")


def fleet_env(path: Path) -> dict[str, str]:
    """BUTLERS_AUTH_TOKEN and BUTLERS_SWITCHBOARD_URL from the dotenv file `path`; CommandError
    when it cannot be read, or others may read it (a token there is anyone's)."""
    from dotenv import dotenv_values

    from butlers.errors import CommandError

    try:
        mode = path.stat().st_mode
        if mode & 0o077:
            raise CommandError(
                f"--env-file {path}: others may read it (mode {mode & 0o777:o}); chmod 600 {path}"
            )
        values = dotenv_values(path)
    except OSError as exc:
        raise CommandError(f"--env-file {path}: {exc.strerror or exc}") from None
    found = {key: value for key in FLEET_ENV_KEYS if (value := values.get(key))}
    if "BUTLERS_AUTH_TOKEN" not in found:
        raise CommandError(f"--env-file {path}: no BUTLERS_AUTH_TOKEN in it")
    return found
