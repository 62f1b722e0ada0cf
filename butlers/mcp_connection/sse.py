"""One kept-open MCP connection over the HTTP+SSE transport, lean enough for route's hot path.

Every routed call crosses this client, and profiling `route` showed the general-purpose MCP
client stack (its per-message HTTP machinery, memory streams, model validation of every
message) costing more CPU than either server it connects. So HTTP is aiohttp's (keep-alive
connections, chunked bodies), the SSE event stream is parsed here (a few lines), JSON-RPC is
the shared core's (butlers.mcp_connection.core), and results stay the JSON the server sent.

The transport: GET the endpoint and keep the event stream; its first event names the URL to
POST messages to (answered 202); answers and the server's requests arrive as `message` events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from urllib.parse import urljoin, urlsplit

import aiohttp

from butlers import __version__
from butlers.errors import ConnectionClosed, RemoteError
from butlers.mcp_connection.core import (
    IDLE_STREAM_S,
    MAX_MESSAGE_BYTES,
    McpConnection,
    Message,
    MessageTooLarge,
    quiet_future,
)

logger = logging.getLogger(__name__)

CLIENT_INFO = {"name": "butlers-switchboard", "version": __version__}


class SseConnection(McpConnection):
    """A connection to one `/sse` endpoint: `open()` it, share it between concurrent callers,
    `close()` it. Without `http`, it makes its own aiohttp client and closes it with itself."""

    def __init__(
        self,
        url: str,
        http: aiohttp.ClientSession | None = None,
        *,
        auth_token: str | None,
        headers: Mapping[str, str] | None = None,
        idle_stream_s: float = IDLE_STREAM_S,
        client_info: dict[str, str] = CLIENT_INFO,
        on_tools_changed: Callable[[], None] | None = None,
        on_closed: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(label=url, on_tools_changed=on_tools_changed, on_closed=on_closed)
        self.url = url
        self.idle_stream_s = idle_stream_s
        self.client_info = client_info
        self._http = http
        self._own_http = http is None
        self._headers = dict(headers or {})  # a server's own (an API key), then our token
        if auth_token:
            self._headers["Authorization"] = f"Bearer {auth_token}"
        self._post_headers = {**self._headers, "Content-Type": "application/json"}
        self._endpoint: asyncio.Future[str] | None = None
        self._post_url = ""  # named by the server's first event
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._last_heard = 0.0  # loop time of the last bytes on the event stream

    async def open(self, timeout_s: float) -> None:
        """Connect the event stream and complete the MCP handshake; raises TimeoutError or
        ConnectionClosed (the caller closes either way)."""
        async with asyncio.timeout(timeout_s):
            if self._http is None:
                self._http = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s),
                    cookie_jar=aiohttp.DummyCookieJar(),  # MCP does not use cookies
                )
            try:
                response = await self._http.get(
                    self.url, headers={**self._headers, "Accept": "text/event-stream"}
                )
            except aiohttp.ClientError as exc:
                raise ConnectionClosed(str(exc) or type(exc).__name__) from exc
            if response.status != 200:
                response.release()
                raise ConnectionClosed(f"GET {self.url} answered HTTP {response.status}")
            self._endpoint = quiet_future()
            loop = asyncio.get_running_loop()
            self._last_heard = loop.time()
            self._reader = loop.create_task(self._read_events(response), name=f"mcp:{self.url}")
            self._watchdog = loop.create_task(self._watch_stream(), name=f"mcp:{self.url}:idle")
            self._post_url = urljoin(self.url, await asyncio.shield(self._endpoint))
            if _origin(self._post_url) != _origin(self.url):  # our token must not go elsewhere
                raise ConnectionClosed(
                    f"{self.url} named a message endpoint on another origin: {self._post_url}"
                )
            await self.initialize(self.client_info, timeout_s=timeout_s)

    async def _send(self, message: Message) -> None:
        if self._http is None or not self._post_url:
            raise ConnectionClosed(f"the connection to {self.url} is not open")
        body = json.dumps(message, separators=(",", ":")).encode()
        try:
            async with self._http.post(
                self._post_url, data=body, headers=self._post_headers
            ) as response:
                if response.status == 404:  # the server forgot us (it restarted)
                    self._lost(f"{self.url} no longer knows this connection")
                    raise ConnectionClosed(self.closed_reason or "connection unknown")
                if response.status >= 300:
                    text = (await response.text())[:200]
                    raise RemoteError(response.status, f"HTTP {response.status}: {text}")
        except aiohttp.ClientError as exc:
            self._lost(f"sending to {self.url} failed: {exc}")
            raise ConnectionClosed(self.closed_reason or str(exc)) from exc

    async def _read_events(self, response: aiohttp.ClientResponse) -> None:
        reason = "the event stream ended"
        try:
            buffer = bytearray()
            searched = 0  # of the buffer, holding no line break (searched once, not per chunk)
            event, data, size = "message", [], 0
            loop = asyncio.get_running_loop()
            async for chunk in response.content.iter_any():
                self._last_heard = loop.time()
                buffer += chunk
                while (end := buffer.find(b"\n", searched)) >= 0:
                    # Every line of an event counts, in bytes: an empty `data:` line adds a
                    # line break to the event (a review: 35,840 of them grew it unbounded).
                    size += end + 1
                    if size > MAX_MESSAGE_BYTES:
                        raise MessageTooLarge(f"an event of over {MAX_MESSAGE_BYTES} bytes")
                    line = buffer[:end].rstrip(b"\r").decode()
                    del buffer[: end + 1]
                    searched = 0
                    if line:
                        field, _, value = line.partition(":")
                        if field == "event":
                            event = value.strip()
                        elif field == "data":
                            data.append(value[1:] if value.startswith(" ") else value)
                        continue  # comments (keep-alive pings) and other fields: nothing to do
                    if data:
                        self._dispatch(event, "\n".join(data))
                    event, data, size = "message", [], 0
                searched = len(buffer)
                if searched > MAX_MESSAGE_BYTES:  # a line never ended (a server's stream is
                    # as hostile as a child's stdout: stdio's bound holds here too)
                    raise MessageTooLarge(f"over {MAX_MESSAGE_BYTES} bytes without a line break")
        except asyncio.CancelledError:
            reason = self.closed_reason or "the connection was closed"
            raise
        except Exception as exc:  # a broken connection: every caller must hear of it
            reason = f"the event stream broke: {exc!r}"
        finally:
            response.close()
            self._lost(reason)

    def _dispatch(self, event: str, data: str) -> None:
        if event == "endpoint":
            if self._endpoint is not None and not self._endpoint.done():
                self._endpoint.set_result(data)
        elif event == "message":
            try:
                message = json.loads(data)
            except ValueError:
                logger.warning("%s sent a message that is not JSON; ignored", self.url)
                return
            self._received(message)

    def _lost(self, reason: str) -> None:
        if self._endpoint is not None and not self._endpoint.done():
            self._endpoint.set_exception(ConnectionClosed(reason))
        super()._lost(reason)

    async def _watch_stream(self) -> None:
        """End the connection when its event stream has been silent for `idle_stream_s`
        (checked a few times per period, not on every chunk: the stream is route's hot path)."""
        loop = asyncio.get_running_loop()
        while self.closed_reason is None and self._reader is not None:
            silent_s = loop.time() - self._last_heard
            if silent_s >= self.idle_stream_s:
                self._lost(
                    f"the event stream of {self.url} was silent for {silent_s:.0f}s "
                    "(no message, no ping): the connection is taken for dead"
                )
                self._reader.cancel()
                return
            await asyncio.sleep(min(self.idle_stream_s / 3, self.idle_stream_s - silent_s))

    async def _close_transport(self) -> None:
        for task in (self._watchdog, self._reader):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._own_http and self._http is not None:
            await self._http.close()


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc
