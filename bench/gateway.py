"""What does the gateway add to a tool call? (Not a test: run it by hand.)

    .venv/bin/python bench/gateway.py [--calls 500] [--write]

One stdio MCP server (tests/fakes/mock_mcp.py, its `echo` tool) called with the official `mcp`
client over stdio three ways, sequentially, each on a kept-open connection:

  direct     host -> child
  suite      host -> `butlers gateway` -> `mock_suite` {action: call, subtool: echo}
  activated  host -> `butlers gateway` -> `echo` (after gateway_activate)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import percentile, write_docs_block  # noqa: E402

MOCK = str(ROOT / "tests" / "fakes" / "mock_mcp.py")
BUTLERS = str(Path(sys.executable).parent / "butlers")


def _devnull():
    return open(os.devnull, "w")  # the servers' stderr


async def timed(call: Callable[[], Awaitable[object]], n: int) -> dict[str, float]:
    for _ in range(20):  # warm-up
        await call()
    latencies = []
    started = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        latencies.append((time.perf_counter() - t0) * 1000)
    elapsed = time.perf_counter() - started
    return {
        "p50": percentile(latencies, 0.5),
        "p99": percentile(latencies, 0.99),
        "rate": n / elapsed,
    }


async def main(calls: int, write: bool) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="butlers-gateway-bench-"))
    (workdir / "mcps" / "mock").mkdir(parents=True)
    spec = {"name": "mock", "command": {"cmd": sys.executable, "args": [MOCK]}}
    (workdir / "mcps" / "mock" / ".mcp.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
    direct = StdioServerParameters(command=sys.executable, args=[MOCK], env=env)
    gateway = StdioServerParameters(
        command=BUTLERS, args=["gateway", "--no-butlers", "--dir", str(workdir)], env=env
    )
    results = {}
    with _devnull() as devnull:
        async with (
            stdio_client(direct, errlog=devnull) as (r1, w1),
            ClientSession(r1, w1) as child,
            stdio_client(gateway, errlog=devnull) as (r2, w2),
            ClientSession(r2, w2) as host,
        ):
            await child.initialize()
            await host.initialize()
            await host.call_tool("gateway_activate", {"name": "mock"})
            args = {"message": "hello"}
            ways = {
                "direct": lambda: child.call_tool("echo", args),
                "suite": lambda: host.call_tool(
                    "mock_suite", {"action": "call", "subtool": "echo", "args": args}
                ),
                "activated": lambda: host.call_tool("echo", args),
            }
            for name, call in ways.items():
                result = await call()
                assert not result.is_error, (name, result)
                results[name] = await timed(call, calls)
    direct_p50 = results["direct"]["p50"]
    lines = [
        f"## gateway overhead ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, stdio)",
        "",
        f"`bench/gateway.py`: {calls} sequential `echo` calls on a stdio MCP server, with the "
        "official `mcp` client, directly and through `butlers gateway`. Latencies in ms.",
        "",
        "| way | p50 | p99 | calls/s | p50 added |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['p50']:.2f} | {r['p99']:.2f} | {r['rate']:.0f} | "
            f"{r['p50'] - direct_p50:+.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if write:
        write_docs_block("gateway_overhead", table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.write))
