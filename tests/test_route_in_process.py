"""Route to a butler of the same process (`butlers up`): no HTTP, the same answers and guards.

The switchboard reaches the butlers its process serves through `LocalConnection`
(butlers.mcp_connection.local): the target's own MCP session and FastMCP dispatch, with its
middleware, over memory streams. These tests wire a fleet of real daemons the way
`start_fleet` does (`route_within_the_process`) and call `route` over SSE, as any client does.
What they hold it to: nothing of the caller's request reaches the target (its headers, its
`_meta`: the caller is a stranger's client), trace context does; a slow target times out and
hears the cancellation; a registry row that points anywhere else still goes over the wire;
closing the switchboard ends the in-process sessions. And the routing_log rows of routes in
flight together are written in one round trip and one transaction (group commit), a refused
row failing only its own route.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastmcp import Client
from fastmcp.client.transports import SSETransport
from fastmcp.exceptions import ToolError
from fastmcp.server.dependencies import get_http_headers

from butlers.daemon import route_within_the_process
from butlers.errors import ButlersError, RouteRefused
from butlers.logs import _BUTLER
from butlers.mcp_middleware import request_conversation
from butlers.session_policy import session_token
from butlers.spawner import ACTING_SESSION
from butlers.switchboard.route import RouteSource
from butlers.switchboard.routing_store import RouteRecord, RoutingStore
from tests.conftest import StartButler, eventually, write_butler_dir
from tests.test_registry import call
from tests.test_route import Fleet, make_fleet


@pytest.fixture
async def fleet(start_butler: StartButler, tmp_path: Path) -> Fleet:
    fleet = await make_fleet(start_butler, tmp_path)
    route_within_the_process([fleet.switchboard, *fleet.targets.values()])
    general = fleet.targets["general"]
    assert general.mcp is not None

    @general.mcp.tool
    def what_i_see() -> dict[str, Any]:
        """What a routed call brings the target: its request's headers and conversation."""
        return {
            "headers": sorted(get_http_headers(include_all=True)),
            "conversation": request_conversation(),
            "session": session_token(),
            "log_butler": _BUTLER.get(),
        }

    return fleet


def _stranger(url: str) -> Client:
    """A client that sends what a stranger would like a target to believe."""
    return Client(
        SSETransport(
            url,
            headers={
                "X-Caller-Secret": "someone-elses",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            },
        )
    )


async def test_a_routed_call_in_the_process_brings_the_target_nothing_of_the_callers_request(
    fleet: Fleet, spans
) -> None:
    async with _stranger(fleet.switchboard.sse_url) as client:
        result = await client.call_tool_mcp(
            "route",
            {"butler_name": "general", "tool_name": "what_i_see"},
            meta={"butlers/conversation": "telegram:victim"},
        )
        status = await call(client, "route", butler_name="general", tool_name="status")
    seen = result.structured_content["result"]
    # No HTTP request at the target (over the wire it has host, authorization...), and the
    # caller's headers and `_meta` stayed with the switchboard.
    assert seen == {
        "headers": [],
        "conversation": None,
        "session": None,
        "log_butler": "general",  # its own records name it
    }, seen
    assert status["name"] == "general"
    # The target's span continues route's, inside the caller's trace.
    [route_span] = [
        s
        for s in spans.get_finished_spans()
        if s.name == "switchboard.route" and s.attributes["tool_name"] == "what_i_see"
    ]
    [target_span] = [s for s in spans.get_finished_spans() if s.name == "general/what_i_see"]
    assert target_span.parent is not None
    assert target_span.parent.span_id == route_span.context.span_id
    assert target_span.context.trace_id == route_span.context.trace_id
    assert f"{route_span.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"


