"""How fast does the `butlers` command start, now and at a baseline commit? (Not a test: run it
by hand.)

    .venv/bin/python bench/cli_startup.py [--base COMMIT] [--now COMMIT] [--rounds 5] [--write]

The baseline is checked out with `git worktree add` into a temporary directory and run with
this same interpreter and venv (PYTHONPATH puts its `butlers` package first), so the two ways
differ only in the code. The ways alternate within each round (the host is noisy: a round's
pair shares its conditions). Each round, per way:

  help         `butlers --help`: spawn -> exit
  unreachable  `butlers list` against a closed port: spawn -> the error, exit 1
  gateway      `butlers gateway --no-butlers` (stdio, an empty directory): spawn -> the answer
               to `initialize`
  cold         `butlers up` (the shipped config, four butlers) on a new data directory:
               spawn -> every butler's /health answering 200
  list         `butlers list` against that switchboard: spawn -> exit 0
  warm         `butlers up` again on the same data directory: spawn -> every /health 200

The short commands' CPU seconds (user + system, from wait4) are reported too: a busy host
inflates wall times, much less the CPU a command uses. `--way NAME=DIR` adds a way: the sources
in DIR (a copy with a change tried out). Medians over the rounds, with the spread (min-max), and
each way / baseline per figure. Targets
(issue 14): help and client commands < 0.5 s, gateway < 1 s, warm < 2 s, cold < 4 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import write_docs_block  # noqa: E402
from bench.startup import environment, private_dir  # noqa: E402
from tests.test_cli import READY, _postgres_on, copy_shipped_config  # noqa: E402

FIGURES: dict[str, tuple[str, float | None]] = {
    "help": ("`butlers --help`", 0.5),
    "unreachable": ("`butlers list`, switchboard down (the error)", 0.5),
    "list": ("`butlers list` against the running switchboard", 0.5),
    "gateway": ("`butlers gateway` (stdio): `initialize` answered", 1.0),
    "warm": ("`butlers up` warm: every /health 200", 2.0),
    "cold": ("`butlers up` cold: every /health 200", 4.0),
    # CPU seconds (user + system) of the short commands: what a busy host does not inflate
    # (on an idle one their wall time is this plus a few milliseconds).
    "help_cpu": ("`butlers --help`: CPU s", None),
    "unreachable_cpu": ("`butlers list`, switchboard down: CPU s", None),
    "list_cpu": ("`butlers list`, switchboard up: CPU s", None),
}
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Way:
    """One version of the code: its source root, run as `python -m butlers` with PYTHONPATH."""

    name: str
    source: Path

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "butlers", *args]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "PYTHONPATH": str(self.source)}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_run(
    way: Way, env: dict[str, str], cwd: Path, *args: str, code: int = 0
) -> tuple[float, float]:
    """Seconds from spawn to exit, and the CPU seconds (user + system) the command used."""
    with tempfile.TemporaryFile() as errors:
        started = time.perf_counter()
        child = subprocess.Popen(
            way.command(*args), env=way.env(env), cwd=cwd, stdout=subprocess.DEVNULL, stderr=errors
        )
        _, status, usage = os.wait4(child.pid, 0)  # this child's own resource usage
        elapsed = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != code:
            errors.seek(0)
            raise SystemExit(
                f"{way.name}: butlers {' '.join(args)} exited {child.returncode}:\n"
                f"{errors.read().decode()}"
            )
    return elapsed, usage.ru_utime + usage.ru_stime


async def record_run(
    results: dict[str, list[float]],
    key: str,
    way: Way,
    env: dict[str, str],
    cwd: Path,
    *args: str,
    code: int = 0,
) -> None:
    elapsed, cpu = await asyncio.to_thread(timed_run, way, env, cwd, *args, code=code)
    results[key].append(elapsed)
    results[f"{key}_cpu"].append(cpu)


async def gateway_initialize(way: Way, env: dict[str, str], cwd: Path) -> float:
    """Spawn -> the answer to `initialize` on stdout."""
    request = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "bench", "version": "1"},
        },
    }
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *way.command("gateway", "--no-butlers", "--dir", str(cwd)),
        env=way.env(env),
        cwd=cwd,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdin and process.stdout
    process.stdin.write(json.dumps(request).encode() + b"\n")
    await process.stdin.drain()
    async with asyncio.timeout(TIMEOUT_S):
        answer = json.loads(await process.stdout.readline())
    elapsed = time.perf_counter() - started
    process.stdin.close()  # the host going away ends the gateway
    async with asyncio.timeout(TIMEOUT_S):
        await process.wait()
    if answer.get("id") != 1 or "result" not in answer:
        raise SystemExit(f"{way.name}: gateway answered {answer}")
    return elapsed


async def _all_healthy(ports: dict[str, int]) -> None:
    async with aiohttp.ClientSession() as session:
        for port in ports.values():
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                if response.status != 200:
                    raise SystemExit(f"/health on {port}: {response.status}")


async def up_then(
    way: Way, env: dict[str, str], cwd: Path, ports: dict[str, int], results: dict[str, list]
) -> float:
    """`butlers up`: spawn -> ready line -> every /health 200 (seconds); meanwhile one
    `butlers list` against it (recorded in results["list"]); then SIGTERM and a clean exit."""
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *way.command("up", "--config-dir", str(cwd / "config")),
        env=way.env(env),
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout and process.stderr
    stderr_task = asyncio.create_task(process.stderr.read())
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                line = await process.stdout.readline()
                if not line:
                    raise SystemExit(
                        f"{way.name}: butlers up exited:\n{(await stderr_task).decode()}"
                    )
                if READY in line.decode():
                    break
            await _all_healthy(ports)
        healthy = time.perf_counter() - started
        url = f"http://127.0.0.1:{ports['switchboard']}/sse"
        await record_run(results, "list", way, env, cwd, "list", "--url", url)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(TIMEOUT_S):
            await process.stdout.read()
            code = await process.wait()
        stderr = (await stderr_task).decode()
    if code != 0 or "Traceback" in stderr:
        raise SystemExit(f"{way.name}: butlers up exited {code}:\n{stderr}")
    if _postgres_on(Path(env["BUTLERS_DATA_DIR"]) / "pgdata"):
        raise SystemExit("PostgreSQL still running after butlers up exited")
    return healthy


async def one_round(way: Way, results: dict[str, list[float]]) -> None:
    root = private_dir(f"butlers-bench-cli-{way.name}-")
    try:
        ports = copy_shipped_config(root / "config")
        env = environment(root / "data")
        await record_run(results, "help", way, env, root, "--help")
        closed = f"http://127.0.0.1:{_closed_port()}/sse"
        await record_run(results, "unreachable", way, env, root, "list", "--url", closed, code=1)
        (root / "gateway").mkdir()
        results["gateway"].append(await gateway_initialize(way, env, root / "gateway"))
        results["cold"].append(await up_then(way, env, root, ports, results))
        results["warm"].append(await up_then(way, env, root, ports, results))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def checkout(commit: str) -> Path:
    """The baseline's sources, in a temporary git worktree."""
    target = Path(tempfile.mkdtemp(prefix="butlers-cli-base-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(target), commit],
        check=True,
        capture_output=True,
    )
    return target


def remove_checkout(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
        check=False,
        capture_output=True,
    )


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(
    results: dict[str, dict[str, list[float]]], base: str, rounds: int, now: str | None = None
) -> str:
    """Markdown: a column per way (base first), and each way's median over the baseline's."""
    others = [name for name in results if name != "base"]
    lines = [
        f"## the `butlers` command: start-up ({date.today()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()})",
        "",
        f"`bench/cli_startup.py`: {rounds} rounds, the ways alternating in each; seconds, "
        f"median (min-max). Baseline `{base}`, now "
        + (f"`{now}`" if now else "the working tree")
        + ", with the same venv.",
        "",
        "| figure | target | baseline | "
        + " | ".join(others)
        + " | "
        + " | ".join(f"{name} / baseline" for name in others)
        + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in others * 2) + " |",
    ]
    for key, (label, target) in FIGURES.items():
        old = results["base"][key]
        cells = [_stats(results[name][key]) for name in others]
        ratios = [
            f"{statistics.median(results[name][key]) / statistics.median(old):.2f}"
            for name in others
        ]
        lines.append(
            f"| {label} | {'-' if target is None else f'< {target:g}'} | {_stats(old)} | "
            + " | ".join(cells + ratios)
            + " |"
        )
    return "\n".join(lines)


