"""JSON-RPC 2.0 for one MCP connection, whatever carries the bytes.

A transport subclass sends one message (`_send`), hands over each message it receives
(`_received`) and says when the connection ended (`_lost`); everything else is here, once:

- **Requests**: an id each, the pending answer found by id, a timeout. A request given up (it
  timed out, or its caller was cancelled) is withdrawn with `notifications/cancelled`, so the
  peer can stop working on it (not `initialize`: the protocol forbids cancelling that).
- **The handshake**: `initialize` offers the newest revision the MCP types package reaches by
  handshake and refuses an answer that package does not list: no version literals here.
- **The peer's requests**: `ping` is answered with `{}`; an owner that declared client
  `capabilities` answers what they promise through `on_request` (the gateway: `roots/list`);
  anything else gets "method not found". Its `notifications/tools/list_changed` goes to the
  owner's `on_tools_changed`; any other notification (a call's progress, log messages) to
  `on_notification(method, params)` when the owner set one (the gateway passes them on).
- **The end**: when the connection closes, every request still waiting fails at once with
  AnswerLost naming the reason, and later requests are refused with ConnectionClosed. A peer
  shutting down may first answer what it drops with a "connection closed" error (the MCP
  SDK does): that is AnswerLost too, not the peer's error.

The errors are butlers.errors' McpCallError family: their messages are plain enough to show;
an owner that knows better words for its readers (the gateway names the child and its
timeout setting) raises the same class again with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from mcp_types.jsonrpc import CONNECTION_CLOSED, JSONRPC_VERSION, METHOD_NOT_FOUND
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION

from butlers.errors import AnswerLost, CallTimedOut, ConnectionClosed, McpCallError, RemoteError
from butlers.mcp_connection.paging import PageGuard

logger = logging.getLogger(__name__)

Message = dict[str, Any]
TOOLS_CHANGED = "notifications/tools/list_changed"
# Servers ping an idle event stream (the MCP SDK's every 15 s). A stream silent for longer
# than this is a connection that died without a word (a NAT or proxy dropped it, the host
# went away): every call on it would wait out its whole timeout. (Here, not in sse.py: the
# pool reads it without loading aiohttp until it first calls over the network.)
IDLE_STREAM_S = 45.0
# How long close() lets replies and cancellations already on their way finish: the peer
# should hear that we gave up on a request even when we close right after.
CLOSE_GRACE_S = 1.0


# One message (a line, or a framed body, or an SSE event) a server may send; past it the
# connection is lost and its owner starts it again. A tool result relaying a file or a page
# is well under it, and the butler's own tools take at most 22 MiB of files; without it a
# child that never ended a line (or announced Content-Length: 99999999999999), or a remote
# server's event stream without a line break, was buffered for ever (red teams).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class MessageTooLarge(ValueError):
    """A server's message over MAX_MESSAGE_BYTES (the connection is given up)."""


class Connection(Protocol):
    """What an owner needs of one open connection, whatever its transport (McpConnection's
    subclasses, and streamable.FastMcpConnection): the pool (route, notify, the dashboard) and
    the gateway's children hold one of these. Opening is not in it: each transport takes
    different things to open (a URL's timeout, a child's client info), and its owner knows
    which transport it made."""

    @property
    def is_open(self) -> bool: ...  # read-only in every kind

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, str] | None = None,
        timeout_s: float | None,
    ) -> Message: ...

    async def list_tools(self, *, timeout_s: float | None) -> list[dict[str, Any]]: ...

    async def request(
        self, method: str, params: dict[str, Any], *, timeout_s: float | None
    ) -> Message: ...

    @property
    def server_capabilities(self) -> dict[str, Any]: ...  # offered in the handshake

    def retire(self) -> None: ...

    async def close(self) -> None: ...


