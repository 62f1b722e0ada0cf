"""Stored before acknowledged, the email half: a mail read over IMAP is flagged \\Seen (which
tells the mailbox it was taken) only once it is in the inbox. While the inbox cannot take it,
it stays unseen on the server, however often it is tried, and it is read without a fetch
that would flag it (BODY.PEEK, never BODY[] or RFC822). Once the inbox is back, it is stored
and answered exactly once.

End to end: pymap (behind a TcpFront that shows what the module sent), the whole switchboard
(the real Claude Code classifying), aiosmtpd taking the reply. The inbox insert fails the
way tests/test_durability.py makes it fail for Telegram: the table is renamed away.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from butlers.context import ModuleStatus
from butlers.modules.mail_imap import MAX_MAIL_FAILURES, TRIED_KEYWORD
from tests.conftest import StartButler, eventually
from tests.fakes.mail import RecordingWorker, SmtpServer, imap_append, imap_flags, pymap_server
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.fakes.tls_front import TcpFront
from tests.test_email import mail, start_mail_fleet
from tests.test_email_tls import (
    PASSWORD,
    USER,
    email_config,
    running,
    wait_until,
    wait_until_seen,
)
from tests.test_inbox import model

# What flags a mail \Seen: a STORE naming \Seen, or a FETCH of BODY[...] or BINARY[...] (not
# their .PEEK forms), RFC822 or RFC822.TEXT (not RFC822.SIZE or RFC822.HEADER): RFC 3501 6.4.5.
_FLAGS_SEEN = re.compile(
    rb"\\Seen\b|\b(?:BODY|BINARY)\[|\bRFC822(?:\.TEXT)?(?![.\w])", re.IGNORECASE
)
_BODY_PEEK = re.compile(rb"\bBODY\.PEEK\[\]", re.IGNORECASE)


def flagging_seen(sent: bytes | bytearray) -> list[bytes]:
    """The command lines among what a client sent that flag a mail \\Seen."""
    return [line for line in bytes(sent).split(b"\r\n") if _FLAGS_SEEN.search(line)]


async def test_a_mail_stays_unseen_until_the_inbox_has_stored_it(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards mail_imap.py's `_read`/`_store`/`_settle` and the fetch items of `_take`/`_read`:
    with the inbox table away, the mail is read (BODY.PEEK) and refused MAX_MAIL_FAILURES
    times; then even its failed row cannot be written, so the session gives up and the module
    reconnects, and the mail is still unseen (a module that flagged it first, or fetched it
    with BODY[], shows here). The front holds that reconnection until the table is back, so
    the next attempt is the one that stores it: it is answered once."""
    scripted_api.respond_with(model("general", {"general": "Noted."}))
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        front = TcpFront(port)
        await front.start()
        try:
            with SmtpServer(users={USER: PASSWORD}) as smtp:
                switchboard = await start_mail_fleet(
                    start_butler, tmp_path, front.port, smtp, monkeypatch
                )

                def email_status() -> ModuleStatus:
                    statuses = switchboard.context.module_statuses()
                    return next(s for s in statuses if s.name == "email")

                await wait_until(lambda: email_status().status == "running")  # logged in
                conn = await db_conn(switchboard.config.database)
                await conn.execute("ALTER TABLE inbox RENAME TO inbox_away")  # inserts fail
                try:
                    front.hold()  # the session that follows this one waits at the front
                    await imap_append(port, USER, PASSWORD, mail(message_id="<durable@x>"))
                    # Until the session gives up (or, were it broken, flags the mail).
                    await wait_until(lambda: front.held > 0 or bool(flagging_seen(front.received)))
                    assert flagging_seen(front.received) == []
                    [flags] = (await imap_flags(port, USER, PASSWORD)).values()
                    assert "\\Seen" not in flags, flags
                    fetched = _BODY_PEEK.findall(front.received)
                    assert len(fetched) == MAX_MAIL_FAILURES  # read, refused, tried again
                    assert await conn.fetchval("SELECT count(*) FROM inbox_away") == 0
                finally:
                    await conn.execute("ALTER TABLE inbox_away RENAME TO inbox")
                    front.release()

                [reply] = await smtp.wait_for(1)
                assert reply["In-Reply-To"] == "<durable@x>"
                await wait_until_seen(port)
                # The sentinel: the worker answers in order, so once this one is answered,
                # a second answer to the first would have come before it.
                await imap_append(port, USER, PASSWORD, mail(message_id="<next@x>"))
                replies = await smtp.wait_for(2)
                await wait_until_seen(port)
        finally:
            await front.stop()
        flags_after = await imap_flags(port, USER, PASSWORD)
    assert [m["In-Reply-To"] for m in replies] == ["<durable@x>", "<next@x>"]
    assert all(f >= {"\\Seen"} and TRIED_KEYWORD not in f for f in flags_after.values())

    async def all_done() -> bool:
        return await conn.fetchval("SELECT bool_and(status = 'done') FROM inbox")

    await eventually(all_done)
    rows = await conn.fetch("SELECT external_id, status FROM inbox ORDER BY id")
    assert [tuple(r) for r in rows] == [("<durable@x>", "done"), ("<next@x>", "done")]


async def test_a_mail_the_database_refused_is_read_after_a_clean_restart() -> None:
    """The crash mark ($ButlersTried) says "reading this killed the process". A mail that
    could not be stored because the database was down, then a clean stop, is no such mail:
    at the next start it is read and stored, not recorded as failed and dropped."""
    down = RecordingWorker(fail_when=lambda m: True)  # the inbox refuses every insert

    async def cannot_record(message, error):
        raise RuntimeError("the database is down")

    down.inbox.record_failed = cannot_record  # type: ignore[method-assign]
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, mail(message_id="<m@x>"))
        # Tried again every 0.02 s (the retry waits at most poll_interval_s): three failed
        # attempts before the row that cannot be written either.
        config = email_config(imap_port=port, mode="poll", poll_interval_s=0.02)
        async with running(config, down) as module:
            await wait_until(lambda: "stays unread" in (module.status.detail or ""))
        [flags] = (await imap_flags(port, USER, PASSWORD)).values()
        assert TRIED_KEYWORD not in flags and "\\Seen" not in flags
        up = RecordingWorker()  # the database is back; the butler starts again
        async with running(config, up):
            await wait_until_seen(port)
    assert up.ids == ["<m@x>"] and up.inbox.failed == []
