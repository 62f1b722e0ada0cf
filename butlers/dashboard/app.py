"""The dashboard's pages, served by the switchboard at /ui on its own port.

Server-rendered (Jinja2, autoescaped: message text is written by strangers), read-mostly,
working without JavaScript; `static/dashboard.js` only refreshes a page's content in place.
Every value a template prints passes through the process's redactor first (`finalize`), so a
secret that reached a message, a reply or an error is not shown either.

    /ui                   Fleet: each butler's health, sessions of the last 24 h, spend
    /ui/messages          the inbox, newest first (?status= ?channel= ?before=ID)
    /ui/messages/ID       one message: its routes, sessions with tool calls, reply, outbox
    /ui/routing-log       the routing log (?butler= ?outcome=ok|failed ?before=TIME; the
                          old /ui/routes redirects here: `butlers log` and routing_log_list
                          show the same rows)
    /ui/butlers/NAME      a butler: sessions, schedules (next run), state keys
    /ui/ask               a form that sends a message through classify -> route -> reply
    /ui/approvals         calls waiting for the owner's yes, with Approve / Deny
    /ui/pairing           strangers' pending codes (Approve / Deny) and paired senders (Revoke)
    /ui/login, /ui/logout the token, once (when BUTLERS_AUTH_TOKEN is set); throttled, and
                          a signed-out session ends for good (butlers.dashboard.auth)
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode
from zoneinfo import ZoneInfo

import jinja2
from fastmcp.server.http import HostOriginGuardMiddleware
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from butlers.channels import MCP_CHANNEL, channel_names
from butlers.core_store import CoreStore
from butlers.dashboard.auth import (
    CSRF_FIELD,
    DashboardAuth,
    LoginThrottle,
    client_of,
    csrf_matches,
    csrf_token,
    keep_csrf,
)
from butlers.dashboard.fleet import MEMORIES_SHOWN, STATE_KEYS_SHOWN, Answer, FleetProbe
from butlers.dashboard.store import PAGE_ROWS, DashboardStore
from butlers.memory import MAX_QUERY_CHARS
from butlers.schedule_time import wall_clock
from butlers.switchboard.approvals import ApprovalDesk
from butlers.switchboard.approvals import public as public_approval
from butlers.switchboard.operator import INBOX_STATUSES, jaeger_url
from butlers.switchboard.pairing import PairingDesk
from butlers.text import escaped_disguises
from butlers.tool_errors import ToolRefusal

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
CHANNELS = (*channel_names(), MCP_CHANNEL)
OUTCOMES = {"ok": True, "failed": False}
REFRESH_S = 10
MAX_ASK_FORM_CHARS = 20_000
MAX_APPROVALS = 100  # the approvals page: the newest this many
# ... and every pending one: expired after [approvals] timeout_hours; a butler asks at most a
# few an hour (the per-person cap), so this many is more than are ever pending.
MAX_PENDING_SHOWN = 1000
# Same-origin only, no inline script or style: an injected tag would run nothing.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    # Not "no-referrer": under it a browser sends `Origin: null` with the page's own form
    # posts, which the Host/Origin guard of a dashboard without a token refuses (every button
    # was refused in Chromium: a red team). Other sites are told nothing either way.
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
    "x-frame-options": "DENY",
}


@dataclass
class DashboardParts:
    """What the pages read and do; the switchboard's own, passed in at start."""

    store: DashboardStore
    probe: FleetProbe
    sessions: CoreStore  # the switchboard's own sessions: the classifier's
    switchboard_name: str
    ask: Callable[[str], Awaitable[dict[str, Any]]]
    jaeger_ui_url: str | None  # None: spans are not exported, a trace is an id without a link
    approvals: ApprovalDesk | None = None  # the calls waiting for the owner's yes
    pairing: PairingDesk | None = None  # strangers' codes and paired senders
    zone: str = "UTC"  # the owner's IANA zone (the switchboard's): every time is shown on it


class BadFilter(ValueError):
    """A query parameter that names nothing the page can filter by (400, named)."""


def _local(value: str | None, zone: str | None, owner_zone: str = "UTC") -> str:
    """A butler's time on its own wall clock (a schedule's next run: 08:00 where the butler
    lives), with the zone's abbreviation; on the owner's when the butler names no zone."""
    if not value or not zone:
        return _when(value, owner_zone)
    return wall_clock(value, zone) or value


