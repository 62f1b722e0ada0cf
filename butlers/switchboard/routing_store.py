"""The store of where a call can go and where it went: butler_registry (written by discover,
read by route, list_butlers and the classifier's list) and routing_log (a row per route and
notification). Its statements are named in butlers.switchboard.queries (REGISTRY_*,
ROUTING_LOG_*), with every other store's of the switchboard."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from butlers.core_store import storable
from butlers.errors import ButlersError
from butlers.switchboard import queries as sql

logger = logging.getLogger(__name__)

# The most routing_log rows one write takes (a burst of routes waits for fewer round trips;
# a write stays a short transaction).
MAX_ROWS_PER_WRITE = 64


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


# A routing_log row waiting for its write: its id, what it says, and its caller's answer.
_Unwritten = tuple[uuid.UUID, RouteRecord, "asyncio.Future[None]"]


class RoutingStore:
    """butler_registry and routing_log, through the switchboard's asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        # routing_log rows waiting for their write, and the task writing them (record_route).
        self._unwritten: list[_Unwritten] = []
        self._writer: asyncio.Task[None] | None = None

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

    async def server_started(self) -> str:
        """When this database's PostgreSQL server started (`database_identity`'s part)."""
        started: str = await self.pool.fetchval(sql.SERVER_STARTED)
        return started

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
        """Log one route, and on success stamp the target as seen; the row's id, once it is
        written.

        Routes logged while a write is under way wait for the next one, which writes them all
        in one round trip and one transaction (group commit): each caller still returns only
        when its own row is in the database, but a burst of routes pays one round trip and
        one commit for many rows instead of one each (bench/route_overhead.py: the log row alone was
        ~13% of what 16 callers could route per second). A write that fails is retried row by
        row, so a row PostgreSQL refuses fails only its own route.

        Every text goes through `storable`: a classifier (a stranger's text) names the butler
        and the tool, and a NUL in either must not stop its refusal from being recorded.

        Committed asynchronously (for this transaction only: `set_config(..., true)` ends with
        it): the caller does not wait for the WAL flush, which was a sixth of a
        routed call's latency. A crash of the PostgreSQL server may lose the last fraction of
        a second of log rows, never half a row; inbox writes keep durable commits.
        """
        row_id = uuid.uuid4()
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unwritten.append((row_id, record, written))
        if self._writer is None:
            # Owned by the store while rows wait; it ends when none do. Every caller awaits
            # its own row, so none is left behind by a caller that goes away.
            self._writer = asyncio.get_running_loop().create_task(
                self._write_unwritten(), name="routing_log:write"
            )
        await asyncio.shield(written)
        return row_id

    async def _write_unwritten(self) -> None:
        batch: list[_Unwritten] = []
        try:
            while self._unwritten:
                batch = self._unwritten[:MAX_ROWS_PER_WRITE]
                del self._unwritten[:MAX_ROWS_PER_WRITE]
                try:
                    await self._write(batch)
                except Exception as exc:
                    if len(batch) == 1:
                        _settle(batch, exc)
                        continue
                    logger.warning(
                        "routing_log: a write of %d rows failed (%s); writing them one by one",
                        len(batch),
                        type(exc).__name__,
                        extra={"action": "routing_log_retry"},
                    )
                    for one in batch:  # the others are not held back by a row it refuses
                        try:
                            await self._write([one])
                        except Exception as one_exc:
                            _settle([one], one_exc)
                        else:
                            _settle([one], None)
                else:
                    _settle(batch, None)
        finally:
            self._writer = None
            # Stopped (its loop closing) with rows in hand or waiting: each caller is told,
            # none left waiting for a write that will not come (done ones are skipped).
            left = batch + self._unwritten
            self._unwritten.clear()
            _settle(left, ButlersError("the routing_log writer stopped before this row"))

    async def _write(self, batch: list[_Unwritten]) -> None:
        """All of `batch` or none of it (executemany is one transaction); a target routed to
        more than once in it is stamped once."""
        stamped: set[str | None] = set()
        rows = []
        for row_id, r, _ in batch:
            routed_to = storable(r.routed_to)
            stamp = r.success and routed_to not in stamped
            if stamp:
                stamped.add(routed_to)
            rows.append(
                (
                    row_id,
                    storable(r.source_channel),
                    storable(r.source_id),
                    routed_to,
                    storable(r.tool_name),
                    storable(r.prompt_summary),
                    storable(r.trace_id),
                    r.success,
                    storable(r.error),
                    r.duration_ms,
                    r.inbox_id,
                    stamp,
                )
            )
        await self.pool.executemany(sql.ROUTING_LOG_RECORD, rows)

    async def handed_before(self, inbox_id: int, since: datetime | None) -> list[tuple[str, bool]]:
        rows = await self.pool.fetch(sql.ROUTING_LOG_HANDED, inbox_id, since)
        return [(row["routed_to"], row["answered"]) for row in rows]

    async def prune(self, older_than_days: int) -> int:
        """Delete routing_log rows older than that."""
        result = await self.pool.execute(sql.ROUTING_LOG_PRUNE, older_than_days)
        return int(result.split()[-1])


def _settle(batch: list[_Unwritten], error: BaseException | None) -> None:
    """Tell each waiting caller of `batch` that its row is written, or why not."""
    for _, _, written in batch:
        if written.done():
            continue
        if error is None:
            written.set_result(None)
        else:
            written.set_exception(error)
            # A caller cancelled meanwhile never reads it: no "exception never retrieved".
            written.add_done_callback(lambda f: f.exception())
