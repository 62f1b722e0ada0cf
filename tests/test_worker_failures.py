"""The inbox worker's failure paths, end to end: real daemons, the real Claude Code binary
against the scripted Messages API, python-telegram-bot against the fake Bot API.

Whatever fails, the person gets one fixed, friendly sentence (or the fallback's answer), the
inbox row says what happened, and the queue moves on.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from butlers.config import RuntimeConfig, SwitchboardConfig, TelegramConfig, TriageRule
from butlers.daemon import ButlerDaemon
from butlers.switchboard.inbox import MAX_ATTEMPTS
from butlers.switchboard.replies import answer_lost, sorry
from tests.conftest import (
    StartButler,
    butler_config,
    eventually,
    free_port,
    log_records,
    write_butler_dir,
)
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use
from tests.test_inbox import is_classifier, model

CHAT = 4242
TO_GENERAL = TriageRule(butler="general", channel="telegram")


async def start_fleet(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    *,
    names: tuple[str, ...] = ("general",),
    runtimes: dict[str, RuntimeConfig] | None = None,
    triage: tuple[TriageRule, ...] = (TO_GENERAL,),
    database: str | None = None,
    lease_s: float = 30.0,
) -> tuple[ButlerDaemon, dict[str, ButlerDaemon]]:
    """The named butlers and a switchboard polling the fake Bot API for chat CHAT.
    `runtimes` gives a butler (the switchboard included) its own [runtime]; `lease_s`: the
    switchboard's message_lease_s."""
    runtimes = runtimes or {}
    config_dir = tmp_path / "config"
    targets = {}
    for name in names:
        config = butler_config(name)
        if name in runtimes:
            config = butler_config(name, runtime=runtimes[name])
        targets[name] = await start_butler(config)
        write_butler_dir(config_dir, name, targets[name].port)
    port = free_port()
    write_butler_dir(config_dir, "switchboard", port)
    telegram = TelegramConfig(allowed_chat_ids=(str(CHAT),), api_base_url=bot_api.url)
    overrides: dict[str, Any] = {
        "port": port,
        "telegram": telegram,
        "triage": triage,
        "switchboard": SwitchboardConfig(message_lease_s=lease_s),
    }
    if "switchboard" in runtimes:
        overrides["runtime"] = runtimes["switchboard"]
    switchboard = await start_butler(
        butler_config("switchboard", **overrides), config_dir=config_dir, database=database
    )
    return switchboard, targets


async def finished_row(conn, external_id: int | str) -> dict[str, Any]:
    """The inbox row of a Telegram update, once the worker has finished with it."""

    async def finished() -> bool:
        return bool(
            await conn.fetchval(
                "SELECT finished_at IS NOT NULL FROM inbox WHERE external_id = $1",
                str(external_id),
            )
        )

    await eventually(finished)
    return dict(await conn.fetchrow("SELECT * FROM inbox WHERE external_id = $1", str(external_id)))


def leaks_detail(reply: str) -> bool:
    """Whether a reply shows something only the operator should see."""
    return bool(re.search(r"https?://|127\.0\.0\.1|Error|Traceback|butler '", reply))


