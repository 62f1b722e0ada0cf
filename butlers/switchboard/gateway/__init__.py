"""Gateway mode: the switchboard as the one MCP server a host (Claude Code, Claude Desktop)
needs — every butler and every `.mcp.json` server behind it as one compact suite tool, with
the detail loaded on demand, or activated into the tool list.

config (gateway.toml | switchboard.config.json) -> children (registry + .mcp.json) ->
clients (stdio / HTTP) -> server (suite tools, activate mode) -> report (token sizes).
"""

from butlers.switchboard.gateway.children import ChildSpec, butler_children, discover_mcp_files
from butlers.switchboard.gateway.config import GatewayConfig, load_gateway_config
from butlers.switchboard.gateway.server import Gateway

__all__ = [
    "ChildSpec",
    "Gateway",
    "GatewayConfig",
    "butler_children",
    "discover_mcp_files",
    "load_gateway_config",
]
