"""How fast the dashboard's pages render with 100 000 inbox rows and 100 000 routing_log rows,
against the same pages on a database of 100 of each (the baseline, in the same run). (Not a
test: run it by hand.)

    .venv/bin/python bench/dashboard.py [--rows 100000] [--rounds 30] [--write]

An embedded PostgreSQL holds two switchboard databases, migrated like a real one and filled
with generate_series (statuses, channels, butlers and outcomes mixed as a busy fleet has them:
1 % failed, 2 % to a rare butler). Each page is asked for `--rounds` times in this process
over ASGI (httpx), so what is measured is the dashboard: its queries and its templates, not a
network. The fleet page is left out: it waits on each butler's /health and `status` (one
concurrent round trip each, bounded by a 1.5-3 s timeout), not on these tables. The query
plans are checked too: each page's statement must use an index, never a sequential scan.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import write_docs_block  # noqa: E402
from butlers.core_store import CoreStore  # noqa: E402
from butlers.dashboard.app import Dashboard, DashboardParts  # noqa: E402
from butlers.dashboard.fleet import FleetProbe  # noqa: E402
from butlers.dashboard.store import DashboardStore  # noqa: E402
from butlers.db import EmbeddedServer, create_pool, prepare_database  # noqa: E402
from butlers.mcp_connection.pool import McpConnections  # noqa: E402

TARGET_MS = 100
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"

SEED = """
INSERT INTO inbox (channel, external_id, source_id, sender_name, text, status, routed_to,
                   classified_via, reply, error, trace_context, received_at, finished_at,
                   attempts)
SELECT (ARRAY['telegram', 'email', 'mcp'])[1 + n % 3], 'x-' || n, 'sender-' || (n % 500),
       'Sender ' || (n % 500),
       'Message ' || n || ': ' || repeat('please remember the thing I said earlier. ', 8),
       CASE WHEN n % 100 = 0 THEN 'failed' ELSE 'done' END,
       (ARRAY['general', 'health', 'relationship'])[1 + n % 3],
       CASE WHEN n % 7 = 0 THEN 'thread' ELSE 'claude' END,
       CASE WHEN n % 100 = 0 THEN NULL ELSE 'Done: ' || repeat('noted. ', 20) END,
       CASE WHEN n % 100 = 0 THEN 'butler ''health'' is down' END,
       jsonb_build_object('traceparent', '00-' || md5(n::text) || '-00f067aa0ba902b7-01'),
       now() - make_interval(secs => $1 - n), now() - make_interval(secs => $1 - n - 1), 1
FROM generate_series(1, $1) AS n;
"""
SEED_ROUTES = """
INSERT INTO routing_log (source_channel, source_id, routed_to, prompt_summary, trace_id,
                         created_at, tool_name, success, error, duration_ms, inbox_id)
SELECT 'telegram', 'sender-' || (n % 500),
       CASE WHEN n % 50 = 0 THEN 'rare' ELSE (ARRAY['general', 'health'])[1 + n % 2] END,
       'Message ' || n, md5(n::text), now() - make_interval(secs => $1 - n), 'trigger',
       n % 100 <> 0, CASE WHEN n % 100 = 0 THEN 'connection refused' END, 40 + n % 200, n
FROM generate_series(1, $1) AS n;
"""
SEED_SESSIONS = """
INSERT INTO sessions (trigger_source, prompt, result, success, tool_calls, duration_ms,
                      trace_id, started_at, finished_at, cost_usd)
SELECT 'classifier', 'Classify message ' || n, 'routed', true,
       '[{"name": "mcp__switchboard__route", "input": {"butler_name": "general"}}]'::jsonb,
       900 + n % 300, md5(n::text), now() - make_interval(secs => $1 - n), now(), 0.0031
