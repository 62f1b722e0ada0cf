"""`butlers` command line: a thin layer over the same objects the tests use.

Environment: DATABASE_URL (else embedded PostgreSQL), BUTLERS_DATA_DIR (default .butlers),
BUTLERS_AUTH_TOKEN (bearer token for every MCP endpoint), OTEL_EXPORTER_OTLP_ENDPOINT.

Each command imports what it needs when it runs, not at import time: `--help` and the client
commands must not pay for FastMCP, OpenTelemetry, Claude Code's SDK and the Telegram library
(seconds on a small machine; tests/test_cli.py guards it, bench/cli_startup.py
measures it). Keep module-level imports here to the standard library and light modules.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import logging
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers import __version__, logs
from butlers.errors import ButlersError, CommandError

if TYPE_CHECKING:
    from butlers.config import ButlerConfig
    from butlers.daemon import ButlerDaemon
    from butlers.redact import Redactor
    from butlers.settings import Settings
    from butlers.telemetry import Telemetry

logger = logging.getLogger("butlers")

DEFAULT_CONFIG_DIR = Path("config/butlers")


def _select(config_dir: Path, only: Sequence[str] | None, settings: Settings) -> list[ButlerConfig]:
    from butlers.config import Placement, load_config_dir

    fleet = load_config_dir(config_dir, Placement.from_environment(settings.environ))
    for error in fleet.errors:
        print(f"error: {error} (butler skipped)", file=sys.stderr)
    if only:
        unknown = [name for name in only if fleet.get(name) is None]
        if unknown:
            known = ", ".join(b.name for b in fleet.butlers) or "none"
            raise CommandError(
                f"no loadable butler named {', '.join(map(repr, unknown))} in {config_dir} "
                f"(loadable: {known})"
            )
        return [b for b in fleet.butlers if b.name in only]
    if not fleet.butlers:
        raise CommandError(f"no loadable butler in {config_dir}")
    return list(fleet.butlers)


def _format_rows(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _print_rows(rows: Sequence[Sequence[str]], indent: str = "") -> None:
    for line in _format_rows(rows, indent):
        print(line)


def _print_rows_with_details(
    header: Sequence[str], rows: Sequence[tuple[Sequence[str], Sequence[str]]]
) -> None:
    """A table whose rows may each carry detail lines (an error), printed indented under it:
    too long for a column, and what the operator is looking for."""
    lines = _format_rows([header, *(cells for cells, _ in rows)])
    print(lines[0])
    for line, (_, details) in zip(lines[1:], rows, strict=True):
        print(line)
        for detail in details:
            print(f"    {detail}")


def _print_table(daemons: Sequence[ButlerDaemon], db_description: str) -> None:
    rows = [("NAME", "MCP (SSE)", "STREAMABLE HTTP", "HEALTH")]
    rows += [
        (d.config.name, d.sse_url, f"{d.base_url}/mcp", f"{d.base_url}/health") for d in daemons
    ]
    print(f"Butlers ready ({db_description}):")
    _print_rows(rows, indent="  ")
    print("Press Ctrl-C to stop.", flush=True)


def ready_report(
    daemons: Sequence[ButlerDaemon], failed: dict[str, str], db_description: str
) -> dict[str, Any]:
    """The ready table as data (`butlers up --json`): every butler asked for, running or not."""
    butlers: list[dict[str, Any]] = [
        {
            "name": d.config.name,
            "status": "running",
            "url": d.sse_url,
            "mcp_url": f"{d.base_url}/mcp",
            "health_url": f"{d.base_url}/health",
        }
        for d in daemons
    ]
    butlers += [{"name": n, "status": "failed", "error": error} for n, error in failed.items()]
    return {"database": db_description, "butlers": sorted(butlers, key=lambda b: b["name"])}


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The garbage collector off while a command imports its libraries, and what they built
    frozen after (never traversed again). Python 3.11 collects over and over while some 900
    modules import, pydantic's models above all: measured, `butlers gateway` imports in 0.7 s
    instead of 0.8-0.95 s this way, with under a thousand garbage objects left behind."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def progress(text: str) -> None:
    """A start-up step, for the person waiting (stderr: stdout stays the ready table or JSON)."""
    logs.progress(text)


def _install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)


@dataclass(frozen=True)
class PortChoice:
    """Ports other than the butler.toml's: `run --port P` (one butler) or `up --port-offset K`
    (every butler). With `--port`, what the registry stores stays the butler.toml's:
    replicas sit behind one address (docs/scaling.md). With `--port-offset` the whole fleet
    moved, and is registered where it listens (Placement.port_offset)."""

    port: int | None = None
    offset: int = 0

    def apply(self, configs: Sequence[ButlerConfig]) -> list[ButlerConfig]:
        chosen = []
        for config in configs:
            port = self.port if self.port is not None else config.port + self.offset
            if not 1 <= port <= 65535:
                option = "--port" if self.port is not None else f"--port-offset {self.offset}"
                raise CommandError(
                    f"{option}: butler {config.name!r} would listen on port {port}; "
                    "expected a port number between 1 and 65535"
                )
            chosen.append(replace(config, port=port))
        return chosen


async def serve(
    config_dir: Path,
    only: Sequence[str] | None,
    *,
    strict: bool,
    redactor: Redactor,
    settings: Settings,
    as_json: bool = False,
    ports: PortChoice | None = None,
) -> int:
    """Run butlers until SIGINT/SIGTERM. `strict`: any butler failing to start is fatal.
    `redactor`: the process's log redaction, told the secrets the configs name."""
    stop = asyncio.Event()
    _install_stop_signals(stop)
    configs = (ports or PortChoice()).apply(_select(config_dir, only, settings))
    from butlers.db import EmbeddedServer, running, server_for

    server = server_for(settings)
    if isinstance(server, EmbeddedServer):
        await server.locate()  # as root, the data may live elsewhere: say where it is
        first = not (server.pgdata / "PG_VERSION").exists()
        progress(
            f"Initialising PostgreSQL in {server.pgdata} (first start)..."
            if first
            else f"Starting PostgreSQL in {server.pgdata}..."
        )
    async with contextlib.AsyncExitStack() as stack:
        # PostgreSQL starts in a worker thread (initdb alone takes most of a second) while this
        # one imports what the butlers need: on a cold start the two overlap.
        starting = asyncio.create_task(
            stack.enter_async_context(running(server)), name="postgres:start"
        )
        await asyncio.sleep(0)  # let it hand the start to its thread before the imports
        try:
            with collector_paused():
                import butlers.daemon  # noqa: F401 - loaded here, with the collector paused
                from butlers.settings import reveal
                from butlers.telemetry import Telemetry

                logs.adopt_fastmcp_logging()
        finally:
            await starting
        from butlers.redact import Redactor

        redactor.add(Redactor.from_environment(configs, environ=settings.environ).secrets)
        telemetry = Telemetry.from_settings(settings, redact=redactor.clipped)
        async with _flushed(telemetry):
            await _serve_fleet(
                configs,
                server,
                config_dir,
                telemetry,
                settings=settings,
                auth_token=reveal(settings.auth_token),
                stop=stop,
                strict=strict,
                as_json=as_json,
                port_offset=(ports or PortChoice()).offset,
            )
    return 0


