"""Attachments: the files a message carries (a voice note, a photo, a PDF, a text file).

A channel downloads a file, checks it (`checked`: its type read from its bytes, never from its
name or the type the sender declared; its size against the channel's cap; `check_count`: how
many a message may carry) and hands it to the inbox with the message, in the same transaction.
From there the same bytes go, on every attempt, to transcription (audio) or to the routed
butler's Claude Code session (images, PDFs and text, as content blocks the model sees). The
classifier sees only `describe()`: kind, size and name, never the bytes.

Between the switchboard and a butler an attachment travels inside `trigger`'s arguments in its
wire form (`to_wire` / `from_wire`): base64, with its name and type.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import secrets
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import imagesize
import puremagic

from butlers.errors import AttachmentRefused
from butlers.text import printable

Kind = Literal["image", "pdf", "text", "audio"]
MAX_NAME_CHARS = 120
# What the Messages API takes as an image block (its documented limit: 5 MB an image).
MAX_IMAGE_BYTES = 5 * 1024 * 1024
# The most pixels an image may declare. Claude Code decodes each image whole before it
# shrinks it for the Messages API: a PNG of 254 KB declaring 16383x16383 took its process to
# 1.37 GB (measured, bundled CLI 2.1.330), one such message enough to have a 2 GiB container
# killed. 50 megapixels takes a 48 MP phone photo (some 250 MB there).
MAX_IMAGE_PIXELS = 50_000_000
# Files a `trigger` or `notify` call may carry (the wire form: base64).
MAX_TOOL_ATTACHMENTS = 20
# Together, what one Messages API request may carry. Its cap, 32 MB a request, counts the
# files as they travel, base64 (a third larger), beside the prompt: two 15 MiB PDFs (30 MiB)
# made a request of ~42 MB, and the butler's session failed "Request too large (max 32MB)".
# 22 MiB of files are 30.8 MB as base64, leaving ~1.2 MB for the rest. A butler's HTTP body
# limit lets this much through, base64 (butlers.daemon), and the switchboard forwards no more
# with one message (butlers.switchboard.attachments).
MAX_TOOL_ATTACHMENT_BYTES = 22 * 1024 * 1024
# Image types the Messages API reads.
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
# What the sender reads when a file is of none of the kinds above.
NOT_READ = "is not a photo, PDF, text file or voice note, so I cannot read it"
# puremagic's names (its MIME type, else its extension) for the types read here, each mapped
# to the one type we store: the transcription services and the Messages API take these.
_SNIFFED: dict[str, str] = {
    "image/jpeg": "image/jpeg",
    "image/png": "image/png",
    "image/gif": "image/gif",
    "image/webp": "image/webp",
    "application/pdf": "application/pdf",
    "application/ogg": "audio/ogg",  # checked further: an Ogg file may hold video
    "audio/ogg": "audio/ogg",
    "audio/x-opus+ogg": "audio/ogg",
    "audio/mpeg": "audio/mpeg",
    "audio/mp4": "audio/mp4",
    "audio/x-m4a": "audio/mp4",
    ".m4a": "audio/mp4",  # puremagic names the "M4A " brand by its extension only
    "audio/wave": "audio/wav",
    "audio/x-wav": "audio/wav",
    "audio/wav": "audio/wav",
    "audio/flac": "audio/flac",
}
# The first packet of an Ogg stream names its codec: these are audio (Opus: a Telegram voice
# note); anything else (Theora video, an unknown codec) is not read.
_OGG_AUDIO_CODECS = (b"OpusHead", b"\x01vorbis", b"\x7fFLAC", b"Speex   ")
# After a PDF's "%PDF-" and its major version digit.
_PDF_MINORS = tuple(f".{n}".encode() for n in range(10))
# Text: at most this share of characters outside the printable ones, tab, CR, LF and FF.
_TEXT_MAX_UNPRINTABLE = 0.05
_TEXT_SAMPLE_CHARS = 64 * 1024  # of a text's start, counted so


@dataclass(frozen=True)
class Attachment:
    """One file of a message: its bytes and the type they were found to be."""

    name: str  # the sender's file name, cleaned (shown, never used as a path)
    mime_type: str  # read from the bytes (`checked`), not from the name or the sender's word
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def kind(self) -> Kind:
        return kind_of(self.mime_type)

    def describe(self) -> str:
        """One line for the classifier and the logs: kind, type, size and name."""
        return f"{self.kind} ({self.mime_type}, {human_size(self.size)}) {self.name!r}"

    def content_block(self) -> dict[str, Any]:
        """The Messages API block the routed session's model sees: an image, a document (a
        PDF), or the text of a text file. Audio never reaches a session (it is transcribed)."""
        if self.kind == "image":
            return {"type": "image", "source": self._base64_source()}
        if self.kind == "pdf":
            return {"type": "document", "source": self._base64_source(), "title": self.name}
        if self.kind == "text":
            text = self.data.decode("utf-8", errors="replace")
            # A boundary the file cannot know (drawn now), as the classifier's: a `</file>`
            # in the text closes nothing.
            tag = f"file-{secrets.token_hex(8)}"
            return {"type": "text", "text": f"<{tag} name={self.name!r}>\n{text}\n</{tag}>"}
        raise ValueError(f"{self.describe()} has no content block (audio is transcribed)")

    def _base64_source(self) -> dict[str, str]:
        return {
            "type": "base64",
            "media_type": self.mime_type,
            "data": base64.b64encode(self.data).decode("ascii"),
        }

    def to_wire(self) -> dict[str, str]:
        """As `trigger`'s `attachments` carry it."""
        return {
            "name": self.name,
            "mime_type": self.mime_type,
            "data": base64.b64encode(self.data).decode("ascii"),
        }


