"""What does `route` cost on top of calling a butler directly? (Not a test: run it by hand.)

    .venv/bin/python bench/route_overhead.py [--calls 500] [--concurrency 16] [--base DIR] [--write]

Runs `butlers up` (a target butler and a switchboard, one process, embedded PostgreSQL in a
temporary directory unless DATABASE_URL is set) and, in another process, FastMCP's own proxy
(`create_proxy` over a connected client) in front of the same target. This process is only
the client. One tool call (`state_get` on the target) is made three ways, each over a
kept-open MCP-over-SSE connection:

  direct  client -> target
  route   client -> switchboard `route` -> kept connection -> target
  proxy   client -> FastMCP proxy -> target (the peer to beat)

sequentially and with N concurrent callers. Prints a Markdown table; --write also puts it into
docs/benchmarks.md.

--base DIR measures a second fleet beside the first, its `butlers` package imported from DIR
(a checkout of the code before a change: `git worktree add /tmp/base <commit>`), in the same
interleaved rounds: "before" and "after" from one run, so that the machine's noise hits both.
Each fleet's route is compared with its own direct call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastmcp import Client

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fakes import wait_listening  # noqa: E402

BUTLERS = str(Path(sys.executable).parent / "butlers")
Call = Callable[[], Awaitable[object]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(latencies_ms: list[float], elapsed_s: float) -> dict[str, float]:
    return {
        "p50": percentile(latencies_ms, 0.5),
        "p99": percentile(latencies_ms, 0.99),
        "rate": len(latencies_ms) / elapsed_s,
    }


async def sequential(call: Call, n: int, latencies: list[float]) -> float:
    started = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        latencies.append((time.perf_counter() - t0) * 1000)
    return time.perf_counter() - started


async def concurrent(call: Call, callers: int, per_caller: int, latencies: list[float]) -> float:
    async def caller() -> None:
        for _ in range(per_caller):
            t0 = time.perf_counter()
            await call()
            latencies.append((time.perf_counter() - t0) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return time.perf_counter() - started


async def serve_proxy(target_url: str, port: int) -> None:
    """The peer: FastMCP's proxy over one connected client (its fast configuration)."""
    import uvicorn
    from fastmcp.server import create_proxy

    async with Client(target_url) as backend:
        app = create_proxy(backend).http_app(transport="sse")
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        await uvicorn.Server(config).serve()


async def _start(*args: str, env: dict[str, str], ready: str) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        *args, env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    async with asyncio.timeout(60):
        while ready.encode() not in (line := await process.stdout.readline()):
            if not line:
                raise RuntimeError(f"{args[0]} exited before it was ready")
    return process


def bench_fleet(base: Path | None = None) -> tuple[Path, dict[str, int], dict[str, str]]:
    """A config directory with a target and a switchboard on free ports, and the environment
    for a `butlers up` on it (embedded PostgreSQL in the same temporary directory); with
    `base`, that `butlers up` imports the package from the checkout `base` instead."""
    workdir = Path(tempfile.mkdtemp(prefix="butlers-bench-"))
    # Run as root, the embedded PostgreSQL is an unprivileged user who must pass through.
    os.chmod(workdir, 0o711)
    ports = {"target": free_port(), "switchboard": free_port()}
    for name, port in ports.items():
        (workdir / "config" / name).mkdir(parents=True)
        (workdir / "config" / name / "butler.toml").write_text(
            f'[butler]\nname = "{name}"\nport = {port}\n'
            f'[butler.db]\nname = "bench_{name}_{os.getpid()}"\n'
            "[runtime]\ntick_interval_s = 0\n"
            # The [switchboard] table is what makes it the switchboard.
            + ('[switchboard]\ndefault_butler = "target"\n' if name == "switchboard" else "")
        )
    env = {**os.environ, "BUTLERS_DATA_DIR": str(workdir / "data")}
    env.pop("BUTLERS_AUTH_TOKEN", None)
    if base is not None:
        if not (base / "butlers" / "__init__.py").is_file():
            raise SystemExit(f"--base {base}: no butlers package there (a checkout of the repo)")
        env["PYTHONPATH"] = os.pathsep.join([str(base), *filter(None, [env.get("PYTHONPATH")])])
    return workdir, ports, env


async def main(calls: int, callers: int, write: bool, base: Path | None) -> None:
    fleets = {"": bench_fleet()}
    if base is not None:
        fleets[" (base)"] = bench_fleet(base)
    ports = fleets[""][1]
    target_url = f"http://127.0.0.1:{ports['target']}/sse"
    proxy_port = free_port()
    processes = []
    try:
        for workdir, _, env in fleets.values():
            processes.append(
                await _start(
                    BUTLERS,
                    "up",
                    "--config-dir",
                    str(workdir / "config"),
                    env=env,
                    ready="Press Ctrl-C to stop.",
                )
            )
        processes.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--serve-proxy",
                target_url,
                str(proxy_port),
                env=fleets[""][2],
            )
        )
        await wait_listening(proxy_port)
        urls = {}
        for suffix, (_, fleet_ports, _) in fleets.items():
            urls["direct" + suffix] = f"http://127.0.0.1:{fleet_ports['target']}/sse"
            urls["route" + suffix] = f"http://127.0.0.1:{fleet_ports['switchboard']}/sse"
        urls["proxy"] = f"http://127.0.0.1:{proxy_port}/sse"
        results = await measure(urls, calls, callers)
    finally:
        for process in processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()
        for workdir, _, _ in fleets.values():
            shutil.rmtree(workdir, ignore_errors=True)

    table = render(results, calls, callers, base=_describe(base))
    print(table)
    if write:
        write_docs(table)


