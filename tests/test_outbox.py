"""The durable outbox: a channel that is down delays replies but loses none, they arrive in
order and once; what the channel refuses for good, or past the retry budget, is visible as
failed; a crash can at most send one reply twice (the documented window), never route a
message again."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from butlers.config import SwitchboardConfig
from tests.conftest import StartButler, eventually
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.mail import SmtpServer
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_cli_client import run_cli
from tests.test_email import start_mail_fleet
from tests.test_email_tls import PASSWORD, USER
from tests.test_email_webhook import post as post_mail
from tests.test_telegram import CHAT, answer_notes, notes_fleet
from tests.test_tracing import CHAT as FLEET_CHAT
from tests.test_tracing import Fleet


async def outbox_rows(conn: asyncpg.Connection) -> list[dict]:
    return [dict(r) for r in await conn.fetch("SELECT * FROM outbox ORDER BY id")]


async def test_telegram_down_for_a_while_loses_nothing_and_keeps_the_order(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api)
    conn = await db_conn(switchboard.config.database)
    bot_api.sends_down = True  # 502 Bad Gateway, as when Telegram has an outage
    for n in range(1, 4):
        await bot_api.push_text(CHAT, f"note-{n}")

    async def all_answered_and_retried() -> bool:
        done = await conn.fetchval("SELECT count(*) FROM inbox WHERE status = 'done'")
        return done == 3 and bot_api.down_sends >= 3

    await eventually(all_answered_and_retried)
    # Every message is handled and its reply is on record while the channel is down.
    rows = await outbox_rows(conn)
    assert [(r["kind"], r["text"]) for r in rows] == [("reply", f"noted {n}") for n in (1, 2, 3)]
    assert {r["status"] for r in rows} <= {"pending", "sending"} and bot_api.sent == []
    # `butlers inbox` says their replies are not sent yet ("done" alone read as sent).
    code, out, err = await run_cli("inbox", "--url", switchboard.sse_url)
    assert code == 0, err
    assert out.count("reply not sent yet: ") >= 1 and "Bad Gateway" in out, out
    bot_api.sends_down = False
    sent = await bot_api.wait_sent(3)
    assert [s["text"] for s in sent] == ["noted 1", "noted 2", "noted 3"]
    await bot_api.push_text(CHAT, "note-4")  # a sentinel: nothing else is still on its way
    await bot_api.wait_sent(4)
    assert [s["text"] for s in bot_api.sent] == [f"noted {n}" for n in range(1, 5)]

    async def all_marked_sent() -> bool:  # the channel answered; the row is marked next
        return [r["status"] for r in await outbox_rows(conn)] == ["sent"] * 4

    await eventually(all_marked_sent)
    rows = await outbox_rows(conn)
    assert rows[0]["attempts"] > 1 and rows[0]["sent_ids"]  # retried, then taken
    # Each reply answers the person's own message.
    assert [p.get("reply_parameters") is not None for p in bot_api.sent_params] == [True] * 4


async def test_a_reply_still_failing_after_the_retry_budget_is_failed(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(
        start_butler,
        tmp_path,
        bot_api,
        switchboard=replace(SwitchboardConfig(), reply_retry_hours=2 / 3600),  # 2 s
    )
    conn = await db_conn(switchboard.config.database)
    bot_api.sends_down = True
    await bot_api.push_text(CHAT, "note-1")

    async def failed() -> bool:
        return await conn.fetchval("SELECT status FROM outbox") == "failed"

    await eventually(failed)
    [row] = await outbox_rows(conn)
    assert row["attempts"] >= 2 and "Bad Gateway" in row["error"]
    inbox = await conn.fetchrow("SELECT status, reply FROM inbox")
    assert (inbox["status"], inbox["reply"]) == ("done", "noted 1")  # handled; not delivered
    # `butlers inbox` says so under the done message (it said nothing: only `outbox` did).
    code, out, err = await run_cli("inbox", "--url", switchboard.sse_url)
    assert code == 0, err
    assert "reply not delivered: " in out and "Bad Gateway" in out
    assert "(`butlers outbox retry " in out
    bot_api.sends_down = False
    await bot_api.push_text(CHAT, "note-2")  # the channel is back: later replies go out
    [sent] = await bot_api.wait_sent(1)
    assert sent["text"] == "noted 2"


async def test_smtp_down_for_a_while_loses_nothing_and_keeps_the_order(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted_api.respond_with(answer_notes)
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", "hook")
    smtp = SmtpServer(users={USER: PASSWORD})  # not started yet: connections are refused
    switchboard = await start_mail_fleet(
        start_butler, tmp_path, 1, smtp, monkeypatch, mode="webhook"
    )
    conn = await db_conn(switchboard.config.database)
    for n in range(1, 4):
        payload = {
            "from": "user@example.com",
            "subject": f"note-{n}",
            "text": f"note-{n}",
            "message_id": f"<n{n}@x>",
        }
        assert await post_mail(switchboard.base_url, payload, b"Bearer hook") == 200

    async def retried() -> bool:
        rows = await outbox_rows(conn)
        return len(rows) == 3 and rows[0]["attempts"] >= 2

    await eventually(retried)
    with smtp:  # the server is back
        received = await smtp.wait_for(3)
    assert [m.get_content().strip() for m in received] == ["noted 1", "noted 2", "noted 3"]
    assert [m["In-Reply-To"] for m in received] == ["<n1@x>", "<n2@x>", "<n3@x>"]

    async def all_marked_sent() -> bool:
        return [r["status"] for r in await outbox_rows(conn)] == ["sent"] * 3

    await eventually(all_marked_sent)
    rows = await outbox_rows(conn)
    assert [r["sent_ids"] for r in rows] == [[m["Message-ID"]] for m in received]


async def test_a_crash_between_sending_and_marking_sends_at_most_one_duplicate(
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    pg_server,
) -> None:
    """SIGKILL while Telegram holds the reply (taken, not yet acknowledged): the message is
    not routed again after the restart (its row was finished with the reply queued, in one
    transaction); the reply is sent again, once: the documented one-duplicate window."""
    scripted_api.respond_with(answer_notes)
    fleet = Fleet(tmp_path, bot_api, scripted_api, pg_server)
    toml = fleet.config_dir / "switchboard" / "butler.toml"
    toml.write_text(
        toml.read_text() + '[[switchboard.triage]]\nchannel = "telegram"\nbutler = "general"\n'
    )
    try:
        butlers = fleet.up()
        await butlers.start()
        await butlers.wait_ready()
        bot_api.hold_sends = True
        await bot_api.push_text(FLEET_CHAT, "note-1")
        await bot_api.wait_attempts(1)  # Telegram has the reply; its answer is held
        os.kill(butlers.process.pid, signal.SIGKILL)
        await butlers.process.wait()
        bot_api.release_sends()
        again = fleet.up()
        await again.start()
        await again.wait_ready()
        sent = await bot_api.wait_sent(2)
        assert [s["text"] for s in sent] == ["noted 1", "noted 1"]
        assert await again.stop() == 0, again.stderr
        rows = await fleet.routing_log()
        assert len(rows) == 1  # routed once, before the crash
        conn = await asyncpg.connect(pg_server.dsn(fleet.database("switchboard")))
        try:
            [outbox] = await conn.fetch("SELECT status, attempts FROM outbox")
            assert (outbox["status"], outbox["attempts"]) == ("sent", 2)
        finally:
            await conn.close()
    finally:
        await fleet.drop()


async def test_a_refused_smtp_login_is_tried_again_until_the_password_works(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards EmailModule.deliver: a login the server refuses (535: the password changed,
    until the operator fixes it) is not the mail's fault; making it final would lose every
    reply queued meanwhile. It is retried and goes out once the login works."""
    scripted_api.respond_with(answer_notes)
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", "hook")
    with SmtpServer(users={USER: "the-old-password"}) as smtp:
        switchboard = await start_mail_fleet(
            start_butler, tmp_path, 1, smtp, monkeypatch, mode="webhook"
        )
        conn = await db_conn(switchboard.config.database)
        payload = {"from": "user@example.com", "text": "note-1", "message_id": "<n1@x>"}
        assert await post_mail(switchboard.base_url, payload, b"Bearer hook") == 200

        async def refused_twice() -> bool:
            return await conn.fetchval("SELECT attempts FROM outbox") == 2

        await eventually(refused_twice)
        [row] = await outbox_rows(conn)
        assert row["status"] in ("pending", "sending") and "refused the login" in row["error"]
        smtp._users[USER] = PASSWORD  # the operator fixed it
        [mail] = await smtp.wait_for(1)
    assert mail.get_content().strip() == "noted 1"


