"""Who may look, and which form posts are the user's own.

With BUTLERS_AUTH_TOKEN set, every page needs either `Authorization: Bearer <token>` (scripts)
or the session cookie the login form sets once the token was typed. The cookie holds an HMAC
of the token, not the token: a leaked cookie opens the dashboard, not the MCP endpoints, and
changing the token ends every dashboard session. It is HttpOnly (no script reads it) and
SameSite=Strict (no other site's page sends it), Secure when the page came over HTTPS.

Without a token the switchboard listens on loopback only (butlers.http refuses anything else),
and the dashboard's pages are guarded like /health: the Host and Origin must name this
machine, so a web page in the user's browser cannot read them through DNS rebinding.

Form posts carry a CSRF token (double submit): a random value in a cookie of its own, also
SameSite=Strict, that the form repeats in a hidden field. A page on another site can send
neither. A bearer-authenticated request needs none (a browser never adds that header itself).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from starlette.requests import Request
from starlette.responses import Response

from butlers.http import secret_matches

SESSION_COOKIE = "butlers_ui"
CSRF_COOKIE = "butlers_csrf"
CSRF_FIELD = "csrf"
COOKIE_PATH = "/ui"
SESSION_MAX_AGE_S = 30 * 24 * 3600
_SESSION_PURPOSE = b"butlers dashboard session v1"


class DashboardAuth:
    def __init__(self, token: str | None) -> None:
        self.token = token
        self._session = (
            hmac.new(token.encode(), _SESSION_PURPOSE, hashlib.sha256).hexdigest()
            if token
            else None
        )

    @property
    def required(self) -> bool:
        return self.token is not None

    def bearer(self, request: Request) -> bool:
        """Whether the request carries the token as a bearer token."""
        header = request.headers.get("authorization", "")
        scheme, _, supplied = header.partition(" ")
        return scheme.lower() == "bearer" and secret_matches(supplied.strip(), self.token)

    def allows(self, request: Request) -> bool:
        if not self.required:
            return True
        return self.bearer(request) or secret_matches(
            request.cookies.get(SESSION_COOKIE), self._session
        )

    def token_matches(self, supplied: str | None) -> bool:
        return secret_matches((supplied or "").strip(), self.token)

    def start_session(self, request: Request, response: Response) -> None:
        assert self._session is not None
        response.set_cookie(
            SESSION_COOKIE,
            self._session,
            max_age=SESSION_MAX_AGE_S,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    def end_session(self, response: Response) -> None:
        response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


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


def csrf_matches(request: Request, supplied: str | None) -> bool:
    return secret_matches(supplied, request.cookies.get(CSRF_COOKIE))
