"""Voice notes into text: `[switchboard.transcription]`, through a service or a local model.

The worker hands a voice note (`butlers.media.Attachment`, audio) to a `Transcriber` and routes
what comes back as the message's text. Two kinds exist:

- `HttpTranscriber`: any OpenAI-compatible `POST /v1/audio/transcriptions` (OpenAI, Groq,
  faster-whisper-server, whisper.cpp's server): multipart `file` + `model` (+ `language`,
  `response_format=json`), the key as a bearer token, the answer `{"text": ...}`.
- `LocalTranscriber`: faster-whisper with weights already on this machine (`model_path`),
  when the optional package is installed. Nothing is ever downloaded.

Failures are `TranscriptionFailed`, and `transient` says what the worker does with the
message: keep it and try again later (the service answered 5xx or 429, took too long, or
could not be reached) or give up and tell the sender (a refused key, a file the service will
not read, an answer without text, no local model). Trying a permanent failure again only
spends the retry window without a chance of success.

The key is a secret. It goes out in the Authorization header only (never a URL, which httpx
logs at INFO), never over plain http to a host beyond this machine, and it is scrubbed from
anything the service answers before that text goes into an error (a service may echo it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import re
import ssl
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

import httpx

from butlers.config import TranscriptionConfig
from butlers.core_store import storable
from butlers.errors import TranscriptionFailed
from butlers.http import is_loopback
from butlers.media import Attachment
from butlers.modules.mail_transport import describe, tls_context
from butlers.text import printable, within_limit

# How much of a service's error text goes into the message (a whole HTML error page does not).
MAX_SAID_CHARS = 200
# A transcript is stored as its message's text: at most as long as a mail's (a service that
# answered 3 MB of text had the classifier refuse the prompt, the owner told "try later").
MAX_TRANSCRIPT_CHARS = 100_000
# Statuses worth trying again: the service is overloaded, rate-limits us, or had a fault.
TRANSIENT_STATUSES = frozenset({408, 425, 429})
# Files a faster-whisper model directory must hold. Without tokenizer.json, faster-whisper
# fetches a tokenizer from the Hugging Face Hub: a download we promise never happens.
LOCAL_MODEL_FILES = ("model.bin", "tokenizer.json")
# The file name's extension by type: services pick the decoder by it (OpenAI refuses
# Telegram's `.oga` but takes the same bytes as `.ogg`).
_EXTENSIONS = {
    "audio/ogg": "ogg",
    "audio/opus": "ogg",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
    "audio/mp4": "m4a",
    "audio/m4a": "m4a",
    "audio/x-m4a": "m4a",
    "audio/wav": "wav",
    "audio/wave": "wav",
    "audio/vnd.wave": "wav",
    "audio/x-wav": "wav",
    "audio/webm": "webm",
    "audio/flac": "flac",
    "audio/x-flac": "flac",
}


def heard(text: str) -> str:
    """A transcript as it is stored as its message's text: nothing PostgreSQL refuses (NUL),
    no lone surrogate (it failed the whole message when routed: a walkthrough), at most
    MAX_TRANSCRIPT_CHARS, saying so when cut."""
    return within_limit((storable(text) or "").strip(), MAX_TRANSCRIPT_CHARS)


class Transcriber(Protocol):
    """What the worker calls with a voice note; owned by whoever made it (`aclose`)."""

    async def transcribe(self, audio: Attachment) -> str:
        """The words of `audio`, never empty; TranscriptionFailed otherwise."""
        ...

    async def aclose(self) -> None:
        """Release what the transcriber holds (connections, a model, its thread)."""
        ...


def transcriber_from(
    config: TranscriptionConfig, variable: Callable[[str], str | None]
) -> Transcriber | None:
    """The transcriber `config` describes, or None when none is configured (voice notes then
    get a reply saying so). `variable` looks a variable up by name, as
    `butlers.settings.Settings.variable` does: the key comes from `config.api_key_env`."""
    if config.model_path:
        return LocalTranscriber(config.model_path, config.language, timeout_s=config.timeout_s)
    if config.url:
        return HttpTranscriber(config, variable(config.api_key_env) if config.api_key_env else None)
    return None


def file_name(audio: Attachment) -> str:
    """The name the file is sent under: `audio.<extension of its type>`. Not the sender's
    name: the service needs only the extension, and the name is theirs to choose (hostile
    text in a multipart header, or a wrong extension)."""
    mime_type = audio.mime_type.partition(";")[0].strip().lower()
    extension = _EXTENSIONS.get(mime_type)
    if extension is None:
        subtype = mime_type.partition("/")[2].removeprefix("x-")
        extension = re.sub(r"[^a-z0-9]", "", subtype)[:10] or "bin"
    return f"audio.{extension}"


def where(url: str) -> str:
    """`url` as errors show it: scheme, host, port and path (no user:password@, no query: a
    key put there by mistake is not repeated)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


