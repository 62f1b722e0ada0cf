"""attachments: what a message carries, made ready before it is classified.

A voice note (or an audio file) becomes the message's text through the transcription
service (`[switchboard.transcription]`, butlers.switchboard.transcription): the transcript is
written to the inbox row, and the reply will quote it, so that a misheard note shows. Images,
PDFs and text files are loaded from the inbox (the same bytes on every attempt, after a crash
too) to go with the route to the butler's session; the classifier sees only their one-line
descriptions (`message_body`).

When the service fails for a while (5xx, a timeout), the message waits in the queue
(`InboxStore.defer`) and is tried again with a growing delay, like a reply while its channel
is down; its sender hears only when `retry_hours` have passed without a transcript. Audio
that cannot be heard (no service, too long, refused, given up) ends a message that is only
that audio, with a reply saying why; one that says or carries more goes on without it, a
line naming what was not read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from butlers.errors import LeaseLost, TranscriptionFailed
from butlers.media import (
    MAX_TOOL_ATTACHMENT_BYTES,
    Attachment,
    audio_seconds,
    clock_length,
    human_size,
)
from butlers.text import printable

if TYPE_CHECKING:
    from butlers.config import TranscriptionConfig
    from butlers.switchboard.inbox import InboxMessage
    from butlers.switchboard.store import InboxQueue
    from butlers.switchboard.transcription import Transcriber

logger = logging.getLogger(__name__)

NO_TRANSCRIBER = (
    "I got your voice note, but voice notes need a transcription service and none is set up "
    'here yet (see the docs, "Voice notes"). Please write your message out.'
)
NOT_HEARD = "Sorry, I could not make out your voice note. Please try again, or write it out."
# Not the sender's recording: the service refused this butler (its key, its model, its bill)
# or is not there. Told as such, not as a voice note badly spoken.
SERVICE_REFUSED = (
    "Sorry, I could not transcribe your voice note: the transcription service turned this "
    "butler away (a problem on this side, not your recording). Please write it out for now."
)
SERVICE_DOWN = (
    "Sorry, I could not transcribe your voice note: the transcription service has not been "
    "answering for {hours}. Please write it out, or send it again later."
)
# What the service answers about a caller it will not serve, or an address that is not a
# transcription endpoint (a redirect: FastAPI's trailing slash; 405: another path), not about
# the audio.
REFUSING_STATUSES = (401, 402, 403, 404, 405)
TOO_LONG = (
    "Sorry, your voice note took too long to transcribe. Please send a shorter one, or write "
    "it out."
)
# Tries that end in a timeout before a voice note is given up (see AttachmentStep._failed).
MAX_TIMEOUTS = 3
QUOTE_CHARS = 300  # of the transcript, quoted in the reply
RETRY_MIN_S = 1.0
RETRY_MAX_S = 300.0


@dataclass(frozen=True)
class Carried:
    """A message ready for classification: its text (a voice note's transcript), the files
    its routed session sees, and what was heard (quoted in the reply), if anything."""

    message: InboxMessage
    files: list[Attachment]
    heard: str | None = None


@dataclass(frozen=True)
class NotNow:
    """The message is not classified now: finished with `status` and `reply` (None: nothing
    said), or, with `retry_in_s`, back in the queue until then."""

    status: str
    reply: str | None
    error: str
    retry_in_s: float | None = None
    timed_out: bool = False  # the service did not answer in time (counted: MAX_TIMEOUTS)


def descriptions(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The files an inbox row's meta lists (InboxStore.accept writes them)."""
    listed = meta.get("attachments")
    return [item for item in listed if isinstance(item, dict)] if isinstance(listed, list) else []


def described(meta: dict[str, Any]) -> str:
    """The files as the classifier and the butler's prompt read them: one line each (kind,
    type, size, name; never the bytes)."""
    from butlers.media import clean_name, human_size

    lines = [
        f"[attached: {item.get('kind')} ({item.get('mime_type')}, "
        f"{human_size(int(item.get('size') or 0))}) {clean_name(str(item.get('name') or ''))!r}]"
        for item in descriptions(meta)
    ]
    return "\n".join(lines)


def quoted(heard: str, reply: str) -> str:
    """The reply to a voice note, starting with one line of what was understood."""
    return f"🎤 “{printable(heard, QUOTE_CHARS)}”\n\n{reply}"


class AttachmentStep:
    """Turns a claimed message's voice notes into text and loads its files."""

    def __init__(
        self,
        inbox: InboxQueue,
        transcriber: Transcriber | None,
        config: TranscriptionConfig,
        *,
        replica: str,
    ) -> None:
        self.inbox = inbox
        self.transcriber = transcriber
        self.config = config
        self.replica = replica

    async def prepare(self, message: InboxMessage) -> Carried | NotNow:
        if not descriptions(message.meta):  # most messages: no query, no work
            return Carried(message, [])
        files = await self.inbox.attachments(message.id)
        audio = [file for file in files if file.kind == "audio"]
        ready = await self._heard(message, audio)
        if isinstance(ready, NotNow):
            if ready.retry_in_s is not None or not _more_than_audio(message, files):
                return ready
            ready = _without_audio(message, audio, ready)
        others, told = _within_one_request(
            [file for file in files if file.kind != "audio"], ready.message
        )
        return dataclasses.replace(ready, message=told, files=others)

    async def _heard(self, message: InboxMessage, audio: list[Attachment]) -> Carried | NotNow:
        """The message with its voice notes' transcript as its text (written to its inbox
        row too), or why not now."""
        if not audio:
            return Carried(message, [])
        if message.meta.get("transcribed"):  # an attempt before a crash heard it (keep_audio)
            return Carried(message, [], message.text)
        if self.transcriber is None:
            return NotNow("skipped", NO_TRANSCRIBER, "a voice note, and no transcription service")
        for file in audio:
            if (too_long := await self._too_long(file)) is not None:
                return NotNow("failed", too_long, f"transcription: {too_long}")
        try:
            heard = [await self.transcriber.transcribe(file) for file in audio]
        except TranscriptionFailed as exc:
            return self._failed(message, exc)
        transcript = "\n".join(text.strip() for text in heard if text.strip())
        if not transcript:
            return NotNow("failed", NOT_HEARD, "transcription: the service heard no words")
        typed = f"{message.text}\n\n" if message.text.strip() else ""
        text = typed + transcript
        if not await self.inbox.transcribed(
            message.id,
            replica=self.replica,
            text=text,
            keep_audio=self.config.keep_audio,
            transcript_at=len(typed),
        ):
            raise LeaseLost(message.id)
        meta = {
            **message.meta,
            "voice": True,
            "transcribed": True,
            "transcript_at": len(typed),
            "attachments": [d for d in descriptions(message.meta) if d.get("kind") != "audio"],
        }
        return Carried(dataclasses.replace(message, text=text, meta=meta), [], transcript)

    async def _too_long(self, audio: Attachment) -> str | None:
        """Why not to transcribe `audio`: it plays longer than `max_seconds`, as measured
        from its bytes (a document, a mail's file and a voice note alike: the length Telegram
        states is the sender's word), or how long it plays cannot be told. A service bills
        by the minute, and a local model decodes a file whole before it starts."""
        most = self.config.max_seconds
        seconds = await asyncio.to_thread(audio_seconds, audio.data, beyond=most)
        name = "the voice note" if audio.name == "voice note" else repr(audio.name)
        if seconds is None:
            return (
                f"I cannot tell how long {name} plays, so I did not transcribe it: write it "
                "out, please"
            )
        if seconds > most:  # measured only as far as needed: longer than that
            return (
                f"{name} plays longer than {clock_length(most)}, the most I transcribe: send "
                "a shorter one, or write it out"
            )
        return None

    def _failed(self, message: InboxMessage, exc: TranscriptionFailed) -> NotNow:
        """A service that fails for now is tried again later (the delay doubles with the time
        already waited), until `retry_hours`; anything else, or past that, fails the message."""
        error = f"transcription: {exc}"
        if not exc.transient:
            refused = on_this_side(exc)
            return NotNow("failed", SERVICE_REFUSED if refused else NOT_HEARD, error)
        timeouts = message.meta.get("timeouts")
        if exc.timed_out and isinstance(timeouts, int) and timeouts >= MAX_TIMEOUTS - 1:
            # Each try holds a worker for timeout_s: a note too long for it is not retried
            # for hours (the service answers other notes meanwhile, or it would be 5xx).
            return NotNow("failed", TOO_LONG, f"{error} ({MAX_TIMEOUTS} times: too long?)")
        waited = message.deferred_for_s()
        if waited >= self.config.retry_hours * 3600:
            hours = _hours(waited)
            return NotNow(
                "failed", SERVICE_DOWN.format(hours=hours), f"{error} (gave up after {hours})"
            )
        delay = min(RETRY_MAX_S, max(RETRY_MIN_S, waited))
        logger.warning(
            "message %s: %s; trying again in %.0f s",
            message.id,
            error,
            delay,
            extra={"action": "transcription_deferred"},
        )
        return NotNow("queued", None, error, retry_in_s=delay, timed_out=exc.timed_out)


def on_this_side(exc: TranscriptionFailed) -> bool:
    """Whether a failure is the butler's setup, not the recording: no answer at all (a local
    model missing), a refusal of this caller, a redirect, a 200 that is no transcription (not
    an OpenAI-compatible endpoint), a 400 about the model. A walkthrough found each of these
    told to the sender as a note badly spoken."""
    status = exc.status
    return (
        status is None
        or status in REFUSING_STATUSES
        or 300 <= status < 400
        or status == 200
        or (status == 400 and "model" in str(exc).lower())
    )


def _more_than_audio(message: InboxMessage, files: list[Attachment]) -> bool:
    """Whether the message says or carries something besides its audio: words typed beside
    it (a mail's text, a caption), or other files."""
    return bool(message.text.strip()) or any(file.kind != "audio" for file in files)


def _without_audio(message: InboxMessage, audio: list[Attachment], why: NotNow) -> Carried:
    """The message without its audio, which could not be heard, and a line saying so: a
    mail with a receipt, its words and a voicemail notification was skipped whole, its
    sender told to write out what they had written (a walkthrough)."""
    names = ", ".join(repr(printable(file.name, 80)) for file in audio)
    note = f"[not read: {names}: {_unheard_because(why)}]"
    text = f"{message.text}\n\n{note}" if message.text.strip() else note
    logger.info(
        "message %s: its audio was not heard (%s); its words and other files go on",
        message.id,
        why.error,
        extra={"action": "audio_left_out"},
    )
    meta = {
        **message.meta,
        "attachments": [d for d in descriptions(message.meta) if d.get("kind") != "audio"],
    }
    # Nothing was transcribed: no words of it are labelled so (the typed text of a mail with
    # a memo was read as "A voice note, transcribed.": a walkthrough).
    meta.pop("voice", None)
    return Carried(dataclasses.replace(message, text=text, meta=meta), [])


def _unheard_because(why: NotNow) -> str:
    """Why audio was not heard, as the butler and so its sender may read it: the kind of
    failure, never the service's own words (its address, a variable's name, a model's
    path: the operator's, in the log)."""
    if why.status == "skipped":
        return "voice notes need a transcription service, and none is set up"
    if why.reply == NOT_HEARD:
        return "no words could be made out"
    said = why.reply or ""
    if said == TOO_LONG or "plays longer than" in said or "cannot tell how long" in said:
        return "too long to transcribe, or its length could not be told"
    return "the transcription service could not be used"


def _within_one_request(
    files: list[Attachment], message: InboxMessage
) -> tuple[list[Attachment], InboxMessage]:
    """The files that fit in one Messages API request together (MAX_TOOL_ATTACHMENT_BYTES:
    what a butler's `trigger` takes), in the sender's order; the rest are named in the text,
    so that the butler can say which it did not see (a mail may carry 5 files of 10 MB)."""
    kept: list[Attachment] = []
    left_out: list[str] = []
    total = 0
    for file in files:
        if total + file.size > MAX_TOOL_ATTACHMENT_BYTES:
            left_out.append(file.name)
            continue
        kept.append(file)
        total += file.size
    if not left_out:
        return files, message
    names = ", ".join(repr(name) for name in left_out)
    note = (
        f"[not read: {names}: the files of one message are read up to "
        f"{human_size(MAX_TOOL_ATTACHMENT_BYTES)} together]"
    )
    text = f"{message.text}\n\n{note}" if message.text else note
    return kept, dataclasses.replace(message, text=text)


def _hours(seconds: float) -> str:
    """'6 hours', '1 hour', '12 minutes' (a short retry_hours)."""
    if seconds < 3600:
        minutes = max(1, round(seconds / 60))
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    hours = round(seconds / 3600, 1)
    shown = f"{hours:g}"
    return f"{shown} hour{'s' if shown != '1' else ''}"
