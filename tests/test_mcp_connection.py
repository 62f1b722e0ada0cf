"""Our MCP connections (butlers.mcp_connection): the shared JSON-RPC core over its transports.

First a real FastMCP server that turns to the client (pings it, asks it things, says its tools
changed, hangs until cancelled, goes away), over SSE on loopback and as a stdio child: the same
behaviour expected of both transports (one server of each, kept for the next test unless a test
made it go away or failed). Then route's SSE connection against a scripted server
showing what a well-behaved server never does: events cut into 5-byte chunks with CRLF endings
and multi-line data, hangs, dropped streams, a server that forgot the connection. The real
butlers are covered through `route` in test_route.py, the gateway's children in test_gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from mcp_types.jsonrpc import METHOD_NOT_FOUND
from mcp_types.version import LATEST_HANDSHAKE_VERSION

from butlers.errors import (
    AnswerLost,
    CallTimedOut,
    ConnectionClosed,
    RemoteError,
    TargetUnreachable,
)
from butlers.mcp_connection.core import McpConnection
from butlers.mcp_connection.pool import McpConnections
from butlers.mcp_connection.sse import SseConnection
from butlers.mcp_connection.stdio import StdioConnection
from tests.conftest import free_port
from tests.fakes import peer_mcp
from tests.fakes.sse_mcp import SseMcpServer

PEER = str(Path(peer_mcp.__file__))
CLIENT_INFO = {"name": "test_mcp_connection", "version": "1"}

# -- against a real FastMCP server, over SSE and over stdio ----------------------------------


# What a waiting call hears when the peer goes: over SSE, the MCP SDK's server answers what it
# drops ("Connection closed") before its stream ends; a stdio child that exits says nothing.
SSE_GONE = r"^(the event stream (ended|broke)|.* closed the connection before answering)"
STDIO_GONE = rf"^the peer exited \(code {peer_mcp.EXIT_CODE}\)$"


@dataclass
class Served:
    """A running peer server, our open connection to it, and how to make the peer go away."""

    connection: McpConnection
    drop: Callable[[], Awaitable[None]]
    gone_reason: str  # a regular expression for what the waiting calls hear then
    dropped: bool = False  # a test made it go away (or may have: it failed)


@dataclass
class Peer:
    """One test's view of a served peer: what the connection told it, and a tag of its own
    for the peer's hang calls (the peer may have served other tests before)."""

    served: Served
    closed: list[str] = field(default_factory=list)  # what on_closed was told
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # on_closed was called
    tools_changed: asyncio.Event = field(default_factory=asyncio.Event)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.connection = self.served.connection
        self.gone_reason = self.served.gone_reason
        self.connection.on_closed = self._closed
        self.connection.on_tools_changed = self.tools_changed.set

    async def drop(self) -> None:
        self.served.dropped = True
        await self.served.drop()

    def _closed(self, reason: str) -> None:
        self.closed.append(reason)
        self.gone.set()


@contextlib.asynccontextmanager
async def sse_peer() -> AsyncIterator[Served]:
    async with peer_mcp.serve_peer_over_sse() as (url, stop):

        async def drop() -> None:
            stop.set()

        connection = SseConnection(url, auth_token=None)
        try:
            await connection.open(timeout_s=10)
            yield Served(connection, drop, gone_reason=SSE_GONE)
        finally:
            await connection.close()


@contextlib.asynccontextmanager
async def stdio_peer() -> AsyncIterator[Served]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        PEER,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "FASTMCP_LOG_LEVEL": "WARNING"},
    )

    async def drop() -> None:  # the peer exits while answering; its own call is lost too
        with contextlib.suppress(AnswerLost):
            await connection.call_tool("exit", {}, timeout_s=10)

    connection = StdioConnection(process, label="the peer")
    try:
        await connection.open(CLIENT_INFO, timeout_s=30)  # a Python start-up on a loaded host
        yield Served(connection, drop, gone_reason=STDIO_GONE)
    finally:
        await connection.close()
        if process.returncode is None:
            process.kill()
        await process.wait()


