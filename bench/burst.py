"""A burst of Telegram messages: one at a time, N at once, and two switchboard processes.
(Not a test: run it by hand.)

    .venv/bin/python bench/burst.py [--delay 1.0] [--chats 10] [--per-chat 2] [--write]

20 messages from 10 chats (2 each) arrive at once through the fake Bot API
(tests/fakes/bot_api.py). The scripted model (tests/fakes/messages_api.py) answers every
request after a fixed delay, so each message costs a real classification session (the
classifier routes it to `general`: two model turns) and a real `general` session (one turn)
of the real Claude Code binary. Real `butlers run` processes on an embedded PostgreSQL; each
run gets new databases. Runs, in this order:

  N = 1        [switchboard] max_concurrent_messages = 1 (the default: spec v1, serial)
  N = 4        max_concurrent_messages = 4
  2 x N = 4    two switchboard processes (`butlers run switchboard` and one `--port P`)

`general` has max_concurrent_sessions = 8 in every run: the target is not what is measured.
Figures per run: time from the burst to the last reply; whether each chat's replies came in
its order; lost and duplicated replies; and the switchboard's own time per message apart from
the model, from its spans (exported to tests/fakes/otlp.py): dequeue (the classify span's
start) -> the message's first model request, and the target's answer (the route span's end)
-> the reply at the Bot API. Each run's time is also given as a multiple of N = 1's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import free_port, write_docs_block  # noqa: E402
from butlers.claude_code import isolated_cli_env  # noqa: E402
from butlers.db import EmbeddedServer  # noqa: E402
from tests.fakes.bot_api import FakeBotAPI  # noqa: E402
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use  # noqa: E402
from tests.fakes.otlp import OtlpReceiver  # noqa: E402
from tests.test_cli import Butlers  # noqa: E402

MARK = re.compile(r"chat (\d+) #(\d+)")
CHAT_BASE = 8800


def is_classifier(body: dict) -> bool:
    return any(t["name"] == "mcp__switchboard__route" for t in body.get("tools", []))


@dataclass
class Model:
    """The scripted model: routes every message to general, general answers it; records when
    each message's first request arrived (wall clock)."""

    api: ScriptedMessagesAPI
    delay_s: float
    first_request: dict[tuple[int, int], float] = field(default_factory=dict)

    def install(self) -> None:
        def arrived(body: dict) -> float:
            found = MARK.search(json.dumps(body["messages"][0]))
            if found:
                self.first_request.setdefault((int(found[1]), int(found[2])), time.time())
            return self.delay_s

        def respond(body: dict) -> list[dict]:
            found = MARK.search(json.dumps(body["messages"][0]))
            key = f"chat {found[1]} #{found[2]}" if found else "?"
            if is_classifier(body):
                turns = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
                if turns:
                    return [text("done")]
                return [
                    tool_use(
                        "mcp__switchboard__route",
                        {"butler_name": "general", "tool_name": "trigger", "args": {"prompt": key}},
                    )
                ]
            return [text(f"answer to {key}")]

        self.api.delay_for = arrived
        self.api.respond_with(respond)


@dataclass
class RunResult:
    label: str
    last_reply_s: float
    in_order: bool
    lost: int
    duplicated: int
    dequeue_to_model_ms: list[float]
    answer_to_reply_ms: list[float]
    switchboard_cpu_ms: float  # per message: the switchboard processes' own CPU
    sessions_cpu_ms: float  # per message: the Claude Code sessions' (both of them)


def write_config(
    config_dir: Path, suffix: str, *, general_port: int, switchboard_port: int, n: int, bot: str
) -> list[str]:
    databases = [f"burst_general_{suffix}", f"burst_switchboard_{suffix}"]
    chats = json.dumps([str(CHAT_BASE + i) for i in range(100)])
    for name, port, extra in (
        (
            "general",
            general_port,
            f'[butler.db]\nname = "{databases[0]}"\n[runtime]\nmax_concurrent_sessions = 8\n',
        ),
        (
            "switchboard",
            switchboard_port,
            f'[butler.db]\nname = "{databases[1]}"\n'
            f'[modules.telegram]\nallowed_chat_ids = {chats}\napi_base_url = "{bot}"\n'
            "max_messages_per_s = 0\n"
            f"[switchboard]\nmax_concurrent_messages = {n}\n",
        ),
    ):
        directory = config_dir / name
        directory.mkdir(parents=True, exist_ok=True)
        description = "Everything." if name == "general" else "The front door."
        (directory / "butler.toml").write_text(
            f'[butler]\nname = "{name}"\ndescription = "{description}"\nport = {port}\n{extra}'
        )
    return databases


