"""Operator tools and commands: `inbox_list`, `routing_log_list`, `inbox_retry`, `outbox_list`
and `butlers inbox | log | retry | outbox`, against a real switchboard and butlers.

Rows come from real messages where the path makes them (a failed route, a retry), and are
seeded with SQL where only their shape matters (every status, long texts, the outbox, whose
sender is not under test here). The commands run as a user runs them: a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from fastmcp import Client
from fastmcp.client.transports import SSETransport

from butlers.config import TriageRule
from butlers.switchboard.inbox import IncomingMessage
from tests.conftest import StartButler, butler_config
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_cli_client import run_cli
from tests.test_inbox import model, start_fleet

TOKEN = "operator-token"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
# A fixed UTC offset (POSIX TZ needs no tz database): the commands print local times.
LOCAL_TZ = {"TZ": "XST-05:30"}
LOCAL = timezone(timedelta(hours=5, minutes=30))


class Refused(Exception):
    """A tool answered with an error."""


async def call(switchboard, tool: str, headers: dict[str, str] | None = None, **arguments) -> Any:
    """A tool's answer as the CLI reads it (the same unwrap), or Refused with its text."""
    from butlers.mcp_connection.core import unwrap

    transport = SSETransport(switchboard.sse_url, headers=headers or {}, auth=TOKEN)
    async with Client(transport) as client:
        result = await client.call_tool_mcp(tool, arguments)
    answer = unwrap(result.model_dump(mode="json", by_alias=True, exclude_none=True))
    if result.is_error:
        raise Refused(answer)
    return answer


