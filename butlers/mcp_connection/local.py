"""One MCP connection to a butler served by this same process (`butlers up` runs the fleet in
one), without HTTP.

Why: a routed call crosses two full MCP servers, and the target's HTTP half (aiohttp's POST,
uvicorn, Starlette, the bearer check, the SDK's SSE transport and its framing) cost as much
CPU as the rest of the hop (bench/route_overhead.py, docs/benchmarks.md). In one process
those layers carry a message from one object to another. What stays is what a butler's
server decides: the SDK's session (the handshake, JSON-RPC validation, cancellation) and
FastMCP's dispatch with the butler's middleware, i.e. its guards, approvals and trace span.
The target is served exactly as FastMCP serves one SSE connection (`Server.run` on a pair of
streams), so a call through here is answered as the same call over the wire would be.

What the wire had and this has not: the request's HTTP headers. A caller route forwards for
sends none that a butler reads (no session credential, no classification claim), and the
bearer token proves a network caller is one of ours: a call from inside the process already
is. The server runs in a fresh `contextvars.Context` (only the target's name for its log
records), so nothing of the task that opened the connection (the inbound request to the
switchboard, its headers, its span, an approved call's conversation) reaches the target's
handlers; trace context travels in `_trace_context` and `_meta`, as over the wire. The streams
must stay plain anyio ones: the SDK runs each handler in the context a message was sent from
when the stream carries one (its own memory transport's does), which would hand every
caller's context to the target (tests/test_route_in_process.py sends a stranger's headers and
`_meta`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types
from mcp.shared.message import SessionMessage

from butlers import __version__
from butlers.errors import ConnectionClosed
from butlers.logs import context_of_butler
from butlers.mcp_connection.core import McpConnection, Message

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
    it one session (in a task of its own, in an empty context), `close()` ends that session."""

    def __init__(self, server: FastMCP[Any], *, label: str) -> None:
        super().__init__(label=label)
        self.server = server
        self._to_server: MemoryObjectSendStream[SessionMessage | Exception] | None = None
        self._from_server: MemoryObjectReceiveStream[SessionMessage] | None = None
        self._serving: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None

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
        tasks = [t for t in (self._serving, self._reading) if t is not None]
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
