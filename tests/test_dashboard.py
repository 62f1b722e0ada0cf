"""The dashboard at /ui: every page from real rows (a real switchboard and `general`, a message
through the real Claude Code path), filters, escaping of hostile text, redaction, and access:
the token once as a cookie, the bearer token, CSRF on every form.

Pages are read with Starlette's TestClient, which runs the app on an event loop of its own:
the dashboard under test is built there (`dashboard_client`), with its own pool on the
switchboard's database and its own MCP connections to the running butlers. The dashboard the
switchboard itself serves is tested over its port (the Ask form, the Host guard) and in a
real browser (tests/test_dashboard_browser.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from html import unescape
from typing import Any
from zoneinfo import ZoneInfo

import aiohttp
import pytest
from starlette.testclient import TestClient

from butlers.core_store import CoreStore
from butlers.dashboard.app import Dashboard, DashboardParts
from butlers.dashboard.fleet import STATE_KEYS_SHOWN, FleetProbe
from butlers.dashboard.store import DashboardStore
from butlers.db import create_pool
from butlers.mcp_connection.pool import McpConnections
from butlers.redact import Redactor
from butlers.tool_errors import ToolRefusal
from tests.conftest import StartButler
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_inbox import model, start_fleet
from tests.test_operator import TOKEN, Refused, call, seed_album, seed_inbox

HOSTILE = "<script>alert('pwned')</script> remind me to water the plants"
SECRET = "sekrit-4242-dashboard-value"
BEARER = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def fleet(start_butler: StartButler, tmp_path, scripted_api: ScriptedMessagesAPI):
    """A switchboard (token-protected) and `general`; the classifier routes every message
    to general, which answers with markup of its own."""
    scripted_api.respond_with(model("general", {"general": "General here: <b>done</b>."}))
    switchboard, targets = await start_fleet(
        start_butler,
        tmp_path,
        names=("general",),
        auth_token=TOKEN,
    )
    return switchboard, targets["general"]


class Pages:
    """A TestClient whose requests run in a worker thread: TestClient blocks its caller, and
    the butlers it asks run on this test's event loop."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.cookies = client.cookies

    async def get(self, path: str, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.client.get, path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.client.post, path, **kwargs)


@contextlib.asynccontextmanager
async def dashboard_client(
    pg_server, switchboard, *, token: str | None = TOKEN, redact=str, zone: str = "UTC"
) -> AsyncIterator[Pages]:
    """TestClient on a Dashboard built on TestClient's own loop, reading the switchboard's
    database and asking the running butlers; `ask` goes to the switchboard's own `ask` tool."""
    holder: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        pool = await create_pool(pg_server, switchboard.config.db_name)
        connections = McpConnections(auth_token=TOKEN)

        async def ask(text: str) -> dict[str, Any]:
            try:
                return await call(switchboard, "ask", text=text)
            except Refused as exc:  # as the switchboard's own Switchboard.ask refuses
                raise ToolRefusal(str(exc)) from exc

        parts = DashboardParts(
            store=DashboardStore.redacting(pool, redact),
            probe=FleetProbe(connections),
            sessions=CoreStore(pool),
            switchboard_name=switchboard.config.name,
            ask=ask,
            jaeger_ui_url="http://jaeger.example:16686",
            zone=zone,
        )
        holder["app"] = Dashboard(
            parts, auth_token=token, allowed_hosts=["testserver"], redact=redact
        ).app
        try:
            yield
        finally:
            await parts.probe.close()
            await connections.close()
            await pool.close()

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            async with lifespan():
                await receive()  # startup
                await send({"type": "lifespan.startup.complete"})
                await receive()  # shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        await holder["app"](scope, receive, send)

    client = TestClient(app, base_url="http://testserver", follow_redirects=False)
    await asyncio.to_thread(client.__enter__)
    try:
        yield Pages(client)
    finally:
        await asyncio.to_thread(client.__exit__, None, None, None)


def rows_of(html: str, table: str) -> list[str]:
    """The <tr> elements of the table with that id (its body), as HTML."""
    body = html.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    return re.findall(r"<tr[ >].*?</tr>", body.split("<tbody>", 1)[1], flags=re.S)


