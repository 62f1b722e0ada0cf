"""Limits that keep one sender, or time, from flooding the switchboard: messages per sender
per hour, and retention of finished rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fastmcp import Client

from butlers import daemon as daemon_module
from butlers.config import (
    DEFAULT_RETENTION_DAYS,
    RuntimeConfig,
    SwitchboardConfig,
    TriageRule,
    load_config_dir,
)
from butlers.daemon import ButlerDaemon
from butlers.switchboard.replies import RATE_LIMITED
from tests.conftest import StartButler, butler_config, eventually, free_port, write_butler_dir
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_inbox import model
from tests.test_telegram import start_telegram_fleet

ALLOWED = (111, 222)


async def hourly_limited_fleet(
    start_butler: StartButler, tmp_path: Path, bot_api: FakeBotAPI
) -> tuple[ButlerDaemon, dict[str, ButlerDaemon]]:
    """`general` and a Telegram switchboard allowing ALLOWED, every message to general, and
    at most two messages per sender per hour: the per-sender limit's tests share it."""
    return await start_telegram_fleet(
        start_butler,
        tmp_path,
        bot_api,
        triage=[TriageRule(butler="general", channel="telegram")],
        names=("general",),
        chats=ALLOWED,
        switchboard=SwitchboardConfig(max_messages_per_sender_per_hour=2),
    )


