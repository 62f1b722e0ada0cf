"""route's outbound MCP-over-SSE session against a scripted server that frames events awkwardly.

The real butlers (FastMCP) are covered through `route` in test_route.py; these are the cases a
well-behaved server never shows: events cut into 5-byte chunks with CRLF endings and multi-line
data, server requests in the middle of a call, hangs, dropped streams, forgotten sessions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from butlers.errors import AnswerLost, CallTimedOut, ConnectionClosed, RemoteError
from butlers.mcp_connection.sse import SseConnection
from butlers.switchboard.pool import McpClientPool, TargetUnreachable
from tests.fakes.sse_mcp import SseMcpServer


@pytest.fixture
async def server() -> AsyncIterator[SseMcpServer]:
    async with SseMcpServer() as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


async def opened(server: SseMcpServer, http: aiohttp.ClientSession, **kwargs) -> SseConnection:
    session = SseConnection(server.url, http, auth_token=kwargs.pop("auth_token", None))
    await session.open(timeout_s=5)
    return session


async def test_handshake_and_call_over_chopped_events(server, http) -> None:
    session = await opened(server, http)
    try:
        result = await session.call_tool(
            "echo", {"text": "hé, world"}, meta={"traceparent": "00-ab-cd-01"}, timeout_s=5
        )
    finally:
        await session.close()
    assert result["structuredContent"] == {"echo": {"text": "hé, world"}}
    assert server.methods() == ["initialize", "notifications/initialized", "tools/call"]
    initialize, _, call = server.received
    assert initialize["params"]["protocolVersion"] == "2025-11-25"
    assert call["params"]["_meta"] == {"traceparent": "00-ab-cd-01"}


async def test_concurrent_calls_each_get_their_own_answer(server, http) -> None:
    session = await opened(server, http)
    try:
        results = await asyncio.gather(
            *(session.call_tool("echo", {"n": n}, timeout_s=5) for n in range(40))
        )
    finally:
        await session.close()
    assert [r["structuredContent"]["echo"]["n"] for r in results] == list(range(40))


async def test_server_requests_mid_call_are_answered(server, http) -> None:
    session = await opened(server, http)
    try:
        result = await session.call_tool("ask_first", {}, timeout_s=5)
    finally:
        await session.close()
    assert result["content"][0]["text"] == "answered after asking"
    replies = {m["id"]: m for m in server.received if "method" not in m}
    assert replies["srv-ping"]["result"] == {}
    assert replies["srv-roots"]["error"]["code"] == -32601


async def test_a_large_result_arrives_whole(http) -> None:
    async with SseMcpServer(chunk_size=65_536) as server:
        session = await opened(server, http)
        try:
            result = await session.call_tool("big", {"size": 3_000_000}, timeout_s=10)
        finally:
            await session.close()
    assert result["content"][0]["text"] == "x" * 3_000_000


async def test_a_json_rpc_error_is_raised_with_its_message(server, http) -> None:
    session = await opened(server, http)
    try:
        with pytest.raises(RemoteError, match="scripted failure") as caught:
            await session.call_tool("error", {}, timeout_s=5)
        assert caught.value.code == -32602
        # the session is still usable
        assert (await session.call_tool("echo", {}, timeout_s=5))["structuredContent"]
    finally:
        await session.close()


async def test_a_timeout_raises_and_tells_the_server(server, http) -> None:
    session = await opened(server, http)
    try:
        with pytest.raises(CallTimedOut, match=r"0\.3s"):
            await session.call_tool("hang", {}, timeout_s=0.3)
        call_id = server.received[-1]["id"]
        async with asyncio.timeout(5):
            cancelled = await server.wait_for("notifications/cancelled")
        assert cancelled["params"]["requestId"] == call_id
        assert session.is_open
    finally:
        await session.close()


async def test_a_dropped_stream_fails_waiting_calls_at_once(server, http) -> None:
    session = await opened(server, http)
    try:
        waiting = asyncio.gather(
            *(session.call_tool("hang", {}, timeout_s=30) for _ in range(3)),
            return_exceptions=True,
        )
        async with asyncio.timeout(5):
            await server.wait_for("tools/call", count=3)  # all three delivered, now waiting
            with pytest.raises(AnswerLost, match="^the event stream ended$"):
                await session.call_tool("drop", {}, timeout_s=30)
            outcomes = await waiting
        assert all(isinstance(o, AnswerLost) for o in outcomes)
        assert not session.is_open
        with pytest.raises(ConnectionClosed):  # not sent at all: safe to send elsewhere
            await session.call_tool("echo", {}, timeout_s=5)
    finally:
        await session.close()


async def test_bearer_token_on_stream_and_messages(server, http) -> None:
    session = await opened(server, http, auth_token="s3cret")
    try:
        await session.call_tool("echo", {}, timeout_s=5)
    finally:
        await session.close()
    assert server.headers and all(h["Authorization"] == "Bearer s3cret" for h in server.headers)


async def test_an_unsupported_protocol_version_is_refused(http) -> None:
    async with SseMcpServer(protocol_version="1999-01-01") as server:
        session = SseConnection(server.url, http, auth_token=None)
        with pytest.raises(ConnectionClosed, match="1999-01-01"):
            await session.open(timeout_s=5)
        await session.close()


async def test_a_message_endpoint_on_another_origin_is_refused(http) -> None:
    """Our bearer token goes only where we connected, whatever the server's first event says."""
    async with (
        SseMcpServer() as elsewhere,
        SseMcpServer(endpoint_base=elsewhere.url.removesuffix("/sse")) as server,
    ):
        session = SseConnection(server.url, http, auth_token="s3cret")
        with pytest.raises(ConnectionClosed, match="another origin"):
            await session.open(timeout_s=5)
        await session.close()
        assert elsewhere.headers == []  # nothing was sent there


