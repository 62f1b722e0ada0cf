"""The switchboard's message path without a channel: `ask` -> inbox -> classify -> route -> reply.

The classifier is the real Claude Code binary against the scripted Messages API; the routed
butlers are real daemons whose own `trigger` runs Claude Code too.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from butlers.claude_code import not_logged_in
from butlers.config import SwitchboardConfig, TriageRule, load_butler_config
from butlers.switchboard.inbox import IncomingMessage
from butlers.switchboard.replies import sorry
from tests.conftest import (
    StartButler,
    butler_config,
    eventually,
    free_port,
    no_credentials_env,
    write_butler_dir,
)
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use
from tests.test_cli_client import run_cli

ROUTE_TOOL = "mcp__switchboard__route"


def is_classifier(body: dict) -> bool:
    return any(t["name"] == ROUTE_TOOL for t in body.get("tools", []))


def turn(body: dict) -> int:
    return sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")


def classifier_prompt(body: dict) -> str:
    """The classification prompt Claude Code sent (the first user message), as text."""
    content = body["messages"][0]["content"]
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return content


def delimited_message(body: dict) -> str | None:
    """The message between the classification prompt's boundary lines (a random token)."""
    found = re.search(
        r"<<<MESSAGE ([0-9a-f]{16})\n(.*)\nMESSAGE \1>>>", classifier_prompt(body), re.S
    )
    return found.group(2) if found else None


def model(pick: str | None, answers: dict[str, str] | None = None):
    """A scripted model: as the classifier it routes to `pick` (or routes nowhere when None);
    as a butler it answers with `answers[butler]` (the butler is read from its tool names)."""
    answers = answers or {}

    def respond(body: dict) -> list[dict]:
        if is_classifier(body):
            if pick is None or turn(body) > 0:
                return [text("done")]
            request = delimited_message(body) or "?"
            return [
                tool_use(
                    ROUTE_TOOL,
                    {"butler_name": pick, "tool_name": "trigger", "args": {"prompt": request}},
                )
            ]
        names = [t["name"] for t in body.get("tools", []) if t["name"].startswith("mcp__")]
        butler = names[0].split("__")[1] if names else "?"
        return [text(answers.get(butler, f"{butler} did it"))]

    return respond


async def start_fleet(
    start_butler: StartButler,
    tmp_path: Path,
    *,
    triage=(),
    switchboard_env=None,
    names=("general", "health", "relationship"),
    database=None,
    switchboard_port=None,
    auth_token=None,
    telemetry=None,  # the switchboard's, else the suite's (exporting to memory)
    **switchboard_overrides,
):
    config_dir = tmp_path / "config"
    targets = {}
    if not (config_dir / "switchboard").exists():
        for name in names:
            daemon = await start_butler(butler_config(name), auth_token=auth_token)
            write_butler_dir(config_dir, name, daemon.port, description=f"{name.title()} things.")
            targets[name] = daemon
    port = switchboard_port or free_port()
    write_butler_dir(config_dir, "switchboard", port, description="Front door.")
    switchboard = await start_butler(
        butler_config("switchboard", port=port, triage=tuple(triage), **switchboard_overrides),
        config_dir=config_dir,
        session_env=switchboard_env,
        database=database,
        auth_token=auth_token,
        **({} if telemetry is None else {"telemetry": telemetry}),
    )
    return switchboard, targets


async def ask(switchboard, message: str) -> dict:
    async with Client(switchboard.sse_url) as client:
        result = await client.call_tool("ask", {"text": message}, timeout=120)
    return result.structured_content


async def _routing_log(db_conn, switchboard) -> list[dict]:
    conn = await db_conn(switchboard.config.database)
    return [dict(r) for r in await conn.fetch("SELECT * FROM routing_log ORDER BY created_at")]


