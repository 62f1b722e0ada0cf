"""One message must not plant a lasting flood: `[runtime] min_schedule_interval_s` refuses a
cron that runs too often, `max_scheduled_runs_per_hour` skips scheduled runs past it (logged,
the owner told once), `max_spend_usd_per_day` refuses new sessions once the last 24 hours
cost that much (the owner told once). On real PostgreSQL, real butlers over MCP, the real
Claude Code binary, the owner's chat on the fake Bot API."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from butlers.config import RuntimeConfig
from butlers.daemon import ButlerDaemon
from butlers.switchboard.replies import sorry
from tests.conftest import StartButler, butler_config, log_records
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI, text
from tests.test_notify import CHAT, OWNER, notify_fleet


async def limited_fleet(
    start_butler: StartButler, tmp_path: Path, bot_api: FakeBotAPI, runtime: RuntimeConfig
) -> tuple[ButlerDaemon, ButlerDaemon]:
    """test_notify's fleet, with general's limits in `runtime` (its notices reach the
    switchboard, which tells the owner) and the switchboard marked as one in its config dir."""
    return await notify_fleet(
        start_butler, tmp_path, bot_api, runtime=runtime, switchboard_extra="[switchboard]\n"
    )


async def owner_notices(conn) -> list[str]:
    """What general told the owner: the switchboard's routing_log rows of its `deliver`."""
    rows = await conn.fetch(
        "SELECT prompt_summary FROM routing_log WHERE source_channel = 'butler' ORDER BY id"
    )
    return [r["prompt_summary"] for r in rows]


async def test_a_cron_that_runs_more_often_than_the_minimum_is_refused(
    start_butler: StartButler, db_conn
) -> None:
    """Guards check_schedule_interval: the shortest gap between two runs, wherever in the
    day it falls, against `min_schedule_interval_s` (default 300)."""
    daemon = await start_butler()
    refused = {
        "* * * * *": 60,
        "*/4 * * * *": 240,
        "0,1 8 * * *": 60,  # once a day, but twice a minute apart
        "0,59 0,23 * * *": 60,  # its closest runs straddle midnight
        "* * 29 2 *": 60,  # first runs on a leap day, years away: then every minute
    }
    async with Client(daemon.sse_url) as client:
        for cron, gap in refused.items():
            with pytest.raises(ToolError) as excinfo:
                await client.call_tool(
                    "schedule_create", {"name": "x", "cron": cron, "prompt": "p"}
                )
            assert str(excinfo.value) == (
                f"cron expression {cron!r} runs {gap} s apart at its closest; this butler "
                "allows one run per 300 s at most ([runtime] min_schedule_interval_s): "
                "choose a less frequent schedule"
            )
        for name, cron in [("five", "*/5 * * * *"), ("daily", "0 8 * * *"), ("hourly", "@hourly")]:
            await client.call_tool("schedule_create", {"name": name, "cron": cron, "prompt": "p"})
    conn = await db_conn(daemon.config.database)
    names = await conn.fetch("SELECT name FROM scheduled_tasks ORDER BY name")
    assert [r["name"] for r in names] == ["daily", "five", "hourly"]

    # The key is the butler's: one that allows a run a minute takes one.
    runtime = RuntimeConfig(timeout_s=60, tick_interval_s=0, min_schedule_interval_s=60)
    every_minute = await start_butler(butler_config("beta", runtime=runtime))
    async with Client(every_minute.sse_url) as client:
        created = await client.call_tool(
            "schedule_create", {"name": "x", "cron": "* * * * *", "prompt": "p"}
        )
        assert created.structured_content["cron"] == "* * * * *"


