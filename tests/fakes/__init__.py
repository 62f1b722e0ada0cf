"""Local stand-ins for services that cannot run here (Anthropic, Telegram), on 127.0.0.1."""

from __future__ import annotations

import asyncio

from aiohttp import web


async def wait_listening(port: int, timeout_s: float = 30) -> None:
    """Wait until something accepts connections on 127.0.0.1:port."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.1)


async def serve_on_loopback(
    app: web.Application, port: int = 0, *, cancel_on_disconnect: bool = False
) -> tuple[web.AppRunner, str]:
    """Serve an aiohttp app on loopback (an ephemeral port by default); runner and base URL.
    `cancel_on_disconnect`: a handler whose client hung up is cancelled, not left running."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel_on_disconnect)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
