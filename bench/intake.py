"""Our own overhead on the message path: Telegram intake -> inbox -> triage -> route -> reply.
(Not a test: run it by hand.)

    .venv/bin/python bench/intake.py [--messages 1000] [--write]

`butlers up --only switchboard` runs against a fake Telegram Bot API (tests/fakes/bot_api.py)
with a triage rule instead of the LLM, and routes to an "echo" butler whose `trigger` answers
at once, so what is measured is ours: python-telegram-bot polling, the durable inbox, the
serial worker, route over the kept-open MCP connection, the reply. Two figures:

  latency   messages sent one at a time: receipt (the update is offered) -> reply sent
  burst     all messages offered at once: messages/s end to end, and none lost
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

import uvicorn
from fastmcp import FastMCP

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import _start, free_port, percentile  # noqa: E402
from tests.fakes.bot_api import FakeBotAPI  # noqa: E402

BUTLERS = str(Path(sys.executable).parent / "butlers")
CHAT = 4242


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def echo_butler() -> FastMCP:
    mcp = FastMCP("echo")

    @mcp.tool
    def trigger(prompt: str, _trace_context: dict | None = None) -> dict:
        return {"result": f"echo: {prompt}"}

    return mcp


async def main(count: int, latency_count: int, write: bool) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="butlers-intake-"))
    os.chmod(workdir, 0o711)  # run as root, the embedded PostgreSQL must pass through
    bot = FakeBotAPI()
    await bot.start()
    echo_port, switchboard_port = free_port(), free_port()
    echo = _Uvicorn(
        uvicorn.Config(
            echo_butler().http_app(transport="sse"),
            host="127.0.0.1",
            port=echo_port,
            log_level="warning",
        )
    )
    echo_task = asyncio.create_task(echo.serve())
    config = workdir / "config"
    (config / "echo").mkdir(parents=True)
    (config / "echo" / "butler.toml").write_text(
        f'[butler]\nname = "echo"\ndescription = "Echo."\nport = {echo_port}\n'
    )
    (config / "switchboard").mkdir()
    (config / "switchboard" / "butler.toml").write_text(
        f'[butler]\nname = "switchboard"\nport = {switchboard_port}\n'
        f'[butler.db]\nname = "bench_intake_{os.getpid()}"\n'
        f"[runtime]\ntick_interval_s = 0\n"
        f'[modules.telegram]\nallowed_chat_ids = ["{CHAT}"]\napi_base_url = "{bot.url}"\n'
        # Telegram's 30 messages/s flood limit would be all this measures otherwise.
        "max_messages_per_s = 0\n"
        '[switchboard]\ndefault_butler = "echo"\n'
        # One chat sends them all: the per-sender hourly limit would skip most of them.
        "max_messages_per_sender_per_hour = 0\n"
        '[[switchboard.triage]]\nchannel = "telegram"\nbutler = "echo"\n'
    )
    env = {**os.environ, "BUTLERS_DATA_DIR": str(workdir / "data"), "TELEGRAM_BOT_TOKEN": bot.token}
    process = await _start(
        BUTLERS,
        "up",
        "--only",
        "switchboard",
        "--config-dir",
        str(config),
        env=env,
        ready="Press Ctrl-C to stop.",
    )
    try:
        while "getUpdates" not in bot.calls:  # noqa: ASYNC110 - wait for the poller
            await asyncio.sleep(0.05)
        for i in range(5):  # warm-up: the first route opens the kept connection
            await bot.push_text(CHAT, f"warm-up {i}")
            await bot.wait_sent(i + 1)
        latencies = []
        for _ in range(latency_count):
            offered = time.monotonic()
            await bot.push_text(CHAT, "latency")
            await bot.wait_sent(len(bot.sent) + 1)
            latencies.append((bot.sent_at[-1] - offered) * 1000)
        done_before = len(bot.sent)
        started = time.monotonic()
        for i in range(count):
            await bot.push_text(CHAT, f"burst {i}")
        await bot.wait_sent(done_before + count, timeout_s=600)
        elapsed = bot.sent_at[-1] - started
        # Each routed prompt carries the conversation so far after its first line.
        burst = [s["text"].split("\n")[0] for s in bot.sent[done_before:]]
        in_order = burst == [f"echo: burst {i}" for i in range(count)]
    finally:
        process.send_signal(signal.SIGTERM)
        await process.wait()
        echo.should_exit = True
        await echo_task
        await bot.stop()

    table = "\n".join(
        [
            f"## intake overhead ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, loopback)",
            "",
            "`bench/intake.py`: fake Telegram Bot API -> python-telegram-bot polling -> inbox -> "
            "triage rule (no LLM) -> route over MCP/SSE to an echo butler -> sendMessage.",
            "",
            "| figure | value |",
            "| --- | ---: |",
            f"| latency, one message at a time ({latency_count}): p50 | "
            f"{percentile(latencies, 0.5):.1f} ms |",
            f"| latency, one message at a time: p99 | {percentile(latencies, 0.99):.1f} ms |",
            f"| burst of {count}: messages/s end to end | {count / elapsed:.0f} |",
            f"| burst: replies received, in order | {len(burst)}/{count}, "
            f"{'in order' if in_order else 'OUT OF ORDER'} |",
        ]
    )
    print(table)
    if write:
        from bench.route_overhead import write_docs_block

        write_docs_block("intake", table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--latency-messages", type=int, default=100)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.latency_messages, args.write))
