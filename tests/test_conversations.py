"""Conversations: a follow-up comes with what was said before (in the classifier's prompt and
the routed prompt), a reply to one of our messages goes back to the butler that sent it
without a classification session (Telegram and email), and Telegram's /start and /help are
answered without any butler."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from butlers.switchboard.conversation import HISTORY_INTRO
from tests.conftest import StartButler, eventually
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.mail import SmtpServer
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_email import start_mail_fleet
from tests.test_email_tls import PASSWORD, USER
from tests.test_email_webhook import post as post_mail
from tests.test_inbox import classifier_prompt, is_classifier, model, turn
from tests.test_telegram import CHAT, start_telegram_fleet

ANSWERS = {
    "health": "Logged.",
    "relationship": "Noted the birthday.",
    "general": "General here.",
}


def butler_prompts(api: ScriptedMessagesAPI, butler: str) -> list[str]:
    """The first user message of each session `butler` ran (its routed prompt)."""
    return [
        json.dumps(body["messages"][0])
        for body in api.requests
        if not is_classifier(body)
        and turn(body) == 0
        and any(t["name"].startswith(f"mcp__{butler}__") for t in body.get("tools", []))
    ]


def classifier_prompts(api: ScriptedMessagesAPI) -> list[str]:
    return [classifier_prompt(b) for b in api.requests if is_classifier(b) and turn(b) == 0]


async def inbox(conn) -> list[dict]:
    rows = await conn.fetch("SELECT * FROM inbox ORDER BY id")
    return [dict(r) for r in rows]


async def test_a_follow_up_comes_with_the_conversation_so_far(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(model("health", ANSWERS))
    switchboard, _ = await start_telegram_fleet(start_butler, tmp_path, bot_api)
    await bot_api.push_text(CHAT, "Log my weight: 80kg")
    await bot_api.wait_sent(1)
    await bot_api.push_text(CHAT, "and yesterday it was 81")
    await bot_api.wait_sent(2)

    first, second = classifier_prompts(scripted_api)
    assert HISTORY_INTRO not in first
    block = re.search(r"<<<HISTORY (\w{16})\n(.*)\nHISTORY \1>>>", second, re.S)
    assert block is not None, second
    assert block.group(2) == "Ada L said: Log my weight: 80kg\nhealth answered: Logged."
    # The routed prompt carries it too: the butler knows what "and yesterday" follows.
    routed = butler_prompts(scripted_api, "health")
    assert len(routed) == 2 and HISTORY_INTRO not in routed[0]
    assert "and yesterday it was 81" in routed[1]
    assert "Ada L said: Log my weight: 80kg" in routed[1]
    rows = await inbox(await db_conn(switchboard.config.database))
    assert [r["conversation"] for r in rows] == [f"telegram:{CHAT}"] * 2


async def test_a_telegram_reply_goes_back_to_the_butler_without_a_classifier(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(model("health", ANSWERS))
    switchboard, _ = await start_telegram_fleet(start_butler, tmp_path, bot_api)
    conn = await db_conn(switchboard.config.database)
    await bot_api.push_text(CHAT, "Log my weight: 80kg")
    await bot_api.wait_sent(1)
    [ours] = bot_api.sent_message_ids()

    async def marked_sent() -> bool:  # affinity follows what the outbox knows it sent
        return await conn.fetchval("SELECT status FROM outbox") == "sent"

    await eventually(marked_sent)
    await bot_api.push_text(CHAT, "and yesterday 81", reply_to=ours)
    await bot_api.wait_sent(2)
    assert len(classifier_prompts(scripted_api)) == 1  # the reply needed no classification
    # And the butler reads what it replies to (an answer older than the history shown left
    # "move it to 16:00" without its dentist: a walkthrough), in a block of its own, as data.
    content = json.loads(butler_prompts(scripted_api, "health")[-1])["content"]
    routed = content if isinstance(content, str) else " ".join(b.get("text", "") for b in content)
    assert "The message replies to a message of ours, quoted between the REPLIED_TO" in routed
    block = re.search(r"<<<REPLIED_TO (\w{16})\n(.*)\nREPLIED_TO \1>>>", routed, re.S)
    assert block is not None and block.group(2) == "Logged.", routed
    rows = await inbox(conn)
    assert [(r["classified_via"], r["routed_to"]) for r in rows] == [
        ("claude", "health"),
        ("thread", "health"),
    ]
    # Affinity expires after thread_affinity_days: then the classifier decides again.
    await conn.execute("UPDATE outbox SET created_at = now() - interval '31 days'")
    await bot_api.push_text(CHAT, "and the day before 82", reply_to=ours)
    await bot_api.wait_sent(3)
    assert len(classifier_prompts(scripted_api)) == 2
    assert (await inbox(conn))[-1]["classified_via"] == "claude"


async def test_an_email_reply_in_our_thread_goes_back_to_the_butler(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted_api.respond_with(model("relationship", ANSWERS))
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", "hook")
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard = await start_mail_fleet(
            start_butler, tmp_path, 1, smtp, monkeypatch, mode="webhook"
        )
        conn = await db_conn(switchboard.config.database)

        async def post(
            message_id: str, references: str = "", sender: str = "user@example.com"
        ) -> None:
            payload = {
                "from": sender,
                "subject": "Anna",
                "text": "Anna's birthday is May 3" if not references else "and Tom's is June 1",
                "message_id": message_id,
                "headers": {"References": references} if references else {},
            }
            assert await post_mail(switchboard.base_url, payload, b"Bearer hook") == 200

        await post("<m1@x>")
        [reply] = await smtp.wait_for(1)

        async def marked_sent() -> bool:
            return await conn.fetchval("SELECT status FROM outbox") == "sent"

        await eventually(marked_sent)
        await post("<m2@x>", references=f"<m1@x> {reply['Message-ID']}")
        await smtp.wait_for(2)
        # Someone else in the thread (CC'd, or claiming its root): their own conversation,
        # with none of the first person's history, and no affinity to our reply to them.
        await post(
            "<m3@x>", references=f"<m1@x> {reply['Message-ID']}", sender="kid@family.example"
        )
        await smtp.wait_for(3)
    assert len(classifier_prompts(scripted_api)) == 2
    assert HISTORY_INTRO not in classifier_prompts(scripted_api)[1]
    assert "Anna's birthday" not in butler_prompts(scripted_api, "relationship")[-1]
    rows = await inbox(conn)
    assert [(r["classified_via"], r["routed_to"], r["conversation"]) for r in rows] == [
        ("claude", "relationship", "email:user@example.com:<m1@x>"),
        ("thread", "relationship", "email:user@example.com:<m1@x>"),
        ("claude", "relationship", "email:kid@family.example:<m1@x>"),
    ]


@pytest.mark.parametrize("command", ["/start", "/help", "/help@butler_bot"])
async def test_start_and_help_are_answered_without_any_butler(
    command: str,
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(model("health", ANSWERS))
    switchboard, _ = await start_telegram_fleet(start_butler, tmp_path, bot_api)
    await bot_api.push_text(CHAT, command)
    [sent] = await bot_api.wait_sent(1)
    assert "• general: General things." in sent["text"]
    assert "• health: Health things." in sent["text"] and "switchboard" not in sent["text"]
    assert scripted_api.requests == []  # no Claude Code session at all
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT count(*) FROM routing_log") == 0
    assert (await inbox(conn))[0]["classified_via"] == "command"


async def test_the_chat_shows_typing_while_a_message_is_processed(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    scripted_api.respond_with(model("health", ANSWERS))
    scripted_api.delay_for = lambda body: 0 if is_classifier(body) else 1.0
    await start_telegram_fleet(start_butler, tmp_path, bot_api)
    await bot_api.push_text(CHAT, "Log my weight: 80kg")
    await bot_api.wait_sent(1)
    assert {"chat_id": CHAT, "action": "typing"} in [
        {"chat_id": int(a["chat_id"]), "action": a["action"]} for a in bot_api.chat_actions
    ]


async def test_a_reply_to_a_butler_that_is_gone_is_classified_afresh(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Thread affinity follows the butler that answered; if it is unreachable now, the
    classifier decides instead of the reply failing for thread_affinity_days."""
    first, later = model("health", ANSWERS), model("general", ANSWERS)
    classified = []

    def respond(body: dict) -> list[dict]:
        if is_classifier(body) and turn(body) == 0:
            classified.append(body)
        return (first if len(classified) <= 1 else later)(body)

    scripted_api.respond_with(respond)
    switchboard, targets = await start_telegram_fleet(start_butler, tmp_path, bot_api)
    conn = await db_conn(switchboard.config.database)
    await bot_api.push_text(CHAT, "Log my weight: 80kg")
    await bot_api.wait_sent(1)
    [ours] = bot_api.sent_message_ids()

    async def marked_sent() -> bool:
        return await conn.fetchval("SELECT status FROM outbox") == "sent"

    await eventually(marked_sent)
    await targets["health"].stop()
    await bot_api.push_text(CHAT, "and yesterday 81", reply_to=ours)
    sent = await bot_api.wait_sent(2)
    assert sent[1]["text"] == "General here."
    rows = await inbox(conn)
    assert [(r["classified_via"], r["routed_to"], r["status"]) for r in rows][1] == (
        "claude",
        "general",
        "done",
    )


def test_help_lists_only_the_butlers_a_message_can_reach() -> None:
    """/help names neither the switchboard, nor a stale row (its directory is gone), nor a row
    that was a switchboard (an old name of it): route refuses all three."""
    from butlers.switchboard.conversation import help_text

    rows = [
        {"name": "switchboard", "description": "front door"},
        {"name": "general", "description": "anything else", "stale": False},
        {"name": "gone", "description": "removed", "stale": True},
        {"name": "frontdoor", "description": "old name", "is_switchboard": True},
    ]
    text = help_text(rows, switchboard="switchboard")
    assert "• general: anything else" in text
    assert "gone" not in text and "frontdoor" not in text and "front door" not in text
