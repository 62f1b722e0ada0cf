"""Every core tool through a real MCP client, over SSE and over streamable HTTP."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from tests.conftest import StartButler, log_records


@pytest.fixture(params=["sse", "mcp"])
async def client(request, start_butler: StartButler):
    begun = time.monotonic()
    daemon = await start_butler()
    started = time.monotonic()
    url = daemon.sse_url if request.param == "sse" else f"{daemon.base_url}/mcp"
    async with Client(url) as c:
        c.daemon = daemon  # type: ignore[attr-defined]
        c.started_between = (begun, started)  # type: ignore[attr-defined]
        yield c


async def call(client: Client, tool: str, **arguments):
    result = await client.call_tool(tool, arguments)
    return (
        result.structured_content.get("result", result.structured_content)
        if result.structured_content is not None
        else result.data
    )


async def test_tool_list_is_the_core_set(client: Client) -> None:
    names = {tool.name for tool in await client.list_tools()}
    assert names == {
        "state_get",
        "state_set",
        "state_delete",
        "state_list",
        "schedule_create",
        "schedule_list",
        "schedule_delete",
        "sessions_list",
        "session_get",
        "trigger",
        "tick",
        "status",
        "notify",
        "memory_remember",
        "memory_search",
        "memory_forget",
        "memory_list",
    }


async def test_state_round_trip(client: Client, db_conn) -> None:
    value = {"kg": 75.5, "tags": ["morning", "ünïcode"], "nested": {"ok": True}}
    stored = await call(client, "state_set", key="log/weight/2026-11-21", value=value)
    assert stored["key"] == "log/weight/2026-11-21"
    assert await call(client, "state_get", key="log/weight/2026-11-21") == value
    assert await call(client, "state_get", key="missing") is None

    # The row is really in PostgreSQL, as JSONB.
    conn = await db_conn(client.daemon.config.database)
    raw = await conn.fetchval(
        "SELECT value::text FROM state WHERE key = $1", "log/weight/2026-11-21"
    )
    assert json.loads(raw) == value

    await call(client, "state_set", key="log/weight/2026-11-22", value=74)
    await call(client, "state_set", key="other", value="x")
    listed = await call(client, "state_list", prefix="log/")
    assert [row["key"] for row in listed] == ["log/weight/2026-11-21", "log/weight/2026-11-22"]
    assert listed[1]["value"] == 74

    assert (await call(client, "state_delete", key="other"))["deleted"] is True
    assert (await call(client, "state_delete", key="other"))["deleted"] is False
    assert [r["key"] for r in await call(client, "state_list")] == [
        "log/weight/2026-11-21",
        "log/weight/2026-11-22",
    ]


async def test_the_channels_own_keys_are_not_the_tools(client: Client) -> None:
    """What a channel keeps across starts (the email intake's first UID to read) is in the
    state table under `channel:`: a session told to set it high would have no mail read
    again (a review). The tools refuse those keys."""
    for tool, arguments in (
        ("state_set", {"key": "channel:email:first_uid:x", "value": {"uid": 10**9}}),
        ("state_get", {"key": "channel:email:first_uid:x"}),
        ("state_delete", {"key": "channel:email:first_uid:x"}),
    ):
        result = await client.call_tool(tool, arguments, raise_on_error=False)
        assert result.is_error and "are the channels' own" in result.content[0].text
    await call(client, "state_set", key="channels", value=1)  # a key of its own is fine


async def test_state_list_prefix_is_literal(client: Client) -> None:
    await call(client, "state_set", key="a%b", value=1)
    await call(client, "state_set", key="axb", value=2)
    assert [r["key"] for r in await call(client, "state_list", prefix="a%")] == ["a%b"]


async def test_schedule_lifecycle(client: Client, db_conn) -> None:
    created = await call(
        client,
        "schedule_create",
        name="weigh-in",
        cron="0 7 * * *",
        prompt="Remind me to weigh myself",
    )
    assert created["name"] == "weigh-in" and created["enabled"] is True
    assert created["next_run_at"].endswith(("07:00:00Z", "07:00:00+00:00"))
    listed = await call(client, "schedule_list")
    assert [t["name"] for t in listed] == ["weigh-in"]

    with pytest.raises(ToolError, match="already exists"):
        await client.call_tool(
            "schedule_create", {"name": "weigh-in", "cron": "0 8 * * *", "prompt": "again"}
        )
    assert (await call(client, "schedule_delete", name="weigh-in"))["deleted"] is True
    assert await call(client, "schedule_list") == []
    with pytest.raises(ToolError, match="no schedule named 'weigh-in'"):
        await client.call_tool("schedule_delete", {"name": "weigh-in"})


async def test_schedules_are_capped(client: Client, db_conn) -> None:
    """At most 100 per butler, at least a minute apart, prompts of at most 32 KiB: a
    schedule starts a Claude Code session each time it runs."""
    for cron in ("* * * * * */5", "* * * * * * *", "@reboot", "every minute"):
        with pytest.raises(ToolError, match="invalid cron expression"):
            await client.call_tool("schedule_create", {"name": "x", "cron": cron, "prompt": "p"})
    # Five fields, one out of range: that field is named, not "expected five fields".
    with pytest.raises(ToolError, match=r"its minute '61' is not valid: it takes 0-59 \("):
        await client.call_tool(
            "schedule_create", {"name": "x", "cron": "61 8 * * *", "prompt": "p"}
        )
    with pytest.raises(ToolError, match=r"its day-of-week 'mon-fry' is not valid: it takes 0-7"):
        await client.call_tool(
            "schedule_create", {"name": "x", "cron": "0 8 * * mon-fry", "prompt": "p"}
        )
    with pytest.raises(ToolError, match=r"'0 0 31 2 \*': it never comes round"):
        await client.call_tool(
            "schedule_create", {"name": "x", "cron": "0 0 31 2 *", "prompt": "p"}
        )
    with pytest.raises(ToolError, match="prompt is 32769 bytes; the limit is 32768"):
        await client.call_tool(
            "schedule_create", {"name": "big", "cron": "@daily", "prompt": "p" * 32769}
        )
    conn = await db_conn(client.daemon.config.database)
    await conn.execute(
        """INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at)
           SELECT 'task-' || n, '0 0 1 1 *', 'p', now() + interval '1 year'
           FROM generate_series(1, 99) AS n"""
    )
    await call(client, "schedule_create", name="hundredth", cron="@hourly", prompt="p" * 32768)
    with pytest.raises(ToolError, match="already has 100 schedules, the limit; delete one"):
        await client.call_tool(
            "schedule_create", {"name": "one-more", "cron": "0 8 * * *", "prompt": "p"}
        )
    assert await conn.fetchval("SELECT count(*) FROM scheduled_tasks") == 100


async def test_status_and_empty_sessions(client: Client) -> None:
    asked = time.monotonic()
    status = await call(client, "status")
    answered = time.monotonic()
    assert status["name"] == client.daemon.config.name
    assert status["database"]["ok"] is True and len(status["database"]["id"]) == 16
    assert status["modules"] == []
    # The tools its sessions may be given, by name (how an owner finds them).
    assert {"state_get", "schedule_create", "memory_search", "notify"} <= set(status["tools"])
    assert status["tools"] == sorted(status["tools"])
    # Seconds since the butler started (it runs in this process, on this clock), to the ms.
    begun, started = client.started_between
    assert asked - started - 0.001 <= status["uptime_s"] <= answered - begun + 0.001
    assert await call(client, "sessions_list") == []


async def test_tick_with_nothing_due_runs_nothing(client: Client) -> None:
    await call(client, "schedule_create", name="later", cron="0 0 1 1 *", prompt="new year")
    assert (await call(client, "tick"))["ran"] == []


async def test_every_tool_accepts_trace_context(client: Client, spans) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    carrier = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    # Each call does its ordinary work with the extra argument...
    calls = [
        ("state_set", {"key": "k", "value": 1}, lambda r: r["key"] == "k"),
        ("state_get", {"key": "k"}, lambda r: r == 1),
        ("state_list", {}, lambda r: [(e["key"], e["value"]) for e in r] == [("k", 1)]),
        ("state_delete", {"key": "k"}, lambda r: r["deleted"] is True),
        (
            "schedule_create",
            {"name": "s", "cron": "0 0 1 1 *", "prompt": "p"},
            lambda r: r["name"] == "s",
        ),
        ("schedule_list", {}, lambda r: [t["name"] for t in r] == ["s"]),
        ("schedule_delete", {"name": "s"}, lambda r: r["deleted"] is True),
        ("sessions_list", {}, lambda r: r == []),
        ("tick", {}, lambda r: r["ran"] == []),
        ("status", {}, lambda r: r["name"] == client.daemon.config.name),
    ]
    for tool, arguments, expected in calls:
        result = await call(client, tool, **arguments, _trace_context=carrier)
        assert expected(result), (tool, result)
    # ...and runs in the caller's trace.
    name = client.daemon.config.name
    traced = {
        s.name.removeprefix(f"{name}/"): format(s.context.trace_id, "032x")
        for s in spans.get_finished_spans()
        if s.name.startswith(f"{name}/")
    }
    assert traced == {tool: trace_id for tool, _, _ in calls}
    # session_get and trigger take it too: they fail on their own terms, not on the argument.
    with pytest.raises(ToolError, match="not found"):
        await client.call_tool("session_get", {"id": str(uuid.uuid4()), "_trace_context": carrier})
    with pytest.raises(ToolError, match="prompt must not be empty"):
        await client.call_tool("trigger", {"prompt": " ", "_trace_context": carrier})


async def test_a_refused_call_is_logged_as_routine_not_as_an_error(client: Client) -> None:
    """FastMCP logs every ToolError at ERROR; a caller's mistake is not the butler's error."""
    with log_records("fastmcp") as records, pytest.raises(ToolError, match="must not be empty"):
        await client.call_tool("state_get", {"key": ""})
    [logged] = [r for r in records if "Error calling tool" in r.getMessage()]
    assert logged.levelno == logging.INFO


async def test_trace_context_must_be_an_object(client: Client) -> None:
    with pytest.raises(ToolError, match="_trace_context must be an object"):
        await client.call_tool("status", {"_trace_context": "00-abc"})