async def measure(ways: list[Way], rounds: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {w.name: {k: [] for k in FIGURES} for w in ways}
    for number in range(1, rounds + 1):
        # Each round in another order: no way always runs first (or last) in a round.
        shift = number % len(ways)
        for way in ways[shift:] + ways[:shift]:
            await one_round(way, results[way.name])
            print(
                f"round {number} {way.name}: "
                + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in results[way.name].items()),
                flush=True,
            )
    return results


def _short(ref: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def main(base: str, now: str | None, rounds: int, write: bool, extra: list[str]) -> None:
    commit = _short(base)
    checkouts = [checkout(commit)]
    try:
        if now is not None:  # a commit, not the working tree others may be editing
            checkouts.append(checkout(_short(now)))
        ways = [Way("base", checkouts[0]), Way("now", checkouts[1] if now else ROOT)]
        for spec in extra:
            name, _, directory = spec.partition("=")
            ways.append(Way(name, Path(directory)))
        results = asyncio.run(measure(ways, rounds))
    finally:
        for path in checkouts:
            remove_checkout(path)
    output = table(results, commit, rounds, _short(now) if now else None)
    print(output)
    if write:
        write_docs_block("cli_startup", output)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the baseline commit (default HEAD)")
    parser.add_argument(
        "--now", metavar="COMMIT", help="measure this commit as now (default: the working tree)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--way",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also measure the sources in DIR (e.g. a copy with a change tried out)",
    )
    args = parser.parse_args()
    main(args.base, args.now, args.rounds, args.write, args.way)