FROM generate_series(1, $1) AS n;
"""


def pages(rows: int) -> dict[str, str]:
    middle = rows // 2
    return {
        "messages": "/ui/messages",
        "messages ?status=failed": "/ui/messages?status=failed",
        "messages ?channel=email": "/ui/messages?channel=email",
        "messages ?before= (half way)": f"/ui/messages?before={middle}",
        "one message": f"/ui/messages/{middle}",
        "routing log": "/ui/routes",
        "routing log ?butler=rare": "/ui/routes?butler=rare",
        "routing log ?outcome=failed": "/ui/routes?outcome=failed",
    }


async def seeded(server: EmbeddedServer, name: str, rows: int):
    await prepare_database(server, name, ("core", "switchboard"))
    pool = await create_pool(server, name)
    async with pool.acquire() as conn:
        await conn.execute(SEED, rows)
        await conn.execute(SEED_ROUTES, rows)
        await conn.execute(SEED_SESSIONS, min(rows, 20_000))
        await conn.execute("ANALYZE")
    return pool


async def plans(pool) -> list[str]:
    """Which of the pages' statements (their filters, as DashboardStore builds them) read a
    table sequentially: none should."""
    statements = {
        "inbox by status": "SELECT id FROM inbox WHERE status = 'failed' ORDER BY id DESC LIMIT 50",
        "inbox by channel": (
            "SELECT id FROM inbox WHERE channel = 'email' ORDER BY id DESC LIMIT 50"
        ),
        "routes by butler": (
            "SELECT id FROM routing_log WHERE routed_to = 'rare' ORDER BY created_at DESC LIMIT 50"
        ),
        "routes by outcome": (
            "SELECT id FROM routing_log WHERE success = false ORDER BY created_at DESC LIMIT 50"
        ),
        "routes of a message": "SELECT id FROM routing_log WHERE inbox_id = 5 LIMIT 20",
        "sessions of a trace": f"SELECT id FROM sessions WHERE trace_id = '{TRACE}' LIMIT 20",
    }
    seq = []
    async with pool.acquire() as conn:
        for label, sql in statements.items():
            plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + sql))
            if "Seq Scan" in plan:
                seq.append(f"{label}: {plan}")
    return seq


async def measure(pool, rows: int, rounds: int) -> dict[str, list[float]]:
    async def ask(text: str) -> dict:
        raise RuntimeError("not measured")

    connections = McpConnections()
    parts = DashboardParts(
        store=DashboardStore(pool),
        probe=FleetProbe(connections),
        sessions=CoreStore(pool),
        switchboard_name="switchboard",
        ask=ask,
        jaeger_ui_url="http://localhost:16686",
    )
    app = Dashboard(parts, auth_token="bench-token", allowed_hosts=["127.0.0.1"]).app
    headers = {"authorization": "Bearer bench-token"}
    timings: dict[str, list[float]] = {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for label, path in pages(rows).items():
            (await client.get(path, headers=headers)).raise_for_status()  # warm
            timings[label] = []
            for _ in range(rounds):
                started = time.perf_counter()
                response = await client.get(path, headers=headers)
                timings[label].append((time.perf_counter() - started) * 1000)
                response.raise_for_status()
    await connections.close()
    return timings


def render(small: dict, large: dict, rows: int, rounds: int, seq: list[str]) -> str:
    day = time.strftime("%Y-%m-%d")
    lines = [
        f"## dashboard pages ({day}, {os.cpu_count()} cores, Python {platform.python_version()})",
        "",
        f"`bench/dashboard.py`: each page {rounds} times over ASGI in one process; milliseconds, "
        f"median (p95). Baseline: the same pages on 100 inbox and 100 routing_log rows; "
        f"large: {rows:,} of each (and {min(rows, 20_000):,} sessions). Target < {TARGET_MS} ms.",
        "",
        "| page | 100 rows | large | large / 100 rows |",
        "|---|---:|---:|---:|",
    ]
    for label in small:
        s, b = small[label], large[label]
        p95 = lambda v: sorted(v)[int(len(v) * 0.95) - 1]  # noqa: E731
        lines.append(
            f"| {label} | {statistics.median(s):.1f} ({p95(s):.1f}) | "
            f"{statistics.median(b):.1f} ({p95(b):.1f}) | "
            f"{statistics.median(b) / statistics.median(s):.2f}x |"
        )
    lines += ["", "Sequential scans in the plans: " + ("none" if not seq else "; ".join(seq))]
    return "\n".join(lines)


async def main(rows: int, rounds: int, write: bool) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="butlers-dashboard-"))
    os.chmod(workdir, 0o711)  # run as root, the embedded PostgreSQL must pass through
    server = EmbeddedServer(workdir / "pgdata", environ=os.environ)
    await server.start()
    try:
        small_pool = await seeded(server, "dash_small", 100)
        large_pool = await seeded(server, "dash_large", rows)
        seq = await plans(large_pool)
        small = await measure(small_pool, 100, rounds)
        large = await measure(large_pool, rows, rounds)
        await small_pool.close()
        await large_pool.close()
    finally:
        await server.stop()
    table = render(small, large, rows, rounds, seq)
    print(table)
    if write:
        write_docs_block("dashboard", table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    asyncio.run(main(args.rows, args.rounds, args.write))
