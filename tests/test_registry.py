"""The switchboard's registry: tables, discover() at startup and at runtime, list_butlers()."""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

from fastmcp import Client
from fastmcp.client.transports import SSETransport

from tests.conftest import (
    StartButler,
    butler_config,
    free_port,
    migration_heads,
    write_butler_dir,
)

DESCRIPTIONS = {
    "general": "General: anything that does not clearly fit a specialist.",
    "relationship": "Relationships: people, birthdays, gifts.",
    "health": "Health: weight, meals, medication, exercise, sleep, symptoms.",
}


def make_config_dir(root: Path, ports: dict[str, int]) -> Path:
    for name, port in ports.items():
        write_butler_dir(root, name, port, description=DESCRIPTIONS.get(name, f"{name} butler"))
    return root


def _butler_names(config_dir: Path) -> list[str]:
    return sorted(d.name for d in config_dir.glob("*") if d.is_dir())


async def start_switchboard(
    start_butler: StartButler, config_dir: Path, *, default_butler: str | None = None, **kwargs
):
    """The switchboard of `config_dir`. Its butler.toml has a [switchboard] table (its
    default_butler: `default_butler`, else the first butler there) and the channel modules;
    with no other butler in the directory, neither (a default_butler must be one of them)."""
    port = free_port()
    others = [name for name in _butler_names(config_dir) if name != "switchboard"]
    default_butler = default_butler or (others[0] if others else None)
    extra = ""
    if default_butler is not None:
        extra = (
            f'[switchboard]\ndefault_butler = "{default_butler}"\n'
            "[modules.telegram]\n[modules.email]\n"
        )
    write_butler_dir(config_dir, "switchboard", port, description="Front door.", extra=extra)
    return await start_butler(
        butler_config("switchboard", port=port), config_dir=config_dir, **kwargs
    )


async def call(client: Client, tool: str, **arguments):
    result = await client.call_tool(tool, arguments)
    content = result.structured_content
    return content["result"] if content is not None and set(content) == {"result"} else content


async def _columns(conn, table: str) -> dict[str, tuple]:
    rows = await conn.fetch(
        """SELECT column_name, data_type, is_nullable, column_default
           FROM information_schema.columns WHERE table_name = $1 AND table_schema = 'public'""",
        table,
    )
    return {r["column_name"]: (r["data_type"], r["is_nullable"], r["column_default"]) for r in rows}


async def test_fresh_switchboard_database_has_spec_tables_after_core(
    start_butler: StartButler, tmp_path: Path, db_conn
) -> None:
    switchboard = await start_switchboard(start_butler, tmp_path / "config")
    conn = await db_conn(switchboard.config.database)
    registry = await _columns(conn, "butler_registry")
    assert registry == {
        "name": ("text", "NO", None),
        "endpoint_url": ("text", "NO", None),
        "description": ("text", "YES", None),
        "modules": ("jsonb", "NO", "'[]'::jsonb"),
        "last_seen_at": ("timestamp with time zone", "YES", None),
        "registered_at": ("timestamp with time zone", "NO", "now()"),
        # Beyond the spec: what route needs to refuse a stale row or a switchboard's.
        "is_switchboard": ("boolean", "NO", "false"),
        "missing_since": ("timestamp with time zone", "YES", None),
    }
    pk = await conn.fetchval(
        """SELECT a.attname FROM pg_index i JOIN pg_attribute a
           ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
           WHERE i.indrelid = 'butler_registry'::regclass AND i.indisprimary"""
    )
    assert pk == "name"
    log = await _columns(conn, "routing_log")
    spec = {
        "id": ("uuid", "NO", "gen_random_uuid()"),
        "source_channel": ("text", "NO", None),
        "source_id": ("text", "YES", None),
        "routed_to": ("text", "NO", None),
        "prompt_summary": ("text", "YES", None),
        "trace_id": ("text", "YES", None),
        "created_at": ("timestamp with time zone", "NO", "now()"),
    }
    assert {k: log[k] for k in spec} == spec
    assert {"tool_name", "success", "error", "duration_ms"} <= set(log)
    for core in ("state", "scheduled_tasks", "sessions"):
        assert await _columns(conn, core), core
    # At the head of both branches (alembic records a core head only when no switchboard
    # revision depends on it).
    versions = {r[0] for r in await conn.fetch("SELECT version_num FROM alembic_version")}
    assert versions == migration_heads("core", "switchboard")


