"""Say why, in words (issue 26): a session that fails because Claude Code cannot do its work
says the reason Claude Code gave, with what to do, in the row's error (once, however many
sessions of the message failed for it), `butlers ask` and `butlers inbox`; the person who
wrote still gets the fixed friendly sentence. And each channel module shows as running,
skipped or failed, with why, in `status()`, /health and the dashboard's fleet page.

Real parts: the bundled Claude Code binary (no credentials at all, or a key the scripted
Messages API refuses), the fake Bot API (a token it does not know is answered 401).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from butlers.claude_code import (
    INVALID_KEY,
    RATE_LIMITED,
    REFUSED_KEY_RETRIES,
    ClaudeCodeRun,
    McpTarget,
    RunSigns,
    binary_missing,
    isolated_cli_env,
    known_reason,
    not_logged_in,
    run_claude_code,
)
from butlers.config import OwnerConfig, RuntimeConfig, SwitchboardConfig, TelegramConfig
from butlers.errors import SpawnError
from butlers.switchboard.replies import sorry
from butlers.switchboard.worker import said_once
from tests.conftest import (
    StartButler,
    butler_config,
    eventually,
    free_port,
    log_records,
    write_butler_dir,
)
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_cli_client import run_cli
from tests.test_dashboard import BEARER, cells, dashboard_client, rows_of
from tests.test_inbox import model, start_fleet
from tests.test_notify import CHAT, notify_fleet
from tests.test_operator import call

FAST_RUNTIME = RuntimeConfig(timeout_s=60, tick_interval_s=0)


async def fleet_with(
    start_butler: StartButler,
    tmp_path: Path,
    session_env: dict[str, str],
    runtime: RuntimeConfig = FAST_RUNTIME,
):
    """`general` and a switchboard whose Claude Code sessions (the classifier's, general's)
    all run with `session_env`."""
    config_dir = tmp_path / "config"
    general = await start_butler(butler_config("general", runtime=runtime), session_env=session_env)
    write_butler_dir(config_dir, "general", general.port, description="General things.")
    port = free_port()
    write_butler_dir(config_dir, "switchboard", port, description="Front door.")
    switchboard = await start_butler(
        butler_config("switchboard", port=port, runtime=runtime),
        config_dir=config_dir,
        session_env=session_env,
    )
    return switchboard, general


async def session_errors(db_conn, *daemons) -> list[str | None]:
    errors = []
    for daemon in daemons:
        conn = await db_conn(daemon.config.database)
        errors += [r["error"] for r in await conn.fetch("SELECT error FROM sessions")]
    return errors


# -- A. Claude Code cannot run: why, once -------------------------------------------------------


async def test_ask_without_any_credentials_says_not_logged_in_once_with_the_fix(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """The issue's first hour: no ANTHROPIC_API_KEY, no login, an empty HOME, the real
    bundled binary. Guards claude_code's reasons (the row said "Command failed with exit code
    1" twice) and the worker's said_once (the reason once, not per session). The scripted
    API stands where Claude Code would send requests: it fails before sending any."""
    home = tmp_path / "empty-home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "ANTHROPIC_BASE_URL": scripted_api.url,  # nothing may reach the internet
    }
    assert not [k for k in os.environ if k.startswith(("ANTHROPIC_", "CLAUDE_"))]
    switchboard, general = await fleet_with(start_butler, tmp_path, env)
    url = switchboard.sse_url

    with log_records("butlers.switchboard.worker") as records:
        code, out, err = await run_cli("ask", "Log my weight: 80kg", "--url", url)
    assert code == 1 and out == "", (out, err)
    reason = not_logged_in()
    assert "log in with `" in reason and "/_bundled/claude /login`" in reason, reason
    # `butlers ask` says why, once, and what to do; then where it happened.
    assert err.count("not logged in") == 1, err
    assert f": {reason} (classifier; routed to general; general: " in err, err
    assert "exit code" not in err and "Command failed" not in err, err
    # The log says it too (the classifier's fallback to general).
    assert any(reason in r.getMessage() for r in records), [r.getMessage() for r in records]

    conn = await db_conn(switchboard.config.database)
    row = await conn.fetchrow("SELECT * FROM inbox")
    assert row["status"] == "failed" and row["error"].startswith(reason), row["error"]
    # The person who wrote gets the fixed sentence, nothing of Claude Code's.
    assert row["reply"] == sorry("failed", "general")
    assert await session_errors(db_conn, switchboard, general) == [reason, reason]
    assert scripted_api.requests == [] and scripted_api.other_requests == []

    code, out, err = await run_cli("inbox", "--url", url)
    assert code == 0, err
    assert out.count("not logged in") == 1 and reason in out, out
    # With --json: the answer on stdout, and exit 1 still (it was 0: scripts saw success).
    code, out, err = await run_cli("ask", "Log my weight: 81kg", "--json", "--url", url)
    assert code == 1 and json.loads(out)["status"] == "failed", (out, err)
    assert "not logged in" in err


@pytest.mark.parametrize(
    ("status", "kind", "said", "reason"),
    [
        (401, "authentication_error", "invalid x-api-key", INVALID_KEY),
        (429, "rate_limit_error", "Number of request tokens has exceeded your limit", RATE_LIMITED),
    ],
    ids=["invalid-key", "rate-limit"],
)
async def test_a_refused_key_and_a_rate_limit_are_named(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    status: int,
    kind: str,
    said: str,
    reason: str,
) -> None:
    """The Messages API answers every request with 401 (a wrong key) or 429: the row says
    which, once, with what to do; the person gets the fixed sentence. Claude Code retries
    both ten times over about three minutes: a 401 is given up at its second retry by the
    run itself (REFUSED_KEY_RETRIES), a 429 waits (CLAUDE_CODE_MAX_RETRIES=0 here)."""
    scripted_api.error = (status, kind, said)
    home = tmp_path / "api-home"
    home.mkdir()
    env = isolated_cli_env(home, scripted_api.url, "sk-ant-wrong", inherited=os.environ)
    if status != 401:
        env["CLAUDE_CODE_MAX_RETRIES"] = "0"
    switchboard, general = await fleet_with(start_butler, tmp_path, env)
    started = time.monotonic()
    answer = await call(switchboard, "ask", text="Log my weight: 80kg")
    took_s = time.monotonic() - started
    # A rate limit passes: the session did nothing ("before acting"), and the person is
    # told the service is busy (a message from a chat would wait and be tried again).
    kind = "busy" if status == 429 else "failed"
    assert (answer["status"], answer["reply"]) == ("failed", sorry(kind, "general"))
    assert answer["error"].startswith(f"{reason} (classifier; routed to general; "), answer
    assert answer["error"].count(reason) == 1
    assert await session_errors(db_conn, switchboard, general) == [reason, reason]
    # Each session: its request, then one retry for a 401 (a login's token is refreshed on
    # a 401, so the first retry is Claude Code's); the third would come seconds later.
    per_session = REFUSED_KEY_RETRIES if status == 401 else 1
    assert len(scripted_api.requests) == 2 * per_session, took_s
    # Nor later: each CLI was ended, not left to its next retry (1.2 s after the second).
    await asyncio.sleep(2.5)
    assert len(scripted_api.requests) == 2 * per_session


async def test_a_refused_token_without_an_api_key_is_left_to_claude_codes_retries(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """Without an API key (a login, or ANTHROPIC_AUTH_TOKEN) a 401 may be a token another
    run is refreshing: the run does not give up at the second retry, and the session's
    timeout decides, saying what it waited on."""
    scripted_api.error = (401, "authentication_error", "invalid bearer token")
    home = tmp_path / "api-home"
    home.mkdir()
    env = isolated_cli_env(home, scripted_api.url, "", inherited=os.environ)
    env["ANTHROPIC_AUTH_TOKEN"] = "sk-ant-oat-expired"
    runtime = RuntimeConfig(timeout_s=4, tick_interval_s=0)
    switchboard, general = await fleet_with(start_butler, tmp_path, env, runtime)
    answer = await call(switchboard, "ask", text="hello")
    assert answer["status"] == "failed"
    # Its butler's session timeout: "took too long", not "could not finish that".
    assert answer["reply"] == sorry("timeout", "general")
    for error in await session_errors(db_conn, switchboard, general):
        assert error.startswith("Claude Code session timed out after 4s: Claude Code was "), error
    assert len(scripted_api.requests) > 2 * REFUSED_KEY_RETRIES  # retried past the second


async def test_a_session_cut_short_while_retrying_says_what_it_waited_on(
    start_butler: StartButler, tmp_path: Path, scripted_api: ScriptedMessagesAPI, db_conn
) -> None:
    """Claude Code retries a rate limit for minutes; a session whose timeout comes first
    says it was waiting on the Messages API and why (the api_retry messages), not
    only "timed out"."""
    scripted_api.error = (429, "rate_limit_error", "Number of requests has exceeded your limit")
    home = tmp_path / "api-home"
    home.mkdir()
    env = isolated_cli_env(home, scripted_api.url, "sk-ant-wrong", inherited=os.environ)
    runtime = RuntimeConfig(timeout_s=3, tick_interval_s=0)
    switchboard, general = await fleet_with(start_butler, tmp_path, env, runtime)
    answer = await call(switchboard, "ask", text="hello")
    assert answer["status"] == "failed"
    assert answer["reply"] == sorry("busy", "general")  # it waited on a rate limit: it passes
    [classifier, triggered] = await session_errors(db_conn, switchboard, general)
    for error in (classifier, triggered):
        assert error.startswith(
            "Claude Code session timed out after 3s: Claude Code was retrying the Messages "
            "API (attempt "
        ), error
        assert error.endswith(f"): {RATE_LIMITED}"), error
    assert answer["error"].startswith(f"{RATE_LIMITED} (classifier: Claude Code session timed")
    assert answer["error"].count(RATE_LIMITED) == 1


async def test_what_claude_code_echoes_is_redacted_and_cut_short(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error we have no name for is a short excerpt of what Claude Code said, through
    the butler's Redactor: the API key it echoes (the configured ANTHROPIC_API_KEY) is in
    no row and no answer."""
    secret = f"sk-ant-api03-{uuid.uuid4().hex}"
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)  # the butlers' Settings: a secret
    scripted_api.error = (500, "api_error", "upstream refused key {key} " + "x" * 600)
    home = tmp_path / "api-home"
    home.mkdir()
    env = isolated_cli_env(home, scripted_api.url, secret, inherited=os.environ)
    env["CLAUDE_CODE_MAX_RETRIES"] = "0"
    switchboard, general = await fleet_with(start_butler, tmp_path, env)
    answer = await call(switchboard, "ask", text="hello")
    assert answer["status"] == "failed"
    errors = await session_errors(db_conn, switchboard, general)
    for error in errors:
        assert error.startswith(
            "Claude Code session failed: API Error: 500 upstream refused key [redacted] x"
        )
        assert len(error) <= 400, error  # cut short
    conn = await db_conn(switchboard.config.database)
    row = await conn.fetchrow("SELECT error, reply FROM inbox")
    for text in (answer["error"], row["error"], row["reply"], *errors):
        assert secret not in text
    assert "[redacted]" not in row["reply"] and "500" not in row["reply"]


