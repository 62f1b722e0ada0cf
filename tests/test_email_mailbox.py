"""No mail can block the mailbox: end to end through a real IMAP server (pymap), the whole
switchboard (the real Claude Code classifying, real butlers answering) and a real SMTP server.

A mail with NUL bytes, a subject that decodes to a line break, a Message-ID too long for the
inbox's index, or one that cannot be stored for whatever reason: each is dealt with, and the
mail after it is still answered.
"""

from __future__ import annotations

import secrets
from email.message import EmailMessage
from pathlib import Path

import pytest

from butlers.errors import MailError
from butlers.modules.email import EmailModule
from butlers.modules.mail_imap import MAX_MAIL_FAILURES
from butlers.modules.mail_parse import one_line
from butlers.switchboard.inbox import IncomingMessage
from tests.conftest import StartButler
from tests.fakes.mail import SmtpServer, imap_append, pymap_server
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_email import mail, start_mail_fleet

# MAILBOX_FIRST: the mails are appended before the module connects. Appended while its first
# UID SEARCH was in flight, pymap's dict backend now and then closed the module's IDLE session
# ("BYE [UNAVAILABLE] Server has closed the connection") and then greeted no new connection:
# the module's reconnect waited out its timeout, past the test's (1 run in 6, measured). What
# these tests check is what becomes of a mail, not how it arrives (tests/test_email_arrivals.py
# covers arrivals while connected).
from tests.test_email_tls import PASSWORD, USER, email_config, wait_until_seen
from tests.test_inbox import model

NEXT = mail(message_id="<next@example.com>", subject="next", body="The next mail.")


def raw_mail(subject: bytes, message_id: str, body: bytes = b"Hello.") -> bytes:
    return (
        b"From: Ada <user@example.com>\r\nTo: butler@example.com\r\nSubject: "
        + subject
        + f"\r\nMessage-ID: {message_id}\r\n".encode()
        + b"Content-Type: text/plain; charset=utf-8\r\n\r\n"
        + body
        + b"\r\n"
    )


@pytest.fixture
def answering(scripted_api: ScriptedMessagesAPI) -> ScriptedMessagesAPI:
    scripted_api.respond_with(model("general", {"general": "Noted."}))
    return scripted_api


async def test_nul_bytes_are_stored_and_answered_and_the_next_mail_too(
    start_butler: StartButler, tmp_path: Path, answering, db_conn, monkeypatch
) -> None:
    nul = raw_mail(b"lunch\x00time", "<nul@example.com>", b"Soup\x00 at noon.")
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        with SmtpServer(users={USER: PASSWORD}) as smtp:
            # In the mailbox before the module connects (see MAILBOX_FIRST).
            await imap_append(port, USER, PASSWORD, nul)  # APPEND carries the NUL bytes as-is
            await imap_append(port, USER, PASSWORD, NEXT)
            switchboard = await start_mail_fleet(start_butler, tmp_path, port, smtp, monkeypatch)
            replies = await smtp.wait_for(2)
            await wait_until_seen(port)
    assert sorted(m["Subject"] for m in replies) == ["Re: lunchtime", "Re: next"]
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT subject, text, status FROM inbox ORDER BY id")
    assert [tuple(r) for r in rows] == [
        ("lunchtime", "Soup at noon.", "done"),
        ("next", "The next mail.", "done"),
    ]


async def test_a_subject_with_a_line_break_gets_its_reply_on_one_line(
    start_butler: StartButler, tmp_path: Path, answering, monkeypatch
) -> None:
    # RFC 2047: the header is one line on the wire, its text has CR LF in it once decoded.
    subject = b"=?utf-8?q?Lunch=0D=0ABcc:_attacker@evil.example?="
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        with SmtpServer(users={USER: PASSWORD}) as smtp:
            await imap_append(port, USER, PASSWORD, raw_mail(subject, "<crlf@example.com>"))
            await start_mail_fleet(start_butler, tmp_path, port, smtp, monkeypatch)
            [reply] = await smtp.wait_for(1)
    assert reply["Subject"] == "Re: Lunch Bcc: attacker@evil.example"
    assert reply["Bcc"] is None and smtp.recipients == [["user@example.com"]]


