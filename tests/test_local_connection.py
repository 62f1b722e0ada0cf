"""LocalConnection's tool calls (FastMCP's own `call_tool`, no MCP session) answer exactly as
the same calls through the target's MCP session do: results, refusals, masked failures, bad
arguments, unknown tools, the call's `_meta`; and a caller that stops waiting cancels the
call. Both ways run on one butler server in this process (no database, no process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
from fastmcp import FastMCP
from opentelemetry import trace
from pydantic import BaseModel

from butlers.errors import AnswerLost, CallTimedOut, RemoteError
from butlers.mcp_connection.core import McpConnection
from butlers.mcp_connection.local import LocalConnection
from butlers.mcp_middleware import (
    CLASSIFICATION_META,
    CONVERSATION_META,
    ButlerMiddleware,
    butler_server,
    classification_claim,
    request_conversation,
)
from butlers.tool_errors import ToolRefusal
from tests.conftest import eventually


class Reading(BaseModel):
    kind: str
    value: float


class _BrokenGuard:
    """A guard with a bug: building a model with a secret fails validation."""

    def check_call(self, tool_name: str) -> None:
        if tool_name == "behind_a_broken_guard":
            Reading(kind="guard-secret", value="not a number")  # type: ignore[arg-type]


def _server() -> tuple[FastMCP, asyncio.Event]:
    middleware = ButlerMiddleware("target", trace.get_tracer(__name__))
    middleware.add_guard(_BrokenGuard())
    server = butler_server("target", middleware, instructions=None)
    cancelled = asyncio.Event()

    @server.tool
    async def behind_a_broken_guard() -> str:
        return "never"

    @server.tool
    async def gives_up() -> str:
        raise asyncio.CancelledError

    @server.tool
    async def a_dict(key: str) -> dict[str, Any]:
        return {"key": key, "n": 1}

    @server.tool
    async def a_text() -> str:
        return "plain words"

    @server.tool
    async def a_number(x: int) -> int:
        return x * 2

    @server.tool
    async def nothing() -> None:
        return None

    @server.tool
    async def a_model() -> Reading:
        return Reading(kind="weight", value=71.5)

    @server.tool
    def in_a_thread(x: int) -> list[int]:
        return [x, x]

    @server.tool
    async def refuses() -> str:
        raise ToolRefusal("no: the key is empty")

    @server.tool
    async def breaks() -> str:
        raise RuntimeError("a secret detail the caller must not see")

    @server.tool
    async def what_the_call_says() -> dict[str, Any]:
        claim = classification_claim()
        return {
            "conversation": request_conversation(),
            "claim": None if claim is None else claim.where,
        }

    @server.tool
    async def dawdles() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    return server, cancelled


@pytest.fixture
async def local() -> AsyncIterator[tuple[LocalConnection, asyncio.Event]]:
    server, cancelled = _server()
    connection = LocalConnection(server, label="local")
    await connection.open(10)
    try:
        yield connection, cancelled
    finally:
        await connection.close()


CALLS: list[tuple[str, dict[str, Any], dict[str, str] | None]] = [
    ("a_dict", {"key": "k"}, None),
    ("a_text", {}, None),
    ("a_number", {"x": 21}, None),
    ("nothing", {}, None),
    ("a_model", {}, None),
    ("in_a_thread", {"x": 3}, None),
    ("refuses", {}, None),
    ("breaks", {}, None),
    ("a_number", {"x": "not a number"}, None),  # bad arguments
    ("a_number", {}, None),  # a missing one
    ("a_dict", {"key": "k", "extra": 1}, None),  # one too many
    ("no_such_tool", {}, None),
    ("behind_a_broken_guard", {}, None),  # the SDK's answer, without pydantic's text
    ("a_dict", {"key": "k", "_trace_context": "not an object"}, None),  # refused by the middleware
    (
        "what_the_call_says",
        {},
        {
            CONVERSATION_META: "telegram:42",
            CLASSIFICATION_META: "a credential",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        },
    ),
]


@pytest.mark.parametrize(("name", "arguments", "meta"), CALLS, ids=[c[0] for c in CALLS])
async def test_a_call_answers_as_through_the_session(
    local: tuple[LocalConnection, asyncio.Event],
    name: str,
    arguments: dict[str, Any],
    meta: dict[str, str] | None,
) -> None:
    connection, _ = local
    through_session = await _answer(
        McpConnection.call_tool(connection, name, dict(arguments), meta=meta, timeout_s=10)
    )
    direct = await _answer(connection.call_tool(name, dict(arguments), meta=meta, timeout_s=10))
    assert direct == through_session
    assert "guard-secret" not in str(direct)
    if name == "breaks":
        assert direct["isError"] and "secret detail" not in str(direct)
    if name == "what_the_call_says":
        assert direct["structuredContent"] == {
            "conversation": "telegram:42",
            "claim": f"_meta {CLASSIFICATION_META!r}",
        }


async def _answer(call: Awaitable[dict[str, Any]]) -> Any:
    """A call's result, or the JSON-RPC error it was answered with."""
    try:
        return await call
    except RemoteError as exc:
        return ("error", exc.code, exc.message)


async def test_a_tool_that_ends_cancelled_answers_at_once(
    local: tuple[LocalConnection, asyncio.Event],
) -> None:
    """A tool that raises CancelledError itself (or awaits what someone else cancelled): its
    caller hears at once that no answer will come, not after its whole timeout, and the
    connection serves on. (Through the session the same call ends the whole session.)"""
    connection, _ = local
    async with asyncio.timeout(5):  # far under the call's own 300 s
        with pytest.raises(AnswerLost):
            await connection.call_tool("gives_up", {}, timeout_s=300)
    assert (await connection.call_tool("a_number", {"x": 2}, timeout_s=10))["structuredContent"]


async def test_a_call_carries_nothing_of_its_callers_context(
    local: tuple[LocalConnection, asyncio.Event],
) -> None:
    """The caller's own `_meta` (a contextvar of this task) is not the call's: only what it
    passes as `meta` is."""
    connection, _ = local
    from butlers.mcp_middleware import LOCAL_CALL_META

    token = LOCAL_CALL_META.set({CONVERSATION_META: "someone else's"})
    try:
        answer = await connection.call_tool("what_the_call_says", {}, timeout_s=10)
    finally:
        LOCAL_CALL_META.reset(token)
    assert answer["structuredContent"] == {"conversation": None, "claim": None}


async def test_a_caller_that_stops_waiting_cancels_the_call(
    local: tuple[LocalConnection, asyncio.Event],
) -> None:
    connection, cancelled = local
    with pytest.raises(CallTimedOut):
        await connection.call_tool("dawdles", {}, timeout_s=0.2)
    async with asyncio.timeout(5):
        await cancelled.wait()

    async def ended() -> bool:
        return not connection._calls

    await eventually(ended, 5)
    assert (await connection.call_tool("a_number", {"x": 1}, timeout_s=10))["structuredContent"]