def cells(row: str) -> list[str]:
    """The text of each <td> of a table row."""
    return [" ".join(text_of(c).split()) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]


def text_of(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", " ", html))


async def answered_message(switchboard, general) -> dict[str, Any]:
    """A message through classify -> route -> reply (real Claude Code), plus a schedule and a
    state key on general for its page."""
    answer = await call(switchboard, "ask", text=f"{HOSTILE} {SECRET}")
    assert answer["status"] == "done" and answer["routed_to"] == "general", answer
    await call(general, "state_set", key="plants/last_watered", value={"when": "monday"})
    await call(general, "schedule_create", name="water", cron="0 8 * * 1", prompt="Water them")
    return answer


async def test_every_page_shows_real_rows_filters_and_escapes_hostile_text(
    fleet, pg_server, db_conn
) -> None:
    switchboard, general = fleet
    answer = await answered_message(switchboard, general)
    conn = await db_conn(switchboard.config.db_name)
    failed = await seed_inbox(
        conn,
        external_id="t-9",
        source_id="555",
        sender_name="The Owner",  # what a stranger may call themselves
        text="never mind",
        status="failed",
        error="butler 'health' is down <img src=x onerror=alert(1)>",
    )
    mail = await seed_inbox(
        conn,
        channel="email",
        external_id="m-1",
        source_id="a@example.com",
        text="Subject line body",
        status="done",
        routed_to="general",
        reply="Done by mail.",
        meta={"attachments": [{"name": "scan <1>.pdf", "kind": "pdf"}]},
    )
    await conn.execute(
        """INSERT INTO routing_log (source_channel, routed_to, tool_name, success, error,
                                    duration_ms, inbox_id)
           VALUES ('telegram', 'health', 'trigger', false, 'connection refused', 12, $1)""",
        failed,
    )
    # A butler that is registered but down (nothing listens on its port).
    await conn.execute(
        """INSERT INTO butler_registry (name, endpoint_url, description)
           VALUES ('gone', 'http://127.0.0.1:9/sse', 'Down for good.')"""
    )
    # One whose directory went (discover marked it stale): said so, not asked.
    await conn.execute(
        """INSERT INTO butler_registry (name, endpoint_url, description, missing_since)
           VALUES ('removed', 'http://127.0.0.1:9/sse', 'Its directory went.', now())"""
    )
    # Stamps of long ago: a butler that answers is seen now; one that does not keeps its own.
    await conn.execute(
        "UPDATE butler_registry SET last_seen_at = '2020-01-02T03:04:05+00' "
        "WHERE name IN ('switchboard', 'gone')"
    )
    # A secret across the cut of the list's one line (120 characters): none of it shown.
    straddled = await seed_inbox(
        conn,
        external_id="t-10",
        source_id="556",
        text=("pad " * 26) + SECRET + " and more",
        status="done",
    )
    redactor = Redactor([SECRET])

    async with dashboard_client(pg_server, switchboard, redact=redactor) as client:
        # Fleet: both butlers, live, with general's session of the last 24 h and its cost.
        page = await client.get("/ui", headers=BEARER)
        assert page.status_code == 200, page.text
        fleet_rows = {
            re.search(r'data-butler="([^"]+)"', r)[1]: r for r in rows_of(page.text, "fleet")
        }
        assert set(fleet_rows) == {"general", "gone", "removed", "switchboard"}
        assert "unreachable" in text_of(fleet_rows["gone"])  # shown, holding up nobody
        assert "2020-01-02 03:04:05 UTC" in text_of(fleet_rows["gone"])
        assert "2020-01-02" not in text_of(fleet_rows["switchboard"])
        removed = text_of(fleet_rows["removed"])
        assert " ".join(removed.split()).startswith(
            "removed Its directory went. stale not in the config directory"
        )
        assert "unreachable" not in removed
        page = await client.get("/ui/butlers/removed", headers=BEARER)  # its own page too
        assert page.status_code == 200, page.text
        assert "stale: the last discover" in page.text and "unreachable" not in page.text
        general_row = text_of(fleet_rows["general"])
        assert " ok " in f" {general_row} " and general.sse_url in general_row
        assert re.search(r'class="sessions">1<', fleet_rows["general"]), fleet_rows["general"]
        assert re.search(
            r'class="cost">\$0\.\d{4,6}<', fleet_rows["general"]
        )  # Claude Code's figure
        assert 'class="cost">$0.0000<' not in fleet_rows["general"]  # a tiny cost is not free
        assert re.search(r'class="sessions">1<', fleet_rows["switchboard"])  # the classifier

        # Messages: newest first; the hostile text escaped, the secret redacted.
        page = await client.get("/ui/messages", headers=BEARER)
        assert page.status_code == 200
        ids = [int(i) for i in re.findall(r'<tr data-id="(\d+)"', page.text)]
        assert ids == sorted([answer["inbox_id"], failed, mail, straddled], reverse=True)
        assert "<script>alert" not in page.text and "<img src=x" not in page.text
        # A name is what a sender calls themselves: who they are (their id) is beside it.
        [named] = [r for r in rows_of(page.text, "messages") if f'data-id="{failed}"' in r]
        assert "<bdi>The Owner</bdi> (555)" in named  # isolated: no bidi trick flips the id
        assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in page.text
        assert SECRET not in page.text and "[redacted]" in page.text
        [cut] = [r for r in rows_of(page.text, "messages") if f'data-id="{straddled}"' in r]
        assert SECRET[:6] not in cut and "[redacted]" in cut, cut
        asked = next(
            r for r in rows_of(page.text, "messages") if f'data-id="{answer["inbox_id"]}"' in r
        )
        assert "claude" in asked and "general" in asked and "General here: &lt;b&gt;done" in asked
        assert re.search(r'href="http://jaeger\.example:16686/trace/[0-9a-f]{32}"', asked)

        failed_only = (await client.get("/ui/messages?status=failed", headers=BEARER)).text
        assert re.findall(r'<tr data-id="(\d+)"', failed_only) == [str(failed)]
        assert "health&#39; is down &lt;img" in failed_only
        by_mail = (await client.get("/ui/messages?channel=email", headers=BEARER)).text
        assert re.findall(r'<tr data-id="(\d+)"', by_mail) == [str(mail)]
        assert '<div class="note">files: scan &lt;1&gt;.pdf</div>' in by_mail
        one = (await client.get(f"/ui/messages/{mail}", headers=BEARER)).text
        assert 'id="message-files">Files: scan &lt;1&gt;.pdf</p>' in one
        older = (await client.get(f"/ui/messages?before={failed}", headers=BEARER)).text
        assert re.findall(r'<tr data-id="(\d+)"', older) == [str(answer["inbox_id"])]
        for bad, named in (
            (
                "status=lost",
                "status must be one of queued, processing, done, failed, skipped, "
                "got &#39;lost&#39;",
            ),
            ("channel=fax", "channel must be one of telegram, email, mcp"),
            ("before=12abc", "before must be a message id"),
            ("before=%C2%B2", "before must be a message id"),  # "²" is a digit to isdigit()
        ):
            refused = await client.get(f"/ui/messages?{bad}", headers=BEARER)
            assert refused.status_code == 400 and named in refused.text, refused.text

        # One message: its route, both sessions of its trace with their tool calls, the reply.
        page = await client.get(f"/ui/messages/{answer['inbox_id']}", headers=BEARER)
        assert page.status_code == 200
        html = page.text
        assert "&lt;script&gt;" in html and "<script>alert" not in html
        assert [cells(r)[1] for r in rows_of(html, "routes")] == ["general"]
        sections = dict(
            re.findall(
                r'<section class="sessions" data-butler="([^"]+)">(.*?)</section>', html, re.S
            )
        )
        assert set(sections) == {"switchboard", "general"}
        assert "mcp__switchboard__route" in sections["switchboard"]  # the classifier's call
        assert "General here: &lt;b&gt;done" in sections["general"]  # general's result
        assert re.search(r"\$0\.\d{4}", sections["general"])
        assert 'id="message-reply">General here: &lt;b&gt;done' in html
        assert (await client.get("/ui/messages/999999", headers=BEARER)).status_code == 404
        # What it came to before `butlers retry` queued it again (kept in its meta).
        await conn.execute(
            """UPDATE inbox SET meta = jsonb_set(meta, '{retries}', jsonb_build_array(
                   jsonb_build_object('retried_at', '2026-11-27T10:00:00+00:00',
                                      'status', 'failed', 'error', 'health was <b>down</b>',
                                      'attempts', 1)))
               WHERE id = $1""",
            failed,
        )
        page = (await client.get(f"/ui/messages/{failed}", headers=BEARER)).text
        assert "<dt>Before retry 1</dt>" in page
        assert "telegram · <bdi>The Owner</bdi> (555)" in page
        # Its refused route to a butler that is not registered: no sessions section, no link.
        assert 'data-butler="health"' not in page and 'href="/ui/butlers/health"' not in page
        assert "failed (attempts 1): health was &lt;b&gt;down&lt;/b&gt;; retried 2026-11-27" in page
        # A mistyped address: the dashboard's own page, with its menu, saying which.
        for address in ("/ui/messages/abc", "/ui/nosuch", "/ui/static/nosuch.css"):
            missing = await client.get(address, headers=BEARER)
            assert missing.status_code == 404, address
            assert f"there is no page {address}" in missing.text, missing.text
            assert 'href="/ui/messages"' in missing.text  # the menu
        wrong = await client.post("/ui/messages", headers=BEARER)
        assert wrong.status_code == 405 and "/ui/messages does not take a POST" in wrong.text

        # Routing log: by butler and by outcome.
        page = (await client.get("/ui/routing-log?butler=general&outcome=ok", headers=BEARER)).text
        assert [cells(r)[2] for r in rows_of(page, "routing-log")] == ["general"]
        page = (await client.get("/ui/routing-log?outcome=failed", headers=BEARER)).text
        [row] = rows_of(page, "routing-log")
        assert "health" in row and "connection refused" in row and f"/ui/messages/{failed}" in row
        # A name the registry does not have is no link (its page would be a 404).
        assert 'href="/ui/butlers/health"' not in page
        page = (await client.get("/ui/routing-log", headers=BEARER)).text
        assert 'href="/ui/butlers/general"' in page and 'href="/ui/butlers/health"' not in page
        refused = await client.get("/ui/routing-log?before=yesterday", headers=BEARER)
        assert refused.status_code == 400 and "before must be an ISO 8601 time" in refused.text
        # What PostgreSQL cannot take is a clear answer, not a 500 (a red team).
        for address, status, said in (
            ("/ui/routing-log?before=0001-01-01T00:00:00%2B14:00", 400, "before is out of range"),
            ("/ui/routing-log?before=9999-12-31T23:59:59-14:00", 400, "before is out of range"),
            ("/ui/routing-log?butler=%00", 400, "the address holds a NUL character"),
            ("/ui/butlers/%00", 400, "the address holds a NUL character"),
            ("/ui/butlers/a%00/memory", 400, "the address holds a NUL character"),
            ("/ui/messages/99999999999999999999", 404, "no message with id 99999999999999999999"),
        ):
            odd = await client.get(address, headers=BEARER)
            assert (odd.status_code, said in odd.text) == (status, True), (address, odd.text)
        # Its old address (a bookmark) leads to the same page, query kept.
        moved = await client.get("/ui/routes?outcome=failed", headers=BEARER)
        assert moved.status_code == 301
        assert moved.headers["location"] == "/ui/routing-log?outcome=failed"

        # A butler's page: its session (prompt, result, tool calls), schedule, state keys.
        page = (await client.get("/ui/butlers/general", headers=BEARER)).text
        assert "&lt;script&gt;alert" in page and "General here: &lt;b&gt;done" in page
        [schedule] = rows_of(page, "schedules")
        assert "water" in schedule and "0 8 * * 1" in schedule and "UTC" in schedule
        assert [cells(r)[0] for r in rows_of(page, "state")] == ["plants/last_watered"]
        assert "monday" not in page  # keys only: a value may be anything the person said
        assert (await client.get("/ui/butlers/nobody", headers=BEARER)).status_code == 404

        # Paging: 50 a page, then a link to the older ones with the same filter.
        await conn.execute(
            """INSERT INTO inbox (channel, external_id, text, status)
               SELECT 'email', 'bulk-' || n, 'bulk ' || n, 'done' FROM generate_series(1, 60) n"""
        )
        first = (await client.get("/ui/messages?channel=email", headers=BEARER)).text
        shown = re.findall(r'<tr data-id="(\d+)"', first)
        link = re.search(r'href="/ui/messages(\?[^"]+)" rel="next"', first)[1]
        assert len(shown) == 50 and unescape(link) == f"?channel=email&before={shown[-1]}"
        rest = (await client.get("/ui/messages" + unescape(link), headers=BEARER)).text
        older_ids = re.findall(r'<tr data-id="(\d+)"', rest)
        assert len(older_ids) == 11 and str(mail) in older_ids and 'rel="next"' not in rest
        # An older page leads back to the newest, the filter kept; the newest page does not.
        assert 'href="/ui/messages?channel=email" rel="first"' in rest
        assert 'rel="first"' not in first
        assert (
            'href="/ui/routing-log" rel="first"'
            in (
                await client.get(
                    "/ui/routing-log?before=2026-01-01T00:00:00%2B00:00", headers=BEARER
                )
            ).text
        )

    # Times are on the owner's clock, with the zone's abbreviation.
    async with dashboard_client(pg_server, switchboard, zone="Asia/Tokyo") as client:
        page = (await client.get(f"/ui/messages/{failed}", headers=BEARER)).text
        received = re.search(r"<dt>Received</dt><dd>([^;<]+);", page)[1]
        stored = await conn.fetchval("SELECT received_at FROM inbox WHERE id = $1", failed)
        tokyo = stored.astimezone(ZoneInfo("Asia/Tokyo"))
        assert received == tokyo.strftime("%Y-%m-%d %H:%M:%S JST"), received
        assert "retried 2026-11-27 19:00:00 JST" in page  # 10:00 UTC


async def test_without_the_token_no_page_shows_data_and_forms_need_their_csrf_token(
    fleet, pg_server, db_conn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    switchboard, general = fleet
    answer = await answered_message(switchboard, general)
    conn = await db_conn(switchboard.config.db_name)
    inbox_rows = await conn.fetchval("SELECT count(*) FROM inbox")

    async with dashboard_client(pg_server, switchboard) as client:
        for path in (
            "/ui",
            "/ui/messages",
            f"/ui/messages/{answer['inbox_id']}",
            "/ui/routing-log",
            "/ui/butlers/general",
            "/ui/butlers/general/memory",
            "/ui/ask",
        ):
            page = await client.get(path)
            assert page.status_code == 303, (path, page.status_code)
            assert page.headers["location"].startswith("/ui/login?next=")
            assert "plants" not in page.text and "general" not in page.text
        wrong = await client.get("/ui/messages", headers={"authorization": "Bearer not-it"})
        assert wrong.status_code == 401 and "water" not in wrong.text
        assert (await client.post("/ui/ask", data={"text": "hi"})).status_code == 401
        # The static files carry nothing and need nothing.
        assert (await client.get("/ui/static/dashboard.css")).status_code == 200

        # The login form: a CSRF cookie, HttpOnly and SameSite=Strict, and its field.
        page = await client.get("/ui/login?next=/ui/messages")
        assert page.status_code == 200
        csrf_cookie = page.headers["set-cookie"]
        assert "butlers_csrf=" in csrf_cookie and "HttpOnly" in csrf_cookie
        assert "SameSite=strict" in csrf_cookie and "Path=/ui" in csrf_cookie
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)[1]
        assert client.cookies.get("butlers_csrf") == csrf

        refused = await client.post("/ui/login", data={"token": TOKEN, "next": "/ui/messages"})
        assert refused.status_code == 403 and "CSRF" in refused.text  # no field, no session
        assert "butlers_ui" not in refused.headers.get("set-cookie", "")
        wrong = await client.post("/ui/login", data={"token": "guess", "csrf": csrf, "next": "/ui"})
        assert wrong.status_code == 401 and "that is not the token" in wrong.text
        # Another site is never where a login sends you.
        signed = await client.post(
            "/ui/login", data={"token": TOKEN, "csrf": csrf, "next": "//evil.example/ui"}
        )
        assert signed.status_code == 303 and signed.headers["location"] == "/ui"
        session_cookie = signed.headers["set-cookie"]
        assert session_cookie.startswith("butlers_ui=") and TOKEN not in session_cookie
        for flag in ("HttpOnly", "SameSite=strict", "Path=/ui", "Max-Age="):
            assert flag in session_cookie, session_cookie
        assert "Secure" not in session_cookie  # plain HTTP here; set over HTTPS

        page = await client.get("/ui/messages")  # the cookie, no header
        assert page.status_code == 200 and f'data-id="{answer["inbox_id"]}"' in page.text
        for header, value in {
            "content-security-policy": "script-src 'self'",
            "x-content-type-options": "nosniff",
            "x-frame-options": "DENY",
            "cache-control": "no-store",
        }.items():
            assert value in page.headers[header]

        # The Ask form without its CSRF field, or with another one: refused, nothing queued.
        for data in ({"text": "hello"}, {"text": "hello", "csrf": "x" * 43}):
            refused = await client.post("/ui/ask", data=data)
            assert refused.status_code == 403 and "CSRF token is missing or wrong" in refused.text
        assert await conn.fetchval("SELECT count(*) FROM inbox") == inbox_rows
        # An empty text is refused by name.
        empty = await client.post("/ui/ask", data={"text": "  ", "csrf": csrf})
        assert empty.status_code == 400 and "text must not be empty" in empty.text
        # A script with the bearer token needs no CSRF field.
        asked = await client.post("/ui/ask", data={"text": "what now?"}, headers=BEARER)
        assert asked.status_code == 200 and 'id="answer-reply">General here' in asked.text

        out = await client.post("/ui/logout", data={"csrf": csrf})
        assert out.status_code == 303 and 'butlers_ui=""' in out.headers["set-cookie"]
        assert (await client.get("/ui/messages")).status_code == 303  # signed out

    # Neither the token nor a wrong guess reached any log, at DEBUG.
    assert "dashboard_login_refused" in {getattr(r, "action", "") for r in caplog.records}
    assert TOKEN not in caplog.text and "guess" not in caplog.text

    # A new token ends the sessions the old one opened.
    cookie = session_cookie.split(";", 1)[0].split("=", 1)[1]
    async with dashboard_client(pg_server, switchboard, token="a-new-token") as client:
        client.cookies.set("butlers_ui", cookie, path="/ui")
        assert (await client.get("/ui")).status_code == 303


async def test_the_switchboard_serves_it_and_its_ask_form_answers(
    start_butler: StartButler, tmp_path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """Served on the switchboard's port, without a token (loopback): the Ask form goes
    through the real path (source `dashboard`); a page asked for by another Host name (DNS
    rebinding) is refused. Its spans exported nowhere (no OTEL_EXPORTER_OTLP_ENDPOINT), a
    trace is shown as its id, not as a link to a Jaeger that never got it."""
    from butlers.telemetry import Telemetry

    scripted_api.respond_with(model("general", {"general": "Watered, noted."}))
    switchboard, _ = await start_fleet(
        start_butler, tmp_path, names=("general",), telemetry=Telemetry()
    )
    base = switchboard.sse_url.removesuffix("/sse")
    jar = aiohttp.CookieJar(unsafe=True)  # cookies for 127.0.0.1
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        async with http.get(f"{base}/ui/ask") as response:
            assert response.status == 200
            csrf = re.search(r'name="csrf" value="([^"]+)"', await response.text())[1]
        async with http.post(
            f"{base}/ui/ask", data={"text": "I watered the plants", "csrf": csrf}
        ) as response:
            page = await response.text()
            assert response.status == 200, page
        assert 'id="answer-reply">Watered, noted.' in page and "answered by general" in page
        async with http.get(f"{base}/ui/messages?channel=mcp") as response:
            listing = await response.text()
            assert "I watered the plants" in listing
        assert "/trace/" not in listing and "not exported" in listing
        inbox_id = re.search(r'data-id="(\d+)"', listing)[1]
        async with http.get(f"{base}/ui/messages/{inbox_id}") as response:
            shown = await response.text()
            assert "/trace/" not in shown and "(not exported: set OTEL_EXPORTER" in shown
        async with http.get(f"{base}/ui", headers={"Host": "evil.example:80"}) as response:
            assert response.status == 421
        async with http.post(
            f"{base}/ui/ask",
            data={"text": "from another site", "csrf": csrf},
            headers={"Origin": "http://evil.example"},
        ) as response:
            assert response.status == 403
    conn = await db_conn(switchboard.config.db_name)
    rows = await conn.fetch("SELECT source_id, text FROM inbox ORDER BY id")
    assert [(r["source_id"], r["text"]) for r in rows] == [("dashboard", "I watered the plants")]


async def test_an_albums_parts_point_to_the_message_that_answered_them(
    fleet, pg_server, db_conn
) -> None:
    switchboard, _ = fleet
    conn = await db_conn(switchboard.config.db_name)
    first, part = await seed_album(conn)
    async with dashboard_client(pg_server, switchboard) as client:
        page = await client.get("/ui/messages", headers=BEARER)
        part_row = next(r for r in rows_of(page.text, "messages") if f'data-id="{part}"' in r)
        first_row = next(r for r in rows_of(page.text, "messages") if f'data-id="{first}"' in r)
        assert f'<a href="/ui/messages/{first}">with #{first}</a>' in part_row
        assert "general" in text_of(first_row) and "with #" not in first_row
        detail = (await client.get(f"/ui/messages/{part}", headers=BEARER)).text
        assert f'first photo, <a href="/ui/messages/{first}">#{first}</a>' in detail


async def test_a_butlers_memories_are_shown_searched_and_forgotten(
    fleet, pg_server, db_conn
) -> None:
    """What a butler remembers is on its page (the CLI's `butlers memory`, not the dashboard,
    showed it before): newest first with whose it is, a search best first, and Forget, a form
    with its CSRF token like every other."""
    switchboard, general = fleet
    tyres = await call(general, "memory_remember", text=f"{HOSTILE}: tyres are 205/55 R16")
    birthday = await call(
        general, "memory_remember", text="Anna's birthday is on May 3", tags=["family", "shared"]
    )
    # One a person's session kept (as MemoryStore.remember writes it for them).
    conn = await db_conn(general.config.db_name)
    theirs = await conn.fetchval(
        """INSERT INTO memories (text, tags, conversation, private, language, words, person,
                                 from_owner)
           VALUES ('Bob likes oat milk', '{}', 'telegram:555', true, 'english',
                   to_tsvector('english', 'Bob likes oat milk'), 'telegram:555', false)
           RETURNING id"""
    )
    # One the owner's own chat kept: the owner's, though it names the chat.
    await conn.execute(
        """INSERT INTO memories (text, tags, conversation, private, language, words, person,
                                 from_owner)
           VALUES ('Door code 4711', '{}', 'telegram:1', true, 'english',
                   to_tsvector('english', 'Door code 4711'), 'telegram:1', true)"""
    )
    async with dashboard_client(pg_server, switchboard) as client:
        butler_page = (await client.get("/ui/butlers/general", headers=BEARER)).text
        assert 'href="/ui/butlers/general/memory"' in butler_page
        page = (await client.get("/ui/butlers/general/memory", headers=BEARER)).text
        assert 'data-refresh="0"' in page  # never refreshed under its buttons
        rows = [cells(r) for r in rows_of(page, "memories")]
        assert rows.pop(0)[2:5] == ["the owner · private", "", "Door code 4711"]
        await conn.execute("DELETE FROM memories WHERE text = 'Door code 4711'")  # (seen)
        assert [r[0] for r in rows] == [str(theirs), str(birthday["id"]), str(tyres["id"])]
        assert rows[0][2:5] == ["telegram:555 · private", "", "Bob likes oat milk"]
        assert rows[1][2:5] == [
            "the owner · shared",
            "family, shared",
            "Anna's birthday is on May 3",
        ]
        assert rows[2][2] == "the owner · private"
        assert "&lt;script&gt;alert" in page and "<script>alert" not in page

        found = (await client.get("/ui/butlers/general/memory?q=tyre", headers=BEARER)).text
        [row] = [cells(r) for r in rows_of(found, "memories")]
        assert row[0] == str(tyres["id"]) and float(row[4]) > 0  # its score
        none = (await client.get("/ui/butlers/general/memory?q=zeppelin", headers=BEARER)).text
        assert [cells(r) for r in rows_of(none, "memories")] == [["No memory matches."]]

        # Signed in with a cookie: Forget needs the page's CSRF token.
        login = await client.get("/ui/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', login.text)[1]
        signed = await client.post("/ui/login", data={"token": TOKEN, "csrf": csrf, "next": "/ui"})
        assert signed.status_code == 303
        refused = await client.post("/ui/butlers/general/memory", data={"forget": str(tyres["id"])})
        assert refused.status_code == 403 and "CSRF" in refused.text
        assert len(await call(general, "memory_list")) == 3
        forgot = await client.post(
            "/ui/butlers/general/memory", data={"forget": str(tyres["id"]), "csrf": csrf}
        )
        assert forgot.status_code == 200
        assert f"Memory #{tyres['id']} is forgotten." in forgot.text
        left = [theirs, birthday["id"]]
        assert [m["id"] for m in await call(general, "memory_list")] == left
        assert [cells(r)[0] for r in rows_of(forgot.text, "memories")] == [str(i) for i in left]
        # Bad input named, nothing else touched.
        again = await client.post(
            "/ui/butlers/general/memory", data={"forget": str(tyres["id"]), "csrf": csrf}
        )
        assert again.status_code == 400 and f"no memory {tyres['id']}" in again.text
        junk = await client.post("/ui/butlers/general/memory", data={"forget": "x", "csrf": csrf})
        assert junk.status_code == 400 and "a memory's number" in text_of(junk.text)
        assert [m["id"] for m in await call(general, "memory_list")] == left


async def test_a_butler_with_thousands_of_state_keys_shows_the_first_ones_without_values(
    fleet, pg_server, db_conn
) -> None:
    """The butler's page listed every state key and fetched every value (2000 keys: 250 KB
    of HTML, every 10 s; a value may be 512 KiB: a year of data's walkthrough). It shows
    the first STATE_KEYS_SHOWN keys, says there are more, and asks for no value."""
    switchboard, general = fleet
    conn = await db_conn(general.config.db_name)
    await conn.execute(
        """INSERT INTO state (key, value)
           SELECT 'log:' || lpad(g::text, 5, '0'), to_jsonb(repeat('secret-value ', 40))
           FROM generate_series(1, $1::int + 5) g""",
        STATE_KEYS_SHOWN,
    )
    async with dashboard_client(pg_server, switchboard) as client:
        page = (await client.get("/ui/butlers/general", headers=BEARER)).text
    keys = [cells(r)[0] for r in rows_of(page, "state")]
    assert keys == [f"log:{n:05}" for n in range(1, STATE_KEYS_SHOWN + 1)]
    assert 'id="state-more"' in page and "secret-value" not in page
    # The tool's own limit and keys-only answer, as the page asks for them.
    listed = await call(general, "state_list", prefix="log:", limit=2, values=False)
    assert [set(row) for row in listed] == [{"key", "updated_at"}] * 2
    assert [row["key"] for row in listed] == ["log:00001", "log:00002"]
    with_values = await call(general, "state_list", prefix="log:0000", limit=1)
    assert with_values[0]["value"].startswith("secret-value")
    assert len(await call(general, "state_list", prefix="log:")) == STATE_KEYS_SHOWN + 5