async def cli(switchboard, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return await run_cli(*args, "--url", switchboard.sse_url, token=TOKEN, env=env)


def local(iso: str) -> str:
    return datetime.fromisoformat(iso).astimezone(LOCAL).strftime("%Y-%m-%d %H:%M:%S")


def table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """A command's table: its header's words, and each row's line (keyed by its first cell)
    followed by its detail lines."""
    lines = out.splitlines()
    rows: dict[str, list[str]] = {}
    for line in lines[1:]:
        if line.startswith("    "):
            rows[list(rows)[-1]].append(line.strip())
        else:
            rows[line.split()[0]] = [line]
    return lines[0].split(), rows


def one_clear_line(result: tuple[int, str, str], expected: str) -> None:
    code, out, err = result
    assert code == 1 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


@pytest.fixture
async def fleet(start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI):
    """A switchboard and `general`, with every Telegram message triaged to general (no
    classifier session); the switchboard's database connection for seeding."""
    scripted_api.respond_with(model("general", {"general": "General here."}))
    switchboard, targets = await start_fleet(
        start_butler,
        tmp_path,
        names=("general",),
        triage=[TriageRule(butler="general", channel="telegram")],
        auth_token=TOKEN,
    )
    return switchboard, targets


async def seed_inbox(conn, **row) -> int:
    """An inbox row as the path leaves it (a telegram message unless `channel` says not)."""
    columns = {"channel": "telegram"} | {
        k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.items()
    }
    names = ", ".join(columns)
    values = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    return await conn.fetchval(
        f"INSERT INTO inbox ({names}) VALUES ({values}) RETURNING id", *columns.values()
    )


async def seed_album(conn) -> tuple[int, int]:
    """An album of two photos as the inbox leaves it once answered: the first message (routed
    to general) and the photo joined to it. Their ids."""
    first = await seed_inbox(
        conn,
        external_id="al-1",
        text="Which one?",
        status="done",
        routed_to="general",
        classified_via="model",
        meta={"album": "g"},
    )
    part = await seed_inbox(
        conn,
        external_id="al-2",
        text="",
        status="done",
        classified_via="album",
        meta={
            "album": "g",
            "album_of": first,
            "attachments": [
                {"name": "beach.jpg", "mime_type": "image/jpeg", "size": 9, "kind": "image"}
            ],
        },
    )
    return first, part


# -- inbox_list -----------------------------------------------------------------------------


async def test_an_albums_joined_photo_names_the_message_that_answered_it(
    fleet, db_conn, capsys: pytest.CaptureFixture[str]
) -> None:
    from butlers.cli.render import print_inbox

    switchboard, _ = fleet
    conn = await db_conn(switchboard.config.database)
    first, part = await seed_album(conn)
    rows = await call(switchboard, "inbox_list")
    assert [(r["id"], r["album_of"]) for r in rows] == [(part, first), (first, None)]
    print_inbox(rows, None)
    lines = capsys.readouterr().out.splitlines()
    [part_line] = [line for line in lines if line.startswith(f"{part} ")]
    [first_line] = [line for line in lines if line.startswith(f"{first} ")]
    assert f"with #{first}" in part_line and "album" in part_line
    assert "general" in first_line and "with #" not in first_line
    # A photo without words says what it carried; a meta not written by us breaks nothing.
    assert [r["files"] for r in rows] == [["beach.jpg"], None]
    assert part_line.endswith("[files: beach.jpg]")
    odd = await seed_inbox(conn, external_id="odd-1", text="hi", meta={"attachments": "x"})
    newest = (await call(switchboard, "inbox_list"))[0]
    assert (newest["id"], newest["files"]) == (odd, None)


def test_a_long_sender_name_never_pushes_their_id_out(capsys: pytest.CaptureFixture[str]) -> None:
    """A name is what a sender calls themselves (it may say "The Owner (555)"): cut on its
    own, so the id beside it always shows."""
    from butlers.cli.render import print_inbox

    row = {
        "id": 1,
        "received_at": "2026-11-27T12:00:00+00:00",
        "channel": "telegram",
        "source_id": "98765",
        "sender_name": "The Owner (555) via Telegram, officially",
        "status": "done",
        "routed_to": "general",
        "excerpt": "hi",
    }
    print_inbox([row], None)
    assert "(98765)" in capsys.readouterr().out


def test_a_memorys_tags_cannot_write_to_the_operators_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Tags kept before they were checked (a person's session chose them) are printed as
    the text is: no escape reaches the terminal, no line break forges a row (a red team)."""
    from butlers.cli.render import print_memories

    row = {
        "id": 7,
        "created_at": "2026-11-27T12:00:00+00:00",
        "person": "telegram:666",
        "from_owner": False,
        "private": True,
        "tags": ["\x1b[30`you", "\x1b]8;;https://evil.example/\x07see\x1b]8;;\x07", "x\nforged"],
        "text": "likes tea",
    }
    print_memories([row])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\nforged" not in out, out
    assert "telegram:666" in out


async def test_inbox_list_newest_first_filtered_bounded_and_traced(fleet, db_conn) -> None:
    switchboard, _ = fleet
    conn = await db_conn(switchboard.config.database)
    long_text = "first line\n\n   second\tline " + "x" * 5000
    traced = await seed_inbox(
        conn,
        external_id="a",
        source_id="42",
        sender_name="Anna",
        conversation="telegram:42",
        text=long_text,
        status="done",
        attempts=1,
        routed_to="general",
        classified_via="triage",
        trace_context={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"},
        finished_at=datetime.now(UTC),
    )
    # An envelope record_failed kept: no trace context, its trace is its first route's.
    routed = await seed_inbox(
        conn,
        external_id="b",
        source_id="bob@example.com",
        subject="Hi",
        text="short",
        status="failed",
        error="boom",
    )
    for trace_id, age in (("a" * 32, timedelta(minutes=2)), ("b" * 32, timedelta(minutes=1))):
        await conn.execute(
            """INSERT INTO routing_log (source_channel, routed_to, tool_name, trace_id,
                                        success, inbox_id, created_at)
               VALUES ('email', 'general', 'trigger', $1, false, $2, now() - $3::interval)""",
            trace_id,
            routed,
            age,
        )
    skipped = await seed_inbox(conn, external_id="c", text="spam", status="skipped", attempts=1)

    rows = await call(switchboard, "inbox_list")
    assert [r["id"] for r in rows] == [skipped, routed, traced]
    first = rows[2]
    assert first["excerpt"] == ("first line second line " + "x" * 200)[:119] + "…"
    assert first["text_chars"] == len(long_text)
    assert {k: first[k] for k in ("source_id", "sender_name", "conversation", "status")} == {
        "source_id": "42",
        "sender_name": "Anna",
        "conversation": "telegram:42",
        "status": "done",
    }
    assert (first["routed_to"], first["classified_via"], first["trace_id"]) == (
        "general",
        "triage",
        TRACE,
    )
    assert first["trace_url"] == f"http://localhost:16686/trace/{TRACE}"
    assert first["received_at"] and first["finished_at"]
    assert (rows[1]["excerpt"], rows[1]["error"], rows[1]["trace_id"]) == (
        "short",
        "boom",
        "a" * 32,
    )
    assert rows[0]["trace_id"] is None and rows[0]["trace_url"] is None

    assert [r["id"] for r in await call(switchboard, "inbox_list", status="failed")] == [routed]
    assert [r["id"] for r in await call(switchboard, "inbox_list", limit=2)] == [skipped, routed]

    human, as_json, failed_only = await asyncio.gather(
        cli(switchboard, "inbox", env=LOCAL_TZ),
        cli(switchboard, "inbox", "--json", "--limit", "2"),
        cli(switchboard, "inbox", "--status", "failed"),
    )
    code, out, err = human
    assert code == 0, err
    header, lines = table(out)
    assert header == ["ID", "RECEIVED", "CHANNEL", "FROM", "STATUS", "ROUTED", "TO", "VIA", "TEXT"]
    assert list(lines) == [str(skipped), str(routed), str(traced)]
    [line] = lines[str(traced)]
    assert local(first["received_at"]) in line
    assert re.search(r"telegram\s+Anna \(42\)\s+done\s+general\s+triage\s+first line second", line)
    assert line.endswith("…") and len(line) < 160
    line, *details = lines[str(routed)]
    assert "bob@example.com" in line and "[Hi] short" in line
    assert details == ["error: boom", f"trace: http://localhost:16686/trace/{'a' * 32}"]

    code, out, err = as_json
    assert code == 0, err
    assert json.loads(out) == rows[:2]
    code, out, err = failed_only
    assert code == 0, err
    assert list(table(out)[1]) == [str(routed)]


async def test_empty_lists_say_so(fleet) -> None:
    switchboard, _ = fleet
    inbox, log, outbox, outbox_sent = await asyncio.gather(
        cli(switchboard, "inbox", "--status", "processing"),
        cli(switchboard, "log", "--butler", "nobody"),
        cli(switchboard, "outbox"),
        cli(switchboard, "outbox", "--status", "sent"),
    )
    assert inbox == (0, "No processing inbox messages.\n", "")
    assert log == (0, "No routes to 'nobody' logged.\n", "")
    assert outbox == (0, "Nothing waiting in the outbox.\n", "")
    assert outbox_sent == (0, "No sent outbox rows.\n", "")


# -- routing_log_list -----------------------------------------------------------------------


async def test_routing_log_list_with_jaeger_links(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The switchboard's JAEGER_UI_URL, read when it starts (the daemons run in this process).
    monkeypatch.setenv("JAEGER_UI_URL", "http://jaeger.lan:16686/")
    switchboard, _ = await start_fleet(
        start_butler, tmp_path, names=("general", "health"), auth_token=TOKEN
    )
    for butler in ("general", "health", "ghost", "general"):
        with pytest.raises(Refused) if butler == "ghost" else contextlib.nullcontext():
            await call(switchboard, "route", butler_name=butler, tool_name="status")
    conn = await db_conn(switchboard.config.database)
    stored = await conn.fetch(
        "SELECT id::text AS id, routed_to, trace_id FROM routing_log ORDER BY created_at DESC"
    )
    assert [r["routed_to"] for r in stored] == ["general", "ghost", "health", "general"]

    rows = await call(switchboard, "routing_log_list")
    assert [r["id"] for r in rows] == [r["id"] for r in stored]
    newest = rows[0]
    assert (newest["source_channel"], newest["routed_to"], newest["tool_name"]) == (
        "mcp",
        "general",
        "status",
    )
    assert newest["success"] is True and newest["error"] is None and newest["inbox_id"] is None
    assert newest["duration_ms"] >= 0 and newest["created_at"]
    assert newest["trace_url"] == f"http://jaeger.lan:16686/trace/{stored[0]['trace_id']}"
    ghost = rows[1]
    assert ghost["success"] is False and "butler 'ghost' not found" in ghost["error"]

    general = await call(switchboard, "routing_log_list", butler="general", limit=1)
    assert [r["id"] for r in general] == [stored[0]["id"]]
    assert len(await call(switchboard, "routing_log_list", butler="general")) == 2

    # The links are the switchboard's, whatever the JAEGER_UI_URL of the command's environment.
    monkeypatch.delenv("JAEGER_UI_URL")
    (code, out, err), (json_code, json_out, json_err) = await asyncio.gather(
        cli(switchboard, "log", env=LOCAL_TZ),
        cli(switchboard, "log", "--butler", "general", "--json"),
    )
    assert code == 0, err
    header, _ = table(out)
    assert header == ["WHEN", "CHANNEL", "FROM", "TO", "RESULT", "MS", "INBOX", "SUMMARY", "TRACE"]
    lines = out.splitlines()[1:]
    assert len(lines) == 5  # four routes and the ghost's error line
    assert lines[0].startswith(local(newest["created_at"]))
    assert re.search(r"mcp\s+-\s+general\.status\s+ok\s+\d+\s+-\s+-\s+http://jaeger", lines[0])
    assert lines[0].endswith(f"http://jaeger.lan:16686/trace/{stored[0]['trace_id']}")
    assert "ghost.status" in lines[1] and "FAILED" in lines[1]
    assert lines[2].startswith("    error: butler 'ghost' not found")
    assert json_code == 0, json_err
    assert [r["id"] for r in json.loads(json_out)] == [stored[0]["id"], stored[3]["id"]]


# -- inbox_retry ----------------------------------------------------------------------------


async def test_a_failed_message_retried_once_its_butler_is_back_gets_its_answer(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted_api.respond_with(model("health", {"health": "Logged 75 kg."}))
    rule = TriageRule(butler="health", pattern=re.compile("weight"))
    switchboard, targets = await start_fleet(
        start_butler, tmp_path, names=("general", "health"), triage=[rule], auth_token=TOKEN
    )
    health = targets["health"]
    await health.stop()
    worker = switchboard.switchboard.worker
    inbox_id = await worker.accept(
        IncomingMessage(
            "telegram",
            "u1",
            "my weight is 75",
            source_id="42",
            sender_name="Anna",
            conversation="telegram:42",
        )
    )
    failed = await worker.wait_for(inbox_id)
    assert failed["status"] == "failed" and "'health' is unreachable" in failed["error"]

    [listed] = await call(switchboard, "inbox_list", status="failed")
    assert listed["id"] == inbox_id and listed["routed_to"] == "health"
    code, out, err = await cli(switchboard, "inbox", "--status", "failed")
    assert code == 0, err
    line, *details = table(out)[1][str(inbox_id)]
    assert re.search(r"telegram\s+Anna \(42\)\s+failed\s+health\s+triage\s+my weight is 75", line)
    assert details[0].startswith("error: health: butler 'health' is unreachable at")

    # The butler is back, where the registry says it is.
    await start_butler(
        butler_config("health", port=health.port),
        database=health.config.database,
        auth_token=TOKEN,
    )
    woken = []
    wake = worker.wake
    monkeypatch.setattr(worker, "wake", lambda: (woken.append(True), wake())[1])
    code, out, err = await cli(switchboard, "retry", str(inbox_id))
    assert code == 0, err
    assert out.startswith(
        f"message {inbox_id} is queued again (it was failed: health: butler 'health'"
    )
    assert woken == [True]

    done = await worker.wait_for(inbox_id)
    assert (done["status"], done["routed_to"], done["reply"], done["error"]) == (
        "done",
        "health",
        "Logged 75 kg.",
        None,
    )
    assert done["attempts"] == 1 and done["classified_via"] == "triage"
    [earlier] = done["meta"]["retries"]
    assert (earlier["status"], earlier["routed_to"], earlier["attempts"]) == ("failed", "health", 1)
    assert earlier["error"] == failed["error"]

    # Both routes are on record, in the trace the message was received in.
    [listed] = await call(switchboard, "inbox_list", limit=1)
    # The inbox listing keeps what it came to before (cli.md points there).
    assert [(r["status"], r["error"]) for r in listed["retries"]] == [("failed", failed["error"])]
    shown = await cli(switchboard, "inbox", "--limit", "1")
    assert f"before retry 1: failed: {failed['error']}" in shown[1], shown
    log = await call(switchboard, "routing_log_list", butler="health")
    assert [(r["inbox_id"], r["success"]) for r in log] == [(inbox_id, True), (inbox_id, False)]
    assert {r["trace_id"] for r in log} == {listed["trace_id"]}

    # Done now: not again. Nor what does not exist.
    again, missing, done_rows = await asyncio.gather(
        cli(switchboard, "retry", str(inbox_id)),
        cli(switchboard, "retry", "999999"),
        call(switchboard, "inbox_list", status="done"),
    )
    one_clear_line(
        again, f"inbox message {inbox_id} is done: only a failed or skipped message can be retried"
    )
    one_clear_line(missing, "no inbox message with id 999999")
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT count(*) FROM routing_log") == 2
    assert [r["id"] for r in done_rows] == [inbox_id]


async def test_retry_of_skipped_and_given_up_messages_and_what_cannot_be_retried(
    fleet, db_conn
) -> None:
    switchboard, _ = fleet
    worker = switchboard.switchboard.worker
    conn = await db_conn(switchboard.config.database)
    skipped = await seed_inbox(
        conn,
        external_id="s",
        source_id="7",
        text="are you there?",
        status="skipped",
        attempts=1,
        error="over max_messages_per_sender_per_hour (60)",
        classified_via="limit",
    )
    # What a message that crashed the switchboard three times is left as.
    gave_up = await seed_inbox(
        conn,
        external_id="g",
        source_id="8",
        text="once more",
        status="failed",
        attempts=4,
        error="gave up after 3 interrupted attempts",
    )
    envelope = await seed_inbox(
        conn,
        channel="email",
        external_id="e",
        source_id="x@example.com",
        text="",
        status="failed",
        error="could not be stored 3 times: boom",
    )

    # With the worker stopped, what a retry leaves: the message as if it had just come in.
    await worker.close()
    answer = await call(switchboard, "inbox_retry", id=skipped)
    assert (answer["id"], answer["status"]) == (skipped, "queued")
    assert answer["retries"][0]["classified_via"] == "limit"
    code, out, err = await cli(switchboard, "retry", str(gave_up), "--json")
    assert code == 0, err
    assert json.loads(out)["retries"][0]["error"] == "gave up after 3 interrupted attempts"
    queued = await conn.fetch(
        """SELECT status, attempts, error, reply, routed_to, classified_via, finished_at
           FROM inbox WHERE id = ANY($1::bigint[])""",
        [skipped, gave_up],
    )
    assert [tuple(r) for r in queued] == [("queued", 0, None, None, None, None, None)] * 2

    await worker.open(resume=[])
    rows = {i: await worker.wait_for(i) for i in (skipped, gave_up)}
    assert {i: (r["status"], r["reply"], r["attempts"]) for i, r in rows.items()} == {
        skipped: ("done", "General here.", 1),
        gave_up: ("done", "General here.", 1),
    }

    processing = await seed_inbox(
        conn, external_id="p", text="busy", status="processing", attempts=1
    )
    envelope_refused, processing_refused = await asyncio.gather(
        cli(switchboard, "retry", str(envelope)), cli(switchboard, "retry", str(processing))
    )
    one_clear_line(
        envelope_refused,
        f"inbox message {envelope} is failed but was never stored in full (only its envelope "
        "was kept: could not be stored 3 times: boom); there is nothing to retry",
    )
    one_clear_line(
        processing_refused,
        f"inbox message {processing} is processing: only a failed or skipped message",
    )
    assert await conn.fetchval("SELECT status FROM inbox WHERE id = $1", envelope) == "failed"


# -- outbox_list ----------------------------------------------------------------------------


async def test_outbox_list_shows_what_is_not_sent(fleet, db_conn) -> None:
    switchboard, _ = fleet
    conn = await db_conn(switchboard.config.database)
    ids = {}
    for status, text, error in (
        ("sent", "Logged.", None),
        ("failed", "Your appointment is at 10.", "Forbidden: bot was blocked by the user"),
        ("pending", "Reminder:\n" + "take the bins out " * 20, "Bad Gateway"),
        ("sending", "On its way.", None),
    ):
        ids[status] = await conn.fetchval(
            """INSERT INTO outbox (kind, inbox_id, butler, channel, recipient, text, status,
                                   attempts, error, sent_at, next_attempt_at)
               VALUES ('reply', 12, 'health', 'telegram', '42', $1, $2, 2, $3,
                       CASE WHEN $2 = 'sent' THEN now() END, now() + interval '30 seconds')
               RETURNING id""",
            text,
            status,
            error,
        )
    rows = await call(switchboard, "outbox_list")
    assert [r["id"] for r in rows] == [ids["sending"], ids["pending"], ids["failed"]]
    pending = rows[1]
    assert pending["excerpt"] == ("Reminder: " + "take the bins out " * 20)[:119] + "…"
    assert {k: pending[k] for k in ("kind", "inbox_id", "butler", "channel", "recipient")} == {
        "kind": "reply",
        "inbox_id": 12,
        "butler": "health",
        "channel": "telegram",
        "recipient": "42",
    }
    assert (pending["status"], pending["attempts"], pending["error"]) == (
        "pending",
        2,
        "Bad Gateway",
    )
    assert pending["next_attempt_at"] and pending["created_at"] and pending["sent_at"] is None
    [sent] = await call(switchboard, "outbox_list", status="sent")
    assert sent["id"] == ids["sent"] and sent["sent_at"] and sent["excerpt"] == "Logged."
    assert [r["id"] for r in await call(switchboard, "outbox_list", limit=1)] == [ids["sending"]]

    (code, out, err), (json_code, json_out, _), (sent_code, sent_out, _) = await asyncio.gather(
        cli(switchboard, "outbox", env=LOCAL_TZ),
        cli(switchboard, "outbox", "--json"),
        cli(switchboard, "outbox", "--status", "sent"),
    )
    assert code == 0, err
    header, lines = table(out)
    assert header[:7] == ["ID", "CREATED", "KIND", "CHANNEL", "TO", "STATUS", "ATTEMPTS"]
    assert list(lines) == [str(ids["sending"]), str(ids["pending"]), str(ids["failed"])]
    line, detail = lines[str(ids["pending"])]
    assert re.search(r"reply\s+telegram\s+42\s+pending\s+2\s+", line)
    assert local(pending["next_attempt_at"]) in line and "health  Reminder: take the bins" in line
    assert detail == "error: Bad Gateway"
    line, detail = lines[str(ids["failed"])]
    assert re.search(r"failed\s+2\s+-\s+12\s+health", line)
    assert detail == "error: Forbidden: bot was blocked by the user"
    assert json_code == 0 and json.loads(json_out) == rows
    assert sent_code == 0 and list(table(sent_out)[1]) == [str(ids["sent"])]


# -- bad input ------------------------------------------------------------------------------


async def test_bad_input_is_refused_with_one_clear_line(fleet) -> None:
    switchboard, _ = fleet
    results = await asyncio.gather(
        cli(switchboard, "inbox", "--status", "lost"),
        cli(switchboard, "inbox", "--limit", "0"),
        cli(switchboard, "log", "--limit", "501"),
        cli(switchboard, "outbox", "--status", "done"),
        cli(switchboard, "outbox", "--limit", "-1"),
        run_cli("inbox", "--url", switchboard.sse_url),  # no token
        run_cli("outbox", "--url", "http://127.0.0.1:9/sse", token=TOKEN),
    )
    expected = [
        "status must be one of queued, processing, done, failed, skipped (an inbox status), "
        "got 'lost'",
        "limit must be between 1 and 500, got 0",
        "limit must be between 1 and 500, got 501",
        "status must be one of pending, sending, sent, failed (an outbox status), got 'done'",
        "limit must be between 1 and 500, got -1",
        "401 Unauthorized: set BUTLERS_AUTH_TOKEN",
        "cannot reach the switchboard at http://127.0.0.1:9/sse",
    ]
    for result, text in zip(results, expected, strict=True):
        one_clear_line(result, text)


async def test_a_classification_session_may_not_use_operator_tools(fleet) -> None:
    switchboard, _ = fleet
    forged = {"X-Butlers-Classification": "guessed-credential"}
    for tool, arguments in (
        ("inbox_list", {}),
        ("routing_log_list", {}),
        ("inbox_retry", {"id": 1}),
        ("outbox_list", {}),
    ):
        with pytest.raises(Refused, match="not available to a classification session"):
            await call(switchboard, tool, headers=forged, **arguments)
    assert await call(switchboard, "inbox_list") == []


async def test_without_span_export_a_trace_is_an_id_with_no_link(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """Spans that go nowhere (no OTEL_EXPORTER_OTLP_ENDPOINT): `butlers inbox` and `log`
    printed a Jaeger link that led nowhere (the first hour's walkthrough); the id stays."""
    from butlers.telemetry import Telemetry

    switchboard, _ = await start_fleet(
        start_butler, tmp_path, names=("general",), auth_token=TOKEN, telemetry=Telemetry()
    )
    conn = await db_conn(switchboard.config.database)
    await seed_inbox(
        conn,
        external_id="a",
        source_id="42",
        text="hi",
        trace_context={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"},
    )
    await call(switchboard, "route", butler_name="general", tool_name="status")
    [row] = await call(switchboard, "inbox_list")
    assert (row["trace_id"], row["trace_url"]) == (TRACE, None)
    [logged] = await call(switchboard, "routing_log_list")
    assert logged["trace_id"] and logged["trace_url"] is None
