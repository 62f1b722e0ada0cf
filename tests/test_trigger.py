"""`trigger` end to end: the real Claude Code binary, driven by the scripted Messages API,
calls the butler's own tools over MCP; every session is recorded, failures included."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from pathlib import Path

import psutil
import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from butlers.claude_code import McpTarget, not_logged_in
from butlers.config import RuntimeConfig
from tests.conftest import StartButler, butler_config, eventually, no_credentials_env
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use

INSTRUCTIONS = "You are the alpha butler. Keep notes in state."


async def _session_rows(db_conn, daemon) -> list[dict]:
    conn = await db_conn(daemon.config.database)
    return [dict(r) for r in await conn.fetch("SELECT * FROM sessions ORDER BY started_at")]


async def test_trigger_runs_claude_code_which_calls_state_set_over_mcp(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    daemon = await start_butler(butler_config(instructions=INSTRUCTIONS), auth_token="tok-123")
    scripted_api.script(
        [tool_use("mcp__alpha__state_set", {"key": "weight", "value": {"kg": 75}})],
        [text("Logged 75 kg.")],
    )
    async with Client(daemon.sse_url, auth="tok-123") as client:
        result = (await client.call_tool("trigger", {"prompt": "Log my weight: 75kg"})).data

    assert result["result"] == "Logged 75 kg."
    # Claude Code really called the tool over MCP: the row is there, and the tool's own answer
    # went back to the model.
    conn = await db_conn(daemon.config.database)
    assert json.loads(await conn.fetchval("SELECT value::text FROM state WHERE key='weight'")) == {
        "kg": 75
    }
    [tool_result] = scripted_api.tool_results()
    assert "updated_at" in json.dumps(tool_result["content"])

    [row] = await _session_rows(db_conn, daemon)
    assert str(row["id"]) == result["session_id"]
    assert row["success"] is True and row["error"] is None
    assert row["result"] == "Logged 75 kg."
    assert row["prompt"] == "Log my weight: 75kg"
    assert row["trigger_source"] == "trigger"
    assert [c["name"] for c in json.loads(row["tool_calls"])] == ["mcp__alpha__state_set"]
    assert row["duration_ms"] > 0 and row["finished_at"] is not None
    assert row["trace_id"] is not None and len(row["trace_id"]) == 32
    # What Claude Code said the session cost (its price of the tokens the API reported).
    assert row["cost_usd"] is not None and row["cost_usd"] > 0

    # What Claude Code was given: the butler's instructions and only its allowed MCP tools.
    first = scripted_api.requests[0]
    system = json.dumps(first.get("system"))
    assert INSTRUCTIONS in system
    tool_names = {t["name"] for t in first.get("tools", [])}
    mcp_tools = {n for n in tool_names if n.startswith("mcp__")}
    assert "mcp__alpha__state_set" in mcp_tools
    assert not mcp_tools & {"mcp__alpha__trigger", "mcp__alpha__tick"}
    assert not tool_names & {"Bash", "Read", "Write", "Edit", "WebFetch"}


async def test_session_is_listed_and_fetchable(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI
) -> None:
    daemon = await start_butler()
    scripted_api.script([text("Hello there.")])
    async with Client(daemon.sse_url) as client:
        done = (await client.call_tool("trigger", {"prompt": "say hello"})).data
        listed = (await client.call_tool("sessions_list", {"limit": 5})).structured_content[
            "result"
        ]
        assert [s["id"] for s in listed] == [done["session_id"]]
        full = (
            await client.call_tool("session_get", {"id": done["session_id"]})
        ).structured_content
        assert full["result"] == "Hello there." and full["success"] is True


async def test_mcp_server_that_does_not_connect_is_a_failed_session(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    daemon = await start_butler()
    scripted_api.script([text("I did it anyway.")])
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    target = McpTarget(
        name="alpha", url=f"http://127.0.0.1:{dead_port}/sse", allowed_tools=("state_set",)
    )
    outcome = await daemon.context.spawner.run("do it", target=target, trigger_source="test")
    assert outcome.success is False
    assert "did not connect" in outcome.error and str(dead_port) in outcome.error
    [row] = await _session_rows(db_conn, daemon)
    assert row["success"] is False and "did not connect" in row["error"]


async def test_a_failed_session_records_what_it_cost(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """A session that runs out of turns failed, and it still spent money: the daily spend
    cap ([runtime] max_spend_usd_per_day) counts sessions.cost_usd, so a message that makes
    every session fail must not run for free."""
    from butlers.config import RuntimeConfig

    daemon = await start_butler(
        butler_config(runtime=RuntimeConfig(timeout_s=60, tick_interval_s=0, max_turns=1))
    )
    scripted_api.script(
        [tool_use("mcp__alpha__state_list", {})],
        [tool_use("mcp__alpha__state_list", {})],
        [text("never reached")],
    )
    async with Client(daemon.sse_url) as client:
        with pytest.raises(ToolError, match="failed"):
            await client.call_tool("trigger", {"prompt": "keep listing"})
    [row] = await _session_rows(db_conn, daemon)
    assert row["success"] is False and row["error"]
    assert row["cost_usd"] is not None and row["cost_usd"] > 0


async def test_missing_credentials_is_a_recorded_failure_with_a_clear_error(
    start_butler: StartButler, db_conn, tmp_path: Path
) -> None:
    env = no_credentials_env(tmp_path / "no-login")
    daemon = await start_butler(session_env=env)
    async with Client(daemon.sse_url) as client:
        with pytest.raises(ToolError) as refused:
            await client.call_tool("trigger", {"prompt": "hello"})
    assert str(refused.value).endswith(f"failed: {not_logged_in()}"), refused.value
    assert "set ANTHROPIC_API_KEY" in not_logged_in()  # and how to fix it
    [row] = await _session_rows(db_conn, daemon)
    assert row["success"] is False and row["error"] == not_logged_in()
    assert not row["cost_usd"]  # nothing spent (Claude Code reports $0 for it, or nothing)


def _claude_children() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "claude" in " ".join(p.cmdline()).lower()
    ]


async def test_timeout_is_a_recorded_failure_and_leaves_no_process(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    daemon = await start_butler(
        butler_config(runtime=RuntimeConfig(timeout_s=3, tick_interval_s=0))
    )
    scripted_api.delay_s = 30
    async with Client(daemon.sse_url) as client:
        with pytest.raises(ToolError, match="timed out after 3s"):
            await client.call_tool("trigger", {"prompt": "take your time"})
    [row] = await _session_rows(db_conn, daemon)
    assert row["success"] is False and "timed out" in row["error"]
    for _ in range(50):
        if not _claude_children():
            break
        await asyncio.sleep(0.1)
    assert _claude_children() == []


async def test_a_session_whose_caller_went_away_says_so_not_that_the_butler_stopped(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """A client that disconnects mid-trigger cuts the session short; its row said "the
    butler stopped" while the butler ran on (a soak test)."""
    daemon = await start_butler(butler_config(runtime=RuntimeConfig(tick_interval_s=0)))
    scripted_api.delay_s = 60  # the model never answers while the caller waits
    async with Client(daemon.sse_url) as client:
        call = asyncio.create_task(client.call_tool("trigger", {"prompt": "take your time"}))
        async with asyncio.timeout(60):
            await scripted_api.wait_for_request(lambda body: True)
        call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    conn = await db_conn(daemon.config.database)

    async def finished() -> bool:
        return await conn.fetchval("SELECT finished_at IS NOT NULL FROM sessions")

    await eventually(finished)
    [row] = await _session_rows(db_conn, daemon)
    assert row["success"] is False
    assert row["error"] == (
        "interrupted: the session was stopped before it finished "
        "(whoever asked for it stopped waiting)"
    )


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_sessions_are_serialised_per_butler(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, concurrency: int
) -> None:
    runtime = RuntimeConfig(timeout_s=120, tick_interval_s=0, max_concurrent_sessions=concurrency)
    daemon = await start_butler(butler_config(runtime=runtime))
    scripted_api.script([text("ok")])
    # Each request is held until both are in flight, or 3 s: serialised sessions never meet
    # (each waits out the 3 s); parallel ones meet however slowly the second one starts (up
    # to 90 s; should it never come, the answer still beats the session timeout and the
    # assertion below says what happened).
    scripted_api.delay_s = 3 if concurrency == 1 else 90
    scripted_api.release_at_in_flight = 2
    async with Client(daemon.sse_url) as client:
        results = await asyncio.gather(
            client.call_tool("trigger", {"prompt": "one"}),
            client.call_tool("trigger", {"prompt": "two"}),
        )
    assert [r.data["result"] for r in results] == ["ok", "ok"]
    # One session at a time by default: the model never saw two conversations at once.
    assert scripted_api.max_in_flight == concurrency


