"""The gateway: one MCP server for a host, with one suite tool per child and activate mode.

A host sees `<child>_suite` tools (`introspect` lists a child's tools in a few tokens, `call`
runs one) plus `gateway_activate` / `gateway_deactivate` / `gateway_status`. Activating a child
puts its own tools into the tool list and tells every connected host
(`notifications/tools/list_changed`, which FastMCP does not send by itself); deactivating takes
them out again while the child stays warm.

The mode (gateway.toml `mode`, `--mode`) says what the list holds: `suite` (suite tools, and an
activated child's tools beside its suite), `activate` (mcpflip's promise: only the three
`gateway_*` tools until something is activated, no suite tools) or `both` (suite tools, and an
activated child's own tools instead of its suite). `search` lists no suite and no child
tool: `gateway_search` finds tools across every child (BM25, butlers.gateway.search),
`gateway_describe` gives one's schema and `gateway_call` runs it through the suite call's very
path (allow/deny, timeouts, redaction, tracing). In every mode the children's prompts and
resources pass through (butlers.gateway.passthrough), and a child asking for roots is given
the gateway's directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import sys
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import mcp_types
from fastmcp import FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import Tool, ToolResult
from mcp_types import LoggingLevel

from butlers import __version__
from butlers.errors import McpCallError
from butlers.gateway.children import ChildSpec
from butlers.gateway.clients import Child, RemoteChild, StdioChild
from butlers.gateway.config import GatewayConfig, SettingsText
from butlers.gateway.control import (
    CALL_SCHEMA,
    CONTROL_DESCRIPTIONS,
    CONTROL_TOOLS,
    INSTRUCTIONS,
    NAME_SCHEMA,
    SEARCH_LIMIT_MAX,
    SEARCH_SCHEMA,
    SEARCH_TOOLS,
    TOOL_NAME_SCHEMA,
    ControlTool,
    Mode,
    name_argument,
)
from butlers.gateway.hosts import HostCall, HostTracker, current_host
from butlers.gateway.passthrough import Kind, PassThrough
from butlers.gateway.reaper import Watchdog
from butlers.gateway.redaction import redact_arguments
from butlers.gateway.search import Entry, SearchIndex
from butlers.gateway.summary import summarize
from butlers.gateway.wrapper import (
    NATURAL_LANGUAGE,
    QUERY_SCHEMA,
    ClaudeWrapper,
    Instructions,
    WrapperFailed,
    instructions_for,
    load_descriptions,
)
from butlers.tasks import Coalesced
from butlers.text import printable
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from butlers.redact import Redactor

logger = logging.getLogger(__name__)

State = Literal["idle", "warming", "ready", "active", "error"]
Verbosity = Literal["summary", "full", "redacted"]
VERBOSITIES: tuple[Verbosity, ...] = ("summary", "full", "redacted")
# How long a search waits for servers still starting before it answers from the others,
# once per start (a call of a tool it does not find waits for them as long again: it may be
# theirs; a call of a tool it finds waits for none). The first search of a `--lazy` gateway
# starts every server: npm's take ~1 s.
SEARCH_WAIT_S = 8.0
# A child that failed before it ever listed a tool (a butler down when the gateway started) is
# tried again by a search or search-mode call, at first this often: it had no tool to call, so
# no call restarted it, and it stayed unknown for the host's whole session (a walkthrough).
# Each failure in a row doubles the wait, up to SEARCH_RETRY_MAX_S: a server that hangs at
# start held up a search every 74 s for good (a walkthrough).
SEARCH_RETRY_S = 10.0
SEARCH_RETRY_MAX_S = 600.0


def search_retry_after_s(failures: int) -> float:
    """How long after its last failed start a search tries a child again."""
    return min(SEARCH_RETRY_S * 2 ** max(failures - 1, 0), SEARCH_RETRY_MAX_S)


# A child's tool list is read again at most this often, however many list_changed it sends.
REFRESH_EVERY_S = 0.5

SUITE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["introspect", "call"]},
        "subtool": {"type": "string", "description": "the child's tool, for action 'call'"},
        "args": {"type": "object", "description": "its arguments, for action 'call'"},
        "verbosity": {
            "type": "string",
            "enum": list(VERBOSITIES),
            "description": "for introspect: full descriptions, summaries or none",
        },
    },
    "required": ["action"],
}


@dataclass
class Slot:
    """One child and what the gateway knows about it."""

    spec: ChildSpec
    child: Child
    suite_name: str
    description: str
    state: State = "idle"
    error: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the child lists them
    injected: list[str] = field(default_factory=list)  # tool names added by activate
    suite_tool: Tool | None = None  # listed unless the mode hides it
    # Hosts with a call on it running, by id (FastMCP contexts are not hashable).
    callers: dict[int, HostCall] = field(default_factory=dict)
    # Its Claude wrapper's instructions (butlers.gateway.wrapper); None: no natural_language.
    instructions: Instructions | None = None
    # The start under way (`Gateway.warm`), which a call made meanwhile waits for.
    starting: asyncio.Future[None] | None = None
    # A search already waited SEARCH_WAIT_S for this start: the next ones answer without it.
    searched_while_starting: bool = False
    # Its tool list read again after a list_changed (`Gateway._refresh_tools`), coalesced.
    relisting: Coalesced | None = None
    failed_at: float | None = None  # (loop time) its last start that failed
    failures: int = 0  # its starts that failed in a row


def suite_description(spec: ChildSpec, config: GatewayConfig) -> str:
    configured = config.suite(spec.name).description
    if configured:
        return configured
    if spec.switchboard_description:
        return spec.switchboard_description
    return f"Use this tool for {spec.description or spec.name}. Actions: 'introspect' | 'call'"


def result_of(raw: dict[str, Any]) -> ToolResult:
    """The child's CallToolResult, passed on unchanged."""
    parsed = mcp_types.CallToolResult.model_validate(raw)
    return ToolResult(
        content=parsed.content,
        structured_content=parsed.structured_content,
        meta=parsed.meta,
        is_error=bool(parsed.is_error),
    )


