"""What does a butler add to a call of one of its tool servers? (Not a test: run it by hand.)

    .venv/bin/python bench/tool_proxy.py [--calls 500] [--write]

A `[[mcp_servers]]` server proxied the way a butler does it (butlers.tool_servers on a FastMCP
server with the butler's one middleware: span, guards; redaction of a configured secret), and
the same server called directly. One stdio server, a tool each: tests/fakes/mock_mcp.py's
`echo`, and, when tests/npm_servers.py has installed it, the official filesystem server's
`read_text_file` on a small file. Sequential calls, kept-open connections:

  direct       our stdio client (the gateway's StdioChild) -> the server
  proxied      the butler's FastMCP server, in process (`call_tool`: its middleware, the
               proxy tool, the redaction) -> the same kind of client -> the server
  own, sse     a session's view of a tool of the butler's own that does nothing: our
               MCP-over-SSE client -> the butler over loopback (what every tool call pays)
  proxied, sse the session's view of the server's tool through the butler

"added" is proxied - direct: what the butler puts on top of the server's own round trip (the
target: under 2 ms at p50). Over SSE, a session pays the loopback hop for every tool of the
butler, proxied or not ("own, sse").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastmcp import FastMCP
from opentelemetry.sdk.trace import TracerProvider

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import timed  # noqa: E402
from bench.route_overhead import write_docs_block  # noqa: E402
from butlers.config import McpServerConfig  # noqa: E402
from butlers.gateway.children import ChildSpec  # noqa: E402
from butlers.gateway.clients import StdioChild  # noqa: E402
from butlers.http import EmbeddedUvicorn  # noqa: E402
from butlers.mcp_connection.sse import SseConnection  # noqa: E402
from butlers.mcp_middleware import ButlerMiddleware  # noqa: E402
from butlers.redact import Redactor  # noqa: E402
from butlers.tool_servers import ToolServers  # noqa: E402

MOCK = str(ROOT / "tests" / "fakes" / "mock_mcp.py")
FILESYSTEM = Path.home() / ".cache" / "butlers-tests" / "npm" / "node_modules" / ".bin"
FILESYSTEM = FILESYSTEM / "mcp-server-filesystem"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_server(
    name: str, command: str, args: tuple[str, ...], tool: str, arguments: dict[str, Any], n: int
) -> dict[str, dict[str, float]]:
    workdir = Path(tempfile.mkdtemp(prefix="butlers-tool-proxy-bench-"))
    environ = dict(os.environ)
    config = McpServerConfig(name=name, command=command, args=args)
    direct = StdioChild(
        ChildSpec(name=name, cmd=command, args=args, cwd=workdir),
        environ=environ,
        spawn_timeout_s=30,
        rpc_timeout_s=30,
    )
    mcp = FastMCP("bench", middleware=[ButlerMiddleware("bench", TracerProvider().get_tracer("b"))])

    @mcp.tool
    async def noop() -> str:
        """Nothing: what a call of one of the butler's own tools costs."""
        return "ok"

    servers = ToolServers(
        (config,),
        mcp=mcp,
        environ=environ,
        data_dir=workdir / "data",
        butler_dir=workdir,
        redact=Redactor(["sk-bench-secret-0123456789"]),  # one plain token, as most are
    )
    port = free_port()
    server = EmbeddedUvicorn(
        uvicorn.Config(mcp.http_app(transport="sse"), port=port, log_config=None, lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    session = SseConnection(f"http://127.0.0.1:{port}/sse", auth_token=None)
    results: dict[str, dict[str, float]] = {}
    try:
        await servers.start()
        while servers.servers[0].status.state != "running":  # noqa: ASYNC110 (a state)
            await asyncio.sleep(0.05)
        while not server.started:  # noqa: ASYNC110 (uvicorn offers nothing to wait on)
            await asyncio.sleep(0.01)
        await session.open(10)
        proxied = f"{name}__{tool}"
        ways: dict[str, Callable[[], Awaitable[object]]] = {
            "direct": lambda: direct.call_tool(tool, arguments),
            "proxied": lambda: mcp.call_tool(proxied, arguments),
            "own, sse": lambda: session.call_tool("noop", {}, timeout_s=30),
            "proxied, sse": lambda: session.call_tool(proxied, arguments, timeout_s=30),
        }
        for way, call in ways.items():
            results[way] = await timed(call, n)
    finally:
        await session.close()
        server.should_exit = True
        await serving
        await servers.close()
        await direct.close()
    return results


def render(all_results: dict[str, dict[str, dict[str, float]]], calls: int) -> str:
    lines = [
        f"## tool servers: a proxied call ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} "
        f"cores, Python {platform.python_version()}, stdio servers)",
        "",
        f"`bench/tool_proxy.py`: {calls} sequential calls of a stdio MCP server's tool, directly "
        "and through a butler's proxy (in process, and as a session reaches it over SSE). "
        "Latencies in ms; *added*: p50 minus the direct call's.",
        "",
        "| server, tool | way | p50 | p99 | calls/s | added |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for server, results in all_results.items():
        direct = results["direct"]["p50"]
        for way, r in results.items():
            added = "" if way in ("direct", "own, sse") else f"{r['p50'] - direct:+.2f}"
            lines.append(
                f"| {server} | {way} | {r['p50']:.2f} | {r['p99']:.2f} | {r['rate']:.0f} | "
                f"{added} |"
            )
    return "\n".join(lines)


async def main(calls: int, write: bool) -> None:
    all_results = {
        "mock `echo`": await one_server(
            "mock", sys.executable, (MOCK,), "echo", {"message": "hello"}, calls
        )
    }
    if FILESYSTEM.exists():
        root = Path(tempfile.mkdtemp(prefix="butlers-tool-proxy-files-"))
        (root / "note.txt").write_text("The spare key is under the blue flowerpot.\n" * 20)
        all_results["filesystem `read_text_file`"] = await one_server(
            "files",
            str(FILESYSTEM),
            (str(root),),
            "read_text_file",
            {"path": str(root / "note.txt")},
            calls,
        )
    table = render(all_results, calls)
    print(table)
    if write:
        write_docs_block("tool_proxy", table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.write))
