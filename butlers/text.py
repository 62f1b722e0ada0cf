"""Text that other people chose, made safe to show on a terminal, in a chat or a log line."""

from __future__ import annotations

import itertools
import secrets
import unicodedata


def printable(text: str | None, limit: int | None = None) -> str:
    """`text` with no control or format characters (line breaks, terminal escapes such as
    ESC and OSC 52, bidirectional overrides, zero-width ones), runs of white space made one,
    cut to `limit` characters (with "…") when given. A name, a memory or a schedule's prompt
    printed by the CLI or sent to the owner cannot move the cursor, rewrite the screen or
    reverse what follows it."""
    if not text:
        return ""
    kept = []
    for char in text if limit is None else text[: limit * 4]:
        category = unicodedata.category(char)
        if category in ("Cc", "Zl", "Zp"):
            kept.append(" ")
        elif not category.startswith("C"):  # Cf, Cs, Co, Cn: invisible or not characters
            kept.append(char)
    line = " ".join("".join(kept).split())
    if limit is None or len(line) <= limit:
        return line
    return line[: limit - 1].rstrip() + "…"


# What may disguise a text without being seen: format characters (bidirectional overrides,
# zero-width ones), line and paragraph separators, private and unassigned code points.
_DISGUISING = frozenset({"Cf", "Zl", "Zp", "Co", "Cs", "Cn"})


def escaped_disguises(text: str) -> str:
    """`text` (JSON, as a rule: it escapes control characters itself) with every character
    that could disguise it written as its escape (`\\u202e`): a tool's arguments shown for
    a yes read as what will run (a right-to-left override made "100000" look like "10"0000"),
    and stay valid JSON."""
    return "".join(
        (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}") if _disguises(c) else c
        for c in text
    )


def _disguises(c: str) -> bool:
    """Invisible, or moving what follows: format characters, separators, private and
    unassigned code points, C1 controls (JSON escapes only C0), variation selectors."""
    code = ord(c)
    if code < 0x7F:
        return False
    return (
        unicodedata.category(c) in _DISGUISING
        or code <= 0x9F
        or 0xFE00 <= code <= 0xFE0F
        or 0xE0100 <= code <= 0xE01EF
    )


def new_boundary(text: str) -> str:
    """A token `text` does not contain, to fence it in (it cannot: it is drawn after the
    text came)."""
    while True:
        boundary = secrets.token_hex(8)
        if boundary not in text:
            return boundary


def fence(label: str, boundary: str, text: str) -> str:
    """`text` between two lines holding `label` and `boundary` (new_boundary: one `text`
    cannot hold), so that a reader knows where it starts and ends."""
    return f"<<<{label} {boundary}\n{text}\n{label} {boundary}>>>"


def fenced_text(text: str, label: str) -> str | None:
    """What the first `label` fence in `text` holds, or None: found with two searches, in
    linear time whatever the text holds."""
    start = text.find(f"<<<{label} ")
    if start < 0:
        return None
    opening_end = text.find("\n", start)
    if opening_end < 0:
        return None
    boundary = text[start + len(label) + 4 : opening_end]
    end = text.find(f"\n{label} {boundary}>>>", opening_end)
    return text[opening_end + 1 : end] if end >= 0 and boundary else None


ANSWER_LINE_CHARS = 100  # a first line longer than this answers nothing
ANSWER_TEXT_CHARS = 20_000  # of a mail, what is looked at for an answer


def answer_line(text: str) -> tuple[str, bool]:
    """A mail's first line that is not blank, its white space made single spaces (empty when
    it is longer than ANSWER_LINE_CHARS: no answer is), and whether nothing but blank or
    quoted (">") lines, or a signature (after "-- "), follows it. Linear, and bounded: an
    owner's "Yes, please." is read this way, and a stranger's mail of 100 000 spaces cost
    minutes to a regular expression that read it whole (a review)."""
    head = text[:ANSWER_TEXT_CHARS]
    lines = iter(head.split("\n"))  # (not splitlines: U+2028 and its kind are no line end)
    for line in lines:
        if line.strip():
            first = " ".join(line.split())
            break
    else:
        return "", True
    # (It has non-blank characters, so its first occurrence is where it is.)
    runs_on = len(text) > len(head) and head.index(line) + len(line) == len(head)
    if len(first) > ANSWER_LINE_CHARS or runs_on:
        return "", False
    for line in itertools.islice(lines, 50):
        if line.rstrip() == "--" or line.startswith("-- "):
            break
        if line.strip() and not line.lstrip().startswith(">"):
            return first, False
    return first, True


def within_limit(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, and a line saying where it was cut when it was
    (a long mail was cut mid-word and nobody was told: a walkthrough)."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n\n[cut: the first {limit} of its {len(text)} characters are above]"
