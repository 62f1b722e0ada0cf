"""A butler's FastMCP server as `butlers.mcp_middleware.butler_server` builds it: what it lists
has its `$ref`s inlined (some MCP clients cannot follow them), while a tool call passes only
through the butler's own middleware (its span and guards), not FastMCP's listing layer."""

from __future__ import annotations

from typing import Any

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from butlers.mcp_middleware import ButlerMiddleware, butler_server
from butlers.tool_errors import ToolRefusal


class Place(BaseModel):
    city: str
    zone: str


class Reminder(BaseModel):
    text: str
    where: Place


class RefuseTool:
    """A guard refusing one tool by name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def check_call(self, tool_name: str) -> None:
        if tool_name == self.name:
            raise ToolRefusal(f"{tool_name} is refused here")


def _contains_key(value: Any, key: str) -> bool:
    if isinstance(value, dict):
        return key in value or any(_contains_key(v, key) for v in value.values())
    if isinstance(value, list):
        return any(_contains_key(v, key) for v in value)
    return False


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def server(spans: InMemorySpanExporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    middleware = ButlerMiddleware("keeper", provider.get_tracer(__name__))
    middleware.add_guard(RefuseTool("forget"))
    mcp = butler_server("keeper", middleware, instructions="keeps reminders")

    @mcp.tool
    async def remember(reminder: Reminder) -> dict[str, str]:
        return {"kept": reminder.text, "city": reminder.where.city}

    @mcp.tool
    async def forget(text: str) -> str:
        return f"forgot {text}"

    return mcp


async def test_listed_schemas_have_their_refs_inlined(server) -> None:
    async with Client(server) as client:
        tools = {tool.name: tool for tool in await client.list_tools()}
    schema = tools["remember"].input_schema
    assert not _contains_key(schema, "$ref") and not _contains_key(schema, "$defs"), schema
    where = schema["properties"]["reminder"]["properties"]["where"]
    assert set(where["properties"]) == {"city", "zone"}


async def test_a_call_goes_through_the_butlers_span_and_guards(
    server, spans: InMemorySpanExporter
) -> None:
    reminder = {"text": "water the plants", "where": {"city": "Lyon", "zone": "Europe/Paris"}}
    async with Client(server) as client:
        result = await client.call_tool("remember", {"reminder": reminder})
        assert result.structured_content == {"kept": "water the plants", "city": "Lyon"}
        with pytest.raises(ToolError, match="forget is refused here"):
            await client.call_tool("forget", {"text": "everything"})
    names = [span.name for span in spans.get_finished_spans()]
    assert names.count("keeper/remember") == 1 and names.count("keeper/forget") == 1, names