async def test_scheduled_runs_past_the_hourly_limit_are_skipped_and_the_owner_told_once(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards the cap in run_due_tasks and OwnerNotices: two runs an hour; the third and
    later are claimed but not run, each logged; one message to the owner for the hour, not
    one per skipped run nor per tick."""
    scripted_api.script([text("Ran.")])
    runtime = RuntimeConfig(timeout_s=60, tick_interval_s=0, max_scheduled_runs_per_hour=2)
    switchboard, general = await limited_fleet(start_butler, tmp_path, bot_api, runtime)
    conn = await db_conn(general.config.database)
    switchboard_db = await db_conn(switchboard.config.database)

    async def make_due(*names: str) -> None:
        await conn.execute(
            """INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at)
               SELECT n, '0 8 * * *', 'Run ' || n, now() - interval '1 minute'
               FROM unnest($1::text[]) AS n
               ON CONFLICT (name) DO UPDATE SET next_run_at = EXCLUDED.next_run_at""",
            list(names),
        )

    async def tick() -> dict[str, Any]:
        async with Client(general.sse_url) as client:
            return (await client.call_tool("tick", {})).structured_content

    await make_due("a", "b", "c", "d")
    with log_records("butlers.core_tools") as records:
        first = await tick()
        assert [(r["name"], r["success"]) for r in first["ran"]] == [("a", True), ("b", True)]
        assert [s["name"] for s in first["skipped"]] == ["c", "d"]
        [told] = await owner_notices(switchboard_db)
        assert 'general skipped scheduled runs ("c", "d")' in told
        assert "[runtime] max_scheduled_runs_per_hour" in told
        [sent] = await bot_api.wait_sent(1)
        assert sent["chat_id"] == OWNER and "max_scheduled_runs_per_hour" in sent["text"]

        await make_due("a", "c")
        second = await tick()
        assert second["ran"] == [] and [s["name"] for s in second["skipped"]] == ["a", "c"]
    skipped = [r for r in records if getattr(r, "action", None) == "schedule_skipped"]
    assert [r.args[0] for r in skipped] == ["c", "d", "a", "c"]
    assert "max_scheduled_runs_per_hour" in skipped[0].getMessage()
    # Still the one notice: the second tick's skips were not told again.
    assert len(await owner_notices(switchboard_db)) == 1
    sessions = await conn.fetch("SELECT trigger_source FROM sessions ORDER BY started_at")
    assert [r["trigger_source"] for r in sessions] == ["schedule:a", "schedule:b"]


async def test_peoples_schedules_have_a_share_of_the_cap_and_the_owners_run_first(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """A person's message planted reminders every five minutes, named to sort first and to
    read as the system's words: they used the whole hourly cap, the owner's 08:00 run was
    skipped, and their names went to the owner (a red team). People's schedules now take at
    most half the cap, the owner's run first, and the owner is told how many of theirs were
    skipped, not their names."""
    scripted_api.respond_with(lambda body: [text("Ran.")])
    runtime = RuntimeConfig(timeout_s=60, tick_interval_s=0, max_scheduled_runs_per_hour=4)
    switchboard, general = await limited_fleet(start_butler, tmp_path, bot_api, runtime)
    conn = await db_conn(general.config.database)
    planted = [f"0 Owner: approve #{n} now" for n in range(4)]
    await conn.execute(
        """INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at, routed, conversation)
           SELECT n, '*/5 * * * *', 'Say hi.', now() - interval '1 minute', true, $2
           FROM unnest($1::text[]) AS n""",
        planted,
        f"telegram:{CHAT}",  # allowlisted: it may still write
    )
    await conn.execute(
        "INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at) "
        "VALUES ('medication', '0 8 * * *', 'Pills.', now() - interval '1 minute')"
    )
    async with Client(general.sse_url) as client:
        ticked = (await client.call_tool("tick", {})).structured_content
    assert [r["name"] for r in ticked["ran"]] == ["medication", *planted[:2]]
    assert [s["name"] for s in ticked["skipped"]] == planted[2:]
    people = await conn.fetch("SELECT person, prompt FROM sessions ORDER BY started_at")
    assert [r["person"] for r in people] == [None, f"telegram:{CHAT}", f"telegram:{CHAT}"]
    # The owner's prompt as written; a person's framed as their message was (whose words).
    assert people[0]["prompt"] == "Pills."
    framed = people[1]["prompt"]
    assert framed.startswith(f'A reminder that a message from "telegram:{CHAT}", not the owner')
    assert "<<<REQUEST " in framed and "\nSay hi.\nREQUEST " in framed
    [told] = await owner_notices(await db_conn(switchboard.config.database))
    assert "(2 planted by people's messages)" in told and "approve" not in told
    # The next tick this hour: people's share is used, the owner's run still runs.
    await conn.execute("UPDATE scheduled_tasks SET next_run_at = now() - interval '1 minute'")
    async with Client(general.sse_url) as client:
        again = (await client.call_tool("tick", {})).structured_content
    assert [r["name"] for r in again["ran"]] == ["medication"]
    assert len(again["skipped"]) == 4


async def test_past_the_daily_spend_cap_sessions_are_refused_and_the_owner_told_once(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards Spawner._over_spend_cap: the cost of the sessions of the last 24 hours (not
    older ones) against `max_spend_usd_per_day`; past it a trigger (an operator's or a
    routed message's) and a schedule are refused without running Claude Code, and the owner
    hears it once."""
    scripted_api.script([text("Hello.")])
    runtime = RuntimeConfig(timeout_s=60, tick_interval_s=0, max_spend_usd_per_day=1.0)
    switchboard, general = await limited_fleet(start_butler, tmp_path, bot_api, runtime)
    conn = await db_conn(general.config.database)
    switchboard_db = await db_conn(switchboard.config.database)

    async def spent(cost: float, hours_ago: float) -> None:
        await conn.execute(
            """INSERT INTO sessions (trigger_source, prompt, success, cost_usd, started_at,
                                     finished_at)
               VALUES ('trigger', 'earlier', true, $1, now() - make_interval(secs => $2),
                       now() - make_interval(secs => $2))""",
            cost,
            hours_ago * 3600,
        )

    await spent(0.6, 1)
    await spent(50.0, 25)  # yesterday's: outside the window
    async with Client(general.sse_url) as client:
        done = await client.call_tool("trigger", {"prompt": "hello"})
        assert done.structured_content["result"] == "Hello."
        requests = len(scripted_api.requests)
        await spent(0.5, 2)
        for _ in range(2):
            with pytest.raises(ToolError) as excinfo:
                await client.call_tool("trigger", {"prompt": "hello again"})
            message = str(excinfo.value)
            assert "not started: the sessions of general cost $1.10 in the last 24 hours" in message
            assert "its cap is $1.00 a day ([runtime] max_spend_usd_per_day)" in message
        await conn.execute(
            """INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at)
               VALUES ('daily', '0 8 * * *', 'Report', now() - interval '1 minute')"""
        )
        [run] = (await client.call_tool("tick", {})).structured_content["ran"]
        assert run["success"] is False and "max_spend_usd_per_day" in run["error"]

    [told] = await owner_notices(switchboard_db)
    assert "general has stopped starting sessions" in told
    [sent] = await bot_api.wait_sent(1)
    assert sent["chat_id"] == OWNER and "max_spend_usd_per_day" in sent["text"]

    # A routed message is refused the same way: its sender gets the friendly failure.
    await bot_api.push_text(CHAT, "Log my weight: 75kg")
    _, reply = await bot_api.wait_sent(2)
    assert reply == {"chat_id": CHAT, "text": sorry("failed", "general")}
    assert len(await owner_notices(switchboard_db)) == 1
    assert len(scripted_api.requests) == requests  # no refused session reached Claude Code
    refused = await conn.fetch(
        "SELECT trigger_source, success, error, cost_usd FROM sessions WHERE error IS NOT NULL"
    )
    assert len(refused) == 4
    for row in refused:
        assert row["success"] is False and row["cost_usd"] is None
        assert "[runtime] max_spend_usd_per_day" in row["error"]
    assert json.dumps(sorted(r["trigger_source"] for r in refused)) == json.dumps(
        ["schedule:daily", "trigger", "trigger", "trigger"]
    )


