"""One-line summaries of child tool descriptions, so `introspect` stays cheap in tokens."""

from __future__ import annotations

import re

ELLIPSIS = "…"
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def summarize(text: str | None, max_chars: int) -> str:
    """Whitespace collapsed; at most `max_chars` characters (code points, never split).

    Too long: cut after the last sentence end that lies past half the limit; failing that, at
    the last word boundary, with an ellipsis.
    """
    flat = " ".join((text or "").split())
    if len(flat) <= max_chars:
        return flat
    if max_chars <= 1:
        return ELLIPSIS[:max_chars]
    window = flat[:max_chars]
    ends = [m.end() for m in _SENTENCE_END.finditer(window)]
    if ends and ends[-1] > max_chars / 2:
        return window[: ends[-1]]
    room = window[: max_chars - len(ELLIPSIS)]
    cut = room.rfind(" ")
    if cut > 0:
        room = room[:cut]
    return room.rstrip(" ,;:-") + ELLIPSIS
