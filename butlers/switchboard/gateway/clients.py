"""Talking to one child MCP server: over its stdio (our own small JSON-RPC client), or over
HTTP (a kept-open FastMCP client).

Why a hand-written stdio client: MCP servers in the wild answer on stdout either one JSON per
line or LSP-style `Content-Length:` frames, and some print log lines there too; the SDK's stdio
client only knows the first. We read both (also split across reads), skip what is not JSON, and
always send newline-delimited JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from butlers.environment import gateway_child_environment
from butlers.errors import ButlersError
from butlers.switchboard.gateway.children import ChildSpec

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = "2025-06-18"
CLIENT_INFO = {"name": "butlers-gateway", "version": "0.1.0"}
KILL_GRACE_S = 2.0


class ChildError(ButlersError):
    """A child could not be started, answered with an error, timed out or died."""


class FrameReader:
    """Turns a child's stdout bytes into JSON-RPC messages, whatever the framing."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._header_length: int | None = None  # inside a Content-Length header block
        self._body_length: int | None = None  # waiting for a framed body of this size
        self.skipped: list[str] = []  # log lines seen, for diagnostics

    def feed(self, data: bytes) -> list[dict[str, Any]]:
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
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return messages
            line = bytes(self._buffer[:newline]).rstrip(b"\r")
            del self._buffer[: newline + 1]
            if self._header_length is not None:
                if not line.strip():  # end of the header block
                    self._body_length, self._header_length = self._header_length, None
                continue  # other headers (Content-Type) are ignored
            if line[:15].lower() == b"content-length:":
                try:
                    self._header_length = int(line[15:].strip())
                except ValueError:
                    self.skipped.append(line.decode(errors="replace"))
                continue
            if line.lstrip().startswith(b"{"):
                self._append(line, messages)
            elif line.strip():
                self.skipped.append(line.decode(errors="replace")[:200])

    def _append(self, raw: bytes, messages: list[dict[str, Any]]) -> None:
        try:
            message = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.skipped.append(raw.decode(errors="replace")[:200])
            return
        if isinstance(message, dict):
            messages.append(message)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGKILL when the gateway dies, even by SIGKILL (no orphans)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class StdioChild:
    """One stdio child: spawned on first use, reused, restarted after a crash, killed on close."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        spawn_timeout_s: float,
        rpc_timeout_s: float,
        on_exit: Callable[[StdioChild, str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.spawn_timeout_s = spawn_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.on_exit = on_exit
        self.spawns = 0
        self._process: asyncio.subprocess.Process | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._start_lock = asyncio.Lock()
        self._ready = False
        self._closing = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None and self._ready

    async def start(self) -> None:
        async with self._start_lock:
            if self.running():
                return
            await self._kill()
            try:
                await asyncio.wait_for(self._spawn_and_initialize(), self.spawn_timeout_s)
            except TimeoutError:
                await self._kill()
                raise ChildError(
                    f"child {self.name!r}: no answer to initialize within "
                    f"{self.spawn_timeout_s * 1000:.0f} ms (timeouts.child_spawn_ms)"
                ) from None
            except ChildError:
                await self._kill()
                raise

    async def _spawn_and_initialize(self) -> None:
        spec = self.spec
        assert spec.cmd is not None
        try:
            self._process = await asyncio.create_subprocess_exec(
                spec.cmd,
                *spec.args,
                cwd=spec.cwd,
                env=gateway_child_environment(spec.env),  # not our secrets
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=None,  # the child's own diagnostics go where the gateway's go
                start_new_session=True,  # its own process group: close() ends grandchildren too
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise ChildError(
                f"child {self.name!r}: cannot run {spec.cmd!r} in {spec.cwd}: {exc.strerror or exc}"
            ) from exc
        self.spawns += 1
        self._reader_task = asyncio.create_task(
            self._read(self._process), name=f"gateway:{self.name}:stdout"
        )
        await self._request(
            "initialize",
            {"protocolVersion": PROTOCOL_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO},
            timeout_s=None,
            step="initialize",
        )
        await self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self._ready = True

    async def list_tools(self) -> list[dict[str, Any]]:
        await self.start()
        tools: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"cursor": cursor} if cursor else {}
            result = await self._request("tools/list", params, step="tools/list")
            tools.extend(result.get("tools") or [])
            cursor = result.get("nextCursor")
            if not cursor:
                return tools

    async def call_tool(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        await self.start()
        return await self._request(
            "tools/call", {"name": tool, "arguments": arguments}, step=f"tools/call {tool!r}"
        )

    async def _request(
        self,
        method: str,
        params: dict[str, Any],
        *,
        step: str,
        timeout_s: float | object | None = ...,
    ) -> dict[str, Any]:
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        limit = self.rpc_timeout_s if timeout_s is ... else timeout_s
        try:
            await self._send(
                {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
            )
            response = await asyncio.wait_for(future, limit)  # type: ignore[arg-type]
        except TimeoutError:
            with contextlib.suppress(ChildError):
                await self._send(
                    {
                        "jsonrpc": "2.0",
                        "method": "notifications/cancelled",
                        "params": {"requestId": request_id, "reason": "timeout"},
                    }
                )
            raise ChildError(
                f"child {self.name!r}: no answer to {step} within "
                f"{self.rpc_timeout_s * 1000:.0f} ms (timeouts.rpc_ms)"
            ) from None
        finally:
            self._pending.pop(request_id, None)
        if "error" in response:
            error = response["error"] or {}
            raise ChildError(
                f"child {self.name!r}: {step} failed: {error.get('message', error)}"
                + (f" (code {error['code']})" if "code" in error else "")
            )
        return response.get("result") or {}

    async def _send(self, message: dict[str, Any]) -> None:
        process = self._process
        if process is None or process.stdin is None or process.returncode is not None:
            raise ChildError(f"child {self.name!r} is not running")
        try:
            process.stdin.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            await process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChildError(f"child {self.name!r} closed its input: {exc}") from exc

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        frames = FrameReader()
        while chunk := await process.stdout.read(65536):
            for message in frames.feed(chunk):
                self._dispatch(message)
        code = await process.wait()
        reason = f"child {self.name!r} exited (code {code})"
        if frames.skipped:
            reason += f"; last output: {frames.skipped[-1]!r}"
        self._ready = False
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChildError(reason))
        self._pending.clear()
        if not self._closing and self.on_exit is not None:
            self.on_exit(self, reason)

    def _dispatch(self, message: dict[str, Any]) -> None:
        future = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if future is not None and not future.done() and "method" not in message:
            future.set_result(message)

    async def _kill(self) -> None:
        process, self._process = self._process, None
        self._ready = False
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), KILL_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if self._reader_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader_task, KILL_GRACE_S)
            self._reader_task = None

    async def close(self) -> None:
        self._closing = True
        await self._kill()


class RemoteChild:
    """A child reached over HTTP (MCP over SSE or streamable HTTP): one kept-open session."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        spawn_timeout_s: float,
        rpc_timeout_s: float,
        auth_token: str | None = None,
    ) -> None:
        self.spec = spec
        self.spawn_timeout_s = spawn_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.auth_token = auth_token
        self.on_exit = None
        self._client: Any = None
        self._lock = asyncio.Lock()

    @property
    def name(self) -> str:
        return self.spec.name

    def running(self) -> bool:
        return self._client is not None and self._client.is_connected()

    async def start(self) -> None:
        from fastmcp import Client

        async with self._lock:
            if self.running():
                return
            await self.close()
            client = Client(self.spec.url, auth=self.auth_token)
            try:
                await asyncio.wait_for(client.__aenter__(), self.spawn_timeout_s)
            except TimeoutError:
                raise ChildError(
                    f"child {self.name!r}: no answer from {self.spec.url} within "
                    f"{self.spawn_timeout_s * 1000:.0f} ms (timeouts.child_spawn_ms)"
                ) from None
            except Exception as exc:
                raise ChildError(
                    f"child {self.name!r}: cannot connect to {self.spec.url}: {exc}"
                ) from exc
            self._client = client

    async def list_tools(self) -> list[dict[str, Any]]:
        await self.start()
        tools = await self._guard("tools/list", self._client.list_tools_mcp())
        return [t.model_dump(by_alias=True, exclude_none=True) for t in tools.tools]

    async def call_tool(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        await self.start()
        result = await self._guard(
            f"tools/call {tool!r}",
            self._client.call_tool_mcp(tool, arguments, timeout=self.rpc_timeout_s),
        )
        return result.model_dump(by_alias=True, exclude_none=True)

    async def _guard(self, step: str, call: Any) -> Any:
        try:
            return await call
        except Exception as exc:
            message = str(exc)
            if "timed out" in message:
                raise ChildError(
                    f"child {self.name!r}: no answer to {step} within "
                    f"{self.rpc_timeout_s * 1000:.0f} ms (timeouts.rpc_ms)"
                ) from exc
            await self.close()  # re-connected on the next call
            raise ChildError(f"child {self.name!r}: {step} failed: {message}") from exc

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


Child = StdioChild | RemoteChild