async def test_tick_runs_due_schedule_as_a_session(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    daemon = await start_butler()
    scripted_api.script(
        [tool_use("mcp__alpha__state_set", {"key": "reminded", "value": True})], [text("Reminded.")]
    )
    async with Client(daemon.sse_url) as client:
        await client.call_tool(
            "schedule_create", {"name": "remind", "cron": "*/5 * * * *", "prompt": "Remind me"}
        )
        conn = await db_conn(daemon.config.database)
        await conn.execute("UPDATE scheduled_tasks SET next_run_at = now() - interval '1 minute'")
        ran = (await client.call_tool("tick", {})).structured_content["ran"]
        assert [(r["name"], r["success"]) for r in ran] == [("remind", True)]
        # Claimed: a second tick right away runs nothing, and the next run moved forward.
        assert (await client.call_tool("tick", {})).structured_content["ran"] == []
    task = await conn.fetchrow("SELECT * FROM scheduled_tasks WHERE name='remind'")
    assert task["last_run_at"] is not None and task["next_run_at"] > task["last_run_at"]
    assert await conn.fetchval("SELECT value::text FROM state WHERE key='reminded'") == "true"
    [row] = await _session_rows(db_conn, daemon)
    assert row["trigger_source"] == "schedule:remind" and row["success"] is True


async def test_claude_codes_logs_of_a_session_stay_in_the_butlers_data_and_age_out(
    start_butler: StartButler, scripted_api: ScriptedMessagesAPI, tmp_path: Path
) -> None:
    """Claude Code logs each run's MCP connections under its cache, one file a session,
    never removed: in the owner's ~/.cache, without bound (a soak test). They go to the
    butler's own data (claude_code.cache_dir), and those older than a day are deleted (at
    start and with retention)."""
    import os
    import time

    from butlers.claude_code import cache_dir, prune_cache

    daemon = await start_butler()
    scripted_api.script([text("Done.")])
    async with Client(daemon.sse_url) as client:
        result = (await client.call_tool("trigger", {"prompt": "Hello"})).data
    assert result["result"] == "Done.", result
    assert daemon.context is not None
    work_dir = daemon.context.spawner.work_dir
    logs = [p for p in cache_dir(work_dir).rglob("*") if p.is_file()]
    assert logs and any("mcp-logs-" in str(p) for p in logs), logs
    home_cache = tmp_path / "claude-home" / ".cache"
    assert not home_cache.exists() or not any(home_cache.rglob("mcp-logs-*")), home_cache
    # A day old: deleted, and the directories it leaves empty.
    assert prune_cache(work_dir) == 0  # (new: kept)
    day_ago = time.time() - 25 * 3600
    for path in logs:
        os.utime(path, (day_ago, day_ago))
    assert prune_cache(work_dir) == len(logs)
    assert not any(p.is_file() for p in cache_dir(work_dir).rglob("*"))


async def test_a_session_runs_with_a_relative_data_dir(
    pg_server,
    make_database,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
    claude_env: dict[str, str],
    scripted_api: ScriptedMessagesAPI,
    telemetry,
) -> None:
    """BUTLERS_DATA_DIR defaults to `.butlers`, relative: Claude Code runs in the session's
    work directory and was handed its MCP config by a path relative to where the butler
    started, so every session of `make up` failed ("MCP config file not found")."""
    from dataclasses import replace

    from butlers.daemon import ButlerDaemon
    from butlers.settings import Settings

    monkeypatch.chdir(tmp_path)
    scripted_api.script([text("Done.")])
    config = replace(butler_config("alpha"), db_name=await make_database())
    daemon = ButlerDaemon(
        config,
        pg_server,
        data_dir=Path(".butlers"),
        settings=Settings.from_environ(),
        session_env=claude_env,
        telemetry=telemetry,
    )
    await daemon.start()
    try:
        assert daemon.context is not None
        outcome = await daemon.context.spawner.run(
            "Say done.", target=daemon.context.self_target(), trigger_source="test"
        )
        assert outcome.success, outcome.error
    finally:
        await daemon.stop()