class _SuiteTool(Tool):
    _gateway: Gateway
    _slot: Slot

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        with self._gateway.span("gateway.suite_call", self._slot, arguments):
            return await self._gateway.suite_call(self._slot, arguments)


class _ChildTool(Tool):
    _gateway: Gateway
    _slot: Slot
    _child_tool: str

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        with self._gateway.span(
            "gateway.call", self._slot, arguments, {"subtool": self._child_tool}
        ):
            return await self._gateway.direct_call(self._slot, self._child_tool, arguments)


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        specs: Sequence[ChildSpec],
        *,
        environ: Mapping[str, str],
        auth_token: str | None = None,
        mode: Mode | None = None,
        tracer: Tracer | None = None,
        cli_env: Mapping[str, str] | None = None,
        directory: Path | None = None,
        redactor: Redactor | None = None,
    ) -> None:
        self.config = config
        # The process's secrets and the servers' (butlers.gateway.redaction): out of what the
        # gateway says to hosts, and of its children's stderr it relays. None: nothing known.
        self.redactor = redactor
        # The one root a child asking `roots/list` is given (`--dir`); None: no roots offered.
        self.roots = (
            None
            if directory is None
            else [{"uri": directory.resolve().as_uri(), "name": directory.resolve().name}]
        )
        self.mode: Mode = mode or config.mode
        self.environ = environ  # stdio children get its base variables, never our secrets
        self.auth_token = auth_token  # for butlers only
        self.tracer = tracer  # None: no spans (tracing is off)
        self.wrapper = ClaudeWrapper(config, environ=environ, cli_env=cli_env, tracer=tracer)
        self._descriptions = load_descriptions(config.base_dir)
        # serverInfo names our version, not FastMCP's (its default).
        self.mcp = FastMCP(
            "butlers-gateway", version=__version__, instructions=INSTRUCTIONS[self.mode]
        )
        self._tracker = HostTracker()
        self.mcp.add_middleware(self._tracker)
        self.mcp.add_middleware(_RedactedRefusals(self.redact))
        self.passthrough = PassThrough(self)
        self.mcp.add_provider(self.passthrough)
        self.slots: dict[str, Slot] = {}
        # Servers a reload holds until a person approves them (butlers.gateway.reload): name
        # -> where declared and how to let it in. Listed by gateway_status; never started.
        self.pending: dict[str, str] = {}
        # Why there are no butlers behind it, when the switchboard's registry could not be
        # read at start (listed by gateway_status: a host hides the gateway's stderr).
        self.butlers_missing: str | None = None
        # Why the gateway runs its settings as approved, not as the file now says
        # (butlers.gateway.approvals); listed by gateway_status.
        self.settings_note: str | None = None
        # The settings file as it was at the start (a later edit is said to wait for one), and
        # the servers the start held pending (the reload warns of them no more).
        self.started_settings: SettingsText | None = None
        self.held_at_start: tuple[ChildSpec, ...] = ()
        self.watchdog = Watchdog()  # the children's groups, should we be killed
        # Warm-ups running (dropped as each ends: a reload adds one per child it starts).
        self._warming: set[asyncio.Task[None]] = set()
        self._notify_tasks: set[asyncio.Task[None]] = set()
        self._closed = False  # close() began: no task of the gateway's starts any more
        self._search_index: SearchIndex | None = None  # search mode; rebuilt when stale
        for spec in specs:
            self._add(spec, auth_token)
        self._register_control_tools()
        # Suite and control tools: an injected tool of the same name gets the child's prefix.
        self._fixed_names: set[str] = (
            {s.suite_name for s in self.slots.values()} | set(CONTROL_TOOLS) | set(SEARCH_TOOLS)
        )

    # -- children -------------------------------------------------------------------------

    def _add(self, spec: ChildSpec, auth_token: str | None) -> None:
        if spec.name in self.slots:
            logger.warning(
                "child %r from %s ignored: the name is taken by %s",
                spec.name,
                spec.source,
                self.slots[spec.name].spec.source,
            )
            return
        spawn_s, rpc_s = self.config.child_spawn_ms / 1000, self.config.rpc_ms / 1000
        child: Child
        if spec.url is not None:
            child = RemoteChild(
                spec,
                spawn_timeout_s=spawn_s,
                rpc_timeout_s=rpc_s,
                auth_token=auth_token if spec.kind == "butler" else None,
                on_tools_changed=self._child_tools_changed,
                on_lists_changed=self._child_lists_changed,
                roots=self.roots,
            )
        else:
            child = StdioChild(
                spec,
                environ=self.environ,
                spawn_timeout_s=spawn_s,
                rpc_timeout_s=rpc_s,
                on_exit=self._child_exited,
                on_tools_changed=self._child_tools_changed,
                on_lists_changed=self._child_lists_changed,
                roots=self.roots,
                watchdog=self.watchdog,
                pass_env=self.config.suite(spec.name).pass_env,
                idle_timeout_s=self.config.suite(spec.name).idle_timeout_s,
                initialize_timeout_s=rpc_s,  # a cold `npx -y` download is not a hung child
                # Its stderr to ours as it was, each line naming it (several children
                # share the host's log), and its last lines kept for gateway_status.
                on_stderr=functools.partial(_relay_stderr, spec.name, self.redact),
            )
        suite_name = self.config.suite(spec.name).suite_name or f"{spec.name}_suite"
        slot = Slot(spec, child, suite_name, suite_description(spec, self.config))
        child.on_log = functools.partial(self._forward_log, slot)
        slot.instructions = instructions_for(spec, self.config, self._descriptions)
        self.slots[spec.name] = slot
        tool = _SuiteTool(name=suite_name, description=slot.description, parameters=SUITE_SCHEMA)
        tool._gateway, tool._slot = self, slot
        slot.suite_tool = tool
        if self.mode not in ("activate", "search"):
            self.mcp.add_tool(tool)

    async def add_child(self, spec: ChildSpec, *, warm: bool = True) -> None:
        """A child declared while the gateway runs (hot reload): added as at start, started
        unless the gateway is lazy (`warm=False`), and the hosts told."""
        if spec.name in self.slots:
            raise ValueError(f"child {spec.name!r} is already behind the gateway")
        self._add(spec, self.auth_token)
        slot = self.slots[spec.name]
        self._fixed_names.add(slot.suite_name)
        if warm:
            self._start_warm(slot)
        if self.mode not in ("activate", "search"):
            await self.notify_tools_changed()

    async def restart_child(self, spec: ChildSpec, *, warm: bool = True) -> None:
        """A child declared differently (hot reload): stopped, then started as `spec`. One
        the host had activated is activated again once it runs (its tools come back into the
        list), rather than coming back deactivated."""
        was_active = bool(self.slots[spec.name].injected) if spec.name in self.slots else False
        await self.remove_child(spec.name)
        await self.add_child(spec, warm=warm and not was_active)
        if was_active:
            self._spawn(self._activate_again(self.slots[spec.name]))

    async def _activate_again(self, slot: Slot) -> None:
        try:
            await self._activate_slot(slot)
        except ToolRefusal as exc:  # it does not start now: the host activates it when it does
            logger.warning("%s", exc, extra={"action": "child_reactivate_failed"})

    async def remove_child(self, name: str) -> None:
        """A child no longer declared (hot reload): its tools leave the hosts' lists (and the
        hosts are told), then the child is stopped. A call on it that is running ends with
        the child's connection."""
        slot = self.slots.pop(name, None)
        if slot is None:
            return
        listed = bool(slot.injected) or self.mode not in ("activate", "search")
        for tool in slot.injected:
            with contextlib.suppress(Exception):
                self.mcp.local_provider.remove_tool(tool)
        slot.injected.clear()
        self._hide_suite(slot)
        self._fixed_names.discard(slot.suite_name)
        self.passthrough.drop(name)
        offered = self.passthrough.offers(slot) if slot.state in ("ready", "active") else ()
        await self.notify_changed(tools=listed, kinds=offered)
        await slot.child.close()

    async def warm_all(self) -> None:
        """Start every child at once; one broken or slow child never holds up the others."""
        await asyncio.gather(*(self.warm(slot) for slot in self.slots.values()))

    def start_warming(self) -> None:
        for slot in self.slots.values():
            self._start_warm(slot)

    def _start_warm(self, slot: Slot) -> asyncio.Task[None]:
        """Warm `slot` in the background; the task leaves `_warming` when it ends, its
        failure logged as any gateway task's (close() cancels those still running)."""
        task = asyncio.create_task(self.warm(slot), name=f"gateway:warm:{slot.spec.name}")
        self._warming.add(task)
        task.add_done_callback(self._warmed)
        return task

    def _warmed(self, task: asyncio.Task[None]) -> None:
        self._warming.discard(task)
        self._done(task)

    async def warm(self, slot: Slot) -> None:
        """Start the child and read its tools, once at a time: a call made while it starts
        (the prewarm) waits for that start and takes its outcome, rather than starting it
        again after it (a server that never answers cost a call two whole timeouts)."""
        if slot.state in ("ready", "active") and slot.child.running():
            return
        if slot.starting is not None:
            await asyncio.shield(slot.starting)
            return
        slot.starting = asyncio.get_running_loop().create_future()
        try:
            await self._start(slot)
        finally:
            starting, slot.starting = slot.starting, None
            starting.set_result(None)

    async def _start(self, slot: Slot) -> None:
        was_up = slot.state in ("ready", "active")
        slot.state, slot.error = "warming", None
        slot.searched_while_starting = False
        try:
            slot.tools = await slot.child.list_tools()
        except McpCallError as exc:
            slot.state, slot.error = "error", str(exc)
            slot.failed_at = asyncio.get_running_loop().time()
            slot.failures += 1
            if slot.child.closed:  # removed (reload) or the gateway closing: not a failure
                logger.debug("%s", exc, extra={"action": "child_removed"})
            else:
                logger.warning("%s", exc, extra={"action": "child_failed"})
            return
        except asyncio.CancelledError:
            if slot.state == "warming":  # not started after all: a later use tries again
                slot.state, slot.error = "idle", None
            raise
        slot.state = "active" if slot.injected else "ready"
        slot.failures = 0
        if not was_up:
            self._came_up(slot)

    def _came_up(self, slot: Slot) -> None:
        """A child started (or is back): its prompts and resources join the hosts' lists."""
        offered = self.passthrough.offers(slot)
        if offered:
            self._spawn(self.notify_changed(kinds=offered))

    def _child_exited(self, child: StdioChild, reason: str) -> None:
        slot = self.slots.get(child.name)
        if slot is not None:
            self._lost(slot, reason)

    def _lost(self, slot: Slot, reason: str) -> None:
        """A child died: it is in error until it restarts, and its injected tools go. A child
        the gateway removed (a reload) is not lost: its call failing is what removal does."""
        if self.slots.get(slot.spec.name) is not slot:
            return
        if slot.state == "error" and slot.error == reason:
            return  # heard already (its exit, then the call it broke, say the same)
        was_up = slot.state in ("ready", "active")
        slot.state, slot.error = "error", reason
        logger.warning("%s", reason, extra={"action": "child_lost"})
        offered = self.passthrough.offers(slot) if was_up else ()
        had_tools = bool(slot.injected)
        if had_tools:
            self._remove_tools(slot)
        if had_tools or offered:
            self._spawn(self.notify_changed(tools=had_tools, kinds=offered))

    # -- suite tools ----------------------------------------------------------------------

    async def suite_call(self, slot: Slot, arguments: dict[str, Any]) -> ToolResult:
        action = arguments.get("action")
        suite = slot.suite_name
        if action == "introspect":
            verbosity = arguments.get("verbosity")
            if verbosity is not None and verbosity not in VERBOSITIES:
                raise ToolRefusal(
                    f"suite {suite!r}: verbosity must be one of {', '.join(VERBOSITIES)}, "
                    f"got {verbosity!r}"
                )
            tools = await self.introspect(slot, verbosity)
            return ToolResult(structured_content={"tools": tools})
        if action != "call":
            raise ToolRefusal(
                f"suite {suite!r}: action must be 'introspect' or 'call', got {action!r}"
            )
        subtool = arguments.get("subtool")
        if not isinstance(subtool, str) or not subtool:
            raise ToolRefusal(f"suite {suite!r}: action 'call' needs 'subtool' (see 'introspect')")
        args = arguments.get("args") or {}
        if not isinstance(args, dict):
            raise ToolRefusal(f"suite {suite!r}: 'args' must be an object")
        if not self._exposes(slot, subtool):
            raise ToolRefusal(f"Subtool {subtool!r} not allowed by suite {suite!r}")
        tools = await self._tools(slot)
        if subtool == NATURAL_LANGUAGE and self._wraps(slot, tools):
            return await self.natural_language(slot, args)
        if subtool not in {t["name"] for t in tools}:
            known = ", ".join(t["name"] for t in self._exposed(slot, tools)) or "none"
            raise ToolRefusal(f"Subtool {subtool!r} not found in suite {suite!r} (tools: {known})")
        return await self.direct_call(slot, subtool, args)

    async def introspect(
        self, slot: Slot, verbosity: Verbosity | None = None
    ) -> list[dict[str, Any]]:
        """The child's exposed tools, as `verbosity` (else `[introspection] mode`) says."""
        mode = verbosity or self.config.introspection_mode
        limit = self._summary_limit(slot)
        listed = []
        for tool in self._exposed(slot, await self._tools(slot)):
            entry: dict[str, Any] = {"name": tool["name"]}
            if mode == "summary":
                entry["summary"] = summarize(tool.get("description"), limit)
            elif mode == "full":
                entry["summary"] = tool.get("description") or ""
            entry["inputSchema"] = tool.get("inputSchema") or {"type": "object"}
            listed.append(entry)
        wrapper = self._wrapper_tool(slot)
        if wrapper is not None and self._exposes(slot, NATURAL_LANGUAGE):
            entry = {"name": NATURAL_LANGUAGE}
            if mode != "redacted":
                entry["summary"] = wrapper["description"]
            listed.append(entry | {"inputSchema": wrapper["inputSchema"]})
        return listed

    def _summary_limit(self, slot: Slot) -> int:
        return self.config.suite(slot.spec.name).summary_max_chars or self.config.summary_max_chars

    def _exposes(self, slot: Slot, subtool: str) -> bool:
        return self.config.suite(slot.spec.name).exposes(subtool)

    def _exposed(self, slot: Slot, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [t for t in tools if self._exposes(slot, t["name"])]

    async def _tools(self, slot: Slot) -> list[dict[str, Any]]:
        if slot.state not in ("ready", "active") or not slot.child.running():
            await self.warm(slot)
        if slot.state == "error":
            raise ToolRefusal(
                slot.error or f"child {slot.spec.name!r} is not available",
                log_level=logging.WARNING,
            )
        return slot.tools

    async def direct_call(self, slot: Slot, tool: str, arguments: dict[str, Any]) -> ToolResult:
        if tool == NATURAL_LANGUAGE and self._wraps(slot, slot.tools):
            return await self.natural_language(slot, arguments)
        was_running = slot.child.running()
        host = current_host()
        progress = None
        if host is not None:
            slot.callers[id(host)] = host
            progress = functools.partial(self._forward_progress, host)
        try:
            raw = await slot.child.call_tool(tool, arguments, progress=progress)
        except McpCallError as exc:
            if not slot.child.running():  # gone (a remote child tells us only now)
                self._lost(slot, str(exc))
            raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
        finally:
            if host is not None:
                slot.callers.pop(id(host), None)
        if not was_running and slot.state == "error":  # restarted by this call: it is back
            slot.state, slot.error = ("active" if slot.injected else "ready"), None
            self._came_up(slot)
        size, cap = result_size(raw), self.config.max_result_bytes
        if size > cap:
            raise ToolRefusal(
                f"{slot.spec.name}/{tool}: its result holds {size} bytes, more than "
                f"max_result_bytes ({cap}) in gateway.toml: not passed on",
                log_level=logging.WARNING,
            )
        return result_of(raw)

    # -- spans ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        slot: Slot,
        arguments: dict[str, Any] | None = None,
        attributes: dict[str, str] | None = None,
    ) -> Iterator[None]:
        """A span around one suite call, call, (de)activation, prompts/get or resources/read
        when tracing is on: in the host's trace when its request carried one (FastMCP puts
        `_meta.traceparent` in the context). Arguments go in with the suite's `redact` keys
        masked; a resource's contents never do (only its URI)."""
        if self.tracer is None:
            yield
            return
        recorded = {"child": slot.spec.name, "suite": slot.suite_name, **(attributes or {})}
        if arguments is not None:
            keys = frozenset(self.config.suite(slot.spec.name).redact)
            shown = redact_arguments(arguments, keys)
            recorded["arguments"] = json.dumps(shown, ensure_ascii=False, default=str)
            for key in ("action", "subtool"):
                if isinstance(arguments.get(key), str):
                    recorded[key] = arguments[key]
        with self.tracer.start_as_current_span(name, attributes=recorded):
            yield

    # -- what children say on their own ---------------------------------------------------

    def _forward_progress(self, host: HostCall, params: dict[str, Any]) -> None:
        """A child's progress on a call, to the host that made it (under the host's own
        progress token, which FastMCP's context holds; nothing if it asked for none)."""
        progress = params.get("progress")
        if isinstance(progress, int | float):
            total = params.get("total")
            message = params.get("message")
            self._spawn(
                host.context.report_progress(
                    progress,
                    total if isinstance(total, int | float) else None,
                    message if isinstance(message, str) else None,
                ),
                host.variables,
            )

    def _forward_log(self, slot: Slot, params: dict[str, Any]) -> None:
        """A child's log message, to each host with a call on it running."""
        data = params.get("data")
        text = data if isinstance(data, str) else json.dumps(data)
        level: LoggingLevel = "info"
        for known in get_args(LoggingLevel):
            if params.get("level") == known:
                level = known
        for host in list(slot.callers.values()):
            self._spawn(
                host.context.log(text, level=level, logger_name=slot.spec.name), host.variables
            )

    def _child_tools_changed(self, name: str) -> None:
        slot = self.slots.get(name)
        if slot is None or slot.state not in ("ready", "active"):
            return
        if slot.relisting is None:
            slot.relisting = Coalesced(lambda: self._refresh_tools(slot), REFRESH_EVERY_S)
        if (run := slot.relisting.request()) is not None:  # else: once more after this one
            self._spawn(run)

    def _child_lists_changed(self, name: str, kind: str) -> None:
        """A child's prompts or resources changed: read again when next asked, and every
        host told (FastMCP does not send list_changed by itself)."""
        slot = self.slots.get(name)
        if slot is None or kind not in ("prompts", "resources"):
            return
        changed: Kind = "prompts" if kind == "prompts" else "resources"
        self.passthrough.forget(name, changed)
        if slot.state in ("ready", "active"):
            self._spawn(self.notify_changed(kinds=(changed,)))

    async def _refresh_tools(self, slot: Slot) -> None:
        """The child's tool list changed: read it again; if the child is active and its
        tools did change, they are replaced in the hosts' lists and the hosts told. Notices
        that come while it reads make one more reading, at most one every REFRESH_EVERY_S
        (butlers.tasks.Coalesced): a child that sent 3000 in 30 s was listed 3000 times, and
        the hosts told 3000 times (a walkthrough)."""
        try:
            tools = await slot.child.list_tools()
        except McpCallError as exc:
            logger.warning("%s", exc, extra={"action": "child_tools_refresh_failed"})
            return
        changed, slot.tools = tools != slot.tools, tools
        if changed and slot.injected:
            for name in slot.injected:
                with contextlib.suppress(Exception):
                    self.mcp.local_provider.remove_tool(name)
            slot.injected.clear()
            self._inject_tools(slot)
            await self.notify_tools_changed()

    def _spawn(
        self, coro: Coroutine[Any, Any, None], variables: contextvars.Context | None = None
    ) -> None:
        """A task of the gateway's (closed with it); `variables`: a host request's context
        variables, where FastMCP finds the request a progress or log message belongs to.
        Once the gateway is closing, `coro` is dropped unrun (a child's notification late)."""
        if self._closed:
            coro.close()
            return
        task = asyncio.create_task(coro, context=variables)
        self._notify_tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._notify_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "gateway task failed", exc_info=task.exception(), extra={"action": "task_failed"}
            )

    # -- the Claude wrapper ---------------------------------------------------------------

    def _wraps(self, slot: Slot, tools: list[dict[str, Any]]) -> bool:
        """Whether `natural_language` is the wrapper's: the child has instructions and no
        tool of that name of its own (its own tool wins)."""
        return slot.instructions is not None and NATURAL_LANGUAGE not in {t["name"] for t in tools}

    def _wrapper_tool(self, slot: Slot) -> dict[str, Any] | None:
        """The `natural_language` tool definition a wrapped child offers, as a child lists
        its tools."""
        if not self._wraps(slot, slot.tools):
            return None
        return {
            "name": NATURAL_LANGUAGE,
            "description": f"Ask {slot.spec.name} in plain words: a Claude session with its "
            "tools answers, and lists the calls it made.",
            "inputSchema": QUERY_SCHEMA,
        }

    def wrapper_load_chars(self, slot: Slot) -> int | None:
        """What each `natural_language` session loads besides the query: its instructions
        and the definitions of the child's tools it may use (paid by that session, not by the
        host). None: the child is not wrapped."""
        if slot.instructions is None or not self._wraps(slot, slot.tools):
            return None
        exposed = self._exposed(slot, slot.tools)
        return len(slot.instructions.text) + sum(len(json.dumps(t)) for t in exposed)

    async def natural_language(self, slot: Slot, arguments: dict[str, Any]) -> ToolResult:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolRefusal(
                f"suite {slot.suite_name!r}: natural_language needs 'query', a non-empty string"
            )
        instructions = slot.instructions
        if instructions is None:  # (only wrapped children get here)
            raise ToolRefusal(f"suite {slot.suite_name!r} has no natural_language")
        names = [t["name"] for t in slot.tools]
        try:
            answer = await self.wrapper.ask(
                slot.spec,
                instructions,
                query,
                allowed=[n for n in names if self._exposes(slot, n)],
                hidden=[n for n in names if not self._exposes(slot, n)],
                auth_token=self.auth_token if slot.spec.kind == "butler" else None,
            )
        except WrapperFailed as exc:
            raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
        return ToolResult(
            content=[mcp_types.TextContent(type="text", text=answer.answer)],
            structured_content=answer.structured(),
        )

    # -- activate mode --------------------------------------------------------------------

    def _register_control_tools(self) -> None:
        described = CONTROL_DESCRIPTIONS[self.mode]
        status = ("gateway_status", self._status, {"type": "object", "properties": {}})
        tools: tuple[tuple[str, Any, dict[str, Any]], ...] = (
            ("gateway_activate", self._activate, NAME_SCHEMA),
            ("gateway_deactivate", self._deactivate, NAME_SCHEMA),
            status,
        )
        if self.mode == "search":
            tools = (
                ("gateway_search", self._search, SEARCH_SCHEMA),
                ("gateway_describe", self._describe, TOOL_NAME_SCHEMA),
                ("gateway_call", self._call, CALL_SCHEMA),
                status,
            )
        for name, handler, parameters in tools:
            tool = ControlTool(name=name, description=described[name], parameters=parameters)
            tool._handler = handler
            self.mcp.add_tool(tool)

    async def _activate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        name = name_argument(arguments)
        slot = self._slot(name)
        with self.span("gateway.activate", slot):
            return await self._activate_slot(slot)

    async def _activate_slot(self, slot: Slot) -> dict[str, Any]:
        name = slot.spec.name
        await self.warm(slot)
        if slot.state == "error":
            raise ToolRefusal(f"cannot activate {name!r}: {slot.error}", log_level=logging.WARNING)
        if not slot.injected:
            self._inject_tools(slot)
            if self.mode == "both":
                self._hide_suite(slot)
            await self.notify_tools_changed()
        slot.state = "active"
        return {"activated": name, "tools": list(slot.injected)}

    async def _deactivate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        slot = self._slot(name_argument(arguments))
        with self.span("gateway.deactivate", slot):
            return await self._deactivate_slot(slot)

    async def _deactivate_slot(self, slot: Slot) -> dict[str, Any]:
        name = slot.spec.name
        removed = list(slot.injected)
        if removed:
            self._remove_tools(slot)
            await self.notify_tools_changed()
        if slot.state == "active":
            slot.state = "ready"
        return {"deactivated": name, "removed": removed}

    def redact(self, text: str) -> str:
        """`text` without the secrets the gateway knows."""
        return self.redactor(text) if self.redactor else text

    def learn_secrets(self, secrets: list[str]) -> None:
        """What servers read (at start, or by a reload) are sent that is secret: redacted from
        now on, in this process's logs too (the Redactor is the process's)."""
        if self.redactor is not None and secrets:
            self.redactor.add(secrets)

    async def _status(self, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        """Every child's state, the servers held pending (not approved), the settings when
        the file changed since its approval, and why no butlers are behind the gateway when
        the switchboard could not be asked."""
        entries = [self._slot_status(slot) for slot in self.slots.values()]
        for entry in entries:
            if entry["error"]:
                entry["error"] = self.redact(entry["error"])
        for name, detail in self.pending.items():
            entries.append({**_NOT_RUNNING, "name": name, "state": "pending", "detail": detail})
        if self.settings_note is not None:
            entries.append(
                {
                    **_NOT_RUNNING,
                    "name": "settings",
                    "kind": "settings",
                    "state": "pending",
                    "detail": self.settings_note,
                }
            )
        if self.butlers_missing is not None:
            entries.append(
                {
                    **_NOT_RUNNING,
                    "name": "butlers",
                    "kind": "butler",
                    "state": "error",
                    "error": self.butlers_missing,
                }
            )
        return entries

    def _slot_status(self, slot: Slot) -> dict[str, Any]:
        entry = {
            "name": slot.spec.name,
            "kind": slot.spec.kind,
            "state": slot.state,
            "ready": slot.state in ("ready", "active"),
            "active": slot.state == "active",
            "error": slot.error,
            "tools": len(self._exposed(slot, slot.tools)),  # what the host may call
            "suite": None if self.mode in ("activate", "search") else slot.suite_name,
        }
        if slot.state == "error" and isinstance(slot.child, StdioChild) and slot.child.said:
            # A server that fails says why on stderr, as a rule ("missing API key").
            entry["stderr"] = [printable(self.redact(line)) for line in slot.child.said]
        return entry

    # -- search mode ----------------------------------------------------------------------

    def _index_fresh(self, index: SearchIndex) -> bool:
        return index.fresh([(name, slot.tools) for name, slot in self.slots.items()])

    async def search_index(self, *, wait_s: float | None = SEARCH_WAIT_S) -> SearchIndex:
        """Every child's exposed tools, indexed; built again when a child's tool list was
        read again (start, restart, list_changed: see butlers.gateway.search). A child not
        started yet (`--lazy`, or still warming) is started, and waited for up to `wait_s`
        (None: until each has started or failed): one slow or hung server held up every
        search and call, a healthy server's too, for its whole timeout (a walkthrough). A
        child in error keeps the tools it last listed (a call restarts it); one that never
        listed any is tried again, after `search_retry_after_s`."""
        pending = [s for s in self.slots.values() if s.state in ("idle", "warming")]
        if wait_s is not None:  # each start holds up one search at most
            pending = [s for s in pending if not s.searched_while_starting]
        now = asyncio.get_running_loop().time()
        pending += [
            s
            for s in self.slots.values()
            if s.state == "error"
            and not s.tools
            and now - (s.failed_at or 0) >= search_retry_after_s(s.failures)
        ]
        if pending and not self._closed:
            starts = [self._start_warm(slot) for slot in pending]  # joins a start under way
            await asyncio.wait(starts, timeout=wait_s)
            for slot in pending:
                slot.searched_while_starting = slot.state in ("idle", "warming")
        sources = [(name, slot.tools) for name, slot in self.slots.items()]
        index = self._search_index
        if index is None or not index.fresh(sources):
            entries = [
                Entry(slot.spec.name, tool)
                for slot in self.slots.values()
                for tool in self._exposed(slot, self._with_wrapper(slot))
            ]
            index = self._search_index = SearchIndex.build(entries, sources)
        return index

    def _with_wrapper(self, slot: Slot) -> list[dict[str, Any]]:
        wrapper = self._wrapper_tool(slot)
        return [*slot.tools, *([wrapper] if wrapper else [])]

    async def _search(self, arguments: dict[str, Any]) -> list[dict[str, str]]:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolRefusal("gateway_search: 'query' must be a non-empty string")
        limit = arguments.get("limit", 5)
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not (1 <= limit <= SEARCH_LIMIT_MAX)
        ):
            raise ToolRefusal(
                f"gateway_search: 'limit' must be a whole number from 1 to {SEARCH_LIMIT_MAX}, "
                f"got {limit!r}"
            )
        index = await self.search_index()
        # One result a tool: the same tool on several servers (every butler's `state_set`)
        # is the best-ranked one, the others named in its `also`: four copies of each filled
        # the five results of a fleet's search (a walkthrough).
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for entry in index.search(query, len(index.entries)):
            same = (entry.name, str(entry.tool.get("description") or ""))
            if same in found:
                found[same].setdefault("also", []).append(index.callable_name(entry))
            elif len(found) < limit:
                found[same] = {
                    "name": index.callable_name(entry),
                    "server": entry.server,
                    "summary": summarize(
                        entry.tool.get("description"),
                        self._summary_limit(self.slots[entry.server]),
                    ),
                }
        return list(found.values())

    async def _describe(self, arguments: dict[str, Any]) -> dict[str, Any]:
        entry = await self._search_entry(arguments, "gateway_describe")
        described = {
            "name": entry.name,
            "server": entry.server,
            "description": entry.tool.get("description") or "",
            "inputSchema": entry.tool.get("inputSchema") or {"type": "object"},
        }
        if entry.tool.get("outputSchema"):
            described["outputSchema"] = entry.tool["outputSchema"]
        if (annotations := _annotations(entry.tool)) is not None:  # destructiveHint, ...
            described["annotations"] = annotations.model_dump(by_alias=True, exclude_none=True)
        return described

    async def _call(self, arguments: dict[str, Any]) -> ToolResult:
        entry = await self._search_entry(arguments, "gateway_call")
        args = arguments.get("arguments") or {}
        if not isinstance(args, dict):
            raise ToolRefusal("gateway_call: 'arguments' must be an object")
        slot = self.slots[entry.server]
        # A suite call in all but name: the same checks, timeouts, span and redaction.
        call = {"action": "call", "subtool": entry.name, "args": args}
        with self.span("gateway.suite_call", slot, call, {"via": "gateway_call"}):
            return await self.suite_call(slot, call)

    async def _search_entry(self, arguments: dict[str, Any], tool: str) -> Entry:
        """The exposed tool `arguments["name"]` names; refused, saying why, when it names
        none, one a server's `expose` keeps back, or several."""
        name = arguments.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRefusal(f"{tool}: 'name' must be a tool's name from gateway_search")
        # A name the tools listed now have is called at once: a hung server's start held up
        # calls of a healthy one's tools by up to SEARCH_WAIT_S (a walkthrough).
        index = self._search_index
        found = index.resolve(name) if index is not None and self._index_fresh(index) else []
        if not found:
            index = await self.search_index()
            found = index.resolve(name)
        if not found and self._starting():  # maybe theirs: waited for once more, as long
            for slot in self.slots.values():
                slot.searched_while_starting = False
            index = await self.search_index()
            found = index.resolve(name)
        if len(found) == 1:
            return found[0]
        if found:
            options = ", ".join(f"{e.server}/{e.name}" for e in found)
            raise ToolRefusal(f"{tool}: more than one server has a tool {name!r}: say {options}")
        for slot in self.slots.values():
            for listed in slot.tools:
                if name in (listed["name"], f"{slot.spec.name}/{listed['name']}"):
                    raise ToolRefusal(
                        f"{tool}: tool {listed['name']!r} of server {slot.spec.name!r} is not "
                        f"allowed (expose in [suites.{slot.spec.name}])"
                    )
        starting = self._starting()
        raise ToolRefusal(
            f"{tool}: no tool named {name!r} behind the gateway (gateway_search finds tools"
            + (f"; still starting: {', '.join(starting)}" if starting else "")
            + ")"
        )

    def _starting(self) -> list[str]:
        """The children still starting (or not started: `--lazy`)."""
        return [n for n, s in self.slots.items() if s.state in ("idle", "warming")]

    def _slot(self, name: str) -> Slot:
        slot = self.slots.get(name)
        if slot is None and name in self.pending:  # declared, not approved: say so
            raise ToolRefusal(f"server {name!r} is pending: {self.pending[name]}")
        if slot is None:
            known = ", ".join(self.slots) or "none"
            raise ToolRefusal(f"no MCP server named {name!r} behind the gateway (known: {known})")
        return slot

    def _inject_tools(self, slot: Slot) -> None:
        taken = self._fixed_names | {n for other in self.slots.values() for n in other.injected}
        for tool in self._exposed(slot, self._with_wrapper(slot)):
            name = tool["name"]
            if name in taken:
                # Prefixed with its server; numbered when that too is taken (another server's
                # own `b_echo`: activating `b` shadowed it, and deactivating `b` removed it
                # from the host's list, a walkthrough).
                prefixed, n = f"{slot.spec.name}_{name}", 2
                name = prefixed
                while name in taken:
                    name, n = f"{prefixed}_{n}", n + 1
            injected = _ChildTool(
                name=name,
                description=tool.get("description") or "",
                parameters=tool.get("inputSchema") or {"type": "object"},
                annotations=_annotations(tool),  # the host's "destructive?" prompt reads them
            )
            injected._gateway, injected._slot, injected._child_tool = self, slot, tool["name"]
            self.mcp.add_tool(injected)
            slot.injected.append(name)
            taken.add(name)

    def _remove_tools(self, slot: Slot) -> None:
        for name in slot.injected:
            with contextlib.suppress(Exception):
                self.mcp.local_provider.remove_tool(name)
        slot.injected.clear()
        if self.mode == "both":
            self._show_suite(slot)

    def _hide_suite(self, slot: Slot) -> None:
        with contextlib.suppress(Exception):
            self.mcp.local_provider.remove_tool(slot.suite_name)

    def _show_suite(self, slot: Slot) -> None:
        if slot.suite_tool is not None:
            self.mcp.add_tool(slot.suite_tool)

    async def notify_tools_changed(self) -> None:
        await self.notify_changed(tools=True)

    async def notify_changed(self, *, tools: bool = False, kinds: Sequence[Kind] = ()) -> None:
        """Tell every connected host which of its lists changed (tools, prompts, resources)."""
        for host in self._tracker.hosts:
            try:
                if tools:
                    await host.send_tool_list_changed()
                if "prompts" in kinds:
                    await host.send_prompt_list_changed()
                if "resources" in kinds:
                    await host.send_resource_list_changed()
            except Exception:  # a host that went away: forget it
                self._tracker.forget(host)

    async def close(self) -> None:
        """Warm-ups and the gateway's own tasks (notifications to hosts, a child's tool list
        read again) cancelled, then every child closed (for good: none starts again), the
        watchdog and the wrapper: all of them, whatever a warm-up or a child's close raised
        (one that raised used to leave the rest running)."""
        self._closed = True
        tasks = [*self._warming, *self._notify_tasks]
        for task in tasks:
            task.cancel()
        try:  # a task's own failure is logged as it ends (_warmed, _done); not raised here
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            try:
                await asyncio.gather(
                    *(slot.child.close() for slot in self.slots.values()),
                    return_exceptions=True,
                )
                await self.watchdog.close()
            finally:
                self.wrapper.close()


