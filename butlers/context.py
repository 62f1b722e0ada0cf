"""The small explicit context every tool of a butler reaches its dependencies through."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from butlers.claude_code import McpTarget
from butlers.config import ButlerConfig
from butlers.core_store import CoreStore
from butlers.memory import MemoryStore
from butlers.spawner import NOT_FOR_SESSIONS, Spawner, default_allowed_tools
from butlers.switchboard_link import SwitchboardLink


@dataclass
class ModuleStatus:
    name: str
    # "starting" | "running" | "standby" (another switchboard process runs its intake) |
    # "skipped" | "failed"
    status: str
    detail: str = ""
    # skipped: the variables its table names that are not set (what to set, or to rename)
    missing: tuple[str, ...] = ()


@dataclass
class ButlerContext:
    config: ButlerConfig
    store: CoreStore
    spawner: Spawner
    # The URL this butler's own sessions use to reach it (loopback, whatever the registry says).
    self_url: str
    started_at: float = field(default_factory=time.monotonic)
    # Live statuses of the butler's modules (a module's status changes as it connects).
    module_statuses: Callable[[], list[ModuleStatus]] = list
    tool_names: list[str] = field(default_factory=list)
    # Where `notify` goes: the switchboard's `deliver`.
    switchboard: SwitchboardLink | None = None
    # Live statuses of its [[mcp_servers]] (butlers.tool_servers): name, state, reason.
    tool_servers: Callable[[], list[dict[str, Any]]] = list
    # Its long-term memory (butlers.memory); None only in tests that build a bare context.
    memory: MemoryStore | None = None

    def self_target(self) -> McpTarget:
        return McpTarget(
            name=self.config.name,
            url=self.self_url,
            allowed_tools=default_allowed_tools(self.tool_names),
            denied_tools=tuple(t for t in self.tool_names if t in NOT_FOR_SESSIONS),
            builtin_tools=self.config.runtime.builtin_tools,
        )