def test_claude_codes_words_name_the_reason() -> None:
    """What the bundled CLI printed for each case (seen against a scripted API), named."""
    cases = {
        "Not logged in · Please run /login": not_logged_in(),
        "Invalid API key · Fix external API key": INVALID_KEY,
        "API Error: Request rejected (429) · Number of request tokens has exceeded": RATE_LIMITED,
    }
    for said, reason in cases.items():
        assert known_reason(said) == reason, said
    assert "credit" in (known_reason("Credit balance is too low", kind="billing_error") or "")
    assert "529" in (known_reason("API Error: 529 Overloaded. This is a server-side") or "")
    assert "credentials" in (known_reason("Failed to authenticate. API Error: 403 no") or "")
    assert known_reason("API Error: 500 Internal server error") is None
    assert known_reason(status=401) == INVALID_KEY and known_reason(kind="rate_limit")


def test_stderr_is_kept_clean_and_short_and_said_when_nothing_else_is() -> None:
    signs = RunSigns()
    for n in range(50):
        signs.on_stderr(f"\x1b[31mline {n}\x1b[0m\x07 " + "y" * 2000)
    assert len(signs.stderr) == 20 and all(len(line) <= 500 for line in signs.stderr)
    why = signs.why("", "Claude Code could not run", fallback="Command failed with exit code 1")
    assert why.startswith("Claude Code could not run: line 47 yyy") and "\x1b" not in why
    assert len(why) < 340
    signs.on_stderr("Error: Not logged in")
    assert signs.why("", "Claude Code could not run") == not_logged_in()


