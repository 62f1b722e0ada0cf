"""The background ticker (`[runtime] tick_interval_s`): every interval it runs the schedules
that are due, each as a Claude Code session, and a tick that fails does not end it.

Every other test runs with tick_interval_s = 0 (no ticker); these run it every 0.2 s. A due
schedule is made by moving a schedule's next_run_at into the past, rather than waiting for
the minute to come round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import asyncpg
from fastmcp import Client

from butlers.config import RuntimeConfig
from butlers.daemon import ButlerDaemon
from tests.conftest import StartButler, butler_config, eventually, log_records
from tests.fakes.messages_api import ScriptedMessagesAPI, text

TICKING = RuntimeConfig(timeout_s=60, tick_interval_s=0.2)


async def make_due(daemon: ButlerDaemon, conn: asyncpg.Connection, name: str, prompt: str) -> None:
    """A schedule created through MCP (every five minutes), then made due now."""
    async with Client(daemon.sse_url) as client:
        await client.call_tool(
            "schedule_create", {"name": name, "cron": "*/5 * * * *", "prompt": prompt}
        )
    await conn.execute(
        "UPDATE scheduled_tasks SET next_run_at = now() - interval '1 second' WHERE name = $1",
        name,
    )


async def finished_session(conn: asyncpg.Connection, schedule: str) -> dict[str, Any]:
    """The session a schedule's run left, once it is finished."""
    query = "SELECT * FROM sessions WHERE trigger_source = $1 AND finished_at IS NOT NULL"

    async def finished() -> bool:
        return await conn.fetchrow(query, f"schedule:{schedule}") is not None

    await eventually(finished)
    return dict(await conn.fetchrow(query, f"schedule:{schedule}"))


async def test_the_ticker_runs_a_due_schedule_as_a_session(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """Guards daemon._tick_loop -> run_due_tasks: with no one calling `tick`, a due schedule
    runs as a Claude Code session recorded as `schedule:<name>`, and comes round again at
    its next time, not at the next tick."""
    scripted_api.script([text("Reminder sent.")])
    daemon = await start_butler(butler_config("alpha", runtime=TICKING))
    conn = await db_conn(daemon.config.database)
    await make_due(daemon, conn, "water", "Remind me to drink water.")
    session = await finished_session(conn, "water")
    assert (session["success"], session["result"], session["error"]) == (
        True,
        "Reminder sent.",
        None,
    )
    assert session["prompt"] == "Remind me to drink water."
    assert any("Remind me to drink water." in str(r["messages"]) for r in scripted_api.requests)
    task = await conn.fetchrow(
        "SELECT last_run_at, next_run_at > now() AS later FROM scheduled_tasks WHERE name = 'water'"
    )
    assert task["last_run_at"] is not None and task["later"] is True


async def test_a_failed_tick_does_not_stop_the_ticker(
    start_butler: StartButler,
    scripted_api: ScriptedMessagesAPI,
    make_database: Callable,
    db_conn,
) -> None:
    """Guards the try/except in daemon._tick_loop: a tick whose schedule cannot run (its
    session cannot be recorded: the sessions table is away) is logged, and the ticker lives
    on: once the table is back, the next due schedule runs."""
    scripted_api.script([text("Ran.")])
    database = await make_database()
    conn = await db_conn(database)
    # A session past retention: the first tick's pruning removes it, which says that tick
    # has happened (pruning runs with the first tick, then hourly).
    await conn.execute(
        """INSERT INTO sessions (trigger_source, prompt, started_at, finished_at)
           VALUES ('trigger', 'old', now() - interval '400 days', now() - interval '400 days')"""
    )
    daemon = await start_butler(butler_config("alpha", runtime=TICKING), database=database)

    async def first_tick_done() -> bool:
        return await conn.fetchval("SELECT count(*) FROM sessions") == 0

    await eventually(first_tick_done)
    with log_records("butlers.daemon") as records:
        await conn.execute("ALTER TABLE sessions RENAME TO sessions_away")
        try:
            await make_due(daemon, conn, "broken", "This run cannot be recorded.")

            async def tick_failed() -> bool:
                return any(getattr(r, "action", None) == "tick_failed" for r in records)

            await eventually(tick_failed)
        finally:
            await conn.execute("ALTER TABLE sessions_away RENAME TO sessions")
    [failure] = [r for r in records if getattr(r, "action", None) == "tick_failed"]
    assert failure.levelno == logging.ERROR and failure.exc_info is not None
    assert isinstance(failure.exc_info[1], asyncpg.UndefinedTableError)
    assert not scripted_api.requests  # the broken run never got as far as Claude Code

    await make_due(daemon, conn, "later", "Run me after the failure.")
    session = await finished_session(conn, "later")
    assert (session["success"], session["result"]) == (True, "Ran.")
    assert await conn.fetchval("SELECT count(*) FROM sessions") == 1


async def test_a_schedule_row_that_cannot_be_parsed_does_not_block_the_others(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """A row the tools would refuse (written by hand, or by an older version) may fail its
    own run, not everyone's: the other due schedule still runs."""
    scripted_api.script([text("Ran.")])
    daemon = await start_butler(butler_config("alpha", runtime=TICKING))
    conn = await db_conn(daemon.config.database)
    with log_records("butlers.daemon") as records, log_records("butlers.core_store") as logged:
        await conn.execute(
            """INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at)
               VALUES ('unparsable', 'every morning', 'x', now() - interval '1 minute')"""
        )
        await make_due(daemon, conn, "good", "Run me anyway.")
        query = "SELECT count(*) FROM sessions WHERE trigger_source = 'schedule:good'"

        async def ran_or_failed_thrice() -> bool:
            failures = sum(getattr(r, "action", None) == "tick_failed" for r in records)
            return failures >= 3 or await conn.fetchval(query) > 0

        await eventually(ran_or_failed_thrice)
    assert await conn.fetchval(query) > 0
    assert (
        await conn.fetchval("SELECT enabled FROM scheduled_tasks WHERE name = 'unparsable'")
        is False
    )
    assert any(getattr(r, "action", None) == "schedule_disabled" for r in logged)
