"""How fast is a butler's memory search, at 10,000 and 100,000 memories? (Not a test: run it
by hand.)

    .venv/bin/python bench/memory.py [--sizes 10000 100000] [--queries 300] [--write]

An embedded PostgreSQL in a temporary directory; one database per size, filled with
sentences drawn from 20,000 made-up words by Zipf's law (a few words are in thousands of
memories, most in a few, as in a language). Per size:

  search    `MemoryStore.search` of 1-3 keywords (what `memory_search` runs), limit 10
  context   the lookup a session's start adds (Spawner._context): the search of a 12-25 word
            prompt, any word matching, [runtime] memory_context = 5

Latencies in ms over `--queries` calls each, p50 and p99, through the asyncpg pool the
butler uses (loopback Unix socket). Targets (issue 27): search p99 < 20 ms at 100,000;
context < 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import write_docs_block  # noqa: E402
from butlers.db import EmbeddedServer, create_pool, prepare_database  # noqa: E402
from butlers.memory import UNRESTRICTED, MemoryStore  # noqa: E402

RNG = random.Random(27)
# Made-up words of 4-9 letters (no two share much, as words of a language mostly do not),
# drawn with Zipf's law over 20,000 of them, as words of a language are: a few are in many
# memories ("car", "Anna"), most in a handful. Words built from a dozen syllables shared
# trigrams with a third of all memories, which measured trigram matching, not memory search.
LETTERS = "abcdefghijklmnoprstuvwyz"
VOCABULARY = sorted(
    {"".join(RNG.choice(LETTERS) for _ in range(RNG.randint(4, 9))) for _ in range(20_000)}
)
RNG.shuffle(VOCABULARY)
# Ranks from 101: the hundred most frequent words of a language are its stop words ("the",
# "is"), which full-text search drops before it indexes or searches anything.
ZIPF = [1 / (rank + 101) ** 1.07 for rank in range(len(VOCABULARY))]


def words(count: int) -> list[str]:
    return RNG.choices(VOCABULARY, weights=ZIPF, k=count)


def sentence(count: int) -> str:
    return " ".join(words(count)).capitalize() + "."


async def fill(pool, count: int) -> None:
    rows = [(sentence(RNG.randint(6, 16)),) for _ in range(count)]
    async with pool.acquire() as conn:
        await conn.executemany(
            "INSERT INTO memories (text, language, words) "
            "VALUES ($1, 'english', to_tsvector('english', $1))",
            rows,
        )
        await conn.execute("ANALYZE memories")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(calls: list, run) -> list[float]:
    latencies = []
    for argument in calls:
        started = time.perf_counter()
        await run(argument)
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


async def measure(server: EmbeddedServer, size: int, queries: int) -> dict[str, list[float]]:
    name = f"bench_memory_{size}"
    await prepare_database(server, name, ("core",))
    pool = await create_pool(server, name, max_size=2)
    try:
        store = MemoryStore(pool, language="english", max_memories=size * 2)
        await store.open()
        await fill(pool, size)
        keywords = [" ".join(words(RNG.randint(1, 3))) for _ in range(queries)]
        prompts = [sentence(RNG.randint(12, 25)) for _ in range(queries)]
        await timed(keywords[:20], lambda q: store.search(q, 10))  # warm the caches
        return {
            "search": await timed(keywords, lambda q: store.search(q, 10)),
            "context": await timed(prompts, lambda p: store.context(p, 5, UNRESTRICTED)),
        }
    finally:
        await pool.close()


def render(results: dict[int, dict[str, list[float]]], queries: int) -> str:
    lines = [
        f"Memory search (`bench/memory.py`, {queries} queries per figure, "
        f"{os.cpu_count()} cores; ms):",
        "",
        "| memories | search p50 | search p99 | context p50 | context p99 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for size, figures in results.items():
        search, context = figures["search"], figures["context"]
        lines.append(
            f"| {size:,} | {statistics.median(search):.2f} | {percentile(search, 0.99):.2f} "
            f"| {statistics.median(context):.2f} | {percentile(context, 0.99):.2f} |"
        )
    return "\n".join(lines)


async def main(sizes: list[int], queries: int, write: bool) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="butlers-memory-"))
    os.chmod(workdir, 0o711)  # run as root, the embedded PostgreSQL must pass through
    server = EmbeddedServer(workdir / "pgdata", environ=os.environ)
    await server.start()
    try:
        results = {size: await measure(server, size, queries) for size in sizes}
    finally:
        await server.stop()
    table = render(results, queries)
    print(table)
    if write:
        write_docs_block("memory", table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    asyncio.run(main(args.sizes, args.queries, args.write))