async def test_what_route_itself_passes_on_does_cross(fleet: Fleet) -> None:
    """The conversation a routed message serves reaches the target (its session's `notify`
    goes there: without it a stranger's routed trigger would run as an owner's session);
    the session an approved call runs for in the caller's task (Spawner.acting_for) does
    not."""
    router = fleet.switchboard.switchboard.router
    token = ACTING_SESSION.set("a-session-of-the-switchboard")
    try:
        seen = await router.route(
            "general", "what_i_see", {}, source=RouteSource(conversation="telegram:1")
        )
    finally:
        ACTING_SESSION.reset(token)
    assert (seen["conversation"], seen["session"]) == ("telegram:1", None), seen
    assert seen["headers"] == []  # in the process, not over the wire


async def test_a_stopped_target_is_down_not_answering_with_errors(fleet: Fleet) -> None:
    """A target stopped while the switchboard runs on is no longer served in the process:
    route says it is unreachable, as for any target that went down."""
    async with Client(fleet.switchboard.sse_url) as client:
        await call(client, "route", butler_name="health", tool_name="status")
        await fleet.targets["health"].stop()
        with pytest.raises(ToolError, match="butler 'health' is unreachable"):
            await call(client, "route", butler_name="health", tool_name="status")


async def test_a_registry_row_that_points_elsewhere_still_goes_over_the_wire(
    fleet: Fleet,
) -> None:
    """Only the URLs the butlers of this process listen on are served in it: the same
    target spelled `localhost` (a proxy, another host) is called over HTTP."""
    general = fleet.targets["general"]
    write_butler_dir(
        fleet.config_dir,
        "general",
        general.port,
        extra=f'endpoint_url = "http://localhost:{general.port}/sse"\n',
    )
    async with Client(fleet.switchboard.sse_url) as client:
        await call(client, "discover")
        seen = await call(client, "route", butler_name="general", tool_name="what_i_see")
    assert "host" in seen["headers"], seen


async def test_a_slow_target_in_the_process_times_out_and_hears_the_cancellation(
    fleet: Fleet,
) -> None:
    general = fleet.targets["general"]
    assert general.mcp is not None
    cancelled = asyncio.Event()

    @general.mcp.tool
    async def dawdle() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    fleet.switchboard.switchboard.router.timeout_s = 0.5
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(ToolError, match="did not answer 'dawdle'"):
            await call(client, "route", butler_name="general", tool_name="dawdle")
        await asyncio.wait_for(cancelled.wait(), 5)
        # The connection is still good for the next call.
        assert (await call(client, "route", butler_name="general", tool_name="status"))[
            "name"
        ] == "general"


async def test_closing_the_switchboard_ends_its_in_process_sessions(fleet: Fleet) -> None:
    async with Client(fleet.switchboard.sse_url) as client:
        await call(client, "route", butler_name="general", tool_name="status")
        await call(client, "route", butler_name="health", tool_name="status")

    def serving() -> list[str]:
        return sorted(
            name
            for task in asyncio.all_tasks()
            if (name := task.get_name()).startswith("mcp:") and name.endswith(":serve")
        )

    assert len(serving()) == 2, serving()
    await fleet.switchboard.stop()
    assert serving() == []
    # The targets serve on: their own clients are untouched.
    async with Client(fleet.targets["general"].sse_url) as client:
        assert (await call(client, "status"))["name"] == "general"


async def test_a_tool_no_cancel_stops_does_not_hold_the_switchboards_stop(fleet: Fleet) -> None:
    """A sync tool runs in a thread, which no cancel stops: closing the switchboard's
    connections ends the call (its caller hears that the connection was lost) and leaves the
    thread to finish instead of waiting for it, as over the wire."""
    general = fleet.targets["general"]
    assert general.mcp is not None
    started = threading.Event()

    @general.mcp.tool
    def block() -> str:
        started.set()
        time.sleep(4)
        return "done"

    client = Client(fleet.switchboard.sse_url)
    async with client:
        call_task = asyncio.ensure_future(
            call(client, "route", butler_name="general", tool_name="block")
        )
        await asyncio.to_thread(started.wait, 10)
        # Bounded under the tool's 4 s: a close that waits for the thread fails here.
        async with asyncio.timeout(3):
            await fleet.switchboard.switchboard.connections.close()
        with pytest.raises(ToolError, match=r"lost before 'block' answered"):
            await call_task


