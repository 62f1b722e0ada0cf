"""Voice notes into text (butlers.switchboard.transcription): the HTTP transcriber against a
fake OpenAI-compatible service over real sockets (TLS through a private CA too), the local
one with a fake faster-whisper model (the weights cannot be here), and which failures the
worker may try again."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from butlers.config import TranscriptionConfig
from butlers.errors import TranscriptionFailed
from butlers.media import Attachment
from butlers.switchboard.attachments import on_this_side
from butlers.switchboard.transcription import (
    HttpTranscriber,
    LocalTranscriber,
    file_name,
    transcriber_from,
)
from tests.conftest import free_port
from tests.fakes.mail import MailCA
from tests.fakes.tls_front import TcpFront
from tests.fakes.transcription_api import (
    DEFAULT_TEXT,
    FakeTranscriptionAPI,
    transcription_api_fixture,
)

transcription_api = transcription_api_fixture()

# The first bytes of an OGG/Opus file, as a Telegram voice note starts.
VOICE = Attachment("voice.oga", "audio/ogg", b"OggS\x00\x02" + bytes(range(256)) * 4)


def config(url: str, **more: Any) -> TranscriptionConfig:
    return TranscriptionConfig(url=url, **more)


@pytest.fixture
async def transcriber(transcription_api: FakeTranscriptionAPI) -> AsyncIterator[HttpTranscriber]:
    """A transcriber with the right key for the fake service."""
    async with HttpTranscriber(config(transcription_api.url), transcription_api.key) as client:
        yield client


def debug_everywhere(caplog: pytest.LogCaptureFixture) -> None:
    """Every record at every level, httpx's and httpcore's too, whatever an earlier test in
    this process set their levels to (butlers.logs quietens httpx)."""
    for name in (None, "httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)


async def failure(transcriber: HttpTranscriber, audio: Attachment = VOICE) -> TranscriptionFailed:
    with pytest.raises(TranscriptionFailed) as caught:
        await transcriber.transcribe(audio)
    return caught.value


# -- the service --------------------------------------------------------------------------------


async def test_the_text_comes_back_and_model_language_and_file_are_sent(
    transcription_api: FakeTranscriptionAPI,
) -> None:
    """The file goes as multipart `file` named by its type (Telegram's `.oga` as `.ogg`: OpenAI
    reads the extension), with `model`, `language`, `response_format=json` and the bearer."""
    settings = config(transcription_api.url, model="whisper-large-v3", language="de")
    async with HttpTranscriber(settings, transcription_api.key) as transcriber:
        assert await transcriber.transcribe(VOICE) == DEFAULT_TEXT
    [sent] = transcription_api.requests
    assert sent.file == VOICE.data
    assert sent.filename == "audio.ogg" and sent.content_type == "audio/ogg"
    assert sent.model == "whisper-large-v3" and sent.language == "de"
    assert sent.response_format == "json"
    assert sent.authorization == f"Bearer {transcription_api.key}"


async def test_without_a_language_none_is_sent_and_the_text_is_the_services(
    transcription_api: FakeTranscriptionAPI, transcriber: HttpTranscriber
) -> None:
    transcription_api.text = lambda data: f"  {len(data)} bytes heard\x00 "
    assert await transcriber.transcribe(VOICE) == f"{VOICE.size} bytes heard"
    [sent] = transcription_api.requests
    assert sent.language is None and sent.model == "whisper-1"


async def test_a_transcript_is_made_storable_and_cut_to_a_messages_length(
    transcription_api: FakeTranscriptionAPI, transcriber: HttpTranscriber
) -> None:
    """A lone surrogate failed the whole message once routed, and a 3 MB transcript had the
    classifier refuse the prompt (a walkthrough): replaced, and cut saying so."""
    from butlers.switchboard.transcription import MAX_TRANSCRIPT_CHARS

    transcription_api.answer_raw(200, '{"text": "Log my weight \\ud800 75 kilograms"}')
    text = await transcriber.transcribe(VOICE)
    assert text.startswith("Log my weight ") and text.endswith(" 75 kilograms")
    text.encode()  # (it raised UnicodeEncodeError)
    transcription_api.answer_raw(200, json.dumps({"text": "word " * MAX_TRANSCRIPT_CHARS}))
    text = await transcriber.transcribe(VOICE)
    assert len(text) < MAX_TRANSCRIPT_CHARS + 100
    whole = 5 * MAX_TRANSCRIPT_CHARS - 1  # (stripped of its last space)
    assert text.endswith(
        f"[cut: the first {MAX_TRANSCRIPT_CHARS} of its {whole} characters are above]"
    )


def test_the_file_name_follows_the_type_never_the_senders_name() -> None:
    def named(name: str, mime_type: str) -> str:
        return file_name(Attachment(name, mime_type, b"x"))

    assert named('evil".exe', "audio/mpeg") == "audio.mp3"
    assert named("a.wav", "audio/x-wav") == "audio.wav"
    assert named("a", "audio/mp4") == "audio.m4a"
    assert named("a", "audio/ogg; codecs=opus") == "audio.ogg"
    assert named("a", "audio/x-aiff") == "audio.aiff"


async def test_a_local_server_without_a_key_gets_no_authorization() -> None:
    async with FakeTranscriptionAPI(key=None) as api:
        async with HttpTranscriber(config(api.url), None) as transcriber:
            assert await transcriber.transcribe(VOICE) == DEFAULT_TEXT
        [sent] = api.requests
        assert sent.authorization is None


async def test_a_wrong_key_is_permanent_says_401_and_never_shows_the_key(
    transcription_api: FakeTranscriptionAPI, caplog: pytest.LogCaptureFixture
) -> None:
    """The service refuses the key and echoes it in its error (as a careless one does): the
    message says 401 and which variable to check, and neither it nor any log record, at any
    level, holds the key."""
    debug_everywhere(caplog)
    wrong = "sk-wrong-5f0c1d2e3a4b5c6d7e8f"
    async with HttpTranscriber(config(transcription_api.url), wrong) as transcriber:
        failed = await failure(transcriber)
    assert failed.transient is False and failed.status == 401
    said = str(failed)
    assert "answered 401" in said and "Incorrect API key provided" in said
    assert "check the key in TRANSCRIPTION_API_KEY" in said
    assert wrong not in said
    [sent] = transcription_api.requests
    assert sent.authorization == f"Bearer {wrong}"  # it was sent, and refused
    assert caplog.records  # httpx and httpcore did log the request
    for record in caplog.records:
        assert wrong not in record.getMessage() and wrong not in repr(record.args)


async def test_no_key_where_one_is_needed_says_which_variable_to_set(
    transcription_api: FakeTranscriptionAPI,
) -> None:
    settings = config(transcription_api.url, api_key_env="GROQ_API_KEY")
    async with HttpTranscriber(settings, None) as transcriber:
        failed = await failure(transcriber)
    assert failed.transient is False and failed.status == 401
    assert "it wants a key: set GROQ_API_KEY" in str(failed)


@pytest.mark.parametrize(
    ("status", "transient"),
    [(503, True), (500, True), (429, True), (400, False), (413, False), (404, False)],
)
async def test_overload_and_faults_are_transient_refusals_are_not(
    transcription_api: FakeTranscriptionAPI,
    transcriber: HttpTranscriber,
    status: int,
    transient: bool,
) -> None:
    """5xx and 429 are tried again later by the worker; a 4xx refusal would be refused again.
    The service works again after: the next request gets the text."""
    transcription_api.fail_next(1, status)
    failed = await failure(transcriber)
    assert failed.transient is transient and failed.status == status
    assert f"answered {status}: fake failure {status}" in str(failed)
    assert await transcriber.transcribe(VOICE) == DEFAULT_TEXT


async def test_no_answer_in_time_is_transient(transcription_api: FakeTranscriptionAPI) -> None:
    transcription_api.hang_next(1)
    settings = config(transcription_api.url, timeout_s=0.5)
    async with HttpTranscriber(settings, transcription_api.key) as transcriber:
        failed = await failure(transcriber)
        assert failed.transient is True and failed.status is None
        assert "did not answer within 0.5 s" in str(failed)
        assert await transcriber.transcribe(VOICE) == DEFAULT_TEXT  # the next one gets through


async def test_nothing_listening_is_transient() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/audio/transcriptions"
    async with HttpTranscriber(config(url), "k") as transcriber:
        failed = await failure(transcriber)
    assert failed.transient is True and failed.status is None
    assert f"cannot reach {url}" in str(failed)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("<html><body>It works!</body></html>", "without JSON (<html><body>It works!"),
        ('{"transcript": "hi"}', 'without a "text" string'),
        ('{"text": 42}', 'without a "text" string'),
        ("[1, 2]", 'without a "text" string'),
        ("", "without JSON (empty)"),
    ],
)
async def test_an_answer_that_is_not_a_transcription_is_permanent(
    transcription_api: FakeTranscriptionAPI, transcriber: HttpTranscriber, body: str, said: str
) -> None:
    transcription_api.answer_raw(200, body)
    failed = await failure(transcriber)
    assert failed.transient is False and failed.status == 200
    assert said in str(failed) and "OpenAI-compatible" in str(failed)


@pytest.mark.parametrize(
    ("status", "body", "setup"),
    [
        (307, "", True),  # FastAPI's trailing-slash redirect
        (405, '{"detail": "Method Not Allowed"}', True),  # another path
        (400, '{"error": {"message": "Invalid model whisper-2"}}', True),
        (200, "<html><body>Welcome</body></html>", True),  # not a transcription endpoint
        (401, '{"error": {"message": "Incorrect API key"}}', True),
        (400, '{"error": {"message": "Invalid file format"}}', False),  # the recording
    ],
)
async def test_a_setup_problem_is_not_blamed_on_the_recording(
    transcription_api: FakeTranscriptionAPI,
    transcriber: HttpTranscriber,
    status: int,
    body: str,
    setup: bool,
) -> None:
    """The sender of each of these was told "I could not make out your voice note" (a
    walkthrough): they are the butler's setup, and said so (SERVICE_REFUSED)."""
    transcription_api.answer_raw(status, body)
    failed = await failure(transcriber)
    assert failed.transient is False
    assert on_this_side(failed) is setup


