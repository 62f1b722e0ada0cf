"""A reverse proxy on loopback shaped like nginx's usual webhook setup: it keeps the public
Host header (`proxy_set_header Host $host`), adds X-Forwarded-For / -Proto, streams the
body with chunked encoding (nginx buffers then sends Content-Length; some proxies stream)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from tests.fakes import serve_on_loopback

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length"}


class ReverseProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._client = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner, self.url = await serve_on_loopback(app)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Forwarded-For"] = request.remote or ""
        headers["X-Forwarded-Proto"] = "https"

        async def body():
            async for chunk in request.content.iter_chunked(64 * 1024):
                yield chunk

        async with self._client.request(
            request.method,
            f"{self.upstream}{request.path_qs}",
            headers=headers,  # Host included: the upstream sees the public name
            data=body() if request.body_exists else None,
        ) as upstream:
            payload = await upstream.read()
            return web.Response(
                status=upstream.status,
                body=payload,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP},
            )