def test_a_bare_exit_code_is_explained_by_the_failed_turn() -> None:
    """The issue's row: the SDK raised only "Command failed with exit code 1"; the turn
    before it had said why (an AssistantMessage with error authentication_failed)."""
    signs = RunSigns(
        api_error="authentication_failed", api_text="Not logged in · Please run /login"
    )
    bare = "Command failed with exit code 1 (exit code: 1)\nError output: Check stderr output"
    assert signs.why("", "Claude Code could not run", fallback=bare) == not_logged_in()
    assert RunSigns().why("", "Claude Code could not run", fallback=bare) == (
        "Claude Code could not run: Command failed with exit code 1 (exit code: 1)"
    )


def test_a_reason_several_sessions_gave_is_said_once() -> None:
    reason = not_logged_in()
    assert said_once(
        [
            f"classifier: {reason}; routed to general",
            "general: butler 'general' answered 'trigger' with an error: session 1 failed: "
            + reason,
        ]
    ) == (
        f"{reason} (classifier; routed to general; general: butler 'general' answered "
        "'trigger' with an error: session 1 failed)"
    )
    # Different reasons, or one alone: each part as it was.
    assert said_once([f"classifier: {reason}", None, "general: down"]) == (
        f"classifier: {reason}; general: down"
    )
    assert said_once([None]) is None