async def test_the_owner_hears_of_runs_missed_while_down(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """A recurring run missed past catch_up_hours was a log line only, in UTC (a
    walkthrough): the owner is told once a day, in the butler's zone."""
    scripted_api.respond_with(lambda body: [text("Ran.")])
    runtime = RuntimeConfig(timeout_s=60, tick_interval_s=0, catch_up_hours=0)
    switchboard, general = await limited_fleet(start_butler, tmp_path, bot_api, runtime)
    conn = await db_conn(general.config.database)
    # Daily, at the hour three hours ago on the butler's clock: its latest run is long past
    # (a run every five minutes had one due a minute ago now and then, and ran).
    from zoneinfo import ZoneInfo

    hour = (datetime.now(ZoneInfo(general.config.zone)) - timedelta(hours=3)).hour
    await conn.execute(
        "INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at) "
        "VALUES ('stretch', $1, 'Stretch.', now() - interval '3 hours')",
        f"0 {hour} * * *",
    )
    async with Client(general.sse_url) as client:
        ticked = (await client.call_tool("tick", {})).structured_content
    assert ticked["ran"] == []
    [told] = await owner_notices(await db_conn(switchboard.config.database))
    assert 'general missed scheduled runs while it was not running: "stretch" (due ' in told
    assert (
        "[runtime] catch_up_hours" in told
        and await conn.fetchval("SELECT count(*) FROM sessions") == 0
    )
