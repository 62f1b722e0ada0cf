"""One MCP connection over a child process's stdin and stdout.

Why not the SDK's stdio client: MCP servers in the wild answer on stdout either one JSON per
line or LSP-style `Content-Length:` frames, and some print log lines there too; the SDK's
stdio client only knows the first. We read both (also split across reads), skip what is not
JSON, and always send newline-delimited JSON. Starting, restarting and killing the process
is its owner's business (the gateway's StdioChild); this is only the conversation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from butlers.errors import ConnectionClosed
from butlers.mcp_connection.core import (
    MAX_MESSAGE_BYTES,
    McpConnection,
    Message,
    MessageTooLarge,
)

SKIPPED_KEPT = 20  # log lines remembered for diagnostics (a chatty child must not grow this)


class FrameReader:
    """Turns a child's stdout bytes into JSON-RPC messages, whatever the framing."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._header_length: int | None = None  # inside a Content-Length header block
        self._body_length: int | None = None  # waiting for a framed body of this size
        # How much of the buffer holds no line break: a long line is searched once, not
        # again from its start with every chunk (quadratic: 64 MiB in 64 KiB chunks was
        # 32 GiB of searching, a red team's reckoning).
        self._searched = 0
        self.skipped: list[str] = []  # the last log lines seen, for diagnostics

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The messages `data` completes; MessageTooLarge for one over MAX_MESSAGE_BYTES."""
        self._buffer += data
        messages: list[dict[str, Any]] = []
        while True:
            if self._body_length is not None:
                if len(self._buffer) < self._body_length:
                    return messages
                body = bytes(self._buffer[: self._body_length])
                del self._buffer[: self._body_length]
                self._body_length = None
                self._append(body, messages)
                continue
            newline = self._buffer.find(b"\n", self._searched)
            if newline < 0:
                self._searched = len(self._buffer)
                if len(self._buffer) > MAX_MESSAGE_BYTES:
                    raise MessageTooLarge(
                        f"it wrote {len(self._buffer)} bytes without ending a line (at most "
                        f"{MAX_MESSAGE_BYTES} a message)"
                    )
                return messages
            line = bytes(self._buffer[:newline]).rstrip(b"\r")
            del self._buffer[: newline + 1]
            self._searched = 0
            if self._header_length is not None:
                if not line.strip():  # end of the header block
                    self._body_length, self._header_length = self._header_length, None
                continue  # other headers (Content-Type) are ignored
            if line[:15].lower() == b"content-length:":
                try:
                    self._header_length = int(line[15:].strip())
                except ValueError:
                    self._skip(line)
                    continue
                if not 0 <= self._header_length <= MAX_MESSAGE_BYTES:
                    raise MessageTooLarge(
                        f"it announced a message of {self._header_length} bytes (at most "
                        f"{MAX_MESSAGE_BYTES})"
                    )
                continue
            if line.lstrip().startswith(b"{"):
                self._append(line, messages)
            elif line.strip():
                self._skip(line)

    def _append(self, raw: bytes, messages: list[dict[str, Any]]) -> None:
        try:
            message = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._skip(raw)
            return
        if isinstance(message, dict):
            messages.append(message)

    def _skip(self, raw: bytes) -> None:
        self.skipped.append(raw.decode(errors="replace")[:200])
        del self.skipped[:-SKIPPED_KEPT]


class StdioConnection(McpConnection):
    """The conversation with one started child process: `open()` reads its stdout and does
    the handshake; `close()` stops reading (the owner ends the process). Its `label` (e.g.
    "child 'docs'") starts the messages that say it is gone: "child 'docs' exited (code 3)"."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        *,
        label: str,
        on_tools_changed: Callable[[], None] | None = None,
        on_closed: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(label=label, on_tools_changed=on_tools_changed, on_closed=on_closed)
        self._process = process
        self._reader: asyncio.Task[None] | None = None

    async def open(self, client_info: dict[str, str], *, timeout_s: float | None) -> None:
        """Start reading the child's stdout, then the MCP handshake."""
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name=f"mcp:{self.label}:stdout"
        )
        await self.initialize(client_info, timeout_s=timeout_s)

    async def _send(self, message: Message) -> None:
        stdin = self._process.stdin
        if stdin is None or self._process.returncode is not None or stdin.is_closing():
            raise ConnectionClosed(f"{self.label} is not running")
        try:
            stdin.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ConnectionClosed(f"{self.label} closed its input: {exc}") from exc

    async def _read(self) -> None:
        stdout = self._process.stdout
        assert stdout is not None, "the child's stdout must be a pipe"
        frames = FrameReader()
        try:
            while chunk := await stdout.read(65536):
                for message in frames.feed(chunk):
                    self._received(message)
            code = await self._process.wait()
            reason = f"{self.label} exited (code {code})"
        except asyncio.CancelledError:
            raise  # close(): the reason is already given
        except MessageTooLarge as exc:
            reason = f"{self.label} was given up: {exc}"
        except Exception as exc:  # every caller must hear of it
            reason = f"reading from {self.label} failed: {exc!r}"
        if frames.skipped:
            reason += f"; last output: {frames.skipped[-1]!r}"
        self._lost(reason)

    async def _close_transport(self) -> None:
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
