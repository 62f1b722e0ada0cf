"""Stored before acknowledged: a Telegram update is acknowledged (the next getUpdates asks
with an offset past it; the webhook answers 200) only once it is in the inbox. When the inbox
cannot take it, the update stays unacknowledged, and Telegram delivers it again until it can."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

import butlers.switchboard.worker as worker_module
from butlers.claude_code import OVERLOADED
from butlers.switchboard.replies import sorry
from tests.conftest import WEBHOOK_SECRET, StartButler, eventually
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI, tool_use
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


OVERLOAD = (529, "overloaded_error", "Overloaded")


async def test_a_message_the_ai_service_is_too_busy_for_is_answered_once_it_is_back(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Messages API overloaded for a while (529): every message of that while failed for
    good, its sender told to send it again (a bad day's walkthrough). A session that failed
    so before doing anything leaves its message in the queue, tried again later (30 s, then
    as long as it has waited, up to an hour); nobody is told anything meanwhile, and the
    answer comes once the service is back."""
    monkeypatch.setattr(worker_module, "BUSY_RETRY_MIN_S", 0.5)  # 30 s in earnest
    scripted_api.respond_with(answer_notes)
    scripted_api.error = OVERLOAD
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api)
    conn = await db_conn(switchboard.config.database)
    await bot_api.push_text(CHAT, "note-1")

    async def put_back() -> bool:
        row = await conn.fetchrow("SELECT status, error FROM inbox")
        return row is not None and row["status"] == "queued" and OVERLOADED in (row["error"] or "")

    await eventually(put_back)
    await eventually(put_back)  # and again, after its first wait: still nobody told
    assert bot_api.sent == []
    scripted_api.error = None
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": "noted 1"}
    row = await conn.fetchrow("SELECT status, attempts, meta FROM inbox")
    assert row["status"] == "done" and row["attempts"] == 1  # put back, not counted
    assert "deferred_since" in row["meta"]


async def test_a_session_that_acted_before_the_service_failed_is_not_run_again(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Put back only when nothing was done: a session that called a tool, then met the
    overloaded API, may have acted (a note kept, a mail sent): run again, it would act twice.
    Its message fails, its sender told, as before."""
    scripted_api.respond_with(lambda _body: [tool_use("mcp__general__state_set", {
        "key": "acted", "value": 1})])  # fmt: skip
    # Its first request answered (the tool call), every later one overloaded.
    scripted_api.error_for = lambda body: (
        OVERLOAD if any(m["role"] == "assistant" for m in body["messages"]) else None
    )
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api)
    conn = await db_conn(switchboard.config.database)
    await bot_api.push_text(CHAT, "note-1")
    [sent] = await bot_api.wait_sent(1)
    assert sent["text"].startswith(sorry("failed", "general"))
    row = await conn.fetchrow("SELECT status, error, meta FROM inbox")
    assert row["status"] == "failed" and OVERLOADED in row["error"], row
    assert "deferred_since" not in row["meta"]
    assert scripted_api.tool_results()  # the tool did run