async def test_silence_is_no_message_and_a_long_error_page_is_cut(
    transcription_api: FakeTranscriptionAPI, transcriber: HttpTranscriber
) -> None:
    transcription_api.answer_raw(200, '{"text": "  "}')
    assert await transcriber.request(VOICE) == ""  # what the service said
    failed = await failure(transcriber)
    assert failed.transient is False and "heard no words" in str(failed)
    transcription_api.answer_raw(502, "<html>\n" + "Bad gateway " * 1000 + "\x1b[31m</html>")
    failed = await failure(transcriber)
    assert failed.transient is True and failed.status == 502
    assert len(str(failed)) < 400 and "\n" not in str(failed) and "\x1b" not in str(failed)


async def test_the_key_never_goes_over_plain_http_beyond_this_machine() -> None:
    """http:// to another host with a key: refused before any connection (192.0.2.1 is a
    documentation address: nothing answers there), naming the variable."""
    settings = config("http://192.0.2.1/v1/audio/transcriptions", timeout_s=2)
    async with HttpTranscriber(settings, "sk-secret") as transcriber:
        failed = await failure(transcriber)
    assert failed.transient is False
    assert "refusing to send the key in TRANSCRIPTION_API_KEY" in str(failed)
    assert "use https" in str(failed)


async def test_a_key_with_a_line_break_inside_is_refused_without_showing_it(
    transcription_api: FakeTranscriptionAPI, caplog: pytest.LogCaptureFixture
) -> None:
    """A trailing line break (a pasted .env value) is dropped; one inside the key cannot go
    into a header (the HTTP library's own error would quote the key): refused, unsent."""
    assert transcription_api.key is not None
    async with HttpTranscriber(
        config(transcription_api.url), transcription_api.key + "\n"
    ) as transcriber:
        assert await transcriber.transcribe(VOICE) == DEFAULT_TEXT
    debug_everywhere(caplog)
    broken = "sk-half\nsk-other-half"
    async with HttpTranscriber(config(transcription_api.url), broken) as transcriber:
        failed = await failure(transcriber)
    assert failed.transient is False
    assert "the key in TRANSCRIPTION_API_KEY holds a space, a line break" in str(failed)
    assert "sk-half" not in str(failed) and "other-half" not in str(failed)
    assert all("sk-half" not in record.getMessage() for record in caplog.records)
    assert len(transcription_api.requests) == 1  # the first one only


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture
async def tls_service(
    transcription_api: FakeTranscriptionAPI, tmp_path: Path
) -> AsyncIterator[tuple[str, MailCA]]:
    """The fake service behind TLS, with a certificate from a private CA: its https URL."""
    ca = MailCA(tmp_path / "ca")
    front = TcpFront(int(transcription_api.base_url.rsplit(":", 1)[1]), ssl=ca.server_context())
    port = await front.start()
    try:
        yield f"https://127.0.0.1:{port}/v1/audio/transcriptions", ca
    finally:
        await front.stop()


