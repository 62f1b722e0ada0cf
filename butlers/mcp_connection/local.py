"""One MCP connection to a butler served by this same process (`butlers up` runs the fleet in
one), without HTTP.

Why: a routed call crosses two full MCP servers, and the target's HTTP half (aiohttp's POST,
uvicorn, Starlette, the bearer check, the SDK's SSE transport and its framing) cost as much
CPU as the rest of the hop (bench/route_overhead.py, docs/benchmarks.md). In one process
those layers carry a message from one object to another. What stays is what a butler's
server decides: FastMCP's dispatch with the butler's middleware, i.e. its guards, approvals
and trace span.

A tool call (what route sends) is FastMCP's own `call_tool`, its public API: the middleware,
the tool lookup, argument validation, error masking. It runs in a task of its own, and its
outcome is made into the `CallToolResult` the wire carries as FastMCP's handler and the SDK
make it (`_outcome`, then the SDK's own shaping for the connection's protocol revision);
tests/test_local_connection.py holds every kind of answer to what the same call through an
MCP session gets. Why not through the session as well: the session cost 215 us of CPU a
call on top of FastMCP's 128 us (eleven turns of the event loop: memory streams, a task per
request, the request's validation, the answer's serialization), a third of what route added
to a direct call (docs/benchmarks.md). What this cannot give a tool: a FastMCP `Context` with
a session (logging or progress to the caller); no butler tool takes one. Everything else
(the handshake, listing tools) goes through the target's MCP session, served exactly as
FastMCP serves one SSE connection (`Server.run` on a pair of memory streams).

What the wire had and this has not: the request's HTTP headers. A caller route forwards for
sends none that a butler reads (no session credential, no classification claim), and the
bearer token proves a network caller is one of ours: a call from inside the process already
is. A call and the session each run in a fresh `contextvars.Context` (only the target's name
for its log records), so nothing of the task that made the call (the inbound request to the
switchboard, its headers, its span, an approved call's conversation) reaches the target's
handlers; trace context travels in `_trace_context` and `_meta`, as over the wire, the
call's `_meta` in `LOCAL_CALL_META` (butlers.mcp_middleware), where the butler's middleware
reads it when FastMCP has no request of its own. The session's streams must stay plain
anyio ones: the SDK runs each handler in the context a message was sent from when the stream
carries one (its own memory transport's does), which would hand every caller's context to
the target (tests/test_route_in_process.py sends a stranger's headers and `_meta`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types
from fastmcp.exceptions import DisabledError, FastMCPError, NotFoundError
from fastmcp.tools.base import ToolResult
from mcp.shared.jsonrpc_dispatcher import handler_exception_to_error_data
from mcp.shared.message import SessionMessage
from mcp_types import ErrorData
from mcp_types.jsonrpc import CONNECTION_CLOSED
from mcp_types.methods import serialize_server_result

from butlers import __version__
from butlers.errors import ConnectionClosed
from butlers.logs import context_of_butler
from butlers.mcp_connection.core import McpConnection, Message
from butlers.mcp_middleware import LOCAL_CALL_META

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
    from fastmcp import FastMCP

logger = logging.getLogger(__name__)

CLIENT_INFO = {"name": "butlers-switchboard-local", "version": __version__}
# Messages in flight each way before a sender waits (the SDK's own memory transport: 1).
STREAM_BUFFER = 64
# How long close() waits for the target's session to end, then for its cancelled handlers: a
# sync tool runs in a thread, which no cancel stops, and the switchboard's stop must not wait
# on it (over the wire it never did).
CLOSE_WAIT_S = 1.0


class LocalConnection(McpConnection):
    """A connection to `server`, a FastMCP server of this process: `open()` starts serving
    it one session (in a task of its own, in an empty context), `call_tool` calls it without
    that session, `close()` ends the session and the calls still running."""

    def __init__(self, server: FastMCP[Any], *, label: str) -> None:
        super().__init__(label=label)
        self.server = server
        self._to_server: MemoryObjectSendStream[SessionMessage | Exception] | None = None
        self._from_server: MemoryObjectReceiveStream[SessionMessage] | None = None
        self._serving: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Task[None]] = {}  # tool calls running, by request id

    async def open(self, timeout_s: float) -> None:
        to_server, server_reads = anyio.create_memory_object_stream[SessionMessage | Exception](
            STREAM_BUFFER
        )
        server_writes, from_server = anyio.create_memory_object_stream[SessionMessage](
            STREAM_BUFFER
        )
        self._to_server, self._from_server = to_server, from_server
        lowlevel = self.server._mcp_server  # what FastMCP's own SSE app and memory client run
        self._serving = asyncio.get_running_loop().create_task(
            lowlevel.run(server_reads, server_writes, lowlevel.create_initialization_options()),
            name=f"mcp:{self.label}:serve",
            context=context_of_butler(self.server.name),  # nothing of the opener's request
        )
        self._serving.add_done_callback(self._served)
        self._reading = asyncio.get_running_loop().create_task(
            self._read(from_server), name=f"mcp:{self.label}:read"
        )
        await self.initialize(CLIENT_INFO, timeout_s=timeout_s)

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, str] | None = None,
        timeout_s: float | None,
    ) -> Message:
        """The `CallToolResult` as JSON, from FastMCP's `call_tool` (see the module's
        docstring); a caller that stops waiting cancels the call, as over the wire."""
        if self.protocol_version is None:  # the result is shaped for the agreed revision
            raise ConnectionClosed(f"{self.label}: not open")
        version = self.protocol_version

        async def start(request_id: int) -> None:
            context = context_of_butler(self.server.name)  # nothing of the caller's request
            context.run(LOCAL_CALL_META.set, dict(meta) if meta else None)
            call = asyncio.get_running_loop().create_task(
                self._call(request_id, name, arguments, version),
                name=f"mcp:{self.label}:call",
                context=context,
            )
            self._calls[request_id] = call
            call.add_done_callback(lambda _: self._calls.pop(request_id, None))

        def give_up(request_id: int, _reason: str) -> None:
            if (call := self._calls.get(request_id)) is not None:
                call.cancel()

        return await self._exchange(start, give_up, timeout_s=timeout_s)

    async def _call(
        self, request_id: int, name: str, arguments: dict[str, Any], version: str
    ) -> None:
        answer: Message = {"jsonrpc": "2.0", "id": request_id}
        try:
            try:
                result = _outcome(await self.server.call_tool(name, arguments))
            except (DisabledError, NotFoundError):
                result = _error_result(f"Unknown tool: {name!r}")
            except FastMCPError as exc:  # masked by FastMCP already, as for the wire
                result = _error_result(str(exc))
            # What the SDK sends on a connection of this protocol revision.
            answer["result"] = serialize_server_result("tools/call", version, result)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # its caller gave up, or close()
                raise
            # The tool itself ended cancelled (it raised CancelledError, or awaited what
            # someone else cancelled): its caller hears at once that no answer will come.
            answer["error"] = {"code": CONNECTION_CLOSED, "message": "Connection closed"}
        except Exception as exc:  # what the SDK answers for a handler that raised
            error = handler_exception_to_error_data(exc)  # MCPError; pydantic's, without text
            if error is None:
                logger.exception("%s: tools/call of %r raised", self.label, name)
                error = ErrorData(code=0, message=str(exc))
            answer["error"] = error.model_dump(by_alias=True, mode="json", exclude_none=True)
        self._received(answer)

    async def _send(self, message: Message) -> None:
        if self._to_server is None:
            raise ConnectionClosed(f"{self.label}: not open")
        try:
            parsed = mcp_types.jsonrpc_message_adapter.validate_python(message, by_name=False)
            await self._to_server.send(SessionMessage(parsed))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise ConnectionClosed(f"{self.label}: the session ended") from exc

    async def _read(self, from_server: MemoryObjectReceiveStream[SessionMessage]) -> None:
        dump = mcp_types.jsonrpc_message_adapter.dump_python
        try:
            async for item in from_server:
                self._received(dump(item.message, by_alias=True, mode="json", exclude_unset=True))
        except (anyio.ClosedResourceError, anyio.EndOfStream):
            pass
        self._lost(f"{self.label}: the session ended")

    def _served(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("%s: the in-process session failed: %r", self.label, exc)
        self._lost(f"{self.label}: the session ended")

    async def _close_transport(self) -> None:
        if self._to_server is not None:
            self._to_server.close()  # the server's loop ends at the end of its stream
        calls = list(self._calls.values())
        for call in calls:  # as the session cancels its handlers when it ends
            call.cancel()
        tasks = [t for t in (self._serving, self._reading, *calls) if t is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            for task in late:
                task.cancel()
            if late:
                _, stuck = await asyncio.wait(late, timeout=CLOSE_WAIT_S)
                if stuck:
                    logger.warning(
                        "%s: the in-process session did not end within %g s of its close "
                        "(a tool still running); left to finish",
                        self.label,
                        2 * CLOSE_WAIT_S,
                    )
        if self._from_server is not None:
            self._from_server.close()


def _outcome(result: Any) -> Message:
    """A ToolResult as FastMCP's handler answers it: the `CallToolResult` it makes of it
    (`to_mcp_result()` gives that, a bare content list, or content and structured content),
    dumped as the SDK dumps a result before shaping it for the connection's revision. What
    is not a ToolResult (an extension's own result) is passed on as the handler does."""
    if not isinstance(result, ToolResult):
        return result.model_dump(by_alias=True, mode="json", exclude_none=True)
    mcp_result = result.to_mcp_result()
    if isinstance(mcp_result, tuple):
        content, structured = mcp_result
        mcp_result = mcp_types.CallToolResult(content=content, structured_content=structured)
    elif not isinstance(mcp_result, mcp_types.CallToolResult):
        mcp_result = mcp_types.CallToolResult(content=mcp_result)
    return mcp_result.model_dump(by_alias=True, mode="json", exclude_none=True)


def _error_result(text: str) -> Message:
    """A tool's failure as FastMCP's handler answers it: an error result, not a raise."""
    failure = mcp_types.CallToolResult(
        content=[mcp_types.TextContent(type="text", text=text)], is_error=True
    )
    return failure.model_dump(by_alias=True, mode="json", exclude_none=True)
