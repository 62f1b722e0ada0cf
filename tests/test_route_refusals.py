"""What `route` refuses beyond an unknown name: the switchboard under another name or address,
a front door, a stale butler, and names PostgreSQL cannot store.

Registry rows are never deleted, so an old row can point anywhere, the switchboard itself
included. Each refusal is checked through a real MCP client calling `route` over SSE on a
live switchboard, with real target butlers, and must leave its routing_log row.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from butlers.config import ButlerConfig
from butlers.errors import OUT_OF_TURNS
from butlers.switchboard.route import OwnEndpoints, _trigger_failure, unroutable
from butlers.switchboard.routing_store import RegistryTarget
from tests.conftest import StartButler, free_port, write_butler_dir
from tests.fakes.messages_api import ScriptedMessagesAPI, text
from tests.test_hostile import attacker, refusals_seen_by_the_model, route_call
from tests.test_inbox import ask, classifier_prompt, is_classifier, start_fleet, turn
from tests.test_registry import call
from tests.test_route import Fleet, make_fleet


@pytest.fixture
async def fleet(start_butler: StartButler, tmp_path: Path) -> Fleet:
    return await make_fleet(start_butler, tmp_path)


async def _log_rows(db_conn, fleet: Fleet) -> list[dict]:
    conn = await db_conn(fleet.switchboard.config.database)
    return [dict(r) for r in await conn.fetch("SELECT * FROM routing_log ORDER BY created_at, id")]


async def _refused(fleet: Fleet, butler: str, match: str) -> None:
    """route(butler, status) over SSE is refused with `match`, without any connection."""
    connects = fleet.connections.connects
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(ToolError, match=match):
            await client.call_tool("route", {"butler_name": butler, "tool_name": "status"})
    assert fleet.connections.connects == connects


async def test_a_stale_butler_is_refused_until_discover_sees_it_again(
    fleet: Fleet, db_conn, spans
) -> None:
    health_port = fleet.targets["health"].port
    shutil.rmtree(fleet.config_dir / "health")
    async with Client(fleet.switchboard.sse_url) as client:
        report = await call(client, "discover")
        rows = {r["name"]: r for r in await call(client, "list_butlers")}
    assert report["stale"] == ["health"]
    assert (rows["health"]["stale"], rows["general"]["stale"]) == (True, False)

    await _refused(fleet, "health", r"butler 'health' is stale: .*run `butlers discover`")
    [row] = await _log_rows(db_conn, fleet)
    assert (row["routed_to"], row["success"]) == ("health", False)
    assert "is stale" in row["error"] and "restore its directory" in row["error"]
    # The health butler never saw the call.
    assert not [s for s in spans.get_finished_spans() if s.name.startswith("health/")]

    # Its directory is back: the next discover makes it routable again.
    write_butler_dir(fleet.config_dir, "health", health_port)
    async with Client(fleet.switchboard.sse_url) as client:
        assert (await call(client, "discover"))["stale"] == []
        status = await call(client, "route", butler_name="health", tool_name="status")
    assert status["name"] == "health"


async def test_a_butler_registered_at_the_switchboards_own_endpoint_is_refused(
    fleet: Fleet, db_conn
) -> None:
    """Any spelling of the switchboard's own host and port, whatever the path."""
    port = fleet.switchboard.port
    spellings = {
        "mirror-a": f"http://127.0.0.1:{port}/sse",
        "mirror-b": f"http://localhost:{port}/mcp",
        "mirror-c": f"http://[::1]:{port}/sse",
        "mirror-d": f"http://LOCALHOST:{port}",
        "mirror-e": f"http://0.0.0.0:{port}/sse",
    }
    for name, url in spellings.items():
        write_butler_dir(fleet.config_dir, name, free_port(), extra=f'endpoint_url = "{url}"\n')
    async with Client(fleet.switchboard.sse_url) as client:
        report = await call(client, "discover")
    assert sorted(report["added"]) == sorted(spellings)

    for name in spellings:
        await _refused(
            fleet,
            name,
            rf"routing to the Switchboard is not permitted: butler '{name}' is "
            "registered at .*, the switchboard's own endpoint",
        )
    rows = await _log_rows(db_conn, fleet)
    assert [(r["routed_to"], r["success"]) for r in rows] == [(n, False) for n in spellings]
    assert all("the switchboard's own endpoint" in r["error"] for r in rows)


