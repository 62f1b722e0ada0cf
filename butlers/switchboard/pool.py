"""Kept-open MCP client sessions, one per target endpoint.

A fresh connect + initialize costs about ten times a call on an open session, so sessions are
opened lazily, shared by every caller (MCP multiplexes concurrent requests on one session),
re-opened once when the connection turns out to be closed (the target restarted), and closed
when the switchboard stops. Endpoints ending in `/sse` (every butler's) get our lean
`SseConnection`; anything else (`/mcp`, streamable HTTP) goes through FastMCP's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import Any, Protocol

import aiohttp
from fastmcp import Client
from mcp.shared.exceptions import MCPError

from butlers.errors import (
    AnswerLost,
    ButlersError,
    CallTimedOut,
    ConnectionClosed,
    RemoteError,
    TargetUnreachable,
)
from butlers.mcp_connection.sse import IDLE_STREAM_S, SseConnection

logger = logging.getLogger(__name__)

CONNECTION_CLOSED = -32000
CONNECT_TIMEOUT_S = 10.0


class Session(Protocol):
    @property
    def is_open(self) -> bool: ...  # read-only in both kinds

    async def open(self, timeout_s: float) -> None: ...

    def retire(self) -> None: ...

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, meta: dict[str, str] | None, timeout_s: float
    ) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class McpClientPool:
    def __init__(
        self, *, auth_token: str | None = None, idle_stream_s: float = IDLE_STREAM_S
    ) -> None:
        self.auth_token = auth_token
        self.idle_stream_s = idle_stream_s
        self._sessions: dict[str, Session] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self.connects = 0  # how many sessions were opened, for tests and benchmarks

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

        A kept session found closed (the target restarted) is re-opened once and the call sent
        again: it never reached the target. A call whose connection broke after it was
        delivered is not repeated; its tool may have run.
        """
        for attempt in (1, 2):
            session = await self._session(url)
            try:
                return await session.call_tool(tool, arguments, meta=meta, timeout_s=timeout_s)
            except CallTimedOut:
                # A session that let a call time out may be stuck: new calls get a fresh one,
                # and the old one closes once the calls still waiting on it are answered.
                self._retire(url, session)
                raise
            except AnswerLost as exc:
                await self._discard(url, session)
                raise TargetUnreachable(
                    f"the connection was lost before {tool!r} answered ({exc}); "
                    "it may or may not have run"
                ) from exc
            except ConnectionClosed as exc:
                await self._discard(url, session)
                if attempt == 2:
                    raise TargetUnreachable(f"the connection was closed ({exc})") from exc
                logger.info(
                    "session to %s was closed; reconnecting once",
                    url,
                    extra={"action": "pool_reconnect"},
                )
        raise AssertionError("unreachable")

    async def _session(self, url: str) -> Session:
        if self._closed:
            raise ButlersError("the MCP client pool is closed")
        session = self._sessions.get(url)
        if session is not None and session.is_open:
            return session
        async with self._locks[url]:
            session = self._sessions.get(url)
            if session is not None and session.is_open:
                return session
            if session is not None:
                await self._discard(url, session)
            session = await self._open(url)
            self.connects += 1
            self._sessions[url] = session
            return session

    async def _open(self, url: str) -> Session:
        if url.rstrip("/").endswith("/sse"):
            if self._http is None:
                self._http = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S),
                    cookie_jar=aiohttp.DummyCookieJar(),  # MCP does not use cookies
                )
            session: Session = SseConnection(
                url, self._http, auth_token=self.auth_token, idle_stream_s=self.idle_stream_s
            )
        else:
            session = FastMcpSession(url, auth_token=self.auth_token)
        try:
            await session.open(CONNECT_TIMEOUT_S)
        except TimeoutError as exc:
            await session.close()
            raise TargetUnreachable(f"no answer within {CONNECT_TIMEOUT_S:g}s") from exc
        except Exception as exc:
            await session.close()
            raise TargetUnreachable(_reason(exc)) from exc
        return session

    def _retire(self, url: str, session: Session) -> None:
        if self._sessions.get(url) is session:
            del self._sessions[url]
            session.retire()

    async def _discard(self, url: str, session: Session) -> None:
        if self._sessions.get(url) is session:
            del self._sessions[url]
        with contextlib.suppress(Exception):
            await session.close()

    async def close(self) -> None:
        self._closed = True
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            with contextlib.suppress(Exception):
                await session.close()
        if self._http is not None:
            await self._http.close()


class FastMcpSession:
    """Any other transport (streamable HTTP): FastMCP's client behind the same interface."""

    def __init__(self, url: str, *, auth_token: str | None) -> None:
        self._client = Client(url, auth=auth_token, init_timeout=CONNECT_TIMEOUT_S)

    @property
    def is_open(self) -> bool:
        return self._client.is_connected()

    async def open(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._client.__aenter__(), timeout_s)

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, meta: dict[str, str] | None, timeout_s: float
    ) -> dict[str, Any]:
        try:
            result = await self._client.call_tool_mcp(name, arguments, timeout=timeout_s)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                raise ConnectionClosed(str(exc.message)) from exc
            if "timed out" in str(exc.message):
                raise CallTimedOut(f"no answer within {timeout_s:g}s") from exc
            raise RemoteError(exc.code, str(exc.message)) from exc
        return result.model_dump(mode="json", by_alias=True, exclude_none=True)

    def retire(self) -> None:
        self._closing = asyncio.get_running_loop().create_task(self._client.close())

    async def close(self) -> None:
        await self._client.close()


def _reason(exc: BaseException) -> str:
    """The innermost cause, e.g. 'Connect call failed' for a refused port."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return text.removeprefix("Client failed to connect: ") or type(exc).__name__
