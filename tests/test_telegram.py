"""Telegram end to end: python-telegram-bot polling a fake Bot API on loopback, the real
Claude Code classifying, real butlers answering, the reply sent back to the chat."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
import pytest

from butlers.config import TelegramConfig, TriageRule
from butlers.modules.telegram import EDIT_NOT_READ, TEXT_ONLY
from butlers.tasks import within
from tests.conftest import (
    WEBHOOK_SECRET,
    StartButler,
    butler_config,
    eventually,
    free_port,
    write_butler_dir,
)
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI, text
from tests.test_inbox import model

CHAT = 12345
STRANGER = 99999  # allowed nowhere


async def start_telegram_fleet(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    *,
    mode: str = "polling",
    triage=(),
    names=("general", "health"),
    chats=(CHAT,),
    telegram: dict | None = None,
    **switchboard_overrides,
):
    """Butlers `names` and a switchboard whose Telegram module talks to `bot_api` and allows
    `chats`; `telegram` adds [modules.telegram] keys, the rest goes to the switchboard's
    config (e.g. `switchboard=SwitchboardConfig(...)`)."""
    config_dir = tmp_path / "config"
    targets = {}
    for name in names:
        daemon = await start_butler(butler_config(name))
        write_butler_dir(config_dir, name, daemon.port, description=f"{name.title()} things.")
        targets[name] = daemon
    port = free_port()
    write_butler_dir(config_dir, "switchboard", port)
    module = TelegramConfig(
        mode=mode,
        allowed_chat_ids=tuple(map(str, chats)),
        api_base_url=bot_api.url,
        **(telegram or {}),
    )
    switchboard = await start_butler(
        butler_config(
            "switchboard",
            port=port,
            telegram=module,
            triage=tuple(triage),
            **switchboard_overrides,
        ),
        config_dir=config_dir,
    )
    return switchboard, targets


async def start_general_only(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    answer: str,
    **kwargs,
):
    """A switchboard and `general` only; a triage rule sends every Telegram message to
    `general`, whose model answers `answer` (for tests about the channel, not the LLM)."""
    scripted_api.respond_with(model("general", {"general": answer}))
    rule = TriageRule(butler="general", channel="telegram")
    switchboard, _ = await start_telegram_fleet(
        start_butler, tmp_path, bot_api, triage=[rule], names=("general",), **kwargs
    )
    return switchboard


async def test_message_is_classified_routed_and_answered_in_the_chat(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(model("health", {"health": "Logged 75 kg."}))
    switchboard, targets = await start_telegram_fleet(start_butler, tmp_path, bot_api)
    await bot_api.push_text(CHAT, "Log my weight: 75kg")
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": "Logged 75 kg."}

    conn = await db_conn(switchboard.config.database)
    [row] = await conn.fetch("SELECT * FROM routing_log")
    assert (row["source_channel"], row["source_id"], row["routed_to"]) == (
        "telegram",
        "12345",
        "health",
    )
    assert row["prompt_summary"] == "Log my weight: 75kg" and len(row["trace_id"]) == 32
    inbox = await conn.fetchrow("SELECT * FROM inbox")
    assert (inbox["status"], inbox["sender_name"], inbox["reply"]) == (
        "done",
        "Ada L",
        "Logged 75 kg.",
    )
    health = await db_conn(targets["health"].config.database)
    assert await health.fetchval("SELECT trace_id FROM sessions") == row["trace_id"]
    status = (await _health(switchboard))["modules"]
    assert {
        "name": "telegram",
        "state": "running",
        "status": "running",
        "detail": "@butler_bot",
    } in status


async def _health(daemon) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{daemon.base_url}/health") as r:
        return await r.json()


async def test_strangers_are_refused_once_and_nothing_is_routed(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(model("general"))
    switchboard, _ = await start_telegram_fleet(start_butler, tmp_path, bot_api)
    await bot_api.push_text(999, "let me in")
    await bot_api.push_text(999, "please")
    await bot_api.push_text(CHAT, "hello")  # processed after the two above
    # Intake handles updates in order: a second refusal would be sent before the answer.
    sent = await bot_api.wait_sent(2)
    assert [s["chat_id"] for s in bot_api.sent] == [999, CHAT]
    assert "private butler" in sent[0]["text"]
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(source_id) FROM inbox") == ["12345"]
    assert await conn.fetchval("SELECT count(*) FROM routing_log") == 1


async def test_stickers_and_edits_get_an_answer_saying_what_is_read(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """An edit is not read (its first version may have been acted on): said once an hour,
    not in silence (the owner who changed "at 9" to "at 10" believed it was read: a
    walkthrough); a stranger's edit gets nothing."""
    scripted_api.respond_with(model("general", {"general": "Got it."}))
    switchboard, _ = await start_telegram_fleet(start_butler, tmp_path, bot_api)
    await bot_api.push_sticker(CHAT)
    await bot_api.push_edit(CHAT, "edited text")
    await bot_api.push_edit(CHAT, "edited again")
    await bot_api.push_edit(STRANGER, "a stranger's edit")
    await bot_api.push_text(CHAT, "plain text")
    sent = await bot_api.wait_sent(3)
    assert [s["text"] for s in sent] == [TEXT_ONLY, EDIT_NOT_READ, "Got it."]
    assert all(s["chat_id"] == CHAT for s in sent)
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(text) FROM inbox") == ["plain text"]