# What gateway_status says of a server that is not a running child.
_NOT_RUNNING: dict[str, Any] = {
    "kind": "mcp",
    "ready": False,
    "active": False,
    "error": None,
    "tools": 0,
    "suite": None,
}


def _annotations(tool: Mapping[str, Any]) -> mcp_types.ToolAnnotations | None:
    """A child's tool's annotations (readOnlyHint, destructiveHint, title...), as the child
    listed them; None when it has none, or none that are valid (a child's word only: hints,
    which no one should trust, but which a host asks its user by)."""
    given = tool.get("annotations")
    if not isinstance(given, dict):
        return None
    try:
        return mcp_types.ToolAnnotations.model_validate(given)
    except ValueError:
        return None


def result_size(raw: Any) -> int:
    """About how many bytes a child's result holds: its texts, its data (base64), its
    structured content, as UTF-8. Counted from the parsed result (no second serialization of
    its texts, which may be megabytes)."""
    if not isinstance(raw, dict):
        return 0
    size = 0
    for item in raw.get("content") or ():
        if isinstance(item, dict):
            resource = item.get("resource")
            for part in (item, resource if isinstance(resource, dict) else {}):
                for key in ("text", "data", "blob"):
                    value = part.get(key)
                    if isinstance(value, str):  # bytes, as a host counts them
                        size += len(value) if value.isascii() else len(value.encode())
    structured = raw.get("structuredContent")
    if structured is not None:
        size += len(json.dumps(structured))  # (non-ASCII as escapes: never fewer bytes)
    return size


def _relay_stderr(name: str, redact: Callable[[str], str], line: str) -> None:
    """A stdio child's stderr line, on the gateway's stderr (where the host shows it, as when
    it was inherited, and keeps it in its own log files), naming the child; without the
    secrets the gateway knows, made printable (butlers.text)."""
    print(f"[{name}] {printable(redact(line))}", file=sys.stderr, flush=True)


class _RedactedRefusals(Middleware):
    """A refusal the gateway answers a host (a child that cannot be reached names its URL,
    whose `?key=` a declaration filled in) goes without the secrets it knows. A child's own
    results pass unchanged (docs/gateway.md)."""

    def __init__(self, redact: Callable[[str], str]) -> None:
        self.redact = redact

    async def on_call_tool(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        try:
            return await call_next(context)
        except ToolError as exc:
            text = self.redact(str(exc))
            if text == str(exc):
                raise
            level = getattr(exc, "log_level", logging.ERROR)
            raise ToolRefusal(text, log_level=level) from None
