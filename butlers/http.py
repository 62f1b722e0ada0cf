"""A butler's HTTP surface: MCP over SSE and streamable HTTP, /health, and a bearer token.

FastMCP builds one Starlette app per transport; a butler serves both on one port, so the SSE
routes are merged into the streamable-HTTP app (whose lifespan runs the server's lifespan).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable

import uvicorn
from fastmcp import FastMCP
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SSE_PATH = "/sse"
MESSAGES_PATH = "/messages"
MCP_PATH = "/mcp"
HEALTH_PATH = "/health"
_PROTECTED_PREFIXES = (SSE_PATH, MESSAGES_PATH, MCP_PATH)


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn that leaves signal handling to the process that embeds it."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


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


class ButlerApp:
    """The ASGI app of one butler, able to end its open streams when the butler stops.

    Open SSE streams (an MCP client's session) would otherwise hold uvicorn's shutdown until
    its graceful timeout and then be cancelled with a logged traceback. `drain()` tells every
    in-flight request that its client disconnected, which ends those streams cleanly.
    """

    def __init__(
        self,
        mcp: FastMCP,
        health: Callable[[], Awaitable[tuple[int, dict]]],
        *,
        allowed_hosts: list[str] | None = None,
    ) -> None:
        # Host/Origin checks guard against DNS rebinding (a web page in the user's browser
        # driving a loopback butler); FastMCP leaves them off unless asked. The registry's
        # endpoint host (e.g. a compose service name) must pass.
        guard = {"allowed_hosts": allowed_hosts or None, "host_origin_protection": True}
        self._app: Starlette = mcp.http_app(transport="http", path=MCP_PATH, **guard)
        sse_app = mcp.http_app(transport="sse", path=SSE_PATH, **guard)
        self._app.router.routes[0:0] = [
            route
            for route in sse_app.router.routes
            if getattr(route, "path", "") in (SSE_PATH, MESSAGES_PATH)
        ]
        self._health = health
        self._draining = asyncio.Event()

    def drain(self) -> None:
        self._draining.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if scope["path"] == HEALTH_PATH:
            status, body = await self._health()
            await _json(send, status, body)
            return
        if scope["method"] == "GET":  # long-lived streams: an MCP session's SSE stream
            receive = self._until_drained(receive)
            send = _one_response(send)
        await self._app(scope, receive, send)

    def _until_drained(self, receive: Receive) -> Receive:
        async def receive_or_disconnect() -> Message:
            if self._draining.is_set():
                return {"type": "http.disconnect"}
            message = asyncio.ensure_future(receive())
            draining = asyncio.ensure_future(self._draining.wait())
            done, _ = await asyncio.wait({message, draining}, return_when=asyncio.FIRST_COMPLETED)
            if message in done:
                draining.cancel()
                return message.result()
            message.cancel()
            return {"type": "http.disconnect"}

        return receive_or_disconnect


def _one_response(send: Send) -> Send:
    """Finish the first response when the handler starts a second one, and drop the second.

    FastMCP's SSE endpoint returns an empty `Response()` after its event stream ends. When we
    end the stream (draining at shutdown), the stream's response is left unfinished and that
    second response follows: uvicorn logged "Exception in ASGI application" on every stop and
    clients saw an incomplete chunked body instead of a clean end of stream.
    """
    responses = 0
    first_complete = False

    async def send_first(message: Message) -> None:
        nonlocal responses, first_complete
        if message["type"] == "http.response.start":
            responses += 1
            if responses == 2 and not first_complete:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                first_complete = True
        if responses > 1:
            return
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            first_complete = True
        await send(message)

    return send_first


def build_app(
    mcp: FastMCP,
    health: Callable[[], Awaitable[tuple[int, dict]]],
    *,
    auth_token: str | None,
    allowed_hosts: list[str] | None = None,
) -> tuple[ASGIApp, ButlerApp]:
    """The served app (behind the bearer check when a token is set) and the app itself."""
    app = ButlerApp(mcp, health, allowed_hosts=allowed_hosts)
    return (BearerTokenMiddleware(app, auth_token) if auth_token else app), app
