"""Every tool continues its caller's trace: `_trace_context`, `_meta.traceparent`, or the
HTTP `traceparent` header (what Claude Code sends), in that order of preference."""

from __future__ import annotations

import pytest
from fastmcp import Client
from fastmcp.client.transports import SSETransport

from tests.conftest import StartButler
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _tool_span(spans, name: str):
    [span] = [s for s in spans.get_finished_spans() if s.name == name]
    return span


def _ancestors(span, spans) -> list[str]:
    """Names of the span's recorded ancestors, nearest first."""
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    names = []
    parent = span.parent
    while parent is not None and parent.span_id in by_id:
        names.append(by_id[parent.span_id].name)
        parent = by_id[parent.span_id].parent
    return names


async def test_trace_context_argument_continues_the_trace(start_butler: StartButler, spans) -> None:
    daemon = await start_butler()
    async with Client(daemon.sse_url) as client:
        await client.call_tool(
            "state_set", {"key": "k", "value": 1, "_trace_context": {"traceparent": TRACEPARENT}}
        )
    span = _tool_span(spans, "alpha/state_set")
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert span.attributes["tool_name"] == "state_set"


async def test_meta_traceparent_is_honoured(start_butler: StartButler, spans, telemetry) -> None:
    """A FastMCP client inside a span puts its traceparent in `_meta`; the tool continues it."""
    daemon = await start_butler()
    async with Client(daemon.sse_url) as client:
        with telemetry.for_butler("caller").tracer.start_as_current_span("caller") as caller:
            await client.call_tool("status", {})
    span = _tool_span(spans, "alpha/status")
    assert span.context.trace_id == caller.get_span_context().trace_id
    assert _ancestors(span, spans)[-1] == "caller"


async def test_http_traceparent_header_is_honoured(
    start_butler: StartButler, spans, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What Claude Code does: the header on every MCP request, nothing in `_meta`."""
    import fastmcp.client.mixins.tools as fastmcp_client_tools
    import mcp.shared.jsonrpc_dispatcher as mcp_dispatcher

    # FastMCP's and the MCP SDK's clients put their own span in `_meta`; Claude Code does not.
    monkeypatch.setattr(fastmcp_client_tools, "inject_trace_context", lambda meta: meta)
    monkeypatch.setattr(mcp_dispatcher, "inject_trace_context", lambda meta: None)
    daemon = await start_butler()
    transport = SSETransport(daemon.sse_url, headers={"traceparent": TRACEPARENT})
    async with Client(transport) as client:
        await client.call_tool("status", {})
    span = _tool_span(spans, "alpha/status")
    assert format(span.context.trace_id, "032x") == TRACE_ID


async def test_without_context_each_call_is_its_own_trace(start_butler: StartButler, spans) -> None:
    """A caller's trace ends with its call: the next calls on the same session, without
    context, are roots of new traces of their own."""
    daemon = await start_butler()
    async with Client(daemon.sse_url) as client:
        await client.call_tool("status", {"_trace_context": {"traceparent": TRACEPARENT}})
        await client.call_tool("status", {})
        await client.call_tool("status", {})
    with_context, *without = [s for s in spans.get_finished_spans() if s.name == "alpha/status"]
    assert format(with_context.context.trace_id, "032x") == TRACE_ID
    assert len(without) == 2
    assert [s.parent for s in without] == [None, None]
    trace_ids = {format(s.context.trace_id, "032x") for s in without}
    assert len(trace_ids) == 2 and TRACE_ID not in trace_ids
    assert all(s.context.is_valid for s in without)


async def test_triggered_session_tools_join_the_trigger_trace(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, spans
) -> None:
    """trigger -> Claude Code session -> the butler's own tool: one trace, parent links intact."""
    daemon = await start_butler()
    scripted_api.script([tool_use("mcp__alpha__state_get", {"key": "x"})], [text("nothing")])
    async with Client(daemon.sse_url) as client:
        result = await client.call_tool(
            "trigger", {"prompt": "look", "_trace_context": {"traceparent": TRACEPARENT}}
        )
    assert result.data["trace_id"] == TRACE_ID
    trigger = _tool_span(spans, "alpha/trigger")
    session = _tool_span(spans, "butler.session")
    tool = _tool_span(spans, "alpha/state_get")
    assert {format(s.context.trace_id, "032x") for s in (trigger, session, tool)} == {TRACE_ID}
    assert trigger.parent.span_id == int(PARENT_ID, 16)
    assert "alpha/trigger" in _ancestors(session, spans)
    # The session's tool call came back in through Claude Code, under the session's span.
    assert _ancestors(tool, spans)[0] == "butler.session"


async def test_session_cannot_call_tools_outside_its_allow_list(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, spans
) -> None:
    daemon = await start_butler()
    scripted_api.script(
        [
            tool_use("mcp__alpha__trigger", {"prompt": "recurse"}),
            tool_use("Bash", {"command": "id"}),
        ],
        [text("could not")],
    )
    async with Client(daemon.sse_url) as client:
        result = await client.call_tool("trigger", {"prompt": "try"})
    assert result.data["result"] == "could not"
    results = scripted_api.tool_results()
    assert len(results) == 2 and all(r.get("is_error") for r in results)
    # Only the outer trigger reached the butler: the session's own attempt never did.
    assert len([s for s in spans.get_finished_spans() if s.name == "alpha/trigger"]) == 1