async def test_claude_code_classifies_and_the_butlers_answer_comes_back(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("health", {"health": "Logged 75 kg."}))
    switchboard, targets = await start_fleet(start_butler, tmp_path)
    answer = await ask(switchboard, "Log my weight: 75kg")
    assert answer["status"] == "done", answer
    assert answer["routed_to"] == "health" and answer["reply"] == "Logged 75 kg."

    [row] = await _routing_log(db_conn, switchboard)
    assert (row["source_channel"], row["source_id"], row["routed_to"]) == ("mcp", "ask", "health")
    assert row["inbox_id"] == answer["inbox_id"] and row["success"] is True
    assert row["prompt_summary"] == "Log my weight: 75kg" and len(row["trace_id"]) == 32

    # The classification prompt: the spec's format, every butler but the switchboard, the
    # default-to-general instruction; and the classifier saw only route and list_butlers.
    [first] = [b for b in scripted_api.requests if is_classifier(b) and turn(b) == 0]
    prompt = json.dumps(first["messages"][0])
    assert "Classify this message and route it. Available butlers: [" in prompt
    for name in ("general", "health", "relationship"):
        assert f"{name}: {name.title()} things." in prompt
    assert "switchboard:" not in prompt and "Front door" not in prompt
    assert "does not clearly fit a specialist butler, route it to general" in prompt
    assert re.search(r"Message: <<<MESSAGE (\w{16})\\nLog my weight: 75kg\\nMESSAGE \1>>>", prompt)
    mcp_tools = {t["name"] for t in first["tools"] if t["name"].startswith("mcp__")}
    assert mcp_tools == {ROUTE_TOOL, "mcp__switchboard__list_butlers"}

    # One trace: the health butler's session ran in the routing_log row's trace.
    health_db = await db_conn(targets["health"].config.database)
    assert await health_db.fetchval("SELECT trace_id FROM sessions") == row["trace_id"]


async def test_ambiguous_message_goes_to_general(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI
) -> None:
    scripted_api.respond_with(model("general", {"general": "Noted."}))
    switchboard, _ = await start_fleet(start_butler, tmp_path)
    answer = await ask(switchboard, "hmm, what about that thing?")
    assert (answer["routed_to"], answer["reply"]) == ("general", "Noted.")


async def test_classifier_that_routes_nowhere_falls_back_to_general(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model(None, {"general": "General here."}))
    switchboard, _ = await start_fleet(start_butler, tmp_path)
    answer = await ask(switchboard, "hello")
    assert answer["status"] == "done"
    assert (answer["routed_to"], answer["reply"]) == ("general", "General here.")
    assert "the classifier did not route the message; routed to general" in answer["error"]


async def test_a_route_to_a_made_up_butler_is_said_when_the_message_falls_back(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI
) -> None:
    """The classifier routed, to a butler that does not exist, and was refused: the note
    says so, not "did not route the message"."""
    scripted_api.respond_with(model("ghost", {"general": "General here."}))
    switchboard, _ = await start_fleet(start_butler, tmp_path)
    answer = await ask(switchboard, "send this to ghost")
    assert (answer["routed_to"], answer["reply"]) == ("general", "General here.")
    assert answer["error"].startswith("classifier: its route to 'ghost' was refused: "), answer
    assert answer["error"].endswith("; routed to general")


async def test_a_made_up_butler_name_of_any_length_makes_a_short_note(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI
) -> None:
    """The name is the model's, which a stranger's words steer: cut, on one line."""
    scripted_api.respond_with(model("g\n" + "h" * 5000, {"general": "General here."}))
    switchboard, _ = await start_fleet(start_butler, tmp_path)
    answer = await ask(switchboard, "send this to a very long name")
    assert answer["routed_to"] == "general" and "\n" not in answer["error"]
    assert (
        answer["error"].startswith("classifier: its route to 'g h") and len(answer["error"]) < 700
    )


async def test_classifier_without_credentials_still_answers_via_general(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("health", {"general": "General here."}))
    bad = no_credentials_env(tmp_path / "no-login")
    switchboard, _ = await start_fleet(start_butler, tmp_path, switchboard_env=bad)
    answer = await ask(switchboard, "Log my weight: 75kg")
    assert (answer["status"], answer["routed_to"], answer["reply"]) == (
        "done",
        "general",
        "General here.",
    )
    assert answer["error"] == f"classifier: {not_logged_in()}; routed to general"
    conn = await db_conn(switchboard.config.database)
    session = await conn.fetchrow("SELECT * FROM sessions")
    assert session["trigger_source"] == "classify:mcp" and session["success"] is False


async def test_triage_rule_skips_claude_code(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("general", {"relationship": "Birthday saved."}))
    rule = TriageRule(butler="relationship", pattern=re.compile(r"(?i)birthday"))
    switchboard, _ = await start_fleet(start_butler, tmp_path, triage=[rule])
    answer = await ask(switchboard, "Anna's BIRTHDAY is on May 3")
    assert (answer["routed_to"], answer["reply"]) == ("relationship", "Birthday saved.")
    assert not [b for b in scripted_api.requests if is_classifier(b)]
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT count(*) FROM sessions") == 0