async def test_other_butlers_do_not_get_switchboard_tables(
    start_butler: StartButler, db_conn
) -> None:
    daemon = await start_butler()
    conn = await db_conn(daemon.config.database)
    assert await conn.fetchval("SELECT to_regclass('butler_registry')") is None


async def test_startup_discovery_registers_every_butler(
    start_butler: StartButler, tmp_path: Path
) -> None:
    ports = {"general": 18101, "relationship": 18102, "health": 18103}
    config_dir = make_config_dir(tmp_path / "config", ports)
    before = datetime.now().astimezone()
    switchboard = await start_switchboard(start_butler, config_dir)
    async with Client(switchboard.sse_url) as client:
        rows = await call(client, "list_butlers")
    by_name = {row["name"]: row for row in rows}
    assert set(by_name) == {"general", "relationship", "health", "switchboard"}
    for name, port in ports.items():
        row = by_name[name]
        assert set(row) == {
            "name",
            "endpoint_url",
            "description",
            "modules",
            "last_seen_at",
            "registered_at",
            "stale",  # beyond the spec's six: what route needs to know
            "is_switchboard",
        }
        assert (row["stale"], row["is_switchboard"]) == (False, False)
        assert row["endpoint_url"] == f"http://127.0.0.1:{port}/sse"
        assert row["description"] == DESCRIPTIONS[name]
        assert row["modules"] == []
        registered = datetime.fromisoformat(row["registered_at"])
        assert registered >= before.replace(microsecond=0)
        assert datetime.fromisoformat(row["last_seen_at"]) >= registered
    assert by_name["switchboard"]["modules"] == ["telegram", "email"]
    assert by_name["switchboard"]["is_switchboard"] is True


async def test_discover_at_runtime_adds_updates_and_keeps_stale(
    start_butler: StartButler, tmp_path: Path, db_conn
) -> None:
    config_dir = make_config_dir(tmp_path / "config", {"general": 18101, "health": 18103})
    switchboard = await start_switchboard(start_butler, config_dir, default_butler="health")
    conn = await db_conn(switchboard.config.database)
    # Last seen an hour ago: whatever the clock's resolution, a discover that sees a butler
    # again must move its stamp forward.
    await conn.execute("UPDATE butler_registry SET last_seen_at = now() - interval '1 hour'")
    original = {r["name"]: dict(r) for r in await conn.fetch("SELECT * FROM butler_registry")}

    write_butler_dir(config_dir, "relationship", 18102, description="People.")  # new
    write_butler_dir(config_dir, "health", 18103, description="Health, now with sleep.")
    write_butler_dir(
        config_dir,
        "switchboard",
        switchboard.port,
        description="Front door.",
        extra='[switchboard]\ndefault_butler = "health"\n[modules.email]\n',
    )  # no Telegram any more
    shutil.rmtree(config_dir / "general")  # gone
    (config_dir / "broken").mkdir()
    (config_dir / "broken" / "butler.toml").write_text("[butler]\nname = 'broken'\n")

    async with Client(switchboard.sse_url) as client:
        report = await call(client, "discover")
        rows = {r["name"]: r for r in await call(client, "list_butlers")}

    assert report["added"] == ["relationship"]
    assert report["updated"] == [
        {"name": "health", "changed": ["description"]},
        {"name": "switchboard", "changed": ["modules"]},
    ]
    assert report["stale"] == ["general"]
    assert report["unchanged"] == []
    [error] = report["errors"]
    assert error["path"].endswith("broken/butler.toml") and error["key"] == "butler.port"

    assert rows["relationship"]["description"] == "People."
    assert rows["health"]["description"] == "Health, now with sleep."
    assert rows["switchboard"]["modules"] == ["email"]
    # The vanished butler is listed as stale; those found are not.
    assert {name: row["stale"] for name, row in rows.items()} == {
        "general": True,
        "health": False,
        "relationship": False,
        "switchboard": False,
    }
    now = {r["name"]: dict(r) for r in await conn.fetch("SELECT * FROM butler_registry")}
    # Stale: kept, last_seen_at untouched. Present: seen again; registered_at never moves.
    assert now["general"]["last_seen_at"] == original["general"]["last_seen_at"]
    assert now["health"]["last_seen_at"] > original["health"]["last_seen_at"]
    assert now["health"]["registered_at"] == original["health"]["registered_at"]
    assert "broken" not in now
    assert report["back"] == []

    # Restored, it is back: said so, since it is routed to again whether it runs or not.
    write_butler_dir(config_dir, "general", 18101, description="General.")
    async with Client(switchboard.sse_url) as client:
        again = await call(client, "discover")
    assert again["back"] == ["general"] and again["stale"] == []