def plaintext_key_refusal(url: str, key: str | None, api_key_env: str) -> str | None:
    """Why the key must not be sent to `url`, or None: over plain http it would cross the
    network readable by anyone on the way, so only a loopback host may get it so."""
    parts = urlsplit(url)
    if key is None or parts.scheme != "http" or is_loopback(parts.hostname or ""):
        return None
    return (
        f"refusing to send the key in {api_key_env} to {where(url)} over plain http (beyond "
        "this machine anyone on the way reads it, and the voice notes): use https, or a "
        "server on this machine"
    )


def unusable_key(key: str | None, api_key_env: str) -> str | None:
    """Why `key` cannot go into a header, or None. Said without the key: the HTTP library's
    own error would quote it (h11 names an illegal header value)."""
    if key is None or (key.isascii() and key.isprintable() and " " not in key):
        return None
    return (
        f"the key in {api_key_env} holds a space, a line break, a control or a non-ASCII "
        "character: copy it again"
    )


class HttpTranscriber:
    """An OpenAI-compatible speech-to-text service. One HTTP client (kept-alive connections,
    one TLS context) for the transcriber's life: `aclose()` it."""

    def __init__(self, config: TranscriptionConfig, api_key: str | None) -> None:
        self.url = config.url
        self._model = config.model
        self._language = config.language
        # A key pasted into a .env file often ends in a line break: not part of the key.
        self._key = (api_key or "").strip() or None
        self._key_env = config.api_key_env
        self._timeout_s = config.timeout_s
        self._refusal = unusable_key(self._key, self._key_env) or plaintext_key_refusal(
            self.url, self._key, self._key_env
        )
        headers = (
            {"Authorization": f"Bearer {self._key}"} if self._key and not self._refusal else {}
        )
        # The system's trust store or SSL_CERT_FILE's, as for the mail servers (httpx's own
        # default would be certifi's bundle, which ignores the system's).
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s),
            verify=tls_context(),
            follow_redirects=False,
        )

    async def __aenter__(self) -> HttpTranscriber:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def transcribe(self, audio: Attachment) -> str:
        text = await self.request(audio)
        if not text:
            raise TranscriptionFailed(
                f"{where(self.url)} heard no words in {audio.describe()}",
                transient=False,
                status=200,
            )
        return text

    async def request(self, audio: Attachment) -> str:
        """One request: the text the service answered, maybe empty (silence). `transcribe`
        is this and the refusal of an empty answer; doctor's probe sends silence."""
        service = where(self.url)
        if self._refusal is not None:
            raise TranscriptionFailed(self._refusal, transient=False)
        fields = {"model": self._model, "response_format": "json"}
        if self._language:
            fields["language"] = self._language
        files = {"file": (file_name(audio), audio.data, audio.mime_type)}
        try:
            # The whole exchange within the limit: httpx's timeouts are per read, and a
            # server trickling bytes would never trip them.
            async with asyncio.timeout(self._timeout_s):
                response = await self._client.post(self.url, data=fields, files=files)
        except (TimeoutError, httpx.TimeoutException):
            raise TranscriptionFailed(
                f"{service} did not answer within {self._timeout_s:g} s",
                transient=True,
                timed_out=True,
            ) from None
        except httpx.TransportError as exc:
            # A certificate we do not trust stays untrusted until someone acts.
            raise TranscriptionFailed(
                f"cannot reach {service}: {self._scrub(describe(exc))}",
                transient=not _certificate_refused(exc),
            ) from None
        return self._text(response)

    def _text(self, response: httpx.Response) -> str:
        service, status = where(self.url), response.status_code
        if status != 200:
            said = self._said(response)
            transient = status >= 500 or status in TRANSIENT_STATUSES
            raise TranscriptionFailed(
                f"{service} answered {status}{': ' + said if said else ''}{self._fix(status)}",
                transient=transient,
                status=status,
            )
        try:
            answer = response.json()
        except ValueError:
            raise TranscriptionFailed(
                f"{service} answered 200 without JSON ({self._said(response) or 'empty'}): is "
                "it an OpenAI-compatible /v1/audio/transcriptions endpoint?",
                transient=False,
                status=status,
            ) from None
        text = answer.get("text") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise TranscriptionFailed(
                f'{service} answered 200 without a "text" string: is it an OpenAI-compatible '
                "/v1/audio/transcriptions endpoint?",
                transient=False,
                status=status,
            )
        return heard(text)

    def _fix(self, status: int) -> str:
        if status in (401, 403):
            if self._key is None:
                return f"; it wants a key: set {self._key_env}"
            return f"; check the key in {self._key_env}"
        if status == 404:
            return "; check [switchboard.transcription] url (…/v1/audio/transcriptions)"
        return ""

    def _said(self, response: httpx.Response) -> str:
        """The service's own short error text: OpenAI's and Groq's `error.message`, FastAPI's
        `detail`, or the start of the body; printable, bounded, and without the key."""
        body = response.text
        said: Any = body
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if isinstance(answer, dict):
            error = answer.get("error")
            said = (
                (error.get("message") if isinstance(error, dict) else error)
                or answer.get("detail")
                or answer.get("message")
                or body
            )
        if not isinstance(said, str):
            said = json.dumps(said)
        return printable(self._scrub(said), MAX_SAID_CHARS)

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "[the key]") if self._key else text


def _certificate_refused(exc: BaseException) -> bool:
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


