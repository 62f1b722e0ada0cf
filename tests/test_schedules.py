"""Time as people expect it (issue 27): schedules in the butler's time zone, one-time `at`
reminders, schedules declared in butler.toml, and runs missed while the butler was down.

Real butlers on real PostgreSQL; a schedule is made due by moving its next_run_at, rather
than by waiting for the clock, and `tick` runs what is due."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from butlers.config import RuntimeConfig, ScheduleConfig
from tests.conftest import StartButler, butler_config, log_records
from tests.fakes.messages_api import ScriptedMessagesAPI, text

TOKYO_BRIEF = ScheduleConfig(name="brief", cron="0 8 * * *", prompt="Summarise today.")


async def call(url: str, tool: str, arguments: dict[str, Any]) -> Any:
    async with Client(url) as client:
        result = await client.call_tool(tool, arguments)
    return (
        result.structured_content.get("result", result.structured_content)
        if (result.structured_content is not None)
        else json.loads(result.content[0].text)
    )


async def test_a_declared_schedule_runs_at_eight_in_its_zone(
    start_butler: StartButler, db_conn
) -> None:
    daemon = await start_butler(
        butler_config("alpha", timezone="Asia/Tokyo", schedules=(TOKYO_BRIEF,))
    )
    conn = await db_conn(daemon.config.database)
    next_run = await conn.fetchval("SELECT next_run_at FROM scheduled_tasks WHERE name = 'brief'")
    assert (next_run.astimezone(UTC).hour, next_run.minute) == (23, 0)  # 08:00 JST
    listed = await call(daemon.sse_url, "schedule_list", {})
    assert [(s["name"], s["origin"], s["timezone"]) for s in listed] == [
        ("brief", "config", "Asia/Tokyo")
    ]
    assert listed[0]["next_run_at"].endswith("+00:00")


async def test_declared_schedules_follow_the_file_and_tools_schedules_stay(
    start_butler: StartButler, db_conn
) -> None:
    first = await start_butler(butler_config("alpha", schedules=(TOKYO_BRIEF,)))
    conn = await db_conn(first.config.database)
    await call(
        first.sse_url, "schedule_create", {"name": "mine", "cron": "0 9 * * 1", "prompt": "Hi."}
    )
    await first.stop()
    changed = ScheduleConfig(name="evening", cron="0 20 * * *", prompt="Close the day.")
    await start_butler(butler_config("alpha", schedules=(changed,)), database=first.config.database)
    rows = await conn.fetch("SELECT name, declared FROM scheduled_tasks ORDER BY name")
    assert [(r["name"], r["declared"]) for r in rows] == [("evening", True), ("mine", False)]


async def test_at_runs_once_late_if_need_be_and_is_then_gone(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.script([text("Reminded.")])
    daemon = await start_butler(butler_config("alpha", timezone="Europe/Berlin"))
    conn = await db_conn(daemon.config.database)
    at = (datetime.now(UTC) + timedelta(seconds=70)).isoformat()
    created = await call(
        daemon.sse_url, "schedule_create", {"name": "call-mum", "at": at, "prompt": "Call mum."}
    )
    assert created["cron"] is None and created["origin"] == "tool"
    assert [s["name"] for s in await call(daemon.sse_url, "schedule_list", {})] == ["call-mum"]
    # Due an hour ago: the butler was down when it came.
    await conn.execute(
        "UPDATE scheduled_tasks SET next_run_at = now() - interval '1 hour' WHERE name = $1",
        "call-mum",
    )
    ticked = await call(daemon.sse_url, "tick", {})
    assert [r["name"] for r in ticked["ran"]] == ["call-mum"]
    assert await conn.fetchval("SELECT count(*) FROM scheduled_tasks") == 0
    prompt = await conn.fetchval(
        "SELECT prompt FROM sessions WHERE trigger_source = $1", "schedule:call-mum"
    )
    assert "runs late" in prompt and prompt.endswith("Call mum.")
    assert (await call(daemon.sse_url, "tick", {}))["ran"] == []


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"at": "2020-01-01T09:00"}, "in the past"),
        ({"at": "next tuesday"}, "ISO 8601"),
        ({"cron": "* * * * *"}, "min_schedule_interval_s"),
        ({}, "exactly one of cron"),
        ({"cron": "0 8 * * *", "at": "2099-01-01T08:00"}, "exactly one of cron"),
    ],
)
async def test_bad_times_are_refused_with_the_reason(
    start_butler: StartButler, db_conn, arguments: dict[str, str], problem: str
) -> None:
    daemon = await start_butler(butler_config("alpha", runtime=RuntimeConfig(tick_interval_s=0)))
    with pytest.raises(ToolError, match=problem):
        await call(daemon.sse_url, "schedule_create", {"name": "x", "prompt": "p", **arguments})
    conn = await db_conn(daemon.config.database)
    assert await conn.fetchval("SELECT count(*) FROM scheduled_tasks") == 0


async def test_a_missed_run_is_caught_up_once_and_an_old_one_moves_on(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.script([text("Done.")])
    daemon = await start_butler(butler_config("alpha"))
    conn = await db_conn(daemon.config.database)
    for name in ("recent", "stale"):
        await call(
            daemon.sse_url, "schedule_create", {"name": name, "cron": "0 * * * *", "prompt": name}
        )
    # Down for a day. recent: hourly, so its latest due run is within the hour, inside
    # catch_up_hours (6): it runs, once, not 24 times. stale: daily, last due 10 hours ago,
    # outside the window: it moves on to tomorrow without running.
    ten_hours_ago = datetime.now(UTC) - timedelta(hours=10)
    await conn.execute(
        "UPDATE scheduled_tasks SET next_run_at = now() - interval '1 day' WHERE name = 'recent'"
    )
    await conn.execute(
        "UPDATE scheduled_tasks SET next_run_at = $1, cron = $2 WHERE name = 'stale'",
        ten_hours_ago.replace(second=0, microsecond=0) - timedelta(days=1),
        f"{ten_hours_ago.minute} {ten_hours_ago.hour} * * *",
    )
    with log_records("butlers.core_store") as records:
        ticked = await call(daemon.sse_url, "tick", {})
    assert [r["name"] for r in ticked["ran"]] == ["recent"]  # once, not 24 times
    assert any("'stale'" in r.getMessage() and "catch_up_hours" in r.getMessage() for r in records)
    stale_next = await conn.fetchval("SELECT next_run_at FROM scheduled_tasks WHERE name = 'stale'")
    assert stale_next > datetime.now(UTC)
    assert (await call(daemon.sse_url, "tick", {}))["ran"] == []


async def test_butlers_schedules_lists_every_butler_in_its_local_time(
    start_butler: StartButler, tmp_path
) -> None:
    from tests.test_cli_client import run_cli
    from tests.test_route import make_fleet

    fleet = await make_fleet(start_butler, tmp_path, names=("general",), auth_token="cli-token")
    general = fleet.targets["general"]
    await call_with_token(
        general.sse_url,
        "schedule_create",
        {"name": "brief", "cron": "0 8 * * *", "prompt": "Summarise today."},
    )
    url = fleet.switchboard.sse_url
    code, out, err = await run_cli("schedules", "--url", url, token="cli-token")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["BUTLER", "NAME", "WHEN"]
    [row] = [line for line in lines if line.startswith("general ")]
    assert "brief" in row and "0 8 * * *" in row and " 08:00 " in row and "tool" in row
    code, out, err = await run_cli(
        "schedules", "--butler", "general", "--json", "--url", url, token="cli-token"
    )
    assert code == 0, err
    assert [(r["butler"], r["name"]) for r in json.loads(out)] == [("general", "brief")]
    code, _, err = await run_cli("schedules", "--butler", "nobody", "--url", url, token="cli-token")
    assert code == 1 and "no butler named 'nobody'" in err


async def call_with_token(url: str, tool: str, arguments: dict[str, Any]) -> Any:
    from fastmcp.client.transports import SSETransport

    async with Client(SSETransport(url, headers={"Authorization": "Bearer cli-token"})) as client:
        return (await client.call_tool(tool, arguments)).structured_content


def test_the_dashboard_shows_a_schedule_on_its_butlers_wall_clock() -> None:
    from butlers.dashboard.app import _local

    assert _local("2026-11-26T23:00:00+00:00", "Asia/Tokyo") == "2026-11-27 08:00 JST"
    assert _local("2026-11-26T23:00:00+00:00", None) == "2026-11-26 23:00:00 UTC"
    assert _local(None, "Asia/Tokyo") == "-"