async def test_triage_by_sender_domain_and_exact_id(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """`sender` rules as butler.toml declares them: "@domain" matches any address there (any
    case), anything else one address or chat id exactly. A near miss goes to the classifier."""
    scripted_api.respond_with(
        model(
            "general",
            {"relationship": "School noted.", "health": "Health noted.", "general": "Noted."},
        )
    )
    rules_toml = write_butler_dir(
        tmp_path / "rules",
        "switchboard",
        free_port(),
        extra=(
            '[[switchboard.triage]]\nsender = "@school.example"\nbutler = "relationship"\n'
            '[[switchboard.triage]]\nsender = "4242"\nbutler = "health"\n'
        ),
    )
    rules = load_butler_config(rules_toml / "butler.toml").triage
    switchboard, _ = await start_fleet(start_butler, tmp_path, triage=rules)
    worker = switchboard.switchboard.worker
    messages = {
        "the school": IncomingMessage("email", "m1", "term dates", source_id="Head@School.Example"),
        "the chat": IncomingMessage("telegram", "u1", "slept 8h", source_id="4242"),
        "a near domain": IncomingMessage(
            "email", "m2", "bake sale", source_id="pta@notschool.example"
        ),
        "a near chat": IncomingMessage("telegram", "u2", "hello there", source_id="42420"),
    }
    ids = {who: await worker.accept(message) for who, message in messages.items()}
    rows = {who: await worker.wait_for(inbox_id) for who, inbox_id in ids.items()}
    assert {who: (r["status"], r["routed_to"], r["reply"]) for who, r in rows.items()} == {
        "the school": ("done", "relationship", "School noted."),
        "the chat": ("done", "health", "Health noted."),
        "a near domain": ("done", "general", "Noted."),
        "a near chat": ("done", "general", "Noted."),
    }
    # Claude Code classified the two near misses, and nothing else.
    classified = {
        delimited_message(b) for b in scripted_api.requests if is_classifier(b) and turn(b) == 0
    }
    assert classified == {"bake sale", "hello there"}
    conn = await db_conn(switchboard.config.database)
    sources = await conn.fetch("SELECT trigger_source FROM sessions ORDER BY started_at")
    assert [s["trigger_source"] for s in sources] == ["classify:email", "classify:telegram"]


async def test_target_down_is_a_failed_message_with_a_clear_reply(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("health"))
    rule = TriageRule(butler="health", pattern=re.compile("weight"))
    switchboard, targets = await start_fleet(start_butler, tmp_path, triage=[rule])
    await targets["health"].stop()
    answer = await ask(switchboard, "my weight is 75")
    # The person gets a fixed sentence; the detail (with the endpoint) is for the operator.
    assert answer["status"] == "failed"
    assert answer["reply"] == sorry("unreachable", "health")
    assert answer["reply"].startswith("Sorry, the health butler is not reachable right now.")
    assert "butler 'health' is unreachable at" in answer["error"]
    [row] = await _routing_log(db_conn, switchboard)
    assert row["success"] is False and row["inbox_id"] == answer["inbox_id"]


async def test_messages_are_processed_one_at_a_time_in_order(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("general"))
    switchboard, _ = await start_fleet(start_butler, tmp_path)
    worker = switchboard.switchboard.worker
    ids = [
        await worker.accept(IncomingMessage("telegram", f"u{i}", f"message {i}", source_id="42"))
        for i in range(4)
    ]
    rows = await asyncio.gather(*(worker.wait_for(i) for i in ids))
    assert [r["status"] for r in rows] == ["done"] * 4
    assert [r["finished_at"] for r in rows] == sorted(r["finished_at"] for r in rows)
    conn = await db_conn(switchboard.config.database)
    sessions = await conn.fetch(
        "SELECT prompt, started_at, finished_at FROM sessions ORDER BY started_at"
    )
    assert [re.search(r"message (\d)", s["prompt"]).group(1) for s in sessions] == list("0123")
    for earlier, later in itertools.pairwise(sessions):
        assert earlier["finished_at"] <= later["started_at"]  # never two classifications at once


async def test_duplicate_is_stored_and_answered_once(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("general"))
    rule = TriageRule(butler="general", channel="telegram")
    switchboard, _ = await start_fleet(start_butler, tmp_path, triage=[rule])
    worker = switchboard.switchboard.worker
    first = await worker.accept(IncomingMessage("telegram", "update-7", "hi", source_id="42"))
    again = await worker.accept(IncomingMessage("telegram", "update-7", "hi", source_id="42"))
    assert first is not None and again is None
    await worker.wait_for(first)
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT count(*) FROM inbox") == 1
    assert await conn.fetchval("SELECT count(*) FROM routing_log") == 1


async def test_message_interrupted_by_a_crash_is_resumed_at_start(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    scripted_api.respond_with(model("general", {"general": "Back again."}))
    rule = TriageRule(butler="general", channel="telegram")
    port = free_port()
    switchboard, _ = await start_fleet(start_butler, tmp_path, triage=[rule], switchboard_port=port)
    database = switchboard.config.database
    await switchboard.stop()
    conn = await db_conn(database)
    # What a SIGKILL mid-processing leaves behind: the row stored, claimed, never finished.
    inbox_id = await conn.fetchval(
        """INSERT INTO inbox (channel, external_id, source_id, text, status, attempts)
           VALUES ('telegram', 'update-9', '42', 'are you there?', 'processing', 1) RETURNING id"""
    )
    again, _ = await start_fleet(
        start_butler, tmp_path, triage=[rule], database=database, switchboard_port=port
    )
    row = await again.switchboard.worker.wait_for(inbox_id)
    assert (row["status"], row["reply"], row["attempts"]) == ("done", "Back again.", 2)


async def test_an_ask_whose_switchboard_stops_is_told_its_message_stays_queued(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """SIGTERM while an `ask` waits: the caller hears that the message is kept (it had
    FastMCP's bare "Error calling tool 'ask'", and people sent it again), and it is."""
    scripted_api.respond_with(model("general", {"general": "Later."}))
    scripted_api.delay_s = 30  # the classifier is still thinking when the stop comes
    switchboard, _ = await start_fleet(
        start_butler, tmp_path, switchboard=SwitchboardConfig(stop_drain_s=0.5)
    )
    asking = asyncio.create_task(ask(switchboard, "Log my weight: 75kg"))
    conn = await db_conn(switchboard.config.database)
    await eventually(lambda: conn.fetchval("SELECT status = 'processing' FROM inbox"), timeout_s=30)
    await switchboard.stop()
    with pytest.raises(ToolError, match=r"stopped before message \d+ was answered; it stays"):
        await asking
    await scripted_api.release_held()
    assert await conn.fetchval("SELECT status FROM inbox") == "queued"


async def test_a_clean_stop_lets_a_message_under_way_finish(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """SIGTERM while a message is being answered: it finishes (within stop_drain_s) instead of
    going back to the queue, where another process would route it to its butler again (a
    walkthrough saw a butler get one request twice after a clean stop)."""
    scripted_api.respond_with(model("general", {"general": "Noted once."}))
    scripted_api.delay_s = 1.5
    switchboard, _ = await start_fleet(start_butler, tmp_path)
    asking = asyncio.create_task(ask(switchboard, "note: buy milk"))
    conn = await db_conn(switchboard.config.database)
    await eventually(lambda: conn.fetchval("SELECT status = 'processing' FROM inbox"), timeout_s=30)
    await switchboard.stop()
    answer = await asking
    assert (answer["status"], answer["reply"]) == ("done", "Noted once.")
    row = await conn.fetchrow("SELECT status, attempts FROM inbox")
    assert (row["status"], row["attempts"]) == ("done", 1)
    routed = await conn.fetchval("SELECT count(*) FROM routing_log WHERE routed_to = 'general'")
    assert routed == 1


async def test_butlers_ask_cli(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI
) -> None:
    scripted_api.respond_with(model("health", {"health": "Logged."}))
    switchboard, _ = await start_fleet(start_butler, tmp_path, names=("general", "health"))
    code, out, err = await run_cli("ask", "Log my weight: 75kg", "--url", switchboard.sse_url)
    assert code == 0, err
    assert out.strip() == "Logged." and "(answered by health)" in err


async def test_ask_rejects_empty_text(start_butler: StartButler, tmp_path: Path) -> None:
    switchboard, _ = await start_fleet(start_butler, tmp_path, names=("general",))
    async with Client(switchboard.sse_url) as client:
        with pytest.raises(Exception, match="text must not be empty"):
            await client.call_tool("ask", {"text": "  "})
