"""The HTTP surface: /health, both MCP transports, and the optional bearer token, required
everywhere but an explicit allowlist."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import uvicorn
from fastmcp import Client, FastMCP
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from butlers.http import EmbeddedUvicorn, build_app
from tests.conftest import StartButler, butler_config, free_port, log_records
from tests.fakes import wait_listening
from tests.test_cli_client import BUTLERS

TOKEN = "an-http-test-token-of-some-length"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


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

    # Plain HTTP: 401 with a clear body, on every MCP path and any other (the dashboard is
    # the switchboard's only); /health and /livez stay open.
    for protected in ("/sse", "/messages/?session_id=x", "/mcp", "/ui", "/api", "/favicon.ico"):
        status, body = await _get(f"{daemon.base_url}{protected}")
        assert status == 401, protected
        assert body == {"error": "missing or wrong bearer token"}
    status, _ = await _get(f"{daemon.base_url}/health")
    assert status == 200
    assert await _get(f"{daemon.base_url}/livez") == (200, {"status": "alive", "name": "alpha"})


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


@contextlib.asynccontextmanager
async def serving(mcp: FastMCP, **options) -> AsyncIterator[str]:
    """build_app's app (FastMCP's real transports) served by uvicorn on a loopback port; its
    base URL."""
    app, _ = build_app(mcp, _healthy, **options)
    sock = socket.create_server(("127.0.0.1", 0))
    server = EmbeddedUvicorn(uvicorn.Config(app, log_config=None, access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:  # the flag uvicorn sets once it listens
            assert not task.done(), task
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def _healthy() -> tuple[int, dict]:
    return 200, {"status": "ok"}


async def _stub(scope: Scope, receive: Receive, send: Send) -> None:
    """The dashboard's place: it checks its own sign-in (butlers.dashboard)."""
    await PlainTextResponse("dashboard")(scope, receive, send)


async def test_the_token_is_needed_everywhere_but_the_allowlist() -> None:
    """Every path needs the token except /health, /livez, the webhooks (their own secrets) and
    /ui (its own sign-in): a route FastMCP serves beyond the MCP endpoints, and any path that
    names nothing, are 401 without it (a list of protected paths served them, or said 404)."""
    mcp = FastMCP("alpha")

    @mcp.custom_route("/api/extra", methods=["GET"])
    async def extra(request: Request) -> PlainTextResponse:
        return PlainTextResponse("served")

    async def webhook(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hook")

    async with (
        serving(
            mcp,
            auth_token=TOKEN,
            webhooks=[Route("/telegram/webhook", webhook, methods=["POST"])],
            dashboard=_stub,
        ) as base,
        aiohttp.ClientSession() as http,
    ):

        async def status(method: str, path: str, **headers: str) -> int:
            async with http.request(method, base + path, headers=headers) as response:
                return response.status

        for path in ("/api/extra", "/nothing", "/", "/mcp", "/sse", "/uix", "/health/x", "/LIVEZ"):
            assert await status("GET", path) == 401, path
        assert await status("POST", "/messages/?session_id=x") == 401
        assert await status("POST", "/api/extra") == 401  # the method matters to nobody
        assert await status("GET", "/api/extra", **BEARER) == 200  # the token opens it
        assert await status("GET", "/nothing", **BEARER) == 404
        # The allowlist, without the token.
        for method, path in (
            ("GET", "/health"),
            ("GET", "/livez"),
            ("POST", "/telegram/webhook"),
            ("GET", "/ui"),
            ("GET", "/ui/messages"),
        ):
            assert await status(method, path) == 200, path
        # A WebSocket upgrade is refused too (before the handshake), whatever the path.
        for path in ("/mcp", "/nothing"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(base + path)
            assert refused.value.status == 403, path


async def test_an_mcp_path_moved_by_fastmcp_settings_still_needs_the_token(
    tmp_path: Path,
) -> None:
    """`butlers gateway --transport http` serves streamable HTTP where FastMCP's settings say:
    FASTMCP_STREAMABLE_HTTP_PATH=/api moves it off /mcp, past any list of protected paths. An
    MCP client without the token gets 401 there (it was served); with it, the tools."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "FASTMCP_"))}
    env |= {"FASTMCP_STREAMABLE_HTTP_PATH": "/api", "BUTLERS_AUTH_TOKEN": TOKEN}
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        *("gateway", "--no-butlers", "--dir", str(tmp_path), "--transport", "http"),
        *("--port", str(port)),
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_listening(port)
        base = f"http://127.0.0.1:{port}"
        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"},
            },
        }
        headers = {"Accept": "application/json, text/event-stream"}
        async with aiohttp.ClientSession() as http:
            for path in ("/api", "/mcp", "/nothing"):
                async with http.post(
                    base + path, data=json.dumps(initialize), headers=headers
                ) as response:
                    assert response.status == 401, path
        async with Client(f"{base}/api", auth=TOKEN) as client:
            assert "gateway_status" in {t.name for t in await client.list_tools()}
    finally:
        if process.returncode is None:
            process.terminate()
            async with asyncio.timeout(15):
                await process.wait()