async def test_https_with_a_private_ca_trusted_through_ssl_cert_file(
    transcription_api: FakeTranscriptionAPI,
    tls_service: tuple[str, MailCA],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, ca = tls_service
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_file))
    async with HttpTranscriber(config(url), transcription_api.key) as transcriber:
        assert await transcriber.transcribe(VOICE) == DEFAULT_TEXT


async def test_an_untrusted_certificate_is_permanent_and_says_how_to_trust_it(
    transcription_api: FakeTranscriptionAPI,
    tls_service: tuple[str, MailCA],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = tls_service
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    async with HttpTranscriber(config(url), transcription_api.key) as transcriber:
        failed = await failure(transcriber)
    assert failed.transient is False
    assert "TLS certificate is not trusted" in str(failed) and "SSL_CERT_FILE" in str(failed)
    assert transcription_api.requests == []  # nothing went to an unverified server


# -- from the config ----------------------------------------------------------------------------


async def test_the_transcriber_the_config_describes(
    transcription_api: FakeTranscriptionAPI, tmp_path: Path
) -> None:
    """None without url and model_path; with url, the key read from the variable
    api_key_env names (looked up by name, as Settings.variable does); with model_path, local."""
    looked_up: list[str] = []

    def variable(name: str) -> str | None:
        looked_up.append(name)
        return {"MY_STT_KEY": transcription_api.key}.get(name)

    assert transcriber_from(TranscriptionConfig(), variable) is None
    settings = config(transcription_api.url, api_key_env="MY_STT_KEY")
    made = transcriber_from(settings, variable)
    assert isinstance(made, HttpTranscriber) and looked_up == ["MY_STT_KEY"]
    try:
        assert await made.transcribe(VOICE) == DEFAULT_TEXT
    finally:
        await made.aclose()
    local = transcriber_from(TranscriptionConfig(model_path=str(tmp_path)), variable)
    assert isinstance(local, LocalTranscriber) and local.model_path == str(tmp_path)
    await local.aclose()


# -- local: faster-whisper ----------------------------------------------------------------------


class FakeSegment:
    def __init__(self, text: str) -> None:
        self.text = text


class FakeWhisper:
    """Stands in for faster_whisper.WhisperModel: records what it is given, answers segments
    (lazily, as faster-whisper's generator does), counts calls running at once."""

    def __init__(self, model_path: str, gate: threading.Event | None = None) -> None:
        self.model_path = model_path
        self.calls: list[tuple[bytes, str | None]] = []
        self.gate = gate
        self.started = threading.Semaphore(0)
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def transcribe(
        self, audio: BinaryIO, language: str | None = None
    ) -> tuple[Iterable[FakeSegment], Any]:
        data = audio.read()
        self.calls.append((data, language))
        return self._segments(data), {"language": language}

    def _segments(self, data: bytes) -> Iterable[FakeSegment]:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.started.release()
        try:
            if self.gate is not None:
                self.gate.wait()
            if data == b"broken":
                raise ValueError("Invalid data found when processing input")
            yield FakeSegment(" Remind me")
            yield FakeSegment(" to call Ada.")
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A directory shaped like a faster-whisper model (the files it must have)."""
    directory = tmp_path / "faster-whisper-small"
    directory.mkdir()
    (directory / "model.bin").write_bytes(b"")
    (directory / "tokenizer.json").write_text("{}")
    return directory


async def test_local_transcription_through_a_model_loaded_once(model_dir: Path) -> None:
    loaded: list[FakeWhisper] = []

    def load(path: str) -> FakeWhisper:
        loaded.append(FakeWhisper(path))
        return loaded[-1]

    async with LocalTranscriber(str(model_dir), "en", load_model=load) as local:
        assert await local.transcribe(VOICE) == "Remind me to call Ada."
        assert await local.transcribe(VOICE) == "Remind me to call Ada."
    [model] = loaded
    assert model.model_path == str(model_dir)
    assert model.calls == [(VOICE.data, "en"), (VOICE.data, "en")]


async def test_local_transcription_stops_at_its_time_limit(model_dir: Path) -> None:
    """The thread cannot be stopped from outside: an hours-long note held every voice note
    behind it for hours. It stops itself between segments, past `timeout_s`."""

    class SlowWhisper(FakeWhisper):
        def _segments(self, data: bytes) -> Iterable[FakeSegment]:
            for _ in range(100):
                time.sleep(0.05)
                yield FakeSegment(" and on")

    async with LocalTranscriber(str(model_dir), timeout_s=0.2, load_model=SlowWhisper) as local:
        started = time.monotonic()
        with pytest.raises(TranscriptionFailed) as failed:
            await local.transcribe(VOICE)
        assert time.monotonic() - started < 2
    assert str(failed.value).startswith(
        "the local model took over 0.2 s ([switchboard.transcription] timeout_s) on audio"
    )
    assert failed.value.transient is False


async def test_local_transcription_runs_one_at_a_time_off_the_loop(model_dir: Path) -> None:
    """Three voice notes at once: the model runs one of them at a time, in a thread (the loop
    keeps turning while the first one is held), and each gets its text."""
    gate = threading.Event()
    model = FakeWhisper(str(model_dir), gate)
    async with LocalTranscriber(str(model_dir), load_model=lambda _: model) as local:
        tasks = [asyncio.create_task(local.transcribe(VOICE)) for _ in range(3)]
        assert await asyncio.to_thread(model.started.acquire, True, 30)  # the first runs
        # Held by the gate: a second one would start now if they could run at once.
        assert not await asyncio.to_thread(model.started.acquire, True, 0.5)
        gate.set()
        assert await asyncio.gather(*tasks) == ["Remind me to call Ada."] * 3
    assert model.most_at_once == 1 and len(model.calls) == 3


@pytest.mark.skipif(
    importlib.util.find_spec("faster_whisper") is not None, reason="faster-whisper is installed"
)
async def test_local_without_faster_whisper_says_how_to_install_it(model_dir: Path) -> None:
    async with LocalTranscriber(str(model_dir)) as local:
        with pytest.raises(TranscriptionFailed) as caught:
            await local.transcribe(VOICE)
    assert caught.value.transient is False
    assert "pip install faster-whisper" in str(caught.value)
    assert "model_path" in str(caught.value)


async def test_local_model_path_problems_are_named_and_nothing_is_loaded(
    tmp_path: Path, model_dir: Path
) -> None:
    loads: list[str] = []

    def load(path: str) -> FakeWhisper:
        loads.append(path)
        return FakeWhisper(path)

    missing = tmp_path / "nowhere"
    (model_dir / "tokenizer.json").unlink()
    for path, said in [
        (missing, f"model_path {str(missing)!r} does not exist"),
        (model_dir / "model.bin", "is not a directory"),
        (model_dir, "has no tokenizer.json"),
    ]:
        async with LocalTranscriber(str(path), load_model=load) as local:
            with pytest.raises(TranscriptionFailed) as caught:
                await local.transcribe(VOICE)
        assert caught.value.transient is False
        assert said in str(caught.value) and "nothing is downloaded" in str(caught.value)
    assert loads == []


async def test_local_failures_are_permanent_and_say_what_failed(model_dir: Path) -> None:
    def refuse(path: str) -> FakeWhisper:
        raise RuntimeError("Unable to open file 'model.bin' in model")

    async with LocalTranscriber(str(model_dir), load_model=refuse) as local:
        with pytest.raises(TranscriptionFailed) as caught:
            await local.transcribe(VOICE)
    assert caught.value.transient is False
    assert "did not load as a faster-whisper model: RuntimeError: Unable to open" in str(
        caught.value
    )
    async with LocalTranscriber(str(model_dir), load_model=FakeWhisper) as local:
        with pytest.raises(TranscriptionFailed) as caught:
            await local.transcribe(Attachment("v.ogg", "audio/ogg", b"broken"))
        assert "could not transcribe audio (audio/ogg, 6 B) 'v.ogg'" in str(caught.value)
        assert await local.transcribe(VOICE) == "Remind me to call Ada."  # the next one works


def test_audio_not_heard_is_told_to_the_butler_without_the_services_words() -> None:
    """The line a message that goes on without its audio carries reaches the butler, and
    so maybe its sender: the kind of failure, never the service's address, a variable's
    name or its error body (a review); the file's name cut."""
    from butlers.switchboard.attachments import (
        NO_TRANSCRIBER,
        NOT_HEARD,
        SERVICE_REFUSED,
        NotNow,
        _unheard_because,
    )

    secret_detail = "transcription: stt.internal:9000 answered 401: set OPENAI_API_KEY"
    cases = {
        NotNow("skipped", NO_TRANSCRIBER, "a voice note, and no transcription service"): (
            "none is set up"
        ),
        NotNow("failed", NOT_HEARD, secret_detail): "no words could be made out",
        NotNow("failed", SERVICE_REFUSED, secret_detail): "could not be used",
        NotNow("failed", "'x.ogg' plays longer than 10:00, the most I transcribe", "t"): (
            "too long"
        ),
    }
    for why, said in cases.items():
        told = _unheard_because(why)
        assert said in told and "stt.internal" not in told and "OPENAI" not in told
