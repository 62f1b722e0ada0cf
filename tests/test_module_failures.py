"""A channel whose credentials are wrong at runtime: the module is `failed` with a reason an
operator can act on, in /health and in the log (not only "did not stop cleanly" at the end),
and the secret itself appears in neither. A real `butlers run switchboard` (its log is what
an operator reads, redaction and all) against the fake Bot API, which answers 401 to a token
it does not know as Telegram does, and a real IMAP server (pymap) refusing the password."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import aiohttp
import asyncpg

from butlers.config import SwitchboardConfig
from tests.conftest import StartButler, eventually, free_port, log_records, write_butler_dir
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.mail import pymap_server
from tests.test_cli import Butlers
from tests.test_telegram import start_telegram_fleet

USER, PASSWORD = "butler", "imap-pw"


async def modules_of(port: int) -> dict[str, dict[str, str]]:
    """The modules in a butler's /health, by name."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/health") as response:
            body = await response.json()
    return {m["name"]: m for m in body["modules"]}


async def health_text(port: int) -> str:
    """A butler's /health as text: to look for secrets anywhere in it."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/health") as response:
            return await response.text()


async def test_a_wrong_bot_token_and_imap_password_are_reported_without_the_secrets(
    tmp_path: Path, bot_api: FakeBotAPI, pg_server
) -> None:
    """Guards telegram.py's InvalidToken handling (it used to re-raise out of its task: the
    status said only "rejected the token", nothing was logged until the stop failed with a
    traceback naming the token) and mail_imap's refusal state."""
    token = f"424242:WRONG-{uuid.uuid4().hex}"  # well formed, unknown to the Bot API: 401
    password = f"wrong-{uuid.uuid4().hex}"
    database = f"modfail_switchboard_{uuid.uuid4().hex[:8]}"
    port = free_port()
    async with pymap_server(USER, PASSWORD, fast_login=True) as imap_port:
        write_butler_dir(tmp_path / "config", "general", free_port())  # named, not started
        write_butler_dir(
            tmp_path / "config",
            "switchboard",
            port,
            extra=(
                f'[butler.db]\nname = "{database}"\n[switchboard]\n'
                f'[modules.telegram]\nallowed_chat_ids = ["1"]\napi_base_url = "{bot_api.url}"\n'
                f'[modules.email]\nimap_host = "127.0.0.1"\nimap_port = {imap_port}\n'
                'imap_ssl = false\nsmtp_host = "127.0.0.1"\nsmtp_port = 1\nsmtp_starttls = false\n'
                'mode = "poll"\nallowed_senders = ["user@example.com"]\n'
            ),
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
        env.update(
            DATABASE_URL=pg_server.dsn("postgres"),
            BUTLERS_DATA_DIR=str(tmp_path / "data"),
            BUTLERS_LOG_LEVEL="DEBUG",  # every record: none may carry a secret
            TELEGRAM_BOT_TOKEN=token,
            BUTLERS_EMAIL_USER=USER,
            BUTLERS_EMAIL_PASSWORD=password,
        )
        switchboard = Butlers(
            "run", "switchboard", "--config-dir", str(tmp_path / "config"), env=env
        )
        try:
            await switchboard.start()
            await switchboard.wait_ready()

            async def both_failed() -> bool:
                modules = await modules_of(port)
                return all(modules[name]["state"] == "failed" for name in ("telegram", "email"))

            await eventually(both_failed, timeout_s=60)
            modules = await modules_of(port)
            health = await health_text(port)
            await switchboard.wait_stderr("Telegram rejected the bot token")
            await switchboard.wait_stderr("refused the login")
            assert await switchboard.stop() == 0
        finally:
            switchboard.kill()
            admin = await asyncpg.connect(pg_server.dsn("postgres"))
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            finally:
                await admin.close()
    assert modules["telegram"]["detail"] == (
        "Telegram rejected the bot token (401 Unauthorized): check TELEGRAM_BOT_TOKEN, then restart"
    )
    assert f"IMAP 127.0.0.1:{imap_port} refused the login of 'butler'" in modules["email"]["detail"]
    log = switchboard.stderr
    assert "telegram: Telegram rejected the bot token (401 Unauthorized)" in log
    assert f"email: IMAP refused: IMAP 127.0.0.1:{imap_port} refused the login of 'butler'" in log
    assert "did not stop cleanly" not in log and "Traceback" not in log, log
    for secret in (token, token.split(":")[1], password):
        assert secret not in health
        assert secret not in log


async def test_a_bot_token_revoked_while_polling_fails_the_module(
    start_butler: StartButler, tmp_path: Path, bot_api: FakeBotAPI
) -> None:
    """Guards telegram.py's poll loop: a getUpdates answered 401 (the token was revoked in
    @BotFather while the switchboard ran) is not retried as if the Bot API were down for
    ever: the module is `failed`, says why, and polls no more."""
    switchboard, _ = await start_telegram_fleet(
        start_butler, tmp_path, bot_api, names=(), switchboard=SwitchboardConfig()
    )
    await bot_api.wait_until(lambda: bool(bot_api.polls))  # it polls with the good token
    assert (await modules_of(switchboard.port))["telegram"]["state"] == "running"
    with log_records("butlers.modules.telegram") as records:
        bot_api.token = "424242:REVOKED"  # the module's token is no longer the bot's
        await bot_api.push_edit(1, "ends the waiting poll")  # ignored by the module

        async def failed() -> bool:
            return (await modules_of(switchboard.port))["telegram"]["state"] == "failed"

        await eventually(failed)
    telegram = (await modules_of(switchboard.port))["telegram"]
    assert telegram["detail"].startswith("Telegram rejected the bot token (401 Unauthorized)")
    assert [r.getMessage() for r in records if r.levelname == "ERROR"] == [
        f"telegram: {telegram['detail']}"
    ]
