"""Who may look, and which form posts are the user's own.

With BUTLERS_AUTH_TOKEN set, every page needs either `Authorization: Bearer <token>` (scripts)
or the session cookie the sign-in form sets once the token was typed.

The session cookie is `<id>.<issued>.<mac>`: a random session id, when it was issued (Unix
seconds) and an HMAC of both under a key derived from the token. It holds no token: a leaked
cookie opens the dashboard, not the MCP endpoints. Checking one needs no state but a single
lookup: changing the token changes the key, which ends every session at once; a cookie older
than SESSION_MAX_AGE_S is refused whatever the browser kept; signing out records the session
id in the switchboard's database (`dashboard_signed_out`, kept until the cookie would have
expired), so that cookie is refused from then on even if replayed, by every switchboard
process sharing the database (replicas) and after a restart. The cookie is HttpOnly (no
script reads it), SameSite=Strict (no other site's page sends it), and Secure when the page
came over HTTPS: directly, or through a TLS proxy whose X-Forwarded-Proto uvicorn trusts
(FORWARDED_ALLOW_IPS; unset, none: butlers.daemon).

Wrong tokens, typed into the sign-in form or sent as a bearer token to a page, are throttled
per client (`LoginThrottle`).

Without a token the switchboard listens on loopback only (butlers.http refuses anything else),
and the dashboard's pages are guarded like /health: the Host and Origin must name this
machine, so a web page in the user's browser cannot read them through DNS rebinding.

Form posts carry a CSRF token (double submit): a random value in a cookie of its own, also
SameSite=Strict, that the form repeats in a hidden field. A page on another site can send
neither; a page on another port of this machine (the same site) is refused by the browser's
Sec-Fetch-Site. A bearer-authenticated request needs none (a browser never adds that header itself).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from butlers.http import secret_matches

logger = logging.getLogger(__name__)

SESSION_COOKIE = "butlers_ui"
CSRF_COOKIE = "butlers_csrf"
CSRF_FIELD = "csrf"
COOKIE_PATH = "/ui"
SESSION_MAX_AGE_S = 30 * 24 * 3600
_SESSION_PURPOSE = b"butlers dashboard session v2"
_CLOCK_SKEW_S = 300  # a cookie "issued" this far ahead (another replica's clock) still counts
LOGIN_MAX_FAILURES = 5
LOGIN_WINDOW_S = 60.0


class SignedOutSessions(Protocol):
    """Where signed-out session ids are kept: the switchboard's database (DashboardStore)."""

    async def session_signed_out(self, session_id: str) -> bool: ...

    async def sign_out_session(self, session_id: str, expires_at: datetime) -> None: ...


@dataclass(frozen=True)
class Session:
    id: str
    issued: int  # Unix seconds

    @property
    def expires(self) -> int:
        return self.issued + SESSION_MAX_AGE_S


