"""The gateway's own tools, `gateway_activate` / `gateway_deactivate` / `gateway_status`
(and in search mode `gateway_search` / `gateway_describe` / `gateway_call` in place of the
first two), and what the host is told about them in each mode (the handlers are the
Gateway's)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import mcp_types
from fastmcp.tools.base import Tool, ToolResult

from butlers.tool_errors import ToolRefusal

Mode = Literal["suite", "activate", "both", "search"]
CONTROL_TOOLS = ("gateway_activate", "gateway_deactivate", "gateway_status")
SEARCH_TOOLS = ("gateway_search", "gateway_describe", "gateway_call", "gateway_status")
SEARCH_LIMIT_MAX = 50
SEARCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "what you want done, in plain words"},
        "limit": {
            "type": "integer",
            "minimum": 1,
            "maximum": SEARCH_LIMIT_MAX,
            "default": 5,
            "description": "how many tools at most",
        },
    },
    "required": ["query"],
}
TOOL_NAME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "description": "a name gateway_search gave"}},
    "required": ["name"],
}
CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "a name gateway_search gave"},
        "arguments": {"type": "object", "description": "as gateway_describe's inputSchema says"},
    },
    "required": ["name"],
}


def control_tools(mode: Mode) -> tuple[str, ...]:
    """The gateway's own tools a host sees in `mode`."""
    return SEARCH_TOOLS if mode == "search" else CONTROL_TOOLS


NAME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "description": "an MCP server's name"}},
    "required": ["name"],
}


class ControlTool(Tool):
    """A `gateway_*` tool: its handler's answer as JSON text and structured content (a list
    under "result", as FastMCP gives a function's). Declared with its schema, not from a
    function's signature: FastMCP would parse the docstrings with griffe at start (30 ms of a
    gateway's start-up, measured)."""

    _handler: Callable[[dict[str, Any]], Awaitable[Any]]

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        value = await self._handler(arguments)
        if isinstance(value, ToolResult):  # gateway_call: the child's result, unchanged
            return value
        return ToolResult(
            content=[mcp_types.TextContent(type="text", text=json.dumps(value))],
            structured_content=value if isinstance(value, dict) else {"result": value},
        )


def name_argument(arguments: dict[str, Any]) -> str:
    name = arguments.get("name")
    if not isinstance(name, str) or not name:
        raise ToolRefusal("'name' must be an MCP server's name (see gateway_status)")
    return name


INSTRUCTIONS: dict[Mode, str] = {
    "suite": "One tool per MCP server behind this gateway: call a suite tool with action "
    "'introspect' to see its tools, 'call' to run one; or gateway_activate a server to get its "
    "tools directly.",
    "activate": "The MCP servers behind this gateway are off until you need one: "
    "gateway_status lists them, gateway_activate puts a server's tools into your tool list, "
    "gateway_deactivate takes them out again.",
    "both": "One tool per MCP server behind this gateway: call a suite tool with action "
    "'introspect' to see its tools, 'call' to run one; or gateway_activate a server to get its "
    "own tools instead of its suite tool.",
    "search": "The tools of every MCP server behind this gateway, found on demand: "
    "gateway_search finds tools by what you want done, gateway_describe gives one's full "
    "description and input schema, gateway_call runs it.",
}
_STATUS = (
    "Every MCP server behind the gateway: state (warming, ready, active, error), its error if "
    "any, how many of its tools you may call, and its suite tool."
)
CONTROL_DESCRIPTIONS: dict[Mode, dict[str, str]] = {
    "suite": {
        "gateway_activate": "Put the tools of the MCP server `name` into your tool list (see "
        "gateway_status for the names). Its suite tool keeps working too.",
        "gateway_deactivate": "Take the tools of `name` out of your tool list again (it stays "
        "warm).",
        "gateway_status": _STATUS,
    },
    "activate": {
        "gateway_activate": "Put the tools of the MCP server `name` into your tool list (see "
        "gateway_status for the names).",
        "gateway_deactivate": "Take the tools of `name` out of your tool list again (it stays "
        "warm).",
        "gateway_status": _STATUS,
    },
    "both": {
        "gateway_activate": "Put the tools of the MCP server `name` into your tool list, in "
        "place of its suite tool (see gateway_status for the names).",
        "gateway_deactivate": "Take the tools of `name` out of your tool list again; its suite "
        "tool comes back (it stays warm).",
        "gateway_status": _STATUS,
    },
    "search": {
        "gateway_search": "Find the tools of the MCP servers behind this gateway that fit "
        "`query` (plain words: what you want done). Best first: name (what gateway_describe "
        "and gateway_call take), server and a short summary.",
        "gateway_describe": "The full description and input schema of the tool `name` (from "
        "gateway_search).",
        "gateway_call": "Run the tool `name` (from gateway_search) with `arguments` (as "
        "gateway_describe's inputSchema says); its result comes back unchanged.",
        "gateway_status": "Every MCP server behind the gateway: state (warming, ready, error), "
        "its error if any, and how many of its tools you may call.",
    },
}