async def _serve_fleet(
    configs: Sequence[ButlerConfig],
    server: Any,
    config_dir: Path,
    telemetry: Telemetry,
    *,
    settings: Settings,
    auth_token: str | None,
    stop: asyncio.Event,
    strict: bool,
    as_json: bool,
    port_offset: int = 0,
) -> None:
    from butlers.daemon import start_fleet, stop_fleet

    report = await start_fleet(
        configs,
        server,
        data_dir=settings.data_dir,
        settings=settings,
        auth_token=auth_token,
        config_dir=config_dir,
        telemetry=telemetry,
        progress=progress,
        port_offset=port_offset,
    )
    try:
        for name, error in report.failed.items():
            print(f"error: butler {name!r} not started: {error}", file=sys.stderr)
        if not report.running or (strict and report.failed):
            raise CommandError(
                "no butler is running" if not report.running else "a butler failed to start"
            )
        if as_json:
            ready = ready_report(report.running, report.failed, server.description)
            print(json.dumps(ready, ensure_ascii=False), flush=True)
        else:
            _print_table(report.running, server.description)
        await stop.wait()
        progress("Stopping...")
    finally:
        await stop_fleet(report.running)


@contextlib.asynccontextmanager
async def _flushed(telemetry: Telemetry) -> AsyncIterator[None]:
    """The last spans of a run are exported before the process ends (in a thread: a flush
    blocks for as long as the collector takes to answer)."""
    try:
        yield
    finally:
        await asyncio.to_thread(telemetry.shutdown)


async def db_upgrade(config_dir: Path, names: Sequence[str], settings: Settings) -> int:
    configs = _select(config_dir, names, settings)  # a config error before the imports
    with collector_paused():
        from butlers.daemon import migration_branches
        from butlers.db import prepare_database, running, server_for

    server = server_for(settings)
    failed = False
    async with running(server):
        for config in configs:
            try:
                await prepare_database(server, config.database, migration_branches(config))
            except ButlersError as exc:
                print(f"error: {config.name}: {exc}", file=sys.stderr)
                failed = True
                continue
            print(f"{config.name}: database {config.database} is up to date")
    return 1 if failed else 0


DEFAULT_SWITCHBOARD_URL = "http://127.0.0.1:8100/sse"
CLIENT_COMMANDS = (
    "list",
    "discover",
    "route",
    "ask",
    "trace",
    "inbox",
    "log",
    "retry",
    "outbox",
    "approvals",
    "pairing",
    "schedules",
    "memory",
)


@dataclass(frozen=True)
class SwitchboardTarget:
    """Where a client command calls the switchboard (`--url`), with the token it sends
    (BUTLERS_AUTH_TOKEN; never shown)."""

    url: str
    auth_token: str | None = field(default=None, repr=False)


CONNECT_TIMEOUT_S = 10.0
CLIENT_INFO = {"name": "butlers-cli", "version": __version__}


async def _call_switchboard(target: SwitchboardTarget, tool: str, arguments: dict[str, Any]) -> Any:
    """One of the switchboard's tools, called and answered; CommandError, in words for the
    user, when the switchboard cannot be reached or the tool refuses.

    An `/sse` URL (the default) goes through our own lean connection (aiohttp): a client
    command then does not import FastMCP, whose import alone takes longer than the whole
    command should (bench/cli_startup.py). Any other URL (`/mcp`) goes through FastMCP's."""
    from butlers.errors import McpCallError

    connection = _connection(target)
    try:
        await connection.open(CONNECT_TIMEOUT_S)
    except Exception as exc:  # TimeoutError, ConnectionClosed, FastMCP's client's own
        # FastMCP's client raises its connect error again from close(): already reported.
        with contextlib.suppress(Exception):
            await connection.close()
        raise CommandError(_unreachable(target.url, exc)) from exc
    try:
        result = await connection.call_tool(tool, arguments, timeout_s=None)
    except McpCallError as exc:
        raise CommandError(f"the switchboard at {target.url} did not answer: {exc}") from exc
    finally:
        await connection.close()
    from butlers.mcp_connection.core import unwrap

    answer = unwrap(result)
    if result.get("isError"):
        raise CommandError(str(answer))
    return answer