async def one_run(
    label: str,
    *,
    n: int,
    replicas: int,
    chats: int,
    per_chat: int,
    model: Model,
    env: dict[str, str],
    workdir: Path,
) -> RunResult:
    bot = FakeBotAPI()
    await bot.start()
    otlp = OtlpReceiver()
    await otlp.start()
    model.first_request.clear()
    model.api.requests.clear()
    suffix = uuid.uuid4().hex[:8]
    config_dir = workdir / f"config-{suffix}"
    general_port, switchboard_port = free_port(), free_port()
    write_config(
        config_dir,
        suffix,
        general_port=general_port,
        switchboard_port=switchboard_port,
        n=n,
        bot=bot.url,
    )
    run_env = env | {
        "TELEGRAM_BOT_TOKEN": bot.token,
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url("http"),
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "500",
    }
    args = ("--config-dir", str(config_dir))
    processes = [Butlers("run", "general", *args, env=run_env)]
    processes.append(Butlers("run", "switchboard", *args, env=run_env))
    for _ in range(replicas - 1):
        port = str(free_port())
        processes.append(Butlers("run", "switchboard", "--port", port, *args, env=run_env))
    try:
        for process in processes:
            await process.start()
            await process.wait_ready()
        keys = [(CHAT_BASE + c, k) for k in range(1, per_chat + 1) for c in range(chats)]
        cpu_before = [cpu_times(p) for p in processes]
        offset = time.time() - time.monotonic()
        started = time.monotonic()
        update_ids = await bot.push_batch(
            *(bot.text_update(chat, f"chat {chat} #{k}") for chat, k in keys)
        )
        sent = await bot.wait_sent(len(keys), timeout_s=900)
        last_reply_s = bot.sent_at[len(keys) - 1] - started
        await asyncio.sleep(2)  # a duplicate would come now
        sent = list(bot.sent)
        replies = [s["text"] for s in sent]
        expected = {f"answer to chat {chat} #{k}" for chat, k in keys}
        in_order = all(
            [s["text"] for s in sent if s["chat_id"] == CHAT_BASE + c]
            == [f"answer to chat {CHAT_BASE + c} #{k}" for k in range(1, per_chat + 1)]
            for c in range(chats)
        )
        reply_at = {s["text"]: bot.sent_at[i] + offset for i, s in enumerate(sent)}
        cpu_used = [
            (after[0] - before[0], after[1] - before[1])
            for before, after in zip(cpu_before, (cpu_times(p) for p in processes), strict=True)
        ]
    finally:
        for process in processes:
            await process.stop_quietly()
    await asyncio.sleep(1)  # the last spans arrive
    message_of = {str(u): key for u, key in zip(update_ids, keys, strict=True)}
    by_trace: dict[str, dict] = {}
    for span in otlp.spans:
        by_trace.setdefault(span.trace_id, {}).setdefault(span.name, []).append(span)
    dequeue, answer = [], []
    for spans in by_trace.values():
        receive = spans.get("switchboard.receive", [])
        if not receive or receive[0].attributes.get("message_id") not in message_of:
            continue
        key = message_of[receive[0].attributes["message_id"]]
        if "switchboard.classify" in spans and key in model.first_request:
            start = min(s.start_ns for s in spans["switchboard.classify"]) / 1e9
            dequeue.append((model.first_request[key] - start) * 1000)
        routes = [s for s in spans.get("switchboard.route", []) if s.attributes.get("target")]
        reply = reply_at.get(f"answer to chat {key[0]} #{key[1]}")
        if routes and reply is not None:
            answer.append((reply - max(s.end_ns for s in routes) / 1e9) * 1000)
    await bot.stop()
    await otlp.stop()
    await drop_databases(env, suffix)
    shutil.rmtree(config_dir, ignore_errors=True)
    return RunResult(
        label,
        last_reply_s,
        in_order,
        lost=len(expected - set(replies)),
        duplicated=len(replies) - len(set(replies)),
        dequeue_to_model_ms=dequeue,
        answer_to_reply_ms=answer,
        switchboard_cpu_ms=sum(own for own, _ in cpu_used[1:]) * 1000 / len(keys),
        sessions_cpu_ms=sum(sessions for _, sessions in cpu_used) * 1000 / len(keys),
    )