async def test_changed_endpoint_is_updated(start_butler: StartButler, tmp_path: Path) -> None:
    config_dir = make_config_dir(tmp_path / "config", {"health": 18103})
    switchboard = await start_switchboard(start_butler, config_dir)
    write_butler_dir(config_dir, "health", 18103, description=DESCRIPTIONS["health"], extra="")
    toml = config_dir / "health" / "butler.toml"
    toml.write_text(
        toml.read_text().replace("[butler]", '[butler]\nendpoint_url = "http://health:8103/sse"')
    )
    async with Client(switchboard.sse_url) as client:
        report = await call(client, "discover")
        rows = {r["name"]: r for r in await call(client, "list_butlers")}
    assert report["updated"] == [{"name": "health", "changed": ["endpoint_url"]}]
    assert rows["health"]["endpoint_url"] == "http://health:8103/sse"


REGISTRY_TOKEN = "registry-test-token-4242"


@contextlib.asynccontextmanager
async def relay_to(port: int, *also: socket.socket) -> AsyncIterator[int]:
    """A process squatting a port: it answers /health with what the butler on `port` answers
    to the same question (proof and all). Its own port (it listens on the sockets `also`
    too, bound before: a reverse proxy's)."""
    from aiohttp import ClientSession, web

    async def health(request: web.Request) -> web.Response:
        async with (
            ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health?{request.query_string}") as answer,
        ):
            return web.json_response(await answer.json(), status=answer.status)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    relay = free_port()
    await web.TCPSite(runner, "127.0.0.1", relay).start()
    for bound in also:
        await web.SockSite(runner, bound).start()
    try:
        yield relay
    finally:
        await runner.cleanup()