async def test_a_row_that_had_a_switchboard_table_is_refused(fleet: Fleet, db_conn) -> None:
    """What discover recorded of a butler's [switchboard] table holds whatever it is called
    now (the row of a renamed switchboard; see test_frontdoor for the whole rename)."""
    conn = await db_conn(fleet.switchboard.config.database)
    await conn.execute("UPDATE butler_registry SET is_switchboard = true WHERE name = 'health'")
    await _refused(fleet, "health", "not permitted: butler 'health' had a \\[switchboard\\] table")
    [row] = await _log_rows(db_conn, fleet)
    assert (row["routed_to"], row["success"]) == ("health", False)
    assert "[switchboard] table" in row["error"]


async def test_a_butler_with_channel_modules_is_refused(fleet: Fleet, db_conn) -> None:
    """A row whose modules include a channel (telegram, email) is a front door: one written
    before channel modules were the switchboard's alone, or by an older discover."""
    conn = await db_conn(fleet.switchboard.config.database)
    await conn.execute(
        """UPDATE butler_registry SET modules = '["email", "telegram"]'::jsonb
           WHERE name = 'health'"""
    )
    await _refused(
        fleet, "health", "butler 'health' runs the channel module\\(s\\) email, telegram"
    )
    [row] = await _log_rows(db_conn, fleet)
    assert (row["routed_to"], row["success"]) == ("health", False)
    assert "channel module(s) email, telegram" in row["error"]


async def test_a_nul_in_the_names_still_records_the_refusal(fleet: Fleet, db_conn) -> None:
    """PostgreSQL text refuses \\x00: the lookup must not be tried, and the routing_log row
    must be written without it."""
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(ToolError, match=r"butler 'heal\\x00th' not found"):
            await client.call_tool(
                "route", {"butler_name": "heal\x00th", "tool_name": "sta\x00tus"}
            )
    [row] = await _log_rows(db_conn, fleet)
    assert (row["routed_to"], row["tool_name"], row["success"]) == ("health", "status", False)
    assert row["error"].startswith("butler 'heal\\x00th' not found (list_butlers")


