"""Every SQL statement of the dashboard, on the switchboard's database (the sessions that were
signed out too: migration switchboard_0008).

Each page reads a bounded slice, newest first, through an index (migration switchboard_0006
for the filters): a page costs the same with a hundred rows or a hundred thousand
(bench/dashboard.py). The WHERE clauses are assembled from fixed fragments, one per filter
given, so that each statement is the one its index serves: `$1 IS NULL OR status = $1` would
be planned once for any value, and read the whole table newest first to find a rare status.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from butlers.switchboard.operator import TRACE_OF_CONTEXT, WITH_ROUTED_TRACE, excerpt
from butlers.switchboard.routing_store import REGISTRY_COLUMNS

PAGE_ROWS = 50
EXCERPT_HEAD = 480  # characters read of a text to show one line of it
MESSAGE_TEXT_CHARS = 20_000  # of one message, its reply and its error, on its own page


def _where(conditions: Sequence[tuple[str, Any]]) -> tuple[str, list[Any]]:
    """`WHERE a = $1 AND b < $2` (or nothing) from (fragment with `{}` for its parameter,
    value) pairs whose value is not None."""
    given = [(fragment, value) for fragment, value in conditions if value is not None]
    parts = [fragment.format(f"${n}") for n, (fragment, _) in enumerate(given, start=1)]
    return ("WHERE " + " AND ".join(parts)) if parts else "", [value for _, value in given]


def _excerpts(row: asyncpg.Record, *names: str) -> dict[str, Any]:
    out = dict(row)
    for name in names:
        out[name] = excerpt(out.pop(f"{name}_head"), out.pop(f"{name}_chars"))
    return out


class DashboardStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def registry(self) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(
            f"SELECT {REGISTRY_COLUMNS} FROM butler_registry ORDER BY name"
        )
        return [dict(r) for r in rows]

    async def butler(self, name: str) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(
            f"SELECT {REGISTRY_COLUMNS} FROM butler_registry WHERE name = $1",
            name,
        )
        return None if row is None else dict(row)

    async def messages(
        self, *, status: str | None, channel: str | None, before: int | None
    ) -> list[dict[str, Any]]:
        """One page of the inbox, newest first (ids below `before`)."""
        where, params = _where(
            [("status = {}", status), ("channel = {}", channel), ("id < {}", before)]
        )
        n = len(params)
        rows = await self.pool.fetch(
            f"""
            WITH page AS (
                SELECT id, channel, source_id, sender_name, subject, status, classified_via,
                       routed_to, attempts, received_at, finished_at, left(error, 300) AS error,
                       left(text, ${n + 2}) AS text_head, length(text) AS text_chars,
                       left(reply, ${n + 2}) AS reply_head, length(reply) AS reply_chars,
                       {TRACE_OF_CONTEXT} AS traced
                FROM inbox {where} ORDER BY id DESC LIMIT ${n + 1}
            )
            {WITH_ROUTED_TRACE}
            """,
            *params,
            PAGE_ROWS,
            EXCERPT_HEAD,
        )
        return [_excerpts(r, "text", "reply") for r in rows]

    async def message(self, inbox_id: int) -> dict[str, Any] | None:
        """One message (its texts up to MESSAGE_TEXT_CHARS), with its routes and what went
        out for it."""
        row = await self.pool.fetchrow(
            f"""SELECT id, channel, external_id, source_id, sender_name, subject, conversation,
                       status, classified_via, routed_to, attempts, received_at, finished_at,
                       left(text, $2) AS text, length(text) AS text_chars,
                       left(reply, $2) AS reply, left(error, $2) AS error,
                       {TRACE_OF_CONTEXT} AS trace_id
                FROM inbox WHERE id = $1""",
            inbox_id,
            MESSAGE_TEXT_CHARS,
        )
        if row is None:
            return None
        message = dict(row)
        message["routes"] = [
            dict(r)
            for r in await self.pool.fetch(
                """SELECT id::text AS id, created_at, routed_to, tool_name, prompt_summary,
                          success, left(error, 2000) AS error, duration_ms, trace_id
                   FROM routing_log WHERE inbox_id = $1 ORDER BY created_at LIMIT 20""",
                inbox_id,
            )
        ]
        message["outbox"] = [
            dict(r)
            for r in await self.pool.fetch(
                """SELECT id, kind, butler, channel, status, attempts, created_at, sent_at,
                          left(error, 2000) AS error
                   FROM outbox WHERE inbox_id = $1 ORDER BY id LIMIT 20""",
                inbox_id,
            )
        ]
        if message["trace_id"] is None and message["routes"]:
            message["trace_id"] = next(
                (r["trace_id"] for r in message["routes"] if r["trace_id"]), None
            )
        # What its sessions asked the owner for (butlers.switchboard.approvals).
        message["approvals"] = [
            dict(r)
            for r in await self.pool.fetch(
                f"""SELECT id, tool, status, requested_at, decided_by FROM approvals
                    WHERE {TRACE_OF_CONTEXT} = $1 ORDER BY id LIMIT 20""",
                message["trace_id"],
            )
        ]
        return message

    async def routes(
        self, *, butler: str | None, success: bool | None, before: datetime | None
    ) -> list[dict[str, Any]]:
        """One page of the routing log, newest first (created before `before`)."""
        where, params = _where(
            [("routed_to = {}", butler), ("success = {}", success), ("created_at < {}", before)]
        )
        rows = await self.pool.fetch(
            f"""SELECT id::text AS id, created_at, source_channel, source_id, routed_to,
                       tool_name, prompt_summary, success, left(error, 300) AS error,
                       duration_ms, inbox_id, trace_id
                FROM routing_log {where}
                ORDER BY created_at DESC LIMIT ${len(params) + 1}""",
            *params,
            PAGE_ROWS,
        )
        return [dict(r) for r in rows]

    async def session_signed_out(self, session_id: str) -> bool:
        """Whether the dashboard session `session_id` was signed out (in any switchboard
        process on this database)."""
        return bool(
            await self.pool.fetchval(
                "SELECT EXISTS (SELECT 1 FROM dashboard_signed_out WHERE session_id = $1)",
                session_id,
            )
        )

    async def sign_out_session(self, session_id: str, expires_at: datetime) -> None:
        """Record that `session_id` ended, until its cookie would have expired anyway; rows
        past that are dropped on the way (a refused cookie's age refuses it from then on)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM dashboard_signed_out WHERE expires_at < now()")
            await conn.execute(
                """INSERT INTO dashboard_signed_out (session_id, expires_at) VALUES ($1, $2)
                   ON CONFLICT (session_id) DO NOTHING""",
                session_id,
                expires_at,
            )