def _connection(target: SwitchboardTarget) -> Any:
    if target.url.rstrip("/").endswith("/sse"):
        with collector_paused():
            from butlers.mcp_connection.sse import SseConnection

        return SseConnection(target.url, auth_token=target.auth_token, client_info=CLIENT_INFO)
    with collector_paused():
        from butlers.mcp_connection.streamable import FastMcpConnection

        logs.adopt_fastmcp_logging()
    return FastMcpConnection(target.url, auth_token=target.auth_token)


def _unreachable(url: str, exc: BaseException) -> str:
    """What to tell the user when the switchboard did not answer: what to check first, and
    the innermost, most telling cause of the failed connection."""
    while True:
        if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    if isinstance(exc, TimeoutError):
        text = f"no answer within {CONNECT_TIMEOUT_S:g} s"
    else:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "401" in text:
        return (
            f"the switchboard at {url} answered 401 Unauthorized: set BUTLERS_AUTH_TOKEN to "
            "the switchboard's token"
        )
    cause = text.removeprefix("Client failed to connect: ")
    return f"cannot reach the switchboard at {url}: is `butlers up` running? ({cause})"


def _print_butlers(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("No butlers registered. Run `butlers discover` after adding config/butlers/<name>/.")
        return
    table = [("NAME", "ENDPOINT", "MODULES", "LAST SEEN", "DESCRIPTION")]
    for row in rows:
        description = row.get("description") or ""
        table.append(
            (
                row["name"],
                row["endpoint_url"],
                ",".join(row.get("modules") or []) or "-",
                ("stale, " if row.get("stale") else "")
                + (row.get("last_seen_at") or "never")[:19].replace("T", " "),
                description if len(description) <= 60 else description[:59] + "…",
            )
        )
    _print_rows(table)


def _print_discover(report: dict[str, Any]) -> None:
    print(f"added:     {', '.join(report['added']) or '-'}")
    updated = [f"{u['name']} ({', '.join(u['changed'])})" for u in report["updated"]]
    print(f"updated:   {', '.join(updated) or '-'}")
    print(f"unchanged: {', '.join(report['unchanged']) or '-'}")
    print(f"stale:     {', '.join(report['stale']) or '-'}")
    for error in report["errors"]:
        print(f"error:     {error['path']}: {error['key']}: {error['problem']}")


def _print_answer(answer: dict[str, Any]) -> None:
    if answer.get("status") != "done":
        raise CommandError(f"message {answer.get('inbox_id')} failed: {answer.get('error')}")
    print(answer.get("reply") or "")
    if answer.get("routed_to"):
        print(f"(answered by {answer['routed_to']})", file=sys.stderr)


def _print_result(result: Any) -> None:
    print(result if isinstance(result, str) else json.dumps(result, indent=2, ensure_ascii=False))


TRACE_ID = re.compile(r"[0-9a-f]{32}")


async def _trace(target: SwitchboardTarget, ref: str, jaeger_ui_url: str) -> dict[str, Any]:
    """The Jaeger link for a trace id, or for the trace of a routing_log row (looked up through
    the switchboard)."""
    ref = ref.strip().lower()
    route = None
    if TRACE_ID.fullmatch(ref):
        trace_id = ref
    else:
        try:
            uuid.UUID(ref)
        except ValueError:
            raise CommandError(
                f"{ref!r} is neither a trace id (32 hex characters) nor a routing_log id (a UUID)"
            ) from None
        route = await _call_switchboard(target, "routing_log_entry", {"id": ref})
        trace_id = route.get("trace_id")
        if not trace_id:
            raise CommandError(f"routing_log row {ref} has no trace id")
    from butlers.switchboard.operator import jaeger_url

    return {"trace_id": trace_id, "url": jaeger_url(trace_id, jaeger_ui_url), "route": route}


def _print_trace(found: dict[str, Any]) -> None:
    print(found["url"])
    route = found["route"]
    if route:
        outcome = "ok" if route["success"] else f"failed: {route['error']}"
        print(
            f"({route['source_channel']} -> {route['routed_to']}.{route['tool_name']}, "
            f"{str(route['created_at'])[:19].replace('T', ' ')}, {outcome})",
            file=sys.stderr,
        )


TABLE_TEXT_CHARS = 48  # an excerpt's share of a table line; --json has the tool's whole excerpt


def _when(value: str | None) -> str:
    """A timestamp of the switchboard's (ISO 8601, UTC) in this machine's local time."""
    if not value:
        return "-"
    return datetime.fromisoformat(value).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _cut(text: str | None, limit: int = TABLE_TEXT_CHARS) -> str:
    """A cell of a table: other people's text (a memory, a prompt, a sender's name), so no
    control characters (a terminal escape would rewrite the operator's screen), one line,
    cut."""
    from butlers.text import printable

    return printable(text, limit)


def _none_found(what: str, status: str | None) -> str:
    return f"No {status} {what}." if status else f"No {what}."


def _print_inbox(rows: list[dict[str, Any]], status: str | None) -> None:
    if not rows:
        print(_none_found("inbox messages", status))
        return
    table = []
    for row in rows:
        sender = row.get("source_id") or "-"
        if row.get("sender_name"):
            sender = f"{row['sender_name']} ({sender})"
        text = row.get("excerpt") or ""
        if row.get("subject"):
            text = f"[{row['subject']}] {text}"
        cells = (
            str(row["id"]),
            _when(row.get("received_at")),
            row["channel"],
            _cut(sender, 32),
            row["status"],
            row.get("routed_to") or "-",
            row.get("classified_via") or "-",
            _cut(text),
        )
        details = [f"error: {row['error']}"] if row.get("error") else []
        if row.get("error") and row.get("trace_url"):
            details.append(f"trace: {row['trace_url']}")
        details += [
            f"approval #{a['id']}: {a['tool']} ({a['status']})" for a in row.get("approvals") or []
        ]
        table.append((cells, details))
    header = ("ID", "RECEIVED", "CHANNEL", "FROM", "STATUS", "ROUTED TO", "VIA", "TEXT")
    _print_rows_with_details(header, table)


def _print_routing_log(rows: list[dict[str, Any]], butler: str | None) -> None:
    if not rows:
        print(f"No routes to {butler!r} logged." if butler else "No routes logged.")
        return
    table = []
    for row in rows:
        duration = row.get("duration_ms")
        cells = (
            _when(row.get("created_at")),
            row["source_channel"],
            _cut(row.get("source_id") or "-", 32),
            f"{row['routed_to']}.{row.get('tool_name') or '?'}",
            "ok" if row.get("success") else "FAILED",
            "-" if duration is None else str(duration),
            str(row.get("inbox_id") or "-"),
            _cut(row.get("prompt_summary")) or "-",
            row.get("trace_url") or "-",
        )
        table.append((cells, [f"error: {row['error']}"] if row.get("error") else []))
    header = ("WHEN", "CHANNEL", "FROM", "TO", "RESULT", "MS", "INBOX", "SUMMARY", "TRACE")
    _print_rows_with_details(header, table)


def _print_retry(answer: dict[str, Any]) -> None:
    earlier = (answer.get("retries") or [{}])[-1]
    why = f": {earlier['error']}" if earlier.get("error") else ""
    print(f"message {answer['id']} is queued again (it was {earlier.get('status', '?')}{why})")


def _print_outbox(rows: list[dict[str, Any]], status: str | None) -> None:
    if not rows:
        print(_none_found("outbox rows", status) if status else "Nothing waiting in the outbox.")
        return
    table = []
    for row in rows:
        cells = (
            str(row["id"]),
            _when(row.get("created_at")),
            row["kind"],
            row["channel"],
            _cut(row["recipient"], 32),
            row["status"],
            str(row["attempts"]),
            _when(row.get("sent_at")) if row["status"] == "sent" else _next(row),
            str(row.get("inbox_id") or "-"),
            row.get("butler") or "-",
            _cut(row.get("excerpt")),
        )
        table.append((cells, [f"error: {row['error']}"] if row.get("error") else []))
    header = (
        "ID",
        "CREATED",
        "KIND",
        "CHANNEL",
        "TO",
        "STATUS",
        "ATTEMPTS",
        "SENT / NEXT TRY",
        "INBOX",
        "BUTLER",
        "TEXT",
    )
    _print_rows_with_details(header, table)


def _print_approvals(rows: list[dict[str, Any]], status: str | None) -> None:
    if not rows:
        print(_none_found("approvals", status))
        return
    table = []
    for row in rows:
        arguments = json.dumps(row.get("arguments"), ensure_ascii=False, sort_keys=True)
        cells = (
            str(row["id"]),
            _when(row.get("requested_at")),
            row["butler"],
            row["tool"],
            row["status"],
            _when(row.get("decided_at")),
            row.get("decided_by") or "-",
            _cut(arguments),
        )
        details = [f"result: {_cut(row['result'], 200)}"] if row.get("result") else []
        table.append((cells, details))
    header = ("ID", "REQUESTED", "BUTLER", "TOOL", "STATUS", "DECIDED", "BY", "ARGUMENTS")
    _print_rows_with_details(header, table)


def _print_decision(answer: dict[str, Any]) -> None:
    """What `approvals approve|deny` did: the decision, and for an approval, how it ran."""
    if not answer.get("changed"):
        raise CommandError(
            f"approval {answer['id']} is {answer['status']} already: nothing changed"
        )
    said = f"approval {answer['id']} is {answer['status']}"
    if answer.get("result"):
        said += f": {_cut(answer['result'], 200)}"
    print(said)


def _print_pairing(listing: dict[str, Any]) -> None:
    """Pending codes, then paired senders; names are the senders' own: cut (and cleaned
    when they were stored)."""
    if not listing.get("enabled"):
        print("Pairing is off ([switchboard.pairing] enabled = false): strangers get no code.")
    pending = listing.get("pending") or []
    if pending:
        rows: list[tuple[str, ...]] = [("CODE", "CHANNEL", "SENDER", "NAME", "ASKED", "EXPIRES")]
        rows += [
            (
                p["code"],
                p["channel"],
                _cut(p["sender"], 40),
                _cut(p.get("name"), 40) or "-",
                _when(p.get("created_at")),
                _when(p.get("expires_at")),
            )
            for p in pending
        ]
        _print_rows(rows)
    else:
        print("No pending pairing codes.")
    paired = listing.get("paired") or []
    if paired:
        print()
        rows = [("PAIRED", "SENDER", "NAME", "APPROVED", "BY")]
        rows += [
            (
                p["channel"],
                _cut(p["sender"], 40),
                _cut(p.get("name"), 40) or "-",
                _when(p.get("approved_at")),
                p.get("approved_by") or "-",
            )
            for p in paired
        ]
        _print_rows(rows)


def _print_paired(answer: dict[str, Any]) -> None:
    """What `pairing approve|deny|revoke` did."""
    who = f"{answer['channel']} {_cut(answer['sender'], 40)}"
    if answer.get("name"):
        who += f" ({_cut(answer['name'], 40)})"
    if answer.get("revoked"):
        print(f"{who} is no longer paired: a stranger again")
    elif answer["status"] == "approved":
        print(f"code {answer['code']} approved: {who} is paired; their next message is answered")
    else:
        print(f"code {answer['code']} denied: {who} is not let in")


def _next(row: dict[str, Any]) -> str:
    """When a row not sent yet is tried again (nothing for one that failed for good)."""
    return "-" if row["status"] == "failed" else _when(row.get("next_attempt_at"))


async def client_command(args: argparse.Namespace, settings: Settings) -> int:
    from butlers.settings import reveal

    target = SwitchboardTarget(args.url, reveal(settings.auth_token))
    result: Any
    show: Callable[[Any], None]  # each printer takes its own tool's answer
    if args.command == "trace":
        result = await _trace(target, args.ref, settings.jaeger_ui_url)
        show = _print_trace
    elif args.command == "list":
        result = await _call_switchboard(target, "list_butlers", {})
        show = _print_butlers
    elif args.command == "discover":
        result = await _call_switchboard(target, "discover", {})
        show = _print_discover
    elif args.command == "ask":
        result = await _call_switchboard(target, "ask", {"text": args.text})
        show = _print_answer
    elif args.command == "inbox":
        result = await _call_switchboard(
            target, "inbox_list", {"status": args.status, "limit": args.limit}
        )
        show = functools.partial(_print_inbox, status=args.status)
    elif args.command == "log":
        result = await _call_switchboard(
            target, "routing_log_list", {"butler": args.butler, "limit": args.limit}
        )
        show = functools.partial(_print_routing_log, butler=args.butler)
    elif args.command == "retry":
        result = await _call_switchboard(target, "inbox_retry", {"id": args.id})
        show = _print_retry
    elif args.command == "outbox":
        result = await _call_switchboard(
            target, "outbox_list", {"status": args.status, "limit": args.limit}
        )
        show = functools.partial(_print_outbox, status=args.status)
    elif args.command == "approvals" and args.action is None:
        result = await _call_switchboard(
            target, "approvals_list", {"status": args.status, "limit": args.limit}
        )
        show = functools.partial(_print_approvals, status=args.status)
    elif args.command == "approvals":
        if args.id is None:
            raise CommandError(f"which approval? `butlers approvals {args.action} ID`")
        decision = {"id": args.id, "decision": args.action}
        result = await _call_switchboard(target, "approval_decide", decision)
        show = _print_decision
    elif args.command == "pairing":
        result = await _pairing(target, args.action, args.values)
        show = _print_pairing if args.action is None else _print_paired
    elif args.command == "schedules":
        result = await _schedules(target, args.butler)
        show = _print_schedules
    elif args.command == "memory":
        result = await _memory(target, args)
        show = _print_memories if args.action is None else _print_result
    else:
        try:
            route_args = json.loads(args.args)
        except json.JSONDecodeError as exc:
            raise CommandError(
                f'ARGS must be a JSON object such as \'{{"prompt": "hi"}}\': {exc}'
            ) from exc
        if not isinstance(route_args, dict):
            raise CommandError(f"ARGS must be a JSON object, got {type(route_args).__name__}")
        result = await _call_switchboard(
            target,
            "route",
            {"butler_name": args.butler, "tool_name": args.tool, "args": route_args},
        )
        show = _print_result
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        show(result)
    return 0


async def _on_butler(
    target: SwitchboardTarget,
    butler: str,
    tool: str,
    arguments: dict[str, Any],
    switchboard: str | None = None,
) -> Any:
    """A tool of butler `butler`: through the switchboard's `route`, or the switchboard's own
    when it is the one named (route does not call itself). `switchboard`: its name, when
    the caller knows it already."""
    if butler == (switchboard or await _switchboard_name(target)):
        return await _call_switchboard(target, tool, arguments)
    return await _call_switchboard(
        target, "route", {"butler_name": butler, "tool_name": tool, "args": arguments}
    )


async def _switchboard_name(target: SwitchboardTarget) -> str | None:
    status = await _call_switchboard(target, "status", {})
    return status.get("name") if isinstance(status, dict) else None


async def _schedules(target: SwitchboardTarget, only: str | None) -> list[dict[str, Any]]:
    """Every butler's schedules (or `only`'s), each row with its butler; a butler that cannot
    be asked is a row saying why, not the end of the listing."""
    registry = await _call_switchboard(target, "list_butlers", {})
    own = await _switchboard_name(target)
    names = [own or "switchboard"] + [
        b["name"] for b in registry if b["name"] != own and not b.get("stale")
    ]
    if only is not None:
        if only not in names:
            raise CommandError(f"no butler named {only!r} (butlers list shows them)")
        names = [only]

    async def of(name: str) -> list[dict[str, Any]]:
        try:
            rows = await _on_butler(target, name, "schedule_list", {}, switchboard=own)
        except CommandError as exc:
            return [{"butler": name, "error": str(exc)}]
        return [{"butler": name, **row} for row in rows]

    found = await asyncio.gather(*(of(name) for name in names))
    return [row for rows in found for row in rows]


def _in_zone(value: str | None, zone: str | None) -> str:
    """A UTC timestamp shown on the butler's own wall clock (its time zone)."""
    if not value:
        return "-"
    from butlers.schedule_time import wall_clock

    return wall_clock(value, zone) or _cut(value)


def _print_schedules(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("No schedules.")
        return
    table: list[tuple[tuple[str, ...], list[str]]] = []
    for row in rows:
        if "error" in row:
            table.append(((row["butler"], "-", "-", "-", "-", "-", "-"), [row["error"]]))
            continue
        zone = row.get("timezone")
        cells = (
            row["butler"],
            row["name"],
            row.get("cron") or "once",
            _in_zone(row.get("next_run_at"), zone),
            _in_zone(row.get("last_run_at"), zone),
            row.get("origin", "tool"),
            _cut(row.get("prompt")),
        )
        table.append((cells, []))
    header = ("BUTLER", "NAME", "WHEN", "NEXT (LOCAL)", "LAST (LOCAL)", "FROM", "PROMPT")
    _print_rows_with_details(header, table)


async def _memory(target: SwitchboardTarget, args: argparse.Namespace) -> Any:
    if args.action == "forget":
        if args.id is None:
            raise CommandError(f"which memory? `butlers memory {args.butler} forget ID`")
        return await _on_butler(target, args.butler, "memory_forget", {"id": args.id})
    if args.search:
        return await _on_butler(
            target, args.butler, "memory_search", {"query": args.search, "limit": args.limit}
        )
    return await _on_butler(target, args.butler, "memory_list", {"limit": args.limit})


def _print_memories(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("No memories.")
        return
    table: list[tuple[tuple[str, ...], list[str]]] = []
    for row in rows:
        cells = (
            str(row["id"]),
            _when(row.get("created_at")),
            ",".join(row.get("tags") or []) or "-",
            f"{row['score']:.3f}" if "score" in row else "-",
            _cut(row["text"]),
        )
        table.append((cells, []))
    _print_rows_with_details(("ID", "REMEMBERED", "TAGS", "SCORE", "TEXT"), table)


async def _pairing(target: SwitchboardTarget, action: str | None, values: list[str]) -> Any:
    """`butlers pairing [approve CODE | deny CODE | revoke CHANNEL SENDER]`."""
    wanted = {None: [], "approve": ["CODE"], "deny": ["CODE"], "revoke": ["CHANNEL", "SENDER"]}
    if len(values) != len(wanted[action]):
        usage = " ".join(["butlers pairing", *([action] if action else []), *wanted[action]])
        count = len(wanted[action])
        raise CommandError(
            f"`{usage}`: expected {count} value{'' if count == 1 else 's'}, got {len(values)}"
        )
    if action is None:
        return await _call_switchboard(target, "pairing_list", {})
    if action == "revoke":
        channel, sender = values
        return await _call_switchboard(
            target, "pairing_revoke", {"channel": channel, "sender": sender}
        )
    return await _call_switchboard(
        target, "pairing_decide", {"code": values[0], "decision": action}
    )


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
    )
    target = SwitchboardTarget(args.url, options.auth_token)

    async def registry() -> list[dict[str, Any]]:
        return await _call_switchboard(target, "list_butlers", {})  # CommandError if down

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
    _install_stop_signals(stop)
    try:
        return await serve_gateway(options, fetch, stop)
    finally:
        if telemetry is not None:
            await asyncio.to_thread(telemetry.shutdown)  # the last spans go out


def _parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="butlers",
        description="Run and talk to a personal team of AI butlers.",
        epilog="Environment: DATABASE_URL (else embedded PostgreSQL under $BUTLERS_DATA_DIR), "
        "BUTLERS_DATA_DIR (default .butlers), BUTLERS_AUTH_TOKEN, OTEL_EXPORTER_OTLP_ENDPOINT.",
    )
    parser.add_argument("--version", action="version", version=f"butlers {__version__}")
    _log_options(
        parser,
        level=settings.log_level,
        log_format=settings.log_format,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def config_dir_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config-dir",
            type=Path,
            default=DEFAULT_CONFIG_DIR,
            help=f"butler config directory (default {DEFAULT_CONFIG_DIR})",
        )

    from butlers import doctor, init_command

    init_command.add_arguments(
        commands.add_parser(
            "init",
            help="write a new config directory (switchboard, general, .env template)",
            description="Write a new, working config directory; asks its questions unless "
            "--non-interactive. Refuses a directory that already holds a config.",
        )
    )
    doctor_parser = commands.add_parser(
        "doctor",
        help="check the configs, secrets, ports, database, Claude Code and exposure",
        description="One line per check (ok, warn, fail) with what to do; exit 0 only when "
        "nothing fails. --online also asks Telegram, the mail servers and the Messages API.",
    )
    config_dir_arg(doctor_parser)
    doctor.add_arguments(doctor_parser)

    up = commands.add_parser("up", help="start PostgreSQL and every butler in one process")
    config_dir_arg(up)
    up.add_argument("--only", nargs="+", metavar="NAME", help="start only these butlers")
    up.add_argument("--json", action="store_true", help="print the ready table as one JSON object")
    up.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="K",
        help="every butler listens on its port + K: a second fleet beside the first, on the "
        "same databases (the switchboard runs as a replica)",
    )

    run = commands.add_parser("run", help="run one butler in the foreground")
    config_dir_arg(run)
    run.add_argument("name")
    run.add_argument(
        "--port",
        type=int,
        metavar="P",
        help="listen on P instead of the butler.toml's port (a switchboard replica)",
    )

    db = commands.add_parser("db", help="database commands")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="create and migrate butler databases")
    config_dir_arg(upgrade)
    upgrade.add_argument("names", nargs="*", metavar="NAME")

    def client_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--url",
            default=settings.switchboard_url or DEFAULT_SWITCHBOARD_URL,
            help="the switchboard's MCP endpoint (default %(default)s, "
            "env BUTLERS_SWITCHBOARD_URL)",
        )
        p.add_argument("--json", action="store_true", help="print JSON, for scripts")

    client_args(commands.add_parser("list", help="list the registered butlers"))
    client_args(commands.add_parser("discover", help="re-scan the config directory"))
    route = commands.add_parser("route", help="call a tool on a butler through the switchboard")
    client_args(route)
    route.add_argument("butler")
    route.add_argument("tool")
    route.add_argument("args", nargs="?", default="{}", help="tool arguments as a JSON object")
    ask = commands.add_parser(
        "ask", help="send a message through classify -> route -> reply and print the reply"
    )
    client_args(ask)
    ask.add_argument("text")
    gateway = commands.add_parser(
        "gateway",
        help="serve every butler and .mcp.json server to a host as one MCP server",
        description="One MCP server for a host such as Claude Code: a suite tool per butler "
        "(from the switchboard's registry) and per .mcp.json server, plus gateway_activate / "
        "gateway_deactivate / gateway_status. Reads gateway.toml (or switchboard.config.json) "
        "from --dir.",
    )
    gateway.add_argument("--transport", choices=("stdio", "sse", "http"), default="stdio")
    gateway.add_argument("--host", default="127.0.0.1", help="for sse/http (default 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=8110, help="for sse/http (default 8110)")
    gateway.add_argument(
        "--dir", type=Path, default=Path("."), help="where gateway.toml and the .mcp.json globs are"
    )
    gateway.add_argument(
        "--url",
        default=settings.switchboard_url or DEFAULT_SWITCHBOARD_URL,
        help="the switchboard whose registry lists the butlers",
    )
    gateway.add_argument("--no-butlers", action="store_true", help="only the .mcp.json servers")
    gateway.add_argument(
        "--lazy", action="store_true", help="start children on first use, not all at start"
    )
    gateway.add_argument(
        "--report",
        action="store_true",
        help="print what a host loads (bytes, tokens): every server directly vs the gateway's "
        "suite, activate and search modes",
    )
    gateway.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="MCP servers from a claude_desktop_config.json, an mcpflip servers.json, Gemini "
        "CLI's settings.json or Codex's config.toml too (.mcp.json at --dir is read anyway)",
    )
    gateway.add_argument(
        "--mode",
        choices=("suite", "activate", "both", "search"),
        help="suite tools, only gateway_* until activation, both, or search (gateway_search, "
        "gateway_describe, gateway_call) (default: gateway.toml's mode, else suite)",
    )
    gateway.add_argument(
        "--dry-run",
        action="store_true",
        help="start every child, list its state and subtools, and exit (1 if one is in error)",
    )
    gateway.add_argument(
        "--json", action="store_true", help="--report / --dry-run as JSON, for scripts"
    )
    actions = gateway.add_subparsers(dest="action", metavar="{install,uninstall}")
    for action, text in (
        ("install", "put the gateway in front of a host's MCP servers, with a backup"),
        ("uninstall", "put the host's original config back, byte for byte"),
    ):
        step = actions.add_parser(action, help=text, description=text)
        # --dir and --config are the gateway's own options too: `gateway --dir D install`
        # must mean `gateway install --dir D`. argparse copies every attribute of a
        # sub-parser's namespace over the parent's, defaults included, so a default here
        # would replace the D given before `install`: without one (SUPPRESS), the value
        # given after `install` wins, else the one given before, else the gateway's default.
        step.add_argument(
            "--dir",
            type=Path,
            default=argparse.SUPPRESS,
            help="the project (the gateway's --dir; default .)",
        )
        step.add_argument(
            "--scope",
            choices=("project", "user"),
            default="project",
            help="project: rewrite DIR/.mcp.json; user: `claude mcp add -s user`",
        )
        step.add_argument(
            "--host",
            dest="target_host",
            choices=("claude-code", "claude-desktop", "cursor", "vscode"),
            default="claude-code",
            help="whose config (default claude-code): DIR/.mcp.json, claude_desktop_config.json, "
            "DIR/.cursor/mcp.json or DIR/.vscode/mcp.json",
        )
        step.add_argument(
            "--config",
            type=Path,
            metavar="FILE",
            default=argparse.SUPPRESS,
            help="the host's file, if not where it keeps it",
        )
    trace = commands.add_parser(
        "trace",
        # (the default is butlers.switchboard.operator's, not imported for a --help)
        help="print the Jaeger URL of a message's trace (JAEGER_UI_URL, "
        "default http://localhost:16686)",
    )
    client_args(trace)
    trace.add_argument("ref", metavar="ID", help="a trace id, or a routing_log id")

    def limit_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--limit", type=int, default=20, help="at most this many, 1..500 (20)")

    inbox = commands.add_parser(
        "inbox", help="the newest messages and what became of them (times are local)"
    )
    client_args(inbox)
    inbox.add_argument("--status", help="only queued|processing|done|failed|skipped ones")
    limit_arg(inbox)
    log = commands.add_parser("log", help="the newest routing_log rows, with their Jaeger links")
    client_args(log)
    log.add_argument("--butler", metavar="NAME", help="only the routes to this butler")
    limit_arg(log)
    retry = commands.add_parser(
        "retry", help="queue a failed (or skipped) message again: it is routed and answered anew"
    )
    client_args(retry)
    retry.add_argument("id", metavar="ID", type=int, help="the message's inbox id")
    outbox = commands.add_parser(
        "outbox", help="replies and notifications not sent yet, and those that failed"
    )
    client_args(outbox)
    outbox.add_argument("--status", help="only pending|sending|sent|failed ones")
    limit_arg(outbox)
    approvals = commands.add_parser(
        "approvals",
        help="calls waiting for the owner's yes, and what became of them; "
        "`approvals approve|deny ID` decides one",
    )
    client_args(approvals)
    approvals.add_argument(
        "action", nargs="?", choices=("approve", "deny"), help="decide approval ID"
    )
    approvals.add_argument("id", nargs="?", type=int, metavar="ID", help="the approval's id")
    approvals.add_argument("--status", help="only pending|approved|denied|expired|done|failed ones")
    limit_arg(approvals)
    pairing = commands.add_parser(
        "pairing",
        help="strangers' pending codes and paired senders; `pairing approve|deny CODE` "
        "decides one, `pairing revoke CHANNEL SENDER` unpairs",
    )
    client_args(pairing)
    pairing.add_argument(
        "action", nargs="?", choices=("approve", "deny", "revoke"), help="what to do"
    )
    pairing.add_argument(
        "values", nargs="*", metavar="VALUE", help="CODE, or CHANNEL SENDER for revoke"
    )
    schedules = commands.add_parser(
        "schedules", help="every butler's schedules, next and last run in its local time"
    )
    client_args(schedules)
    schedules.add_argument("--butler", metavar="NAME", help="only this butler's")
    memory = commands.add_parser(
        "memory",
        help="a butler's long-term memory: the newest, `--search Q`, or `memory BUTLER forget ID`",
    )
    client_args(memory)
    memory.add_argument("butler", metavar="BUTLER", help="whose memory")
    memory.add_argument("action", nargs="?", choices=("forget",), help="forget memory ID")
    memory.add_argument("id", nargs="?", type=int, metavar="ID", help="the memory's id")
    memory.add_argument("--search", metavar="Q", help="memories matching Q, best first")
    limit_arg(memory)
    # On every command too (`butlers list --log-level debug`), where they override the
    # defaults above only when given.
    for command in [*commands.choices.values(), *db_commands.choices.values()]:
        _log_options(command, level=argparse.SUPPRESS, log_format=argparse.SUPPRESS)
    return parser