async def test_a_classifier_naming_a_butler_with_a_nul_is_refused_and_recorded(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """The classifier (a stranger's text) picks the name: its refusal is recorded like any
    other, and the message still reaches the default butler."""
    scripted_api.respond_with(
        attacker(
            [
                [route_call("gen\x00eral", "trigger", {"prompt": "hi\x00"})],
                [route_call("general", "trig\x00ger", {"prompt": "hi"})],
            ],
            {"general": "General here."},
        )
    )
    switchboard, _ = await start_fleet(start_butler, tmp_path, names=("general",))
    answer = await ask(switchboard, "hello")

    refusals = refusals_seen_by_the_model(scripted_api)
    assert len(refusals) == 2
    assert "'gen\\x00eral' is not a butler you can route to" in refusals[0]
    assert "butler 'gen\\x00eral' not found" in refusals[0]
    assert "not 'trig\\x00ger'" in refusals[1]
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT * FROM routing_log ORDER BY created_at, id")
    assert [(r["routed_to"], r["tool_name"], r["success"]) for r in rows] == [
        ("general", "trigger", False),
        ("general", "trigger", False),
        ("general", "trigger", True),  # the default butler, since nothing was routed
    ]
    assert [r["inbox_id"] for r in rows] == [answer["inbox_id"]] * 3
    assert rows[0]["prompt_summary"] == "hi" and "not found" in rows[0]["error"]
    assert (answer["status"], answer["reply"]) == ("done", "General here.")


def _row(name: str, endpoint_url: str, **overrides) -> RegistryTarget:
    fields = {"modules": (), "is_switchboard": False, "stale": False, **overrides}
    return RegistryTarget(name=name, endpoint_url=endpoint_url, **fields)


@pytest.mark.parametrize(
    ("endpoint_url", "own"),
    [
        ("http://switchboard:8100/sse", True),  # its registered endpoint_url (compose)
        ("http://SWITCHBOARD:8100/mcp", True),
        ("http://127.0.0.1:9100/sse", True),  # where it listens (`run --port 9100`)
        ("http://127.9.9.9:9100/sse", True),  # all of 127.0.0.0/8 is loopback
        ("http://[::ffff:127.0.0.1]:9100/sse", True),
        ("http://switchboard:8101/sse", False),
        ("http://health:8100/sse", False),
        ("http://127.0.0.1:8100/sse", False),  # not where this one listens
        ("not a url", False),
        ("http://127.0.0.1:99999/sse", False),  # no such port: not ours
    ],
)
def test_own_endpoints_are_compared_by_normalised_host_and_port(
    endpoint_url: str, own: bool
) -> None:
    config = ButlerConfig(
        name="frontdoor", port=8100, endpoint_url_override="http://switchboard:8100/sse"
    )
    endpoints = OwnEndpoints.of_switchboard(config, "http://127.0.0.1:9100/sse")
    assert endpoints.includes(endpoint_url) is own
    refusal = unroutable(_row("old", endpoint_url), switchboard_name="frontdoor", own=endpoints)
    assert (refusal is not None) is own


async def test_the_classifier_is_not_shown_stale_butlers(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI
) -> None:
    scripted_api.respond_with(attacker([[text("nothing to route")]], {"general": "ok"}))
    switchboard, _ = await start_fleet(start_butler, tmp_path)
    shutil.rmtree(tmp_path / "config" / "relationship")
    async with Client(switchboard.sse_url) as client:
        assert (await call(client, "discover"))["stale"] == ["relationship"]
    await ask(switchboard, "who is it for?")
    [first] = [b for b in scripted_api.requests if is_classifier(b) and turn(b) == 0]
    listed = classifier_prompt(first).split("Available butlers: [", 1)[1].split("]", 1)[0]
    assert "general: General things." in listed and "health: Health things." in listed
    assert "relationship" not in listed


async def test_the_switchboard_never_runs_a_routed_message_itself(fleet: Fleet) -> None:
    """Should a row reach the switchboard by an address route does not know as its own
    (127.1, its LAN address), its `trigger` still refuses a call that serves a conversation
    (what route sends)."""
    async with Client(fleet.switchboard.sse_url) as client:
        with pytest.raises(ToolError, match="not a butler messages are routed to"):
            await client.call_tool(
                "trigger", {"prompt": "list the inbox"}, meta={"butlers/conversation": "x:1"}
            )


SESSION = f"session {'0' * 8}-1234-4abc-8def-{'a' * 12}"


@pytest.mark.parametrize(
    ("tool_name", "said", "kind"),
    [
        ("trigger", f"{SESSION} failed: {OUT_OF_TURNS}: x", "out_of_turns"),
        # A model's words cannot stand first: they come after the switchboard's or Claude
        # Code's own, and another tool's error is its own.
        ("trigger", f"session 12ab failed: Claude Code session failed: {OUT_OF_TURNS}", "failed"),
        ("trigger", f"{OUT_OF_TURNS}: no session", "failed"),
        ("state_get", f"session 12ab failed: {OUT_OF_TURNS}: x", "failed"),
        ("trigger", {"text": f"session 12ab failed: {OUT_OF_TURNS}"}, "failed"),
        # Nothing done, for a reason that passes: the message may be tried again.
        ("trigger", f"{SESSION} failed before acting: the Messages API is overloaded", "busy"),
        ("trigger", "failed before acting: no session", "failed"),
        ("state_get", f"{SESSION} failed before acting: x", "failed"),
        # Its butler's own session timeout: "took too long".
        ("trigger", f"{SESSION} failed: Claude Code session timed out after 20s", "timeout"),
    ],
)
def test_only_a_triggers_own_words_say_how_its_session_failed(
    tool_name: str, said: object, kind: str
) -> None:
    assert _trigger_failure(tool_name, said).kind == kind
