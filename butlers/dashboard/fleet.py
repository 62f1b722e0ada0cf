"""What the dashboard asks the butlers themselves: each owns its database, so its sessions,
schedules and state come from its own tools, over the switchboard's kept MCP connections
(not through `route`: looking is not routing, and leaves no routing_log row).

Every butler is asked at once, each with a short timeout: a butler that is down or slow shows
as such and holds up no page.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from butlers.mcp_connection.core import unwrap
from butlers.mcp_connection.pool import McpConnections

if TYPE_CHECKING:  # loaded at the first /health asked (not when the switchboard starts)
    import aiohttp

HEALTH_TIMEOUT_S = 1.5
TOOL_TIMEOUT_S = 3.0
# A butler's page: its first state keys, without their values (the page listed every key and
# fetched every value, 2000 keys 250 KB of HTML, every 10 s: a year of data's walkthrough).
STATE_KEYS_SHOWN = 200
MEMORIES_SHOWN = 50  # a butler's memory page: the newest, or a search's best (its limit: 100)


@dataclass(frozen=True)
class Answer:
    """A butler's answer to one question, or why there is none."""

    value: Any = None
    error: str | None = None


def health_url(endpoint_url: str) -> str:
    """`http://host:port/health` of a butler registered at `http://host:port/sse`."""
    parts = urlsplit(endpoint_url)
    return urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))


class FleetProbe:
    """Asks the butlers; owns the HTTP session of its /health checks (closed by `close()`)."""

    def __init__(self, connections: McpConnections) -> None:
        self.connections = connections
        self._http: aiohttp.ClientSession | None = None

    async def health(self, endpoint_url: str) -> Answer:
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            )
        try:
            async with self._http.get(health_url(endpoint_url)) as response:
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return Answer(error=f"unreachable ({type(exc).__name__})")
        if not isinstance(body, dict):
            return Answer(error=f"/health answered {response.status} without a JSON object")
        return Answer(body, None if response.status == 200 else f"/health {response.status}")

    async def call(self, endpoint_url: str, tool: str, arguments: dict[str, Any]) -> Answer:
        try:
            # The whole question, connecting and waiting for the other questions' connect to
            # the same butler included: a butler page asks four at once, and a butler that
            # accepts and never answers held it 4 x 10 s.
            async with asyncio.timeout(TOOL_TIMEOUT_S):
                result = await self.connections.call(
                    endpoint_url, tool, arguments, timeout_s=TOOL_TIMEOUT_S
                )
        except TimeoutError:
            return Answer(error=f"{tool}: no answer within {TOOL_TIMEOUT_S:g} s")
        except Exception as exc:  # unreachable, timed out, refused: shown, never raised
            return Answer(error=f"{tool}: {exc}"[:300] or type(exc).__name__)
        answer = unwrap(result)
        if result.get("isError"):
            return Answer(error=f"{tool}: {answer}"[:300])
        return Answer(answer)

    async def fleet(self, registry: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each registered butler with its live health and its `status` (sessions of the last
        24 hours among it), asked of all at once."""

        async def one(butler: dict[str, Any]) -> dict[str, Any]:
            if butler.get("stale"):  # gone from the config directory: nothing to ask
                return {**butler, "health": None, "status": None}
            health, status = await asyncio.gather(
                self.health(butler["endpoint_url"]),
                self.call(butler["endpoint_url"], "status", {}),
            )
            return {**butler, "health": health, "status": status}

        return list(await asyncio.gather(*(one(b) for b in registry)))

    async def sessions_of_trace(self, butlers: dict[str, str], trace_id: str) -> dict[str, Answer]:
        """Each named butler's sessions in one trace, with their tool calls (name -> its
        endpoint URL)."""
        names = sorted(butlers)
        answers = await asyncio.gather(
            *(
                self.call(
                    butlers[name],
                    "sessions_list",
                    {"limit": 20, "trace_id": trace_id, "detail": True},
                )
                for name in names
            )
        )
        return dict(zip(names, answers, strict=True))

    async def butler_detail(self, endpoint_url: str) -> dict[str, Answer]:
        """What a butler's page shows: its status, sessions, schedules and state keys."""
        health, status, sessions, schedules, state = await asyncio.gather(
            self.health(endpoint_url),
            self.call(endpoint_url, "status", {}),
            self.call(endpoint_url, "sessions_list", {"limit": 20, "detail": True}),
            self.call(endpoint_url, "schedule_list", {}),
            # One more than shown: the page says there are more.
            self.call(endpoint_url, "state_list", {"limit": STATE_KEYS_SHOWN + 1, "values": False}),
        )
        return {
            "health": health,
            "status": status,
            "sessions": sessions,
            "schedules": schedules,
            "state": state,
        }

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
