"""The dashboard's sign-in: sessions that end when signed out (on every replica, replayed or
not), CSRF on sign-out, wrong tokens throttled per client with one warning per burst, the
Secure flag behind a TLS proxy, and a fleet page that a butler which never answers cannot
hold up.

Pages the switchboard serves itself are asked over its port (uvicorn with its proxy headers,
as deployed); two dashboards on one database stand for two switchboard replicas."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from starlette.requests import Request
from starlette.responses import Response

from butlers.dashboard.auth import SESSION_MAX_AGE_S, DashboardAuth, LoginThrottle, client_of
from tests.conftest import StartButler
from tests.test_dashboard import BEARER, dashboard_client, rows_of, text_of
from tests.test_inbox import start_fleet
from tests.test_operator import TOKEN

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def switchboard_alone(start_butler: StartButler, tmp_path: Path, **options):
    """A token-protected switchboard with no other butler."""
    switchboard, _ = await start_fleet(
        start_butler, tmp_path, names=(), auth_token=TOKEN, **options
    )
    return switchboard


def cookie_of(response, name: str) -> str | None:
    """The value a response's Set-Cookie gives `name` (None: not set)."""
    for header in response.headers.get_list("set-cookie"):
        key, _, rest = header.partition("=")
        if key == name:
            return rest.split(";", 1)[0]
    return None


async def test_sign_out_ends_that_session_on_every_replica_even_replayed(
    start_butler: StartButler, tmp_path: Path, pg_server, db_conn
) -> None:
    switchboard = await switchboard_alone(start_butler, tmp_path)
    async with (
        dashboard_client(pg_server, switchboard) as first,
        dashboard_client(pg_server, switchboard) as second,  # another replica, same database
    ):

        async def sign_in(client) -> str:
            """A fresh browser's session cookie."""
            client.cookies.clear()
            csrf = CSRF.search((await client.get("/ui/login")).text)[1]
            signed = await client.post("/ui/login", data={"token": TOKEN, "csrf": csrf})
            assert signed.status_code == 303
            session = cookie_of(signed, "butlers_ui")
            assert session is not None
            return session

        async def opens(client, session: str) -> bool:
            client.cookies.clear()
            client.cookies.set("butlers_ui", session, path="/ui")
            page = await client.get("/ui/messages")
            assert page.status_code in (200, 303), page.status_code
            return page.status_code == 200

        laptop = await sign_in(first)
        phone = await sign_in(first)
        assert laptop != phone  # each sign-in is a session of its own
        assert await opens(first, laptop) and await opens(second, laptop)

        # Sign-out without its CSRF token (a page on another site posting the form): refused,
        # and the session survives.
        first.cookies.set("butlers_ui", laptop, path="/ui")
        for data in ({}, {"csrf": "x" * 43}):
            refused = await first.post("/ui/logout", data=data)
            assert refused.status_code == 403 and "CSRF" in refused.text
            assert cookie_of(refused, "butlers_ui") is None
        assert await opens(first, laptop) and await opens(second, laptop)

        # The sign-out form of the page the browser shows, with its CSRF token.
        await opens(first, laptop)
        csrf = CSRF.search((await first.get("/ui/messages")).text)[1]
        out = await first.post("/ui/logout", data={"csrf": csrf})
        assert out.status_code == 303 and cookie_of(out, "butlers_ui") == '""'
        # The cookie replayed: refused by this process and by the other one.
        assert not await opens(first, laptop)
        assert not await opens(second, laptop)
        assert await opens(second, phone)  # the other session goes on

        # Forged: another id under the same issue time and MAC, or the MAC of another id.
        session_id, issued, mac = phone.split(".")
        for forged in (f"x{session_id}.{issued}.{mac}", f"{session_id}.{int(issued) + 1}.{mac}"):
            assert not await opens(first, forged)

    conn = await db_conn(switchboard.config.db_name)
    rows = await conn.fetch("SELECT session_id, expires_at FROM dashboard_signed_out")
    assert [r["session_id"] for r in rows] == [laptop.split(".")[0]]  # the id, never the MAC

    # After a restart (a new dashboard on the same database) it stays signed out.
    async with dashboard_client(pg_server, switchboard) as restarted:
        restarted.cookies.set("butlers_ui", laptop, path="/ui")
        assert (await restarted.get("/ui")).status_code == 303
        restarted.cookies.set("butlers_ui", phone, path="/ui")
        assert (await restarted.get("/ui")).status_code == 200


