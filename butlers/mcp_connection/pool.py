"""Kept-open MCP connections to other butlers, one per target endpoint.

A fresh connect + initialize costs about ten times a call on an open connection, so
connections are opened lazily, shared by every caller (MCP multiplexes concurrent requests on
one connection), re-opened once when one turns out to be closed (the target restarted), and
closed with their owner: the switchboard (route, and the dashboard's fleet probe), or a butler
(its `notify` to the switchboard). An endpoint served by this same process (`serve_locally`:
`butlers up` runs the fleet in one) gets a `LocalConnection`, without HTTP; other endpoints
ending in `/sse` (every butler's) our lean `SseConnection`; anything else (`/mcp`, streamable
HTTP) `FastMcpConnection`, FastMCP's client. All raise the McpCallError family, so the pool
reads their failures one way: only a call that was never sent (ConnectionClosed) is sent
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from butlers.errors import (
    AnswerLost,
    ButlersError,
    CallTimedOut,
    ConnectionClosed,
    TargetUnreachable,
)
from butlers.mcp_connection.core import IDLE_STREAM_S, Connection
from butlers.mcp_connection.local import LocalConnection
from butlers.mcp_connection.proof import UNPROVEN_HINT, Unproven, check_holds_token

# aiohttp (and with it the SSE transport) loads when a butler is first called over the network,
# not when a butler starts: ~70 ms of a warm `butlers up` (bench/startup.py), which every
# butler's notify link and the switchboard build a pool for.
if TYPE_CHECKING:  # FastMCP's client loads when a non-`/sse` endpoint is first called
    import aiohttp
    from fastmcp import FastMCP

    from butlers.mcp_connection.sse import SseConnection
    from butlers.mcp_connection.streamable import FastMcpConnection

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


class McpConnections:
    """One kept-open connection per endpoint URL, opened by the first `call()` to it; its
    owner (the switchboard, or a butler's notify) ends them all with `close()`."""

    def __init__(
        self, *, auth_token: str | None = None, idle_stream_s: float = IDLE_STREAM_S
    ) -> None:
        self.auth_token = auth_token
        self.idle_stream_s = idle_stream_s
        self._connections: dict[str, Connection] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self._local: dict[str, FastMCP[Any]] = {}  # endpoint URL -> the server of this process
        self.connects = 0  # how many connections were opened, for tests and benchmarks

    async def call(
        self,
        url: str,
        tool: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, str] | None = None,
        timeout_s: float,
    ) -> dict[str, Any]:
        """The target's `CallToolResult` as JSON.

        A kept connection found closed (the target restarted) is re-opened once and the call
        sent again: it never reached the target. A call whose connection broke after it was
        delivered is not repeated; its tool may have run.
        """
        # Opening a connection counts against a short call's own timeout too: a target that
        # accepts and never answers held a 3 s dashboard probe for the 10 s connect timeout.
        connect_timeout_s = min(CONNECT_TIMEOUT_S, timeout_s)
        for attempt in (1, 2):
            connection = await self._connection(url, connect_timeout_s)
            try:
                return await connection.call_tool(tool, arguments, meta=meta, timeout_s=timeout_s)
            except CallTimedOut:
                # A connection that let a call time out may be stuck: new calls get a fresh
                # one, and the old one closes once the calls still waiting on it are answered.
                self._retire(url, connection)
                raise
            except AnswerLost as exc:
                await self._discard(url, connection)
                raise TargetUnreachable(
                    f"the connection was lost before {tool!r} answered ({exc}); "
                    "it may or may not have run"
                ) from exc
            except ConnectionClosed as exc:
                await self._discard(url, connection)
                if attempt == 2:
                    raise TargetUnreachable(f"the connection was closed ({exc})") from exc
                logger.info(
                    "connection to %s was closed; reconnecting once",
                    url,
                    extra={"action": "mcp_reconnect"},
                )
        raise AssertionError("unreachable")

    def serve_locally(self, urls: list[str], server: FastMCP[Any]) -> None:
        """Calls to these endpoint URLs go to `server` in this process, not over HTTP."""
        for url in urls:
            self._local[url] = server

    async def stop_serving_locally(self, server: FastMCP[Any]) -> None:
        """`server` is stopping: its URLs are reached over the network again (where nothing
        answers now: the target is down), and a connection open to it in this process is
        closed; its calls still waiting fail as for a target that went down."""
        for url in [url for url, local in self._local.items() if local is server]:
            del self._local[url]
            if (connection := self._connections.get(url)) is not None:
                await self._discard(url, connection)

    async def _connection(self, url: str, connect_timeout_s: float) -> Connection:
        if self._closed:
            raise ButlersError("the switchboard's MCP connections are closed")
        connection = self._connections.get(url)
        if connection is not None and connection.is_open:
            return connection
        async with self._locks[url]:
            connection = self._connections.get(url)
            if connection is not None and connection.is_open:
                return connection
            if connection is not None:
                await self._discard(url, connection)
            connection = await self._open(url, connect_timeout_s)
            self.connects += 1
            self._connections[url] = connection
            return connection

    async def _open(self, url: str, timeout_s: float) -> Connection:
        connection: LocalConnection | SseConnection | FastMcpConnection
        if (server := self._local.get(url)) is not None:
            connection = LocalConnection(server, label=url)
        elif url.rstrip("/").endswith("/sse"):
            import aiohttp

            from butlers.mcp_connection.sse import SseConnection

            if self._http is None:
                self._http = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S),
                    cookie_jar=aiohttp.DummyCookieJar(),  # MCP does not use cookies
                )
            connection = SseConnection(
                url, self._http, auth_token=self.auth_token, idle_stream_s=self.idle_stream_s
            )
        else:
            from butlers.mcp_connection.streamable import FastMcpConnection

            connection = FastMcpConnection(url, auth_token=self.auth_token)
        try:
            if server is None:  # (over the network: the token goes to its holder only)
                await check_holds_token(url, self.auth_token)
            await connection.open(timeout_s)
        except BaseException as exc:
            # FastMCP's client raises its connect error again when closed after failing to
            # open: the reason to report is the first one. A caller that gave up (cancelled)
            # leaves no half-open connection behind either.
            with contextlib.suppress(Exception):
                await asyncio.shield(connection.close())
            if not isinstance(exc, Exception):
                raise
            if isinstance(exc, Unproven):
                raise TargetUnreachable(f"{exc}: not connected to ({UNPROVEN_HINT})") from exc
            if isinstance(exc, TimeoutError):
                raise TargetUnreachable(f"no answer within {timeout_s:g}s") from exc
            raise TargetUnreachable(_reason(exc)) from exc
        return connection

    def _retire(self, url: str, connection: Connection) -> None:
        if self._connections.get(url) is connection:
            del self._connections[url]
            connection.retire()

    async def _discard(self, url: str, connection: Connection) -> None:
        if self._connections.get(url) is connection:
            del self._connections[url]
        with contextlib.suppress(Exception):
            await connection.close()

    async def close(self) -> None:
        self._closed = True
        connections, self._connections = self._connections, {}
        for connection in connections.values():
            with contextlib.suppress(Exception):
                await connection.close()
        if self._http is not None:
            await self._http.close()


def _reason(exc: BaseException) -> str:
    """The innermost cause, e.g. 'Connect call failed' for a refused port."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return text.removeprefix("Client failed to connect: ") or type(exc).__name__
