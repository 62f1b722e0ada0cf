"""A butler's HTTP surface: MCP over SSE and streamable HTTP, /health, and a bearer token.

FastMCP builds one Starlette app per transport; a butler serves both on one port, so the SSE
routes are merged into the streamable-HTTP app (whose lifespan runs the server's lifespan).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

from fastmcp import FastMCP
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

SSE_PATH = "/sse"
MESSAGES_PATH = "/messages"
MCP_PATH = "/mcp"
HEALTH_PATH = "/health"
_PROTECTED_PREFIXES = (SSE_PATH, MESSAGES_PATH, MCP_PATH)


class BearerTokenMiddleware:
    """Require `Authorization: Bearer <token>` on every MCP endpoint (not on /health)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(supplied, self._expected):
                await _json(
                    send,
                    401,
                    {"error": "missing or wrong bearer token"},
                    extra=[(b"www-authenticate", b'Bearer realm="butlers"')],
                )
                return
        await self.app(scope, receive, send)


async def _json(send: Send, status: int, body: dict, extra: list | None = None) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def build_app(
    mcp: FastMCP,
    health: Callable[[], Awaitable[tuple[int, dict]]],
    *,
    auth_token: str | None,
    allowed_hosts: list[str] | None = None,
) -> ASGIApp:
    """One ASGI app with /sse + /messages/, /mcp and /health for one butler."""
    # Host/Origin checks guard browsers against DNS rebinding; docker service names must pass.
    app: Starlette = mcp.http_app(
        transport="http", path=MCP_PATH, allowed_hosts=allowed_hosts or None
    )
    sse_app = mcp.http_app(transport="sse", path=SSE_PATH, allowed_hosts=allowed_hosts or None)
    sse_routes = [
        route
        for route in sse_app.router.routes
        if getattr(route, "path", "") in (SSE_PATH, MESSAGES_PATH)
    ]
    app.router.routes[0:0] = sse_routes

    async def health_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        status, body = await health()
        await _json(send, status, body)

    async def root(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == HEALTH_PATH:
            await health_endpoint(scope, receive, send)
            return
        await app(scope, receive, send)

    if auth_token:
        return BearerTokenMiddleware(root, auth_token)
    return root
