"""The gateway's own three tools, `gateway_activate` / `gateway_deactivate` /
`gateway_status`, and what the host is told about them in each mode (the handlers are the
Gateway's)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import mcp_types
from fastmcp.tools.base import Tool, ToolResult

from butlers.tool_errors import ToolRefusal

Mode = Literal["suite", "activate", "both"]
CONTROL_TOOLS = ("gateway_activate", "gateway_deactivate", "gateway_status")
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
}
_STATUS = (
    "Every MCP server behind the gateway: state (warming, ready, active, error), its error if "
    "any, how many tools it has, and its suite tool."
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
}
