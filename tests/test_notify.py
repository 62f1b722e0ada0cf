"""notify: a butler's session reaches its person through the switchboard's `deliver` and
the outbox, from a schedule (to the owner) and while serving a routed message (to that
conversation); limited per butler; each one a routing_log row in the session's trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastmcp import Client

from butlers.config import (
    OwnerConfig,
    RuntimeConfig,
    SwitchboardConfig,
    TelegramConfig,
    TriageRule,
)
from butlers.daemon import ButlerDaemon
from tests.conftest import StartButler, butler_config, free_port, log_records, write_butler_dir
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use
from tests.test_inbox import turn

OWNER = 777
CHAT = 12345
NOTIFY = "mcp__general__notify"


def general_model(body: dict) -> list[dict]:
    """The general butler: a prompt about watering notifies (a reminder), one asking for
    progress notifies then answers; everything else just answers."""
    prompt = json.dumps(body["messages"][0])
    if turn(body) == 0 and "water the plants" in prompt:
        return [tool_use(NOTIFY, {"text": "Time to water the plants."})]
    if turn(body) == 0 and "keep me posted" in prompt:
        return [tool_use(NOTIFY, {"text": "Working on it..."})]
    return [text("Done.")]


async def notify_fleet(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    limits: SwitchboardConfig | None = None,
    *,
    runtime: RuntimeConfig | None = None,
    switchboard_extra: str = "",
    general_overrides: dict[str, Any] | None = None,
    switchboard_overrides: dict[str, Any] | None = None,
    allowed_chats: tuple[int, ...] = (CHAT,),
) -> tuple[ButlerDaemon, ButlerDaemon]:
    """`general` (which knows the switchboard's URL) and a switchboard with Telegram, an
    owner, and a triage rule sending every Telegram message to general. `runtime`: general's
    (the flood limits' tests give theirs); `switchboard_extra`: added to the switchboard's
    butler.toml in the config dir the switchboard discovers; `*_overrides`: more of either
    one's ButlerConfig (the approvals' tests give their `approvals`)."""
    port = free_port()
    config_dir = tmp_path / "config"
    general = await start_butler(
        butler_config(
            "general",
            switchboard_url=f"http://127.0.0.1:{port}/sse",
            runtime=runtime or RuntimeConfig(timeout_s=60, tick_interval_s=0),
            **(general_overrides or {}),
        )
    )
    write_butler_dir(config_dir, "general", general.port)
    write_butler_dir(config_dir, "switchboard", port, extra=switchboard_extra)
    switchboard = await start_butler(
        butler_config(
            "switchboard",
            port=port,
            telegram=TelegramConfig(
                allowed_chat_ids=tuple(map(str, allowed_chats)), api_base_url=bot_api.url
            ),
            triage=(TriageRule(butler="general", channel="telegram"),),
            switchboard=limits or SwitchboardConfig(owner=OwnerConfig(telegram_chat_id=str(OWNER))),
            **(switchboard_overrides or {}),
        ),
        config_dir=config_dir,
    )
    return switchboard, general


async def test_a_scheduled_reminder_reaches_the_owners_chat(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(general_model)
    switchboard, general = await notify_fleet(start_butler, tmp_path, bot_api)
    general_db = await db_conn(general.config.database)
    await general_db.execute(
        """INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at)
           VALUES ('plants', '0 8 * * *', 'Remind me to water the plants.', now())"""
    )
    async with Client(general.sse_url) as client:
        ran = (await client.call_tool("tick", {})).structured_content["ran"]
    assert [(r["name"], r["success"]) for r in ran] == [("plants", True)]
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": OWNER, "text": "Time to water the plants."}
    switchboard_db = await db_conn(switchboard.config.database)
    [row] = await switchboard_db.fetch("SELECT * FROM routing_log")
    assert (row["source_channel"], row["source_id"], row["routed_to"], row["tool_name"]) == (
        "butler",
        "general",
        "telegram",
        "notify",
    )
    assert row["success"] is True and row["prompt_summary"] == "Time to water the plants."
    # In the session's trace: the schedule's session and the notification share its id.
    session_trace = await general_db.fetchval("SELECT trace_id FROM sessions")
    assert row["trace_id"] == session_trace
    [outbox] = await switchboard_db.fetch("SELECT kind, butler, conversation FROM outbox")
    assert tuple(outbox) == ("notification", "general", None)


async def test_a_notify_while_serving_a_message_reaches_that_chat(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(general_model)
    switchboard, _ = await notify_fleet(start_butler, tmp_path, bot_api)
    await bot_api.push_text(CHAT, "Book the table and keep me posted")
    sent = await bot_api.wait_sent(2)
    # The conversation's chat, not the owner's: first the notification, then the reply.
    assert sent == [
        {"chat_id": CHAT, "text": "Working on it..."},
        {"chat_id": CHAT, "text": "Done."},
    ]
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT kind, conversation FROM outbox ORDER BY id")
    assert [tuple(r) for r in rows] == [
        ("notification", f"telegram:{CHAT}"),
        ("reply", f"telegram:{CHAT}"),
    ]


async def test_deliver_refuses_clearly_and_limits_each_butler(
    start_butler: StartButler, tmp_path: Path, bot_api: FakeBotAPI, db_conn
) -> None:
    limits = SwitchboardConfig(
        max_notifications_per_hour=2, owner=OwnerConfig(telegram_chat_id=str(OWNER))
    )
    switchboard, _ = await notify_fleet(start_butler, tmp_path, bot_api, limits)
    async with Client(switchboard.sse_url) as client:

        async def deliver(**arguments):
            return await client.call_tool("deliver", {"butler": "general", **arguments})

        with pytest.raises(Exception, match="the owner has no email set"):
            await deliver(text="hi", channel="email")
        with pytest.raises(Exception, match="must not be empty"):
            await deliver(text="  ")
        with pytest.raises(Exception, match="no conversation 'telegram:999' to notify"):
            await deliver(text="hi", conversation="telegram:999")
        for n in (1, 2):
            assert (await deliver(text=f"n{n}")).structured_content["to"] == "owner"
        with pytest.raises(Exception, match="already sent 2 notifications in the last hour"):
            await deliver(text="n3")
        # The limit is per butler.
        await client.call_tool("deliver", {"butler": "health", "text": "n4"})
    sent = await bot_api.wait_sent(3)
    assert [s["text"] for s in sent] == ["n1", "n2", "n4"]
    conn = await db_conn(switchboard.config.database)
    rows = await conn.fetch("SELECT success, error FROM routing_log ORDER BY created_at, id")
    assert [r["success"] for r in rows] == [False, False, False, True, True, False, True]


async def test_a_capped_notify_is_one_warning_in_the_log_not_two(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
) -> None:
    """The switchboard's refusal is its warning; the butler whose notify it refused says it
    at INFO (each capped notify was two WARNING lines: a soak test)."""
    limits = SwitchboardConfig(
        max_notifications_per_hour=1, owner=OwnerConfig(telegram_chat_id=str(OWNER))
    )
    _, general = await notify_fleet(start_butler, tmp_path, bot_api, limits)
    with log_records("fastmcp") as records:
        async with Client(general.sse_url) as client:
            await client.call_tool("notify", {"text": "one"})
            with pytest.raises(Exception, match="already sent 1 notifications in the last hour"):
                await client.call_tool("notify", {"text": "two"})
    said = {
        tool: [r.levelname for r in records if f"Error calling tool {tool!r}" in r.getMessage()]
        for tool in ("deliver", "notify")
    }
    assert said == {"deliver": ["WARNING"], "notify": ["INFO"]}, said


async def test_without_an_owner_a_reminder_is_refused_with_what_to_set(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    db_conn,
) -> None:
    switchboard, _ = await notify_fleet(start_butler, tmp_path, bot_api, SwitchboardConfig())
    async with Client(switchboard.sse_url) as client:
        with pytest.raises(
            Exception, match=r"set telegram_chat_id or email under \[switchboard.owner\]"
        ):
            await client.call_tool("deliver", {"butler": "general", "text": "hi"})
    # Logged as meant for the owner (it said "?", which `butlers log` showed as `?.notify`).
    conn = await db_conn(switchboard.config.database)
    row = await conn.fetchrow("SELECT routed_to, success FROM routing_log")
    assert (row["routed_to"], row["success"]) == ("owner", False)