def from_wire(items: Sequence[Mapping[str, Any]] | None) -> list[Attachment]:
    """`trigger`'s `attachments` back into attachments; AttachmentRefused names what is wrong
    (which item, which key)."""
    attachments = []
    for index, item in enumerate(items or ()):
        where = f"attachments[{index}]"
        if not isinstance(item, Mapping):
            raise AttachmentRefused(f"{where}: expected an object with name, mime_type and data")
        name, mime_type, data = item.get("name"), item.get("mime_type"), item.get("data")
        if not isinstance(mime_type, str) or kind_or_none(mime_type) is None:
            raise AttachmentRefused(f"{where}.mime_type: {mime_type!r} is not a type read here")
        if not isinstance(data, str):
            raise AttachmentRefused(f"{where}.data: expected base64 text")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise AttachmentRefused(f"{where}.data: not base64 ({exc})") from None
        attachments.append(Attachment(clean_name(str(name or "")), mime_type, raw))
    return attachments


def sniff(data: bytes) -> str | None:
    """The type of `data`, read from its bytes alone (never a name or a declared type): one
    of the image, PDF, audio and text types read here, or None for anything else.

    The magic numbers are puremagic's; of its best guesses (those of its highest confidence)
    the first one read here counts. Where a signature says little, more is checked: an Ogg
    file must be audio (its first packet names Opus, Vorbis, FLAC or Speex), a PDF must start
    with a `%PDF-n.n` header, a JPEG with a marker after its start-of-image one. A file that
    is readable text throughout is text even when it starts like an image or audio file
    ("GIF89a is...", "ID3 tags..."): real images and audio always hold bytes no text has;
    only a PDF can be plain ASCII, so its header wins.
    """
    if not data:
        return None
    sniffed = _magic(data)
    if sniffed == "application/pdf":
        return sniffed
    if _is_text(data):
        return "text/plain"
    return sniffed


def _magic(data: bytes) -> str | None:
    """puremagic's best guess among the types read here, with the checks it lacks."""
    try:
        matches = puremagic.magic_string(data)
    except (puremagic.PureError, ValueError):
        return None
    if not matches:
        return None
    best = matches[0].confidence
    for match in matches:
        if match.confidence < best:
            break
        mime_type = _SNIFFED.get(match.mime_type) or _SNIFFED.get(match.extension)
        if mime_type is None:
            continue
        if mime_type == "audio/ogg":
            return mime_type if _ogg_audio(data) else None
        if mime_type == "application/pdf":
            return mime_type if _pdf_header(data) else None
        if mime_type == "image/jpeg":  # its start-of-image marker, then a segment's marker
            return mime_type if data.startswith(b"\xff\xd8\xff") else None
        return mime_type
    return None


