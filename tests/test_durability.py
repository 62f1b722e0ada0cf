"""Stored before acknowledged: a Telegram update is acknowledged (the next getUpdates asks
with an offset past it; the webhook answers 200) only once it is in the inbox. When the inbox
cannot take it, the update stays unacknowledged, and Telegram delivers it again until it can."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.conftest import WEBHOOK_SECRET, StartButler, eventually
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_telegram import CHAT, answer_notes, notes_fleet


async def test_update_is_not_acknowledged_until_the_inbox_has_stored_it(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards telegram.py's poll loop: an update whose store failed is not passed by the
    offset (Telegram would forget it: the message would be lost); it is fetched again, and
    once the inbox is back it is stored and answered exactly once."""
    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api)
    await bot_api.wait_until(lambda: bool(bot_api.polls))  # the intake loop is polling
    conn = await db_conn(switchboard.config.database)
    await conn.execute("ALTER TABLE inbox RENAME TO inbox_away")  # every insert now fails
    try:
        update_id = await bot_api.push_text(CHAT, "note-1")
        # Fetched, not stored, fetched again: the loop retries the same update, and never
        # asks with an offset past it meanwhile.
        await bot_api.wait_until(
            lambda: bot_api.deliveries(update_id) >= 2 or bot_api.acknowledged(update_id)
        )
        assert not bot_api.acknowledged(update_id), bot_api.polls
        assert bot_api.deliveries(update_id) >= 2
        assert await conn.fetchval("SELECT count(*) FROM inbox_away") == 0
    finally:
        await conn.execute("ALTER TABLE inbox_away RENAME TO inbox")

    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": "noted 1"}
    await bot_api.wait_until(lambda: bot_api.acknowledged(update_id))
    # A later message is answered next: the first one was not answered twice meanwhile.
    second_id = await bot_api.push_text(CHAT, "note-2")
    await bot_api.wait_sent(2)
    assert [s["text"] for s in bot_api.sent] == ["noted 1", "noted 2"]

    async def both_done() -> bool:
        return await conn.fetchval("SELECT bool_and(status = 'done') FROM inbox")

    await eventually(both_done)
    rows = await conn.fetch("SELECT external_id FROM inbox ORDER BY id")
    assert [r["external_id"] for r in rows] == [str(update_id), str(second_id)]


async def test_webhook_update_is_refused_until_the_inbox_has_stored_it(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards telegram.py's webhook: it answers 200 (which tells Telegram to forget the
    update) only once the update is stored; when the inbox cannot take it, the answer is an
    error, so Telegram posts it again, and that post is stored and answered once."""
    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api, mode="webhook")
    update = bot_api.text_update(CHAT, "note-1")
    url = f"{switchboard.base_url}/telegram/webhook"
    headers = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
    conn = await db_conn(switchboard.config.database)
    async with aiohttp.ClientSession() as session:
        await conn.execute("ALTER TABLE inbox RENAME TO inbox_away")
        try:
            async with session.post(url, json=update, headers=headers) as response:
                assert response.status >= 500
                assert "inbox" not in await response.text()  # no detail for the caller
        finally:
            await conn.execute("ALTER TABLE inbox_away RENAME TO inbox")
        for body in (update, bot_api.text_update(CHAT, "note-2")):  # Telegram's retry, then
            async with session.post(url, json=body, headers=headers) as response:
                assert response.status == 200
    await bot_api.wait_sent(2)
    assert [s["text"] for s in bot_api.sent] == ["noted 1", "noted 2"]
    assert await conn.fetchval("SELECT count(*) FROM inbox") == 2