def _log_options(parser: argparse.ArgumentParser, *, level: str, log_format: str) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=logs.LEVELS,
        default=level,
        help="what to log, from DEBUG up (default WARNING, env BUTLERS_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=log_format,
        help="text lines, or one JSON object per line (default text, env BUTLERS_LOG_FORMAT)",
    )


def _parse(argv: Sequence[str], settings: Settings) -> argparse.Namespace:
    """argparse checks the choices of what is typed; the defaults from BUTLERS_LOG_LEVEL and
    BUTLERS_LOG_FORMAT were checked when `settings` were read."""
    return _parser(settings).parse_args(argv)


def _start_logging(args: argparse.Namespace, settings: Settings) -> Redactor:
    """The process's one log stream, redacting the secrets of the environment (and later
    those the loaded configs name: the returned redactor is told them)."""
    from butlers.redact import Redactor, install_log_redaction

    logs.configure_logging(args.log_level, args.log_format)
    redactor = Redactor()
    install_log_redaction(redactor)
    redactor.add(Redactor.from_environment(environ=settings.environ).secrets)
    return redactor


async def cli(argv: Sequence[str], settings: Settings) -> int:
    """Run one command. `settings`: the process's environment, read once by main()."""
    args = _parse(argv, settings)
    redactor = _start_logging(args, settings)
    if args.command == "init":
        from butlers import init_command

        return await init_command.run(args, settings)
    if args.command == "doctor":
        from butlers import doctor

        return await doctor.run(args, settings)
    if args.command == "db":
        return await db_upgrade(args.config_dir, args.names, settings)
    if args.command == "gateway":
        return await gateway_command(args, settings, redactor)
    if args.command in CLIENT_COMMANDS:
        return await client_command(args, settings)
    if args.command == "up":
        return await serve(
            args.config_dir,
            args.only,
            strict=False,
            redactor=redactor,
            settings=settings,
            as_json=args.json,
            ports=PortChoice(offset=args.port_offset),
        )
    return await serve(
        args.config_dir,
        [args.name],
        strict=True,
        redactor=redactor,
        settings=settings,
        ports=PortChoice(port=args.port),
    )


