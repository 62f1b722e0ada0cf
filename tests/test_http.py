"""The HTTP surface: /health, both MCP transports, and the optional bearer token."""

from __future__ import annotations

import contextlib
import logging

import aiohttp
import pytest
from fastmcp import Client

from tests.conftest import StartButler, butler_config, log_records


async def _get(url: str, headers: dict | None = None) -> tuple[int, dict | str]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def test_health_reports_name_and_database(start_butler: StartButler) -> None:
    daemon = await start_butler()
    status, body = await _get(f"{daemon.base_url}/health")
    assert status == 200
    assert body["name"] == "alpha" and body["status"] == "ok" and body["database"]["ok"] is True


async def test_health_degrades_when_the_database_is_gone(
    start_butler: StartButler, pg_server
) -> None:
    import asyncpg

    daemon = await start_butler()
    database = daemon.config.database
    admin = await asyncpg.connect(pg_server.dsn("postgres"))
    try:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", database
        )
        status, body = await _get(f"{daemon.base_url}/health")
        assert status == 503
        assert body["status"] == "degraded" and body["database"]["ok"] is False
        assert body["database"]["error"]
    finally:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await admin.close()
    # Back once the database is: the pool reconnects by itself.
    status, body = await _get(f"{daemon.base_url}/health")
    assert status == 200 and body["status"] == "ok"


@pytest.mark.parametrize("path", ["/sse", "/mcp"])
async def test_auth_token_accepted_and_refused(start_butler: StartButler, path: str) -> None:
    daemon = await start_butler(auth_token="s3cret-token")
    url = f"{daemon.base_url}{path}"

    async with Client(url, auth="s3cret-token") as client:
        assert (await client.call_tool("status", {})).data["name"] == "alpha"

    for auth in (None, "wrong-token"):
        # The client's error differs per transport; the raw requests below show it is a 401.
        with pytest.raises(Exception):  # noqa: B017
            async with Client(url, auth=auth) as client:
                await client.call_tool("status", {})

    # Plain HTTP: 401 with a clear body, on every MCP path; /health stays open.
    for protected in ("/sse", "/messages/?session_id=x", "/mcp"):
        status, body = await _get(f"{daemon.base_url}{protected}")
        assert status == 401, protected
        assert body == {"error": "missing or wrong bearer token"}
    status, _ = await _get(f"{daemon.base_url}/health")
    assert status == 200


@pytest.mark.parametrize("path", ["/sse", "/mcp", "/messages/?session_id=x"])
async def test_foreign_host_header_is_refused(start_butler: StartButler, path: str) -> None:
    """DNS rebinding: a web page whose name resolves to 127.0.0.1 must not drive a butler.
    The registry's endpoint host (a compose service name here) is accepted."""
    config = butler_config(endpoint_url_override="http://alpha-svc:1234/sse")
    daemon = await start_butler(config)
    port = daemon.port

    async def status(path: str, **headers: str) -> int:
        """Only the status line: an accepted GET /sse is an endless stream."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{daemon.base_url}{path}", headers=headers) as response,
        ):
            return response.status

    assert await status(path, Host=f"evil.example:{port}") == 421
    assert await status("/health", Host=f"evil.example:{port}") == 421  # details stay local
    assert await status("/health", Host="alpha-svc:1234") == 200
    assert await status("/sse", Host=f"evil.example:{port}", Origin="http://evil.example") == 421
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "alpha-svc:1234"):
        assert await status("/sse", Host=host) == 200, host  # the SSE stream opened
    # The Origin on its own: a page served by evil.example whose request names our own Host
    # (a rebinding that got the Host right) is refused, 403 Forbidden Origin.
    good = f"127.0.0.1:{port}"
    assert await status(path, Host=good, Origin="http://evil.example") == 403
    assert await status("/health", Host=good, Origin=f"http://evil.example:{port}") == 403
    assert await status("/sse", Host=good, Origin=f"http://{good}") == 200
    async with Client(daemon.sse_url) as client:
        assert (await client.call_tool("status", {})).data["name"] == "alpha"


async def test_without_token_configured_no_auth_needed(start_butler: StartButler) -> None:
    daemon = await start_butler()
    async with Client(f"{daemon.base_url}/mcp") as client:
        assert (await client.call_tool("status", {})).data["name"] == "alpha"


async def test_stop_ends_open_mcp_sessions_promptly_and_quietly(start_butler: StartButler) -> None:
    """Open SSE and streamable-HTTP sessions are ended by stop(), not waited for: uvicorn
    would otherwise sit out its graceful-shutdown timeout, then cancel them and log an error
    (on its own logger, which does not propagate: hence log_records, not caplog)."""
    daemon = await start_butler()
    sse = Client(daemon.sse_url)
    http = Client(f"{daemon.base_url}/mcp")
    await sse.__aenter__()
    await http.__aenter__()
    try:
        await sse.call_tool("status", {})
        await http.call_tool("status", {})
        with log_records("uvicorn.error") as uvicorn_records:
            await daemon.stop()
    finally:
        for client in (sse, http):
            with contextlib.suppress(Exception):
                await client.close()
    messages = [r.getMessage() for r in uvicorn_records]
    assert "Shutting down" in messages  # (the listener did hear uvicorn's shutdown)
    assert not [m for m in messages if "graceful shutdown exceeded" in m], messages
    assert [r.getMessage() for r in uvicorn_records if r.levelno >= logging.ERROR] == []
