"""Programs squatting ports (a stopped butler's, the switchboard's): each answers every request
with `answer` and records what it was sent (path and Authorization header), so a test can
tell whether the fleet's token reached it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.conftest import free_port


@dataclass
class Squatter:
    port: int
    heard: list[str] = field(default_factory=list)  # "<path> <Authorization or ->"

    @property
    def sse_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/sse"


@contextlib.asynccontextmanager
async def squatting(
    port: int | None = None, *, answer: dict[str, Any] | None = None, ports: int = 1
) -> AsyncIterator[list[Squatter]]:
    """`ports` squatters, the first on `port` when given (else free ports), answering `answer`
    as JSON (else 404)."""
    squatters = [
        Squatter(port if port is not None and not i else free_port()) for i in range(ports)
    ]
    runners: list[web.AppRunner] = []
    try:
        for squatter in squatters:

            async def squat(request: web.Request, heard: list[str] = squatter.heard) -> Any:
                heard.append(f"{request.path} {request.headers.get('Authorization', '-')}")
                return web.json_response(answer) if answer is not None else web.Response(status=404)

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", squat)
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", squatter.port).start()
        yield squatters
    finally:
        for runner in runners:
            await runner.cleanup()
