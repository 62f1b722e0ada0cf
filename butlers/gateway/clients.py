"""Talking to one child MCP server: a process we start (stdio), or a server we reach (http).

The conversation itself is butlers.mcp_connection's, shared with route: the same requests,
timeouts, cancellation, answers to the child's pings, and errors (the McpCallError family).
What is the gateway's own is here: starting a child on first use and again after it died,
killing it with everything it started, and messages that name the child and the setting
(`timeouts.rpc_ms`, `timeouts.child_spawn_ms`) a person would change.

`close()` is final: a child removed by a reload, or closed with the gateway, never starts
again, whoever asks (a host's call in flight, a warm-up, a re-activation); a start already
under way when it is closed ends what it spawned, and `close()` returns only after it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import re
import signal
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from butlers import __version__
from butlers.environment import gateway_child_environment
from butlers.errors import CallTimedOut, ConnectionClosed, McpCallError, RemoteError
from butlers.gateway.children import ChildSpec
from butlers.gateway.reaper import Watchdog, end_group
from butlers.mcp_connection.core import Connection, McpConnection
from butlers.mcp_connection.stdio import StdioConnection
from butlers.tasks import within

if TYPE_CHECKING:  # the http transports (aiohttp, FastMCP) load when a remote child starts
    from butlers.mcp_connection.sse import SseConnection
    from butlers.mcp_connection.streamable import FastMcpConnection

logger = logging.getLogger(__name__)

# A stdio child's last lines on stderr kept (StdioChild.said).
STDERR_KEPT = 5

CLIENT_INFO = {"name": "butlers-gateway", "version": __version__}
# A child's word that its prompts or resources changed: the kind the gateway passes on.
LISTS_CHANGED = {
    "notifications/prompts/list_changed": "prompts",
    "notifications/resources/list_changed": "resources",
}
KILL_GRACE_S = 2.0
# A child offered roots may ask for them right after the handshake and apply them then (the
# npm filesystem server: its first call went before, and was refused the project: a
# walkthrough). Its calls (not its listing) wait for the question this long after the
# handshake the first time (never again if it does not ask), longer once it has asked, and
# then a moment for the roots to take.
ROOTS_FIRST_WAIT_S = 0.5
ROOTS_KNOWN_WAIT_S = 5.0
ROOTS_SETTLE_S = 0.1
# A tool name as MCP's SEP-986 has it (letters, digits, _ - . /, at most 128): a child's other
# names are left out. One with a line break forged a line of `--dry-run`'s listing, and
# activate mode put it as it was into the host's tool list (a walkthrough).
TOOL_NAME = re.compile(r"[A-Za-z0-9_./-]{1,128}")
T = TypeVar("T")
_progress_tokens = itertools.count(1)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGKILL when the gateway dies, even by SIGKILL (no orphans)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


class _Child:
    """What both kinds share: a name, timeouts, and the child's words for a failed request."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        spawn_timeout_s: float,
        rpc_timeout_s: float,
        on_tools_changed: Callable[[str], None] | None = None,
        on_lists_changed: Callable[[str, str], None] | None = None,
        roots: list[dict[str, str]] | None = None,
    ) -> None:
        self.spec = spec
        self.spawn_timeout_s = spawn_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.on_tools_changed = on_tools_changed
        # (name, "prompts" | "resources"): the child said that list changed.
        self.on_lists_changed = on_lists_changed
        # What a child asking `roots/list` is told (the gateway's --dir); None: we offer no
        # roots, and the child's request is "method not found".
        self.roots = roots
        # Whether the child asks for the roots after its handshake (None: not known yet), and
        # whether it did on this connection.
        self.asks_roots: bool | None = None
        self._roots_asked = asyncio.Event()
        self._roots_taken: asyncio.Task[None] | None = None  # this connection's wait
        # Counts the connections made: what was read from the child before a restart is stale.
        self.generation = 0
        # What the child offered in its last handshake (prompts, resources...); kept while an
        # idle child is stopped.
        self.server_capabilities: dict[str, Any] = {}
        self._connection: Connection | None = None
        # Calls in flight that asked for their progress: our progress token -> where it goes.
        self._progress: dict[str, Callable[[dict[str, Any]], None]] = {}
        # Where the child's log messages go while calls run (the gateway's hosts).
        self.on_log: Callable[[dict[str, Any]], None] | None = None
        # Set by close(), never cleared: start() refuses from then on.
        self._closed = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def closed(self) -> bool:
        """Closed for good (removed from the gateway, or the gateway closing)."""
        return self._closed

    def _removed(self) -> ConnectionClosed:
        """What a start of a closed child raises: a request still waiting to start it must not
        bring back a child the gateway let go (nothing would ever end it)."""
        return ConnectionClosed(f"child {self.name!r} was removed: it is not started again")

    async def start(self) -> None:
        raise NotImplementedError

    async def list_tools(self) -> list[dict[str, Any]]:
        """Every tool the child lists whose name is one (TOOL_NAME), as JSON; starts it first
        if need be."""
        await self.start()
        assert self._connection is not None, "start() connected it"
        tools = await self._ask(
            "tools/list", self._connection.list_tools(timeout_s=self.rpc_timeout_s)
        )
        named = [
            t for t in tools if isinstance(t.get("name"), str) and TOOL_NAME.fullmatch(t["name"])
        ]
        if len(named) < len(tools):
            left_out = [repr(t.get("name"))[:60] for t in tools if t not in named]
            logger.warning(
                "child %r: %d tool(s) left out, their names not a tool's (letters, digits, "
                "_ - . /, at most 128): %s",
                self.name,
                len(left_out),
                ", ".join(left_out[:5]),
                extra={"action": "child_tool_name_refused"},
            )
        return named

    async def call_tool(
        self,
        tool: str,
        arguments: dict[str, Any],
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """The child's `CallToolResult` as JSON; starts it first if need be. `progress` gets
        the params of each `notifications/progress` the child sends about this call."""
        await self.start()
        await self._until_roots_taken()
        assert self._connection is not None, "start() connected it"
        meta = None
        token = f"gateway-{next(_progress_tokens)}"
        if progress is not None:
            self._progress[token] = progress
            meta = {"progressToken": token}
        try:
            return await self._ask(
                f"tools/call {tool!r}",
                self._connection.call_tool(
                    tool, arguments, meta=meta, timeout_s=self.rpc_timeout_s
                ),
            )
        finally:
            self._progress.pop(token, None)

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """Any other request of the child's (prompts, resources), its result as JSON; starts
        it first if need be. Held to the call timeout."""
        await self.start()
        await self._until_roots_taken()
        connection = self._connection
        assert connection is not None, "start() connected it"
        return await self._ask(
            method, connection.request(method, params, timeout_s=self.rpc_timeout_s)
        )

    def _connected(self, connection: McpConnection) -> None:
        """A new connection of ours, before its handshake: the roots we offer, and how the
        child's requests and notifications reach us. (A /mcp child, through FastMCP's client,
        is offered no roots and its prompt or resource list changes are not heard: a FastMCP
        server on the 2026-07-28 revision sends neither.)"""
        if self.roots is not None:
            connection.capabilities = {"roots": {"listChanged": False}}
        self._roots_asked = asyncio.Event()
        connection.on_request = self._answer
        connection.on_notification = self._notified

    def _opened(self) -> None:
        """The handshake completed: a new generation, and what the child offers."""
        self.generation += 1
        if self._connection is not None:
            self.server_capabilities = self._connection.server_capabilities

    def _answer(self, method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """The child asks us (its client): `roots/list` is the gateway's directory."""
        if method == "roots/list" and self.roots is not None:
            self._roots_asked.set()
            return {"roots": [dict(root) for root in self.roots]}
        return None

    async def _until_roots_taken(self) -> None:
        """Before a call: this connection's roots asked for and taken (or not asked)."""
        task = self._roots_taken
        if task is not None and not task.done():
            # (Not the task's outcome: one ended with its child is no error of this call's;
            # and a caller giving up does not cut the others' wait.)
            await asyncio.wait({task})

    def _await_roots(self) -> None:
        """After the handshake: the wait for the roots runs while the tools are listed."""
        if self.roots is not None and self.asks_roots is not False:
            self._roots_taken = asyncio.get_running_loop().create_task(
                self._take_roots(), name=f"child:{self.name}:roots"
            )

    async def _take_roots(self) -> None:
        """The roots asked for and answered, the answer read (a ping behind it came back)
        and a moment to apply them; or, the first time, no question within a moment."""
        connection = self._connection
        if self.roots is None or self.asks_roots is False or connection is None:
            return
        wait_s = ROOTS_KNOWN_WAIT_S if self.asks_roots else ROOTS_FIRST_WAIT_S
        try:
            await within(self._roots_asked.wait(), wait_s)
        except TimeoutError:
            if self.asks_roots is None:
                self.asks_roots = False  # it does not ask: no start waits for it again
            return
        self.asks_roots = True
        with contextlib.suppress(Exception):  # (no ping: the moment below is all it gets)
            await connection.request("ping", {}, timeout_s=self.rpc_timeout_s)
        await asyncio.sleep(ROOTS_SETTLE_S)

    def _notified(self, method: str, params: dict[str, Any]) -> None:
        """A call's progress goes to whoever asked for it; log messages to `on_log`; a
        changed prompt or resource list to `on_lists_changed`."""
        if method == "notifications/progress":
            forward = self._progress.get(str(params.get("progressToken")))
            if forward is not None:
                forward(params)
        elif method == "notifications/message" and self.on_log is not None:
            self.on_log(params)
        elif method in LISTS_CHANGED and self.on_lists_changed is not None:
            self.on_lists_changed(self.name, LISTS_CHANGED[method])

    def _tools_changed(self) -> None:
        """The child says its tool list changed. The gateway may act on it; we log it."""
        logger.info(
            "child %r says its tools changed", self.name, extra={"action": "child_tools_changed"}
        )
        if self.on_tools_changed is not None:
            self.on_tools_changed(self.name)

    async def _ask(self, step: str, request: Awaitable[T]) -> T:
        """Run one request; its failure is raised again in words that name the child."""
        try:
            return await request
        except CallTimedOut as exc:
            raise CallTimedOut(
                f"child {self.name!r}: no answer to {step} within "
                f"{_ms(self.rpc_timeout_s)} (timeouts.rpc_ms)"
            ) from exc
        except RemoteError as exc:
            raise RemoteError(
                exc.code, f"child {self.name!r}: {step} failed: {exc.message} (code {exc.code})"
            ) from exc
        except ConnectionClosed as exc:
            gone = self._gone(step, exc)
            if gone is exc:
                raise
            raise gone from exc

    def _gone(self, step: str, exc: ConnectionClosed) -> ConnectionClosed:
        return type(exc)(f"child {self.name!r}: {step} failed: {exc}")


class StdioChild(_Child):
    """One stdio child: spawned on first use, reused, restarted after a crash, killed on close."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        environ: Mapping[str, str],
        spawn_timeout_s: float,
        rpc_timeout_s: float,
        on_exit: Callable[[StdioChild, str], None] | None = None,
        on_tools_changed: Callable[[str], None] | None = None,
        on_lists_changed: Callable[[str, str], None] | None = None,
        roots: list[dict[str, str]] | None = None,
        watchdog: Watchdog | None = None,
        on_stderr: Callable[[str], None] | None = None,
        pass_env: tuple[str, ...] = (),
        initialize_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            spec,
            spawn_timeout_s=spawn_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            on_tools_changed=on_tools_changed,
            on_lists_changed=on_lists_changed,
            roots=roots,
        )
        # Variables of `environ` this child gets by name (`[suites.<child>] pass_env`).
        self.pass_env = pass_env
        # None: `initialize` counts against the spawn timeout. The gateway gives it the call
        # timeout instead: `npx -y pkg` downloads the package before it can answer at all.
        self.initialize_timeout_s = initialize_timeout_s
        # Stopped after this long without a request (`[suites.<child>] idle_timeout_s`), and
        # started again by the next one; None: it runs until the gateway ends.
        self.idle_timeout_s = idle_timeout_s
        self._in_use = 0  # requests in flight: an idle stop never cuts one short
        self._idle_stop: asyncio.Task[None] | None = None
        self.on_exit = on_exit
        # None: the child's stderr is ours (the gateway's host shows it); else each line goes
        # here (a butler logs it, so that it is redacted like every other line).
        self.on_stderr = on_stderr
        # Its last lines on stderr (when it goes to on_stderr): where a server that fails at
        # start says why ("missing API key"), for whoever asks after it exited.
        self.said: deque[str] = deque(maxlen=STDERR_KEPT)
        self._stderr_reader: asyncio.Task[None] | None = None
        self.environ = environ
        self.watchdog = watchdog  # ends its process group if the gateway is killed
        self.spawns = 0
        self._process: asyncio.subprocess.Process | None = None
        self._start_lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def list_tools(self) -> list[dict[str, Any]]:
        async with self._using():
            return await super().list_tools()

    async def call_tool(
        self,
        tool: str,
        arguments: dict[str, Any],
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        async with self._using():
            return await super().call_tool(tool, arguments, progress=progress)

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        async with self._using():
            return await super().request(method, params)

    @contextlib.asynccontextmanager
    async def _using(self) -> AsyncIterator[None]:
        """Counts a request in flight; the last one to end starts the idle countdown."""
        self._cancel_idle_stop()
        self._in_use += 1
        try:
            yield
        finally:
            self._in_use -= 1
            if self._in_use == 0 and self.idle_timeout_s is not None and not self._closed:
                self._idle_stop = asyncio.get_running_loop().create_task(
                    self._stop_when_idle(self.idle_timeout_s), name=f"child:{self.name}:idle"
                )

    def _cancel_idle_stop(self) -> None:
        task, self._idle_stop = self._idle_stop, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _stop_when_idle(self, idle_timeout_s: float) -> None:
        await asyncio.sleep(idle_timeout_s)
        async with self._start_lock:  # not while a request is starting it again
            if self._in_use or not self.running():
                return
            self._idle_stop = None  # ending it now: close() must not cancel this very task
            logger.info(
                "child %r idle for %g s: stopped, started again by its next request",
                self.name,
                idle_timeout_s,
                extra={"action": "child_idle_stop"},
            )
            await self._kill()

    def running(self) -> bool:
        return (
            self._process is not None
            and self._process.returncode is None
            and self._connection is not None
            and self._connection.is_open
        )

    async def start(self) -> None:
        """Spawn and initialize it unless it runs. Raises ConnectionClosed once it is closed;
        closed while starting, it ends what it spawned before raising, at whichever step."""
        if self._closed:
            raise self._removed()
        async with self._start_lock:
            if self._closed:  # closed while this request waited for another's start
                raise self._removed()
            if self.running():
                return
            await self._kill()
            if self.initialize_timeout_s is None:
                spawn, initialize = self._spawn_and_initialize, self.spawn_timeout_s
                steps = [(spawn, initialize, "timeouts.child_spawn_ms")]
            else:
                steps = [
                    (self._spawn, self.spawn_timeout_s, "timeouts.child_spawn_ms"),
                    (self._initialize, self.initialize_timeout_s, "timeouts.rpc_ms"),
                ]
            for step, timeout_s, setting in steps:
                await self._unless_closed()
                try:
                    await within(step(), timeout_s)
                except TimeoutError:
                    await self._kill()
                    raise CallTimedOut(
                        f"child {self.name!r}: no answer to initialize within "
                        f"{_ms(timeout_s)} ({setting})"
                    ) from None
                except McpCallError as exc:
                    await self._kill()
                    if self._closed:  # close() ended it under us: say so, not "exited"
                        raise self._removed() from exc
                    raise
                except asyncio.CancelledError:
                    # The request that was starting it went away (a host cancelled its
                    # call): a child spawned but not initialized must not pass for running.
                    await self._kill()
                    raise
            await self._unless_closed()
            self._opened()
            self._await_roots()

    async def _unless_closed(self) -> None:
        """Within start(): a child closed meanwhile has what this start spawned ended (close()
        could not reach a process not spawned yet) and the start refused."""
        if self._closed:
            await self._kill()
            raise self._removed()

    async def _spawn_and_initialize(self) -> None:
        await self._spawn()
        await self._initialize()

    async def _spawn(self) -> None:
        """Start the process and its connection; nothing is asked of it yet."""
        spec = self.spec
        assert spec.cmd is not None, "a stdio child has a command"
        try:
            self._process = await asyncio.create_subprocess_exec(
                spec.cmd,
                *spec.args,
                cwd=spec.cwd,
                # not our secrets: only what pass_env names
                env=gateway_child_environment(spec.env, self.environ, self.pass_env),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                # the child's own diagnostics go where the gateway's go, or to on_stderr
                stderr=None if self.on_stderr is None else asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group: close() ends grandchildren too
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise ConnectionClosed(
                f"child {self.name!r}: cannot run {spec.cmd!r} in {spec.cwd}: {exc.strerror or exc}"
            ) from exc
        self.spawns += 1
        if self.watchdog is not None:
            self.watchdog.watch(self._process.pid)
        if self.on_stderr is not None and self._process.stderr is not None:
            self._stderr_reader = asyncio.get_running_loop().create_task(
                self._read_stderr(self._process.stderr, self._heard),
                name=f"child:{self.name}:stderr",
            )
        connection = StdioConnection(
            self._process,
            label=f"child {self.name!r}",  # "child 'docs' exited (code 3)"
            on_tools_changed=self._tools_changed,
            on_closed=self._exited,
        )
        self._connected(connection)
        self._connection = connection
        if self._closed:  # closed while it was being spawned: start() ends it
            raise self._removed()

    async def _initialize(self) -> None:
        if self._closed:  # closed since it spawned
            raise self._removed()
        assert isinstance(self._connection, StdioConnection), "spawned first"
        await self._ask("initialize", self._connection.open(CLIENT_INFO, timeout_s=None))

    @staticmethod
    async def _read_stderr(stream: asyncio.StreamReader, say: Callable[[str], None]) -> None:
        """Every line, until the child closes its stderr. Reading must go on whatever comes:
        a child whose stderr pipe is full blocks on its next write."""
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the reader's limit: dropped (asyncio drops it)
                say("(a line too long to show was left out)")
                continue
            if not line:
                return
            say(line.decode(errors="replace").rstrip())

    def _heard(self, line: str) -> None:
        self.said.append(line)
        if self.on_stderr is not None:
            self.on_stderr(line)

    def _exited(self, reason: str) -> None:
        if self.on_exit is not None:
            self.on_exit(self, reason)

    def _gone(self, step: str, exc: ConnectionClosed) -> ConnectionClosed:
        return exc  # its connection's words already name the child: "child 'x' exited (code 3)"

    async def _kill(self) -> None:
        """Stop listening first (a child we end did not crash), then end its process group:
        also what it started, also when it has exited already (a crash leaves its own
        children behind)."""
        connection, self._connection = self._connection, None
        roots, self._roots_taken = self._roots_taken, None
        if roots is not None:
            roots.cancel()
            await asyncio.gather(roots, return_exceptions=True)
        if connection is not None:
            await connection.close()
        process, self._process = self._process, None
        if process is not None:
            await end_group(process, KILL_GRACE_S)
            if self.watchdog is not None:
                self.watchdog.forget(process.pid)
        reader, self._stderr_reader = self._stderr_reader, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def close(self) -> None:
        """For good. What runs now ends at once (a start waiting on its `initialize` fails
        with it); then, under the start lock, after any start in progress has ended what it
        spawned: no process of this child outlives the call."""
        self._closed = True
        self._cancel_idle_stop()
        await self._kill()
        async with self._start_lock:
            await self._kill()


class RemoteChild(_Child):
    """A child reached over HTTP: our SseConnection for `/sse` endpoints (as route uses),
    FastMCP's client for streamable HTTP. One kept-open connection, made again when lost."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        spawn_timeout_s: float,
        rpc_timeout_s: float,
        auth_token: str | None = None,
        on_tools_changed: Callable[[str], None] | None = None,
        on_lists_changed: Callable[[str, str], None] | None = None,
        roots: list[dict[str, str]] | None = None,
    ) -> None:
        super().__init__(
            spec,
            spawn_timeout_s=spawn_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            on_tools_changed=on_tools_changed,
            on_lists_changed=on_lists_changed,
            roots=roots,
        )
        self.auth_token = auth_token
        self.on_exit = None
        self._lock = asyncio.Lock()

    def running(self) -> bool:
        return self._connection is not None and self._connection.is_open

    async def start(self) -> None:
        """Connect unless connected. Raises ConnectionClosed once it is closed; closed while
        connecting, it closes what it opened before raising."""
        if self._closed:
            raise self._removed()
        async with self._lock:
            if self._closed:
                raise self._removed()
            if self.running():
                return
            await self._disconnect()
            url = self.spec.url
            assert url is not None, "a remote child has a URL"
            await self._check_holds_token(url)
            connection = self._connect(url, self.auth_token)
            try:
                await connection.open(self.spawn_timeout_s)
            except TimeoutError:
                await _close_quietly(connection)
                raise CallTimedOut(
                    f"child {self.name!r}: no answer from {where(url)} within "
                    f"{_ms(self.spawn_timeout_s)} (timeouts.child_spawn_ms)"
                ) from None
            except Exception as exc:  # FastMCP's client raises what its transport raised
                await _close_quietly(connection)
                raise ConnectionClosed(
                    f"child {self.name!r}: cannot connect to {where(url)}: {exc}"
                ) from exc
            if self._closed:  # closed while connecting: close() could not reach it
                await _close_quietly(connection)
                raise self._removed()
            self._connection = connection
            self._opened()

    async def _check_holds_token(self, url: str) -> None:
        """ConnectionClosed unless the butler at `url` proves it holds the fleet's token, when
        there is one to send (butlers.mcp_connection.proof): a port a stopped butler left is
        anyone's to take; an impostor there was given no token, but was served to the host
        as the butler (a walkthrough)."""
        from butlers.mcp_connection.proof import UNPROVEN_HINT, Unproven, check_holds_token

        try:
            await check_holds_token(url, self.auth_token, self.spec.name)
        except Unproven as exc:
            raise ConnectionClosed(
                f"child {self.name!r}: {exc}: not connected to ({UNPROVEN_HINT})"
            ) from exc
        except OSError as exc:
            raise ConnectionClosed(f"child {self.name!r}: cannot connect to {exc}") from exc

    def _connect(self, url: str, auth_token: str | None) -> SseConnection | FastMcpConnection:
        if url.rstrip("/").endswith("/sse"):
            from butlers.mcp_connection.sse import SseConnection

            sse = SseConnection(
                url,
                auth_token=auth_token,
                headers=self.spec.headers,
                client_info=CLIENT_INFO,
                on_tools_changed=self._tools_changed,
            )
            self._connected(sse)
            return sse
        from butlers.mcp_connection.streamable import FastMcpConnection

        return FastMcpConnection(
            url,
            auth_token=auth_token,
            headers=self.spec.headers,
            on_tools_changed=self._tools_changed,
        )

    async def close(self) -> None:
        """For good: the open connection ends now; then, after a connect in progress has
        closed what it opened (bounded by `timeouts.child_spawn_ms`)."""
        self._closed = True
        await self._disconnect()
        async with self._lock:
            await self._disconnect()

    async def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()


Child = StdioChild | RemoteChild


def where(url: str) -> str:
    """A remote child's URL as messages show it: scheme, host and port only. Its path, query
    and user info may hold a credential (`/s/<token>/mcp`, `?key=`, `u:p@`), and what the
    gateway says reaches the host's model."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "its URL"
    host = f"[{host}]" if ":" in host else host
    hidden = "/…" if parts.path not in ("", "/") or parts.query else ""
    return f"{parts.scheme}://{host}{port}{hidden}"


async def _close_quietly(connection: SseConnection | FastMcpConnection) -> None:
    """Close a connection that failed to open: FastMCP's client raises the transport's error
    again from `close` (an unreachable remote child ended `butlers gateway` in a traceback
    instead of showing the child in error)."""
    with contextlib.suppress(Exception):
        await connection.close()
