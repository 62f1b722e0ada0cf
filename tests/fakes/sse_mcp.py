"""A scripted MCP server on the HTTP+SSE transport, for testing our client's edge cases.

Real servers (FastMCP) always frame events the same tidy way; this one writes its event stream
in tiny chunks with CRLF line endings, multi-line data fields and keep-alive comments, asks the
client things in the middle of a call, and can hang, drop the stream or forget the session.
Tool behaviour is chosen by the tool's name:

  echo       answers structuredContent {"echo": arguments}
  big        answers a text block of `arguments["size"]` characters
  ask_first  first sends the client a `ping` and an unknown request, a notification and a
             comment; answers once the client has replied to both requests
  error      answers a JSON-RPC error (not a tool error)
  hang       never answers
  slow       answers like echo after `arguments["s"]` seconds
  held       answers like echo once the test sets `release_held`
  drop       closes the event stream instead of answering

`tools/list` lists these tools, `ping` is answered; any other request gets "method not
found". The stream is silent between events unless `ping_every_s` is set (as servers do, to keep
it alive: the MCP SDK's every 15 s).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fakes import serve_on_loopback

TOOLS = [
    {
        "name": "echo",
        "description": "Answer with the arguments.",
        "inputSchema": {"type": "object"},
    },
    {
        "name": "big",
        "description": "Answer with `size` characters.",
        "inputSchema": {"type": "object", "properties": {"size": {"type": "integer"}}},
    },
    {
        "name": "ask_first",
        "description": "Ask the client first.",
        "inputSchema": {"type": "object"},
    },
    {"name": "error", "description": "A JSON-RPC error.", "inputSchema": {"type": "object"}},
    {"name": "hang", "description": "Never answer.", "inputSchema": {"type": "object"}},
    {
        "name": "slow",
        "description": "Answer after `s` seconds.",
        "inputSchema": {"type": "object", "properties": {"s": {"type": "number"}}},
    },
    {"name": "drop", "description": "Close the event stream.", "inputSchema": {"type": "object"}},
    {"name": "held", "description": "Answer when released.", "inputSchema": {"type": "object"}},
]


@dataclass
class SseMcpServer:
    chunk_size: int = 5
    protocol_version: str | None = None  # None: the version the client asks for
    forget_sessions: bool = False  # answer every POST with 404, as after a restart
    endpoint_base: str = ""  # e.g. "http://elsewhere:1" to name a foreign message endpoint
    ping_every_s: float = 0.0  # keep-alive comments on an idle stream (0: none)
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    streams_opened: int = 0
    url: str = ""

    def __post_init__(self) -> None:
        self._streams: dict[str, asyncio.Queue[bytes | None]] = {}
        self.streams_ended = 0  # event streams whose client went away
        self._replies: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._runner: web.AppRunner | None = None
        self._arrived = asyncio.Condition()
        self.release_held = asyncio.Event()  # lets every `held` call answer

    async def __aenter__(self) -> SseMcpServer:
        app = web.Application()
        app.router.add_get("/sse", self._stream)
        app.router.add_post("/messages/", self._message)
        self._runner, base = await serve_on_loopback(app)
        self.url = f"{base}/sse"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for queue in self._streams.values():
            queue.put_nowait(None)
        assert self._runner is not None
        await self._runner.cleanup()

    def methods(self) -> list[str]:
        return [message.get("method", "<reply>") for message in self.received]

    async def wait_for(self, method: str, count: int = 1) -> dict[str, Any]:
        """The first message received with this method, once `count` of them have arrived."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: self.methods().count(method) >= count)
        return self.received[self.methods().index(method)]

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        self.streams_opened += 1
        session = f"s{self.streams_opened}"
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._streams[session] = queue
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        endpoint = f"{self.endpoint_base}/messages/?session_id={session}"
        await self._write(response, f"event: endpoint\r\ndata: {endpoint}\r\n\r\n")
        while True:
            try:
                payload = await asyncio.wait_for(queue.get(), self.ping_every_s or None)
            except TimeoutError:
                payload = b": ping\r\n\r\n"
            if payload is None:
                return response
            try:
                await self._write(response, payload.decode())
            except ConnectionError:
                self.streams_ended += 1
                return response

    async def _write(self, response: web.StreamResponse, text: str) -> None:
        data = text.encode()
        for start in range(0, len(data), self.chunk_size):
            await response.write(data[start : start + self.chunk_size])

    def _send(self, session: str, message: dict[str, Any]) -> None:
        # Split the JSON over two data lines (joined with a newline, still valid JSON) and
        # put a keep-alive comment before it, as sse-starlette does.
        text = json.dumps(message)
        cut = text.index(",") + 1 if "," in text else len(text)
        event = f": ping\r\nevent: message\r\ndata: {text[:cut]}\r\ndata: {text[cut:]}\r\n\r\n"
        self._streams[session].put_nowait(event.encode())

    async def _message(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        session = request.query.get("session_id", "")
        if self.forget_sessions or session not in self._streams:
            return web.Response(status=404, text="Could not find session")
        message = await request.json()
        async with self._arrived:
            self.received.append(message)
            self._arrived.notify_all()
        if "method" not in message:  # the client's reply to one of our requests
            waiter = self._replies.get(message.get("id"))
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif "id" in message:
            asyncio.get_running_loop().create_task(self._answer(session, message))
        return web.Response(status=202, text="Accepted")

    async def _answer(self, session: str, message: dict[str, Any]) -> None:
        request_id = message["id"]
        if message["method"] != "tools/call":
            self._send(session, {"jsonrpc": "2.0", "id": request_id, **self._other(message)})
            return
        params = message.get("params") or {}
        tool, arguments = params.get("name"), params.get("arguments") or {}
        if tool == "echo":
            result = {"content": [], "structuredContent": {"echo": arguments}, "isError": False}
        elif tool == "big":
            result = {"content": [{"type": "text", "text": "x" * int(arguments["size"])}]}
        elif tool == "ask_first":
            await self._ask_first(session)
            result = {"content": [{"type": "text", "text": "answered after asking"}]}
        elif tool == "error":
            error = {"code": -32602, "message": "scripted failure"}
            self._send(session, {"jsonrpc": "2.0", "id": request_id, "error": error})
            return
        elif tool == "hang":
            return
        elif tool == "slow":
            await asyncio.sleep(float(arguments["s"]))
            result = {"content": [], "structuredContent": {"echo": arguments}, "isError": False}
        elif tool == "held":
            await self.release_held.wait()
            result = {"content": [], "structuredContent": {"echo": arguments}, "isError": False}
        elif tool == "drop":
            self._streams[session].put_nowait(None)
            return
        else:
            raise AssertionError(f"unscripted tool {tool!r}")
        self._send(session, {"jsonrpc": "2.0", "id": request_id, "result": result})

    def _other(self, message: dict[str, Any]) -> dict[str, Any]:
        """The answer (`result` or `error`) to a request other than tools/call."""
        method = message["method"]
        if method == "initialize":
            asked = (message.get("params") or {}).get("protocolVersion")
            return {
                "result": {
                    "protocolVersion": self.protocol_version or asked,
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "scripted", "version": "1"},
                }
            }
        if method == "tools/list":
            return {"result": {"tools": TOOLS}}
        if method == "ping":
            return {"result": {}}
        return {"error": {"code": -32601, "message": f"Method not found: {method}"}}

    async def _ask_first(self, session: str) -> None:
        loop = asyncio.get_running_loop()
        for request_id, method in (("srv-ping", "ping"), ("srv-roots", "roots/list")):
            self._replies[request_id] = loop.create_future()
            self._send(session, {"jsonrpc": "2.0", "id": request_id, "method": method})
        self._send(
            session,
            {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "log line"}},
        )
        await asyncio.gather(*(self._replies[key] for key in ("srv-ping", "srv-roots")))
