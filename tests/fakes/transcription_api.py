"""A fake OpenAI-compatible speech-to-text service on loopback: `POST /v1/audio/transcriptions`.

It takes what OpenAI, Groq, faster-whisper-server and whisper.cpp's server take (multipart
`file`, `model`, `language`, `response_format`; `Authorization: Bearer <key>`) and answers
`{"text": ...}`. Every request is recorded (`requests`: the file's bytes, name and type, the
fields, the Authorization header, the status it was answered with), also the refused ones.

- The key: with `key` set, any other bearer (or none) gets 401, with an error message that
  echoes the bearer it got (a careless service: what the client makes of it must not show it).
  `key=None`: no key needed (a local server).
- The answer: `text` (default `DEFAULT_TEXT`), or a function of the file's bytes.
- Failures: `fail_next(n, status)` answers the next n requests with that status (default 503);
  `hang_next(n)` never answers the next n (until the client gives up, or `stop()`);
  `answer_raw(status, body)` answers every request with that body until `answer_raw(None)`.

In a test module (the conftest is not this fake's):

    from tests.fakes.transcription_api import FakeTranscriptionAPI, transcription_api_fixture

    transcription_api = transcription_api_fixture()  # a fresh service per test

    async def test_x(transcription_api: FakeTranscriptionAPI) -> None:
        # [switchboard.transcription] url = transcription_api.url,
        # TRANSCRIPTION_API_KEY = transcription_api.key
        ...
        [request] = await transcription_api.wait_for_requests(1)

or `async with FakeTranscriptionAPI() as api: ...`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from tests.fakes import serve_on_loopback

PATH = "/v1/audio/transcriptions"
DEFAULT_KEY = "stt-test-key-0123456789abcdef"
DEFAULT_TEXT = "Log my weight: 75 kilograms."
# Voice notes up to the Bot API's 20 MiB, and then some (aiohttp's default is 1 MiB).
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class TranscriptionRequest:
    """One request as the service saw it."""

    file: bytes | None  # None: no `file` part
    filename: str | None
    content_type: str | None
    model: str | None
    language: str | None
    response_format: str | None
    authorization: str | None  # the header as it came
    status: int  # what it was answered with (0: never answered)


class FakeTranscriptionAPI:
    def __init__(
        self, key: str | None = DEFAULT_KEY, text: str | Callable[[bytes], str] = DEFAULT_TEXT
    ) -> None:
        self.key = key
        self.text = text
        self.requests: list[TranscriptionRequest] = []
        self.base_url = ""
        self._failures: list[int] = []  # statuses for the next requests (0: hang)
        self._raw: tuple[int, str] | None = None
        self._stopping = asyncio.Event()
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The endpoint: what `[switchboard.transcription] url` is set to."""
        return self.base_url + PATH

    # -- what the test does -----------------------------------------------------------------

    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next `count` requests with `status` (and an OpenAI-style error)."""
        self._failures += [status] * count

    def hang_next(self, count: int = 1) -> None:
        """Never answer the next `count` requests (the client's timeout ends them)."""
        self._failures += [0] * count

    def answer_raw(self, status: int | None, body: str = "") -> None:
        """Answer every request with `body` (as it is) and `status`; None: normal again."""
        self._raw = None if status is None else (status, body)

    async def wait_for_requests(self, count: int) -> list[TranscriptionRequest]:
        """The first `count` requests, once they have arrived (answered or not)."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.requests) >= count)
        return self.requests[:count]

    # -- serving ----------------------------------------------------------------------------

    async def _transcriptions(self, request: web.Request) -> web.Response:
        form = await request.post()
        upload = form.get("file")
        data = filename = content_type = None
        if isinstance(upload, web.FileField):
            with upload.file:  # a temporary file: closed here, also when the handler hangs
                data = upload.file.read()
            filename, content_type = upload.filename, upload.content_type

        def field(name: str) -> str | None:
            value = form.get(name)
            return value if isinstance(value, str) else None

        authorization = request.headers.get("Authorization")
        status, body = self._answer(authorization, data)

        async def record(answered: int) -> None:
            async with self._changed:
                self.requests.append(
                    TranscriptionRequest(
                        file=data,
                        filename=filename,
                        content_type=content_type,
                        model=field("model"),
                        language=field("language"),
                        response_format=field("response_format"),
                        authorization=authorization,
                        status=answered,
                    )
                )
                self._changed.notify_all()

        if status == 0:
            await record(0)
            await self._stopping.wait()  # or the client hangs up: the handler is cancelled
            raise web.HTTPServiceUnavailable()
        await record(status)
        return web.Response(status=status, text=body, content_type="application/json")

    def _answer(self, authorization: str | None, data: bytes | None) -> tuple[int, str]:
        if self.key is not None and authorization != f"Bearer {self.key}":
            sent = (authorization or "").removeprefix("Bearer ")
            message = f"Incorrect API key provided: {sent}" if sent else "Missing bearer token"
            return 401, json.dumps(
                {"error": {"message": message, "type": "invalid_request_error", "code": None}}
            )
        if self._failures:
            status = self._failures.pop(0)
            if status == 0:
                return 0, ""
            error = {"message": f"fake failure {status}", "type": "server_error", "code": None}
            return status, json.dumps({"error": error})
        if self._raw is not None:
            return self._raw
        if data is None:
            return 400, json.dumps({"error": {"message": "no file", "type": "invalid_request"}})
        text = self.text(data) if callable(self.text) else self.text
        return 200, json.dumps({"text": text})

    async def _other(self, request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(PATH, self._transcriptions)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner, self.base_url = await serve_on_loopback(app, cancel_on_disconnect=True)

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeTranscriptionAPI:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def transcription_api_fixture(
    *,
    key: str | None = DEFAULT_KEY,
    text: str | Callable[[bytes], str] = DEFAULT_TEXT,
    name: str = "transcription_api",
) -> Any:
    """A pytest fixture (named `name`) giving each test a fresh FakeTranscriptionAPI: assign
    it to a module-level name in the test module, `transcription_api =
    transcription_api_fixture()`."""

    @pytest.fixture(name=name)
    async def fixture() -> AsyncIterator[FakeTranscriptionAPI]:
        async with FakeTranscriptionAPI(key=key, text=text) as api:
            yield api

    return fixture
