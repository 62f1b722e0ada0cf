"""SMTP refusing a recipient, against the real aiosmtpd of tests/fakes/mail.py and the whole
switchboard (mail in through the webhook, answered by real butlers through Claude Code):

- a 5xx to RCPT TO is final for that mail: `failed` with the server's reply, never retried;
- a 4xx is tried again with the outbox's backoff, and sent once the server takes it;
- neither holds back the replies to other addresses (delivery is in order per channel, so a
  retried row at the head would have stopped every later reply for `reply_retry_hours`);
  the replies to the address that is refused for now still go out in their order.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from tests.conftest import StartButler, eventually
from tests.fakes.mail import SmtpServer
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_cli_client import run_cli
from tests.test_email import start_mail_fleet
from tests.test_email_tls import PASSWORD, USER
from tests.test_email_webhook import post
from tests.test_inbox import model

GONE, FULL, GOOD = "gone@example.com", "full@example.com", "user@example.com"
NO_SUCH_USER = "550 5.1.1 No such user here"
MAILBOX_FULL = "451 4.2.2 Mailbox full, try again later"


async def rows_by_recipient(conn: asyncpg.Connection) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for row in await conn.fetch("SELECT * FROM outbox ORDER BY id"):
        rows.setdefault(row["recipient"], []).append(dict(row))
    return rows


async def test_a_refused_recipient_never_holds_back_the_others(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted_api.respond_with(model("general", {"general": "Noted."}))
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", "hook")
    refuse = {GONE: NO_SUCH_USER, FULL: MAILBOX_FULL}
    with SmtpServer(users={USER: PASSWORD}, refuse=refuse) as smtp:
        switchboard = await start_mail_fleet(
            start_butler,
            tmp_path,
            1,
            smtp,
            monkeypatch,
            mode="webhook",
            allowed_senders=(GONE, FULL, GOOD),
        )
        conn = await db_conn(switchboard.config.database)
        # Answered in this order: the replies are queued in it.
        for n, sender in enumerate([GONE, FULL, GOOD, FULL, GOOD]):
            payload = {"from": sender, "text": f"note {n}", "message_id": f"<n{n}@x>"}
            assert await post(switchboard.base_url, payload, b"Bearer hook") == 200

        # The replies to the good address go out while the full mailbox is refused, also the
        # one queued after the full mailbox's second reply (which waits for its first).
        sent = await smtp.wait_for(2, timeout_s=120)
        assert [(m["To"], m["In-Reply-To"]) for m in sent] == [(GOOD, "<n2@x>"), (GOOD, "<n4@x>")]

        async def full_retried_and_all_queued() -> bool:
            full = (await rows_by_recipient(conn)).get(FULL, [])
            return len(full) == 2 and full[0]["attempts"] >= 2

        await eventually(full_retried_and_all_queued, timeout_s=120)  # backoff: 1 s, then 2 s
        rows = await rows_by_recipient(conn)
        [gone] = rows[GONE]
        assert (gone["status"], gone["attempts"]) == ("failed", 1)  # final: not retried
        assert NO_SUCH_USER in gone["error"] and GONE in gone["error"]
        full, later = rows[FULL]
        assert full["status"] in ("pending", "sending") and MAILBOX_FULL in full["error"]
        # The second reply to the full mailbox waits behind the first: never tried yet.
        assert (later["status"], later["attempts"]) == ("pending", 0)
        assert len(smtp.messages) == 2

        del smtp.refuse[FULL]  # the mailbox has room again
        sent_all = await smtp.wait_for(4, timeout_s=120)  # the backoff may be at 30 s by now
    assert [(m["To"], m["In-Reply-To"]) for m in sent_all[2:]] == [
        (FULL, "<n1@x>"),
        (FULL, "<n3@x>"),
    ]

    async def marked_sent() -> bool:
        rows = await rows_by_recipient(conn)
        return [r["status"] for r in rows[FULL] + rows[GOOD]] == ["sent"] * 4

    await eventually(marked_sent)
    rows = await rows_by_recipient(conn)
    assert rows[GONE][0]["attempts"] == 1  # still: a 5xx is never tried again
    assert [r for r, _ in smtp.refusals].count(GONE) == 1


async def test_the_outbox_holds_back_only_the_recipient_a_row_is_held_for(
    pg_server, make_database, switchboard_template: str
) -> None:
    """OutboxStore on its own, row by row: a row held for its recipient (a 4xx to RCPT TO)
    lets the channel's rows to others go, never that recipient's later ones; a row the
    channel did not take (the server down) holds back everything after it, as before."""
    from butlers.db import create_pool
    from butlers.switchboard.outbox import OutboxStore, Outgoing

    pool = await create_pool(pg_server, await make_database(switchboard_template))
    store = OutboxStore(pool)
    try:
        async with pool.acquire() as conn:
            await store.add(
                conn,
                [Outgoing("reply", "email", to, f"to {to}") for to in ("a@x", "b@x", "a@x", "c@x")],
                None,
            )
        ids = [r["id"] for r in await pool.fetch("SELECT id FROM outbox ORDER BY id")]

        async def claimed() -> int | None:
            delivery = await store.claim("email", "r1", 60)
            return None if delivery is None else ids.index(delivery.id)

        async def due_now(row: int) -> None:
            await pool.execute("UPDATE outbox SET next_attempt_at = now() WHERE id = $1", ids[row])

        assert await claimed() == 0
        await store.later(ids[0], "451 mailbox full", 3600, held_for_recipient=True)
        assert await claimed() == 1  # b@x goes while a@x's first row waits
        await store.later(ids[1], "the server is down", 3600)  # not held: blocks the channel
        assert await claimed() is None
        assert 3000 < (await store.head_due_in_s("email") or 0) <= 3600
        await due_now(1)
        assert await claimed() == 1
        await store.sent(ids[1], ["<b@x>"])
        assert await claimed() == 3  # c@x; a@x's second row waits behind its first
        await store.sent(ids[3], ["<c@x>"])
        assert await claimed() is None
        await due_now(0)
        assert await claimed() == 0
        await store.later(ids[0], "the server is down", 3600)  # no longer held: its mark goes
        meta = await pool.fetchval("SELECT meta FROM outbox WHERE id = $1", ids[0])
        assert "held_for_recipient" not in meta
        await due_now(0)
        assert await claimed() == 0
        await store.sent(ids[0], ["<a1@x>"])
        assert await claimed() == 2
    finally:
        await pool.close()


async def test_a_reply_refused_for_good_is_sent_again_by_the_operator(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 5xx is final, and once the cause is fixed (a provider's daily quota, an address
    refused by mistake) `butlers outbox retry ID` sends that very answer again: it was lost
    for good (a walkthrough). A row that did not fail is not sent twice."""
    scripted_api.respond_with(model("general", {"general": "Noted."}))
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", "hook")
    with SmtpServer(users={USER: PASSWORD}, refuse={GONE: NO_SUCH_USER}) as smtp:
        switchboard = await start_mail_fleet(
            start_butler, tmp_path, 1, smtp, monkeypatch, mode="webhook", allowed_senders=(GONE,)
        )
        conn = await db_conn(switchboard.config.database)
        payload = {"from": GONE, "text": "note", "message_id": "<q1@x>"}
        assert await post(switchboard.base_url, payload, b"Bearer hook") == 200

        async def failed() -> bool:
            return await conn.fetchval("SELECT status FROM outbox") == "failed"

        await eventually(failed, timeout_s=120)
        row_id = await conn.fetchval("SELECT id FROM outbox")
        code, out, err = await cli_of(switchboard, "inbox")
        assert code == 0, err
        assert "reply not delivered: " in out and NO_SUCH_USER in out, out
        assert f"(`butlers outbox retry {row_id}` sends it again once that is fixed)" in out
        del smtp.refuse[GONE]  # the cause is fixed
        code, out, err = await cli_of(switchboard, "outbox", "retry", str(row_id))
        assert code == 0, err
        earlier = await conn.fetchval("SELECT meta->'retries'->0->>'error' FROM outbox")
        assert NO_SUCH_USER in earlier
        assert out.strip() == (
            f"outbox row {row_id} (reply to {GONE} on email) is sent again (it failed: {earlier})"
        )
        [sent] = await smtp.wait_for(1, timeout_s=60)
        assert (sent["To"], sent["In-Reply-To"]) == (GONE, "<q1@x>")

        async def marked_sent() -> bool:
            return await conn.fetchval("SELECT status FROM outbox") == "sent"

        await eventually(marked_sent)
        code, out, err = await cli_of(switchboard, "outbox", "retry", str(row_id))
        assert code == 1 and f"outbox row {row_id} is sent: only a failed one" in err
        code, out, err = await cli_of(switchboard, "outbox", "retry", "999")
        assert code == 1 and "no outbox row with id 999" in err
    assert len(smtp.messages) == 1


async def cli_of(switchboard, *args: str) -> tuple[int, str, str]:
    """A command against this mail fleet, which runs without a token: none is sent (a token
    goes only to a switchboard that proves it holds it, and this one holds none)."""
    return await run_cli(*args, "--url", switchboard.sse_url)