def _describe(base: Path | None) -> str | None:
    """The base checkout as its commit (`git rev-parse --short HEAD` there), else its path."""
    if base is None:
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", str(base), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(base)
    return commit


async def measure(urls: dict[str, str], calls: int, callers: int):
    clients = {name: Client(url) for name, url in urls.items()}
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for client in clients.values():
            await client.__aenter__()
        ways: dict[str, Call] = {}
        for name, client in clients.items():
            if name.startswith("direct"):
                await client.call_tool("state_set", {"key": "k", "value": {"bench": True}})
            ways[name] = _way(name, client)
        for name, call in ways.items():  # warm-up, and a check that each way works
            result = await call()
            assert not result.is_error, (name, result)
            await asyncio.gather(*(call() for _ in range(callers)))
        # Rounds interleave the ways so that noise from the machine hits all of them.
        rounds = 5
        seq = {name: ([], 0.0) for name in ways}
        conc = {name: ([], 0.0) for name in ways}
        for _ in range(rounds):
            for name, call in ways.items():
                lat, elapsed = seq[name]
                seq[name] = (lat, elapsed + await sequential(call, calls // rounds, lat))
                lat, elapsed = conc[name]
                per_caller = max(1, calls // rounds // callers)
                conc[name] = (lat, elapsed + await concurrent(call, callers, per_caller, lat))
        for name in ways:
            results[name] = {
                "sequential": summarize(*seq[name]),
                "concurrent": summarize(*conc[name]),
            }
    finally:
        for client in clients.values():
            with contextlib.suppress(Exception):
                await client.close()
    return results


def _way(name: str, client: Client) -> Call:
    """One `state_get` on a target: directly, through the switchboard's `route`, or the proxy."""
    if name.startswith("route"):
        arguments = {"butler_name": "target", "tool_name": "state_get", "args": {"key": "k"}}
        return lambda: client.call_tool_mcp("route", arguments)
    return lambda: client.call_tool_mcp("state_get", {"key": "k"})


def render(results, calls: int, callers: int, base: str | None = None) -> str:
    lines = [
        f"## route overhead ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, loopback, MCP over SSE)",
        "",
        f"`bench/route_overhead.py`: one `state_get` on the target butler; {calls} sequential "
        f"calls and {calls} calls from {callers} concurrent callers per way, in five interleaved "
        "rounds. Butlers in one `butlers up` process, the proxy in its own, the client in a "
        "third. Latencies in ms."
        + (
            f" The rows marked (base) are a second `butlers up` of the code at {base}, "
            "measured in the same rounds: before and after from one run."
            if base
            else ""
        ),
        "",
        "| way | seq p50 | seq p99 | seq calls/s | conc p50 | conc p99 | conc calls/s "
        "| p50 vs direct | conc calls/s vs direct |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        s, c = r["sequential"], r["concurrent"]
        # Each fleet's ways against its own direct call; the proxy stands before the first.
        _, space, fleet = name.partition(" ")
        direct = results["direct" + space + fleet]
        lines.append(
            f"| {name} | {s['p50']:.2f} | {s['p99']:.2f} | {s['rate']:.0f} | {c['p50']:.2f} | "
            f"{c['p99']:.2f} | {c['rate']:.0f} | {s['p50'] / direct['sequential']['p50']:.2f}x "
            f"| {c['rate'] / direct['concurrent']['rate']:.2f}x |"
        )
    return "\n".join(lines)


def write_docs(table: str) -> None:
    write_docs_block("route_overhead", table)


def write_docs_block(name: str, table: str) -> None:
    """Replace this benchmark's table in docs/benchmarks.md (or append the block). Notes
    written under the old table inside the block (earlier rounds' figures) are kept."""
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start in text:
        old = text[text.index(start) + len(start) : text.index(end)]
        block = f"{start}\n{table}\n{_notes_after_table(old)}{end}"
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        block = f"{start}\n{table}\n{end}"
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    print(f"written to {path}")


def _notes_after_table(block: str) -> str:
    """What follows the first Markdown table of `block` (from its next line on), or ""."""
    lines = block.splitlines(keepends=True)
    in_table = False
    for index, line in enumerate(lines):
        if line.startswith("|"):
            in_table = True
        elif in_table:
            notes = "".join(lines[index:])
            return notes if notes.strip() else ""
    return ""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--base", type=Path, help="a checkout of the code before: measured beside this one"
    )
    parser.add_argument(
        "--serve-proxy", nargs=2, metavar=("TARGET_URL", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve_proxy:
        asyncio.run(serve_proxy(args.serve_proxy[0], int(args.serve_proxy[1])))
    else:
        asyncio.run(main(args.calls, args.concurrency, args.write, args.base))
