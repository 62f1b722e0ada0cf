"""Any other MCP transport (streamable HTTP, `/mcp`) through FastMCP's client, behind the same
methods and errors as our own connections.

Only `/sse` endpoints get our lean SseConnection (every butler serves one, and route's hot path
runs over them); for the rest FastMCP's client is good enough, and the MCP SDK under it
answers the server's pings itself. Its exceptions are turned into the McpCallError family
here, where they enter, so no caller ever catches an MCPError. The one FastMCP-client
connection: the pool's (route, notify, the dashboard) for a `/mcp` target, the gateway's for
a remote child, the CLI's for a `/mcp` switchboard. A connection that ends mid-call is
AnswerLost as over SSE: the call was sent, so its tool may have run and it is not sent again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx2
import mcp_types
from fastmcp import Client
from fastmcp.client.messages import MessageHandler
from fastmcp.client.transports import StreamableHttpTransport
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import CONNECTION_CLOSED, METHOD_NOT_FOUND
from pydantic import BaseModel

from butlers.errors import AnswerLost, CallTimedOut, ConnectionClosed, McpCallError, RemoteError
from butlers.mcp_connection.core import MAX_MESSAGE_BYTES, no_answer_within
from butlers.mcp_connection.paging import PageGuard
from butlers.tasks import within


class _ToolsChanged(MessageHandler):
    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback

    async def on_tool_list_changed(self, message: mcp_types.ToolListChangedNotification) -> None:
        self._callback()


class FastMcpConnection:
    """A kept-open FastMCP client: `open()`, `call_tool()`, `list_tools()`, `close()`."""

    def __init__(
        self,
        url: str,
        *,
        auth_token: str | None,
        headers: Mapping[str, str] | None = None,
        on_tools_changed: Callable[[], None] | None = None,
    ) -> None:
        self.url = url
        handler = _ToolsChanged(on_tools_changed) if on_tools_changed is not None else None
        transport = StreamableHttpTransport(
            url,
            headers={**(headers or {}), "Accept-Encoding": "identity"},
            auth=auth_token,
            httpx_client_factory=_bounded_client,
        )
        self._client = Client(transport, message_handler=handler)
        self._closing: asyncio.Task[None] | None = None

    @property
    def is_open(self) -> bool:
        return self._client.is_connected()

    @property
    def server_capabilities(self) -> dict[str, Any]:
        """What the server offered (prompts, resources...), as JSON."""
        offered = self._client.server_capabilities
        return {} if offered is None else offered.model_dump(by_alias=True, exclude_none=True)

    async def open(self, timeout_s: float) -> None:
        """Connect and complete the handshake; raises TimeoutError, or the client's own error
        (the caller closes either way)."""
        await within(self._client.__aenter__(), timeout_s)

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, str] | None = None,
        timeout_s: float | None,
    ) -> dict[str, Any]:
        """The `CallToolResult` as JSON (a tool's error is a result with `isError`)."""
        self._check_open()
        try:
            result = await self._client.call_tool_mcp(
                name, arguments, timeout=timeout_s, meta=meta or None
            )
        except MCPError as exc:
            raise _mapped(exc, timeout_s) from exc
        return result.model_dump(mode="json", by_alias=True, exclude_none=True)

    async def list_tools(self, *, timeout_s: float | None) -> list[dict[str, Any]]:
        """Every tool, as JSON, following `nextCursor` within the bounds of
        butlers.mcp_connection.paging (`timeout_s` for the whole list)."""
        self._check_open()
        tools: list[dict[str, Any]] = []
        cursor = None
        guard = PageGuard(self.url, "tools/list")
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    page = await self._client.list_tools_mcp(cursor=cursor)
                    tools += [
                        t.model_dump(mode="json", by_alias=True, exclude_none=True)
                        for t in page.tools
                    ]
                    cursor = page.next_cursor
                    guard.check(cursor, len(tools))
                    if not cursor:
                        return tools
        except TimeoutError:
            raise CallTimedOut(no_answer_within(timeout_s)) from None
        except MCPError as exc:
            raise _mapped(exc, timeout_s) from exc

    async def request(
        self, method: str, params: dict[str, Any], *, timeout_s: float | None
    ) -> dict[str, Any]:
        """The prompt and resource requests the gateway passes on, their results as JSON;
        any other method is refused as the server would refuse one it does not know."""
        self._check_open()
        client, cursor = self._client, params.get("cursor")
        requests: dict[str, Callable[[], Awaitable[BaseModel]]] = {
            "prompts/list": lambda: client.list_prompts_mcp(cursor=cursor),
            "prompts/get": lambda: client.get_prompt_mcp(params["name"], params.get("arguments")),
            "resources/list": lambda: client.list_resources_mcp(cursor=cursor),
            "resources/templates/list": lambda: client.list_resource_templates_mcp(cursor=cursor),
            "resources/read": lambda: client.read_resource_mcp(params["uri"]),
        }
        send = requests.get(method)
        if send is None:
            raise RemoteError(METHOD_NOT_FOUND, f"Method not found: {method}")
        try:
            async with asyncio.timeout(timeout_s):
                result = await send()
        except TimeoutError:
            raise CallTimedOut(no_answer_within(timeout_s)) from None
        except MCPError as exc:
            raise _mapped(exc, timeout_s) from exc
        return result.model_dump(mode="json", by_alias=True, exclude_none=True)

    def _check_open(self) -> None:
        if not self.is_open:
            raise ConnectionClosed(f"the connection to {self.url} is closed")

    def retire(self) -> None:
        """Close once nobody uses it; FastMCP's client lets calls in flight finish."""
        self._closing = asyncio.get_running_loop().create_task(
            self._client.close(), name=f"mcp:{self.url}:close"
        )

    async def close(self) -> None:
        await self._client.close()


def _bounded_client(
    headers: dict[str, str] | None = None,
    timeout: httpx2.Timeout | None = None,
    auth: httpx2.Auth | None = None,
    **options: Any,
) -> httpx2.AsyncClient:
    """The MCP SDK's own client (its timeouts), whose answers are bounded as ours are over
    SSE and stdio: the SDK reads a JSON answer whole, whatever its size (a server of the
    gateway's or a tool server's could fill the process's memory). Its event streams it
    bounds itself (`max_sse_event_size`). FastMCP passes `follow_redirects` too."""
    from mcp.shared._httpx_utils import create_mcp_http_client

    client = create_mcp_http_client(headers=headers, timeout=timeout, auth=auth)
    client.follow_redirects = bool(options.get("follow_redirects", False))
    client.event_hooks["response"].append(_bound_answer)
    return client


async def _bound_answer(response: httpx2.Response) -> None:
    """A JSON answer's body read through a count of its bytes. Only an answer sent as it is
    can be counted so (gzip multiplies what a few MB become), so one compressed although
    the request asked for none (`Accept-Encoding: identity`) is not read at all."""
    kind = response.headers.get("content-type", "").lower()
    if kind.startswith("text/event-stream") or not isinstance(
        response.stream,
        httpx2.AsyncByteStream,  # (always, of an AsyncClient)
    ):
        return
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    response.stream = _Bounded(response.stream, refused=encoding not in ("", "identity"))


class _Bounded(httpx2.AsyncByteStream):
    def __init__(self, stream: httpx2.AsyncByteStream, *, refused: bool) -> None:
        self._stream, self._refused = stream, refused

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # httpx2.StreamError: what the SDK turns into the call's error, the connection kept.
        if self._refused:
            raise httpx2.StreamError("a compressed answer, although none was asked for")
        read = 0
        async for chunk in self._stream:
            read += len(chunk)
            if read > MAX_MESSAGE_BYTES:
                raise httpx2.StreamError(f"an answer of over {MAX_MESSAGE_BYTES} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


def _mapped(exc: MCPError, timeout_s: float | None) -> McpCallError:
    """The request was sent (the connection was open), so a closed connection lost its answer."""
    if exc.code == CONNECTION_CLOSED:
        return AnswerLost(str(exc.message))
    if "timed out" in str(exc.message):
        return CallTimedOut(no_answer_within(timeout_s))
    return RemoteError(exc.code, str(exc.message))
