"""A real FastMCP server whose tools make it turn to the client: what a butler never does, and
what our MCP connections must handle. Served over SSE in the test's process
(`serve_peer_over_sse`) or as a stdio child (`python tests/fakes/peer_mcp.py`).

  ping_client      the server pings the client; answers "pong" once the client answered
  ask_roots        the server asks the client `roots/list`; answers with the client's error
  change_tools     sends notifications/tools/list_changed; answers "sent"
  hang             never answers; when the client cancels it, `wait_cancelled` hears of it
  wait_hanging     answers once `n` hang calls are running (false after `timeout_s`)
  wait_cancelled   true once a `hang` call was cancelled (false after `timeout_s`)
  exit             the process ends at once, code 3 (over stdio: the connection drops)

hang, wait_hanging and wait_cancelled take an optional `tag`: a hang call counts only for
the wait_* calls with its tag, so tests sharing one peer do not see each other's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import warnings
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from typing import Literal

from fastmcp import Context, FastMCP
from mcp.shared.exceptions import MCPError

EXIT_CODE = 3


def build_peer() -> FastMCP:
    mcp = FastMCP("peer")
    # FastMCP runs every tool on the server's loop. By tag: hang calls cancelled, in progress.
    cancelled: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
    running: Counter[str] = Counter()
    hanging = asyncio.Condition()  # notified when a hang call starts

    @mcp.tool
    async def ping_client(ctx: Context) -> str:
        await ctx.session.send_ping()
        return "pong"

    @mcp.tool
    async def ask_roots(ctx: Context) -> str:
        with warnings.catch_warnings():  # roots are deprecated as of 2026-07-28; still sent
            warnings.simplefilter("ignore")
            try:
                roots = await ctx.session.list_roots()
            except MCPError as exc:
                return f"error {exc.code}: {exc.message}"
        return f"roots: {roots}"

    @mcp.tool
    async def change_tools(ctx: Context) -> str:
        await ctx.session.send_tool_list_changed()
        return "sent"

    @mcp.tool
    async def hang(tag: str = "") -> str:
        async with hanging:
            running[tag] += 1
            hanging.notify_all()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled[tag].set()
            raise
        finally:
            running[tag] -= 1
        return "never"

    @mcp.tool
    async def wait_hanging(n: int, timeout_s: float, tag: str = "") -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s), hanging:
                await hanging.wait_for(lambda: running[tag] >= n)
        return running[tag] >= n

    @mcp.tool
    async def wait_cancelled(timeout_s: float, tag: str = "") -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await cancelled[tag].wait()
        return cancelled[tag].is_set()

    @mcp.tool
    def exit() -> str:
        os._exit(EXIT_CODE)

    return mcp


@contextlib.asynccontextmanager
async def serve_peer_over_sse(
    peer: FastMCP | None = None, transport: Literal["sse", "http"] = "sse"
) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """The peer (or another FastMCP server: a stand-in) on 127.0.0.1 (an ephemeral port): its
    `/sse` URL (`/mcp` for transport "http": streamable HTTP), and an event that stops the
    server (open event streams are cut after a moment) when set."""
    import uvicorn

    from butlers.http import EmbeddedUvicorn

    app = (peer or build_peer()).http_app(transport=transport)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=0.2
    )
    server = EmbeddedUvicorn(config)
    serving = asyncio.create_task(server.serve(), name="peer_mcp:sse")
    stop = asyncio.Event()
    stopper = asyncio.create_task(stop.wait(), name="peer_mcp:stop")
    try:
        while not server.started:  # uvicorn offers no event for this
            if serving.done():
                serving.result()  # raises why it could not start
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        stopper.add_done_callback(lambda _: setattr(server, "should_exit", True))
        yield f"http://127.0.0.1:{port}/{'sse' if transport == 'sse' else 'mcp'}", stop
    finally:
        stop.set()
        server.should_exit = True
        await serving
        await stopper


if __name__ == "__main__":
    build_peer().run(transport="stdio", show_banner=False)