def _record(n: int, duration_ms: int = 3) -> RouteRecord:
    return RouteRecord(
        source_channel="mcp",
        source_id=None,
        routed_to="general",
        tool_name=f"tool_{n}",
        prompt_summary=None,
        trace_id=None,
        success=True,
        error=None,
        duration_ms=duration_ms,
    )


async def test_routes_in_flight_together_share_one_write_and_a_refused_row_fails_alone(
    fleet: Fleet, db_conn
) -> None:
    store = RoutingStore(fleet.switchboard._pool)
    conn = await db_conn(fleet.switchboard.config.database)

    # Ten routes logged at once: one write (its transaction is each row's xmin).
    ids = await asyncio.gather(*(store.record_route(_record(n)) for n in range(10)))
    written = await logged(conn, list(ids))
    assert [r["tool_name"] for r in written] == [f"tool_{n}" for n in range(10)]
    assert len({r["tx"] for r in written}) == 1, written

    # duration_ms beyond PostgreSQL's integer: that row is refused, the others are written.
    results = await asyncio.gather(
        *(store.record_route(_record(n, 2**40 if n == 13 else 3)) for n in range(10, 16)),
        return_exceptions=True,
    )
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and results[3] is failed[0], results
    kept = await logged(conn, [r for r in results if isinstance(r, uuid.UUID)])
    assert [r["tool_name"] for r in kept] == ["tool_10", "tool_11", "tool_12", "tool_14", "tool_15"]


async def test_one_write_stamps_each_target_that_answered_and_no_other(
    fleet: Fleet, db_conn
) -> None:
    """A write of several rows stamps a target once however often it was routed to, and
    only if one of its routes succeeded: a failure before a success does not hide it."""
    pool = fleet.switchboard._pool
    assert pool is not None
    stamps: list[list[bool]] = []

    class StampsSeen:
        """The pool, noting which of a write's rows ask for their target's stamp ($12)."""

        async def executemany(self, query: str, rows: list[tuple[Any, ...]]) -> None:
            stamps.append([row[11] for row in rows])
            await pool.executemany(query, rows)

    store = RoutingStore(pool)
    store.pool = StampsSeen()  # type: ignore[assignment]
    conn = await db_conn(fleet.switchboard.config.database)

    async def seen() -> dict[str, Any]:
        rows = await conn.fetch("SELECT name, last_seen_at FROM butler_registry")
        return {r["name"]: r["last_seen_at"] for r in rows}

    before = await seen()
    failed = replace(_record(0), success=False, error="unreachable")
    ids = await asyncio.gather(
        store.record_route(failed),
        store.record_route(_record(1)),
        store.record_route(_record(2)),
        store.record_route(replace(_record(3), routed_to="health")),
        store.record_route(replace(failed, routed_to="switchboard")),
    )
    written = await logged(conn, list(ids))
    assert [r["tool_name"] for r in written] == [f"tool_{n}" for n in (0, 1, 2, 3, 0)]
    assert len({r["tx"] for r in written}) == 1, written  # (one write, or this proves nothing)
    assert stamps == [[False, True, False, True, False]]  # general once, health, no failure
    after = await seen()
    assert after["general"] > before["general"]
    assert after["health"] > before["health"]
    assert after["switchboard"] == before["switchboard"]


async def test_a_locked_registry_row_holds_up_no_routes_log_row(fleet: Fleet, db_conn) -> None:
    """A discover under way (or an operator's open transaction) holds a registry row: the
    routes' log rows are written anyway, that target's last_seen_at left as it was."""
    store = RoutingStore(fleet.switchboard._pool)
    conn = await db_conn(fleet.switchboard.config.database)
    locker = await db_conn(fleet.switchboard.config.database)
    before = await conn.fetchval("SELECT last_seen_at FROM butler_registry WHERE name = 'general'")
    async with locker.transaction():
        await locker.execute("SELECT 1 FROM butler_registry WHERE name = 'general' FOR UPDATE")
        # Bounded only so that a hang fails the test instead of stalling it.
        ids = await asyncio.wait_for(
            asyncio.gather(
                store.record_route(_record(1)),
                store.record_route(replace(_record(2), routed_to="health")),
            ),
            10,
        )
        assert len(await logged(conn, list(ids))) == 2
    assert (
        await conn.fetchval("SELECT last_seen_at FROM butler_registry WHERE name = 'general'")
        == before
    )
    await store.record_route(_record(3))  # unlocked: stamped again
    assert (
        await conn.fetchval("SELECT last_seen_at FROM butler_registry WHERE name = 'general'")
        > before
    )