class Peers:
    """The module's peers, one per transport, started when a test first asks for one (a stdio
    peer is a Python start-up importing FastMCP: 0.7 s of CPU). A peer that a test dropped,
    whose connection ended, or whose test failed is shut down, and the next test gets a new
    one: whatever the order, each test starts with a peer that is up and connected."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[contextlib.AsyncExitStack, Served]] = {}

    async def get(self, transport: str) -> Served:
        kept = self._kept.get(transport)
        if kept is not None and kept[1].connection.is_open and not kept[1].dropped:
            return kept[1]
        await self.discard(transport)
        stack = contextlib.AsyncExitStack()
        served = await stack.enter_async_context(sse_peer() if transport == "sse" else stdio_peer())
        self._kept[transport] = (stack, served)
        return served

    async def discard(self, transport: str) -> None:
        kept = self._kept.pop(transport, None)
        if kept is not None:
            await kept[0].aclose()

    async def close(self) -> None:
        for transport in list(self._kept):
            await self.discard(transport)


@pytest.fixture(scope="module")
async def peers() -> AsyncIterator[Peers]:
    peers = Peers()
    try:
        yield peers
    finally:
        await peers.close()


# The tests that share the module's peers run on one xdist worker (`--dist loadgroup`).
SHARES_PEERS = pytest.mark.xdist_group("test_mcp_connection:peers")


@pytest.fixture(params=["sse", "stdio"])
async def peer(request: pytest.FixtureRequest, peers: Peers) -> AsyncIterator[Peer]:
    served = await peers.get(request.param)
    failed_before = request.session.testsfailed
    try:
        yield Peer(served)
    finally:
        served.connection.on_closed = None
        served.connection.on_tools_changed = None
        if request.session.testsfailed != failed_before:  # leave nothing odd to the next test
            served.dropped = True
        if served.dropped:
            await peers.discard(request.param)


def text(result: dict) -> str:
    return " ".join(block["text"] for block in result["content"] if block["type"] == "text")


@SHARES_PEERS
async def test_the_handshake_agrees_on_the_newest_revision_of_the_types_package(peer) -> None:
    assert peer.connection.protocol_version == LATEST_HANDSHAKE_VERSION
    assert peer.connection.server_info["name"] == "peer"


@SHARES_PEERS
async def test_the_peers_ping_is_answered(peer) -> None:
    """The server's send_ping() returns only once we answered it (it waits for ever else)."""
    result = await peer.connection.call_tool("ping_client", {}, timeout_s=10)
    assert text(result) == "pong"


@SHARES_PEERS
async def test_the_peers_other_requests_get_method_not_found(peer) -> None:
    result = await peer.connection.call_tool("ask_roots", {}, timeout_s=10)
    assert text(result) == f"error {METHOD_NOT_FOUND}: Method not found: roots/list"


@SHARES_PEERS
async def test_tools_list_changed_reaches_the_owner(peer) -> None:
    assert not peer.tools_changed.is_set()
    result = await peer.connection.call_tool("change_tools", {}, timeout_s=10)
    assert text(result) == "sent"
    async with asyncio.timeout(10):
        await peer.tools_changed.wait()


@SHARES_PEERS
async def test_a_timed_out_request_is_cancelled_at_the_peer(peer) -> None:
    """The peer hears `notifications/cancelled` and stops the tool; the connection stays."""
    with pytest.raises(CallTimedOut, match=r"^no answer within 0\.5s$"):
        await peer.connection.call_tool("hang", {"tag": peer.tag}, timeout_s=0.5)
    result = await peer.connection.call_tool(
        "wait_cancelled", {"timeout_s": 10, "tag": peer.tag}, timeout_s=20
    )
    assert result["structuredContent"] == {"result": True}
    assert peer.connection.is_open


