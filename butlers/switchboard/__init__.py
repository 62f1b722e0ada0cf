"""The Switchboard: the butler at the front door.

A message's path reads top to bottom through this package: intake (butlers.modules) ->
inbox -> classify -> route -> reply. This issue's part: the registry (discover, list_butlers)
and route, over pooled MCP-over-SSE sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastmcp import FastMCP
from fastmcp.exceptions import ToolError
from pydantic import JsonValue

from butlers.switchboard.pool import McpClientPool
from butlers.switchboard.registry import discover
from butlers.switchboard.route import RouteError, Router
from butlers.switchboard.store import SwitchboardStore


@dataclass
class Switchboard:
    """What the switchboard has beyond a plain butler; opened and closed with its daemon."""

    store: SwitchboardStore
    router: Router
    pool: McpClientPool
    config_dir: Path

    async def discover(self) -> dict[str, Any]:
        report = await discover(self.store, self.config_dir)
        self.router.forget_endpoints()
        return report

    async def close(self) -> None:
        await self.pool.close()


def attach_switchboard(
    mcp: FastMCP,
    store: SwitchboardStore,
    *,
    config_dir: Path,
    auth_token: str | None,
    route_timeout_s: float | None = None,
) -> Switchboard:
    """Create the switchboard's parts and register route, list_butlers and discover."""
    pool = McpClientPool(auth_token=auth_token)
    router = (
        Router(store, pool)
        if route_timeout_s is None
        else Router(store, pool, timeout_s=route_timeout_s)
    )
    switchboard = Switchboard(store=store, router=router, pool=pool, config_dir=config_dir)

    @mcp.tool
    async def route(
        butler_name: str, tool_name: str, args: dict[str, Any] | None = None
    ) -> JsonValue:
        """Call `tool_name` with `args` on the butler `butler_name`; returns its answer."""
        try:
            return await router.route(butler_name, tool_name, args)
        except RouteError as exc:
            raise ToolError(str(exc)) from exc

    @mcp.tool
    async def list_butlers() -> list[dict[str, Any]]:
        """Every registered butler: name, endpoint_url, description, modules, last_seen_at,
        registered_at."""
        return await store.registry()

    @mcp.tool(name="discover")
    async def discover_tool() -> dict[str, Any]:
        """Re-scan the butler config directory: add new butlers, update changed ones, report
        stale ones (never deleted) and broken configs."""
        return await switchboard.discover()

    return switchboard
