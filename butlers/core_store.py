"""The store of the core tables (state, scheduled_tasks, sessions, limit_notices), through the
butler's asyncpg pool: its statements are named in butlers.queries. And `storable`, which every
store uses on what it writes."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

import asyncpg

from butlers import queries as sql

logger = logging.getLogger(__name__)


def storable(text: str | None) -> str | None:
    """PostgreSQL's text and jsonb refuse NUL (\\x00), and a lone UTF-16 surrogate cannot be
    encoded to send them (it becomes "?"). Channels, models and other butlers may hand us
    anything, and a row that can never be written would be retried forever (a mail blocking
    its mailbox) or lost (a session's outcome, a refused route's log row)."""
    if text is None:
        return None
    text = text.replace("\x00", "")
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            text = text.encode(errors="replace").decode()
    return text


def storable_json(value: Any) -> Any:
    """`storable` through a JSON value: every string in it, keys included."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {storable(str(k)): storable_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_json(v) for v in value]
    return value


def _row(record: asyncpg.Record | None) -> dict[str, Any] | None:
    return None if record is None else dict(record)


class CoreStore:
    """Named queries on state, scheduled_tasks and sessions."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    # -- health -----------------------------------------------------------------------------

    async def ping(self) -> str:
        """The database answers; its identity (`database_identity`)."""
        async with self.pool.acquire(timeout=5) as conn:
            row = await conn.fetchrow(sql.PING)
        assert row is not None  # one row, always
        return database_identity(row[0], row[1])

    # -- state ------------------------------------------------------------------------------

    async def state_get(self, key: str) -> dict[str, Any] | None:
        return _row(await self.pool.fetchrow(sql.STATE_GET, key))

    async def state_set(self, key: str, value: Any) -> datetime:
        return await self.pool.fetchval(sql.STATE_SET, key, value)

    async def state_delete(self, key: str) -> bool:
        return (await self.pool.execute(sql.STATE_DELETE, key)) == "DELETE 1"

    async def state_list(
        self, prefix: str, *, limit: int | None = None, values: bool = True
    ) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(sql.STATE_LIST if values else sql.STATE_KEYS, prefix, limit)
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
        person: str | None = None,
        max_routed: int = 0,
        owner_persons: Sequence[str] = (),
        forwarded_from: str | None = None,
    ) -> dict[str, Any] | Literal["full", "routed_full", "people_full"] | None:
        """Insert a task; None when the name is taken, "full" when there are `max_schedules`.
        `cron` None: it runs once, at `next_run_at`, and is then deleted. `routed`: created by
        a session of a routed message (its runs are restricted alike, and answer in its
        `conversation`); "routed_full" when that conversation's `person` has `max_routed`
        already, "people_full" when people's messages planted half of `max_schedules` (the
        rest is kept for the owner's: `owner_persons`, whose own are not counted; a message
        they forwarded, `forwarded_from`, is another's and counts).

        The count and the insert are one transaction under a lock on the table, so two
        concurrent creations cannot both pass the cap.
        """
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.SCHEDULE_LOCK)
            if await conn.fetchval(sql.SCHEDULE_COUNT) >= max_schedules:
                return "full"
            owners = [p.lower() for p in owner_persons]
            peoples = routed and (
                forwarded_from is not None or (person or "").lower() not in owners
            )
            if peoples and max_routed:
                planted = await conn.fetchrow(
                    sql.SCHEDULE_COUNT_ROUTED, (person or "").lower(), owners
                )
                assert planted is not None  # (an aggregate's one row)
                if planted["theirs"] >= max_routed:
                    return "routed_full"
                if planted["everyones"] >= max_schedules // 2:
                    return "people_full"
            return _row(
                await conn.fetchrow(
                    sql.SCHEDULE_CREATE,
                    name,
                    cron,
                    prompt,
                    next_run_at,
                    routed,
                    conversation,
                    storable(forwarded_from),
                )
            )

    async def schedule_list(self) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(sql.SCHEDULE_LIST)
        return [dict(r) for r in rows]

    async def schedule_delete(self, name: str, *, routed_only: bool = False) -> bool:
        """`routed_only`: only one a routed message's session planted (not declared)."""
        result = await self.pool.execute(sql.SCHEDULE_DELETE, name, routed_only)
        return result == "DELETE 1"

    async def schedule_disable(self, task_id: uuid.UUID) -> None:
        """Kept, not run: `enabled` false (schedule_list shows it so)."""
        await self.pool.execute(sql.SCHEDULE_DISABLE, task_id)

    async def schedule_once_again(self, task_id: uuid.UUID, at: datetime, counted: bool) -> None:
        """A one-time reminder due again at `at` (its run failed, or was skipped: then not
        `counted` as an attempt)."""
        await self.pool.execute(sql.SCHEDULE_ONCE_AGAIN, task_id, at, counted)

    async def schedule_ran_once(self, task_id: uuid.UUID) -> None:
        """A one-shot schedule is gone once its run finished (claimed, it is not due again)."""
        await self.pool.execute(sql.SCHEDULE_RAN_ONCE, task_id)

    async def schedule_renew_once(
        self, task_id: uuid.UUID, held_until: datetime, until: datetime
    ) -> bool:
        """Renew a one-shot task's claim as its run starts (to `until`), if it is still this
        claim (`held_until`): a reminder queued behind others outlived its claim before it
        started, and another process took it and ran it too (a walkthrough)."""
        return (
            await self.pool.execute(sql.SCHEDULE_RENEW_ONCE, task_id, held_until, until)
            == "UPDATE 1"
        )

    async def schedule_give_back(
        self, task_id: uuid.UUID, held_until: datetime, next_run_at: datetime
    ) -> bool:
        """A claimed run that did not happen (cut short by the butler's stop) is as before
        its claim (`next_run_at`, its attempt not counted): a recurring one had already moved
        on to its next run, and a restart for an upgrade lost that day's brief."""
        return (
            await self.pool.execute(sql.SCHEDULE_GIVE_BACK, task_id, held_until, next_run_at)
            == "UPDATE 1"
        )

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
            await conn.execute(sql.SCHEDULE_LOCK)
            current = {r["name"]: r for r in await conn.fetch(sql.SCHEDULE_DECLARED, names)}
            for name, cron, prompt in declared:
                row = current.get(name)
                if row is None:
                    await conn.execute(
                        sql.SCHEDULE_DECLARE_NEW,
                        name,
                        cron,
                        prompt,
                        next_runs(cron),
                    )
                    report["created"].append(name)
                elif (row["cron"], row["prompt"], row["declared"]) != (cron, prompt, True):
                    if row["routed"] or row["conversation"]:
                        # A person's message planted it (a name taken before the owner
                        # declared it): the declared one replaces it, answering no one.
                        logger.warning(
                            "schedule %r: one a person's message planted (%s) is replaced by "
                            "the one declared in butler.toml",
                            name,
                            row["conversation"] or "no conversation",
                            extra={"action": "schedule_taken_over"},
                        )
                    await conn.execute(
                        sql.SCHEDULE_DECLARE_CHANGED,
                        name,
                        cron,
                        prompt,
                        next_runs(cron),
                    )
                    report["updated"].append(name)
            gone = [n for n, r in current.items() if r["declared"] and n not in names]
            if gone:
                await conn.execute(sql.SCHEDULE_DECLARE_GONE, gone)
                report["removed"] = gone
        return report

    async def schedules_rezone(
        self, zone: str, now: datetime, next_runs: Callable[[str, datetime], datetime]
    ) -> tuple[str | None, list[str]]:
        """Move the recurring schedules to the wall clock of `zone` when their next runs were
        reckoned in another (the butler's time zone changed while it was down): each next run
        still ahead becomes `next_runs(cron, now)`. The zone they were reckoned in, and the
        names of those moved. Nothing is moved when the zone is the same."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.SCHEDULE_LOCK)
            was = await conn.fetchval(sql.SCHEDULE_CLOCK)
            if was == zone:
                return was, []
            moved = []
            for row in await conn.fetch(sql.SCHEDULE_AHEAD, now):
                try:
                    following = next_runs(row["cron"], now)
                except Exception:  # unreadable: the tick disables it, logged
                    continue
                if following != row["next_run_at"]:
                    await conn.execute(sql.SCHEDULE_SET_NEXT, row["id"], following)
                    moved.append(row["name"])
            await conn.execute(sql.SCHEDULE_CLOCK_SET, zone)
        return was, moved

    async def claim_due_tasks(
        self,
        now: datetime,
        next_runs: Callable[[str, datetime], datetime],
        last_due: Callable[[str, datetime], datetime | None],
        catch_up: timedelta,
        once_lease: timedelta = timedelta(minutes=10),
        missed: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """Take the tasks due at `now` and move each one forward, atomically.

        A recurring task runs once however many of its runs were missed, and only if its
        latest due run (`last_due`) is within `catch_up` (`[runtime] catch_up_hours`: the
        butler was down); an older one moves on to its next run, logged. A one-shot task
        always runs, late if need be (`due_at` says when it was due): claimed for `once_lease`
        (due again after it, should this process die in its run; the caller deletes it once
        it ran, or sets it due again), its `attempts` counted. Each task's `held_until` is
        its row's next run as the claim left it (`schedule_renew_once`, `schedule_give_back`).

        Claiming and advancing in one transaction (FOR UPDATE SKIP LOCKED) means two
        concurrent ticks never run a task twice. A row whose cron cannot be read (written by
        hand, or by an older version) is disabled and logged, rather than failing the claim
        of every other task on every tick. `missed`, when given, gets each recurring task
        whose run was missed (its row, with `due_at` the latest run missed).
        """
        due = []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(sql.SCHEDULE_DUE, now)
            for row in rows:
                if row["once"]:
                    await conn.execute(
                        sql.SCHEDULE_CLAIM_ONCE,
                        row["id"],
                        now,
                        now + once_lease,
                    )
                    due.append(
                        {**row, "attempts": row["attempts"] + 1, "held_until": now + once_lease}
                    )
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
                    await conn.execute(sql.SCHEDULE_DISABLE, row["id"])
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
                    await conn.execute(sql.SCHEDULE_SET_NEXT, row["id"], following)
                    if missed is not None:
                        missed.append({**row, "due_at": latest})
                    continue
                await conn.execute(sql.SCHEDULE_RAN, row["id"], now, following)
                # (due_at: the run it makes up; held_until: where the claim left the row)
                due.append({**row, "due_at": max(latest, row["due_at"]), "held_until": following})
        return due

    # -- sessions --------------------------------------------------------------------------

    async def session_start(
        self, trigger_source: str, prompt: str, trace_id: str | None, person: str | None = None
    ) -> uuid.UUID:
        """A session's row; `person`: whose message (not the owner's) it serves."""
        return await self.pool.fetchval(
            sql.SESSION_START,
            trigger_source,
            storable(prompt),
            trace_id,
            storable(person),
        )

    async def sessions_abandoned(self, older_than_s: float, error: str) -> int:
        """Mark sessions left unfinished (a process killed, or stopped by a release that did
        not record it) and started over `older_than_s` ago as failed with `error`; how many."""
        status = await self.pool.execute(sql.SESSIONS_ABANDONED, older_than_s, error)
        return int(status.split()[-1])

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
            sql.SESSION_FINISH,
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
        result = await self.pool.execute(sql.SESSIONS_PRUNE, older_than_days)
        return int(result.split()[-1])

    async def sessions_list(
        self, limit: int, *, trace_id: str | None = None, detail: bool = False
    ) -> list[dict[str, Any]]:
        """Newest first; only one trace's when `trace_id` is given; with `detail`, each one's
        result and tool calls too."""
        rows = await self.pool.fetch(
            sql.SESSIONS_LIST_DETAIL if detail else sql.SESSIONS_LIST, limit, trace_id
        )
        return [dict(r) for r in rows]

    async def sessions_summary(self, hours: int) -> dict[str, Any]:
        """The sessions started in the last `hours`: how many, how many failed, their median
        duration and what they cost (Claude Code's figures, where it gave one)."""
        row = await self.pool.fetchrow(sql.SESSIONS_SUMMARY, hours)
        assert row is not None  # an aggregate always has a row
        summary = dict(row)
        if summary["median_ms"] is not None:
            summary["median_ms"] = round(summary["median_ms"])
        return summary

    async def scheduled_runs_since(self, hours: float) -> tuple[int, int]:
        """How many scheduled sessions (`schedule:<name>`) started in the last `hours`: all,
        and those of schedules people's messages planted."""
        row = await self.pool.fetchrow(sql.SCHEDULED_RUNS_SINCE, hours * 3600)
        assert row is not None  # an aggregate always has a row
        return row["everyones"], row["peoples"]

    async def spend_since(self, hours: float) -> float:
        """What the sessions started in the last `hours` cost, by Claude Code's figures."""
        return await self.pool.fetchval(sql.SPEND_SINCE, hours * 3600)

    async def claim_notice(self, kind: str, window: Literal["hour", "day"]) -> bool:
        """True for the first claim of `kind` in the current (UTC) hour or day, False for
        every later one: who gets True tells the owner. Notices of past days are dropped."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.NOTICES_FORGET)
            claimed = await conn.fetchval(sql.NOTICE_CLAIM, kind, window)
        return bool(claimed)

    async def session_get(self, session_id: uuid.UUID) -> dict[str, Any] | None:
        return _row(await self.pool.fetchrow(sql.SESSION_GET, session_id))


def database_identity(server_started: str, database: str) -> str:
    """Which database of which running PostgreSQL server, as a short hash that says nothing
    else: a butler's /health shows its own, and discover compares it with the one it expects
    (its own server's, the butler's database), so that a butler of someone else's fleet on a
    port it once had is not taken for this fleet's."""
    return hashlib.sha256(f"{server_started}/{database}".encode()).hexdigest()[:16]
