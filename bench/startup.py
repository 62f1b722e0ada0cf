"""How long `butlers up` takes to start and to stop. (Not a test: run it by hand.)

    .venv/bin/python bench/startup.py [--rounds 3] [--write]

The shipped config (four butlers) on free ports, with the embedded PostgreSQL in a fresh
mkdtemp directory (0711: run as root, the server runs as an unprivileged user who must pass
through it). Each round, in this order:

  baseline  `butlers --help`: the interpreter and the CLI's imports, what every start pays
            before it does anything; every figure is also given as a multiple of it
  pg cold   PostgreSQL alone (butlers.db.EmbeddedServer in this process): initdb + start
  pg warm   PostgreSQL alone on that data directory again: start
  pg stop   PostgreSQL alone: stop (after the warm start)
  cold      `butlers up` on a new data directory, spawn -> the ready line: initdb, four
            databases created and migrated, four butlers listening
  warm      `butlers up` again on the same data directory
  stop      SIGTERM -> exit (every butler and PostgreSQL stopped), after each start

Medians over the rounds, with the spread (min-max).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import write_docs_block  # noqa: E402
from butlers.db import EmbeddedServer  # noqa: E402
from tests.test_cli import BUTLERS, Butlers, _postgres_on, copy_shipped_config  # noqa: E402

FIGURES = {
    "baseline": "`butlers --help` (baseline: interpreter + imports)",
    "pg_cold": "PostgreSQL alone, new data directory (initdb + start)",
    "pg_warm": "PostgreSQL alone, existing data directory (start)",
    "pg_stop": "PostgreSQL alone, stop",
    "cold": "`butlers up` cold start (new data directory) to ready",
    "warm": "`butlers up` warm start (existing data directory) to ready",
    "stop_cold": "stop after SIGTERM, after the cold start",
    "stop_warm": "stop after SIGTERM, after the warm start",
}


def environment(data_dir: Path | None = None) -> dict[str, str]:
    """This environment without our settings, and with Python's bytecode cache on, as a
    user's is: with PYTHONDONTWRITEBYTECODE (set on some development machines) every start
    compiled again each module edited since its .pyc was written, and measured that."""
    leaky = ("BUTLERS_", "DATABASE_URL", "TELEGRAM_", "OTEL_", "ANTHROPIC_", "CLAUDE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(leaky)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if data_dir is not None:
        env["BUTLERS_DATA_DIR"] = str(data_dir)
    return env


def private_dir(prefix: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o711)
    return root


async def start_and_stop(config: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds from spawn to the ready line, and from SIGTERM to exit."""
    up = Butlers("up", "--config-dir", str(config), env=env)
    started = time.perf_counter()
    await up.start()
    try:
        await up.wait_ready(timeout_s=180)
        ready = time.perf_counter() - started
        stopping = time.perf_counter()
        code = await up.stop(signal.SIGTERM, timeout_s=60)
        stopped = time.perf_counter() - stopping
    except BaseException:
        up.kill()
        raise
    if code != 0 or "Traceback" in up.stderr:
        raise SystemExit(f"butlers up exited {code}:\n{up.stderr}")
    if _postgres_on(Path(env["BUTLERS_DATA_DIR"]) / "pgdata"):
        raise SystemExit("PostgreSQL still running after butlers up exited")
    return ready, stopped


async def postgres_alone() -> tuple[float, float, float]:
    root = private_dir("butlers-bench-pg-")
    try:
        server = EmbeddedServer(root / "pgdata", environ=os.environ)
        started = time.perf_counter()
        await server.start()
        cold = time.perf_counter() - started
        await server.stop()
        again = EmbeddedServer(root / "pgdata", environ=os.environ)
        started = time.perf_counter()
        await again.start()
        warm = time.perf_counter() - started
        started = time.perf_counter()
        await again.stop()
        return cold, warm, time.perf_counter() - started
    finally:
        shutil.rmtree(root, ignore_errors=True)


def baseline() -> float:
    started = time.perf_counter()
    subprocess.run([BUTLERS, "--help"], check=True, capture_output=True, env=environment())
    return time.perf_counter() - started


async def one_round(results: dict[str, list[float]]) -> None:
    results["baseline"].append(baseline())
    pg_cold, pg_warm, pg_stop = await postgres_alone()
    results["pg_cold"].append(pg_cold)
    results["pg_warm"].append(pg_warm)
    results["pg_stop"].append(pg_stop)
    root = private_dir("butlers-bench-up-")
    try:
        copy_shipped_config(root / "config")
        env = environment(root / "data")
        cold, stop_cold = await start_and_stop(root / "config", env)
        warm, stop_warm = await start_and_stop(root / "config", env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, value in (
        ("cold", cold),
        ("warm", warm),
        ("stop_cold", stop_cold),
        ("stop_warm", stop_warm),
    ):
        results[name].append(value)


def table(results: dict[str, list[float]], rounds: int) -> str:
    base = statistics.median(results["baseline"])
    lines = [
        f"## butlers up: start and stop ({date.today()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, embedded PostgreSQL)",
        "",
        f"`bench/startup.py`: the shipped config (four butlers), {rounds} rounds, medians "
        "(min-max) in seconds; `x baseline` is the median over `butlers --help`'s, measured in "
        "the same rounds.",
        "",
        "| figure | median s | min-max s | x baseline |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label in FIGURES.items():
        values = results[key]
        median = statistics.median(values)
        lines.append(
            f"| {label} | {median:.2f} | {min(values):.2f}-{max(values):.2f} | "
            f"{median / base:.1f}x |"
        )
    return "\n".join(lines)


async def main(rounds: int, write: bool) -> None:
    results: dict[str, list[float]] = {key: [] for key in FIGURES}
    for number in range(1, rounds + 1):
        await one_round(results)
        print(
            f"round {number}: "
            + ", ".join(f"{key} {values[-1]:.2f}s" for key, values in results.items()),
            flush=True,
        )
    output = table(results, rounds)
    print(output)
    if write:
        write_docs_block("startup", output)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.write))