def _ogg_audio(data: bytes) -> bool:
    """Whether an Ogg stream's first page starts an audio codec's stream."""
    # The page header: "OggS", version 0, flags (beginning of stream: 2), granule position,
    # serial, sequence, CRC, then the number of segments and their lengths.
    if len(data) < 27 or data[:5] != b"OggS\x00" or not data[5] & 0x02:
        return False
    start = 27 + data[26]
    packet = data[start : start + sum(data[27:start])]
    return packet.startswith(_OGG_AUDIO_CODECS)


def _pdf_header(data: bytes) -> bool:
    """`%PDF-` and a version such as 1.7 (a text merely starting with "%PDF" is not one)."""
    version = data[5:8]
    return data.startswith(b"%PDF-") and version[:1].isdigit() and version[1:] in _PDF_MINORS


def _is_text(data: bytes) -> bool:
    """Valid UTF-8 throughout, no NUL, and (almost) every character of its start printable
    or a line break or tab. Only the start is counted character by character: the rest is
    checked at C speed (decoding, the NUL search), so a 20 MB text costs milliseconds, not
    seconds of the event loop."""
    if b"\x00" in data:
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    start = text[:_TEXT_SAMPLE_CHARS]
    unprintable = sum(1 for c in start if not c.isprintable() and c not in "\t\r\n\f")
    return unprintable <= len(start) * _TEXT_MAX_UNPRINTABLE


def checked(data: bytes, name: str, *, max_bytes: int) -> Attachment:
    """A file as received, made an Attachment once it may be read; else AttachmentRefused,
    whose text tells the sender which file and which limit (nothing of the file is kept).

    The type is the one its bytes show (`sniff`): a name or a declared type saying otherwise
    does not matter, so an executable named photo.jpg is refused and a PNG named x.pdf is an
    image. The size is checked first: an oversized file is not even read."""
    name = clean_name(name)
    if len(data) > max_bytes:
        raise AttachmentRefused(f"{name!r} is {_sizes(len(data), max_bytes)}")
    if not data:
        raise AttachmentRefused(f"{name!r} is empty, so I cannot read it")
    mime_type = sniff(data)
    if mime_type is None:
        raise AttachmentRefused(f"{name!r} {NOT_READ}")
    if mime_type in IMAGE_TYPES:
        if len(data) > MAX_IMAGE_BYTES:
            raise AttachmentRefused(f"{name!r} is {_sizes(len(data), MAX_IMAGE_BYTES, 'a photo')}")
        _check_pixels(data, name)
    return Attachment(name, mime_type, data)


def _check_pixels(data: bytes, name: str) -> None:
    """AttachmentRefused for an image declaring more than MAX_IMAGE_PIXELS, or whose
    header does not say its size (a decoder would have to guess). Read from the header
    alone: a JPEG's segments are walked to its frame header, at worst 0.55 s for 5 MB of
    empty segments (measured; callers check files off the event loop)."""
    width, height = imagesize.get(io.BytesIO(data), exif_rotation=False)
    if data.startswith(b"GIF"):  # a decoder grows the screen to fit the first frame
        width, height = _gif_canvas(data, width, height)
    if width <= 0 or height <= 0:
        raise AttachmentRefused(f"{name!r} does not say its size in pixels, so I cannot read it")
    if width * height > MAX_IMAGE_PIXELS:
        raise AttachmentRefused(
            f"{name!r} is {width}x{height} pixels; the most I can read of a photo is "
            f"{MAX_IMAGE_PIXELS // 1_000_000} megapixels"
        )


def audio_seconds(data: bytes, *, beyond: float = float("inf")) -> float | None:
    """How long an audio file plays (or some length over `beyond`, as soon as that is clear),
    or None when that cannot be told. An Ogg Opus stream (a
    Telegram voice note) is measured by its packets, as a decoder plays them: the length its
    pages declare (the last granule position), like the length Telegram states, is the
    sender's to write. Other audio by what its header says (tinytag): a crafted header can
    still understate it, and a transcription's time limit then bounds it."""
    if data.startswith(b"OggS"):
        played = _opus_seconds(data, beyond)
        if played is not None or _first_packet_is_opus(data):
            # An Opus file is measured by its packets or not at all: one that cannot be
            # measured fell back to what its last page declares (a review: a second stream
            # that is not Opus, and it passed as 1 s while it played 20 minutes).
            return played
    from tinytag import TinyTag

    try:
        tag = TinyTag.get(file_obj=io.BytesIO(data), tags=False)
    except Exception:  # tinytag's own errors, or a parser falling over crafted bytes
        return None
    return float(tag.duration) if tag.duration is not None else None