async def test_a_missing_binary_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The binary cannot be missing here (the wheel bundles it): the SDK's lookup is made to
    find none, as on a platform whose wheel bundles none and no `claude` on PATH."""
    from claude_agent_sdk._internal.transport.subprocess_cli import SubprocessCLITransport

    monkeypatch.setattr(SubprocessCLITransport, "_find_bundled_cli", lambda self: None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("HOME", str(tmp_path))
    run = ClaudeCodeRun("system", 1, tmp_path / "work", inherited=dict(os.environ))
    with pytest.raises(SpawnError) as failed:
        await run_claude_code("hi", McpTarget("x", url="http://127.0.0.1:9/sse"), run, [])
    assert str(failed.value) == binary_missing()


# -- B. Modules: running, skipped, failed, with why ---------------------------------------------


async def health_modules(daemon) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{daemon.base_url}/health") as response:
            body = await response.json()
    return {m["name"]: m for m in body["modules"]}


@pytest.mark.parametrize(
    ("token", "state", "detail"),
    [
        (None, "skipped", "TELEGRAM_BOT_TOKEN not set"),
        (
            "424242:WRONG",
            "failed",
            "Telegram rejected the bot token (401 Unauthorized): check TELEGRAM_BOT_TOKEN",
        ),
        ("good", "running", "@butler_bot"),
    ],
    ids=["unset", "rejected", "running"],
)
async def test_a_module_shows_its_state_and_why_everywhere(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    monkeypatch: pytest.MonkeyPatch,
    pg_server,
    token: str | None,
    state: str,
    detail: str,
) -> None:
    """Guards module_report, _not_configured and the fleet page (which listed `telegram` for
    a module skipped as not configured): status(), /health and the fleet page show the
    state and why. A token the fake Bot API does not know is answered 401, as Telegram does."""
    if token is None:
        monkeypatch.delenv("TELEGRAM_BOT_TOKEN")
    elif token != "good":
        monkeypatch.setenv("TELEGRAM_BOT_TOKEN", token)
    scripted_api.respond_with(model("general"))
    telegram = TelegramConfig(allowed_chat_ids=("1",), api_base_url=bot_api.url)
    switchboard, _ = await start_fleet(
        start_butler, tmp_path, names=("general",), telegram=telegram
    )

    async def settled() -> bool:
        return (await health_modules(switchboard))["telegram"]["state"] == state

    await eventually(settled)
    telegram_health = (await health_modules(switchboard))["telegram"]
    assert telegram_health["detail"].startswith(detail), telegram_health
    assert telegram_health["status"] == state  # the earlier name, still there
    [module] = [
        m for m in (await call(switchboard, "status"))["modules"] if m["name"] == "telegram"
    ]
    assert module == telegram_health

    async with dashboard_client(pg_server, switchboard) as client:
        page = await client.get("/ui", headers=BEARER)
    assert page.status_code == 200, page.text
    [row] = [r for r in rows_of(page.text, "fleet") if 'data-butler="switchboard"' in r]
    shown = cells(row)[3]
    assert shown.startswith(f"telegram: {state} ({detail}"), shown
    assert f'data-module="telegram" data-state="{state}"' in row


async def test_the_owner_is_told_where_the_reason_is(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    """A person gets the fixed sentence only; the owner, who can read why, is also told
    which message to look up (a walkthrough's owner got "please try again later", which
    could not help: Claude Code had no credentials)."""
    owner = OwnerConfig(telegram_chat_id=str(CHAT))
    _, general = await notify_fleet(start_butler, tmp_path, bot_api, SwitchboardConfig(owner=owner))
    await general.stop()  # its route fails at once
    await bot_api.push_text(CHAT, "note: buy milk")
    [sent] = await bot_api.wait_sent(1, timeout_s=60)
    assert sent["text"].startswith(sorry("unreachable", "general")), sent
    assert sent["text"].endswith("\n\n(Message 1: `butlers inbox` says why.)"), sent
