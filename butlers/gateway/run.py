"""`butlers gateway`: assemble the children, serve the gateway (or print the token report)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from mcp.shared.exceptions import MCPDeprecationWarning
from starlette.middleware import Middleware

from butlers.errors import ButlersError
from butlers.gateway.children import ChildSpec, butler_children, discover_mcp_files
from butlers.gateway.config import load_gateway_config
from butlers.gateway.control import Mode, control_tools
from butlers.gateway.redaction import install_argument_redaction
from butlers.gateway.server import Gateway
from butlers.gateway.sources import project_servers, read_config_file
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


async def build_gateway(options: GatewayOptions, fetch_registry: RegistryFetch | None) -> Gateway:
    config = load_gateway_config(options.directory)
    specs: list[ChildSpec] = []
    if fetch_registry is not None:
        try:
            specs += butler_children(await fetch_registry())
        except ButlersError as exc:
            logger.warning("no butlers behind the gateway: %s", exc, extra={"action": "registry"})
    # Where a name comes twice, the first wins and the gateway warns, naming both files:
    # the butlers, --config, .mcp.json, what install moved, then the seed-000 globs.
    if options.config_file is not None:
        specs += read_config_file(options.config_file, options.environ)
    specs += project_servers(options.directory, options.environ)
    specs += discover_mcp_files(config.discover_globs, config.base_dir)
    telemetry = options.telemetry
    return Gateway(
        config,
        specs,
        environ=options.environ,
        auth_token=options.auth_token,
        mode=options.mode,
        tracer=telemetry.tracer if telemetry is not None else None,
        cli_env=telemetry.cli_env if telemetry is not None else None,
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
    gateway = await build_gateway(options, fetch_registry)
    install_argument_redaction(k for s in gateway.config.suites.values() for k in s.redact)
    try:
        if options.prewarm:
            gateway.start_warming()
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


async def dry_run(
    options: GatewayOptions, fetch_registry: RegistryFetch | None, *, as_json: bool = False
) -> tuple[int, str]:
    """Start every child, list each one's state and subtools (names and summaries), stop.
    The exit code is 1 when a child is in error, so a script can check a config with it."""
    gateway = await build_gateway(options, fetch_registry)
    try:
        await gateway.warm_all()
        children: list[dict[str, Any]] = []
        for slot in gateway.slots.values():
            subtools = []
            if slot.state != "error":
                subtools = await gateway.introspect(slot, "summary")
            children.append(
                {
                    "name": slot.spec.name,
                    "kind": slot.spec.kind,
                    "source": slot.spec.source,
                    "state": slot.state,
                    "error": slot.error,
                    # Activate and search mode list no suite tool.
                    "suite": slot.suite_name if gateway.mode in ("suite", "both") else None,
                    "subtools": [
                        {"name": t["name"], "summary": t.get("summary", "")} for t in subtools
                    ],
                }
            )
    finally:
        await gateway.close()
    code = 1 if any(c["state"] == "error" for c in children) else 0
    if as_json:
        return code, json.dumps({"mode": gateway.mode, "children": children})
    lines = [f"mode: {gateway.mode}, {len(children)} children"]
    for child in children:
        head = f"{child['name']} ({child['kind']}, {child['state']})"
        if child["error"]:
            lines.append(f"{head}: {child['error']}")
            continue
        suite = f", suite {child['suite']}" if child["suite"] else ""
        lines.append(f"{head}: {len(child['subtools'])} subtools{suite}")
        width = max((len(t["name"]) for t in child["subtools"]), default=0)
        lines += [f"  {t['name']:<{width}}  {t['summary']}".rstrip() for t in child["subtools"]]
    return code, "\n".join(lines)


def _json(model: Any) -> str:
    return json.dumps(model.model_dump(by_alias=True, exclude_none=True, mode="json"))


def _tokens(chars: int) -> int:
    """About four characters per token for JSON tool definitions."""
    return math.ceil(chars / 4)


async def token_report(
    options: GatewayOptions, fetch_registry: RegistryFetch | None, *, as_json: bool = False
) -> str:
    """Per child and in total: the tools/list a host sees natively vs through the gateway;
    a Markdown table, or (`as_json`) one JSON object with the same figures."""
    if options.transport != "stdio":
        require_token_beyond_loopback("the gateway", options.host, options.auth_token)
    gateway = await build_gateway(options, fetch_registry)
    try:
        await gateway.warm_all()
        # Whole definitions, as each side's tools/list carries them (schemas included).
        listed = {
            tool.name: len(_json(tool.to_mcp_tool())) for tool in await gateway.mcp.list_tools()
        }
        rows = [
            (
                slot.spec.name,
                slot.state,
                len(slot.tools),
                sum(len(json.dumps(t)) for t in slot.tools),
                listed.get(slot.suite_name, 0),
                gateway.wrapper_load_chars(slot),
            )
            for slot in gateway.slots.values()
        ]
        # The gateway's own tools the host lists in this mode (search: its four).
        own = control_tools(gateway.mode)
        control = sum(listed.get(name, 0) for name in own)
    finally:
        await gateway.close()
    if as_json:
        return json.dumps(_report_data(rows, control, own))
    lines = [
        "| child | state | tools | native chars | native tokens | gateway chars | gateway tokens "
        "| wrapper tokens |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, state, count, native, suite, wrapper in rows:
        lines.append(
            f"| {name} | {state} | {count} | {native} | {_tokens(native)} | {suite} | "
            f"{_tokens(suite)} | {'-' if wrapper is None else _tokens(wrapper)} |"
        )
    native_total = sum(r[3] for r in rows)
    gateway_total = sum(r[4] for r in rows) + control
    lines.append(
        f"| **total** (gateway incl. {len(own)} gateway_* tools) | | "
        f"{sum(r[2] for r in rows)} | {native_total} | {_tokens(native_total)} | "
        f"{gateway_total} | {_tokens(gateway_total)} | |"
    )
    if native_total:
        saved = 100 * (1 - gateway_total / native_total)
        lines.append("")
        lines.append(f"Through the gateway a host's tool list is {saved:.0f}% smaller.")
    if any(r[5] is not None for r in rows):
        lines.append(
            "wrapper tokens: what each natural_language call's Claude session loads (the "
            "wrapper's instructions and the child's tools), paid by that session, not the host."
        )
    return "\n".join(lines)


ReportRow = tuple[str, str, int, int, int, int | None]


def _report_data(rows: Sequence[ReportRow], control: int, own: Sequence[str]) -> dict[str, Any]:
    """The token report as data: per child, and the totals (the gateway's including its
    control tools)."""
    native_total = sum(r[3] for r in rows)
    gateway_total = sum(r[4] for r in rows) + control
    return {
        "children": [
            {
                "name": name,
                "state": state,
                "tools": count,
                "native_chars": native,
                "native_tokens": _tokens(native),
                "gateway_chars": suite,
                "gateway_tokens": _tokens(suite),
                "wrapper_chars": wrapper,
                "wrapper_tokens": None if wrapper is None else _tokens(wrapper),
            }
            for name, state, count, native, suite, wrapper in rows
        ],
        "control_tools": list(own),
        "control_chars": control,
        "total": {
            "tools": sum(r[2] for r in rows),
            "native_chars": native_total,
            "native_tokens": _tokens(native_total),
            "gateway_chars": gateway_total,
            "gateway_tokens": _tokens(gateway_total),
            "saved_percent": round(100 * (1 - gateway_total / native_total))
            if native_total
            else None,
        },
    }
