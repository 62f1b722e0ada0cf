"""A butler's HTTP surface: MCP over SSE and streamable HTTP, /health (readiness), /livez
(liveness), webhooks, a bearer token and a body limit.

FastMCP builds one Starlette app per transport; a butler serves both on one port, so the SSE
routes are merged into the streamable-HTTP app (whose lifespan runs the server's lifespan).

Who may reach what: when a token is set, every path needs it except an explicit allowlist
(`ButlerApp.is_public`): /health and /livez, the webhooks (each proves itself with its own
secret) and the dashboard (its own sign-in). A list of protected paths instead failed open:
any route FastMCP or a module added elsewhere was served to anyone. MCP endpoints' Host and
Origin must name this machine (a web page in the user's browser must not drive a loopback
butler through DNS rebinding); webhooks arrive through reverse proxies that keep the public
Host, so they skip that check. Listening beyond loopback without a token, or with one shorter
than MIN_TOKEN_CHARS, is refused at start. No request body may exceed the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from urllib.parse import parse_qs

import uvicorn
from fastmcp import FastMCP
from fastmcp.server.http import HostOriginGuardMiddleware
from mcp.server.transport_security import RequestBodyLimitMiddleware
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from butlers.errors import ButlersError
from butlers.mcp_connection.proof import HEALTH_PORT_PARAM, HEALTH_PROOF_PARAM
from butlers.tasks import within

logger = logging.getLogger(__name__)

SSE_PATH = "/sse"
MESSAGES_PATH = "/messages"
MCP_PATH = "/mcp"
HEALTH_PATH = "/health"  # readiness: 503 while the database is unreachable
LIVEZ_PATH = "/livez"  # liveness: this process answers; never asks the database
DASHBOARD_PATH = "/ui"
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
AUTH_TOKEN_ENV = "BUTLERS_AUTH_TOKEN"
# A token that guards a port beyond this machine (and the dashboard's sign-in form) must not
# be guessable: 24 characters of token_urlsafe are 144 bits.
MIN_TOKEN_CHARS = 24


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (a name other than localhost is
    taken to be reachable from elsewhere)."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def require_token_beyond_loopback(what: str, host: str, auth_token: str | None) -> None:
    """Listening beyond this machine without a bearer token would hand every tool (state,
    schedules, sessions, route) to anyone who can reach the port, and a short token could be
    guessed (through the dashboard's sign-in form too): refuse to start."""
    if is_loopback(host):
        return
    if not auth_token:
        raise ButlersError(
            f"{what} is set to listen on {host}, beyond this machine, without a token: set "
            f"{AUTH_TOKEN_ENV} (every MCP endpoint then requires it as a bearer token), or "
            "listen on 127.0.0.1 behind a reverse proxy"
        )
    if len(auth_token) < MIN_TOKEN_CHARS:
        raise ButlersError(
            f"{what} is set to listen on {host}, beyond this machine, and {AUTH_TOKEN_ENV} is "
            f"{len(auth_token)} characters: it needs at least {MIN_TOKEN_CHARS} (make one with "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )


def secret_matches(supplied: str | None, expected: str | None) -> bool:
    """Compare a secret from a request header with ours, in constant time, as bytes: str
    comparison fails on non-ASCII (a TypeError, i.e. a 500); a header arrives as latin-1."""
    if not expected or supplied is None:
        return False
    return hmac.compare_digest(supplied.encode("latin-1", "replace"), expected.encode())


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn that leaves signal handling to the process that embeds it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Listener:
    """A butler's HTTP server as a component (butlers.lifecycle): `open` serves `app` on the
    bound socket and returns once uvicorn listens; `close` ends the open MCP streams
    (`drain`), then serving, within `stop_timeout_s`, else cancels it."""

    def __init__(
        self,
        config: uvicorn.Config,
        sock: socket.socket,
        *,
        name: str,
        drain: Callable[[], None],
        stop_timeout_s: float,
    ) -> None:
        self.server = EmbeddedUvicorn(config)
        self._sock = sock
        self._name = name
        self._drain = drain
        self._stop_timeout_s = stop_timeout_s
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self._task = asyncio.create_task(self._serve(), name=f"butler:{self._name}:http")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what went wrong
                raise ButlersError(f"butler {self._name!r} stopped while starting")
            await asyncio.sleep(0.01)

    async def _serve(self) -> None:
        try:
            await self.server.serve(sockets=[self._sock])
        except SystemExit as exc:  # uvicorn's way of reporting a failed lifespan start-up
            raise ButlersError(f"butler {self._name!r} failed to start its app") from exc
        finally:
            self._sock.close()

    async def close(self) -> None:
        if self._task is None:
            self._sock.close()
            return
        self._drain()  # end open MCP streams so shutdown does not wait for them
        self.server.should_exit = True
        try:
            await within(asyncio.shield(self._task), self._stop_timeout_s)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        except Exception:
            logger.exception("butler %s: server ended with an error", self._name)
        self._task = None


class BearerTokenMiddleware:
    """Require `Authorization: Bearer <token>` on every path but the public ones (`public`
    says which; by default none, as for the gateway): an unknown path is 401 too, never the
    app's 404 or whatever it serves there (FastMCP's paths move with FASTMCP_* settings)."""

    def __init__(
        self, app: ASGIApp, token: str, public: Callable[[str], bool] = lambda path: False
    ) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self._public(scope["path"]):
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(supplied, self._expected):
                if scope["type"] == "websocket":  # refused before the handshake: a 403
                    await send({"type": "websocket.close", "code": 1008})
                    return
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


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: MCP messages, webhooks and `ask` alike.

    A plain Content-Length is checked before anything is read (the HTTP parser never hands over
    more than it declares): the fast path, what MCP clients send. A body without one (chunked,
    or Transfer-Encoding beside a Content-Length) is read here first, up to the limit, and
    handed on whole: the app never sees a partial body it could answer 500 to.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        *,
        trusted_bytes: int | None = None,
        trusted: Callable[[Scope], bool] = lambda scope: False,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # A bigger limit for requests `trusted` says carry the bearer token (a butler's
        # notify with files, to the switchboard): a stranger's body stays small.
        self.trusted_bytes = trusted_bytes
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length: bytes | None = None
        encoded = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                encoded = True
        if length is not None and not encoded:
            if not length.isdigit():
                await _json(send, 400, {"error": "bad Content-Length"})
            elif int(length) > self.max_bytes and int(length) > self._limit_of(scope):
                await self._too_large(send, self._limit_of(scope))
            else:
                await self.app(scope, receive, send)
            return
        if not encoded and scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)  # no body (an SSE stream's GET)
            return
        body = await self._read_body(receive, scope)
        if body is None:
            await self._too_large(send, self._limit_of(scope))
            return
        await self.app(scope, _replaying(body, receive), send)

    def _limit_of(self, scope: Scope) -> int:
        """The request's limit: asked only of a body over `max_bytes` (the common request
        pays nothing for the token's limit)."""
        if self.trusted_bytes is not None and self.trusted(scope):
            return max(self.max_bytes, self.trusted_bytes)
        return self.max_bytes

    async def _read_body(self, receive: Receive, scope: Scope) -> bytes | None:
        """The whole body, or None when it is over the limit (or the client went away)."""
        parts: list[bytes] = []
        size = 0
        limit = self.max_bytes
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                if limit != self.max_bytes or (limit := self._limit_of(scope)) < size:
                    return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, send: Send, limit: int) -> None:
        await _json(send, 413, {"error": f"request body over {limit} bytes"})


