"""Kept-open MCP client sessions, one per target endpoint.

A fresh connect + initialize costs about ten times a call on an open session, so sessions are
opened lazily, shared by every caller (MCP multiplexes concurrent requests on one session),
re-opened once when the connection turns out to be closed (the target restarted), and closed
when the switchboard stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import Any

import mcp_types
from fastmcp import Client
from mcp.shared.exceptions import MCPError

from butlers.errors import ButlersError

logger = logging.getLogger(__name__)

CONNECTION_CLOSED = -32000
CONNECT_TIMEOUT_S = 10.0


class TargetUnreachable(ButlersError):
    """The target's endpoint refused, dropped or never answered the connection."""


class TargetTimeout(ButlersError):
    """The target accepted the call but did not answer within the timeout."""


class McpClientPool:
    def __init__(self, *, auth_token: str | None = None) -> None:
        self.auth_token = auth_token
        self._clients: dict[str, Client] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False
        self.connects = 0  # how many sessions were opened, for tests and benchmarks

    async def call(
        self, url: str, tool: str, arguments: dict[str, Any], *, timeout_s: float
    ) -> mcp_types.CallToolResult:
        """Call `tool` on the endpoint; reconnects once if the kept session was closed."""
        client = await self._session(url)
        try:
            return await self._call(client, tool, arguments, timeout_s)
        except _Closed:
            logger.info(
                "session to %s was closed; reconnecting once",
                url,
                extra={"action": "pool_reconnect"},
            )
            await self._discard(url, client)
        client = await self._session(url)
        try:
            return await self._call(client, tool, arguments, timeout_s)
        except _Closed as exc:
            await self._discard(url, client)
            raise TargetUnreachable("the connection was closed") from exc

    async def _call(
        self, client: Client, tool: str, arguments: dict[str, Any], timeout_s: float
    ) -> mcp_types.CallToolResult:
        try:
            return await client.call_tool_mcp(tool, arguments, timeout=timeout_s)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                raise _Closed from exc
            if "timed out" in str(exc.message):
                raise TargetTimeout(f"no answer within {timeout_s:g}s") from exc
            raise

    async def _session(self, url: str) -> Client:
        if self._closed:
            raise ButlersError("the MCP client pool is closed")
        client = self._clients.get(url)
        if client is not None and client.is_connected():
            return client
        async with self._locks[url]:
            client = self._clients.get(url)
            if client is not None and client.is_connected():
                return client
            if client is not None:
                await self._discard(url, client)
            client = Client(url, auth=self.auth_token, init_timeout=CONNECT_TIMEOUT_S)
            try:
                await asyncio.wait_for(client.__aenter__(), CONNECT_TIMEOUT_S)
            except TimeoutError as exc:
                raise TargetUnreachable(f"no answer within {CONNECT_TIMEOUT_S:g}s") from exc
            except Exception as exc:
                raise TargetUnreachable(_reason(exc)) from exc
            self.connects += 1
            self._clients[url] = client
            return client

    async def _discard(self, url: str, client: Client) -> None:
        if self._clients.get(url) is client:
            del self._clients[url]
        with contextlib.suppress(Exception):
            await client.close()

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = self._clients, {}
        for client in clients.values():
            with contextlib.suppress(Exception):
                await client.close()


class _Closed(Exception):
    """The kept session's connection is gone (internal: triggers one reconnect)."""


def _reason(exc: BaseException) -> str:
    """The innermost cause, e.g. 'All connection attempts failed' for a refused port."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return text.removeprefix("Client failed to connect: ") or type(exc).__name__