class DashboardAuth:
    def __init__(
        self,
        token: str | None,
        signed_out: SignedOutSessions,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.token = token
        self._signed_out = signed_out
        self._clock = clock  # wall clock: a cookie's age is compared across processes
        self._key = (
            hmac.new(token.encode(), _SESSION_PURPOSE, hashlib.sha256).digest() if token else None
        )

    @property
    def required(self) -> bool:
        return self.token is not None

    def bearer(self, request: Request) -> bool:
        """Whether the request carries the token as a bearer token."""
        header = request.headers.get("authorization", "")
        scheme, _, supplied = header.partition(" ")
        return scheme.lower() == "bearer" and secret_matches(supplied.strip(), self.token)

    async def allows(self, request: Request) -> bool:
        if not self.required:
            return True
        if self.bearer(request):
            return True
        session = self.session_of(request)
        # The database is asked only for a cookie this token signed: garbage costs nothing.
        return session is not None and not await self._signed_out.session_signed_out(session.id)

    def token_matches(self, supplied: str | None) -> bool:
        return secret_matches((supplied or "").strip(), self.token)

    def _mac(self, session_id: str, issued: int) -> str:
        assert self._key is not None
        return hmac.new(self._key, f"{session_id}.{issued}".encode(), hashlib.sha256).hexdigest()

    def session_of(self, request: Request) -> Session | None:
        """The request's session if its cookie was signed with this token and is not too
        old (signed out or not: `allows` asks that)."""
        if self._key is None:
            return None
        session_id, _, rest = (request.cookies.get(SESSION_COOKIE) or "").partition(".")
        issued_text, _, mac = rest.partition(".")
        # isascii: isdigit() is true of ² and ³ too (latin-1, so a header can carry them),
        # which int() refuses: an anonymous request would be a 500 and a logged traceback.
        if not (
            session_id
            and issued_text.isascii()
            and issued_text.isdigit()
            and len(issued_text) <= 12
        ):
            return None
        issued = int(issued_text)
        if not hmac.compare_digest(mac.encode(), self._mac(session_id, issued).encode()):
            return None
        now = self._clock()
        if not issued - _CLOCK_SKEW_S <= now < issued + SESSION_MAX_AGE_S:
            return None
        return Session(session_id, issued)

    def start_session(self, request: Request, response: Response) -> None:
        """A new session (its own id, so that signing it out ends this one only)."""
        session_id = secrets.token_urlsafe(18)
        issued = int(self._clock())
        response.set_cookie(
            SESSION_COOKIE,
            f"{session_id}.{issued}.{self._mac(session_id, issued)}",
            max_age=SESSION_MAX_AGE_S,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    async def end_session(self, request: Request, response: Response) -> None:
        """Sign the request's session out for good (every process sharing the database
        refuses its cookie from now on), and have the browser forget the cookie."""
        session = self.session_of(request)
        if session is not None:
            await self._signed_out.sign_out_session(
                session.id, datetime.fromtimestamp(session.expires, UTC)
            )
        response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


def client_of(request: Request) -> str:
    """Whom a failed sign-in is counted against: the client's address (the one a trusted
    proxy forwarded, as uvicorn's proxy headers say), an IPv6 client by its /64, which one
    host usually holds whole."""
    host = request.client.host if request.client else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host or "unknown"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


@dataclass
class _Failures:
    times: list[float]
    blocked_until: float | None = None


class LoginThrottle:
    """At most `max_failures` wrong tokens per client within `window_s`; the one that reaches
    the limit blocks that client's sign-ins (429 with Retry-After) for `window_s`, then it
    starts afresh. One warning per such burst, never one per guess.

    In memory, per process, on purpose: it bounds the noise and cost of guessing, while the
    token's length (MIN_TOKEN_CHARS beyond loopback) is what makes guessing hopeless, so
    shared state is not worth a database write per wrong guess. Two replicas allow twice the
    guesses; a restart forgets the counts. At most `max_clients` clients are remembered (the
    oldest go first) so that a flood of addresses cannot grow it without bound.
    """

    def __init__(
        self,
        max_failures: int = LOGIN_MAX_FAILURES,
        window_s: float = LOGIN_WINDOW_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._max_clients = max_clients
        self._clients: dict[str, _Failures] = {}

    def retry_after(self, client: str) -> int | None:
        """Seconds until `client` may try again, or None when it may now."""
        state = self._clients.get(client)
        if state is None or state.blocked_until is None:
            return None
        left = state.blocked_until - self._clock()
        if left <= 0:
            del self._clients[client]
            return None
        return max(1, math.ceil(left))

    def failed(self, client: str) -> None:
        now = self._clock()
        state = self._clients.pop(client, None)
        if state is None or (state.blocked_until is not None and state.blocked_until <= now):
            state = _Failures([])
        state.times = [t for t in state.times if t > now - self.window_s] + [now]
        if len(state.times) >= self.max_failures:
            state.times, state.blocked_until = [], now + self.window_s
            logger.warning(
                "dashboard: %d wrong tokens from %s within %.0f s; its sign-ins are refused "
                "for %.0f s",
                self.max_failures,
                client,
                self.window_s,
                self.window_s,
                extra={"action": "dashboard_login_throttled"},
            )
        self._clients[client] = state  # newest last: the oldest are dropped first
        while len(self._clients) > self._max_clients:
            del self._clients[next(iter(self._clients))]

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)


def csrf_token(request: Request) -> tuple[str, bool]:
    """The request's CSRF token, and whether it is new (then `keep_csrf` must set it)."""
    current = request.cookies.get(CSRF_COOKIE)
    if current and len(current) >= 32:
        return current, False
    return secrets.token_urlsafe(32), True


def keep_csrf(request: Request, response: Response, token: str) -> None:
    response.set_cookie(
        CSRF_COOKIE,
        token,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


# What a browser says of a request's origin (Fetch Metadata) that a form of ours may have:
# the same origin, or none (typed by the user). `same-site` is refused: every port of
# 127.0.0.1 is one site, so a page served on another local port could otherwise plant the
# CSRF cookie (it is not bound to a port) and post with it.
_OUR_FETCH_SITES = ("same-origin", "none")


def csrf_matches(request: Request, supplied: str | None) -> bool:
    """Whether a form post is ours: its CSRF field repeats its cookie, and a browser that
    says where the request comes from (Sec-Fetch-Site) says from this origin."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site.lower() not in _OUR_FETCH_SITES:
        return False
    return secret_matches(supplied, request.cookies.get(CSRF_COOKIE))