def test_the_owners_chat_may_write_only_when_it_is_a_private_chat() -> None:
    """[switchboard.owner]'s chat may write without being listed; a group named there would
    have let every member write as the owner (a review)."""
    from types import SimpleNamespace

    from butlers.config import OwnerConfig
    from butlers.modules.telegram import TelegramModule

    def module(owner: str) -> SimpleNamespace:
        desk = SimpleNamespace(owner=OwnerConfig(telegram_chat_id=owner))
        return SimpleNamespace(config=SimpleNamespace(allowed_chat_ids=("1",)), approvals=desk)

    assert TelegramModule.allowed(module("777"), "777")
    assert not TelegramModule.allowed(module("-100500"), "-100500")
    assert not TelegramModule.allowed(module(""), "")
    assert TelegramModule.allowed(module("-100500"), "1")


async def test_burst_of_messages_all_answered_in_order(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    def echo(body: dict) -> list[dict]:
        prompt = str(body["messages"][-1])
        number = re.findall(r"message #(\d+)", str(body["messages"][0]))
        return [{"type": "text", "text": f"answer #{number[0] if number else prompt[:5]}"}]

    scripted_api.respond_with(echo)
    rule = TriageRule(butler="general", channel="telegram")  # the LLM is not what this tests
    switchboard, _ = await start_telegram_fleet(
        start_butler, tmp_path, bot_api, triage=[rule], names=("general",)
    )
    count = 30
    await asyncio.gather(*(bot_api.push_text(CHAT, f"message #{i}") for i in range(count)))
    sent = await bot_api.wait_sent(count, timeout_s=240)
    assert [s["text"] for s in sent] == [f"answer #{i}" for i in range(count)]
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT count(*) FROM inbox WHERE status = 'done'") == count


def answer_notes(body: dict) -> list[dict]:
    """A butler model that answers `note-<n>` in its prompt with `noted <n>`: each answer
    says which message it is for."""
    found = re.search(r"note-(\d+)", json.dumps(body["messages"][0]))
    return [text(f"noted {found.group(1) if found else '?'}")]


async def notes_fleet(start_butler: StartButler, tmp_path: Path, bot_api: FakeBotAPI, **kwargs):
    """A switchboard and `general`; a triage rule sends every Telegram message there."""
    rule = TriageRule(butler="general", channel="telegram")  # the LLM is not what this tests
    switchboard, _ = await start_telegram_fleet(
        start_butler, tmp_path, bot_api, triage=[rule], names=("general",), **kwargs
    )
    return switchboard


async def test_update_delivered_twice_in_one_batch_is_stored_and_answered_once(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards the inbox's idempotency on Telegram's update_id: Telegram redelivers an update
    whose acknowledgement it did not get, here twice in one getUpdates answer."""
    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api)
    update = bot_api.text_update(CHAT, "note-1")
    later = bot_api.text_update(CHAT, "note-2")
    await bot_api.push_batch(update, dict(update), later)
    # note-2 is stored after both copies and answered after the first: a second answer to
    # note-1 would come before it.
    await bot_api.wait_sent(2)
    assert bot_api.deliveries(update["update_id"]) >= 2
    assert [s["text"] for s in bot_api.sent] == ["noted 1", "noted 2"]
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT external_id FROM inbox ORDER BY id")
    assert [r["external_id"] for r in rows] == [str(update["update_id"]), str(later["update_id"])]


async def test_webhook_update_posted_twice_is_stored_and_answered_once(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards idempotency in webhook mode: Telegram posts an update again when our 200 did
    not reach it; the second post is acknowledged (200) but not stored or answered again."""
    scripted_api.respond_with(answer_notes)
    switchboard = await notes_fleet(start_butler, tmp_path, bot_api, mode="webhook")
    update = bot_api.text_update(CHAT, "note-1")
    later = bot_api.text_update(CHAT, "note-2")
    url = f"{switchboard.base_url}/telegram/webhook"
    headers = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
    async with aiohttp.ClientSession() as session:
        for body in (update, update, later):
            async with session.post(url, json=body, headers=headers) as response:
                assert response.status == 200
    await bot_api.wait_sent(2)
    assert [s["text"] for s in bot_api.sent] == ["noted 1", "noted 2"]
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT external_id FROM inbox ORDER BY id")
    assert [r["external_id"] for r in rows] == [str(update["update_id"]), str(later["update_id"])]


async def test_long_reply_is_split_and_429_is_retried(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    """Five 429s in a row: more than the rate limiter's own retries (3 after the first) and
    than the outbox's internal errors (3: a 429 that was an error of ours looked retried)."""
    long_answer = ("word " * 1200).strip()  # ~6000 characters
    switchboard = await start_general_only(
        start_butler, tmp_path, bot_api, scripted_api, long_answer
    )
    bot_api.fail_next_sends_with_429 = 5
    await bot_api.push_text(CHAT, "talk to me")
    sent = await bot_api.wait_sent(2, timeout_s=60)
    assert all(len(s["text"]) <= 4096 for s in sent)
    assert " ".join(s["text"] for s in sent) == long_answer
    assert switchboard.switchboard is not None
    pool = switchboard.switchboard.outbox.store.pool

    async def both_sent() -> bool:  # (each is marked sent right after Telegram took it)
        return await pool.fetchval("SELECT bool_and(status = 'sent') FROM outbox")

    await eventually(both_sent)
    # The rate limiter tried four times, then the outbox once more: a 429, never an error of
    # ours (three of those and a row is given up).
    assert await pool.fetchval("SELECT attempts FROM outbox ORDER BY id LIMIT 1") == 2


async def test_webhook_mode_checks_the_secret(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    switchboard = await start_general_only(
        start_butler, tmp_path, bot_api, scripted_api, "Via webhook.", mode="webhook"
    )
    update = {"update_id": 77, "message": bot_api._message(CHAT, text="hook me")}
    url = f"{switchboard.base_url}/telegram/webhook"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": "wrong"}
        ) as r:
            assert r.status == 401
        async with session.post(
            url, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
        ) as r:
            assert r.status == 200
    [sent] = await bot_api.wait_sent(1)
    assert sent["text"] == "Via webhook."
    assert "getUpdates" not in bot_api.calls


async def test_large_message_is_handled(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    switchboard = await start_general_only(
        start_butler, tmp_path, bot_api, scripted_api, "That was long."
    )
    big = "x" * 200_000  # far past Telegram's own limit: the pipeline must not care
    await bot_api.push_text(CHAT, big)
    [sent] = await bot_api.wait_sent(1)
    assert sent["text"] == "That was long."
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT length(text) FROM inbox") == 200_000
    assert len(await conn.fetchval("SELECT prompt_summary FROM routing_log")) == 200


async def test_start_up_waits_for_an_unreachable_bot_api(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted_api.respond_with(model("general", {"general": "Finally."}))
    api = FakeBotAPI()
    port = free_port()
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", api.token)
    config_dir = tmp_path / "config"
    general = await start_butler(butler_config("general"))
    write_butler_dir(config_dir, "general", general.port)
    sb_port = free_port()
    write_butler_dir(config_dir, "switchboard", sb_port)
    telegram = TelegramConfig(
        allowed_chat_ids=(str(CHAT),), api_base_url=f"http://127.0.0.1:{port}"
    )
    rule = TriageRule(butler="general", channel="telegram")
    switchboard = await start_butler(
        butler_config("switchboard", port=sb_port, telegram=telegram, triage=(rule,)),
        config_dir=config_dir,
    )

    # The Bot API is down: the switchboard still serves, and says why Telegram is not running.
    async def says_unreachable() -> bool:
        [module] = (await _health(switchboard))["modules"]
        return module["state"] == "starting" and "unreachable" in module["detail"]

    await eventually(says_unreachable)
    await api.start_on(port)
    try:
        await api.push_text(CHAT, "hello?")
        [sent] = await api.wait_sent(1, timeout_s=30)
        assert sent["text"] == "Finally."
    finally:
        await api.stop()


async def test_another_poller_costs_a_moment_and_the_module_recovers(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    """A second getUpdates with the bot's token (a replica's hand-over, a script) is answered
    409 to the first: the poller tries again at once rather than after a minute (a message
    then waited 63 s), is `failed` on /health only while the other keeps polling, and
    `running` again once it stopped (it stayed `failed` for good: a walkthrough)."""
    switchboard = await start_general_only(
        start_butler, tmp_path, bot_api, scripted_api, "Answered."
    )
    url = f"{bot_api.url}/bot{bot_api.token}/getUpdates"

    async def foreign_poll(wait_s: float) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"timeout": wait_s}) as response:
                await response.read()

    async def polling() -> bool:
        return bool(bot_api.polls)

    async def module_state() -> str:
        modules = (await _health(switchboard))["modules"]
        return next(m["status"] for m in modules if m["name"] == "telegram")

    await eventually(polling)
    await foreign_poll(0)  # once: the switchboard's waiting poll is ended with 409
    await bot_api.push_text(CHAT, "still there?")
    await within(bot_api.wait_sent(1), 20)  # (it waited 60 s)
    assert await module_state() == "running"
    # Another poller that keeps polling: failed, saying why, ...
    async with asyncio.timeout(60):
        while await module_state() != "failed":
            await foreign_poll(0.5)
    [telegram] = [m for m in (await _health(switchboard))["modules"] if m["name"] == "telegram"]
    assert "another poller is running" in telegram["detail"]

    # ... until it stops: answering, and running again (its next poll goes through).
    await bot_api.push_text(CHAT, "and now?")
    await within(bot_api.wait_sent(2), 30)
    assert await module_state() == "running"
