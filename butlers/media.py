"""Attachments: the files a message carries (a voice note, a photo, a PDF, a text file).

A channel downloads a file, checks it (`checked`: its type read from its bytes, never from its
name; its size against the channel's cap) and hands it to the inbox with the message, in the
same transaction. From there the same bytes go, on every attempt, to transcription (audio) or
to the routed butler's Claude Code session (images, PDFs and text, as content blocks the model
sees). The classifier sees only `describe()`: kind, size and name, never the bytes.

Between the switchboard and a butler an attachment travels inside `trigger`'s arguments in its
wire form (`to_wire` / `from_wire`): base64, with its name and type.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from butlers.errors import AttachmentRefused
from butlers.text import printable

Kind = Literal["image", "pdf", "text", "audio"]
MAX_NAME_CHARS = 120
# What the Messages API takes as an image block (its documented limit: 5 MB an image).
MAX_IMAGE_BYTES = 5 * 1024 * 1024
# Image types the Messages API reads.
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


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
            return {"type": "text", "text": f"<file name={self.name!r}>\n{text}\n</file>"}
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
