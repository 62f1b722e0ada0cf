"""Serving the host over stdio, so that a signal can stop it.

FastMCP's stdio transport (the MCP SDK's `stdio_server`) reads standard input in a worker
thread; a task blocked there cannot be cancelled, so a SIGTERM or SIGINT could not end the
gateway (measured: it kept running, children and all, until its input closed). Here the event
loop reads standard input itself when it is a pipe or socket, as every host gives, so stopping
is a cancellation like any other. Anything else (a terminal, a file, /dev/null) falls back to
FastMCP's own run.

This drives FastMCP's server the way its `run_stdio_async` does (its lifespan and low-level
server: private names, in the range pyproject.toml pins).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastmcp import FastMCP

logger = logging.getLogger(__name__)

# A JSON-RPC message is one line; a longer one is dropped (and logged), never fatal.
MAX_LINE_BYTES = 64 * 1024 * 1024


class StdinLines:
    """Standard input as the async iterator of text lines the SDK's `stdio_server` reads."""

    def __init__(self, reader: asyncio.StreamReader, transport: asyncio.ReadTransport) -> None:
        self._reader = reader
        self._transport = transport

    def __aiter__(self) -> StdinLines:
        return self

    async def __anext__(self) -> str:
        while True:
            try:
                line = await self._reader.readline()
            except ValueError:  # over MAX_LINE_BYTES: the reader dropped it
                logger.warning(
                    "a message from the host over %d bytes was dropped",
                    MAX_LINE_BYTES,
                    extra={"action": "host_message_too_long"},
                )
                continue
            if not line:
                raise StopAsyncIteration
            return line.decode("utf-8", errors="replace")

    def close(self) -> None:
        self._transport.close()


async def open_stdin() -> StdinLines | None:
    """Standard input, read by the event loop; None when it is not a pipe or a socket (uvloop
    aborts the process on a character device such as /dev/null: measured)."""
    fd = sys.stdin.fileno()
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
    pipe = os.fdopen(os.dup(fd), "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
    except ValueError:
        pipe.close()
        return None
    return StdinLines(reader, transport)


async def serve_stdio(mcp: FastMCP) -> None:
    """Serve `mcp` to the host on stdin/stdout until the input ends or this is cancelled."""
    stdin = await open_stdin()
    if stdin is None:
        await mcp.run_async(transport="stdio", show_banner=False)
        return
    from fastmcp.server.context import reset_transport, set_transport
    from mcp.server.stdio import stdio_server

    token = set_transport("stdio")
    try:
        async with mcp._lifespan_manager(), stdio_server(stdin=stdin) as (read, write):  # type: ignore[arg-type]
            server = mcp._mcp_server
            await server.run(read, write, server.create_initialization_options())
    except* (BrokenPipeError, ConnectionResetError):
        # The host went away (it crashed, or was killed) with an answer still to write: the
        # end of its session, as the end of its input is, not a failure of ours.
        logger.info("the host closed its end; stopping", extra={"action": "host_gone"})
        _stdout_to_devnull()
    finally:
        reset_transport(token)
        stdin.close()


def _stdout_to_devnull() -> None:
    """Standard output onto /dev/null: the interpreter flushes it once more at exit, which
    on the broken pipe would print "Exception ignored ... BrokenPipeError" (the Python
    documentation's own advice for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
