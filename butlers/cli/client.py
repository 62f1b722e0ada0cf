"""The commands that talk to a running switchboard over MCP (`list`, `ask`, `inbox`, `log`,
`retry`, `outbox`, `approvals`, `pairing`, `schedules`, `memory`, `trace`, `call`, ...).

One connection per command, the bearer token from BUTLERS_AUTH_TOKEN; what each prints is in
butlers.cli.render. Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from butlers import __version__, logs
from butlers.cli.process import collector_paused
from butlers.cli.render import (
    answer_failure,
    decision_failure,
    print_answer,
    print_approvals,
    print_butlers,
    print_decision,
    print_discover,
    print_forgotten,
    print_inbox,
    print_memories,
    print_outbox,
    print_paired,
    print_pairing,
    print_reply_retry,
    print_result,
    print_retry,
    print_routing_log,
    print_schedule_deleted,
    print_schedules,
    print_trace,
)
from butlers.errors import CommandError
from butlers.mcp_connection.proof import UNPROVEN_HINT, Unproven, check_holds_token

if TYPE_CHECKING:
    from butlers.settings import Settings

DEFAULT_SWITCHBOARD_URL = "http://127.0.0.1:8100/sse"


@dataclass(frozen=True)
class SwitchboardTarget:
    """Where a client command calls the switchboard (`--url`), with the token it sends
    (BUTLERS_AUTH_TOKEN; never shown)."""

    url: str
    auth_token: str | None = field(default=None, repr=False)


CONNECT_TIMEOUT_S = 10.0


CLIENT_INFO = {"name": "butlers-cli", "version": __version__}


async def call_switchboard(target: SwitchboardTarget, tool: str, arguments: dict[str, Any]) -> Any:
    """One of the switchboard's tools, called and answered; CommandError, in words for the
    user, when the switchboard cannot be reached or the tool refuses.

    An `/sse` URL (the default) goes through our own lean connection (aiohttp): a client
    command then does not import FastMCP, whose import alone takes longer than the whole
    command should (bench/cli_startup.py). Any other URL (`/mcp`) goes through FastMCP's."""
    from butlers.errors import McpCallError

    connection = _connection(target)
    try:
        await check_holds_token(target.url, target.auth_token)
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
        if str(answer).startswith("Unknown tool"):  # a butler's URL, not the switchboard's
            raise CommandError(
                f"{target.url} has no tool {tool!r}: is it the switchboard? (a butler's own URL "
                "answers there too; --url or BUTLERS_SWITCHBOARD_URL names the switchboard's)"
            )
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
    if isinstance(exc, Unproven):  # (the token was not sent: butlers.mcp_connection.proof)
        return f"{exc}: not connected to ({UNPROVEN_HINT})"
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
            "the switchboard's token (a config `butlers init` wrote keeps it in DIR/.env: "
            "set -a; . DIR/.env; set +a)"
        )

    cause = text.removeprefix("Client failed to connect: ")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"--url {url} is not a URL: http://HOST:PORT/sse, as `butlers up` prints it"
    if not parts.path.rstrip("/").endswith(("/sse", "/mcp")):
        return (
            f"cannot reach the switchboard at {url} ({cause}): its MCP endpoint ends in /sse "
            f"(or /mcp): {url.rstrip('/')}/sse"
        )
    return (
        f"cannot reach the switchboard at {url}: is `butlers up` running? ({cause}); one "
        "listening elsewhere (--port-offset, another host): --url or BUTLERS_SWITCHBOARD_URL"
    )


TRACE_ID = re.compile(r"[0-9a-f]{32}")


async def _trace(target: SwitchboardTarget, ref: str, jaeger_ui_url: str) -> dict[str, Any]:
    """The Jaeger link for a trace id, or for the trace of a routing_log row (looked up through
    the switchboard)."""
    ref = ref.strip().lower()
    route = None
    inbox_id = None
    if TRACE_ID.fullmatch(ref):
        trace_id = ref
    elif ref.isdigit():  # an inbox message, as `butlers inbox` numbers them
        inbox_id = int(ref)
        trace_id = await _message_trace(target, inbox_id)
    else:
        try:
            uuid.UUID(ref)
        except ValueError:
            raise CommandError(
                f"{ref!r} is neither a trace id (32 hex characters), an inbox message's "
                "number nor a routing_log id (a UUID)"
            ) from None
        route = await call_switchboard(target, "routing_log_entry", {"id": ref})
        trace_id = route.get("trace_id")
        if not trace_id:
            raise CommandError(f"routing_log row {ref} has no trace id")
        inbox_id = route.get("inbox_id")
    from butlers.switchboard.operator import jaeger_url

    return {
        "trace_id": trace_id,
        "url": jaeger_url(trace_id, jaeger_ui_url),
        "inbox_id": inbox_id,
        "route": route,
    }