# An Opus frame's length in milliseconds, by its TOC byte's configuration (RFC 6716, 3.1):
# SILK-only 0-11, hybrid 12-15, CELT-only 16-31.
_OPUS_FRAME_MS = (*(10, 20, 40, 60) * 3, *(10, 20) * 2, *(2.5, 5, 10, 20) * 4)
_OPUS_PACKET_MAX_MS = 120  # longer packets are invalid: a decoder refuses them


def _opus_packet_ms(head: bytes) -> float:
    """The length of an Opus packet from its first bytes: its frames times their length."""
    toc = head[0]
    code = toc & 0x03
    frames = (1, 2, 2)[code] if code < 3 else (head[1] & 0x3F if len(head) > 1 else 0)
    return min(_OPUS_FRAME_MS[toc >> 3] * frames, _OPUS_PACKET_MAX_MS)


def _opus_seconds(data: bytes, beyond: float) -> float | None:
    """The seconds the Opus packets of an Ogg file play, every stream's (a decoder plays a
    chained file's streams one after another); None when a stream is not Opus. Pages are
    walked by their lacing values, each packet's first bytes read: linear in the size (20 MiB
    of the smallest packets: 3.9 s of CPU, measured), so it stops past `beyond` seconds."""
    streams: dict[int, list[Any]] = {}  # serial: [packets ended, the current packet's start]
    played_ms = 0.0
    position = 0
    while position + 27 <= len(data):
        lacing = data[position + 27 : position + 27 + data[position + 26]]
        end = position + 27 + len(lacing) + sum(lacing)
        if data[position : position + 4] != b"OggS" or not _ogg_crc_matches(data, position, end):
            # Not a page: a decoder (libogg) looks for the next one and plays on, so so do
            # we. A junk byte after the head, or a page whose CRC is wrong (libogg drops it)
            # claiming the real pages as one unfinished packet, hid 20 minutes (reviews).
            position = data.find(b"OggS", position + 1)
            if position < 0:
                break
            continue
        serial = int.from_bytes(data[position + 14 : position + 18], "little")
        offset = position + 27 + len(lacing)
        stream = streams.setdefault(serial, [0, b""])
        for length in lacing:
            if len(stream[1]) < 8:
                stream[1] += data[offset : offset + min(length, 8 - len(stream[1]))]
            offset += length
            if length == 255:
                continue  # the packet goes on in the next segment
            ended, head = stream
            if ended == 0 and not head.startswith(b"OpusHead"):
                return None
            if ended >= 2 and head:  # after OpusHead and OpusTags: audio
                played_ms += _opus_packet_ms(head)
                if played_ms > beyond * 1000:
                    return played_ms / 1000
            stream[0], stream[1] = ended + 1, b""
        position = offset
    if not any(ended for ended, _ in streams.values()):
        return None  # no packet at all: nothing says it is Opus
    return played_ms / 1000


# Ogg's CRC is CRC-32 (0x04C11DB7) unreflected, from 0, with no final XOR; zlib's is the
# reflected one: fed bit-reversed bytes from a start that makes its register 0, its result's
# complement bit-reversed is Ogg's. In C: a pure-Python CRC of 20 MiB took seconds.
_BITS_REVERSED = bytes(int(f"{byte:08b}"[::-1], 2) for byte in range(256))


def _ogg_crc_matches(data: bytes, start: int, end: int) -> bool:
    """The page at data[start:end] carries the CRC of its bytes (its CRC field as zeros)."""
    if end > len(data):
        return False
    page = data[start : start + 22] + b"\0\0\0\0" + data[start + 26 : end]
    register = ~zlib.crc32(page.translate(_BITS_REVERSED), 0xFFFFFFFF) & 0xFFFFFFFF
    return int(f"{register:032b}"[::-1], 2) == int.from_bytes(
        data[start + 22 : start + 26], "little"
    )


