"""One kept-open MCP session over the HTTP+SSE transport, lean enough for route's hot path.

Every routed call crosses this client, and profiling `route` showed the general-purpose MCP
client stack (its per-message HTTP machinery, memory streams, model validation of every
message) costing more CPU than either server it connects. This session speaks exactly what
route needs and nothing more: the handshake, `tools/call`, answers to the server's pings,
and cancellation. HTTP is aiohttp's (keep-alive connections, chunked bodies); JSON-RPC
framing and the SSE event stream are ours, because they are a few lines. Results come back
as the JSON the target sent, which route unwraps without building models.

The transport: GET the endpoint and keep the event stream; its first event names the URL to
POST messages to (answered 202); replies and server requests arrive as `message` events.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION

from butlers.errors import ButlersError

logger = logging.getLogger(__name__)

CLIENT_INFO = {"name": "butlers-switchboard", "version": "1"}
METHOD_NOT_FOUND = -32601
# Servers ping an idle event stream (the MCP SDK's every 15 s). A stream silent for longer
# than this is a connection that died without a word (a NAT or proxy dropped it, the host
# went away): every call on it would wait out its whole timeout.
IDLE_STREAM_S = 45.0


class SessionClosed(ButlersError):
    """The session is gone (e.g. the target restarted) and the request was not delivered, so
    sending it again on a new session cannot run anything twice."""


class AnswerLost(ButlersError):
    """The request was delivered, then the connection went away before its answer: the tool
    may or may not have run, so it must not be sent again blindly."""


class CallTimedOut(ButlersError):
    """The target accepted the request but sent no answer within the timeout."""


class RemoteError(ButlersError):
    """The target answered with a JSON-RPC error (not a tool error: those are results)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SseSession:
    """A connected session; `open()` it, share it between concurrent callers, `close()` it."""

    def __init__(
        self,
        url: str,
        http: aiohttp.ClientSession,
        *,
        auth_token: str | None,
        idle_stream_s: float = IDLE_STREAM_S,
    ) -> None:
        self.url = url
        self.idle_stream_s = idle_stream_s
        self._http = http
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._post_headers = {**self._headers, "Content-Type": "application/json"}
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._endpoint: asyncio.Future[str] | None = None
        self._post_url = ""  # named by the server's first event
        self._reader: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closed_reason: str | None = None
        self._last_heard = 0.0  # loop time of the last bytes on the event stream
        self._retired = False

    @property
    def is_open(self) -> bool:
        return self._reader is not None and self._closed_reason is None

    async def open(self, timeout_s: float) -> None:
        """Connect the event stream and complete the MCP handshake; raises on any failure."""
        async with asyncio.timeout(timeout_s):
            response = await self._http.get(
                self.url, headers={**self._headers, "Accept": "text/event-stream"}
            )
            if response.status != 200:
                response.release()
                raise SessionClosed(f"GET {self.url} answered HTTP {response.status}")
            self._endpoint = _future()
            self._last_heard = asyncio.get_running_loop().time()
            self._reader = asyncio.create_task(self._read_events(response))
            self._spawn(self._watch_stream())
            self._post_url = urljoin(self.url, await asyncio.shield(self._endpoint))
            if _origin(self._post_url) != _origin(self.url):  # our token must not go elsewhere
                raise SessionClosed(
                    f"{self.url} named a message endpoint on another origin: {self._post_url}"
                )
            result = await self.request(
                "initialize",
                {
                    "protocolVersion": LATEST_HANDSHAKE_VERSION,
                    "capabilities": {},
                    "clientInfo": CLIENT_INFO,
                },
                timeout_s=timeout_s,
            )
            version = result.get("protocolVersion")
            if version not in HANDSHAKE_PROTOCOL_VERSIONS:
                raise SessionClosed(f"{self.url} offered unsupported protocol version {version!r}")
            await self._post({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, str] | None = None,
        timeout_s: float,
    ) -> dict[str, Any]:
        """The `CallToolResult` as JSON (a tool error is a result with `isError`, not a raise)."""
        params: dict[str, Any] = {"name": name, "arguments": arguments}
        if meta:
            params["_meta"] = meta
        return await self.request("tools/call", params, timeout_s=timeout_s)

    async def request(
        self, method: str, params: dict[str, Any], *, timeout_s: float
    ) -> dict[str, Any]:
        if self._closed_reason is not None:
            raise SessionClosed(self._closed_reason)
        request_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = _future()
        self._pending[request_id] = answer
        try:
            async with asyncio.timeout(timeout_s):
                await self._post(
                    {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
                )
                try:
                    message = await answer
                except SessionClosed as exc:
                    raise AnswerLost(f"{exc}, after the request was delivered") from exc
        except (TimeoutError, asyncio.CancelledError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            if self._closed_reason is None:  # tell the target to stop working on it
                reason = "timed out" if timed_out else "cancelled"
                self._spawn(
                    self._send_quietly(
                        {
                            "jsonrpc": "2.0",
                            "method": "notifications/cancelled",
                            "params": {"requestId": request_id, "reason": reason},
                        }
                    )
                )
            if timed_out:
                raise CallTimedOut(f"no answer within {timeout_s:g}s") from None
            raise
        finally:
            self._pending.pop(request_id, None)
            if self._retired and not self._pending:
                self._spawn(self.close())
        if "error" in message:
            error = message["error"] or {}
            raise RemoteError(int(error.get("code", 0)), str(error.get("message", "")))
        return message.get("result") or {}

    def retire(self) -> None:
        """No new calls will come (the pool dropped this session): close it as soon as the
        calls still waiting on it have their answers."""
        self._retired = True
        if not self._pending:
            self._spawn(self.close())

    async def close(self) -> None:
        self._fail_pending("the session was closed")
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        for task in list(self._background):
            task.cancel()

    async def _post(self, message: dict[str, Any]) -> None:
        body = json.dumps(message, separators=(",", ":")).encode()
        try:
            async with self._http.post(
                self._post_url, data=body, headers=self._post_headers
            ) as response:
                if response.status == 404:  # the server no longer knows this session
                    self._fail_pending(f"{self.url} no longer knows this session")
                    raise SessionClosed(self._closed_reason or "session unknown")
                if response.status >= 300:
                    text = (await response.text())[:200]
                    raise RemoteError(response.status, f"HTTP {response.status}: {text}")
        except aiohttp.ClientError as exc:
            self._fail_pending(f"sending to {self.url} failed: {exc}")
            raise SessionClosed(self._closed_reason or str(exc)) from exc

    async def _read_events(self, response: aiohttp.ClientResponse) -> None:
        reason = "the event stream ended"
        try:
            buffer = bytearray()
            event, data = "message", []
            loop = asyncio.get_running_loop()
            async for chunk in response.content.iter_any():
                self._last_heard = loop.time()
                buffer += chunk
                while (end := buffer.find(b"\n")) >= 0:
                    line = buffer[:end].rstrip(b"\r").decode()
                    del buffer[: end + 1]
                    if line:
                        field, _, value = line.partition(":")
                        if field == "event":
                            event = value.strip()
                        elif field == "data":
                            data.append(value[1:] if value.startswith(" ") else value)
                        continue  # comments (keep-alive pings) and other fields: nothing to do
                    if data:
                        self._dispatch(event, "\n".join(data))
                    event, data = "message", []
        except asyncio.CancelledError:
            reason = self._closed_reason or "the session was closed"
            raise
        except Exception as exc:  # a broken connection: every caller must hear of it
            reason = f"the event stream broke: {exc!r}"
        finally:
            response.close()
            self._fail_pending(reason)

    def _dispatch(self, event: str, data: str) -> None:
        if event == "endpoint":
            if self._endpoint is not None and not self._endpoint.done():
                self._endpoint.set_result(data)
            return
        if event != "message":
            return
        try:
            message = json.loads(data)
        except ValueError:
            logger.warning("%s sent a message that is not JSON; ignored", self.url)
            return
        if not isinstance(message, dict):
            return
        if "method" not in message:
            answer = self._pending.get(message.get("id"))  # type: ignore[arg-type]
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif "id" in message:  # a request from the server: we serve pings only
            if message["method"] == "ping":
                reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"], "result": {}}
            else:
                reply = {
                    "jsonrpc": "2.0",
                    "id": message["id"],
                    "error": {"code": METHOD_NOT_FOUND, "message": "not supported by this client"},
                }
            self._spawn(self._send_quietly(reply))
        # notifications (logging, progress, list changes) are of no use to route

    async def _watch_stream(self) -> None:
        """End the session when its event stream has been silent for `idle_stream_s`
        (checked a few times per period, not on every chunk: the stream is route's hot path)."""
        loop = asyncio.get_running_loop()
        while self._closed_reason is None and self._reader is not None:
            silent_s = loop.time() - self._last_heard
            if silent_s >= self.idle_stream_s:
                self._fail_pending(
                    f"the event stream of {self.url} was silent for {silent_s:.0f}s "
                    "(no message, no ping): the connection is taken for dead"
                )
                self._reader.cancel()
                return
            await asyncio.sleep(min(self.idle_stream_s / 3, self.idle_stream_s - silent_s))

    async def _send_quietly(self, message: dict[str, Any]) -> None:
        """For messages nobody waits on (replies, cancellations): a failure here surfaces
        anyway, at the next call on this session."""
        with contextlib.suppress(ButlersError):
            await self._post(message)

    def _fail_pending(self, reason: str) -> None:
        if self._closed_reason is None:
            self._closed_reason = reason
        if self._endpoint is not None and not self._endpoint.done():
            self._endpoint.set_exception(SessionClosed(reason))
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(SessionClosed(reason))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _future() -> asyncio.Future[Any]:
    """A future whose failure nobody may await (its caller gave up first) without asyncio
    reporting "exception was never retrieved"."""
    future = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future
