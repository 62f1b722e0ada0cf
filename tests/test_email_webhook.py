"""POST /email/inbound: the bearer token is compared as bytes (a non-ASCII header made
hmac.compare_digest raise on str: a 500), and the From address obeys the IMAP rules.

Requests go out as raw bytes over a socket: HTTP clients refuse to send non-ASCII headers.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import StartButler
from tests.fakes.mail import SmtpServer
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_email import start_mail_fleet
from tests.test_email_tls import PASSWORD, USER
from tests.test_inbox import model


async def post(base_url: str, payload: dict, authorization: bytes | None) -> int:
    """POST /email/inbound with exactly these header bytes; the response's status code."""
    url = urlsplit(base_url)
    body = json.dumps(payload).encode()
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
        status_line = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    return int(status_line.split()[1])


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
        ]:
            payload = good | {"from": sender, "message_id": f"<{len(sender)}@x>"}
            assert await post(url, payload, bearer) == 400, sender
        assert await post(url, good, bearer) == 200
        [reply] = await smtp.wait_for(1)
    assert reply["To"] == "user@example.com"
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(external_id) FROM inbox") == ["<w1@x>"]