# -- local: faster-whisper --------------------------------------------------------------------


class Segment(Protocol):
    text: str


class WhisperModelLike(Protocol):
    """What LocalTranscriber uses of `faster_whisper.WhisperModel` (tests give a fake)."""

    def transcribe(
        self, audio: BinaryIO, language: str | None = None
    ) -> tuple[Iterable[Segment], Any]: ...


def package_problem() -> str | None:
    """Why faster-whisper cannot be used, or None."""
    if importlib.util.find_spec("faster_whisper") is None:
        return (
            "[switchboard.transcription] model_path is set but the faster-whisper package is "
            "not installed: pip install faster-whisper (into the environment butlers runs in)"
        )
    return None


def model_path_problem(model_path: str) -> str | None:
    """Why `model_path` is not a faster-whisper model we can load without a download, or None.
    Reads the file system: call it off the event loop."""
    path = Path(model_path)
    fetch = (
        "put a faster-whisper (CTranslate2) model there yourself, e.g. a copy of "
        "Systran/faster-whisper-small: nothing is downloaded at run time"
    )
    if not path.exists():
        return f"[switchboard.transcription] model_path {model_path!r} does not exist: {fetch}"
    if not path.is_dir():
        return f"[switchboard.transcription] model_path {model_path!r} is not a directory: {fetch}"
    missing = [name for name in LOCAL_MODEL_FILES if not (path / name).is_file()]
    if missing:
        return (
            f"[switchboard.transcription] model_path {model_path!r} has no "
            f"{' and no '.join(missing)}: {fetch}"
        )
    return None


def load_whisper(model_path: str) -> WhisperModelLike:
    """faster-whisper's model from a local directory (device and precision chosen by
    CTranslate2); `local_files_only`: never the Hub."""
    # By name: an optional package without type information (mypy would need it installed).
    faster_whisper = importlib.import_module("faster_whisper")
    model: WhisperModelLike = faster_whisper.WhisperModel(model_path, local_files_only=True)
    return model


class LocalTranscriber:
    """faster-whisper on this machine. The model is loaded at the first voice note (seconds,
    and memory only when used) and runs in a thread of its own, one voice note at a time: a
    model uses every core it gets, and several at once would only slow each other down. One
    dedicated thread rather than `asyncio.to_thread` under a lock: a caller that is cancelled
    while its transcription runs would release the lock and let the next one start beside it.

    `load_model` stands in for `load_whisper` (tests: the weights cannot be here)."""

    def __init__(
        self,
        model_path: str,
        language: str = "",
        *,
        timeout_s: float = TranscriptionConfig().timeout_s,
        load_model: Callable[[str], WhisperModelLike] | None = None,
    ) -> None:
        self.model_path = model_path
        self._language = language or None
        self._timeout_s = timeout_s
        self._load_model = load_model
        self._model: WhisperModelLike | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transcription")

    async def __aenter__(self) -> LocalTranscriber:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop taking voice notes; one running finishes in its thread, queued ones are
        dropped (their callers were cancelled, or the process is stopping)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._model = None

    async def transcribe(self, audio: Attachment) -> str:
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self._thread, self._transcribe, audio)
        if not text:
            raise TranscriptionFailed(
                f"the local model heard no words in {audio.describe()}", transient=False
            )
        return text

    def _model_loaded(self) -> WhisperModelLike:
        if self._model is not None:
            return self._model
        problem = None if self._load_model is not None else package_problem()
        problem = problem or model_path_problem(self.model_path)
        if problem is not None:
            raise TranscriptionFailed(problem, transient=False)
        load = self._load_model or load_whisper
        try:
            self._model = load(self.model_path)
        except Exception as exc:  # ctranslate2's and faster-whisper's own errors
            raise TranscriptionFailed(
                f"[switchboard.transcription] model_path {self.model_path!r} did not load as a "
                f"faster-whisper model: {type(exc).__name__}: {printable(str(exc), 200)}",
                transient=False,
            ) from None
        return self._model

    def _transcribe(self, audio: Attachment) -> str:
        """In the transcription thread: load the model once, then decode and transcribe,
        within `timeout_s` (the thread cannot be stopped from outside: an hours-long note
        held every voice note behind it for hours)."""
        model = self._model_loaded()
        deadline = time.monotonic() + self._timeout_s
        try:
            segments, _info = model.transcribe(io.BytesIO(audio.data), language=self._language)
            # The segments are a generator: the work happens while they are read.
            said = []
            for segment in segments:
                said.append(segment.text)
                if time.monotonic() > deadline:
                    raise TranscriptionFailed(
                        f"the local model took over {self._timeout_s:g} s ([switchboard."
                        f"transcription] timeout_s) on {audio.describe()}",
                        transient=False,
                    )
            text = "".join(said)
        except TranscriptionFailed:
            raise
        except Exception as exc:  # PyAV cannot decode it, or the model failed on it
            raise TranscriptionFailed(
                f"the local model could not transcribe {audio.describe()}: "
                f"{type(exc).__name__}: {printable(str(exc), 200)}",
                transient=False,
            ) from None
        return heard(text)