async def _message_trace(target: SwitchboardTarget, inbox_id: int) -> str:
    """The trace id of inbox message `inbox_id` (it was looked for among the newest 500:
    an older one was "not found")."""
    rows = await call_switchboard(target, "inbox_list", {"limit": 1, "before": inbox_id + 1})
    row = next((r for r in rows if r.get("id") == inbox_id), None)
    if row is None:
        raise CommandError(f"no inbox message {inbox_id} (`butlers inbox` lists them)")
    if not row.get("trace_id"):
        raise CommandError(f"inbox message {inbox_id} has no trace id")
    return str(row["trace_id"])


async def client_command(args: argparse.Namespace, settings: Settings, _redactor: object) -> int:
    """Ask the switchboard what `args.command` asks (CLIENT_CALLS), print its answer: the
    command's table, or with `--json` the answer itself."""
    from butlers.settings import reveal

    target = SwitchboardTarget(args.url, reveal(settings.auth_token))
    result, show = await CLIENT_CALLS[args.command](target, args, settings)
    if not args.json:
        show(result)
        return 0
    print(json.dumps(result, ensure_ascii=False))
    # A failure the table would have said (exit 1) is the same failure in JSON: a script
    # reads the exit status, the answer stays on stdout.
    if (failed := FAILURES.get(show)) is not None and (why := failed(result)) is not None:
        raise CommandError(why)
    return 0


# What a client command asks and how its answer is printed: (the answer, its printer).
Asked = tuple[Any, Callable[[Any], None]]
# The printers that end a command with exit 1, and how they tell (for --json as well).
FAILURES: dict[Callable[[Any], None], Callable[[Any], str | None]] = {
    print_answer: answer_failure,
    print_decision: decision_failure,
}


async def _trace_command(target: SwitchboardTarget, args: Any, settings: Settings) -> Asked:
    return await _trace(target, args.ref, settings.jaeger_ui_url), print_trace


async def _list(target: SwitchboardTarget, _args: Any, _settings: Settings) -> Asked:
    return await call_switchboard(target, "list_butlers", {}), print_butlers


async def _discover(target: SwitchboardTarget, _args: Any, _settings: Settings) -> Asked:
    return await call_switchboard(target, "discover", {}), print_discover


