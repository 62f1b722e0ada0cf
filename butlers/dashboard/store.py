"""The dashboard's reads and its sign-outs, on the switchboard's database (the sessions that
were signed out too: migration switchboard_0008). Its statements are named in
butlers.switchboard.queries (DASHBOARD_*), and the registry's are the switchboard's own
(REGISTRY, REGISTRY_BUTLER): the fleet page reads what list_butlers does.

Each page reads a bounded slice, newest first, through an index (migration switchboard_0006
for the filters): a page costs the same with a hundred rows or a hundred thousand
(bench/dashboard.py). Its WHERE holds only the filters given, each a fixed fragment
(`butlers.queries.Filtered`), so that each statement is the one its index serves.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg

from butlers.switchboard import queries as sql
from butlers.switchboard.operator import excerpt

PAGE_ROWS = 50
EXCERPT_HEAD = 480  # characters read of a text to show one line of it
MESSAGE_TEXT_CHARS = 20_000  # of one message, its reply and its error, on its own page


def _excerpts(row: asyncpg.Record, clip: Callable[[str], str], *names: str) -> dict[str, Any]:
    out = dict(row)
    for name in names:
        head = out.pop(f"{name}_head")
        out[name] = excerpt(clip(head) if head else head, out.pop(f"{name}_chars"))
    return out


class DashboardStore:
    def __init__(self, pool: asyncpg.Pool, *, clip: Callable[[str], str] = str) -> None:
        self.pool = pool
        # Secrets out of a text before it is cut to a line, the beginning of one at the cut
        # too (Redactor.clipped): the page's own redaction, after the cut, saw only part of
        # a secret there, and showed it (a red team padded a message to choose how much).
        self.clip = clip

    @classmethod
    def redacting(cls, pool: asyncpg.Pool, redact: Callable[[str], str]) -> DashboardStore:
        """The store whose excerpts `redact` (the process's Redactor: its `clipped`, when
        it has one) clips before they are cut."""
        return cls(pool, clip=getattr(redact, "clipped", redact))

    async def registry(self) -> list[dict[str, Any]]:
        """Every butler, as list_butlers reads it (RoutingStore.registry's statement): the
        spec's six columns, `stale` and `is_switchboard`."""
        rows = await self.pool.fetch(sql.REGISTRY)
        return [dict(r) for r in rows]

    async def butler(self, name: str) -> dict[str, Any] | None:
        """One butler's registry row, the same columns; None when there is none."""
        row = await self.pool.fetchrow(sql.REGISTRY_BUTLER, name)
        return None if row is None else dict(row)

    async def messages(
        self, *, status: str | None, channel: str | None, before: int | None
    ) -> list[dict[str, Any]]:
        """One page of the inbox, newest first (ids below `before`)."""
        statement, filters = sql.DASHBOARD_MESSAGES.build(status, channel, before)
        rows = await self.pool.fetch(statement, PAGE_ROWS, EXCERPT_HEAD, *filters)
        return [_excerpts(r, self.clip, "text", "reply") for r in rows]

    async def message(self, inbox_id: int) -> dict[str, Any] | None:
        """One message (its texts up to MESSAGE_TEXT_CHARS), with its routes and what went
        out for it."""
        row = await self.pool.fetchrow(sql.DASHBOARD_MESSAGE, inbox_id, MESSAGE_TEXT_CHARS)
        if row is None:
            return None
        message = dict(row)
        message["routes"] = [
            dict(r) for r in await self.pool.fetch(sql.DASHBOARD_MESSAGE_ROUTES, inbox_id)
        ]
        message["outbox"] = [
            dict(r) for r in await self.pool.fetch(sql.DASHBOARD_MESSAGE_OUTBOX, inbox_id)
        ]
        if message["trace_id"] is None and message["routes"]:
            message["trace_id"] = next(
                (r["trace_id"] for r in message["routes"] if r["trace_id"]), None
            )
        # What its sessions asked the owner for (butlers.switchboard.approvals).
        message["approvals"] = [
            dict(r)
            for r in await self.pool.fetch(sql.DASHBOARD_MESSAGE_APPROVALS, message["trace_id"])
        ]
        return message

    async def routes(
        self, *, butler: str | None, success: bool | None, before: datetime | None
    ) -> list[dict[str, Any]]:
        """One page of the routing log, newest first (created before `before`)."""
        statement, filters = sql.DASHBOARD_ROUTES.build(butler, success, before)
        rows = await self.pool.fetch(statement, PAGE_ROWS, *filters)
        return [dict(r) for r in rows]

    async def session_signed_out(self, session_id: str) -> bool:
        """Whether the dashboard session `session_id` was signed out (in any switchboard
        process on this database)."""
        return bool(await self.pool.fetchval(sql.DASHBOARD_SIGNED_OUT, session_id))

    async def sign_out_session(self, session_id: str, expires_at: datetime) -> None:
        """Record that `session_id` ended, until its cookie would have expired anyway; rows
        past that are dropped on the way (a refused cookie's age refuses it from then on)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.DASHBOARD_FORGET_SIGN_OUTS)
            await conn.execute(sql.DASHBOARD_SIGN_OUT, session_id, expires_at)
