"""What children say to the gateway on their own, and how the gateway and a child agree on a
protocol revision: a call's progress and log messages reach the host that made the call, a
changed tool list is read again (and an active child's tools replaced in the host's list), a
child on an older revision works, one on an unknown revision is refused by name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.test_gateway import BUTLERS, Host, _append, _env, mcp_json, text_of


async def test_progress_logs_list_changed_and_protocol_revisions(tmp_path: Path) -> None:
    mcp_json(tmp_path, "talker", "--extras")
    mcp_json(tmp_path, "old", "--protocol", "2025-03-26")
    mcp_json(tmp_path, "future", "--protocol", "2099-01-01")
    notifications: list[Any] = []
    logs: list[Any] = []

    async def on_message(message: Any) -> None:
        notifications.append(message)

    async def on_log(params: Any) -> None:
        logs.append(params)

    params = StdioServerParameters(
        command=BUTLERS,
        args=["gateway", "--dir", str(tmp_path), "--no-butlers"],
        env=_env(tmp_path),
        cwd=str(tmp_path),
    )
    with _append(tmp_path / "gateway.stderr") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(
                read, write, message_handler=on_message, logging_callback=on_log, log_level="debug"
            ) as client,
        ):
            await client.initialize()
            host = Host(client, notifications)

            progress: list[tuple[float, float | None, str | None]] = []

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                progress.append((done, total, message))

            call = {"action": "call", "subtool": "progress", "args": {}}
            result = await client.call_tool("talker_suite", call, progress_callback=on_progress)
            assert text_of(result) == "done"
            async with asyncio.timeout(10):
                while len(progress) < 3 or not logs:  # noqa: ASYNC110 - filled by callbacks
                    await asyncio.sleep(0.02)
            assert progress == [(1, 3, "step 1"), (2, 3, "step 2"), (3, 3, "step 3")]
            # (FastMCP sends a log message's text as {"msg": ...})
            assert [(e.level, e.logger, e.data["msg"]) for e in logs] == [
                ("warning", "talker", "half way there")
            ]

            # An active child whose tool list grows: its new tool joins the host's list.
            await host.call("gateway_activate", name="talker")
            await host.wait_list_changed(1)
            assert "extra" not in await host.tools()
            assert text_of(await host.call("grow")) == "grown"
            await host.wait_list_changed(2)
            assert "extra" in await host.tools()
            listed = (await host.suite("talker_suite", "introspect")).structured_content["tools"]
            assert "extra" in {t["name"] for t in listed}

            # An older revision the types package lists works; an unknown one is refused.
            assert text_of(await host.suite("old_suite", "call", "add", a=1, b=1)) == "2"
            result = await host.suite("future_suite", "introspect")
            assert result.is_error
            assert "unsupported protocol version '2099-01-01'" in text_of(result)
            assert "child 'future'" in text_of(result)
