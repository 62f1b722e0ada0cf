"""Exposing the switchboard: a Telegram webhook behind a reverse proxy that keeps the public
Host, secrets compared as bytes, request bodies capped, and no listening beyond loopback
without a token."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from fastmcp import Client

from butlers.config import SwitchboardConfig
from butlers.daemon import FILES_REQUEST_BYTES
from butlers.errors import ButlersError
from butlers.http import is_loopback, require_token_beyond_loopback
from tests.conftest import WEBHOOK_SECRET as SECRET
from tests.conftest import StartButler, butler_config
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.fakes.proxy import ReverseProxy
from tests.test_cli_client import run_cli
from tests.test_telegram import CHAT, start_general_only

PUBLIC = "https://bot.example.com/telegram/webhook"


async def webhook_switchboard(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    *,
    mode: str = "webhook",
    **telegram,
):
    """A switchboard and `general` (which answers "Via the proxy."), Telegram in `mode`, and a
    256 KiB body limit."""
    return await start_general_only(
        start_butler,
        tmp_path,
        bot_api,
        scripted_api,
        "Via the proxy.",
        mode=mode,
        telegram=telegram,
        switchboard=SwitchboardConfig(max_request_bytes=256 * 1024),
    )


async def wait_for(condition, timeout_s: float = 30) -> None:
    """Until the fake Bot API's call log shows what we wait for (it has no event for it)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def raw_post(base_url: str, path: str, headers: bytes, body: bytes) -> int:
    """A request written byte by byte: clients refuse to send non-ASCII header values, an
    attacker does not."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + f"{host}:{port}".encode()
            + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + headers
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )  # fmt: skip
        await writer.drain()
        status_line = await reader.readline()
        return int(status_line.split()[1])
    finally:
        writer.close()


async def test_webhook_behind_a_proxy_that_keeps_the_host(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    switchboard = await webhook_switchboard(
        start_butler, tmp_path, bot_api, scripted_api, webhook_url=PUBLIC
    )
    # At start the switchboard registered its public URL and secret with Telegram.
    await wait_for(lambda: bot_api.webhooks)
    [registered] = bot_api.webhooks
    assert (registered["url"], registered["secret_token"]) == (PUBLIC, SECRET)
    assert "deleteWebhook" not in bot_api.calls

    proxy = ReverseProxy(switchboard.base_url)
    await proxy.start()
    try:
        update = {"update_id": 501, "message": bot_api._message(CHAT, text="through nginx")}
        async with aiohttp.ClientSession() as session:
            hook = f"{proxy.url}/telegram/webhook"
            public = {"Host": "bot.example.com"}
            async with session.post(
                hook, json=update, headers={**public, "X-Telegram-Bot-Api-Secret-Token": "wrong"}
            ) as response:
                assert response.status == 401
            async with session.post(
                hook, json=update, headers={**public, "X-Telegram-Bot-Api-Secret-Token": SECRET}
            ) as response:
                assert response.status == 200, await response.text()
            # The MCP endpoints still refuse a foreign Host (DNS rebinding guard).
            async with session.get(f"{proxy.url}/sse", headers=public) as response:
                assert response.status == 421
    finally:
        await proxy.stop()
    [sent] = await bot_api.wait_sent(1)
    assert sent == {"chat_id": CHAT, "text": "Via the proxy."}


@pytest.mark.parametrize(
    "secret_header",
    [
        b"X-Telegram-Bot-Api-Secret-Token: h\xe9\xffk-s\xc3\xa9cret\r\n",
        b"X-Telegram-Bot-Api-Secret-Token: " + SECRET.encode()[:-1] + b"\xe9\r\n",
        b"",
    ],
    ids=["latin-1", "almost", "missing"],
)
async def test_a_wrong_or_non_ascii_secret_is_401_never_500(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    secret_header: bytes,
    db_conn,
) -> None:
    switchboard = await webhook_switchboard(start_butler, tmp_path, bot_api, scripted_api)
    body = json.dumps({"update_id": 9, "message": bot_api._message(CHAT, text="x")}).encode()
    status = await raw_post(switchboard.base_url, "/telegram/webhook", secret_header, body)
    assert status == 401
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT count(*) FROM inbox") == 0


async def test_bodies_over_the_limit_get_413(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    switchboard = await webhook_switchboard(start_butler, tmp_path, bot_api, scripted_api)
    big = json.dumps(
        {"update_id": 10, "message": bot_api._message(CHAT, text="x" * (2 * 1024 * 1024))}
    ).encode()
    secret = {"X-Telegram-Bot-Api-Secret-Token": SECRET}
    async with aiohttp.ClientSession() as session:
        # Declared with Content-Length: refused before it is read.
        async with session.post(
            f"{switchboard.base_url}/telegram/webhook", data=big, headers=secret
        ) as response:
            assert response.status == 413

        # Streamed without a length (chunked): counted as it arrives.
        async def chunks():
            for start in range(0, len(big), 64 * 1024):
                yield big[start : start + 64 * 1024]

        async with session.post(
            f"{switchboard.base_url}/telegram/webhook", data=chunks(), headers=secret
        ) as response:
            assert response.status == 413
        # The MCP endpoints of a switchboard without a token (on loopback: its callers are
        # the owner's butlers) take a butler's files, up to FILES_REQUEST_BYTES; past it, a
        # clean 413 too, chunked or not, never a 500 from a half-read body.
        huge = b" " * (FILES_REQUEST_BYTES + 1)

        async def huge_chunks():
            for start in range(0, len(huge), 1024 * 1024):
                yield huge[start : start + 1024 * 1024]

        for path in ("/mcp", "/messages/?session_id=0"):
            async with session.post(
                f"{switchboard.base_url}{path}", data=huge_chunks()
            ) as response:
                assert response.status == 413, path
            async with session.post(f"{switchboard.base_url}{path}", data=huge) as response:
                assert response.status == 413, path
    async with Client(switchboard.sse_url) as client:
        with pytest.raises(Exception):  # noqa: B017 (the transport reports the 413 its own way)
            await client.call_tool("ask", {"text": "y" * 300_000}, timeout=5)
    async with Client(switchboard.sse_url) as client:  # the SDK client drops a session on 413
        assert (await client.call_tool("status", {})).data["name"] == "switchboard"
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT count(*) FROM inbox") == 0


async def test_polling_mode_removes_a_webhook(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    await webhook_switchboard(start_butler, tmp_path, bot_api, scripted_api, mode="polling")
    await wait_for(lambda: "getUpdates" in bot_api.calls)
    assert bot_api.calls.index("deleteWebhook") < bot_api.calls.index("getUpdates")
    assert bot_api.webhooks == []


async def test_webhook_mode_without_a_usable_secret_is_reported(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", "spaces are not allowed")
    switchboard = await webhook_switchboard(
        start_butler, tmp_path, bot_api, scripted_api, webhook_url=PUBLIC
    )
    await wait_for(lambda: "getMe" in bot_api.calls)
    async with Client(switchboard.sse_url) as client:
        for _ in range(100):
            status = (await client.call_tool("status", {})).data
            [telegram] = [m for m in status["modules"] if m["name"] == "telegram"]
            if telegram["state"] != "starting":
                break
            await asyncio.sleep(0.05)
    assert telegram["state"] == "failed"
    assert "TELEGRAM_WEBHOOK_SECRET must be 1-256 characters" in telegram["detail"]
    assert bot_api.webhooks == []


def test_loopback_names() -> None:
    for host in (
        "127.0.0.1",
        "127.0.0.2",
        "::1",
        "[::1]",
        "localhost",
        "LocalHost",
        "::ffff:127.0.0.1",
    ):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.5", "butlers.lan", "", "::ffff:10.0.0.1"):
        assert not is_loopback(host), host
    require_token_beyond_loopback("x", "0.0.0.0", "t" * 24)  # with a long enough token: allowed
    require_token_beyond_loopback("x", "127.0.0.1", "short")  # on loopback: any token


async def test_listening_beyond_loopback_needs_a_token(start_butler: StartButler) -> None:
    with pytest.raises(ButlersError, match="set BUTLERS_AUTH_TOKEN") as refused:
        await start_butler(butler_config(host="0.0.0.0"))
    assert "butler 'alpha' is set to listen on 0.0.0.0" in str(refused.value)
    code, _, err = await run_cli(
        "gateway", "--transport", "sse", "--host", "0.0.0.0", "--no-butlers", env={}
    )
    assert code == 1 and "the gateway is set to listen on 0.0.0.0" in err
    assert "BUTLERS_AUTH_TOKEN" in err


async def test_a_short_token_beyond_loopback_is_refused_at_start(start_butler: StartButler) -> None:
    """A token that guards a port beyond this machine (and the dashboard's sign-in form) is
    at least 24 characters: a short one is refused at start, naming the variable and the
    length, and never shown."""
    short = "23-characters-is-short!"
    with pytest.raises(ButlersError) as refused:
        await start_butler(butler_config(host="0.0.0.0"), auth_token=short)
    assert str(refused.value).startswith(
        "butler 'alpha' is set to listen on 0.0.0.0, beyond this machine, and "
        "BUTLERS_AUTH_TOKEN is 23 characters: it needs at least 24"
    )
    assert short not in str(refused.value)
    code, _, err = await run_cli(
        "gateway", "--transport", "sse", "--host", "0.0.0.0", "--no-butlers", token=short
    )
    assert code == 1 and "BUTLERS_AUTH_TOKEN is 23 characters: it needs at least 24" in err
    assert short not in err
    # On loopback the same token is fine (nobody else reaches the port).
    daemon = await start_butler(auth_token=short)
    async with Client(daemon.sse_url, auth=short) as client:
        assert (await client.call_tool("status", {})).data["name"] == "alpha"