def cpu_times(process: Butlers) -> tuple[float, float]:
    """A `butlers run` process's own CPU seconds, and its finished children's (its Claude
    Code sessions)."""
    assert process.process is not None
    times = psutil.Process(process.process.pid).cpu_times()
    return times.user + times.system, times.children_user + times.children_system


async def drop_databases(env: dict[str, str], suffix: str) -> None:
    import asyncpg

    admin = await asyncpg.connect(env["DATABASE_URL"])
    try:
        for name in (f"burst_general_{suffix}", f"burst_switchboard_{suffix}"):
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def table(results: list[RunResult], delay_s: float, messages: int, chats: int) -> str:
    serial = results[0].last_reply_s
    lines = [
        f"## burst: {messages} messages from {chats} chats ({date.today()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()})",
        "",
        f"`bench/burst.py`: the scripted model answers every request after {delay_s:g} s; each "
        "message is a classification session (2 model turns) and a `general` session (1 "
        "turn), real Claude Code; real `butlers run` processes on an embedded PostgreSQL. "
        "Overheads are medians per message, from the switchboard's spans.",
        "",
        "| run | last reply | vs N = 1 | chats in order | lost | duplicated "
        "| dequeue -> first model request | target answered -> reply sent "
        "| switchboard CPU / message | Claude Code CPU / message |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {r.last_reply_s:.1f} s | {r.last_reply_s / serial:.2f}x "
            f"| {'yes' if r.in_order else 'NO'} | {r.lost} | {r.duplicated} "
            f"| {median(r.dequeue_to_model_ms)} ms | {median(r.answer_to_reply_ms)} ms "
            f"| {r.switchboard_cpu_ms:.0f} ms | {r.sessions_cpu_ms:.0f} ms |"
        )
    return "\n".join(lines)


RUNS = {"1": ("N = 1", 1, 1), "4": ("N = 4", 4, 1), "2x4": ("2 x N = 4", 4, 2)}


async def main(delay_s: float, chats: int, per_chat: int, write: bool, runs: list[str]) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="butlers-burst-"))
    os.chmod(workdir, 0o711)  # run as root, the embedded PostgreSQL must pass through
    server = EmbeddedServer(workdir / "pgdata", environ=os.environ)
    await server.start()
    api = ScriptedMessagesAPI()
    await api.start()
    model = Model(api, delay_s)
    model.install()
    leaky = ("BUTLERS_", "DATABASE_URL", "TELEGRAM_", "OTEL_", "ANTHROPIC_", "CLAUDE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(leaky)}
    home = workdir / "home"
    home.mkdir()
    env.update(isolated_cli_env(home, api.url, inherited=env))
    env.update(
        DATABASE_URL=server.dsn("postgres"),
        BUTLERS_DATA_DIR=str(workdir / "data"),
        BUTLERS_LOG_LEVEL="WARNING",
    )
    results = []
    try:
        for label, n, replicas in (RUNS[run] for run in runs):
            result = await one_run(
                label,
                n=n,
                replicas=replicas,
                chats=chats,
                per_chat=per_chat,
                model=model,
                env=env,
                workdir=workdir,
            )
            print(
                f"{label}: last reply {result.last_reply_s:.1f} s, in order {result.in_order}, "
                f"lost {result.lost}, duplicated {result.duplicated}",
                flush=True,
            )
            results.append(result)
    finally:
        await api.stop()
        await server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    block = table(results, delay_s, chats * per_chat, chats)
    print(block)
    if write:  # one block per model delay: the default's, and any other's beside it
        write_docs_block("burst" if delay_s == 1.0 else f"burst_delay_{delay_s:g}s", block)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delay", type=float, default=1.0, help="seconds per model answer")
    parser.add_argument("--chats", type=int, default=10)
    parser.add_argument("--per-chat", type=int, default=2)
    parser.add_argument(
        "--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs (all)"
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    if args.write and args.runs != list(RUNS):
        parser.error("--write takes every run (N = 1 is the baseline)")
    asyncio.run(main(args.delay, args.chats, args.per_chat, args.write, args.runs))