async def test_target_down_the_chat_gets_the_fixed_sentence_and_the_row_the_detail(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards replies.py/worker.py: a route that cannot reach its butler is answered with
    `sorry("unreachable", butler)`, never the endpoint or the exception; the detail is on
    the inbox row (`failed`)."""
    scripted_api.respond_with(model("health"))
    rule = TriageRule(butler="health", channel="telegram")
    switchboard, targets = await start_fleet(
        start_butler, tmp_path, bot_api, names=("health",), triage=(rule,)
    )
    health_port = targets["health"].port
    await targets["health"].stop()
    update_id = await bot_api.push_text(CHAT, "my weight is 75")
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": sorry("unreachable", "health")}
    assert not leaks_detail(sent["text"])
    conn = await db_conn(switchboard.config.database)
    row = await finished_row(conn, update_id)
    assert (row["status"], row["routed_to"], row["reply"]) == ("failed", "health", sent["text"])
    assert f"butler 'health' is unreachable at http://127.0.0.1:{health_port}/sse" in row["error"]
    assert not scripted_api.requests  # nothing was classified or run


async def test_a_reply_the_bot_api_refuses_is_recorded_and_the_queue_moves_on(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards the outbox: a send Telegram refuses (400: the chat does not exist) is final:
    the outbox row is `failed` with the reason (the message itself was handled: `done`,
    its reply on record), it is not tried again, and the next reply still goes out."""
    scripted_api.respond_with(model("general", {"general": "Done."}))
    switchboard, _ = await start_fleet(start_butler, tmp_path, bot_api)
    conn = await db_conn(switchboard.config.database)
    bot_api.fail_sends_with_400 = True
    refused_id = await bot_api.push_text(CHAT, "first")
    row = await finished_row(conn, refused_id)
    assert (row["status"], row["routed_to"], row["reply"]) == ("done", "general", "Done.")

    async def refused() -> bool:
        return await conn.fetchval("SELECT status FROM outbox") == "failed"

    await eventually(refused)
    outbox = await conn.fetchrow("SELECT * FROM outbox")
    assert (outbox["kind"], outbox["inbox_id"], outbox["attempts"]) == ("reply", row["id"], 1)
    assert "refused" in outbox["error"] and "chat not found" in outbox["error"].lower()
    assert bot_api.refused_sends == [{"chat_id": CHAT, "text": "Done."}]

    bot_api.fail_sends_with_400 = False
    answered_id = await bot_api.push_text(CHAT, "second")
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": "Done."}
    row = await finished_row(conn, answered_id)
    assert (row["status"], row["error"]) == ("done", None)
    assert bot_api.refused_sends == [{"chat_id": CHAT, "text": "Done."}]  # not tried again


async def test_a_message_that_keeps_crashing_the_switchboard_is_given_up(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    make_database: Callable,
    switchboard_template: str,
    db_conn,
) -> None:
    """Guards the MAX_ATTEMPTS cap in worker._process: a message a crash loop left
    `processing` after its last allowed attempt is failed with "gave up after" and the
    person is told `sorry("gave_up")`, without classifying or routing it again (it may be
    what brings the process down). One attempt short of the cap, a message is still
    processed."""
    scripted_api.respond_with(model("general", {"general": "Handled."}))
    database = await make_database(switchboard_template)
    conn = await db_conn(database)
    # What crash loops leave behind: claimed (attempts counted), never finished.
    last_try, over = await conn.fetch(
        """INSERT INTO inbox (channel, external_id, source_id, text, status, attempts) VALUES
           ('telegram', 'one-more-try', $1, 'still worth a try', 'queued', $2),
           ('telegram', 'crash-loop', $1, 'the message that kills', 'processing', $3)
           RETURNING id""",
        str(CHAT),
        MAX_ATTEMPTS - 1,
        MAX_ATTEMPTS,
    )
    _, targets = await start_fleet(start_butler, tmp_path, bot_api, database=database)
    sent = await bot_api.wait_sent(2)
    assert sent == [
        {"chat_id": CHAT, "text": "Handled."},
        {"chat_id": CHAT, "text": sorry("gave_up")},
    ]
    gave_up = await finished_row(conn, "crash-loop")
    assert (gave_up["status"], gave_up["attempts"]) == ("failed", MAX_ATTEMPTS + 1)
    assert gave_up["error"] == f"gave up after {MAX_ATTEMPTS} interrupted attempts"
    assert gave_up["reply"] == sorry("gave_up") and gave_up["routed_to"] is None
    handled = await finished_row(conn, "one-more-try")
    assert (handled["status"], handled["attempts"]) == ("done", MAX_ATTEMPTS)
    # Only the message under the cap reached a butler.
    routed = await conn.fetch("SELECT inbox_id FROM routing_log")
    assert [r["inbox_id"] for r in routed] == [last_try["id"]]
    general = await db_conn(targets["general"].config.database)
    assert await general.fetchval("SELECT count(*) FROM sessions") == 1
    assert over["id"] == gave_up["id"]


async def test_a_classifier_that_times_out_falls_back_to_general(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards the fallback in worker._classify_and_route: when the classification session
    times out without routing, the message still goes to `general` and is answered; the row
    says the classifier timed out and where the message went."""
    scripted_api.respond_with(model("health", {"general": "General here.", "health": "Wrong."}))
    scripted_api.delay_for = lambda body: 120 if is_classifier(body) else 0  # a stuck model
    switchboard, _ = await start_fleet(
        start_butler,
        tmp_path,
        bot_api,
        names=("general", "health"),
        runtimes={"switchboard": RuntimeConfig(timeout_s=2, tick_interval_s=0)},
        triage=(),
    )
    update_id = await bot_api.push_text(CHAT, "log my weight: 75 kg")
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": "General here."}
    conn = await db_conn(switchboard.config.database)
    row = await finished_row(conn, update_id)
    assert (row["status"], row["routed_to"]) == ("done", "general")
    assert row["error"] == "classifier: Claude Code session timed out after 2s; routed to general"
    session = await conn.fetchrow("SELECT * FROM sessions")
    assert (session["trigger_source"], session["success"]) == ("classify:telegram", False)
    assert "timed out" in session["error"]


def endless_tool_calls(tool: str, answers: dict[str, str]) -> Callable[[dict], list[dict]]:
    """A model that, wherever `tool` is offered, calls it on every turn and never stops;
    elsewhere answers `answers[butler]`."""

    def respond(body: dict) -> list[dict]:
        if any(t["name"] == tool for t in body.get("tools", [])):
            return [tool_use(tool, {})]
        names = [t["name"] for t in body.get("tools", []) if t["name"].startswith("mcp__")]
        butler = names[0].split("__")[1] if names else "?"
        return [text(answers.get(butler, "?"))]

    return respond


async def test_a_classifier_past_max_turns_is_a_failed_session_and_general_answers(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards the spawner and the fallback: a classification session that hits max_turns
    (the model keeps calling tools) is recorded as failed with an error naming max turns,
    and the message still gets an answer from `general`."""
    scripted_api.respond_with(
        endless_tool_calls("mcp__switchboard__list_butlers", {"general": "General here."})
    )
    switchboard, _ = await start_fleet(
        start_butler,
        tmp_path,
        bot_api,
        runtimes={"switchboard": RuntimeConfig(max_turns=2, timeout_s=60, tick_interval_s=0)},
        triage=(),
    )
    update_id = await bot_api.push_text(CHAT, "what now?")
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": "General here."}
    conn = await db_conn(switchboard.config.database)
    session = await conn.fetchrow("SELECT * FROM sessions")
    assert (session["trigger_source"], session["success"]) == ("classify:telegram", False)
    # It ran and took all its turns: said so, not "could not run".
    assert session["error"].startswith(
        "ran out of turns: the session took all 2 of its turns ([runtime] max_turns)"
    ), session["error"]
    row = await finished_row(conn, update_id)
    assert (row["status"], row["routed_to"]) == ("done", "general")
    assert row["error"].startswith("classifier: ") and row["error"].endswith("; routed to general")
    assert session["error"] in row["error"]


async def test_a_butler_past_max_turns_gets_a_friendly_failure(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards trigger -> route -> reply: a butler session that hits max_turns is a failed
    session; the person is told it ran out of steps and that part may be done (not to try
    again later: its tools' work on the way is done, and would be again), and the row gets
    the session's error."""
    scripted_api.respond_with(endless_tool_calls("mcp__general__state_list", {}))
    switchboard, targets = await start_fleet(
        start_butler,
        tmp_path,
        bot_api,
        runtimes={"general": RuntimeConfig(max_turns=2, timeout_s=60, tick_interval_s=0)},
    )
    update_id = await bot_api.push_text(CHAT, "list everything, forever")
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": sorry("out_of_turns", "general")}
    assert "ran out of steps" in sent["text"] and "try again" not in sent["text"]
    general = await db_conn(targets["general"].config.database)
    session = await general.fetchrow("SELECT * FROM sessions")
    assert (session["trigger_source"], session["success"]) == ("trigger", False)
    # It ran and took all its turns: said so, not "could not run".
    assert session["error"].startswith(
        "ran out of turns: the session took all 2 of its turns ([runtime] max_turns)"
    ), session["error"]
    assert session["cost_usd"] is not None  # what it spent is still counted
    conn = await db_conn(switchboard.config.database)
    row = await finished_row(conn, update_id)
    assert (row["status"], row["routed_to"]) == ("failed", "general")
    assert session["error"] in row["error"]


async def test_the_worker_outlives_a_database_that_fails_while_a_message_is_finished(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards the worker: when finishing a message fails and recording it as failed fails
    too (the database is failing), the worker logs it and goes on. The message stays
    `processing` until its lease runs out; then it is taken up again, before the chat's next
    message (one conversation, in order). Its butler had answered: it is not asked again
    (general's session ran twice, and what it did was done twice), and the chat is told the
    answer was lost."""
    scripted_api.respond_with(model("general", {"general": "Done."}))
    scripted_api.delay_for = lambda body: 60.0  # general's session waits for the release
    switchboard, _ = await start_fleet(start_butler, tmp_path, bot_api, lease_s=2)
    conn = await db_conn(switchboard.config.database)
    with log_records("butlers.switchboard.worker") as records:
        first_id = await bot_api.push_text(CHAT, "first")
        await scripted_api.wait_for_request(lambda body: True)
        await conn.execute("ALTER TABLE inbox RENAME TO inbox_away")
        await scripted_api.release_held()

        async def gave_up_recording() -> bool:
            return any(r.getMessage().startswith("cannot record inbox") for r in records)

        await eventually(gave_up_recording)
        await conn.execute("ALTER TABLE inbox_away RENAME TO inbox")
    first = await conn.fetchrow("SELECT status FROM inbox WHERE external_id = $1", str(first_id))
    assert first["status"] == "processing"
    scripted_api.delay_for = None
    answered_id = await bot_api.push_text(CHAT, "second")
    row = await finished_row(conn, answered_id)
    assert (row["status"], row["reply"]) == ("done", "Done.")
    first = await finished_row(conn, first_id)
    lost = answer_lost(["general"])
    assert (first["status"], first["reply"], first["attempts"]) == ("done", lost, 2)
    assert first["routed_to"] == "general" and "not asked again" in first["error"]
    assert first["finished_at"] < row["finished_at"]  # the chat's order held
    sent = await bot_api.wait_sent(2)
    assert sent == [{"chat_id": CHAT, "text": lost}, {"chat_id": CHAT, "text": "Done."}]
    triggered = await conn.fetchval(
        "SELECT count(*) FROM routing_log WHERE routed_to = 'general' AND tool_name = 'trigger'"
    )
    assert triggered == 2  # once for each message
