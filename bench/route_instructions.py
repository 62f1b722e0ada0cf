"""CPU instructions per call in `butlers up`, counted by callgrind. (Not a test: run it by hand.)

    .venv/bin/python bench/route_instructions.py [--calls 160] [--base DIR] [--write]

Wall-clock figures on a shared 2-core host move by 1.5x from one run to the next; instruction
counts do not (the same code counts the same to three digits). This runs `butlers up` (a
target and a switchboard) under `valgrind --tool=callgrind` (Debian's `valgrind` package;
expect a few minutes) and counts what the butlers' process executes per `state_get`, called
directly on the target and through `route`, one caller at a time and 16 at once. Use it to
see whether a change to the call path costs or saves work.

--base DIR counts a checkout of the code before the change first (its `butlers` package
imported from DIR: `git worktree add /tmp/base <commit>`), then this one, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from fastmcp import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from route_overhead import BUTLERS, ROOT, _describe, bench_fleet, write_docs_block

READY = b"Press Ctrl-C to stop."


async def callgrind_control(option: str, pid: int) -> None:
    process = await asyncio.create_subprocess_exec(
        "callgrind_control", option, str(pid), stdout=asyncio.subprocess.DEVNULL
    )
    if await process.wait() != 0:
        raise RuntimeError(f"callgrind_control {option} {pid} failed")


async def count(pid: int, out: Path, call, calls: int, callers: int) -> float:
    """Millions of instructions per call: zero the counters, make the calls, dump."""
    await callgrind_control("--zero", pid)

    async def caller() -> None:
        for _ in range(calls // callers):
            result = await call()
            assert not result.is_error, result

    await asyncio.gather(*(caller() for _ in range(callers)))
    before = set(out.parent.glob(out.name + ".*"))
    await callgrind_control("--dump", pid)
    (dump,) = set(out.parent.glob(out.name + ".*")) - before
    totals = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.MULTILINE)
    assert totals, f"no totals in {dump}"
    return int(totals.group(1)) / (calls // callers * callers) / 1e6


async def count_fleet(calls: int, base: Path | None) -> dict[tuple[str, int], float]:
    """Instructions per call of one `butlers up` (this checkout's, or `base`'s)."""
    workdir, ports, env = bench_fleet(base)
    out = workdir / "callgrind.out"
    process = await asyncio.create_subprocess_exec(
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        BUTLERS,
        "up",
        "--config-dir",
        str(workdir / "config"),
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdout is not None
    results: dict[tuple[str, int], float] = {}
    try:
        async with asyncio.timeout(900):
            while READY not in (line := await process.stdout.readline()):
                if not line:
                    raise RuntimeError("butlers up exited before it was ready")
        target = Client(f"http://127.0.0.1:{ports['target']}/sse", timeout=600)
        switchboard = Client(f"http://127.0.0.1:{ports['switchboard']}/sse", timeout=600)
        async with target, switchboard:
            await target.call_tool("state_set", {"key": "k", "value": {"bench": True}})
            ways = {
                "direct": lambda: target.call_tool_mcp("state_get", {"key": "k"}),
                "route": lambda: switchboard.call_tool_mcp(
                    "route",
                    {"butler_name": "target", "tool_name": "state_get", "args": {"key": "k"}},
                ),
            }
            for way, call in ways.items():
                await asyncio.gather(*(call() for _ in range(32)))  # warm: connections, caches
                for callers in (1, 16):
                    results[way, callers] = await count(process.pid, out, call, calls, callers)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await process.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    return results


async def main(calls: int, write: bool, base: Path | None) -> None:
    before = await count_fleet(calls, base) if base is not None else None
    table = render(await count_fleet(calls, None), calls, before, _describe(base))
    print(table)
    if write:
        write_docs_block("route_instructions", table)


def render(
    results: dict[tuple[str, int], float],
    calls: int,
    before: dict[tuple[str, int], float] | None = None,
    base: str | None = None,
) -> str:
    lines = [
        f"## instructions per call ({time.strftime('%Y-%m-%d')}, callgrind, `butlers up`)",
        "",
        f"`bench/route_instructions.py`: {calls} `state_get` calls per row, counted in the "
        "butlers' process (target + switchboard); the client and PostgreSQL are not counted."
        + (
            f" The rows marked (base) are the code at {base}, counted in the same run."
            if base
            else ""
        ),
        "",
        "| way | 1 caller: M instructions/call | 16 callers: M instructions/call |",
        "| --- | ---: | ---: |",
    ]
    for label, counts in (("(base)", before), ("", results)):
        if counts is None:
            continue
        for way in ("direct", "route"):
            name = f"{way} {label}".strip()
            lines.append(f"| {name} | {counts[way, 1]:.2f} | {counts[way, 16]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=160)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--base", type=Path, help="a checkout of the code before: counted first, in this run"
    )
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.write, args.base))