async def _ask(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    return await call_switchboard(target, "ask", {"text": args.text}), print_answer


async def _inbox(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    asked = paged({"status": args.status, "limit": args.limit}, args.before)
    rows = await call_switchboard(target, "inbox_list", asked)
    return rows, functools.partial(print_inbox, status=args.status, limit=args.limit)


def paged(asked: dict[str, Any], before: int | str | None) -> dict[str, Any]:
    """A listing's arguments, with `before` when a page was asked for (a switchboard of an
    older build refuses arguments it does not know: only what was given is sent)."""
    return asked if before is None else {**asked, "before": before}


async def _routing_log(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    asked = paged({"butler": args.butler, "limit": args.limit}, args.before)
    rows = await call_switchboard(target, "routing_log_list", asked)
    return rows, functools.partial(print_routing_log, butler=args.butler, limit=args.limit)


async def _retry(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    return await call_switchboard(target, "inbox_retry", {"id": args.id}), print_retry


async def _outbox(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    if args.action == "retry":
        if args.id is None:
            raise CommandError(
                "which outbox row? `butlers outbox retry ID` (ids: `butlers outbox`)"
            )
        return await call_switchboard(target, "outbox_retry", {"id": args.id}), print_reply_retry
    asked = paged({"status": args.status, "limit": args.limit}, args.before)
    rows = await call_switchboard(target, "outbox_list", asked)
    return rows, functools.partial(print_outbox, status=args.status, limit=args.limit)


async def _approvals(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    if args.action is None:
        asked = paged({"status": args.status, "limit": args.limit}, args.before)
        rows = await call_switchboard(target, "approvals_list", asked)
        return rows, functools.partial(print_approvals, status=args.status, limit=args.limit)
    if args.id is None:
        raise CommandError(f"which approval? `butlers approvals {args.action} ID`")
    decision = {"id": args.id, "decision": args.action}
    return await call_switchboard(target, "approval_decide", decision), print_decision


async def _pairing_command(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    result = await _pairing(target, args.action, args.values)
    return result, print_pairing if args.action is None else print_paired


async def _schedules_command(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    if args.action == "delete":
        if args.owner is None or args.name is None:
            raise CommandError(
                "which schedule? `butlers schedules delete BUTLER NAME` (`butlers schedules` "
                "lists them)"
            )
        deleted = await _on_butler(target, args.owner, "schedule_delete", {"name": args.name})
        return {"butler": args.owner, **deleted}, print_schedule_deleted
    if args.owner is not None:
        raise CommandError(
            f"`butlers schedules` lists; for one butler's: --butler {args.owner} (or "
            "`butlers schedules delete BUTLER NAME`)"
        )
    return await _schedules(target, args.butler), print_schedules


async def _memory_command(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    result = await _memory(target, args)
    if args.action is not None:
        return result, print_forgotten
    # A search is ranked, not paged: its page has no "older ones".
    return result, functools.partial(print_memories, limit=None if args.search else args.limit)


async def _call(target: SwitchboardTarget, args: Any, _settings: Settings) -> Asked:
    try:
        route_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        raise CommandError(
            f'ARGS must be a JSON object such as \'{{"prompt": "hi"}}\': {exc}'
        ) from exc
    if not isinstance(route_args, dict):
        raise CommandError(f"ARGS must be a JSON object, got {type(route_args).__name__}")
    asked = {"butler_name": args.butler, "tool_name": args.tool, "args": route_args}
    return await call_switchboard(target, "route", asked), print_result


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
        return await call_switchboard(target, tool, arguments)
    return await call_switchboard(
        target, "route", {"butler_name": butler, "tool_name": tool, "args": arguments}
    )


async def _switchboard_name(target: SwitchboardTarget) -> str | None:
    status = await call_switchboard(target, "status", {})
    return status.get("name") if isinstance(status, dict) else None


STALE = (  # as route says it
    "stale: the last discover did not find it in the config directory; restore its directory "
    "(or fix its butler.toml) and run `butlers discover`"
)


async def _schedules(target: SwitchboardTarget, only: str | None) -> list[dict[str, Any]]:
    """Every butler's schedules (or `only`'s), each row with its butler; a butler that cannot
    be asked is a row saying why, not the end of the listing."""
    registry = await call_switchboard(target, "list_butlers", {})
    own = await _switchboard_name(target)
    names = [own or "switchboard"] + [b["name"] for b in registry if b["name"] != own]
    # A stale one is a row saying so, not asked: route would refuse it, and log that.
    stale = {b["name"] for b in registry if b.get("stale")}
    if only is not None:
        if only not in names:
            raise CommandError(f"butler {only!r} not found (butlers list shows them)")
        names = [only]

    async def of(name: str) -> list[dict[str, Any]]:
        if name in stale:
            return [{"butler": name, "error": STALE}]
        try:
            rows = await _on_butler(target, name, "schedule_list", {}, switchboard=own)
        except CommandError as exc:
            return [{"butler": name, "error": str(exc)}]
        return [{"butler": name, **row} for row in rows]

    found = await asyncio.gather(*(of(name) for name in names))
    return [row for rows in found for row in rows]


async def _memory(target: SwitchboardTarget, args: argparse.Namespace) -> Any:
    if args.action == "forget":
        if args.id is None:
            raise CommandError(f"which memory? `butlers memory {args.butler} forget ID`")
        return await _on_butler(target, args.butler, "memory_forget", {"id": args.id})
    # Checked here, as the switchboard's own lists check theirs: a butler's tool would refuse
    # it in pydantic's words, and the route be logged as failed.
    most = MEMORY_SEARCH_LIMIT if args.search else MEMORY_LIST_LIMIT
    if not 1 <= args.limit <= most:
        with_search = " with --search" if args.search else ""
        raise CommandError(f"--limit must be 1..{most}{with_search}, got {args.limit}")
    if args.search:
        if args.before is not None:
            raise CommandError("--before pages `butlers memory BUTLER`; a --search is ranked")
        return await _on_butler(
            target, args.butler, "memory_search", {"query": args.search, "limit": args.limit}
        )
    asked = paged({"limit": args.limit}, args.before)
    return await _on_butler(target, args.butler, "memory_list", asked)


MEMORY_LIST_LIMIT, MEMORY_SEARCH_LIMIT = 500, 100  # (memory_list's and memory_search's own)


async def _pairing(target: SwitchboardTarget, action: str | None, values: list[str]) -> Any:
    """`butlers pairing [approve CODE | deny CODE | revoke CHANNEL SENDER]`."""
    wanted = {None: [], "approve": ["CODE"], "deny": ["CODE"], "revoke": ["CHANNEL", "SENDER"]}
    if action in ("approve", "deny") and not values:
        raise CommandError(
            f"which code? `butlers pairing {action} CODE`, with the code the bot or the mail "
            "gave the sender (`butlers pairing` lists those waiting)"
        )
    if len(values) != len(wanted[action]):
        usage = " ".join(["butlers pairing", *([action] if action else []), *wanted[action]])
        count = len(wanted[action])
        raise CommandError(
            f"`{usage}`: expected {count} value{'' if count == 1 else 's'}, got {len(values)}"
        )
    if action is None:
        return await call_switchboard(target, "pairing_list", {})
    if action == "revoke":
        channel, sender = values
        return await call_switchboard(
            target, "pairing_revoke", {"channel": channel, "sender": sender}
        )
    return await call_switchboard(target, "pairing_decide", {"code": values[0], "decision": action})


CLIENT_CALLS: dict[str, Callable[[SwitchboardTarget, Any, Settings], Awaitable[Asked]]] = {
    "list": _list,
    "discover": _discover,
    "route": _call,
    "ask": _ask,
    "trace": _trace_command,
    "inbox": _inbox,
    "log": _routing_log,
    "retry": _retry,
    "outbox": _outbox,
    "approvals": _approvals,
    "pairing": _pairing_command,
    "schedules": _schedules_command,
    "memory": _memory_command,
}