class McpConnection:
    """The protocol half of a connection; a transport subclass provides the bytes.

    `on_tools_changed()` is called when the peer says its tool list changed; `on_closed(reason)`
    when the connection ends by itself (not when its owner calls `close()`). Both run on the
    event loop inside the transport's reader: keep them short, do not await there.
    """

    def __init__(
        self,
        *,
        label: str,
        on_tools_changed: Callable[[], None] | None = None,
        on_closed: Callable[[str], None] | None = None,
    ) -> None:
        self.label = label  # who the peer is, in messages and task names
        self.on_tools_changed = on_tools_changed
        self.on_closed = on_closed
        # Set by an owner that wants the peer's other notifications (progress, log messages).
        self.on_notification: Callable[[str, dict[str, Any]], None] | None = None
        # Client capabilities offered in the handshake, and the owner's answers to the peer's
        # requests they promise (a result, or None: "method not found"). Default: none.
        self.capabilities: dict[str, Any] = {}
        self.on_request: Callable[[str, dict[str, Any]], Message | None] | None = None
        self.server_capabilities: dict[str, Any] = {}  # what the peer offered (prompts...)
        self.protocol_version: str | None = None  # agreed in the handshake
        self.server_info: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._ready = False  # the handshake completed
        self._closed_reason: str | None = None
        self._closing = False  # the owner called close(): it needs no on_closed
        self._retired = False
        self._outgoing: set[asyncio.Task[None]] = set()  # replies and cancellations

    # -- what a transport provides ---------------------------------------------------------

    async def _send(self, message: Message) -> None:
        """Send one message; raise ConnectionClosed if it could not be sent."""
        raise NotImplementedError

    async def _close_transport(self) -> None:
        """Stop reading and release the transport (by close(); again if close() is)."""

    # -- state -------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        """The handshake completed and the connection has not closed since."""
        return self._ready and self._closed_reason is None

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

    # -- requests ----------------------------------------------------------------------------

    async def initialize(self, client_info: dict[str, str], *, timeout_s: float | None) -> Message:
        """The MCP handshake; the server's `initialize` result. Raises ConnectionClosed when
        the server answers a protocol revision we do not speak (the caller closes)."""
        result = await self.request(
            "initialize",
            {
                "protocolVersion": LATEST_HANDSHAKE_VERSION,
                "capabilities": self.capabilities,
                "clientInfo": client_info,
            },
            timeout_s=timeout_s,
        )
        version = result.get("protocolVersion")
        if version not in HANDSHAKE_PROTOCOL_VERSIONS:
            raise ConnectionClosed(f"{self.label} offered unsupported protocol version {version!r}")
        self.protocol_version = version
        self.server_info = result.get("serverInfo") or {}
        self.server_capabilities = result.get("capabilities") or {}
        await self.notify("notifications/initialized")
        self._ready = True
        return result

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, str] | None = None,
        timeout_s: float | None,
    ) -> Message:
        """The `CallToolResult` as JSON (a tool's error is a result with `isError`, not a raise)."""
        params: dict[str, Any] = {"name": name, "arguments": arguments}
        if meta:
            params["_meta"] = meta
        return await self.request("tools/call", params, timeout_s=timeout_s)

    async def list_tools(self, *, timeout_s: float | None) -> list[dict[str, Any]]:
        """Every tool, as JSON, following `nextCursor` within the bounds of
        butlers.mcp_connection.paging (`timeout_s` for the whole list, as for each page)."""
        tools: list[dict[str, Any]] = []
        cursor = None
        guard = PageGuard(self.label, "tools/list")
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    result = await self.request(
                        "tools/list", {"cursor": cursor} if cursor else {}, timeout_s=timeout_s
                    )
                    tools.extend(result.get("tools") or [])
                    cursor = result.get("nextCursor")
                    guard.check(cursor, len(tools))
                    if not cursor:
                        return tools
        except TimeoutError:
            raise CallTimedOut(
                f"{self.label}: its tools/list did not end within {timeout_s:g} s "
                f"({guard.pages} pages)"
            ) from None

    async def request(
        self, method: str, params: dict[str, Any] | None = None, *, timeout_s: float | None
    ) -> Message:
        """Send a request and wait for its `result` (`timeout_s=None`: no limit).

        Raises ConnectionClosed (not sent: safe to send again elsewhere), AnswerLost (sent,
        then the connection ended), CallTimedOut, or RemoteError (the peer's JSON-RPC error).
        """

        async def send(request_id: int) -> None:
            message: Message = {"jsonrpc": JSONRPC_VERSION, "id": request_id, "method": method}
            if params is not None:
                message["params"] = params
            await self._send(message)

        def withdraw(request_id: int, reason: str) -> None:
            self._withdraw(request_id, method, reason)

        return await self._exchange(send, withdraw, timeout_s=timeout_s)

    async def _exchange(
        self,
        start: Callable[[int], Awaitable[None]],
        give_up: Callable[[int, str], None],
        *,
        timeout_s: float | None,
    ) -> Message:
        """One request's life, however it travels: `start(id)` sets it off, its answer comes
        to `_received` under that id, and `give_up(id, why)` is told when its caller stops
        waiting (timed out, cancelled). Raises what `request` raises."""
        if self._closed_reason is not None:
            raise ConnectionClosed(self._closed_reason)
        request_id = next(self._ids)
        answer: asyncio.Future[Message] = quiet_future()
        self._pending[request_id] = answer
        try:
            async with asyncio.timeout(timeout_s):
                await start(request_id)
                reply = await answer
        except (TimeoutError, asyncio.CancelledError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            give_up(request_id, "timed out" if timed_out else "cancelled")
            if timed_out:
                raise CallTimedOut(no_answer_within(timeout_s)) from None
            raise
        finally:
            del self._pending[request_id]
            if self._retired and not self._pending:
                self._spawn(self.close(), "close")
        if "error" in reply:
            error = reply["error"] or {}
            code, text = int(error.get("code", 0)), str(error.get("message", ""))
            if code == CONNECTION_CLOSED:  # the MCP SDK's answer to what it drops on shutdown
                raise AnswerLost(f"{self.label} closed the connection before answering ({text})")
            raise RemoteError(code, text)
        return reply.get("result") or {}

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        """Send a notification (no answer comes); raises ConnectionClosed if it was not sent."""
        message: Message = {"jsonrpc": JSONRPC_VERSION, "method": method}
        if params is not None:
            message["params"] = params
        await self._send(message)

    def _withdraw(self, request_id: int, method: str, reason: str) -> None:
        """Tell the peer to stop working on a request we gave up on."""
        if self._closed_reason is None and method != "initialize":
            cancelled: Message = {
                "jsonrpc": JSONRPC_VERSION,
                "method": "notifications/cancelled",
                "params": {"requestId": request_id, "reason": reason},
            }
            self._spawn(self._send_quietly(cancelled), "cancel")

    # -- what arrives --------------------------------------------------------------------------

    def _received(self, message: Any) -> None:
        """One message from the peer: an answer, a request, or a notification."""
        if not isinstance(message, dict):
            return
        method = message.get("method")
        if method is None:  # an answer to one of ours
            request_id = message.get("id")
            answer = self._pending.get(request_id) if type(request_id) is int else None
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif "id" in message:  # the peer's request: it waits for our answer
            reply: Message = {"jsonrpc": JSONRPC_VERSION, "id": message["id"]}
            params = message.get("params")
            result = self._answer(method, params if isinstance(params, dict) else {})
            if result is not None:
                reply["result"] = result
            else:
                reply["error"] = {
                    "code": METHOD_NOT_FOUND,
                    "message": f"Method not found: {method}",
                }
            self._spawn(self._send_quietly(reply), "reply")
        elif method == TOOLS_CHANGED and self.on_tools_changed is not None:
            try:
                self.on_tools_changed()
            except Exception:  # the owner's bug must not end our reader
                logger.exception("on_tools_changed of %s failed", self.label)
        elif self.on_notification is not None:
            params = message.get("params")
            try:
                self.on_notification(method, params if isinstance(params, dict) else {})
            except Exception:
                logger.exception("on_notification of %s failed", self.label)

    def _answer(self, method: str, params: dict[str, Any]) -> Message | None:
        """Our result for a request of the peer's, or None when we do not offer the method."""
        if method == "ping":
            return {}
        if self.on_request is None:
            return None
        try:
            return self.on_request(method, params)
        except Exception:  # the owner's bug must not end our reader
            logger.exception("on_request of %s failed", self.label)
            return None

    def _lost(self, reason: str) -> None:
        """The connection ended (or is being closed): fail every waiting request, refuse new
        ones, and tell the owner if it did not close it itself. The first reason stays."""
        first = self._closed_reason is None
        if first:
            self._closed_reason = reason
        else:
            reason = self._closed_reason or reason
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(AnswerLost(reason))
        if first and not self._closing and self.on_closed is not None:
            try:
                self.on_closed(reason)
            except Exception:
                logger.exception("on_closed of %s failed", self.label)

    # -- closing -------------------------------------------------------------------------------

    def retire(self) -> None:
        """No new requests will come (the owner moved on to a new connection): close this one
        as soon as the requests still waiting on it have their answers."""
        self._retired = True
        if not self._pending:
            self._spawn(self.close(), "close")

    async def close(self) -> None:
        """Fail what is still waiting, let replies and cancellations on their way finish
        (briefly), then release the transport. Safe to call more than once."""
        self._closing = True
        self._lost("the connection was closed")
        current = asyncio.current_task()
        outgoing = [task for task in self._outgoing if task is not current]
        if outgoing:
            _, late = await asyncio.wait(outgoing, timeout=CLOSE_GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self._close_transport()

    # -- helpers -------------------------------------------------------------------------------

    async def _send_quietly(self, message: Message) -> None:
        """For messages nobody waits on (replies, cancellations): if this fails, the
        connection is gone, and the next request on it says so."""
        with contextlib.suppress(McpCallError):
            await self._send(message)

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"mcp:{self.label}:{what}")
        self._outgoing.add(task)
        task.add_done_callback(self._outgoing.discard)


def no_answer_within(timeout_s: float | None) -> str:
    """CallTimedOut's message: "no answer within 0.3s"."""
    return "no answer" if timeout_s is None else f"no answer within {timeout_s:g}s"


def quiet_future() -> asyncio.Future[Any]:
    """A future whose failure nobody may await (its caller gave up first) without asyncio
    reporting "exception was never retrieved"."""
    future = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


def unwrap(result: dict[str, Any]) -> Any:
    """A tool's answer (a `CallToolResult` as JSON): its structured content, else its text.

    Route, notify and the CLI's client commands read answers with it; it lives here, not in
    the switchboard, so a client command does not import the switchboard (1.4 s -> 0.5 s for
    `butlers list`, bench/cli_startup.py)."""
    structured = result.get("structuredContent")
    if structured is not None:
        fastmcp_meta = (result.get("_meta") or {}).get("fastmcp")
        wrapped = isinstance(fastmcp_meta, dict) and fastmcp_meta.get("wrap_result")
        return structured.get("result") if wrapped and isinstance(structured, dict) else structured
    blocks = result.get("content") or []
    return "\n".join(b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text")