async def test_an_endpoint_that_still_answers_is_kept_until_it_does_not(
    start_butler: StartButler, tmp_path: Path, db_conn
) -> None:
    """A switchboard whose config gives another port than where a butler runs (a replica
    started without the fleet's --port-offset) does not move the registry away from where
    the butler proves it answers; what merely answers like it (a butler of another database,
    a process relaying to the real one from a port it squats) is not kept, nor anything
    without the fleet's token; once nothing answers, discover moves it."""
    from butlers.config import Placement
    from butlers.switchboard.registry import discover

    health = await start_butler(butler_config("health"), auth_token=REGISTRY_TOKEN)
    config_dir = tmp_path / "config"

    def health_at(port: int, database: str = health.config.database) -> None:
        write_butler_dir(
            config_dir,
            "health",
            port,
            description=DESCRIPTIONS["health"],
            extra=f'[butler.db]\nname = "{database}"\n',
        )

    health_at(health.port)
    switchboard = await start_switchboard(start_butler, config_dir, auth_token=REGISTRY_TOKEN)
    conn = await db_conn(switchboard.config.database)
    elsewhere = free_port()  # nothing listens there
    moved = f"http://127.0.0.1:{elsewhere}/sse"
    bearer = {"Authorization": f"Bearer {REGISTRY_TOKEN}"}
    async with Client(SSETransport(switchboard.sse_url, headers=bearer)) as client:
        health_at(elsewhere)
        report = await call(client, "discover")
        rows = {r["name"]: r for r in await call(client, "list_butlers")}
        assert report["kept"] == [
            {"name": "health", "endpoint_url": health.sse_url, "instead_of": moved}
        ]
        assert report["updated"] == [] and rows["health"]["endpoint_url"] == health.sse_url
        routed = await call(client, "route", butler_name="health", tool_name="status")
        assert routed["name"] == "health"

        # Without the token nothing is proven: the new endpoint is taken, as before.
        assert switchboard.switchboard is not None
        store = switchboard.switchboard.routing_store
        report = await discover(store, config_dir, Placement(), None)
        assert report["kept"] == [] and report["updated"][0]["name"] == "health"

        # A process on a port the butler had, relaying the question to the real butler.
        async with relay_to(health.port) as relay:
            await conn.execute(
                "UPDATE butler_registry SET endpoint_url = $1 WHERE name = 'health'",
                f"http://127.0.0.1:{relay}/sse",
            )
            report = await call(client, "discover")
        assert report["kept"] == [] and report["updated"][0]["name"] == "health"

        health_at(health.port)  # back where it listens
        assert (await call(client, "discover"))["updated"][0]["name"] == "health"
        health_at(elsewhere, "butler_health_of_someone_else")  # another fleet's database
        report = await call(client, "discover")
        assert report["kept"] == []
        assert report["updated"] == [{"name": "health", "changed": ["endpoint_url"]}]

        health_at(health.port)
        assert (await call(client, "discover"))["updated"][0]["name"] == "health"
        health_at(elsewhere)
        await health.stop()
        report = await call(client, "discover")
        rows = {r["name"]: r for r in await call(client, "list_butlers")}
    assert report["kept"] == []
    assert report["updated"] == [{"name": "health", "changed": ["endpoint_url"]}]
    assert rows["health"]["endpoint_url"] == moved


async def test_empty_registry_lists_nothing(start_butler: StartButler, tmp_path: Path) -> None:
    config_dir = tmp_path / "empty"
    config_dir.mkdir()
    switchboard = await start_butler(butler_config("switchboard"), config_dir=config_dir)
    async with Client(switchboard.sse_url) as client:
        assert await call(client, "list_butlers") == []


async def test_a_butler_behind_a_proxy_proves_itself_for_the_proxys_port_only(
    start_butler: StartButler,
) -> None:
    """A butler reached through a reverse proxy (its registered `endpoint_url` on another
    port: docs/scaling.md) proves it holds the token for that port too, so the gateway gives
    it the token; a relay on any other port still gets no proof."""
    from dataclasses import replace

    from butlers.mcp_connection.proof import proven_health

    # The proxy's port held from the start: a port chosen, let go and bound later was taken
    # meanwhile by another test's server (CI).
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy_port = proxy.getsockname()[1]
    config = replace(
        butler_config("health"), endpoint_url_override=f"http://127.0.0.1:{proxy_port}/sse"
    )
    health = await start_butler(config, auth_token=REGISTRY_TOKEN)
    async with relay_to(health.port, proxy) as relay_port:
        for port, proven in ((health.port, True), (proxy_port, True), (relay_port, False)):
            url = f"http://127.0.0.1:{port}/sse"
            body = await proven_health(url, REGISTRY_TOKEN, "health")
            assert (body is not None) == proven, port
        assert await proven_health(health.sse_url, "another-token", "health") is None