async def test_a_wrong_token_keeps_where_the_reader_was_going(
    start_butler: StartButler, tmp_path: Path, pg_server
) -> None:
    """Sent to sign in from a page: a wrong token first, then the right one, still lands on
    that page (it landed on the fleet)."""
    switchboard = await switchboard_alone(start_butler, tmp_path)
    async with dashboard_client(pg_server, switchboard) as client:
        page = (await client.get("/ui/login?next=/ui/messages")).text
        # Where the token is, for an owner who never opened .env (the first hour's walkthrough).
        assert "<code>.env</code> file of your config directory" in page
        csrf = CSRF.search(page)[1]
        wrong = await client.post(
            "/ui/login", data={"token": "nope", "csrf": csrf, "next": "/ui/messages"}
        )
        assert wrong.status_code == 401
        assert 'name="next" value="/ui/messages"' in wrong.text
        csrf = CSRF.search(wrong.text)[1]
        signed = await client.post(
            "/ui/login", data={"token": TOKEN, "csrf": csrf, "next": "/ui/messages"}
        )
        assert (signed.status_code, signed.headers["location"]) == (303, "/ui/messages")


async def test_wrong_tokens_are_throttled_per_client_with_one_warning_a_burst(
    start_butler: StartButler,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per client: behind a proxy the switchboard believes (FORWARDED_ALLOW_IPS), per the
    address it forwards."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "127.0.0.1")  # a proxy on this machine
    switchboard = await switchboard_alone(start_butler, tmp_path)
    base = switchboard.base_url
    guesses = [f"guess-number-{n}" for n in range(9)]

    async def sign_in(http: aiohttp.ClientSession, token: str, **headers: str):
        async with http.get(f"{base}/ui/login", headers=headers) as page:
            csrf = CSRF.search(await page.text())[1]
        async with http.post(
            f"{base}/ui/login",
            data={"token": token, "csrf": csrf},
            headers=headers,
            allow_redirects=False,
        ) as response:
            return response.status, response.headers.get("retry-after"), await response.text()

    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        for guess in guesses[:5]:
            status, _, page = await sign_in(http, guess)
            assert status == 401 and "that is not the token" in page
        # The limit reached: refused before the token is even compared, the right one too.
        for token in (*guesses[5:], TOKEN):
            status, retry_after, page = await sign_in(http, token)
            assert status == 429, status
            assert 1 <= int(retry_after) <= 60
            assert f"try again in {retry_after} s" in page
        # Another client (as a trusted proxy on loopback forwards it) is not held up by it.
        other = {"X-Forwarded-For": "203.0.113.9"}
        status, _, _ = await sign_in(http, TOKEN, **other)
        assert status == 303

    throttled = [
        r for r in caplog.records if getattr(r, "action", "") == "dashboard_login_throttled"
    ]
    assert len(throttled) == 1 and throttled[0].levelno == logging.WARNING
    assert "5 wrong tokens from 127.0.0.1 within 60 s" in throttled[0].getMessage()
    assert not [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and getattr(r, "action", "") == "dashboard_login_refused"
    ]  # one warning per burst, not one per guess
    for secret in (TOKEN, *guesses):
        assert secret not in caplog.text, secret


async def test_wrong_bearer_tokens_count_as_guesses_like_the_sign_in_forms(
    start_butler: StartButler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script's `Authorization: Bearer` on /ui is a guess like the form's: five wrong ones
    and that client is refused (429) before its token is compared. (With a token any Host may
    ask, as a proxy forwards it: a rebinding web page can only guess, and, no proxy being
    believed unless FORWARDED_ALLOW_IPS says so, cannot claim a new address per guess with
    X-Forwarded-For: a red team's page in Chromium made 30 guesses so.)"""
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)  # the default
    switchboard = await switchboard_alone(start_butler, tmp_path)
    base = switchboard.base_url
    async with aiohttp.ClientSession() as http:

        async def get(token: str, **headers: str) -> tuple[int, str | None]:
            bearer = {"Authorization": f"Bearer {token}", **headers}
            async with http.get(f"{base}/ui/messages", headers=bearer) as response:
                return response.status, response.headers.get("retry-after")

        assert (await get(TOKEN))[0] == 200
        for n in range(5):
            assert (await get(f"guess-{n}"))[0] == 401
        status, retry_after = await get(TOKEN)
        assert status == 429 and retry_after is not None and 1 <= int(retry_after) <= 60
        # The same client claiming to be another (as a rebinding page's fetch may) is not.
        assert (await get(TOKEN, **{"X-Forwarded-For": "203.0.113.9"}))[0] == 429
        assert (await get("guess-5", **{"X-Forwarded-For": "203.0.113.10"}))[0] == 429


def test_the_throttle_window_and_its_memory() -> None:
    now = [1000.0]
    throttle = LoginThrottle(max_failures=5, window_s=60, clock=lambda: now[0], max_clients=3)
    # Failures spread wider than the window never block.
    for _ in range(4):
        throttle.failed("a")
    now[0] += 61
    for _ in range(4):
        throttle.failed("a")
    assert throttle.retry_after("a") is None
    throttle.failed("a")  # the fifth within a minute
    assert throttle.retry_after("a") == 60
    now[0] += 59.5
    assert throttle.retry_after("a") == 1
    now[0] += 0.5
    assert throttle.retry_after("a") is None  # blocked for one window, then afresh
    for _ in range(4):
        throttle.failed("a")
    assert throttle.retry_after("a") is None
    throttle.succeeded("a")  # a right token forgets the client's failures
    for _ in range(4):
        throttle.failed("a")
    assert throttle.retry_after("a") is None
    # At most max_clients are remembered: the oldest go first.
    for client in ("b", "c", "d"):
        for _ in range(5):
            throttle.failed(client)
    assert throttle.retry_after("b") == throttle.retry_after("d") == 60
    throttle.failed("e")
    assert throttle.retry_after("b") is None and throttle.retry_after("d") == 60


class SignedOut:
    """The protocol DashboardAuth keeps signed-out ids through, in memory: the database's
    side is tested above; here only the cookie's age is."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    async def session_signed_out(self, session_id: str) -> bool:
        return session_id in self.ids

    async def sign_out_session(self, session_id: str, expires_at) -> None:
        self.ids.add(session_id)


async def test_a_cookie_is_refused_past_its_age_whatever_the_browser_kept() -> None:
    now = [1_800_000_000.0]
    auth = DashboardAuth("a-token-for-the-cookie-age", SignedOut(), clock=lambda: now[0])
    scope = {"type": "http", "scheme": "http", "path": "/ui/login", "query_string": b""}
    response = Response()
    auth.start_session(Request({**scope, "headers": []}), response)
    cookie = response.headers["set-cookie"].split(";", 1)[0]
    request = Request({**scope, "headers": [(b"cookie", cookie.encode())]})
    assert await auth.allows(request)
    now[0] += SESSION_MAX_AGE_S - 1
    assert await auth.allows(request)
    now[0] += 1
    assert not await auth.allows(request)
    now[0] -= SESSION_MAX_AGE_S + 3600  # an hour before it was issued: not from this key's past
    assert not await auth.allows(request)


async def test_a_cookie_with_digits_int_refuses_is_no_session() -> None:
    """`"²".isdigit()` is true and a cookie header is latin-1: such a cookie is no session,
    not a 500 with a traceback for anyone who reaches /ui."""
    auth = DashboardAuth("a-token-for-the-cookie-age", SignedOut())
    for value in ("a.\u00b2.x", "a.1\u00b3.x", "a.\u0661\u0662.x"):
        scope = {"type": "http", "scheme": "http", "path": "/ui", "query_string": b""}
        cookie = f"butlers_ui={value}".encode("latin-1", "replace")
        request = Request({**scope, "headers": [(b"cookie", cookie)]})
        assert auth.session_of(request) is None
        assert not await auth.allows(request)


def test_a_form_post_from_another_origin_is_refused_even_with_the_cookie() -> None:
    """Every port of 127.0.0.1 is one site: a page on another local port could plant the
    CSRF cookie and post with it. The browser's Sec-Fetch-Site gives it away."""
    from butlers.dashboard.auth import CSRF_COOKIE, csrf_matches

    def post(site: str | None) -> Request:
        headers = [(b"cookie", f"{CSRF_COOKIE}=planted-token".encode())]
        if site is not None:
            headers.append((b"sec-fetch-site", site.encode()))
        return Request({"type": "http", "method": "POST", "path": "/ui/ask", "headers": headers})

    assert csrf_matches(post(None), "planted-token")  # a client that says nothing (curl)
    assert csrf_matches(post("same-origin"), "planted-token")
    assert not csrf_matches(post("same-site"), "planted-token")
    assert not csrf_matches(post("cross-site"), "planted-token")
    assert not csrf_matches(post("same-origin"), "another-token")


def test_a_client_is_its_address_and_an_ipv6_client_its_64() -> None:
    def client(host: str) -> str:
        return client_of(Request({"type": "http", "client": (host, 1234), "headers": []}))

    assert client("192.0.2.7") == "192.0.2.7"
    assert client("::ffff:192.0.2.7") == "192.0.2.7"
    assert client("2001:db8:1:2:aaaa::1") == client("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client("2001:db8:1:3::1") != client("2001:db8:1:2::1")
    assert ipaddress.ip_network(client("2001:db8::1")).prefixlen == 64


async def test_the_session_cookie_is_secure_behind_a_tls_proxy_it_trusts(
    start_butler: StartButler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn believes X-Forwarded-Proto from FORWARDED_ALLOW_IPS (unset: from nobody):
    through a TLS proxy there the cookies are Secure; from a proxy it does not trust, the
    header changes nothing."""

    async def cookies_through_proxy(switchboard) -> tuple[str, str]:
        """The CSRF and session cookies of a sign-in through a TLS proxy on loopback: the
        public Host and X-Forwarded-Proto: https, from 127.0.0.1."""
        proxied = {"Host": "dash.example.com", "X-Forwarded-Proto": "https"}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{switchboard.base_url}/ui/login", headers=proxied) as page:
                csrf_cookie = page.headers["set-cookie"]
                csrf = CSRF.search(await page.text())[1]
            async with http.post(
                f"{switchboard.base_url}/ui/login",
                data={"token": TOKEN, "csrf": csrf},
                headers={**proxied, "Cookie": f"butlers_csrf={csrf}"},
                allow_redirects=False,
            ) as signed:
                assert signed.status == 303
                session_cookie = signed.headers["set-cookie"]
        assert csrf_cookie.startswith("butlers_csrf=")
        assert session_cookie.startswith("butlers_ui=")
        return csrf_cookie, session_cookie

    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "127.0.0.1,::1")  # a proxy on this machine
    trusted = await switchboard_alone(start_butler, tmp_path / "trusted")
    for cookie in await cookies_through_proxy(trusted):
        assert "; Secure" in cookie and "HttpOnly" in cookie, cookie
    # Straight to the port over plain HTTP: not Secure (the browser would never send it back).
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{trusted.base_url}/ui/login") as page:
            assert "Secure" not in page.headers["set-cookie"]

    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "192.0.2.1")  # the proxy is elsewhere
    untrusted = await switchboard_alone(start_butler, tmp_path / "untrusted")
    for cookie in await cookies_through_proxy(untrusted):
        assert "Secure" not in cookie, cookie
    monkeypatch.delenv("FORWARDED_ALLOW_IPS")  # the default: no proxy is believed
    unset = await switchboard_alone(start_butler, tmp_path / "unset")
    for cookie in await cookies_through_proxy(unset):
        assert "Secure" not in cookie, cookie


@pytest.fixture
async def silent_butler() -> AsyncIterator[str]:
    """A butler's endpoint that accepts a connection and then never says a word."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # kept open, never written to

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/sse"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_butler_that_accepts_and_never_answers_is_shown_unreachable(
    start_butler: StartButler, tmp_path: Path, pg_server, db_conn, silent_butler: str
) -> None:
    switchboard = await switchboard_alone(start_butler, tmp_path)
    conn = await db_conn(switchboard.config.db_name)
    await conn.execute(
        """INSERT INTO butler_registry (name, endpoint_url, description)
           VALUES ('mute', $1, 'Accepts, then silence.')""",
        silent_butler,
    )
    async with dashboard_client(pg_server, switchboard) as client:
        # Bounded by the probe's own timeouts; this guard only turns a hang into a failure.
        async with asyncio.timeout(60):
            page = await client.get("/ui", headers=BEARER)
        assert page.status_code == 200
        rows = {re.search(r'data-butler="([^"]+)"', r)[1]: r for r in rows_of(page.text, "fleet")}
        assert set(rows) == {"mute", "switchboard"}
        mute = text_of(rows["mute"])
        assert "unreachable (TimeoutError)" in mute, mute
        assert "status:" in mute  # its status call gave up too, and says so
        assert " ok " in f" {text_of(rows['switchboard'])} "
        # Its own page too.
        async with asyncio.timeout(60):
            page = await client.get("/ui/butlers/mute", headers=BEARER)
        assert page.status_code == 200 and "unreachable (TimeoutError)" in text_of(page.text)
