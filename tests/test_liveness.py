"""Liveness and readiness: `/livez` says this process answers and never asks the database;
`/health` follows the database. A Kubernetes liveness probe on /health would restart every
pod during a database blip: here the butler's own PostgreSQL is really stopped."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from butlers.daemon import ButlerDaemon
from butlers.db import EmbeddedServer, prepare_database
from butlers.settings import Settings
from tests.conftest import butler_config, embedded_server

pytestmark = pytest.mark.pg


@pytest.fixture
async def own_server() -> AsyncIterator[EmbeddedServer]:
    """An embedded PostgreSQL of this test's own, which it may stop (the session's is shared)."""
    async with embedded_server("butlers-test-livez-") as server:
        yield server


async def _get(url: str, **headers: str) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers=headers) as response,
    ):
        return response.status, await response.json(content_type=None)


async def test_livez_stays_alive_while_the_database_is_down_and_health_does_not(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    await prepare_database(own_server, "butler_alpha", ("core",))
    daemon = ButlerDaemon(
        replace(butler_config(), db_name="butler_alpha"),
        own_server,
        data_dir=tmp_path / "data",
        settings=Settings.from_environ(),
        auth_token="a-liveness-test-token",  # both probes answer without it
        session_env={},
    )
    await daemon.start()
    try:
        assert await _get(f"{daemon.base_url}/livez") == (200, {"status": "alive", "name": "alpha"})
        status, body = await _get(f"{daemon.base_url}/health")
        assert (status, body["status"]) == (200, "ok")

        await own_server.stop()  # the database is gone: its socket, its server, its connections

        status, body = await _get(f"{daemon.base_url}/health")
        assert status == 503 and body["status"] == "degraded" and body["database"]["ok"] is False
        # Liveness: the process is fine, whatever Host a probe sends.
        for host in ("localhost", "10.1.2.3:8101"):
            assert await _get(f"{daemon.base_url}/livez", Host=host) == (
                200,
                {"status": "alive", "name": "alpha"},
            )

        await own_server.start()  # back: readiness follows by itself
        status, body = await _get(f"{daemon.base_url}/health")
        assert (status, body["status"]) == (200, "ok")
    finally:
        await daemon.stop()