def _when(value: datetime | str | None, zone: str = "UTC") -> str:
    """A stored time on the owner's wall clock, with the zone's abbreviation ("CET"): the
    owner reads the dashboard where they live, as they read the bot's messages."""
    if value is None:
        return "-"
    if isinstance(value, str):  # a butler's answer over MCP: ISO 8601
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            return value
    else:
        when = value
    if when.tzinfo is None:  # not written by us; read as UTC, as the database keeps them
        when = when.replace(tzinfo=UTC)
    return when.astimezone(ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M:%S %Z")


def _duration(ms: int | float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _money(value: float | None) -> str:
    """Dollars to four places; a cost under half a hundredth of a cent to six (shown as
    $0.0000 it read as free)."""
    if value is None:
        return "-"
    return f"${value:.6f}" if 0 < value < 0.00005 else f"${value:.4f}"


def _environment(redact: Callable[[str], str], zone: str = "UTC") -> jinja2.Environment:
    def finalize(value: Any) -> Any:
        return redact(value) if isinstance(value, str) else value

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        finalize=finalize,
        undefined=jinja2.ChainableUndefined,
    )
    environment.filters.update(
        when=functools.partial(_when, zone=zone),
        local=functools.partial(_local, owner_zone=zone),
        duration=_duration,
        money=_money,
    )
    return environment


class Dashboard:
    """The pages and their access rules, as one ASGI app (`app`) for paths under /ui."""

    def __init__(
        self,
        parts: DashboardParts,
        *,
        auth_token: str | None,
        allowed_hosts: Sequence[str] | None = None,
        redact: Callable[[str], str] = str,
    ) -> None:
        self.parts = parts
        self.auth = DashboardAuth(auth_token, parts.store)
        self.throttle = LoginThrottle()  # this process's failed sign-ins, per client
        self.templates = _environment(redact, parts.zone)
        routes = [
            Route("/ui", self.fleet),
            Route("/ui/", self.fleet),
            Route("/ui/messages", self.messages),
            Route("/ui/messages/{inbox_id:int}", self.message),
            Route("/ui/routing-log", self.routing_log),
            Route("/ui/routes", self.old_routing_log),
            Route("/ui/butlers/{name}", self.butler),
            Route("/ui/butlers/{name}/memory", self.memory, methods=["GET", "POST"]),
            Route("/ui/ask", self.ask, methods=["GET", "POST"]),
            Route("/ui/approvals", self.approvals, methods=["GET", "POST"]),
            Route("/ui/pairing", self.pairing, methods=["GET", "POST"]),
            Route("/ui/login", self.login, methods=["GET", "POST"]),
            Route("/ui/logout", self.logout, methods=["POST"]),
            Mount("/ui/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        # A mistyped address is a page of the dashboard too, with its menu, not a bare text.
        pages = Starlette(
            routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed}
        )
        guarded: ASGIApp = self._checked(pages)
        if not self.auth.required:
            # Open on loopback only: no page may be read by a rebinding web page. (With a
            # token any Host may ask, as a proxy of the owner's network forwards it: a
            # rebinding page can only guess the token, and its guesses are throttled.)
            guarded = HostOriginGuardMiddleware(guarded, allowed_hosts=allowed_hosts, mode="strict")
        self.app: ASGIApp = _with_headers(guarded)

    def _checked(self, pages: ASGIApp) -> ASGIApp:
        async def checked(scope: Scope, receive: Receive, send: Send) -> None:
            path = scope.get("path", "")
            if scope["type"] != "http" or path.startswith("/ui/static/") or path == "/ui/login":
                await pages(scope, receive, send)
                return
            request = Request(scope, receive)
            response: Response
            # A wrong bearer token is a guess like one typed into the sign-in form: counted,
            # and a client over the limit is refused before its token is compared.
            guessing = self.auth.required and "authorization" in request.headers
            retry_after = self.throttle.retry_after(client_of(request)) if guessing else None
            if retry_after is not None:
                response = Response(
                    f"too many wrong tokens from your address: try again in {retry_after} s",
                    status_code=429,
                    headers={"retry-after": str(retry_after)},
                )
                await response(scope, receive, send)
                return
            if not await self.auth.allows(request):
                if guessing:
                    self.throttle.failed(client_of(request))
                if request.method == "GET" and "authorization" not in request.headers:
                    target = request.url.path + (
                        f"?{request.url.query}" if request.url.query else ""
                    )
                    response = RedirectResponse(
                        "/ui/login?" + urlencode({"next": target}), status_code=303
                    )
                else:
                    response = Response(
                        "the dashboard needs the token (BUTLERS_AUTH_TOKEN)",
                        status_code=401,
                        headers={"www-authenticate": 'Bearer realm="butlers"'},
                    )
                await response(scope, receive, send)
                return
            if "\x00" in request.url.path or any(
                "\x00" in v for v in request.query_params.values()
            ):
                # PostgreSQL refuses NUL in text: a 500 with a traceback (a red team).
                await self._problem(request, 400, "the address holds a NUL character")(
                    scope, receive, send
                )
                return
            await pages(scope, receive, send)

        return checked

    # -- rendering ----------------------------------------------------------------------------

    def _render(
        self,
        request: Request,
        template: str,
        status_code: int = 200,
        *,
        refresh: bool = False,
        **values: Any,
    ) -> HTMLResponse:
        token, new = csrf_token(request)
        html = self.templates.get_template(template).render(
            csrf_field=CSRF_FIELD,
            csrf=token,
            signed_in=self.auth.required,
            refresh_s=REFRESH_S if refresh else 0,
            path=request.url.path,
            trace_url=self._trace_url,
            **values,
        )
        response = HTMLResponse(html, status_code=status_code)
        if new:
            keep_csrf(request, response, token)
        return response

    def _trace_url(self, trace_id: str | None) -> str | None:
        if not trace_id or self.parts.jaeger_ui_url is None:
            return None
        return jaeger_url(trace_id, self.parts.jaeger_ui_url)

    def _problem(self, request: Request, status_code: int, problem: str) -> HTMLResponse:
        return self._render(request, "problem.html", status_code, problem=problem)

    async def _not_found(self, request: Request, _exc: Exception) -> HTMLResponse:
        return self._problem(request, 404, f"there is no page {request.url.path}")

    async def _not_allowed(self, request: Request, _exc: Exception) -> HTMLResponse:
        problem = f"{request.url.path} does not take a {request.method}: open it from the menu"
        return self._problem(request, 405, problem)

    def _csrf_refused(self, request: Request) -> HTMLResponse:
        problem = "the form's CSRF token is missing or wrong: reload the page and send it again"
        return self._problem(request, 403, problem)

    # -- pages ------------------------------------------------------------------------------

    async def fleet(self, request: Request) -> Response:
        butlers = await self.parts.probe.fleet(await self.parts.store.registry())
        now = datetime.now(UTC)
        for butler in butlers:
            status: Answer | None = butler["status"]  # None: stale, not asked
            answered = status.value if status is not None else None
            butler["summary"] = answered.get("sessions_24h") if answered else None
            # The registry's stamp is the last route or discover; a butler whose /health
            # answered just now was seen now (the switchboard's own stamp never moves).
            health: Answer | None = butler["health"]
            if health is not None and health.error is None:
                butler["last_seen_at"] = now
        spent = [
            b["summary"]["cost_usd"] for b in butlers if b["summary"] and b["summary"]["cost_usd"]
        ]
        return self._render(
            request,
            "fleet.html",
            refresh=True,
            butlers=butlers,
            total_cost=sum(spent) if spent else None,
        )

    async def messages(self, request: Request) -> Response:
        try:
            status = _choice(request, "status", INBOX_STATUSES)
            channel = _choice(request, "channel", CHANNELS)
            before = _integer(request, "before")
        except BadFilter as exc:
            return self._problem(request, 400, str(exc))
        rows = await self.parts.store.messages(status=status, channel=channel, before=before)
        filters = {"status": status, "channel": channel}
        older = _older(rows, filters, before=rows[-1]["id"] if rows else None)
        return self._render(
            request,
            "messages.html",
            refresh=before is None,
            rows=rows,
            status=status,
            channel=channel,
            statuses=INBOX_STATUSES,
            channels=CHANNELS,
            older=older,
            newest=_newest(filters, paging=before is not None),
        )

    async def message(self, request: Request) -> Response:
        inbox_id = request.path_params["inbox_id"]
        # (An id past PostgreSQL's bigint is nobody's: a 500 before, a red team.)
        message = await self.parts.store.message(inbox_id) if inbox_id < 2**63 else None
        if message is None:
            return self._problem(request, 404, f"no message with id {inbox_id}")
        sessions: dict[str, Answer] = {}
        registry = {b["name"]: b["endpoint_url"] for b in await self.parts.store.registry()}
        if message["trace_id"]:
            own = await self.parts.sessions.sessions_list(
                20, trace_id=message["trace_id"], detail=True
            )
            sessions[self.parts.switchboard_name] = Answer(own)
            routed = {r["routed_to"] for r in message["routes"]} - {self.parts.switchboard_name}
            found = {name: registry[name] for name in routed if name in registry}
            sessions |= await self.parts.probe.sessions_of_trace(found, message["trace_id"])
            # A route that ran to a butler the registry no longer has; a refused one (a name
            # the classifier made up, the owner of a notify) had no session to show.
            gone = {r["routed_to"] for r in message["routes"] if r["success"]} - set(registry)
            for name in sorted(gone - {self.parts.switchboard_name}):
                sessions[name] = Answer(error="no longer registered")
        return self._render(
            request, "message.html", message=message, sessions=sessions, butlers=set(registry)
        )

    async def old_routing_log(self, request: Request) -> Response:
        """A bookmark of the page's old address (/ui/routes): the same query, its new name."""
        query = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"/ui/routing-log{query}", status_code=301)

    async def routing_log(self, request: Request) -> Response:
        try:
            butler = request.query_params.get("butler") or None
            outcome = _choice(request, "outcome", tuple(OUTCOMES))
            before = _timestamp(request, "before")
        except BadFilter as exc:
            return self._problem(request, 400, str(exc))
        rows = await self.parts.store.routes(
            butler=butler,
            success=OUTCOMES[outcome] if outcome else None,
            before=before,
        )
        last = rows[-1]["created_at"].isoformat() if rows else None
        filters = {"butler": butler, "outcome": outcome}
        older = _older(rows, filters, before=last)
        butlers = [b["name"] for b in await self.parts.store.registry()]
        return self._render(
            request,
            "routing_log.html",
            refresh=before is None,
            rows=rows,
            butler=butler,
            outcome=outcome,
            butlers=butlers,
            outcomes=tuple(OUTCOMES),
            older=older,
            newest=_newest(filters, paging=before is not None),
        )

    async def butler(self, request: Request) -> Response:
        name = request.path_params["name"]
        butler = await self.parts.store.butler(name)
        if butler is None:
            return self._problem(request, 404, f"no butler named {name!r} in the registry")
        if butler.get("stale"):  # gone from the config directory: nothing there to ask
            gone = Answer(error="stale: the last discover did not find it in the config directory")
            detail = dict.fromkeys(("health", "status", "sessions", "schedules", "state"), gone)
        else:
            detail = await self.parts.probe.butler_detail(butler["endpoint_url"])
        durations = [
            s["duration_ms"]
            for s in (detail["sessions"].value or [])
            if s.get("duration_ms") is not None
        ]
        return self._render(
            request,
            "butler.html",
            refresh=True,
            butler=butler,
            detail=detail,
            median_ms=statistics.median(durations) if durations else None,
            state_keys_shown=STATE_KEYS_SHOWN,
        )

    async def memory(self, request: Request) -> Response:
        """A butler's newest memories (`?q=`: those matching, best first), each with Forget (a
        form with the page's CSRF token, or a bearer caller): its `memory_forget`, as `butlers
        memory NAME forget ID`. A page of its own that never refreshes itself: rows moving
        under the pointer (a new session or memory above) would forget another memory."""
        name = request.path_params["name"]
        butler = await self.parts.store.butler(name)
        if butler is None:
            return self._problem(request, 404, f"no butler named {name!r} in the registry")
        if butler.get("stale"):
            return self._problem(request, 404, f"{name} is gone from the config directory")
        endpoint = butler["endpoint_url"]
        query = (request.query_params.get("q") or "").strip()[:MAX_QUERY_CHARS]
        notice = None
        if request.method == "POST":
            form = await request.form()
            if not (self.auth.bearer(request) or csrf_matches(request, _field(form, CSRF_FIELD))):
                return self._csrf_refused(request)
            try:
                memory_id = int(_field(form, "forget") or "")
            except ValueError:
                return self._problem(request, 400, "forget must be a memory's number")
            forgot = await self.parts.probe.call(endpoint, "memory_forget", {"id": memory_id})
            if forgot.error:
                return self._problem(request, 400, forgot.error)
            notice = f"Memory #{memory_id} is forgotten."
        if query:
            arguments: dict[str, Any] = {"query": query, "limit": MEMORIES_SHOWN}
            memories = await self.parts.probe.call(endpoint, "memory_search", arguments)
        else:
            memories = await self.parts.probe.call(
                endpoint, "memory_list", {"limit": MEMORIES_SHOWN}
            )
        return self._render(
            request,
            "memory.html",
            butler=butler,
            memories=memories,
            query=query,
            notice=notice,
            memories_shown=MEMORIES_SHOWN,
        )

    async def ask(self, request: Request) -> Response:
        if request.method == "GET":
            return self._render(request, "ask.html", text="", answer=None, problem=None)
        form = await request.form()
        if not (self.auth.bearer(request) or csrf_matches(request, _field(form, CSRF_FIELD))):
            return self._csrf_refused(request)
        text = _field(form, "text") or ""
        if len(text) > MAX_ASK_FORM_CHARS:
            problem = f"the text is {len(text)} characters; the form takes {MAX_ASK_FORM_CHARS}"
            return self._render(request, "ask.html", 400, text=text, answer=None, problem=problem)
        try:
            answer = await self.parts.ask(text)
        except ToolRefusal as exc:
            return self._render(request, "ask.html", 400, text=text, answer=None, problem=str(exc))
        return self._render(request, "ask.html", text="", answer=answer, problem=None)

    async def approvals(self, request: Request) -> Response:
        """The newest approvals, the pending ones with Approve / Deny (a form with its CSRF
        token, or a bearer caller); a decision is taken as the CLI's is, once."""
        desk = self.parts.approvals
        if desk is None:
            return self._problem(request, 404, "this switchboard keeps no approvals")
        notice, running = None, False
        if request.method == "POST":
            form = await request.form()
            if not (self.auth.bearer(request) or csrf_matches(request, _field(form, CSRF_FIELD))):
                return self._csrf_refused(request)
            try:
                approval_id = int(_field(form, "id") or "")
                decided = await desk.decide(
                    approval_id, _field(form, "decision") or "", by="dashboard", wait=False
                )
            except ValueError:
                return self._problem(request, 400, "id must be an approval's number")
            except ToolRefusal as exc:
                return self._problem(request, 400, str(exc))
            notice = f"Approval #{approval_id} is {decided['status']}" + (
                "." if decided["changed"] else " already: nothing changed."
            )
            # Not waited for (the page would hang on the tool): said so (it read "approved" of a
            # call that then failed).
            running = decided["changed"] and decided["status"] == "approved"
            if running:
                notice = f"Approval #{approval_id} is approved: its call runs now; this page "
                notice += "shows how it ended once it has."
        await desk.expire()
        # Every pending one, whatever came after it (one waiting behind a hundred newer ones
        # could not be decided here), then the newest.
        pending_rows, newest = await asyncio.gather(
            desk.store.newest("pending", MAX_PENDING_SHOWN), desk.store.newest(None, MAX_APPROVALS)
        )
        merged = {row["id"]: row for row in [*pending_rows, *newest]}
        rows = [public_approval(merged[i]) for i in sorted(merged, reverse=True)]
        served: dict[tuple[str | None, str | None], str] = {}  # one name lookup a conversation
        for row in rows:
            # Exactly what will run, and seen as such: nothing in them may reorder or hide
            # what follows (the Telegram question's rule).
            shown = json.dumps(row["arguments"], indent=2, ensure_ascii=False)
            row["shown"] = escaped_disguises(shown)
            # And whom it serves: a stranger's request is told from the owner's own.
            key = (row.get("conversation"), row.get("forwarded_from"))
            if key not in served:
                served[key] = await desk.whose(row)
            row["serves"] = served[key]
        # Refreshed while a call runs, but never under buttons: a new request coming in at the
        # top would move the rows, and a click meant for one could approve another.
        waiting = running or any(row["status"] == "approved" for row in rows)
        pending = any(row["status"] == "pending" for row in rows)
        return self._render(
            request,
            "approvals.html",
            refresh=waiting and not pending,
            rows=rows,
            notice=notice,
            more=len(newest) >= MAX_APPROVALS,
            shown=MAX_APPROVALS,
        )

    async def pairing(self, request: Request) -> Response:
        """Pending codes with Approve / Deny, paired senders with Revoke (forms with the
        page's CSRF token, or a bearer caller); taken as `butlers pairing` takes them (a code
        once; wrong codes count against the same limit)."""
        desk = self.parts.pairing
        if desk is None:
            return self._problem(request, 404, "this switchboard has no pairing")
        notice = None
        if request.method == "POST":
            form = await request.form()
            if not (self.auth.bearer(request) or csrf_matches(request, _field(form, CSRF_FIELD))):
                return self._csrf_refused(request)
            action = _field(form, "action") or ""
            try:
                if action == "revoke":
                    revoked = await desk.revoke(
                        _field(form, "channel") or "", _field(form, "sender") or ""
                    )
                    notice = f"{revoked['channel']} {revoked['sender']} is no longer paired."
                else:
                    decided = await desk.decide(_field(form, "code") or "", action, by="dashboard")
                    notice = f"Code {decided['code']} is {decided['status']}."
            except ToolRefusal as exc:
                return self._problem(request, 400, str(exc))
        listing = await desk.listing()
        return self._render(request, "pairing.html", listing=listing, notice=notice)

    async def login(self, request: Request) -> Response:
        target = _local_target(request.query_params.get("next"))
        if not self.auth.required:
            return RedirectResponse(target, status_code=303)
        if request.method == "GET":
            return self._render(request, "login.html", problem=None, target=target)
        client = client_of(request)
        # Before anything is read or compared: a blocked client's guesses are not even tried.
        retry_after = self.throttle.retry_after(client)
        if retry_after is not None:
            # (`next` from the form: not a guess, nothing compared.)
            target = _local_target(_field(await request.form(), "next"))
            problem = f"too many wrong tokens from your address: try again in {retry_after} s"
            refused = self._render(request, "login.html", 429, problem=problem, target=target)
            refused.headers["retry-after"] = str(retry_after)
            return refused
        form = await request.form()
        if not csrf_matches(request, _field(form, CSRF_FIELD)):
            return self._csrf_refused(request)
        target = _local_target(_field(form, "next"))  # kept for the next try (the form's)
        if not self.auth.token_matches(_field(form, "token")):
            # DEBUG: one line per guess would be a flood; LoginThrottle warns once a burst.
            logger.debug(
                "dashboard: a wrong token was typed", extra={"action": "dashboard_login_refused"}
            )
            self.throttle.failed(client)
            return self._render(
                request, "login.html", 401, problem="that is not the token", target=target
            )
        self.throttle.succeeded(client)
        response = RedirectResponse(target, status_code=303)
        self.auth.start_session(request, response)
        return response

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if not csrf_matches(request, _field(form, CSRF_FIELD)):
            return self._csrf_refused(request)
        response = RedirectResponse("/ui/login", status_code=303)
        await self.auth.end_session(request, response)
        return response


def _older(
    rows: list[dict[str, Any]], filters: dict[str, str | None], *, before: Any
) -> str | None:
    """The query string of the next, older page (the same filters), or None on a last page."""
    if len(rows) < PAGE_ROWS:
        return None
    return "?" + urlencode({k: v for k, v in filters.items() if v} | {"before": before})


def _newest(filters: dict[str, str | None], *, paging: bool) -> str | None:
    """On an older page, the query string of the first one (the same filters; "" for none);
    else None."""
    if not paging:
        return None
    query = urlencode({k: v for k, v in filters.items() if v})
    return f"?{query}" if query else ""


def _field(form: Any, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def _choice(request: Request, name: str, allowed: Sequence[str]) -> str | None:
    value = request.query_params.get(name) or None
    if value is not None and value not in allowed:
        raise BadFilter(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _integer(request: Request, name: str) -> int | None:
    value = request.query_params.get(name) or None
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 18:  # (int("²") raises)
        raise BadFilter(f"{name} must be a message id (a positive whole number), got {value!r}")
    return int(value)


def _timestamp(request: Request, name: str) -> datetime | None:
    value = request.query_params.get(name) or None
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise BadFilter(f"{name} must be an ISO 8601 time with its offset, got {value!r}") from None
    if when.tzinfo is None:
        raise BadFilter(f"{name} must be an ISO 8601 time with its offset, got {value!r}")
    try:
        return when.astimezone(UTC)
    except OverflowError:  # year 1 at +14:00, year 9999 at -14:00: a 500 before (a red team)
        raise BadFilter(f"{name} is out of range, got {value!r}") from None


def _local_target(target: str | None) -> str:
    """Where to go after login: a dashboard path only (never another site)."""
    if target and target.startswith("/ui") and not target.startswith("//") and "\\" not in target:
        return quote(target, safe="/?=&%:+-._~")
    return "/ui"


def _with_headers(app: ASGIApp) -> ASGIApp:
    extra = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def with_headers(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await app(scope, receive, send_with_headers)

    return with_headers