async def test_a_route_named_with_a_lone_surrogate_is_still_recorded(fleet: Fleet, db_conn) -> None:
    """A name PostgreSQL cannot take (a lone UTF-16 surrogate, which a JSON `\\ud800`
    escape decodes to): the refusal is recorded all the same, the bad character replaced."""
    router = fleet.switchboard.switchboard.router
    with pytest.raises(RouteRefused, match="not found"):
        await router.route("gen\ud800eral", "st\udfffatus", {})
    conn = await db_conn(fleet.switchboard.config.database)
    row = await conn.fetchrow("SELECT routed_to, tool_name, success FROM routing_log")
    assert dict(row) == {"routed_to": "gen?eral", "tool_name": "st?atus", "success": False}


async def test_a_writer_stopped_mid_write_tells_every_waiting_caller(fleet: Fleet, db_conn) -> None:
    """The writer task ended from outside (its loop closing) while a batch is in flight and
    more wait: every caller hears why, none waits for ever."""
    store = RoutingStore(fleet.switchboard._pool)
    locker = await db_conn(fleet.switchboard.config.database)
    async with locker.transaction():
        # Hold the table so that the first write waits inside PostgreSQL.
        await locker.execute("LOCK TABLE routing_log IN ACCESS EXCLUSIVE MODE")
        first = [asyncio.ensure_future(store.record_route(_record(n))) for n in range(3)]
        await asyncio.sleep(0.3)  # the writer took them and waits on the lock
        later = [asyncio.ensure_future(store.record_route(_record(n))) for n in range(3, 5)]
        await asyncio.sleep(0)
        assert store._writer is not None
        store._writer.cancel()
        results = await asyncio.wait_for(asyncio.gather(*first, *later, return_exceptions=True), 10)
    assert all(isinstance(r, ButlersError) for r in results), results
    assert all("writer stopped" in str(r) for r in results), results


async def logged(conn, ids: list[uuid.UUID]) -> list[dict]:
    """The routing_log rows of `ids`, in the order written, with the transaction of each."""
    return [
        dict(r)
        for r in await conn.fetch(
            "SELECT id, tool_name, xmin::text AS tx FROM routing_log WHERE id = ANY($1)"
            " ORDER BY created_at",
            ids,
        )
    ]


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_route_cancelled_before_the_target_answered_still_leaves_its_row(
    fleet: Fleet, db_conn, cancels: int
) -> None:
    """Every call leaves one routing_log row, a caller that gave up too (a classification
    session that ended, a client that went away): the row says it was cancelled. With two
    cancels the second lands while the row is being written, and is not what stops it."""
    general = fleet.targets["general"]
    assert general.mcp is not None
    started = asyncio.Event()

    @general.mcp.tool
    async def linger() -> str:
        started.set()
        await asyncio.sleep(30)
        return "late"

    router = fleet.switchboard.switchboard.router
    routing = asyncio.create_task(router.route("general", "linger", {}))
    await asyncio.wait_for(started.wait(), 10)
    for _ in range(cancels):
        routing.cancel()
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await routing
    conn = await db_conn(fleet.switchboard.config.database)

    async def written() -> bool:
        return (
            await conn.fetchval("SELECT count(*) FROM routing_log WHERE tool_name = 'linger'") > 0
        )

    await eventually(written, 10)
    found = await conn.fetchrow("SELECT success, error FROM routing_log WHERE tool_name = 'linger'")
    assert (found["success"], found["error"]) == (False, "cancelled before the target answered")
