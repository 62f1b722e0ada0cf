"""butlers.tool_templates: a tool registered by several butlers from one `def` is parsed once,
and each butler's copy is exactly what FastMCP's own parse gives, running its own closure."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from fastmcp import FastMCP
from fastmcp.tools import FunctionTool
from opentelemetry import trace

from butlers import tool_templates
from butlers.core_tools import register_core_tools
from butlers.mcp_middleware import ButlerMiddleware, butler_server
from butlers.tool_templates import add_tool


class _Store:
    """What `state_get` reads: one value, which says whose store it is."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    async def state_get(self, key: str) -> dict[str, Any]:
        return {"value": f"{self.owner}:{key}"}


def _butler(name: str) -> FastMCP:
    server = butler_server(
        name, ButlerMiddleware(name, trace.get_tracer(__name__)), instructions=None
    )
    register_core_tools(server, SimpleNamespace(store=_Store(name), config=None))  # type: ignore[arg-type]
    return server


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No template from earlier tests; the name of every function FastMCP parses."""
    monkeypatch.setattr(tool_templates, "_templates", {})
    parsed: list[str] = []
    original = FunctionTool.from_function.__func__  # type: ignore[attr-defined]

    def counting(cls: type[FunctionTool], fn: Any, **kwargs: Any) -> FunctionTool:
        parsed.append(fn.__name__)
        return original(cls, fn, **kwargs)

    monkeypatch.setattr(FunctionTool, "from_function", classmethod(counting))
    return parsed


async def test_the_core_tools_are_parsed_once_for_every_butler(parses: list[str]) -> None:
    first = _butler("first")
    names = sorted(t.name for t in await first.list_tools(run_middleware=False))
    assert sorted(parses) == names and len(names) >= 17
    parses.clear()
    second, third = _butler("second"), _butler("third")
    assert parses == []
    for server in (second, third):
        assert sorted(t.name for t in await server.list_tools(run_middleware=False)) == names


async def test_a_copy_is_what_fastmcp_parses(parses: list[str]) -> None:
    _butler("first")
    copied = {t.name: t for t in await _butler("second").list_tools(run_middleware=False)}
    # FastMCP's own `@mcp.tool`, on the second butler's very functions.
    reference = FastMCP("reference")
    for tool in copied.values():
        reference.tool(tool.fn)
    parsed = {t.name: t for t in await reference.list_tools(run_middleware=False)}
    assert copied.keys() == parsed.keys()
    for name, tool in copied.items():
        assert tool.model_dump(exclude={"fn"}) == parsed[name].model_dump(exclude={"fn"}), name
        assert tool.to_mcp_tool() == parsed[name].to_mcp_tool(), name


async def test_each_butler_runs_its_own_closure_with_its_own_schemas(parses: list[str]) -> None:
    first, second = _butler("first"), _butler("second")
    for server in (first, second):
        result = await server.call_tool("state_get", {"key": "k"})
        assert result.structured_content == {"result": f"{server.name}:k"}
    one, other = await first.get_tool("state_set"), await second.get_tool("state_set")
    assert one.parameters == other.parameters
    assert one.parameters is not other.parameters
    one.parameters["properties"]["key"]["edited"] = True
    assert "edited" not in other.parameters["properties"]["key"]


def _probe(default: int):
    async def probe(count: int = default) -> int:
        """Echo the count."""
        return count

    return probe


def _described(description: str):
    async def probe(count: int) -> int:
        return count

    probe.__doc__ = description
    return probe


def _wrapped(default: int):
    """A decorated function: the decorator's one wrapper code serves every function it wraps."""

    async def probe(count: int = default) -> int:
        return count

    @functools.wraps(probe)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        return await probe(*args, **kwargs)

    return wrapper


async def test_a_wrapper_is_parsed_for_what_it_wraps(parses: list[str]) -> None:
    servers = [FastMCP(f"s{i}") for i in range(2)]
    add_tool(servers[0], _wrapped(1))
    add_tool(servers[1], _wrapped(2))
    assert parses == ["probe"] * 2
    tools = [await server.get_tool("probe") for server in servers]
    assert [t.parameters["properties"]["count"]["default"] for t in tools] == [1, 2]


async def test_a_closure_with_other_defaults_or_docs_is_parsed_anew(parses: list[str]) -> None:
    servers = [FastMCP(f"s{i}") for i in range(4)]
    add_tool(servers[0], _probe(1))
    add_tool(servers[1], _probe(2))
    add_tool(servers[2], _described("one"))
    add_tool(servers[3], _described("two"))
    assert parses == ["probe"] * 4
    tools = [await server.get_tool("probe") for server in servers]
    assert [t.parameters["properties"]["count"]["default"] for t in tools[:2]] == [1, 2]
    assert [t.description for t in tools[2:]] == ["one", "two"]
    assert [(await s.call_tool("probe", {})).structured_content for s in servers[:2]] == [
        {"result": 1},
        {"result": 2},
    ]