@SHARES_PEERS
async def test_a_dropped_connection_fails_every_waiting_call_with_its_reason(peer) -> None:
    waiting = [
        asyncio.create_task(peer.connection.call_tool("hang", {"tag": peer.tag}, timeout_s=60))
        for _ in range(3)
    ]
    running = await peer.connection.call_tool(
        "wait_hanging", {"n": 3, "timeout_s": 10, "tag": peer.tag}, timeout_s=20
    )
    assert running["structuredContent"] == {"result": True}  # sent, and the peer is on them
    await peer.drop()
    async with asyncio.timeout(10):  # at once, not after the calls' own timeout
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    # Sent, then lost: the tool may have run. The MCP SDK's server, stopping, first answers
    # what it drops with "Connection closed"; a process that exits says nothing.
    assert all(isinstance(o, AnswerLost) for o in outcomes), outcomes
    assert all(re.search(peer.gone_reason, str(o)) for o in outcomes), outcomes
    async with asyncio.timeout(10):
        await peer.gone.wait()  # over SSE the stream's end may follow the answers
    assert not peer.connection.is_open
    [reason] = peer.closed  # the owner heard it once
    with pytest.raises(ConnectionClosed) as refused:  # a new call is not sent at all
        await peer.connection.call_tool("ping_client", {}, timeout_s=10)
    assert type(refused.value) is ConnectionClosed and str(refused.value) == reason


# -- route's SSE connection against a scripted server ----------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[SseMcpServer]:
    async with SseMcpServer() as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


async def opened(server: SseMcpServer, http: aiohttp.ClientSession, **kwargs) -> SseConnection:
    connection = SseConnection(server.url, http, auth_token=kwargs.pop("auth_token", None))
    await connection.open(timeout_s=5)
    return connection


async def test_handshake_and_call_over_chopped_events(server, http) -> None:
    connection = await opened(server, http)
    try:
        result = await connection.call_tool(
            "echo", {"text": "hé, world"}, meta={"traceparent": "00-ab-cd-01"}, timeout_s=5
        )
    finally:
        await connection.close()
    assert result["structuredContent"] == {"echo": {"text": "hé, world"}}
    assert server.methods() == ["initialize", "notifications/initialized", "tools/call"]
    initialize, _, call = server.received
    assert initialize["params"]["protocolVersion"] == LATEST_HANDSHAKE_VERSION
    assert call["params"]["_meta"] == {"traceparent": "00-ab-cd-01"}


async def test_concurrent_calls_each_get_their_own_answer(server, http) -> None:
    connection = await opened(server, http)
    try:
        results = await asyncio.gather(
            *(connection.call_tool("echo", {"n": n}, timeout_s=5) for n in range(40))
        )
    finally:
        await connection.close()
    assert [r["structuredContent"]["echo"]["n"] for r in results] == list(range(40))


async def test_server_requests_mid_call_are_answered(server, http) -> None:
    connection = await opened(server, http)
    try:
        result = await connection.call_tool("ask_first", {}, timeout_s=5)
    finally:
        await connection.close()
    assert result["content"][0]["text"] == "answered after asking"
    replies = {m["id"]: m for m in server.received if "method" not in m}
    assert replies["srv-ping"]["result"] == {}
    assert replies["srv-roots"]["error"]["code"] == -32601


async def test_a_large_result_arrives_whole(http) -> None:
    async with SseMcpServer(chunk_size=65_536) as server:
        connection = await opened(server, http)
        try:
            result = await connection.call_tool("big", {"size": 3_000_000}, timeout_s=10)
        finally:
            await connection.close()
    assert result["content"][0]["text"] == "x" * 3_000_000


async def test_a_result_over_the_limit_ends_the_connection_not_the_memory(
    http, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote server's event (or a line never ended) was buffered whatever its size (a red
    team: 200 MiB in 30 s); stdio's bound holds over SSE too."""
    from butlers.mcp_connection import sse

    monkeypatch.setattr(sse, "MAX_MESSAGE_BYTES", 100_000)
    async with SseMcpServer(chunk_size=4096) as server:
        connection = await opened(server, http)
        try:
            fits = await connection.call_tool("big", {"size": 50_000}, timeout_s=10)
            assert fits["content"][0]["text"] == "x" * 50_000
            with pytest.raises(AnswerLost, match="over 100000 bytes without a line break"):
                await connection.call_tool("big", {"size": 300_000}, timeout_s=10)
            assert not connection.is_open
        finally:
            await connection.close()


