"""POST /email/inbound: the bearer token is compared as bytes (a non-ASCII header made
hmac.compare_digest raise on str: a 500), the From address obeys the IMAP rules, every bad
body gets a 400 naming what is wrong (never a 500), the body is read off the event loop, and
the webhook works behind a reverse proxy that keeps the public Host.

Requests go out as raw bytes over a socket: HTTP clients refuse to send non-ASCII headers.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

import butlers.modules.email as email_module
import butlers.modules.mail_webhook as mail_webhook
from tests.conftest import StartButler
from tests.fakes.mail import SmtpServer, record_threads
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.fakes.proxy import ReverseProxy
from tests.test_email import start_mail_fleet
from tests.test_email_tls import PASSWORD, USER
from tests.test_inbox import model


async def post(base_url: str, payload: dict, authorization: bytes | None) -> int:
    """POST /email/inbound with exactly these header bytes; the response's status code."""
    status, _ = await post_bytes(base_url, json.dumps(payload).encode(), authorization)
    return status


async def post_bytes(
    base_url: str, body: bytes, authorization: bytes | None
) -> tuple[int, dict[str, Any]]:
    """POST these body bytes to /email/inbound; the response's status and JSON body."""
    url = urlsplit(base_url)
    head = [
        b"POST /email/inbound HTTP/1.1",
        f"Host: {url.netloc}".encode(),
        b"Content-Type: application/json",
        f"Content-Length: {len(body)}".encode(),
        b"Connection: close",
    ]
    if authorization is not None:
        head.append(b"Authorization: " + authorization)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 30)  # Connection: close
    finally:
        writer.close()
    status_line, _, rest = response.partition(b"\r\n")
    _, _, content = rest.partition(b"\r\n\r\n")
    try:
        answer = json.loads(content) if content else {}
    except ValueError:  # a 500's "Internal Server Error"
        answer = {"not JSON": content.decode(errors="replace")}
    return int(status_line.split()[1]), answer


