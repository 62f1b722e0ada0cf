"""The switchboard is the butler with a [switchboard] table, whatever it is called: here one in
`config/frontdoor` keeps the registry, routes, takes messages through its inbox (the real
Claude Code classifying against the scripted Messages API), sends what nobody routed to its
own `default_butler`, and refuses to route to itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from butlers.config import SwitchboardConfig, load_config_dir
from butlers.daemon import migration_branches
from tests.conftest import (
    StartButler,
    butler_config,
    free_port,
    migration_heads,
    write_butler_dir,
)
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_inbox import ask, classifier_prompt, is_classifier, model, turn


async def start_frontdoor(start_butler: StartButler, tmp_path: Path):
    """general and health, and a switchboard called frontdoor whose default_butler is health;
    its butler.toml in the config directory says the same as the config it runs with."""
    config_dir = tmp_path / "config"
    targets = {}
    for name in ("general", "health"):
        daemon = await start_butler(butler_config(name))
        write_butler_dir(config_dir, name, daemon.port, description=f"{name.title()} things.")
        targets[name] = daemon
    port = free_port()
    write_butler_dir(
        config_dir,
        "frontdoor",
        port,
        description="Front door.",
        extra='[switchboard]\ndefault_butler = "health"\n',
    )
    [config] = [b for b in load_config_dir(config_dir).butlers if b.name == "frontdoor"]
    assert config.is_switchboard and migration_branches(config) == ("core", "switchboard")
    frontdoor = await start_butler(
        butler_config(
            "frontdoor", port=port, switchboard=SwitchboardConfig(default_butler="health")
        ),
        config_dir=config_dir,
    )
    return frontdoor, targets


async def test_a_switchboard_called_frontdoor_registers_routes_and_answers(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("general", {"general": "Noted.", "health": "Logged."}))
    frontdoor, _ = await start_frontdoor(start_butler, tmp_path)
    assert frontdoor.switchboard is not None  # the inbox, route and registry are attached
    conn = await db_conn(frontdoor.config.database)
    versions = {
        r["version_num"] for r in await conn.fetch("SELECT version_num FROM alembic_version")
    }
    assert versions == migration_heads("core", "switchboard")

    async with Client(frontdoor.sse_url) as client:
        rows = (await client.call_tool("list_butlers", {})).structured_content["result"]
        assert {r["name"] for r in rows} == {"frontdoor", "general", "health"}
        status = await client.call_tool(
            "route", {"butler_name": "health", "tool_name": "status", "args": {}}
        )
        assert status.data["name"] == "health"
        with pytest.raises(ToolError, match="routing to the Switchboard is not permitted"):
            await client.call_tool(
                "route", {"butler_name": "frontdoor", "tool_name": "status", "args": {}}
            )

    answer = await ask(frontdoor, "Remember to buy milk")
    assert (answer["status"], answer["routed_to"], answer["reply"]) == ("done", "general", "Noted.")
    [first] = [b for b in scripted_api.requests if is_classifier(b) and turn(b) == 0]
    prompt = classifier_prompt(first)
    assert "general: General things." in prompt and "health: Health things." in prompt
    assert "frontdoor:" not in prompt  # the switchboard never lists itself
    assert "route it to health" in prompt  # its own default_butler

    routed = await conn.fetch("SELECT routed_to, success FROM routing_log ORDER BY created_at")
    assert [(r["routed_to"], r["success"]) for r in routed] == [
        ("health", True),
        ("frontdoor", False),
        ("general", True),
    ]


async def test_what_nobody_routes_goes_to_the_configured_default_butler(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI
) -> None:
    scripted_api.respond_with(model(None, {"health": "Health took it."}))
    frontdoor, _ = await start_frontdoor(start_butler, tmp_path)
    answer = await ask(frontdoor, "Something nobody claims")
    assert (answer["status"], answer["routed_to"]) == ("done", "health"), answer
    assert answer["reply"] == "Health took it."


async def test_after_a_rename_the_switchboards_old_name_is_not_routable(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """Registry rows are never deleted: once `config/switchboard` became `config/frontdoor`,
    the row `switchboard` still points at this very process. It is stale, it had a
    [switchboard] table and its endpoint is the switchboard's own: route refuses it, and the
    classifier is not shown it."""
    scripted_api.respond_with(model("general", {"general": "Noted."}))
    config_dir = tmp_path / "config"
    general = await start_butler(butler_config("general"))
    write_butler_dir(config_dir, "general", general.port, description="General things.")
    port = free_port()
    table = '[switchboard]\ndefault_butler = "general"\n'
    write_butler_dir(config_dir, "switchboard", port, description="Front door.", extra=table)
    before = await start_butler(butler_config("switchboard", port=port), config_dir=config_dir)
    await before.stop()

    shutil.rmtree(config_dir / "switchboard")
    write_butler_dir(config_dir, "frontdoor", port, description="Front door.", extra=table)
    frontdoor = await start_butler(
        butler_config("frontdoor", port=port, switchboard=SwitchboardConfig()),
        config_dir=config_dir,
        database=before.config.database,
    )
    async with Client(frontdoor.sse_url) as client:
        rows = {r["name"]: r for r in (await client.call_tool("list_butlers", {})).data}
        old = rows["switchboard"]
        assert (old["stale"], old["is_switchboard"]) == (True, True)
        assert (rows["frontdoor"]["stale"], rows["general"]["stale"]) == (False, False)
        with pytest.raises(ToolError, match="routing to the Switchboard is not permitted"):
            await client.call_tool("route", {"butler_name": "switchboard", "tool_name": "status"})

    answer = await ask(frontdoor, "Remember to buy milk")
    assert (answer["status"], answer["routed_to"]) == ("done", "general")
    [first] = [b for b in scripted_api.requests if is_classifier(b) and turn(b) == 0]
    listed = classifier_prompt(first).split("Available butlers: [", 1)[1].split("]", 1)[0]
    assert listed == "general: General things."
    conn = await db_conn(frontdoor.config.database)
    routed = await conn.fetch("SELECT routed_to, success FROM routing_log ORDER BY created_at")
    assert [(r["routed_to"], r["success"]) for r in routed] == [
        ("switchboard", False),
        ("general", True),
    ]
