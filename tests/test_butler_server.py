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


async def test_a_tool_is_looked_up_in_its_one_provider_as_fastmcp_would_without_a_task_group(
    server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ButlerServer._get_tool` (a lookup per tool call, twice per routed call): the same
    answers as FastMCP's own aggregate lookup, without its task group."""
    from fastmcp.server.providers import aggregate

    names = ["remember", "forget", "nothing_by_that_name"]
    fastmcps = [await aggregate.AggregateProvider._get_tool(server, name) for name in names]
    assert fastmcps[0] is not None and fastmcps[1] is not None and fastmcps[2] is None

    gathered = []
    real_gather = aggregate.gather

    def counting_gather(*args: Any, **kwargs: Any) -> Any:
        gathered.append(args)
        return real_gather(*args, **kwargs)

    monkeypatch.setattr(aggregate, "gather", counting_gather)
    assert [await server._get_tool(name) for name in names] == fastmcps
    assert [await server.get_tool(name) for name in names] == fastmcps
    assert gathered == []
    async with Client(server) as client:
        result = await client.call_tool("forget", {"text": "x"}, raise_on_error=False)
        assert "forget is refused here" in result.content[0].text  # (found, then refused)
        listed = {tool.name for tool in await client.list_tools()}
    assert listed == {"remember", "forget"}
    assert gathered  # (listings still ask every provider: the counter does count)
    # What FastMCP decides around the lookup still holds: a disabled tool is not found.
    server.disable(names={"remember"})
    assert await server.get_tool("remember") is None


async def test_a_provider_that_fails_a_lookup_is_handled_as_fastmcp_does(
    server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logged and not found (FastMCP's default strategy), or raised (`"raise"`), exactly as
    its own lookup does; a cancellation is never taken for a failure."""
    import asyncio

    from fastmcp.server.providers.aggregate import AggregateProvider

    [provider] = server.providers

    async def broken(name: str, version: Any = None) -> None:
        raise RuntimeError("the provider broke")

    monkeypatch.setattr(provider, "get_tool", broken)
    assert await server._get_tool("remember") is None
    assert await AggregateProvider._get_tool(server, "remember") is None
    server.provider_error_strategy = "raise"
    for lookup in (server._get_tool, lambda name: AggregateProvider._get_tool(server, name)):
        with pytest.raises(RuntimeError, match="the provider broke"):
            await lookup("remember")

    never = asyncio.Event()

    async def hanging(name: str, version: Any = None) -> None:
        await never.wait()

    monkeypatch.setattr(provider, "get_tool", hanging)
    server.provider_error_strategy = "warn"
    lookup = asyncio.ensure_future(server._get_tool("remember"))
    await asyncio.sleep(0.01)
    lookup.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lookup


async def test_a_server_with_more_than_one_provider_looks_up_as_fastmcp_does(server) -> None:
    from fastmcp import FastMCP

    mounted = FastMCP("extra")

    @mounted.tool
    def extra() -> str:
        return "from the mounted server"

    server.mount(mounted)
    assert len(server.providers) == 2
    async with Client(server) as client:
        assert (await client.call_tool("extra", {})).data == "from the mounted server"
        assert (await client.call_tool("forget", {"text": "x"}, raise_on_error=False)).is_error


async def test_a_tools_own_auth_is_checked_as_fastmcp_checks_it() -> None:
    """FastMCP checks a tool's `auth` twice in a lookup: on the provider's answer (in its own
    `_get_tool`, which calls the one-provider step as its `super()`) and after its
    transforms. A butler's server checks it as often, and a tool it refuses is not found."""
    from fastmcp import FastMCP
    from opentelemetry import trace

    checked: dict[str, list[str]] = {"butler": [], "fastmcp": []}

    def with_tools(server: FastMCP, key: str) -> FastMCP:
        def allowed(ctx: Any) -> bool:
            checked[key].append(ctx.component.name)
            return ctx.component.name != "hidden"

        @server.tool(auth=allowed)
        def shown() -> str:
            return "shown"

        @server.tool(auth=allowed)
        def hidden() -> str:
            return "hidden"

        return server

    middleware = ButlerMiddleware("keeper", trace.get_tracer(__name__))
    ours = with_tools(butler_server("keeper", middleware, instructions=None), "butler")
    plain = with_tools(FastMCP("plain"), "fastmcp")
    for server in (ours, plain):
        assert (await server.get_tool("shown")) is not None
        assert (await server.get_tool("hidden")) is None
    assert checked["fastmcp"] == ["shown", "shown", "hidden"]  # (what FastMCP does today)
    assert checked["butler"] == checked["fastmcp"]


async def test_invalid_arguments_are_said_in_one_line_naming_each(server) -> None:
    """What pydantic finds wrong with a call's arguments, one line: each argument with what
    was wrong and what was given; a missing one without a value; no URL."""
    async with Client(server) as client:
        with pytest.raises(ToolError) as refused:
            await client.call_tool("remember", {"reminder": {"text": 5}})
    said = str(refused.value)
    assert "\n" not in said and "errors.pydantic.dev" not in said, said
    assert said.startswith("remember: reminder.text: Input should be a valid string (got 5)")
    assert "reminder.where: Field required" in said and "(got" not in said.split("; ")[-1]