async def pruning_switchboard(
    start_butler: StartButler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ButlerDaemon:
    """A switchboard keeping finished rows 30 days, whose ticker prunes every 0.1 s: the
    retention tests share it, each with the rows it inserts."""
    monkeypatch.setattr(daemon_module, "PRUNE_EVERY_S", 0.1)
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    return await start_butler(
        butler_config(
            "switchboard",
            port=free_port(),
            runtime=RuntimeConfig(tick_interval_s=0.1),
            switchboard=replace(SwitchboardConfig(), retention_days=30),
        ),
        config_dir=config_dir,
    )


async def test_a_sender_over_the_hourly_limit_is_told_once_and_not_classified(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    scripted_api.respond_with(model("general", {"general": "Done."}))
    switchboard, targets = await hourly_limited_fleet(start_butler, tmp_path, bot_api)
    general = targets["general"]
    flooder, other = ALLOWED
    for i in range(5):
        await bot_api.push_text(flooder, f"message {i}")
    await bot_api.push_text(other, "hello")
    # Two answers, one notice for the flooder; one answer for the other sender.
    sent = await bot_api.wait_sent(4, timeout_s=90)
    conn = await db_conn(switchboard.config.database)

    async def all_finished() -> bool:
        return not await conn.fetchval("SELECT count(*) FROM inbox WHERE finished_at IS NULL")

    await eventually(all_finished)
    assert [s["text"] for s in sent if s["chat_id"] == flooder] == ["Done.", "Done.", RATE_LIMITED]
    assert [s["text"] for s in sent if s["chat_id"] == other] == ["Done."]
    assert len(bot_api.sent) == 4  # the later messages over the limit get no answer at all
    rows = await conn.fetch(
        "SELECT id, status, reply, error FROM inbox WHERE source_id = $1 ORDER BY id",
        str(flooder),
    )
    assert [r["status"] for r in rows] == ["done", "done", "skipped", "skipped", "skipped"]
    assert [r["reply"] for r in rows][2:] == [RATE_LIMITED, None, None]
    assert all("max_messages_per_sender_per_hour (2)" in r["error"] for r in rows[2:])
    # Skipped messages never reached a butler: three trigger sessions in all.
    general_db = await db_conn(general.config.database)
    assert await general_db.fetchval("SELECT count(*) FROM sessions") == 3
    # The operator may queue one again on purpose: then it is answered, not skipped again.
    async with Client(switchboard.sse_url) as client:
        await client.call_tool("inbox_retry", {"id": rows[3]["id"]})
    retried = await switchboard.switchboard.worker.wait_for(rows[3]["id"])
    assert (retried["status"], retried["reply"]) == ("done", "Done.")


async def test_the_hourly_limit_counts_only_the_last_hour(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """Guards the window of the per-sender count (inbox.claim_next): a sender's messages
    from more than an hour ago no longer count, nor does a notice they were given then (they
    are told again); one from within the hour still counts."""
    scripted_api.respond_with(model("general", {"general": "Done."}))
    switchboard, _ = await hourly_limited_fleet(start_butler, tmp_path, bot_api)
    sender = str(ALLOWED[0])
    conn = await db_conn(switchboard.config.database)
    await conn.execute(
        """INSERT INTO inbox (channel, external_id, source_id, text, status, received_at,
                              finished_at)
           SELECT 'telegram', 'earlier-' || n, $1, 'x', status, now() - age, now() - age
           FROM (VALUES (1, 'skipped', interval '70 minutes'),
                        (2, 'done', interval '61 minutes'),
                        (3, 'done', interval '61 minutes'),
                        (4, 'done', interval '61 minutes'),
                        (5, 'done', interval '59 minutes')) AS earlier(n, status, age)""",
        sender,
    )
    await bot_api.push_text(ALLOWED[0], "within the limit")  # one earlier message counts
    await bot_api.push_text(ALLOWED[0], "over it")  # two do: the limit
    sent = await bot_api.wait_sent(2, timeout_s=90)
    assert [s["text"] for s in sent] == ["Done.", RATE_LIMITED]
    rows = await conn.fetch(
        "SELECT status FROM inbox WHERE external_id NOT LIKE 'earlier-%' ORDER BY id"
    )
    assert [r["status"] for r in rows] == ["done", "skipped"]


async def test_the_ticker_deletes_finished_rows_older_than_retention_days(
    start_butler: StartButler,
    tmp_path: Path,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    switchboard = await pruning_switchboard(start_butler, tmp_path, monkeypatch)
    conn = await db_conn(switchboard.config.database)
    await conn.execute(
        """
        INSERT INTO inbox (channel, external_id, text, status, received_at, finished_at) VALUES
          ('telegram', 'old-done', 'x', 'done', now() - interval '40 days',
                                                now() - interval '40 days'),
          ('telegram', 'old-failed', 'x', 'failed', now() - interval '40 days',
                                                    now() - interval '31 days'),
          ('telegram', 'old-skipped', 'x', 'skipped', now() - interval '40 days',
                                                      now() - interval '31 days'),
          ('telegram', 'recent-done', 'x', 'done', now() - interval '29 days',
                                                   now() - interval '29 days');
        INSERT INTO routing_log (source_channel, routed_to, created_at) VALUES
          ('telegram', 'general', now() - interval '31 days'),
          ('telegram', 'general', now() - interval '1 day');
        INSERT INTO sessions (trigger_source, prompt, started_at, finished_at) VALUES
          ('classify:telegram', 'p', now() - interval '31 days', now() - interval '31 days'),
          ('classify:telegram', 'p', now() - interval '2 days', now() - interval '2 days');
        """
    )

    async def pruned() -> bool:  # by the daemon's ticker
        counts = await conn.fetchrow(
            """SELECT (SELECT count(*) FROM inbox) AS inbox,
                      (SELECT count(*) FROM routing_log) AS routing_log,
                      (SELECT count(*) FROM sessions) AS sessions"""
        )
        return tuple(counts) == (1, 1, 1)

    await eventually(pruned)
    assert await conn.fetchval("SELECT external_id FROM inbox") == "recent-done"
    assert await conn.fetchval("SELECT count(*) FROM routing_log") == 1
    assert await conn.fetchval("SELECT count(*) FROM sessions") == 1


async def test_every_butler_keeps_its_sessions_as_long_as_the_switchboard_keeps_messages(
    start_butler: StartButler,
    tmp_path: Path,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`[switchboard] retention_days` held for the switchboard alone: the other butlers kept
    their sessions (whose prompts hold people's words) 90 days whatever the owner had set,
    and with a longer setting deleted them under the messages they answered (a year of
    data's walkthrough). Every butler of the config directory takes it."""
    monkeypatch.setattr(daemon_module, "PRUNE_EVERY_S", 0.1)
    config_dir = tmp_path / "config"
    write_butler_dir(config_dir, "general", free_port())
    write_butler_dir(
        config_dir,
        "switchboard",
        free_port(),
        extra='[switchboard]\ndefault_butler = "general"\nretention_days = 30\n',
    )
    fleet = load_config_dir(config_dir)
    assert not fleet.errors
    general = fleet.get("general")
    assert general is not None and general.retention_days == 30
    alone = tmp_path / "alone"
    write_butler_dir(alone, "general", free_port())
    assert load_config_dir(alone).butlers[0].retention_days == DEFAULT_RETENTION_DAYS

    daemon = await start_butler(
        replace(general, runtime=RuntimeConfig(tick_interval_s=0.1)), config_dir=config_dir
    )
    conn = await db_conn(daemon.config.database)
    await conn.execute(
        """INSERT INTO sessions (trigger_source, prompt, started_at, finished_at) VALUES
             ('trigger', 'old', now() - interval '31 days', now() - interval '31 days'),
             ('trigger', 'kept', now() - interval '29 days', now() - interval '29 days')"""
    )

    async def pruned() -> bool:
        return await conn.fetchval("SELECT count(*) FROM sessions") == 1

    await eventually(pruned)
    assert await conn.fetchval("SELECT prompt FROM sessions") == "kept"


async def test_retention_keeps_what_is_not_finished_however_old(
    start_butler: StartButler,
    tmp_path: Path,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards the retention queries (inbox, outbox, sessions): only what is finished goes.
    A message still queued or in flight, a reply not sent yet (pending, or `sending` when a
    crash interrupted it) and a session still running stay, however old; sent and failed
    outbox rows older than retention_days go, as docs/configuration.md says."""
    switchboard = await pruning_switchboard(start_butler, tmp_path, monkeypatch)
    conn = await db_conn(switchboard.config.database)
    # The queued message waits behind one that another switchboard process holds (its lease
    # runs for an hour): this process's worker takes neither, whatever the pruning does.
    await conn.execute(
        """
        INSERT INTO inbox (channel, external_id, source_id, text, status, conversation,
                           claimed_by, lease_until, received_at) VALUES
          ('telegram', 'old-processing', '9', 'x', 'processing', 'telegram:9', 'elsewhere:8100',
           now() + interval '1 hour', now() - interval '100 days');
        INSERT INTO inbox (channel, external_id, source_id, text, status, conversation,
                           received_at) VALUES
          ('telegram', 'old-queued', '9', 'x', 'queued', 'telegram:9',
           now() - interval '100 days');
        INSERT INTO inbox (channel, external_id, text, status, received_at, finished_at) VALUES
          ('telegram', 'old-done', 'x', 'done', now() - interval '100 days',
                                                now() - interval '100 days');
        INSERT INTO outbox (kind, channel, recipient, text, status, created_at, sent_at) VALUES
          ('reply', 'telegram', '9', 'x', 'pending', now() - interval '100 days', NULL),
          ('reply', 'telegram', '9', 'x', 'sending', now() - interval '100 days', NULL),
          ('reply', 'telegram', '9', 'x', 'sent', now() - interval '100 days',
                                              now() - interval '100 days'),
          ('reply', 'telegram', '9', 'x', 'failed', now() - interval '100 days', NULL),
          ('reply', 'telegram', '9', 'x', 'sent', now() - interval '1 day', now());
        INSERT INTO sessions (trigger_source, prompt, started_at, finished_at) VALUES
          ('classify:telegram', 'running', now() - interval '100 days', NULL),
          ('classify:telegram', 'finished', now() - interval '100 days',
                                            now() - interval '100 days');
        """
    )

    async def pruned() -> bool:  # the finished old rows are gone: the ticker has pruned
        return await conn.fetchval(
            """SELECT NOT EXISTS (SELECT 1 FROM inbox WHERE external_id = 'old-done')
                  AND NOT EXISTS (SELECT 1 FROM sessions WHERE prompt = 'finished')
                  AND (SELECT count(*) FROM outbox) = 3"""
        )

    await eventually(pruned)
    inbox = await conn.fetch("SELECT external_id, status FROM inbox ORDER BY id")
    assert [tuple(r) for r in inbox] == [
        ("old-processing", "processing"),
        ("old-queued", "queued"),
    ]
    outbox = await conn.fetch("SELECT status, created_at > now() - interval '2 days' FROM outbox")
    assert sorted(tuple(r) for r in outbox) == [
        ("pending", False),
        ("sending", False),
        ("sent", True),
    ]
    assert await conn.fetchval("SELECT prompt FROM sessions") == "running"
