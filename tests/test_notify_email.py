"""notify by email: a butler's notification reaches the owner by mail when `[switchboard.owner]`
prefers it, goes into the mail thread of the conversation a session serves (Re: its subject,
In-Reply-To and References), and when the switchboard cannot be reached the butler's session
gets a clear error and goes on. Real SMTP (aiosmtpd), the real Claude Code, real butlers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastmcp import Client

from butlers.config import OwnerConfig, RuntimeConfig, SwitchboardConfig, TriageRule
from tests.conftest import StartButler, butler_config, free_port, write_butler_dir
from tests.fakes.mail import SmtpServer
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_email_tls import PASSWORD, USER, email_config
from tests.test_email_webhook import post
from tests.test_notify import general_model

OWNER = OwnerConfig(telegram_chat_id="777", email="me@example.com", prefer="email")
PLANTS = """INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at)
            VALUES ('plants', '0 8 * * *', 'Remind me to water the plants.', now())"""


async def start_general(
    start_butler: StartButler, config_dir: Path, switchboard_url: str, **overrides: Any
):
    general = await start_butler(
        butler_config(
            "general",
            switchboard_url=switchboard_url,
            runtime=RuntimeConfig(timeout_s=60, tick_interval_s=0),
            **overrides,
        )
    )
    write_butler_dir(config_dir, "general", general.port)
    return general


async def mail_notify_fleet(
    start_butler: StartButler,
    tmp_path: Path,
    smtp: SmtpServer,
    monkeypatch: pytest.MonkeyPatch,
    *,
    general_overrides: dict[str, Any] | None = None,
    switchboard_overrides: dict[str, Any] | None = None,
):
    """`general` (which knows the switchboard's URL) and a switchboard with email (webhook
    intake, SMTP out), OWNER, and a triage rule sending every mail to general; `*_overrides`:
    more of either one's ButlerConfig (the approvals' test gives its own)."""
    monkeypatch.setenv("BUTLERS_EMAIL_USER", USER)
    monkeypatch.setenv("BUTLERS_EMAIL_PASSWORD", PASSWORD)
    monkeypatch.setenv("BUTLERS_EMAIL_WEBHOOK_TOKEN", "hook")
    port = free_port()
    config_dir = tmp_path / "config"
    general = await start_general(
        start_butler, config_dir, f"http://127.0.0.1:{port}/sse", **(general_overrides or {})
    )
    write_butler_dir(config_dir, "switchboard", port)
    switchboard_config = {
        "email": email_config(smtp_port=smtp.port, mode="webhook"),
        "triage": (TriageRule(butler="general", channel="email"),),
        "switchboard": SwitchboardConfig(owner=OWNER),
    }
    switchboard = await start_butler(
        butler_config(
            "switchboard", port=port, **switchboard_config | (switchboard_overrides or {})
        ),
        config_dir=config_dir,
    )
    return switchboard, general


async def tick(butler) -> list[dict]:
    async with Client(butler.sse_url) as client:
        return (await client.call_tool("tick", {})).structured_content["ran"]


async def test_a_reminder_reaches_the_owner_by_email_when_preferred(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner has a Telegram chat and an address, and prefers email: the reminder is a
    new mail to that address (no thread to continue), from the butler's address."""
    scripted_api.respond_with(general_model)
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard, general = await mail_notify_fleet(start_butler, tmp_path, smtp, monkeypatch)
        general_db = await db_conn(general.config.database)
        await general_db.execute(PLANTS)
        ran = await tick(general)
        assert [(r["name"], r["success"]) for r in ran] == [("plants", True)]
        [sent] = await smtp.wait_for(1)
    assert smtp.recipients == [["me@example.com"]]
    assert (sent["From"], sent["To"], sent["Subject"]) == (
        "Butlers <butler@example.com>",
        "me@example.com",
        "From your general butler",
    )
    assert sent["In-Reply-To"] is None and sent["References"] is None
    assert sent["Auto-Submitted"] == "auto-generated"
    assert sent.get_content().strip() == "Time to water the plants."
    conn = await db_conn(switchboard.config.database)
    [row] = await conn.fetch("SELECT kind, channel, recipient, conversation, status FROM outbox")
    assert tuple(row)[:4] == ("notification", "email", "me@example.com", None)
    [route] = await conn.fetch("SELECT routed_to, success FROM routing_log")
    assert tuple(route) == ("email", True)


async def test_a_notification_within_a_mail_conversation_goes_into_its_thread(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While general serves a mail (Subject "Table", in a thread rooted at <t0@x>), its
    notify goes to that sender, not to the owner, as a reply in the thread; the answer
    follows in the same thread."""
    scripted_api.respond_with(general_model)
    with SmtpServer(users={USER: PASSWORD}) as smtp:
        switchboard, _ = await mail_notify_fleet(start_butler, tmp_path, smtp, monkeypatch)
        payload = {
            "from": "Ada <user@example.com>",
            "subject": "Table",
            "text": "Book the table and keep me posted",
            "message_id": "<t1@x>",
            "headers": {"References": "<t0@x>", "In-Reply-To": "<t0@x>"},
        }
        assert await post(switchboard.base_url, payload, b"Bearer hook") == 200
        notification, reply = await smtp.wait_for(2)
    assert notification.get_content().strip() == "Working on it..."
    assert reply.get_content().strip() == "Done."
    for sent in (notification, reply):
        assert (sent["To"], sent["Subject"]) == ("user@example.com", "Re: Table")
        assert sent["In-Reply-To"] == "<t1@x>"
        assert sent["References"] == "<t0@x> <t1@x>"
    assert notification["Message-ID"] != reply["Message-ID"]
    assert smtp.recipients == [["user@example.com"], ["user@example.com"]]
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT kind, recipient, conversation FROM outbox ORDER BY id")
    conversation = "email:user@example.com:<t0@x>"
    assert [tuple(r) for r in rows] == [
        ("notification", "user@example.com", conversation),
        ("reply", "user@example.com", conversation),
    ]


async def test_notify_with_the_switchboard_unreachable_is_a_clear_error(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Nothing listens at the butler's switchboard_url: the session's notify call gets an
    error naming that URL, the session goes on and finishes, and the butler keeps serving."""
    scripted_api.respond_with(general_model)
    nowhere = f"http://127.0.0.1:{free_port()}/sse"
    general = await start_general(start_butler, tmp_path / "config", nowhere)
    general_db = await db_conn(general.config.database)
    await general_db.execute(PLANTS)
    [ran] = await tick(general)
    assert (ran["name"], ran["success"]) == ("plants", True)  # the session finished
    [result] = scripted_api.tool_results()
    assert result["is_error"] is True
    said = json.dumps(result["content"])
    assert f"the switchboard at {nowhere} did not answer" in said
    # Directly, as any MCP client would call it: the same error, as a tool error.
    async with Client(general.sse_url) as client:
        answer = await client.call_tool("notify", {"text": "hi"}, raise_on_error=False)
        assert answer.is_error
        assert f"the switchboard at {nowhere} did not answer" in answer.content[0].text
        status = (await client.call_tool("status", {})).structured_content
    assert status["name"] == "general" and status["database"]["ok"] is True
