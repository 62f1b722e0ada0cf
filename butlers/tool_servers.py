"""A butler's tool servers (`[[mcp_servers]]`): started with the butler, proxied by its own
MCP server as `<server>__<tool>`.

Why through the butler and not handed to Claude Code: a session's MCP config names only the
butler's own server (strict MCP config), so every call of a server's tool passes through the
butler, where the rest of its policy already is: the one middleware's span (the call is in the
message's trace) and guards, the session's tool-call record, and here: the server's allow and
deny globs (a denied tool is never registered, so neither listed nor callable), its approval
globs, a timeout per call, and the butler's Redactor over every answer (a server that echoes
a configured secret does not hand it to a model reading a stranger's words).

Approval: a session's call that a server's `approval` globs name is answered by the approval
gate in the butler's middleware (butlers.approvals: recorded, the owner asked) and never
reaches the server. Should one get here all the same (no gate wired), it is refused, not run:
a session runs on a stranger's text. A caller that is no session (the operator with the
fleet's token, or `approval_execute` running what the owner approved) is obeyed.

The process side is the gateway's (butlers.gateway.clients): a stdio server runs in a process
group of its own with PATH, HOME, locale and TZ plus its declared `env` and `pass_env` (nothing
else of ours), dies with the butler (PR_SET_PDEATHSIG, and the reaper's watchdog ends its
group when the butler is SIGKILLed); a remote one is one kept-open connection. What a stdio
server writes to its stderr becomes the butler's log records (INFO), so configured secrets
are redacted there too.

Servers start in the background when the butler starts (not lazily on first use: a session
is told its tools when it starts, so a server that has not started has no tools to offer);
the butler does not wait for them, so one that is slow or cannot start (npx offline) neither
delays nor stops the butler: its tools are absent and `statuses()` says why. One that exits is
started again after a backoff (1 s, doubling to 60 s; back to 1 s once it has run a minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastmcp import FastMCP
from fastmcp.tools.base import Tool, ToolResult

from butlers.backoff import Backoff
from butlers.config import PROXY_SEPARATOR, McpServerConfig
from butlers.errors import McpCallError
from butlers.gateway.children import ChildSpec
from butlers.gateway.clients import Child, RemoteChild, StdioChild
from butlers.gateway.reaper import Watchdog
from butlers.gateway.server import result_of
from butlers.session_policy import waits_for_approval
from butlers.tasks import Coalesced, within
from butlers.text import printable
from butlers.tool_errors import ToolRefusal

logger = logging.getLogger(__name__)

RESTART_BACKOFF = Backoff.doubling(1.0, 60.0)
LAST_WORDS_CHARS = 500  # of a failed server's stderr, in the log line that says it failed
STABLE_AFTER_S = 60.0  # a server that ran this long starts its backoff over
# A server whose tools change is listed again at most this often (its notices coalesced).
RELIST_EVERY_S = 0.5
# What Claude Code and the Messages API take as a tool name (`mcp__<butler>__<server>__<tool>`).
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class ServerStatus:
    """What `status()` and /health say about one server."""

    name: str
    state: str = "starting"  # starting | running | restarting | failed | stopped
    reason: str = ""  # why it is not running (its last failure), empty while it runs
    tools: int = 0  # tools offered
    starts: int = 0

    def report(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "reason": self.reason,
            "tools": self.tools,
            "starts": self.starts,
        }


class _ProxiedTool(Tool):
    """One allowed tool of a server, on the butler's MCP server as `<server>__<tool>`."""

    _server: ToolServer
    _tool: str

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        return await self._server.call(self._tool, arguments)


