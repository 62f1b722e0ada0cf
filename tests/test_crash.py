"""Never lose a message: SIGKILL the switchboard's process while a message is being
processed, start it again, and the message is processed and answered."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

from butlers.spawner import isolated_cli_env
from tests.conftest import free_port, write_butler_dir
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI, text
from tests.test_cli import Butlers

CHAT = 777


async def test_sigkill_mid_message_then_restart_answers_it(
    tmp_path: Path, bot_api: FakeBotAPI, scripted_api: ScriptedMessagesAPI, pg_server, db_conn
) -> None:
    suffix = uuid.uuid4().hex[:8]
    config_dir = tmp_path / "config"
    write_butler_dir(
        config_dir, "general", free_port(), extra=f'[butler.db]\nname = "crash_general_{suffix}"\n'
    )
    write_butler_dir(
        config_dir,
        "switchboard",
        free_port(),
        extra=(
            f'[butler.db]\nname = "crash_switchboard_{suffix}"\n'
            f'[modules.telegram]\nallowed_chat_ids = ["{CHAT}"]\n'
            f'api_base_url = "{bot_api.url}"\n'
            '[[switchboard.triage]]\nchannel = "telegram"\nbutler = "general"\n'
        ),
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
    env.update(isolated_cli_env(home, scripted_api.url))
    env.update(
        DATABASE_URL=pg_server.dsn("postgres"),
        TELEGRAM_BOT_TOKEN=bot_api.token,
        BUTLERS_DATA_DIR=str(tmp_path / "data"),
    )

    scripted_api.script([text("Survived the crash.")])
    scripted_api.delay_s = 30  # the model "thinks" long enough for us to pull the plug
    first = Butlers("up", "--config-dir", str(config_dir), env=env)
    await first.start()
    second = None
    try:
        await first.wait_ready()
        await bot_api.push_text(CHAT, "are you there?")
        async with asyncio.timeout(60):
            while not scripted_api.requests:  # noqa: ASYNC110 - the general butler's session began
                await asyncio.sleep(0.1)
        await first.crash()

        conn = await db_conn(f"crash_switchboard_{suffix}")
        row = await conn.fetchrow("SELECT status, attempts FROM inbox")
        assert (row["status"], row["attempts"]) == ("processing", 1)
        assert bot_api.sent == []

        scripted_api.delay_s = 0
        second = Butlers("up", "--config-dir", str(config_dir), env=env)
        await second.start()
        await second.wait_ready()
        [sent] = await bot_api.wait_sent(1, timeout_s=60)
        assert sent == {"chat_id": CHAT, "text": "Survived the crash."}
        async with asyncio.timeout(10):  # the row is finished right after the reply is sent
            while (row := await conn.fetchrow("SELECT status, attempts FROM inbox"))[  # noqa: ASYNC110
                "status"
            ] == "processing":
                await asyncio.sleep(0.05)
        assert (row["status"], row["attempts"]) == ("done", 2)
        assert await second.stop() == 0
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
        import asyncpg

        admin = await asyncpg.connect(pg_server.dsn("postgres"))
        for name in ("general", "switchboard"):
            await admin.execute(f'DROP DATABASE IF EXISTS "crash_{name}_{suffix}" WITH (FORCE)')
        await admin.close()