def _replaying(body: bytes, receive: Receive) -> Receive:
    """Hand the app the body read ahead, then whatever the connection says next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _lift_sdk_body_limit(route: BaseRoute, max_bytes: int) -> None:
    """The MCP SDK answers 413 to an SSE message over 4 MiB (mcp 2.3: SseServerTransport's
    RequestBodyLimitMiddleware), and FastMCP offers no way to say otherwise: a `trigger`
    carrying a message's PDF, routed over SSE, would never arrive. BodyLimitMiddleware, in
    front of the whole app, is the limit (`max_request_bytes`): the SDK's is raised to it.
    (The streamable-HTTP endpoint's session manager is made at start-up: it keeps 4 MiB.)"""
    transport = getattr(getattr(route, "app", None), "__self__", None)
    limit = getattr(transport, "_post_message_app", None)
    if isinstance(limit, RequestBodyLimitMiddleware):
        limit.max_body_size = max(limit.max_body_size, max_bytes)


class ButlerApp:
    """The ASGI app of one butler, able to end its open streams when the butler stops.

    Open SSE streams (an MCP client's connection) would otherwise hold uvicorn's shutdown until
    its graceful timeout and then be cancelled with a logged traceback. `drain()` tells every
    in-flight request that its client disconnected, which ends those streams cleanly.
    """

    def __init__(
        self,
        mcp: FastMCP,
        health: Callable[[], Awaitable[tuple[int, dict]]],
        *,
        allowed_hosts: list[str] | None = None,
        webhooks: Sequence[BaseRoute] = (),
        dashboard: ASGIApp | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        proof: Callable[[str, int | None], str | None] | None = None,
    ) -> None:
        # Host/Origin checks guard against DNS rebinding (a web page in the user's browser
        # driving a loopback butler); FastMCP leaves them off unless asked. The registry's
        # endpoint host (e.g. a compose service name) must pass.
        hosts = allowed_hosts or None
        self._app: Starlette = mcp.http_app(
            transport="http", path=MCP_PATH, allowed_hosts=hosts, host_origin_protection=True
        )
        sse_app = mcp.http_app(
            transport="sse", path=SSE_PATH, allowed_hosts=hosts, host_origin_protection=True
        )
        sse_routes = [
            route
            for route in sse_app.router.routes
            if getattr(route, "path", "") in (SSE_PATH, MESSAGES_PATH)
        ]
        for route in sse_routes:
            _lift_sdk_body_limit(route, max_request_bytes)
        self._app.router.routes[0:0] = sse_routes
        self._health = health
        self._proof = proof
        self._name = mcp.name
        # /health carries no data, yet its details (a database error, a module's host) are
        # for this machine: a page in the user's browser may not read them (DNS rebinding).
        self._guarded_health = HostOriginGuardMiddleware(
            self._serve_health, allowed_hosts=allowed_hosts, mode="strict"
        )
        self._draining = asyncio.Event()
        # Served before (and without) the Host/Origin guard: see the module docstring.
        self._webhook_paths = {getattr(route, "path", "") for route in webhooks}
        self._webhooks = Router(routes=list(webhooks))
        # The switchboard's /ui: its own token check (a cookie or the bearer token) and,
        # without a token, its own Host/Origin guard (butlers.dashboard.auth).
        self._dashboard = dashboard

    async def _serve_health(self, scope: Scope, receive: Receive, send: Send) -> None:
        status, body = await self._health()
        nonce = _query_value(scope, HEALTH_PROOF_PARAM)
        port = _query_value(scope, HEALTH_PORT_PARAM)
        if self._proof is not None and nonce is not None and _NONCE.fullmatch(nonce):
            asked_port = int(port) if port is not None and _PORT.fullmatch(port) else None
            if (proof := self._proof(nonce, asked_port)) is not None:
                body = {**body, "proof": proof}
        await _json(send, status, body)

    async def _serve_livez(self, send: Send) -> None:
        """Liveness: the event loop runs and answers. Nothing else is asked (the database
        least of all: a liveness probe that followed it would restart every pod during a
        database blip). Only the name, so no Host guard: a probe may send any Host."""
        await _json(send, 200, {"status": "alive", "name": self._name})

    def _is_dashboard(self, path: str) -> bool:
        return self._dashboard is not None and (
            path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")
        )

    def is_public(self, path: str) -> bool:
        """Whether `path` is served without the bearer token: the probes, the webhooks (their
        own secrets) and the dashboard (its own sign-in). Everything else needs it."""
        return (
            path in (HEALTH_PATH, LIVEZ_PATH)
            or path in self._webhook_paths
            or self._is_dashboard(path)
        )

    def drain(self) -> None:
        self._draining.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if scope["path"] == LIVEZ_PATH:
            await self._serve_livez(send)
            return
        if scope["path"] == HEALTH_PATH:
            await self._guarded_health(scope, receive, send)
            return
        if scope["path"] in self._webhook_paths:
            await self._webhooks(scope, receive, send)
            return
        if self._dashboard is not None and self._is_dashboard(scope["path"]):
            await self._dashboard(scope, receive, send)
            return
        if scope["method"] == "GET":  # long-lived streams: an MCP client's SSE stream
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


_NONCE = re.compile(r"[0-9a-f]{16,64}")
_PORT = re.compile(r"[0-9]{1,5}")


def _query_value(scope: Scope, name: str) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(name)
    return values[0] if values else None


def build_app(
    mcp: FastMCP,
    health: Callable[[], Awaitable[tuple[int, dict]]],
    *,
    auth_token: str | None,
    allowed_hosts: list[str] | None = None,
    webhooks: Sequence[BaseRoute] = (),
    dashboard: ASGIApp | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    token_request_bytes: int | None = None,
    health_proof: Callable[[str, int | None], str | None] | None = None,
) -> tuple[ASGIApp, ButlerApp]:
    """The served app (body limit, then the bearer check when a token is set) and the app
    itself. `token_request_bytes`: the limit for a request to a path that is not public and
    carries the token (with no token set, every such request: the butler is on loopback)."""
    app = ButlerApp(
        mcp,
        health,
        allowed_hosts=allowed_hosts,
        webhooks=webhooks,
        dashboard=dashboard,
        max_request_bytes=max(max_request_bytes, token_request_bytes or 0),
        proof=health_proof,
    )
    served: ASGIApp = (
        BearerTokenMiddleware(app, auth_token, public=app.is_public) if auth_token else app
    )
    expected = f"Bearer {auth_token}".encode() if auth_token else None

    def carries_token(scope: Scope) -> bool:
        if app.is_public(scope["path"]):
            return False
        if expected is None:
            return True
        return hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), expected)

    limited = BodyLimitMiddleware(
        served, max_request_bytes, trusted_bytes=token_request_bytes, trusted=carries_token
    )
    return limited, app