class ToolServer:
    """One `[[mcp_servers]]` entry: its child, its registered tools and its supervisor."""

    def __init__(
        self,
        config: McpServerConfig,
        child: Child,
        owner: ToolServers,
    ) -> None:
        self.config = config
        self.child = child
        self.owner = owner
        self.status = ServerStatus(config.name)
        self.registered: list[str] = []
        self._withheld = False  # its tools not offered: an approval glob matches none
        self._exited = asyncio.Event()
        self._exit_reason = ""
        self._supervisor: asyncio.Task[None] | None = None
        self._relisting = Coalesced(self._refresh, RELIST_EVERY_S)
        self.running = asyncio.Event()  # set while its state is "running" (`ready_for`)
        if isinstance(child, StdioChild):
            child.on_exit = self._on_exit
        child.on_tools_changed = self._on_tools_changed

    @property
    def name(self) -> str:
        return self.config.name

    def start(self) -> None:
        self._supervisor = asyncio.get_running_loop().create_task(
            self._supervise(), name=f"tool-server:{self.name}"
        )

    async def _supervise(self) -> None:
        """Start, wait for an exit, start again after the backoff; for good."""
        loop = asyncio.get_running_loop()
        failures = 0
        told = ""  # the reason last logged at WARNING: the same again is only INFO
        while True:
            self._exited.clear()
            started_at = loop.time()
            try:
                await self._start_once()
            except Exception as exc:  # whatever a server does, the butler goes on
                self._failed(self._describe(exc))
            else:
                await self._exited.wait()
                self._failed(self._exit_reason or "it exited")
                if loop.time() - started_at >= STABLE_AFTER_S:
                    failures = 0
            self._set("restarting")
            backoff = RESTART_BACKOFF.delay(failures)
            failures += 1
            logger.log(
                logging.INFO if self.status.reason == told else logging.WARNING,
                "tool server %r: %s; starting it again in %g s%s",
                self.name,
                self.status.reason,
                backoff,
                self._last_words(),
                extra={"action": "tool_server_down"},
            )
            told = self.status.reason
            await asyncio.sleep(backoff)

    async def _start_once(self) -> None:
        self._set("starting" if not self.status.starts else "restarting")
        self.status.starts += 1
        if isinstance(self.child, StdioChild):
            self.child.said.clear()  # its last words are this run's, not an earlier one's
        await self.child.start()
        await self._register(await self.child.list_tools())
        if not self._withheld:
            logger.info(
                "tool server %r running: %d tools offered",
                self.name,
                self.status.tools,
                extra={"action": "tool_server_running"},
            )
        if isinstance(self.child, RemoteChild):
            await asyncio.Event().wait()  # a remote one reconnects on its next call

    def _set(self, state: str, reason: str | None = None) -> None:
        """Its state (and why, when given), and `running` set while it is "running"."""
        self.status.state = state
        if reason is not None:
            self.status.reason = reason
        if state == "running":
            self.running.set()
        else:
            self.running.clear()

    def _failed(self, reason: str) -> None:
        self._set("failed", self.owner.redact(reason)[:500])

    def _describe(self, exc: BaseException) -> str:
        return str(exc) or type(exc).__name__

    def _last_words(self) -> str:
        """What a stdio server last wrote to its stderr, for the operator's log line of its
        failure: why it failed is there ("npm error 404 Not Found"), each line otherwise only
        at INFO. Never in `reason`: /health and sessions (status()) read that, and a server's
        stderr may hold what it was given (paths, other conversations' data). Redacted, made
        printable, cut."""
        said = list(self.child.said) if isinstance(self.child, StdioChild) else []
        if not said:
            return ""
        return f"; it said: {printable(self.owner.redact(' | '.join(said)), LAST_WORDS_CHARS)}"

    def _on_exit(self, _child: StdioChild, reason: str) -> None:
        self._exit_reason = reason
        self._exited.set()

    def _on_tools_changed(self, _name: str) -> None:
        """Read its tools again: once at a time, and once more for whatever notices came
        meanwhile (a red team: each of 3000 notices was a reading, and every tool
        registered again, each a task left waiting on a server that did not answer)."""
        if (run := self._relisting.request()) is not None:
            self.owner.spawn(run, f"tool-server:{self.name}:refresh")

    async def _refresh(self) -> None:
        try:
            await self._register(await self.child.list_tools())
        except McpCallError as exc:
            logger.warning("tool server %r: cannot list its tools again: %s", self.name, exc)

    async def _register(self, tools: Sequence[Mapping[str, Any]]) -> None:
        """The server's offered tools on the butler's server, replacing what was there; none
        while an `approval` glob matches none of them (`_unguarded`)."""
        self._unregister()
        refused = self._unguarded(tools)
        self._withheld = refused is not None
        if refused is not None:
            self._set("failed", refused)
            return
        self._set("running", "")
        mcp = self.owner.mcp
        for tool in tools:
            name = str(tool.get("name") or "")
            if not self.config.offers(name):
                continue  # denied, or not allowed: never offered
            proxied = f"{self.name}{PROXY_SEPARATOR}{name}"
            if not TOOL_NAME.match(proxied):
                logger.warning(
                    "tool server %r: tool %r skipped: %r is not a usable tool name",
                    self.name,
                    name,
                    proxied,
                )
                continue
            description = str(tool.get("description") or "")
            if self.config.needs_approval(name):
                description = f"(Needs the owner's approval.) {description}"
            registered = _ProxiedTool(
                name=proxied,
                description=description,
                parameters=tool.get("inputSchema") or {"type": "object"},
            )
            registered._server, registered._tool = self, name
            mcp.add_tool(registered)
            self.registered.append(proxied)
        self.status.tools = len(self.registered)
        self.owner.tools_changed()

    def _unguarded(self, tools: Sequence[Mapping[str, Any]]) -> str | None:
        """Why none of the server's tools is offered, when an `approval` glob matches none of
        the tools it offers: a misspelt one ("write_fle") would leave the tool it meant
        without the owner's veto, so the server's tools wait until the globs match (its
        tools may change while it runs: looked at again then). Warned of once for each."""
        offered = [n for n in (str(t.get("name") or "") for t in tools) if self.config.offers(n)]
        unmatched = [
            glob
            for glob in self.config.approval
            if not any(fnmatch.fnmatchcase(name, glob) for name in offered)
        ]
        if not unmatched:
            return None
        refused = (
            f"approval {', '.join(map(repr, unmatched))} matches none of its tools (they are "
            f"{', '.join(sorted(offered)) or 'none'}), so none is offered: fix [[mcp_servers]] "
            "approval"
        )
        if refused != self.status.reason:
            logger.warning(
                "tool server %r: %s", self.name, refused, extra={"action": "approval_unmatched"}
            )
        return refused

    def _unregister(self) -> None:
        for name in self.registered:
            with contextlib.suppress(Exception):
                self.owner.mcp.local_provider.remove_tool(name)
        had = bool(self.registered)
        self.registered = []
        self.status.tools = 0
        if had:
            self.owner.tools_changed()

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Run the server's `tool` for a session: refused unless offered, held for the
        owner's yes when its approval globs say so, bounded by `timeout_s`, redacted."""
        proxied = f"{self.name}{PROXY_SEPARATOR}{tool}"
        if not self.config.offers(tool):  # never registered; kept in case it ever is
            raise ToolRefusal(f"{proxied} is not offered on this butler")
        if not self.config.people and self.owner.answers_someone_else():
            # Kept out of such a session's allowlist too (Spawner.run): asked anyway, by a
            # stranger's text or a credential of no running session.
            raise ToolRefusal(
                f"{proxied} is the owner's alone ([[mcp_servers]] people = false): not for a "
                "session answering someone else",
                log_level=logging.WARNING,
            )
        if self.config.needs_approval(tool) and waits_for_approval():
            # The approval gate answers these before they get here: a session's call that
            # did not pass it is never run without the owner's yes.
            raise ToolRefusal(
                f"{proxied} needs the owner's approval, and this butler cannot ask for it: "
                "the call was not made",
                log_level=logging.WARNING,
            )
        if self.status.state != "running" and not self.child.running():
            raise ToolRefusal(
                f"tool server {self.name!r} is not running ({self.status.state}: "
                f"{self.status.reason or 'starting'}); try again shortly",
                log_level=logging.WARNING,
            )
        try:
            raw = await self.child.call_tool(tool, arguments)
        except McpCallError as exc:
            raise ToolRefusal(
                self.owner.redact(f"{proxied} failed: {exc}"), log_level=logging.WARNING
            ) from exc
        return result_of(self.owner.redact_json(raw))

    async def close(self) -> None:
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        if isinstance(self.child, StdioChild):
            self.child.on_exit = None  # a child we end did not crash
        await self.child.close()
        self._set("stopped")


