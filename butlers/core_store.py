"""Every SQL statement on the core tables (state, scheduled_tasks, sessions, limit_notices), run
through the butler's asyncpg pool; and `storable`, which every store uses on what it writes."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

import asyncpg

logger = logging.getLogger(__name__)


def storable(text: str | None) -> str | None:
    """PostgreSQL's text and jsonb refuse NUL (\\x00). Channels, models and other butlers may
    hand us anything, and a row that can never be written would be retried forever (a mail
    blocking its mailbox) or lost (a session's outcome)."""
    return None if text is None else text.replace("\x00", "")


def storable_json(value: Any) -> Any:
    """`storable` through a JSON value: every string in it, keys included."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {storable(str(k)): storable_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_json(v) for v in value]
    return value


SCHEDULE_COLUMNS = (
    "id, name, cron, prompt, enabled, next_run_at, last_run_at, created_at, routed, once, declared"
)


def _row(record: asyncpg.Record | None) -> dict[str, Any] | None:
    return None if record is None else dict(record)


class CoreStore:
    """Named queries on state, scheduled_tasks and sessions."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    # -- health -----------------------------------------------------------------------------

    async def ping(self) -> None:
        async with self.pool.acquire(timeout=5) as conn:
            await conn.fetchval("SELECT 1")

    # -- state ------------------------------------------------------------------------------

    async def state_get(self, key: str) -> dict[str, Any] | None:
        return _row(
            await self.pool.fetchrow("SELECT key, value, updated_at FROM state WHERE key = $1", key)
        )

    async def state_set(self, key: str, value: Any) -> datetime:
        return await self.pool.fetchval(
            """
            INSERT INTO state (key, value, updated_at) VALUES ($1, $2, now())
            ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
            RETURNING updated_at
            """,
            key,
            value,
        )

    async def state_delete(self, key: str) -> bool:
        return (await self.pool.execute("DELETE FROM state WHERE key = $1", key)) == "DELETE 1"

    async def state_list(self, prefix: str) -> list[dict[str, Any]]:
        # starts_with() avoids LIKE's wildcard escaping for prefixes containing % or _.
        rows = await self.pool.fetch(
            "SELECT key, value, updated_at FROM state WHERE starts_with(key, $1) ORDER BY key",
            prefix,
        )
        return [dict(r) for r in rows]

    # -- scheduled tasks -------------------------------------------------------------------

    async def schedule_create(
        self,
        name: str,
        cron: str | None,
        prompt: str,
        next_run_at: datetime,
        *,
        max_schedules: int,
        routed: bool = False,
        conversation: str | None = None,
        max_routed: int = 0,
    ) -> dict[str, Any] | Literal["full", "routed_full"] | None:
        """Insert a task; None when the name is taken, "full" when there are `max_schedules`.
        `cron` None: it runs once, at `next_run_at`, and is then deleted. `routed`: created by
        a session of a routed message (its runs are restricted alike, and answer in its
        `conversation`); "routed_full" when that conversation has `max_routed` already.

        The count and the insert are one transaction under a lock on the table, so two
        concurrent creations cannot both pass the cap.
        """
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("LOCK TABLE scheduled_tasks IN SHARE ROW EXCLUSIVE MODE")
            if await conn.fetchval("SELECT count(*) FROM scheduled_tasks") >= max_schedules:
                return "full"
            if routed and max_routed:
                planted = await conn.fetchval(
                    "SELECT count(*) FROM scheduled_tasks WHERE routed "
                    "AND conversation IS NOT DISTINCT FROM $1",
                    conversation,
                )
                if planted >= max_routed:
                    return "routed_full"
            return _row(
                await conn.fetchrow(
                    f"""
                    INSERT INTO scheduled_tasks
                        (name, cron, prompt, next_run_at, routed, once, conversation)
                    VALUES ($1, $2, $3, $4, $5, $2::text IS NULL, $6)
                    ON CONFLICT (name) DO NOTHING
                    RETURNING {SCHEDULE_COLUMNS}
                    """,
                    name,
                    cron,
                    prompt,
                    next_run_at,
                    routed,
                    conversation,
                )
            )

    async def schedule_list(self) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(
            f"SELECT {SCHEDULE_COLUMNS} FROM scheduled_tasks ORDER BY next_run_at NULLS LAST, name"
        )
        return [dict(r) for r in rows]

    async def schedule_delete(self, name: str, *, routed_only: bool = False) -> bool:
        """`routed_only`: only one a routed message's session planted (not declared)."""
        result = await self.pool.execute(
            "DELETE FROM scheduled_tasks WHERE name = $1 AND (NOT $2 OR (routed AND NOT declared))",
            name,
            routed_only,
        )
        return result == "DELETE 1"

    async def schedule_once_again(self, task_id: uuid.UUID, at: datetime, counted: bool) -> None:
        """A one-time reminder due again at `at` (its run failed, or was skipped: then not
        `counted` as an attempt)."""
        await self.pool.execute(
            "UPDATE scheduled_tasks SET next_run_at = $2, "
            "attempts = attempts - CASE WHEN $3 THEN 0 ELSE 1 END WHERE id = $1 AND once",
            task_id,
            at,
            counted,
        )

    async def schedule_ran_once(self, task_id: uuid.UUID) -> None:
        """A one-shot schedule is gone once its run finished (claimed, it is not due again)."""
        await self.pool.execute("DELETE FROM scheduled_tasks WHERE id = $1 AND once", task_id)

    async def schedules_declare(
        self, declared: Sequence[tuple[str, str, str]], next_runs: Callable[[str], datetime]
    ) -> dict[str, list[str]]:
        """Make the declared schedules (`[[schedules]]`: name, cron, prompt) what the table
        holds: new ones created, changed ones updated (a changed cron starts over from now;
        an unchanged one keeps its next run, so a run missed while down is still seen),
        declared ones no longer in the file deleted. A schedule a tool made under a declared
        name becomes the declared one. Those tools made otherwise are left alone."""
        report: dict[str, list[str]] = {"created": [], "updated": [], "removed": []}
        names = [name for name, _, _ in declared]
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("LOCK TABLE scheduled_tasks IN SHARE ROW EXCLUSIVE MODE")
            current = {
                r["name"]: r
                for r in await conn.fetch(
                    "SELECT name, cron, prompt, declared FROM scheduled_tasks "
                    "WHERE declared OR name = ANY($1::text[])",
                    names,
                )
            }
            for name, cron, prompt in declared:
                row = current.get(name)
                if row is None:
                    await conn.execute(
                        "INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at, declared) "
                        "VALUES ($1, $2, $3, $4, true)",
                        name,
                        cron,
                        prompt,
                        next_runs(cron),
                    )
                    report["created"].append(name)
                elif (row["cron"], row["prompt"], row["declared"]) != (cron, prompt, True):
                    await conn.execute(
                        """UPDATE scheduled_tasks SET prompt = $3, declared = true,
                               once = false, routed = false, enabled = true,
                               next_run_at = CASE WHEN cron IS DISTINCT FROM $2 THEN $4
                                                  ELSE next_run_at END,
                               cron = $2
                           WHERE name = $1""",
                        name,
                        cron,
                        prompt,
                        next_runs(cron),
                    )
                    report["updated"].append(name)
            gone = [n for n, r in current.items() if r["declared"] and n not in names]
            if gone:
                await conn.execute(
                    "DELETE FROM scheduled_tasks WHERE declared AND name = ANY($1::text[])", gone
                )
                report["removed"] = gone
        return report

    async def claim_due_tasks(
        self,
        now: datetime,
        next_runs: Callable[[str, datetime], datetime],
        last_due: Callable[[str, datetime], datetime | None],
        catch_up: timedelta,
        once_lease: timedelta = timedelta(minutes=10),
    ) -> list[dict[str, Any]]:
        """Take the tasks due at `now` and move each one forward, atomically.

        A recurring task runs once however many of its runs were missed, and only if its
        latest due run (`last_due`) is within `catch_up` (`[runtime] catch_up_hours`: the
        butler was down); an older one moves on to its next run, logged. A one-shot task
        always runs, late if need be (`due_at` says when it was due): claimed for `once_lease`
        (due again after it, should this process die in its run; the caller deletes it once
        it ran, or sets it due again), its `attempts` counted.

        Claiming and advancing in one transaction (FOR UPDATE SKIP LOCKED) means two
        concurrent ticks never run a task twice. A row whose cron cannot be read (written by
        hand, or by an older version) is disabled and logged, rather than failing the claim
        of every other task on every tick.
        """
        due = []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                """SELECT id, name, cron, prompt, routed, once, conversation, attempts,
                          next_run_at AS due_at
                   FROM scheduled_tasks
                   WHERE enabled AND next_run_at <= $1
                   ORDER BY next_run_at, name FOR UPDATE SKIP LOCKED""",
                now,
            )
            for row in rows:
                if row["once"]:
                    await conn.execute(
                        "UPDATE scheduled_tasks SET last_run_at = $2, next_run_at = $3, "
                        "attempts = attempts + 1 WHERE id = $1",
                        row["id"],
                        now,
                        now + once_lease,
                    )
                    due.append({**row, "attempts": row["attempts"] + 1})
                    continue
                try:
                    following = next_runs(row["cron"], now)
                    latest = last_due(row["cron"], now) or row["due_at"]
                except Exception as exc:
                    logger.error(
                        "schedule %r: cron %r cannot be read (%s); disabled",
                        row["name"],
                        row["cron"],
                        exc,
                        extra={"action": "schedule_disabled"},
                    )
                    await conn.execute(
                        "UPDATE scheduled_tasks SET enabled = false WHERE id = $1", row["id"]
                    )
                    continue
                late = now - max(latest, row["due_at"])
                if late > catch_up:
                    logger.warning(
                        "schedule %r: its run due at %s was missed (%s ago, more than "
                        "[runtime] catch_up_hours); not run, next run at %s",
                        row["name"],
                        latest.isoformat(timespec="minutes"),
                        str(late).split(".")[0],
                        following.isoformat(timespec="minutes"),
                        extra={"action": "schedule_missed"},
                    )
                    await conn.execute(
                        "UPDATE scheduled_tasks SET next_run_at = $2 WHERE id = $1",
                        row["id"],
                        following,
                    )
                    continue
                await conn.execute(
                    "UPDATE scheduled_tasks SET last_run_at = $2, next_run_at = $3 WHERE id = $1",
                    row["id"],
                    now,
                    following,
                )
                due.append(dict(row))
        return due

    # -- sessions --------------------------------------------------------------------------

    async def session_start(
        self, trigger_source: str, prompt: str, trace_id: str | None
    ) -> uuid.UUID:
        return await self.pool.fetchval(
            """INSERT INTO sessions (trigger_source, prompt, trace_id)
               VALUES ($1, $2, $3) RETURNING id""",
            trigger_source,
            storable(prompt),
            trace_id,
        )

    async def session_finish(
        self,
        session_id: uuid.UUID,
        *,
        result: str | None,
        success: bool,
        error: str | None,
        tool_calls: Sequence[dict[str, Any]],
        duration_ms: int,
        cost_usd: float | None = None,
    ) -> None:
        await self.pool.execute(
            """UPDATE sessions SET result = $2, success = $3, error = $4, tool_calls = $5,
                      duration_ms = $6, cost_usd = $7, finished_at = now()
               WHERE id = $1""",
            session_id,
            storable(result),
            success,
            storable(error),
            storable_json(list(tool_calls)),
            duration_ms,
            cost_usd,
        )

    async def prune_sessions(self, older_than_days: int) -> int:
        """Delete finished sessions that started longer ago than that."""
        result = await self.pool.execute(
            """DELETE FROM sessions WHERE started_at < now() - make_interval(days => $1)
               AND finished_at IS NOT NULL""",
            older_than_days,
        )
        return int(result.split()[-1])

    async def sessions_list(
        self, limit: int, *, trace_id: str | None = None, detail: bool = False
    ) -> list[dict[str, Any]]:
        """Newest first; only one trace's when `trace_id` is given; with `detail`, each one's
        result and tool calls too."""
        more = ", result, tool_calls" if detail else ""
        rows = await self.pool.fetch(
            f"""SELECT id, trigger_source, prompt, success, error, duration_ms, cost_usd,
                       trace_id, started_at, finished_at{more}
                FROM sessions WHERE $2::text IS NULL OR trace_id = $2
                ORDER BY started_at DESC LIMIT $1""",
            limit,
            trace_id,
        )
        return [dict(r) for r in rows]

    async def sessions_summary(self, hours: int) -> dict[str, Any]:
        """The sessions started in the last `hours`: how many, how many failed, their median
        duration and what they cost (Claude Code's figures, where it gave one)."""
        row = await self.pool.fetchrow(
            """SELECT count(*) AS count,
                      count(*) FILTER (WHERE success IS FALSE) AS failed,
                      percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS median_ms,
                      sum(cost_usd) AS cost_usd
               FROM sessions WHERE started_at > now() - make_interval(hours => $1)""",
            hours,
        )
        assert row is not None  # an aggregate always has a row
        summary = dict(row)
        if summary["median_ms"] is not None:
            summary["median_ms"] = round(summary["median_ms"])
        return summary

    async def scheduled_runs_since(self, hours: float) -> int:
        """How many scheduled sessions (`schedule:<name>`) started in the last `hours`."""
        return await self.pool.fetchval(
            """SELECT count(*) FROM sessions
               WHERE started_at > now() - make_interval(secs => $1)
               AND starts_with(trigger_source, 'schedule:')""",
            hours * 3600,
        )

    async def spend_since(self, hours: float) -> float:
        """What the sessions started in the last `hours` cost, by Claude Code's figures."""
        return await self.pool.fetchval(
            """SELECT coalesce(sum(cost_usd), 0)::float8 FROM sessions
               WHERE started_at > now() - make_interval(secs => $1)""",
            hours * 3600,
        )

    async def claim_notice(self, kind: str, window: Literal["hour", "day"]) -> bool:
        """True for the first claim of `kind` in the current (UTC) hour or day, False for
        every later one: who gets True tells the owner. Notices of past days are dropped."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "DELETE FROM limit_notices WHERE window_start < now() - interval '2 days'"
            )
            claimed = await conn.fetchval(
                """INSERT INTO limit_notices (kind, window_start)
                   VALUES ($1, date_trunc($2, now(), 'UTC'))
                   ON CONFLICT DO NOTHING RETURNING true""",
                kind,
                window,
            )
        return bool(claimed)

    async def session_get(self, session_id: uuid.UUID) -> dict[str, Any] | None:
        return _row(await self.pool.fetchrow("SELECT * FROM sessions WHERE id = $1", session_id))
