"""What does a routing_log row cost the switchboard? (Not a test: run it by hand.)

    .venv/bin/python bench/route_write.py [--rows 2000] [--rounds 3] [--base DIR]

Every routed call waits for its routing_log row (`RoutingStore.record_route`) before it
answers. This writes rows through the real store into an embedded PostgreSQL (in a temporary
directory), one caller at a time and 16 at once, and reports per row the writing process's
CPU and the caller's wait. PostgreSQL's own CPU is not in the first figure; it is in the
second.

--base DIR measures a checkout of older code too (its `butlers` package imported from DIR:
`git worktree add /tmp/base <commit>`), in alternating rounds against the same server, each
version on its own database.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALLERS = (1, 16)


async def child(url: str, database: str, rows: int) -> None:
    """In a process of its own (the code under test on sys.path): write `rows` rows per
    caller count, print the figures as JSON."""
    from butlers.db import create_pool, prepare_database
    from butlers.db.server import ExternalServer
    from butlers.switchboard.routing_store import RouteRecord, RoutingStore

    server = ExternalServer(url)
    await prepare_database(server, database, ("core", "switchboard"))
    pool = await create_pool(server, database)
    await pool.execute(
        "INSERT INTO butler_registry (name, endpoint_url) VALUES ('general', 'http://x') "
        "ON CONFLICT DO NOTHING"
    )
    store = RoutingStore(pool)
    record = RouteRecord(
        source_channel="mcp",
        source_id=None,
        routed_to="general",
        tool_name="state_get",
        prompt_summary='{"key": "k"}',
        trace_id="0af7651916cd43dd8448eb211c80319c",
        success=True,
        error=None,
        duration_ms=2,
    )

    async def caller(n: int) -> None:
        for _ in range(n):
            await store.record_route(record)

    await caller(300)  # statements prepared, pool warm
    figures = {}
    for callers in CALLERS:
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(caller(rows // callers) for _ in range(callers)))
        figures[callers] = {
            "cpu_us": (time.process_time() - cpu) / rows * 1e6,
            "wall_us": (time.perf_counter() - wall) / rows * 1e6,
        }
    await pool.close()
    print(json.dumps(figures))


def _measure(checkout: Path, url: str, database: str, rows: int) -> dict[str, dict[str, float]]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", url, database, str(rows)],
        env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def _describe(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or str(checkout)


async def main(rows: int, rounds: int, base: Path | None) -> None:
    sys.path.insert(0, str(ROOT))
    from butlers.db import EmbeddedServer

    workdir = Path(tempfile.mkdtemp(prefix="butlers-bench-"))
    os.chmod(workdir, 0o711)  # as root, the embedded PostgreSQL's own user passes through
    server = EmbeddedServer(workdir / "pgdata", environ=os.environ)
    versions = {"this checkout": ROOT}
    if base is not None:
        versions[f"base ({_describe(base)})"] = base
    results: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in versions}
    try:
        await server.locate()
        await server.start()
        url = server.dsn("postgres")
        for _ in range(rounds):
            for n, (name, checkout) in enumerate(versions.items()):
                results[name].append(
                    await asyncio.to_thread(_measure, checkout, url, f"bench_write_{n}", rows)
                )
    finally:
        await server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"{rows} rows per caller count, {rounds} rounds; medians (range)\n")
    print("| code | callers | CPU us/row (writer) | wait us/row (caller) |")
    print("| --- | ---: | ---: | ---: |")
    for name, runs in results.items():
        for callers in CALLERS:
            cells = []
            for key in ("cpu_us", "wall_us"):
                values = [run[str(callers)][key] for run in runs]
                cells.append(
                    f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"
                )
            print(f"| {name} | {callers} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        import uvloop

        uvloop.install()  # as `butlers up` runs
        asyncio.run(child(sys.argv[2], sys.argv[3], int(sys.argv[4])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", type=Path)
    args = parser.parse_args()
    asyncio.run(main(args.rows, args.rounds, args.base))