async def test_an_event_of_empty_data_lines_is_bounded_too(
    http, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each empty `data:` line adds a line break to its event, and counted nothing: 35,840 of
    them made one event of 35,839 characters past a bound of 1024 (a review)."""
    from aiohttp import web

    from butlers.mcp_connection import sse

    monkeypatch.setattr(sse, "MAX_MESSAGE_BYTES", 1024)

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"event: endpoint\ndata: /messages?session_id=1\n\n")
        for _ in range(40):
            await response.write(b"data:\n" * 1024)
        await response.write(b"\n")
        return response

    app = web.Application()
    app.router.add_get("/sse", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    lost: list[str] = []
    connection = SseConnection(
        f"http://127.0.0.1:{port}/sse", http, auth_token=None, on_closed=lost.append
    )
    try:
        with contextlib.suppress(Exception):  # (the handshake never completes)
            await connection.open(timeout_s=3)
        await eventually_true(lambda: bool(lost))
        assert "an event of over 1024 bytes" in lost[0], lost
    finally:
        await connection.close()
        await runner.cleanup()


async def eventually_true(check: Callable[[], bool], timeout_s: float = 5) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - a callback of the connection fills it
            await asyncio.sleep(0.01)


async def test_a_json_rpc_error_is_raised_with_its_message(server, http) -> None:
    connection = await opened(server, http)
    try:
        with pytest.raises(RemoteError, match="scripted failure") as caught:
            await connection.call_tool("error", {}, timeout_s=5)
        assert caught.value.code == -32602
        # the connection is still usable
        assert (await connection.call_tool("echo", {}, timeout_s=5))["structuredContent"]
    finally:
        await connection.close()


async def test_a_timeout_raises_and_tells_the_server(server, http) -> None:
    connection = await opened(server, http)
    try:
        with pytest.raises(CallTimedOut, match=r"0\.3s"):
            await connection.call_tool("hang", {}, timeout_s=0.3)
        call_id = server.received[-1]["id"]
        async with asyncio.timeout(5):
            cancelled = await server.wait_for("notifications/cancelled")
        assert cancelled["params"]["requestId"] == call_id
        assert connection.is_open
    finally:
        await connection.close()


async def test_a_dropped_stream_fails_waiting_calls_at_once(server, http) -> None:
    connection = await opened(server, http)
    try:
        waiting = asyncio.gather(
            *(connection.call_tool("hang", {}, timeout_s=30) for _ in range(3)),
            return_exceptions=True,
        )
        async with asyncio.timeout(5):
            await server.wait_for("tools/call", count=3)  # all three delivered, now waiting
            with pytest.raises(AnswerLost, match=r"^the event stream ended$"):
                await connection.call_tool("drop", {}, timeout_s=30)
            outcomes = await waiting
        assert all(isinstance(o, AnswerLost) for o in outcomes)
        assert not connection.is_open
        with pytest.raises(ConnectionClosed):  # not sent at all: safe to send elsewhere
            await connection.call_tool("echo", {}, timeout_s=5)
    finally:
        await connection.close()


async def test_bearer_token_on_stream_and_messages(server, http) -> None:
    connection = await opened(server, http, auth_token="s3cret")
    try:
        await connection.call_tool("echo", {}, timeout_s=5)
    finally:
        await connection.close()
    assert server.headers and all(h["Authorization"] == "Bearer s3cret" for h in server.headers)


async def test_an_unsupported_protocol_version_is_refused(http) -> None:
    async with SseMcpServer(protocol_version="1999-01-01") as server:
        connection = SseConnection(server.url, http, auth_token=None)
        with pytest.raises(ConnectionClosed, match="1999-01-01"):
            await connection.open(timeout_s=5)
        await connection.close()


async def test_a_message_endpoint_on_another_origin_is_refused(http) -> None:
    """Our bearer token goes only where we connected, whatever the server's first event says."""
    async with (
        SseMcpServer() as elsewhere,
        SseMcpServer(endpoint_base=elsewhere.url.removesuffix("/sse")) as server,
    ):
        connection = SseConnection(server.url, http, auth_token="s3cret")
        with pytest.raises(ConnectionClosed, match="another origin"):
            await connection.open(timeout_s=5)
        await connection.close()
        assert elsewhere.headers == []  # nothing was sent there


async def test_kept_connection_is_reopened_once_when_the_server_forgot_it(server) -> None:
    connections = McpConnections()
    try:
        first = await connections.call(server.url, "echo", {"n": 1}, timeout_s=5)
        server.forget_sessions = True  # as a restarted server would
        with pytest.raises(TargetUnreachable, match="no longer knows this connection"):
            await connections.call(server.url, "echo", {"n": 2}, timeout_s=5)
        assert server.streams_opened == 2  # tried to reconnect once, then gave up
        server.forget_sessions = False
        second = await connections.call(server.url, "echo", {"n": 3}, timeout_s=5)
    finally:
        await connections.close()
    assert first["structuredContent"] == {"echo": {"n": 1}}
    assert second["structuredContent"] == {"echo": {"n": 3}}
    assert connections.connects == 2 and server.streams_opened == 3


async def test_kept_connection_does_not_repeat_a_call_whose_answer_was_lost(server) -> None:
    """The stream broke after the call was delivered: the tool may have run, so no retry."""
    connections = McpConnections()
    try:
        await connections.call(server.url, "echo", {}, timeout_s=5)
        with pytest.raises(TargetUnreachable, match=r"'drop' answered .*may or may not have run"):
            await connections.call(server.url, "drop", {}, timeout_s=5)
        assert server.methods().count("tools/call") == 2  # echo, drop: drop was sent once
        result = await connections.call(server.url, "echo", {"after": "drop"}, timeout_s=5)
    finally:
        await connections.close()
    assert result["structuredContent"] == {"echo": {"after": "drop"}}
    assert connections.connects == 2


async def test_a_silent_stream_is_taken_for_dead(http) -> None:
    """No message and no ping for `idle_stream_s`: a connection that died without a word
    (a NAT or proxy dropped it). The call fails then, not after its whole timeout."""
    async with SseMcpServer() as server:
        connection = SseConnection(server.url, http, auth_token=None, idle_stream_s=0.5)
        await connection.open(timeout_s=5)
        # Not CallTimedOut: the silence ends the call before its own timeout would.
        with pytest.raises(AnswerLost, match=r"silent for .* taken for dead"):
            await connection.call_tool("hang", {}, timeout_s=30)
        assert not connection.is_open
        await connection.close()


async def test_a_stream_kept_alive_by_pings_is_not(http) -> None:
    async with SseMcpServer(ping_every_s=0.05) as server:  # ten pings per idle_stream_s
        connection = SseConnection(server.url, http, auth_token=None, idle_stream_s=0.5)
        await connection.open(timeout_s=5)
        try:
            result = await connection.call_tool("slow", {"s": 1.0}, timeout_s=30)
            assert result["structuredContent"] == {"echo": {"s": 1.0}}
            assert connection.is_open
        finally:
            await connection.close()


async def test_kept_connection_whose_call_timed_out_is_dropped() -> None:
    """New calls get a fresh connection; calls still waiting on the old one get their answers,
    then it is closed (the server notices at its next keep-alive)."""
    connections = McpConnections()
    async with SseMcpServer(ping_every_s=0.1) as server:
        await _timed_out_connection_is_dropped(connections, server)


async def _timed_out_connection_is_dropped(
    connections: McpConnections, server: SseMcpServer
) -> None:
    try:
        await connections.call(server.url, "echo", {}, timeout_s=5)
        held = asyncio.create_task(connections.call(server.url, "held", {"n": 1}, timeout_s=30))
        async with asyncio.timeout(5):
            await server.wait_for("tools/call", count=2)  # held: waiting on the first connection
        with pytest.raises(CallTimedOut):
            await connections.call(server.url, "hang", {}, timeout_s=0.3)
        await connections.call(server.url, "echo", {"after": True}, timeout_s=5)
        assert (connections.connects, server.streams_opened) == (2, 2)
        assert not held.done()
        server.release_held.set()  # its answer comes over the old connection's stream
        assert (await held)["structuredContent"] == {"echo": {"n": 1}}
        async with asyncio.timeout(5):
            while server.streams_ended < 1:  # noqa: ASYNC110 (the server's own counter)
                await asyncio.sleep(0.05)
    finally:
        await connections.close()


@pytest.mark.parametrize("path", ["/sse", "/mcp"])
async def test_a_target_that_is_not_there_is_unreachable_over_either_transport(path) -> None:
    """Guards McpConnections._open: a refused connection is TargetUnreachable (route says
    'unreachable' to the person) over streamable HTTP too, where FastMCP's client raises its
    connect error again when it is closed after failing to open (httpx's ConnectError
    escaped route)."""
    connections = McpConnections()
    try:
        with pytest.raises(TargetUnreachable):
            await connections.call(f"http://127.0.0.1:{free_port()}{path}", "x", {}, timeout_s=5)
    finally:
        await connections.close()


class _EndlessAnswers:
    """A streamable-HTTP MCP server that shakes hands, then answers `tools/call` with a JSON
    body that never ends (or, asked for none, a gzip one), counting what it wrote."""

    def __init__(self, *, gzip: bool = False) -> None:
        self.gzip = gzip
        self.written = 0
        self.port = free_port()

    async def __aenter__(self) -> _EndlessAnswers:
        from aiohttp import web

        async def post(request: web.Request) -> web.StreamResponse:
            message = await request.json()
            if "id" not in message:
                return web.Response(status=202)
            if message["method"] == "initialize":
                result = {
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "endless", "version": "1"},
                }
                return web.json_response(
                    {"jsonrpc": "2.0", "id": message["id"], "result": result},
                    headers={"mcp-session-id": "s1"},
                )
            if message["method"] != "tools/call":  # (the SDK's probe of newer revisions)
                error = {"code": METHOD_NOT_FOUND, "message": "no"}
                return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": error})
            headers = {"Content-Type": "application/json"}
            if self.gzip:
                headers["Content-Encoding"] = "gzip"
            response = web.StreamResponse(headers=headers)
            await response.prepare(request)
            await response.write(b'{"jsonrpc":"2.0","id":%d,"result":{"content":[' % message["id"])
            with contextlib.suppress(ConnectionError):
                while self.written < 1 << 30:
                    await response.write(b"x" * 65536)
                    self.written += 65536
            return response

        async def other(request: web.Request) -> web.Response:
            return web.Response(status=405 if request.method == "GET" else 200)

        app = web.Application()
        app.router.add_post("/mcp", post)
        app.router.add_route("*", "/mcp", other)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


@pytest.mark.parametrize("gzip", [False, True])
async def test_an_endless_answer_over_streamable_http_is_not_read_whole(
    gzip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FastMCP's client (the MCP SDK) reads a JSON answer whole, whatever its size (a review:
    the gateway's remote children and tool servers could fill the process's memory); ours
    stops at MAX_MESSAGE_BYTES, the call fails saying so and the connection stays. A gzip
    answer (a few MB are gigabytes) is not read at all: none was asked for."""
    from butlers.mcp_connection import streamable

    monkeypatch.setattr(streamable, "MAX_MESSAGE_BYTES", 1 << 20)
    async with _EndlessAnswers(gzip=gzip) as server:
        connection = streamable.FastMcpConnection(
            f"http://127.0.0.1:{server.port}/mcp", auth_token=None
        )
        await connection.open(timeout_s=10)
        try:
            with pytest.raises(RemoteError) as caught:
                await connection.call_tool("any", {}, timeout_s=20)
            said = "a compressed answer" if gzip else f"an answer of over {1 << 20} bytes"
            assert said in str(caught.value), caught.value
            assert server.written < 64 << 20, server.written  # it stopped reading
            assert connection.is_open
        finally:
            await connection.close()
