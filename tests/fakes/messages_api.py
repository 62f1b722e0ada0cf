"""A scripted Anthropic Messages API on loopback, for driving the real Claude Code binary.

Each scripted turn is the list of content blocks the "model" answers with. The turn used for a
request is the number of assistant messages already in its conversation, so turn 0 answers the
prompt, turn 1 answers the first tool results, and so on; past the script the model says
"done". Requests and the tool results Claude Code sent back are kept for assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tests.fakes import serve_on_loopback

Block = dict[str, Any]
MAX_REQUEST_BYTES = 32 * 1000 * 1000
Responder = Callable[[dict[str, Any]], list[Block]]


def text(value: str) -> Block:
    return {"type": "text", "text": value}


_ids = itertools.count(1)


def tool_use(name: str, arguments: dict[str, Any]) -> Block:
    return {"type": "tool_use", "id": f"toolu_{next(_ids):08d}", "name": name, "input": arguments}


def prompt_blocks(body: dict[str, Any]) -> list[Block]:
    """The content blocks of a recorded request's first user message (the prompt's turn); a
    plain string content as one text block."""
    content = body["messages"][0]["content"]
    return [text(content)] if isinstance(content, str) else list(content)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class ScriptedMessagesAPI:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.other_requests: list[str] = []
        self._turns: list[list[Block]] = []
        self._responder: Responder | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.delay_s = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self._stopping = asyncio.Event()
        self._changed = asyncio.Condition()
        # With delay_s: answer as soon as this many requests are in flight at once (0: never).
        self.release_at_in_flight = 0
        # Per request: how long to hold it (overrides delay_s), e.g. only a slow butler's.
        self.delay_for: Callable[[dict[str, Any]], float] | None = None
        self._releases = 0  # release_held() calls so far: a held request waits for the next
        # Answer every request with this error instead: (HTTP status, error type, message), as
        # the Messages API does (401 authentication_error, 429 rate_limit_error...). The
        # message may hold "{key}": the request's x-api-key (an API that echoes it).
        self.error: tuple[int, str, str] | None = None
        # Per request, when `error` is None: the error to answer it with, or None to answer it.
        self.error_for: Callable[[dict[str, Any]], tuple[int, str, str] | None] | None = None

    # -- scripting --------------------------------------------------------------------------

    def script(self, *turns: list[Block]) -> None:
        """Answer the n-th turn of every conversation with turns[n]."""
        self._turns = [list(turn) for turn in turns]
        self._responder = None

    def respond_with(self, responder: Responder) -> None:
        """Answer each request with whatever `responder(request_body)` returns."""
        self._responder = responder

    async def wait_for_request(self, matches: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first request that `matches`, once it has arrived."""
        async with self._changed:
            await self._changed.wait_for(lambda: any(matches(b) for b in self.requests))
        return next(b for b in self.requests if matches(b))

    async def release_held(self) -> None:
        """Answer every request held by a delay now (later ones are held as usual)."""
        async with self._changed:
            self._releases += 1
            self._changed.notify_all()

    def reset(self) -> None:
        self.requests.clear()
        self.other_requests.clear()
        self._turns = []
        self._responder = None
        self.delay_s = 0.0
        self.release_at_in_flight = 0
        self.delay_for = None
        self.error = None
        self.error_for = None
        self.in_flight = 0
        self.max_in_flight = 0

    def tool_results(self) -> list[dict[str, Any]]:
        """Every tool_result block Claude Code sent back, in order."""
        seen: dict[str, dict[str, Any]] = {}
        for body in self.requests:
            for message in body.get("messages", []):
                content = message.get("content")
                if isinstance(content, list):
                    for block in content:
                        if block.get("type") == "tool_result":
                            seen[block["tool_use_id"]] = block
        return list(seen.values())

    # -- serving ----------------------------------------------------------------------------

    def _answer(self, body: dict[str, Any]) -> list[Block]:
        if self._responder is not None:
            return self._responder(body)
        turn = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        if turn < len(self._turns):
            return self._turns[turn]
        return [text("done")]

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        async with self._changed:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self._changed.notify_all()
        try:
            delay_s = self.delay_for(body) if self.delay_for is not None else self.delay_s
            if delay_s:  # a "slow model"; ends early when the API stops
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._released(self._releases), delay_s)
            return await self._reply(request, body)
        finally:
            self.in_flight -= 1

    async def _released(self, releases: int) -> None:
        """Until the API stops, or `release_at_in_flight` requests are in flight together."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: (
                    self._stopping.is_set()
                    or self._releases > releases
                    or (
                        self.release_at_in_flight > 0
                        and self.in_flight >= self.release_at_in_flight
                    )
                )
            )

    async def _reply(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        error = self.error
        if error is None and self.error_for is not None:
            error = self.error_for(body)
        if error is not None:
            status, kind, text = error
            said = text.replace("{key}", request.headers.get("x-api-key", ""))
            return web.json_response(
                {"type": "error", "error": {"type": kind, "message": said}}, status=status
            )
        blocks = self._answer(body)
        stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
        message = {
            "id": f"msg_{len(self.requests)}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "scripted"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
        if not body.get("stream"):
            message.update(content=blocks, stop_reason=stop_reason)
            return web.json_response(message)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_sse("message_start", {"type": "message_start", "message": message}))
        for index, block in enumerate(blocks):
            if block["type"] == "text":
                start = {"type": "text", "text": ""}
                delta = {"type": "text_delta", "text": block["text"]}
            else:
                start = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            await response.write(
                _sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": start},
                )
            )
            await response.write(
                _sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            )
            await response.write(
                _sse("content_block_stop", {"type": "content_block_stop", "index": index})
            )
        await response.write(
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": 1},
                },
            )
        )
        await response.write(_sse("message_stop", {"type": "message_stop"}))
        await response.write_eof()
        return response

    async def _other(self, request: web.Request) -> web.Response:
        self.other_requests.append(f"{request.method} {request.path}")
        return web.json_response(
            {"type": "error", "error": {"type": "not_found_error", "message": "not scripted"}},
            status=404,
        )

    async def start(self) -> None:
        # The real API's request cap (32 MB), not aiohttp's default 1 MiB: a prompt carrying
        # a PDF or photos is bigger than that.
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_route("*", "/{tail:.*}", self._other)
        # A held request whose Claude Code gave up on it (and retried) must stop counting as
        # in flight, or `release_at_in_flight` would release a dead request with a live one.
        self._runner, self.url = await serve_on_loopback(app, cancel_on_disconnect=True)

    async def stop(self) -> None:
        self._stopping.set()
        async with self._changed:
            self._changed.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
