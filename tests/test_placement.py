"""The environment's placement (BUTLERS_ENDPOINT_URL_TEMPLATE, what docker compose sets) reaches
what the daemons read from the config directory themselves: the switchboard's registry, and the
switchboard's URL a butler's `notify` finds there."""

from __future__ import annotations

import os
from pathlib import Path

from fastmcp import Client

from butlers.settings import Settings
from tests.conftest import StartButler, butler_config, free_port, write_butler_dir


async def test_the_endpoint_template_reaches_the_registry_and_notify(
    start_butler: StartButler, tmp_path: Path
) -> None:
    settings = Settings.from_environ(
        {**os.environ, "BUTLERS_ENDPOINT_URL_TEMPLATE": "http://{name}.internal:{port}/sse"}
    )
    config_dir = tmp_path / "config"
    general_port, switchboard_port = free_port(), free_port()
    write_butler_dir(config_dir, "general", general_port)
    write_butler_dir(config_dir, "switchboard", switchboard_port, extra="[switchboard]\n")
    switchboard = await start_butler(
        butler_config("switchboard", port=switchboard_port),
        config_dir=config_dir,
        settings=settings,
    )
    async with Client(switchboard.sse_url) as client:
        rows = (await client.call_tool("list_butlers", {})).structured_content["result"]
    assert {r["name"]: r["endpoint_url"] for r in rows} == {
        "general": f"http://general.internal:{general_port}/sse",
        "switchboard": f"http://switchboard.internal:{switchboard_port}/sse",
    }
    general = await start_butler(
        butler_config("general", port=general_port), config_dir=config_dir, settings=settings
    )
    assert general.context is not None and general.context.switchboard is not None
    assert general.context.switchboard.url == f"http://switchboard.internal:{switchboard_port}/sse"