async def test_a_message_id_too_long_for_the_index_is_answered(
    start_butler: StartButler, tmp_path: Path, answering, db_conn, monkeypatch
) -> None:
    """PostgreSQL's btree refuses an entry past ~2.7 kB: a mail whose (random, so
    incompressible) Message-ID is that long could never be stored under it."""
    long_id = f"<{secrets.token_urlsafe(3000)}@example.com>"
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        with SmtpServer(users={USER: PASSWORD}) as smtp:
            await imap_append(port, USER, PASSWORD, raw_mail(b"long id", long_id))
            await imap_append(port, USER, PASSWORD, NEXT)
            switchboard = await start_mail_fleet(start_butler, tmp_path, port, smtp, monkeypatch)
            replies = await smtp.wait_for(2)
            await wait_until_seen(port)
    assert sorted(m["Subject"] for m in replies) == ["Re: long id", "Re: next"]
    conn = await db_conn(switchboard.config.database)
    ids = await conn.fetchval("SELECT array_agg(external_id ORDER BY id) FROM inbox")
    assert ids[0].startswith("message-id-sha256:") and ids[1] == "<next@example.com>"


async def test_a_mail_that_cannot_be_stored_is_recorded_as_failed_and_skipped(
    start_butler: StartButler, tmp_path: Path, answering, db_conn, monkeypatch
) -> None:
    """Failure injection (only that): the inbox refuses one message, whatever it is."""
    attempts: list[str] = []
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        with SmtpServer(users={USER: PASSWORD}) as smtp:
            switchboard = await start_mail_fleet(start_butler, tmp_path, port, smtp, monkeypatch)
            worker = switchboard.switchboard.worker  # type: ignore[union-attr]
            store = worker.accept

            async def accept(message: IncomingMessage) -> int | None:
                if message.external_id == "<poison@example.com>":
                    attempts.append(message.external_id)
                    raise RuntimeError("the inbox refuses this one")
                return await store(message)

            monkeypatch.setattr(worker, "accept", accept)
            poison = mail(message_id="<poison@example.com>", subject="poison", body="Poison.")
            await imap_append(port, USER, PASSWORD, poison)  # first: it used to block the rest
            await imap_append(port, USER, PASSWORD, NEXT)
            [reply] = await smtp.wait_for(1)
            await wait_until_seen(port)
    assert reply["Subject"] == "Re: next"
    assert len(attempts) == MAX_MAIL_FAILURES == 3
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT external_id, source_id, subject, status, error FROM inbox")
    failed = {r["external_id"]: r for r in rows}["<poison@example.com>"]
    assert (failed["source_id"], failed["subject"], failed["status"]) == (
        "user@example.com",
        "poison",
        "failed",
    )
    assert "could not be stored 3 times: the inbox refuses this one" in failed["error"]


async def test_every_header_we_write_is_one_line() -> None:
    """Subject, In-Reply-To and References come from what a sender wrote; a line break in
    them made the email package refuse the reply (and, were it let through, would start a
    header of the sender's choosing). A To that is not one address is refused."""
    with SmtpServer(auth=False) as relay:
        module = EmailModule(email_config(smtp_port=relay.port), USER, PASSWORD, None)
        await module.send(
            "user@example.com",
            "Re: Lunch\r\nBcc: a@evil.example",
            "Soup.",
            in_reply_to="<m1@example.com>\r\nBcc: b@evil.example",
            references="<m0@example.com>\r\n <m1@example.com>\nBcc: c@evil.example",
        )
        [sent] = await relay.wait_for(1)
        with pytest.raises(MailError, match="cannot send to"):
            await module.send("user@example.com\r\nBcc: d@evil.example", "Hi", "Soup.")
    assert sent["Subject"] == "Re: Lunch Bcc: a@evil.example"
    assert sent["In-Reply-To"] == "<m1@example.com> Bcc: b@evil.example"
    assert sent["References"] == "<m0@example.com> <m1@example.com> Bcc: c@evil.example"
    assert sent["Bcc"] is None and relay.recipients == [["user@example.com"]]


def test_one_line_is_linear_and_knows_every_line_break() -> None:
    """Its regex backtracked on runs of spaces (32 KiB of them: 5.8 s, on the event loop when
    replying); and the email package refuses a header with any character str.splitlines()
    breaks at, U+2028 included: the reply to such a subject was lost. (Its time on 32 KiB
    of spaces: bench/hostile_input.py.)"""
    assert one_line(" " * 32_768 + "x") == "x"
    assert one_line("a" + " " * 32_768 + "b") == "a" + " " * 32_768 + "b"  # plain spaces stay
    for brk in ["\r\n ", "\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]:
        subject = one_line(f"Lunch {brk} Bcc: a@evil.example")
        assert subject == "Lunch Bcc: a@evil.example", repr(brk)
        EmailMessage()["Subject"] = subject  # the email package takes it