def _server_said(name: str, line: str) -> None:
    """A line a stdio server wrote to its stderr: a log record of the butler's (INFO), so it
    is redacted and formatted like every other line, and named; printable, so that it cannot
    forge another line of the log (a CR and a terminal escape did: a red team)."""
    if said := printable(line):
        logger.info("tool server %r: %s", name, said, extra={"action": "tool_server_stderr"})


class ToolServers:
    """Every tool server of one butler (see the module's docstring)."""

    def __init__(
        self,
        servers: Sequence[McpServerConfig],
        *,
        mcp: FastMCP,
        environ: Mapping[str, str],
        data_dir: Path,
        butler_dir: Path | None,
        redact: Callable[[str], str] = str,
        on_tools_changed: Callable[[], None] | None = None,
        answers_someone_else: Callable[[], bool] = lambda: False,
    ) -> None:
        self.mcp = mcp
        self.redact = redact
        # Whether the call in hand is a session's answering someone other than the owner
        # (Spawner.answers_someone_else): a `people = false` server refuses it.
        self.answers_someone_else = answers_someone_else
        self.on_tools_changed = on_tools_changed
        # Absolute: the default BUTLERS_DATA_DIR is relative (.butlers), and a server runs in
        # the data directory, where `{data_dir}` written relative would name a directory
        # inside itself.
        data_dir = data_dir.absolute()
        butler_dir = butler_dir.absolute() if butler_dir is not None else None
        self.data_dir = data_dir
        self._watchdog = Watchdog()  # ends the servers' process groups if we are SIGKILLed
        self._tasks: set[asyncio.Task[None]] = set()
        places = {"{data_dir}": str(data_dir), "{butler_dir}": str(butler_dir or data_dir)}
        self.servers = [
            ToolServer(config, self._child(config, environ, places), self) for config in servers
        ]

    def _child(
        self, config: McpServerConfig, environ: Mapping[str, str], places: Mapping[str, str]
    ) -> Child:
        def place(text: str) -> str:
            for token, value in places.items():
                text = text.replace(token, value)
            return text

        if config.url is not None:
            headers = {
                header: environ.get(variable, "") for header, variable in config.headers_env.items()
            }
            spec = ChildSpec(name=config.name, url=config.url, headers=headers)
            return RemoteChild(
                spec, spawn_timeout_s=config.start_timeout_s, rpc_timeout_s=config.timeout_s
            )
        assert config.command is not None, "a stdio server has a command"
        env = {name: place(value) for name, value in config.env.items()}
        env |= {name: environ[name] for name in config.pass_env if name in environ}
        spec = ChildSpec(
            name=config.name,
            cmd=place(config.command),
            args=tuple(place(a) for a in config.args),
            env=env,
            cwd=Path(place(config.cwd)) if config.cwd else self.data_dir,
        )
        return StdioChild(
            spec,
            environ=environ,
            spawn_timeout_s=config.start_timeout_s,
            rpc_timeout_s=config.timeout_s,
            watchdog=self._watchdog,
            on_stderr=lambda line: _server_said(config.name, line),
        )

    @staticmethod
    def secrets(servers: Sequence[McpServerConfig], environ: Mapping[str, str]) -> list[str]:
        """The values the servers' config takes from the environment (`pass_env`,
        `headers_env`): for the butler's Redactor."""
        names = {n for s in servers for n in (*s.pass_env, *s.headers_env.values())}
        return [environ[name] for name in sorted(names) if environ.get(name)]

    def redact_json(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A server's answer with every configured secret replaced, wherever it is."""
        text = json.dumps(raw, ensure_ascii=False)
        redacted = self.redact(text)
        return raw if redacted is text else json.loads(redacted)

    async def open(self) -> None:
        """Start every server in the background; returns at once."""
        await asyncio.to_thread(self.data_dir.mkdir, mode=0o700, parents=True, exist_ok=True)
        for server in self.servers:
            server.start()

    def tools_changed(self) -> None:
        if self.on_tools_changed is not None:
            self.on_tools_changed()

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def why_missing(self, tool_name: str) -> str | None:
        """Why `<server>__<tool>` is not there, when its server is not running (the call then
        says so, not just "Unknown tool")."""
        server_name, _, _ = tool_name.partition(PROXY_SEPARATOR)
        server = next((s for s in self.servers if s.name == server_name), None)
        if server is None or server.status.state == "running":
            return None
        reason = f": {server.status.reason}" if server.status.reason else ""
        return f"tool server {server_name!r} is not running ({server.status.state}{reason})"

    async def ready_for(self, tool_name: str, timeout_s: float) -> None:
        """Until the server of `<server>__<tool>` runs, for at most `timeout_s` (not one of a
        server's: at once). An approved call is run when the butler starts, if the owner said
        yes while it was down; its server was still starting, the call failed for good
        ("Unknown tool: ... not running (starting)": a walkthrough)."""
        server_name, separator, _ = tool_name.partition(PROXY_SEPARATOR)
        server = self.get(server_name) if separator else None
        if server is not None:
            with contextlib.suppress(TimeoutError):
                await within(server.running.wait(), timeout_s)

    def statuses(self) -> list[dict[str, Any]]:
        return [server.status.report() for server in self.servers]

    def get(self, name: str) -> ToolServer | None:
        return next((s for s in self.servers if s.name == name), None)

    async def close(self) -> None:
        """Every server stopped with what it started; then the watchdog ends."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in self.servers), return_exceptions=True)
        await self._watchdog.close()
