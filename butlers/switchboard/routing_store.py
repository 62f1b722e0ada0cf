"""The store of where a call can go and where it went: butler_registry (written by discover,
read by route, list_butlers and the classifier's list) and routing_log (a row per route and
notification). Its statements are named in butlers.switchboard.queries (REGISTRY_*,
ROUTING_LOG_*), with every other store's of the switchboard."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from butlers.core_store import storable
from butlers.switchboard import queries as sql


@dataclass(frozen=True)
class RegistryEntry:
    """What discover() writes for one butler found in the config directory."""

    name: str
    endpoint_url: str
    description: str
    modules: list[str]
    is_switchboard: bool = False  # it has a [switchboard] table


@dataclass(frozen=True)
class RegistryTarget:
    """What route needs of one registry row to decide whether it may call it, and where."""

    name: str
    endpoint_url: str
    modules: tuple[str, ...]
    is_switchboard: bool
    stale: bool  # missing from the last discover

    @classmethod
    def of_row(cls, row: Any) -> RegistryTarget:
        """From a registry row (`registry()`'s dicts, or the record `target()` reads)."""
        return cls(
            name=row["name"],
            endpoint_url=row["endpoint_url"],
            modules=tuple(row["modules"] or ()),
            is_switchboard=bool(row["is_switchboard"]),
            stale=bool(row["stale"]),
        )


@dataclass(frozen=True)
class RouteRecord:
    """One routing_log row: where a call came from, where it went, and how it ended."""

    source_channel: str
    source_id: str | None
    routed_to: str
    tool_name: str
    prompt_summary: str | None
    trace_id: str | None
    success: bool
    error: str | None
    duration_ms: int
    inbox_id: int | None = None


class RoutingStore:
    """butler_registry and routing_log, through the switchboard's asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def registry(self) -> list[dict[str, Any]]:
        """Every row: the spec's six columns, `stale` and `is_switchboard`."""
        rows = await self.pool.fetch(sql.REGISTRY)
        return [dict(r) for r in rows]

    async def routing_entry(self, entry_id: uuid.UUID) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(sql.ROUTING_LOG_ENTRY, entry_id)
        return dict(row) if row is not None else None

    async def target(self, name: str) -> RegistryTarget | None:
        """The registry's row of `name`, or None. A name PostgreSQL cannot hold (NUL) names
        no row: None, without asking (the query itself would fail)."""
        if storable(name) != name:
            return None
        row = await self.pool.fetchrow(sql.REGISTRY_TARGET, name)
        return RegistryTarget.of_row(row) if row is not None else None

    async def record_discovery(self, entries: Sequence[RegistryEntry]) -> None:
        """Insert new butlers, refresh changed ones, stamp all of them as seen now; every
        other row is stale from now on (`missing_since`, kept from its first miss)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.executemany(
                sql.REGISTRY_UPSERT,
                [
                    (e.name, e.endpoint_url, e.description, e.modules, e.is_switchboard)
                    for e in entries
                ],
            )
            await conn.execute(sql.REGISTRY_MARK_MISSING, [e.name for e in entries])

    async def record_route(self, record: RouteRecord) -> uuid.UUID:
        """Log one route, and on success stamp the target as seen: one round trip for both.

        Every text goes through `storable`: a classifier (a stranger's text) names the butler
        and the tool, and a NUL in either must not stop its refusal from being recorded.

        Committed asynchronously (for this statement only: `set_config(..., true)` ends with
        its transaction): the caller does not wait for the WAL flush, which was a sixth of a
        routed call's latency. A crash of the PostgreSQL server may lose the last fraction of
        a second of log rows, never half a row; inbox writes keep durable commits.
        """
        return await self.pool.fetchval(
            sql.ROUTING_LOG_RECORD,
            storable(record.source_channel),
            storable(record.source_id),
            storable(record.routed_to),
            storable(record.tool_name),
            storable(record.prompt_summary),
            storable(record.trace_id),
            record.success,
            storable(record.error),
            record.duration_ms,
            record.inbox_id,
        )

    async def prune(self, older_than_days: int) -> int:
        """Delete routing_log rows older than that."""
        result = await self.pool.execute(sql.ROUTING_LOG_PRUNE, older_than_days)
        return int(result.split()[-1])
