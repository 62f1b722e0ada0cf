"""Local stand-ins for services that cannot run here (Anthropic, Telegram), on 127.0.0.1."""

from __future__ import annotations

from aiohttp import web


async def serve_on_loopback(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve an aiohttp app on loopback (an ephemeral port by default); runner and base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
