"""POST /email/inbound answers 200 only once the mail is in the inbox: while PostgreSQL refuses
the insert (a real trigger on the test's own inbox table, raising after the row was written),
the provider gets a 503 and nothing is left behind; once the table takes rows again, the
provider's retry (and a second copy of it) is stored once and answered once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import StartButler, log_records
from tests.fakes.mail import SmtpServer
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_email_tls import PASSWORD, USER
from tests.test_email_webhook import BEARER, post_bytes, webhook_switchboard

PAYLOAD = (
    b'{"from": "Ada <user@example.com>", "subject": "Lunch", '
    b'"text": "SECRET-SOUP at noon.", "message_id": "<store-1@x>"}'
)

REFUSE_INSERTS = """
CREATE FUNCTION refuse_inbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the inbox is refusing rows (test)';
END $$;
CREATE TRIGGER refuse_inbox AFTER INSERT ON inbox FOR EACH ROW EXECUTE FUNCTION refuse_inbox();
"""


async def test_the_webhook_answers_only_once_the_mail_is_stored(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard = await webhook_switchboard(
            start_butler, tmp_path, scripted_api, smtp, monkeypatch
        )
        conn = await db_conn(switchboard.config.database)
        await conn.execute(REFUSE_INSERTS)
        with log_records("butlers.modules.email") as records:
            status, answer = await post_bytes(switchboard.base_url, PAYLOAD, BEARER)
        assert (status, answer) == (
            503,
            {"error": "the mail could not be stored; send it again later"},
        )
        # The row the trigger saw was rolled back with the statement: nothing half-written.
        assert await conn.fetchval("SELECT count(*) FROM inbox") == 0
        [error] = [r for r in records if r.levelno == logging.ERROR]
        message = error.getMessage()
        assert "'<store-1@x>'" in message and "the inbox is refusing rows" in message
        assert "SECRET-SOUP" not in message  # the body is never logged

        await conn.execute("DROP TRIGGER refuse_inbox ON inbox")
        for _ in range(2):  # the provider's retry, and a second copy of it
            status, answer = await post_bytes(switchboard.base_url, PAYLOAD, BEARER)
            assert (status, answer) == (200, {"ok": True})
        [reply] = await smtp.wait_for(1)
        # A sentinel: the worker answers in order, so a second reply would be there by now.
        sentinel = PAYLOAD.replace(b"<store-1@x>", b"<store-2@x>")
        assert (await post_bytes(switchboard.base_url, sentinel, BEARER))[0] == 200
        replies = await smtp.wait_for(2)
    assert [m["In-Reply-To"] for m in replies] == ["<store-1@x>", "<store-2@x>"]
    assert reply["To"] == "user@example.com"
    rows = await conn.fetch("SELECT external_id, text FROM inbox ORDER BY id")
    assert [tuple(r) for r in rows] == [
        ("<store-1@x>", "SECRET-SOUP at noon."),
        ("<store-2@x>", "SECRET-SOUP at noon."),
    ]
