"""route(): real target butlers on loopback, a real switchboard, a real MCP client."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError
from opentelemetry.trace import StatusCode

from tests.conftest import StartButler, butler_config, free_port, log_records, write_butler_dir
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use
from tests.test_registry import call, start_switchboard


class Fleet:
    def __init__(self, switchboard, targets, config_dir: Path) -> None:
        self.switchboard = switchboard
        self.targets = targets
        self.config_dir = config_dir

    @property
    def connections(self):
        return self.switchboard.switchboard.connections


async def make_fleet(
    start_butler: StartButler,
    tmp_path: Path,
    names=("general", "health"),
    *,
    auth_token: str | None = None,
    ports: dict[str, int] | None = None,
    endpoint_path: str = "/sse",
) -> Fleet:
    config_dir = tmp_path / "config"
    targets = {}
    for name in names:
        port = (ports or {}).get(name, 0)
        daemon = await start_butler(butler_config(name, port=port), auth_token=auth_token)
        extra = ""
        if endpoint_path != "/sse":
            extra = f'endpoint_url = "http://127.0.0.1:{daemon.port}{endpoint_path}"\n'
        write_butler_dir(config_dir, name, daemon.port, extra="").joinpath("butler.toml")
        toml = config_dir / name / "butler.toml"
        toml.write_text(toml.read_text() + extra)
        targets[name] = daemon
    switchboard = await start_switchboard(start_butler, config_dir, auth_token=auth_token)
    return Fleet(switchboard, targets, config_dir)


@pytest.fixture
async def fleet(start_butler: StartButler, tmp_path: Path) -> Fleet:
    return await make_fleet(start_butler, tmp_path)


async def _log_rows(db_conn, fleet: Fleet) -> list[dict]:
    conn = await db_conn(fleet.switchboard.config.database)
    return [dict(r) for r in await conn.fetch("SELECT * FROM routing_log ORDER BY created_at")]


async def _last_seen(db_conn, fleet: Fleet, name: str):
    conn = await db_conn(fleet.switchboard.config.database)
    return await conn.fetchval("SELECT last_seen_at FROM butler_registry WHERE name = $1", name)


async def test_route_to_health_trigger_runs_its_claude_code(
    fleet: Fleet, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.script(
        [tool_use("mcp__health__state_set", {"key": "weight", "value": {"kg": 75}})],
        [text("Logged 75 kg.")],
    )
    seen_before = await _last_seen(db_conn, fleet, "health")
    async with Client(fleet.switchboard.sse_url) as client:
        result = await call(
            client,
            "route",
            butler_name="health",
            tool_name="trigger",
            args={"prompt": "Log my weight: 75kg"},
        )
    assert result["result"] == "Logged 75 kg."
    health_db = await db_conn(fleet.targets["health"].config.database)
    assert json.loads(await health_db.fetchval("SELECT value::text FROM state")) == {"kg": 75}

    [row] = await _log_rows(db_conn, fleet)
    assert row["source_channel"] == "mcp" and row["source_id"] is None
    assert row["routed_to"] == "health" and row["tool_name"] == "trigger"
    assert row["prompt_summary"] == "Log my weight: 75kg"
    assert row["success"] is True and row["error"] is None
    assert len(row["trace_id"]) == 32 and row["duration_ms"] > 0
    # The health butler's session ran in the same trace as the route.
    session_trace = await health_db.fetchval("SELECT trace_id FROM sessions")
    assert session_trace == row["trace_id"]
    assert await _last_seen(db_conn, fleet, "health") > seen_before


async def test_route_returns_target_results_and_summarizes_args(fleet: Fleet, db_conn) -> None:
    async with Client(fleet.switchboard.sse_url) as client:
        stored = await call(
            client,
            "route",
            butler_name="general",
            tool_name="state_set",
            args={"key": "note", "value": "buy milk"},
        )
        assert stored["key"] == "note"
        value = await call(
            client, "route", butler_name="general", tool_name="state_get", args={"key": "note"}
        )
        assert value == "buy milk"
        status = await call(client, "route", butler_name="general", tool_name="status")
        assert status["name"] == "general"
    rows = await _log_rows(db_conn, fleet)
    assert [r["prompt_summary"] for r in rows] == [
        '{"key": "note", "value": "buy milk"}',
        '{"key": "note"}',
        None,
    ]


async def test_the_logs_asynchronous_commit_stays_in_its_own_statement(fleet: Fleet) -> None:
    """The routing_log row is committed without waiting for the WAL flush; the inbox, which
    shares the pooled connections, must keep durable commits."""
    pool = fleet.switchboard.switchboard.routing_store.pool
    async with Client(fleet.switchboard.sse_url) as client:
        await asyncio.gather(
            *(
                call(client, "route", butler_name="general", tool_name="status")
                for _ in range(2 * pool.get_max_size())
            )
        )
    connections = [await pool.acquire() for _ in range(pool.get_max_size())]
    try:
        settings = [await conn.fetchval("SHOW synchronous_commit") for conn in connections]
    finally:
        for conn in connections:
            await pool.release(conn)
    assert settings == ["on"] * pool.get_max_size()


async def test_long_prompt_is_truncated_in_the_summary(fleet: Fleet, db_conn) -> None:
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(ToolError):
            # general's trigger would need Claude Code; session_get fails fast on the target.
            await client.call_tool(
                "route",
                {
                    "butler_name": "general",
                    "tool_name": "session_get",
                    "args": {"id": "x", "prompt": "p" * 500},
                },
            )
    [row] = await _log_rows(db_conn, fleet)
    assert len(row["prompt_summary"]) == 200 and row["prompt_summary"].endswith("…")


async def test_unknown_butler_is_refused_without_connecting(fleet: Fleet, db_conn) -> None:
    connects = fleet.connections.connects
    async with Client(fleet.switchboard.sse_url) as client:
        with (
            log_records("fastmcp") as records,
            pytest.raises(ToolError, match="butler 'nonexistent' not found"),
        ):
            await client.call_tool(
                "route",
                {"butler_name": "nonexistent", "tool_name": "trigger", "args": {"prompt": "hello"}},
            )
    assert fleet.connections.connects == connects
    # The caller's mistake: logged as routine, not as the switchboard's problem.
    [logged] = [r for r in records if "Error calling tool 'route'" in r.getMessage()]
    assert logged.levelno == logging.INFO
    [row] = await _log_rows(db_conn, fleet)
    assert row["routed_to"] == "nonexistent" and row["success"] is False
    assert "not found" in row["error"]


async def test_routing_to_the_switchboard_is_refused(fleet: Fleet, db_conn) -> None:
    connects = fleet.connections.connects
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(ToolError, match="routing to the Switchboard is not permitted"):
            await client.call_tool("route", {"butler_name": "switchboard", "tool_name": "status"})
    assert fleet.connections.connects == connects
    [row] = await _log_rows(db_conn, fleet)
    assert row["routed_to"] == "switchboard" and row["success"] is False


async def test_unreachable_butler_error_names_it_and_its_endpoint(
    fleet: Fleet, db_conn, spans
) -> None:
    health = fleet.targets["health"]
    endpoint = health.sse_url
    async with Client(fleet.switchboard.sse_url) as client:
        await call(client, "route", butler_name="health", tool_name="status")
        seen = await _last_seen(db_conn, fleet, "health")
        await health.stop()
        with log_records("fastmcp") as records, pytest.raises(ToolError) as excinfo:
            await client.call_tool(
                "route",
                {"butler_name": "health", "tool_name": "trigger", "args": {"prompt": "hello"}},
            )
    message = str(excinfo.value)
    assert "butler 'health' is unreachable at" in message and endpoint in message
    # Worth an operator's attention, but not a crash of the switchboard.
    [logged] = [r for r in records if "Error calling tool 'route'" in r.getMessage()]
    assert logged.levelno == logging.WARNING
    rows = await _log_rows(db_conn, fleet)
    assert [r["success"] for r in rows] == [True, False]
    assert endpoint in rows[1]["error"] and rows[1]["trace_id"]
    assert await _last_seen(db_conn, fleet, "health") == seen
    # The failed route is still traced: an error span, in the trace routing_log names.
    failed = [s for s in spans.get_finished_spans() if s.name == "switchboard.route"][-1]
    assert failed.status.status_code is StatusCode.ERROR and endpoint in failed.status.description
    assert format(failed.context.trace_id, "032x") == rows[1]["trace_id"]


async def test_a_butler_registered_where_it_no_longer_answers_is_found_where_it_does(
    fleet: Fleet, db_conn
) -> None:
    """A second fleet on the same database (`butlers up --port-offset`) registered its
    `health`; once it stopped, every route of the first failed "unreachable" until someone
    ran `butlers discover` (a red team). An unreachable target makes the switchboard
    discover again (at most every REDISCOVER_EVERY_S), and the route goes where it answers."""
    health = fleet.targets["health"]
    conn = await db_conn(fleet.switchboard.config.database)
    gone = f"http://127.0.0.1:{free_port()}/sse"  # the stopped fleet's
    await conn.execute("UPDATE butler_registry SET endpoint_url = $1 WHERE name = 'health'", gone)
    switchboard = fleet.switchboard.switchboard
    assert switchboard is not None
    switchboard.router.forget_endpoints()  # (its cache held the other fleet's too)
    async with Client(fleet.switchboard.sse_url) as client:
        answer = await call(client, "route", butler_name="health", tool_name="status")
        assert answer["name"] == "health"
        assert (
            await conn.fetchval("SELECT endpoint_url FROM butler_registry WHERE name = 'health'")
            == health.sse_url
        )
        # Gone for good: told so, and discover is not run for every route that fails.
        await health.stop()
        discovers = 0
        rediscover = switchboard.router.rediscover

        async def counted(butler: str, endpoint: str) -> object:
            nonlocal discovers
            discovers += 1
            assert rediscover is not None
            return await rediscover(butler, endpoint)

        switchboard.router.rediscover = counted
        for _ in range(3):
            with pytest.raises(ToolError, match="'health' is unreachable at"):
                await client.call_tool("route", {"butler_name": "health", "tool_name": "status"})
    assert discovers == 0  # (one ran within REDISCOVER_EVERY_S, above)


async def test_never_started_butler_is_unreachable_too(
    start_butler: StartButler, tmp_path: Path
) -> None:
    config_dir = tmp_path / "config"
    port = free_port()
    write_butler_dir(config_dir, "health", port)
    switchboard = await start_switchboard(start_butler, config_dir)
    async with Client(switchboard.sse_url) as client:
        with pytest.raises(
            ToolError, match=rf"'health' is unreachable at http://127\.0\.0\.1:{port}/sse"
        ):
            await client.call_tool("route", {"butler_name": "health", "tool_name": "status"})


async def test_target_tool_error_is_passed_back_marked_as_the_targets(
    fleet: Fleet, db_conn
) -> None:
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(
            ToolError,
            match="butler 'health' answered 'session_get' with an "
            "error: session id 'nope' is not a UUID",
        ):
            await client.call_tool(
                "route",
                {"butler_name": "health", "tool_name": "session_get", "args": {"id": "nope"}},
            )
        with pytest.raises(ToolError, match="butler 'health' answered 'no_such_tool'"):
            await client.call_tool("route", {"butler_name": "health", "tool_name": "no_such_tool"})
    rows = await _log_rows(db_conn, fleet)
    assert [r["success"] for r in rows] == [False, False]


async def test_trace_context_reaches_the_target_in_the_same_trace(
    fleet: Fleet, spans, db_conn
) -> None:
    async with Client(fleet.switchboard.sse_url) as client:
        await call(client, "route", butler_name="health", tool_name="state_get", args={"key": "k"})
    [row] = await _log_rows(db_conn, fleet)
    finished = spans.get_finished_spans()
    [route_span] = [s for s in finished if s.name == "switchboard.route"]
    [target_span] = [s for s in finished if s.name == "health/state_get"]
    assert route_span.attributes["target"] == "health"
    assert route_span.attributes["tool_name"] == "state_get"
    assert format(route_span.context.trace_id, "032x") == row["trace_id"]
    assert target_span.context.trace_id == route_span.context.trace_id
    # The target's span is a child of the route span (through `_trace_context`).
    assert target_span.parent.span_id == route_span.context.span_id


async def test_failed_route_span_has_error_status(fleet: Fleet, spans) -> None:
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(ToolError):
            await client.call_tool("route", {"butler_name": "ghost", "tool_name": "status"})
    [route_span] = [s for s in spans.get_finished_spans() if s.name == "switchboard.route"]
    assert route_span.status.status_code.name == "ERROR"


async def test_connections_are_kept_and_shared_by_concurrent_callers(fleet: Fleet) -> None:
    async with Client(fleet.switchboard.sse_url) as client:
        for i in range(5):
            await call(
                client,
                "route",
                butler_name="general",
                tool_name="state_set",
                args={"key": f"k{i}", "value": i},
            )
        results = await asyncio.gather(
            *(
                call(client, "route", butler_name=name, tool_name="status")
                for name in ("general", "health") * 10
            )
        )
    assert {r["name"] for r in results} == {"general", "health"}
    assert fleet.connections.connects == 2  # one connection per target, whatever the traffic


async def test_target_restart_between_routes(
    start_butler: StartButler, tmp_path: Path, db_conn
) -> None:
    port = free_port()
    fleet = await make_fleet(start_butler, tmp_path, names=("health",), ports={"health": port})
    health = fleet.targets["health"]
    async with Client(fleet.switchboard.sse_url) as client:
        await call(
            client,
            "route",
            butler_name="health",
            tool_name="state_set",
            args={"key": "before", "value": 1},
        )
        await health.stop()
        await start_butler(butler_config("health", port=port), database=health.config.database)
        value = await call(
            client, "route", butler_name="health", tool_name="state_get", args={"key": "before"}
        )
    assert value == 1
    assert fleet.connections.connects == 2
    assert [r["success"] for r in await _log_rows(db_conn, fleet)] == [True, True]


async def test_routing_with_auth_token_everywhere(
    start_butler: StartButler, tmp_path: Path
) -> None:
    fleet = await make_fleet(start_butler, tmp_path, names=("general",), auth_token="tok")
    async with Client(fleet.switchboard.sse_url, auth="tok") as client:
        status = await call(client, "route", butler_name="general", tool_name="status")
    assert status["name"] == "general"


async def test_streamable_http_endpoint_is_used_when_registered(
    start_butler: StartButler, tmp_path: Path
) -> None:
    fleet = await make_fleet(start_butler, tmp_path, names=("general",), endpoint_path="/mcp")
    async with Client(fleet.switchboard.sse_url) as client:
        rows = {r["name"]: r for r in await call(client, "list_butlers")}
        assert rows["general"]["endpoint_url"].endswith("/mcp")
        status = await call(client, "route", butler_name="general", tool_name="status")
    assert status["name"] == "general"