async def test_a_channel_failing_in_a_way_it_does_not_explain_gives_up_after_a_few_tries(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards OutboxSender: an exception a channel does not turn into a DeliveryError (a
    bug) is retried MAX_INTERNAL_ERRORS times, then the row is failed: delivery is in order,
    so a row retried for the whole budget would hold up the channel's later replies."""
    from butlers.modules.telegram import TelegramModule
    from butlers.switchboard.outbox import MAX_INTERNAL_ERRORS

    deliver = TelegramModule.deliver
    broken = True

    async def maybe_broken(self: TelegramModule, delivery):
        if broken:
            raise RuntimeError("a bug in the channel")
        return await deliver(self, delivery)

    monkeypatch.setattr(TelegramModule, "deliver", maybe_broken)
    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api)
    conn = await db_conn(switchboard.config.database)
    await bot_api.push_text(CHAT, "note-1")

    async def failed() -> bool:
        return await conn.fetchval("SELECT status FROM outbox") == "failed"

    await eventually(failed)
    [row] = await outbox_rows(conn)
    assert row["attempts"] == MAX_INTERNAL_ERRORS
    assert row["error"] == "internal error (RuntimeError)"
    broken = False
    await bot_api.push_text(CHAT, "note-2")
    [sent] = await bot_api.wait_sent(1)
    assert sent["text"] == "noted 2"