@pytest.mark.parametrize("token", ["mail-hook", "mail-höök"])  # the latter sent as UTF-8
async def test_webhook_token_and_sender_rules(
    token: str,
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted_api.respond_with(model("general", {"general": "Got it."}))
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", token)
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard = await start_mail_fleet(
            start_butler, tmp_path, 1, smtp, monkeypatch, mode="webhook"
        )
        url = switchboard.base_url
        good = {"from": "Ada <user@example.com>", "text": "Hi.", "message_id": "<w1@x>"}
        bearer = b"Bearer " + token.encode()
        for authorization in [
            None,
            b"Bearer wrong",
            b"Bearer mail-h\xc3\xb6\xc3\xb6X",  # non-ASCII, UTF-8
            b"Bearer \xff\xfe\xfd",  # non-ASCII, not even UTF-8
            token.encode("latin-1"),  # no "Bearer "
            *([] if token.isascii() else [b"Bearer " + token.encode("latin-1")]),  # other bytes
            b"Bearer " + token.encode() + b"\xff",
        ]:
            assert await post(url, good, authorization) == 401, authorization
        for sender in [
            "user@example.com)<attacker@evil.example>",
            "<user@example.com>attacker@evil.example",
            "a@example.com, user@example.com",
            "friends: user@example.com;",
            "user@=?utf-8?b?ZXhhbXBsZS5jb20=?=",  # RFC 2047 in the domain: read as example.com
        ]:
            payload = good | {"from": sender, "message_id": f"<{len(sender)}@x>"}
            assert await post(url, payload, bearer) == 400, sender
        assert await post(url, good, bearer) == 200
        [reply] = await smtp.wait_for(1)
    assert reply["To"] == "user@example.com"
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(external_id) FROM inbox") == ["<w1@x>"]


TOKEN = "mail-hook"
BEARER = f"Bearer {TOKEN}".encode()
GOOD = {"from": "Ada <user@example.com>", "text": "Hi.", "message_id": "<good@x>"}


async def webhook_switchboard(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    smtp: SmtpServer,
    monkeypatch: pytest.MonkeyPatch,
):
    scripted_api.respond_with(model("general", {"general": "Got it."}))
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", TOKEN)
    return await start_mail_fleet(start_butler, tmp_path, 1, smtp, monkeypatch, mode="webhook")


async def test_the_webhook_behind_a_proxy_that_keeps_the_host(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nginx's `proxy_set_header Host $host`: the webhook sees the public name, which the MCP
    endpoints' DNS rebinding guard refuses (421); the webhook proves itself with its token."""
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard = await webhook_switchboard(
            start_butler, tmp_path, scripted_api, smtp, monkeypatch
        )
        proxy = ReverseProxy(switchboard.base_url)
        await proxy.start()
        try:
            async with aiohttp.ClientSession() as session:
                hook = f"{proxy.url}/email/inbound"
                public = {"Host": "mail.example.com"}
                wrong = {**public, "Authorization": "Bearer wrong"}
                async with session.post(hook, json=GOOD, headers=wrong) as response:
                    assert response.status == 401
                right = {**public, "Authorization": f"Bearer {TOKEN}"}
                async with session.post(hook, json=GOOD, headers=right) as response:
                    assert response.status == 200, await response.text()
                async with session.get(f"{proxy.url}/sse", headers=public) as response:
                    assert response.status == 421  # the MCP endpoints still refuse it
        finally:
            await proxy.stop()
        [reply] = await smtp.wait_for(1)
    assert reply["To"] == "user@example.com"
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(external_id) FROM inbox") == ["<good@x>"]


def body(**fields: Any) -> bytes:
    return json.dumps(GOOD | fields).encode()


BAD_BODIES = [
    (b"not json", "the body is not JSON"),
    (b"[" * 100_000, "the body is not JSON we take: nested too deeply"),
    (b'{"from": "\xff"}', "the body is not JSON"),
    (b'{"from": ' + b"1" * 5000 + b"}", "the body is not JSON"),  # Python's digit limit
    (b"[]", "the body must be a JSON object, not an array"),
    (b"{}", "'from' is required"),
    (body(**{"from": 5}), "'from' must be a string, not a number"),
    (body(**{"from": "(" * 20_000 + "user@example.com"}), "'from' is 20016 characters long"),
    (body(**{"from": "(" * 5_000 + "user@example.com"}), "malformed (nested too deeply)"),
    (body(message_id=None), "'message_id' is required"),
    (body(subject=["x"]), "'subject' must be a string, not an array"),
    (body(subject="x" * 9000), "'subject' is 9000 characters long, over the limit of 8192"),
    (body(text={"a": 1}), "'text' must be a string, not an object"),
    (body(html=True, text=None), "'html' must be a string, not a boolean"),
    (body(headers=[]), "'headers' must be an object, not an array"),
    (body(headers={"X-A": 5}), "'headers': 'X-A' must be a string or a list of strings"),
    (body(headers={"X-A": "x" * 9000}), "'headers': 'X-A' is 9000 characters long"),
    (body(headers={"Auto-Submitted": "no\r\nBcc: a@evil.example"}), "'headers': "),
]


async def test_every_bad_body_gets_a_400_naming_what_is_wrong(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A From of 20,000 '(' made the address parser recurse until RecursionError, JSON nested
    100,000 deep did the same in the JSON decoder, a lone surrogate made the database refuse
    the row: each was a 500. A subject with U+2028 (a line break to str.splitlines, which the
    email package refuses in a header) lost the reply."""
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard = await webhook_switchboard(
            start_butler, tmp_path, scripted_api, smtp, monkeypatch
        )
        url = switchboard.base_url
        for raw, why in BAD_BODIES:
            status, answer = await post_bytes(url, raw, BEARER)
            assert (status, why in answer.get("error", "")) == (400, True), (raw[:80], answer)
        odd = body(text="Soup \ud800 at noon.", subject="Lunch\u2028Bcc: a@evil.example")
        assert (await post_bytes(url, odd, BEARER))[0] == 200
        [reply] = await smtp.wait_for(1)
    assert reply["Subject"] == "Re: Lunch Bcc: a@evil.example" and reply["Bcc"] is None
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(text) FROM inbox") == ["Soup \ufffd at noon."]


async def test_a_big_body_is_read_without_blocking_the_event_loop(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nearly 1 MiB of HTML markup takes its conversion ~0.5 s (more on a busy machine): the
    body is parsed, and its HTML converted, in a worker thread, never on the event loop's."""
    calls = record_threads(
        monkeypatch, (email_module, "parse_webhook"), (mail_webhook, "html_to_text")
    )
    html = "<p>Soup.</p>" + "<i></i>" * 140_000
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard = await webhook_switchboard(
            start_butler, tmp_path, scripted_api, smtp, monkeypatch
        )
        status, _ = await post_bytes(switchboard.base_url, body(text=None, html=html), BEARER)
        assert status == 200
        await smtp.wait_for(1)
    assert {name for name, _ in calls} == {"parse_webhook", "html_to_text"}
    on_the_loop = [name for name, thread in calls if thread == threading.get_ident()]
    assert on_the_loop == []
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(text) FROM inbox") == ["Soup."]


async def test_webhook_mode_without_a_token_is_reported_not_running(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It would answer 401 to everything: the module says why, where an operator looks."""
    monkeypatch.delenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", raising=False)
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard = await start_mail_fleet(
            start_butler, tmp_path, 1, smtp, monkeypatch, mode="webhook"
        )
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{switchboard.base_url}/health") as response:
                modules = {m["name"]: m for m in (await response.json())["modules"]}
        assert modules["email"]["state"] == "failed"
        assert "set BUTLERS_EMAIL_WEBHOOK_TOKEN" in modules["email"]["detail"]
        assert await post(switchboard.base_url, GOOD, b"Bearer ") == 401