def _first_packet_is_opus(data: bytes) -> bool:
    """The file's first Ogg page begins an Opus stream (its first packet is OpusHead)."""
    if len(data) < 27:
        return False
    return data[27 + data[26] :].startswith(b"OpusHead")


def clock_length(seconds: float) -> str:
    """`1:05:03`, `4:10`: a length as a player shows it."""
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


_GIF_BLOCKS_BEFORE_A_FRAME = 1000  # extensions walked before the first image; then: no size


def _gif_canvas(data: bytes, width: int, height: int) -> tuple[int, int]:
    """A GIF's size as its decoder makes it: the logical screen (`width` x `height`), grown
    to hold the first frame (libnsgif does so: a 35-byte GIF of a 1x1 screen declared a
    16383x16383 frame, a review found). (-1, -1) when no frame is found in the first blocks."""
    position = 13
    if len(data) > 10 and data[10] & 0x80:  # a global colour table follows the screen
        position += 3 * 2 ** ((data[10] & 0x07) + 1)
    for _ in range(_GIF_BLOCKS_BEFORE_A_FRAME):
        if position >= len(data):
            break
        kind = data[position]
        if kind == 0x2C and position + 9 < len(data):  # the first frame's descriptor
            left, top, frame_width, frame_height = struct.unpack_from("<HHHH", data, position + 1)
            return max(width, left + frame_width), max(height, top + frame_height)
        if kind != 0x21:  # not an extension: the trailer, or not a GIF we can read
            break
        position += 2  # the introducer and the label, then sub-blocks to an empty one
        while position < len(data) and data[position]:
            position += data[position] + 1
        position += 1
    return -1, -1


def check_count(count: int, limit: int) -> None:
    """AttachmentRefused when a message carries more files than `limit`."""
    if count > limit:
        has = f"This message has {count} {'file' if count == 1 else 'files'}"
        if limit == 0:
            raise AttachmentRefused(f"{has}; files are not read here")
        files = "file" if limit == 1 else "files"
        raise AttachmentRefused(f"{has}; I read at most {limit} {files} a message")


def _sizes(size: int, limit: int, of: str = "") -> str:
    """'12.3 MB; the most I can read is 10.0 MB': in bytes when both would read the same."""
    shown, most = human_size(size), human_size(limit)
    if shown == most:
        shown, most = f"{size:,} bytes", f"{limit:,} bytes"
    return f"{shown}; the most I can read{' of ' + of if of else ''} is {most}"


# The file name endings each type read here goes out with (the first: the one added).
EXTENSIONS = {
    "image/jpeg": (".jpg", ".jpeg"),
    "image/png": (".png",),
    "image/gif": (".gif",),
    "image/webp": (".webp",),
    "application/pdf": (".pdf",),
    "text/plain": (".txt", ".md", ".csv", ".log"),
    "audio/ogg": (".ogg", ".oga", ".opus"),
    "audio/mpeg": (".mp3",),
    "audio/mp4": (".m4a",),
    "audio/wav": (".wav",),
    "audio/flac": (".flac",),
}


def as_its_type(file: Attachment) -> Attachment:
    """`file` under a name whose ending says what its bytes are: a text a session named
    `invoice.html` or `update.bat` goes out as `invoice.html.txt`, so that no mail client
    or phone opens it as a page or a program."""
    endings = EXTENSIONS.get(file.mime_type)
    if not endings or file.name.lower().endswith(endings):
        return file
    return dataclasses.replace(file, name=clean_name(file.name + endings[0]))


def kind_or_none(mime_type: str) -> Kind | None:
    if mime_type in IMAGE_TYPES:
        return "image"
    if mime_type == "application/pdf":
        return "pdf"
    if mime_type.startswith("text/"):
        return "text"
    if mime_type.startswith("audio/"):
        return "audio"
    return None


def kind_of(mime_type: str) -> Kind:
    kind = kind_or_none(mime_type)
    if kind is None:
        raise ValueError(f"{mime_type!r} is not a type read here")
    return kind


def clean_name(name: str) -> str:
    """A file name as shown: its last path part, printable, bounded."""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = printable(name).strip()
    return name[:MAX_NAME_CHARS] or "file"


def human_size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.0f} KB"
    return f"{size / (1024 * 1024):.1f} MB"