def _install_fast_event_loop() -> None:
    """uvloop where it is installed: measured 216 vs 91 routed calls/s with 16 callers."""
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


def _standard_streams_open() -> None:
    """A command started with stdin, stdout or stderr closed (`butlers doctor <&-`, some
    service managers) would have the event loop's own pipes take those numbers, and uvloop
    aborts (`uv__close: Assertion 'fd > STDERR_FILENO'`, exit 134): each closed one is opened
    on /dev/null first."""
    import os

    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:  # the lowest free number: fd itself, unless a lower one is free
                os.dup2(opened, fd)
                os.close(opened)


def main(argv: Sequence[str] | None = None) -> None:
    _standard_streams_open()
    _install_fast_event_loop()
    try:
        with collector_paused():
            from butlers.settings import Settings

        # The one place the environment is read: a bad value ends here, named, exit 1.
        settings = Settings.from_environ()
        code = asyncio.run(cli(sys.argv[1:] if argv is None else argv, settings))
    except ButlersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:  # before the signal handlers were installed
        code = 130
    except BrokenPipeError:  # `butlers log | head`: the reader left; nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # as a shell reports a command ended by SIGPIPE
    # Nothing is left to free: the interpreter's last collections at exit, over everything the
    # libraries built, took 0.3 s of a gateway's life (measured), so they see none of it.
    gc.freeze()
    sys.exit(code)