async def test_a_reply_taken_while_the_database_is_away_is_marked_sent_not_sent_again(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Telegram took the reply, then marking its row sent failed (the database restarting):
    the row stayed `sending` by this process, which took it again at once and sent it twice
    (a red team). It is marked sent once the database is back, and sent once."""
    import asyncpg

    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api)
    assert switchboard.switchboard is not None
    store = switchboard.switchboard.outbox.store
    marked = store.sent
    refusals = 3

    async def database_away_at_first(delivery_id: int, sent_ids: Any) -> None:
        nonlocal refusals
        if refusals:
            refusals -= 1
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle")
        await marked(delivery_id, sent_ids)

    store.sent = database_away_at_first  # type: ignore[method-assign]
    await bot_api.push_text(CHAT, "note-1")
    await bot_api.wait_sent(1)
    conn = await db_conn(switchboard.config.database)

    async def marked_sent() -> bool:
        return await conn.fetchval("SELECT status FROM outbox") == "sent"

    await eventually(marked_sent)
    assert refusals == 0
    await bot_api.push_text(CHAT, "note-2")  # a sentinel: nothing else is on its way
    await bot_api.wait_sent(2)
    assert [s["text"] for s in bot_api.sent] == ["noted 1", "noted 2"]


async def test_a_slow_bot_api_gets_each_reply_once(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    """A Bot API that answers sendMessage after 6 s: python-telegram-bot gave up at 5 s and
    the reply was sent again (three times at 7 s: a red team). It waits READ_TIMEOUT_S."""
    scripted_api.respond_with(answer_notes)
    await notes_fleet(start_butler, tmp_path, bot_api)
    bot_api.hold_sends = True
    await bot_api.push_text(CHAT, "note-1")
    await bot_api.wait_attempts(1)
    await asyncio.sleep(6)  # past python-telegram-bot's own 5 s
    bot_api.release_sends()
    await bot_api.push_text(CHAT, "note-2")  # a sentinel
    await bot_api.wait_sent(2)
    assert [s["text"] for s in bot_api.sent] == ["noted 1", "noted 2"]
    assert len(bot_api.send_attempts) == 2