async def test_pool_reopens_a_session_the_server_forgot_once(server) -> None:
    pool = McpClientPool()
    try:
        first = await pool.call(server.url, "echo", {"n": 1}, timeout_s=5)
        server.forget_sessions = True  # as a restarted server would
        with pytest.raises(TargetUnreachable, match="no longer knows this connection"):
            await pool.call(server.url, "echo", {"n": 2}, timeout_s=5)
        assert server.streams_opened == 2  # tried to reconnect once, then gave up
        server.forget_sessions = False
        second = await pool.call(server.url, "echo", {"n": 3}, timeout_s=5)
    finally:
        await pool.close()
    assert first["structuredContent"] == {"echo": {"n": 1}}
    assert second["structuredContent"] == {"echo": {"n": 3}}
    assert pool.connects == 2 and server.streams_opened == 3


async def test_pool_does_not_repeat_a_call_whose_answer_was_lost(server) -> None:
    """The stream broke after the call was delivered: the tool may have run, so no retry."""
    pool = McpClientPool()
    try:
        await pool.call(server.url, "echo", {}, timeout_s=5)
        with pytest.raises(TargetUnreachable, match=r"'drop' answered .*may or may not have run"):
            await pool.call(server.url, "drop", {}, timeout_s=5)
        assert server.methods().count("tools/call") == 2  # echo, drop: drop was sent once
        result = await pool.call(server.url, "echo", {"after": "drop"}, timeout_s=5)
    finally:
        await pool.close()
    assert result["structuredContent"] == {"echo": {"after": "drop"}}
    assert pool.connects == 2


async def test_a_silent_stream_is_taken_for_dead(http) -> None:
    """No message and no ping for `idle_stream_s`: a connection that died without a word
    (a NAT or proxy dropped it). The call fails then, not after its whole timeout."""
    async with SseMcpServer() as server:
        session = SseConnection(server.url, http, auth_token=None, idle_stream_s=0.5)
        await session.open(timeout_s=5)
        # Not CallTimedOut: the silence ends the call before its own timeout would.
        with pytest.raises(AnswerLost, match=r"silent for .* taken for dead"):
            await session.call_tool("hang", {}, timeout_s=30)
        assert not session.is_open
        await session.close()


async def test_a_stream_kept_alive_by_pings_is_not(http) -> None:
    async with SseMcpServer(ping_every_s=0.05) as server:  # ten pings per idle_stream_s
        session = SseConnection(server.url, http, auth_token=None, idle_stream_s=0.5)
        await session.open(timeout_s=5)
        try:
            result = await session.call_tool("slow", {"s": 1.5}, timeout_s=30)
            assert result["structuredContent"] == {"echo": {"s": 1.5}}
            assert session.is_open
        finally:
            await session.close()


async def test_pool_drops_a_session_whose_call_timed_out() -> None:
    """New calls get a fresh session; calls still waiting on the old one get their answers,
    then it is closed (the server notices at its next keep-alive)."""
    pool = McpClientPool()
    async with SseMcpServer(ping_every_s=0.1) as server:
        await _timed_out_session_is_dropped(pool, server)


async def _timed_out_session_is_dropped(pool: McpClientPool, server: SseMcpServer) -> None:
    try:
        await pool.call(server.url, "echo", {}, timeout_s=5)
        held = asyncio.create_task(pool.call(server.url, "held", {"n": 1}, timeout_s=30))
        async with asyncio.timeout(5):
            await server.wait_for("tools/call", count=2)  # held: waiting on the first session
        with pytest.raises(CallTimedOut):
            await pool.call(server.url, "hang", {}, timeout_s=0.3)
        await pool.call(server.url, "echo", {"after": True}, timeout_s=5)
        assert (pool.connects, server.streams_opened) == (2, 2)
        assert not held.done()
        server.release_held.set()  # its answer comes over the old session's stream
        assert (await held)["structuredContent"] == {"echo": {"n": 1}}
        async with asyncio.timeout(5):
            while server.streams_ended < 1:  # noqa: ASYNC110 (the server's own counter)
                await asyncio.sleep(0.05)
    finally:
        await pool.close()
