"""Whose words a mail's text holds: the sender's own, the quoted history of a reply (trimmed:
a stranger's words, maybe, that would read as the owner's), and a forwarded mail (kept, and
said to be someone else's). Every pattern here is linear: blanks are [ \\t], a value begins
with a non-blank, a line's words are tested with `in`, because each of them has been fed a
sender's body that made a looser one take seconds."""

from __future__ import annotations

import re

from butlers.text import printable

_QUOTE_HEADER = re.compile(r"^(On .+ wrote:|-----Original Message-----|Le .+ a écrit :)\s*$")
# The line a mail program writes above the mail a reply quotes, in other languages: its
# start, a word in it, and (for those that hold the date) a digit, tested with `in`, not a
# regex (`Am .*\d.* schrieb` backtracks quadratically on a long line). German Gmail ("Am Do.,
# 26. Nov. 2026 um 14:05 Uhr schrieb X:"), Thunderbird and Apple Mail ("Am 26.11.2026 um 14:05
# schrieb X:"); Spanish, Italian, Dutch, Portuguese, Swedish alike. Unknown, the history
# stayed: a German owner's "approve" above it was not an answer, and the quoted mail (a
# stranger's words, maybe) was read as the owner's (a walkthrough).
_QUOTE_LINES = (
    ("Am ", " schrieb "),
    ("El ", " escribió"),
    ("Il ", " ha scritto"),
    ("Op ", " schreef "),
    ("Em ", " escreveu"),
    ("Den ", " skrev "),
)
# Outlook's line above the mail it answers, in other languages than _QUOTE_HEADER's, and
# the English one with its dashes spaced or counted otherwise (Outlook Express, webmails).
_ORIGINAL_MESSAGE = re.compile(
    r"-{3,}[ \t]*(?:original message|ursprüngliche nachricht|message d'origine|"
    r"mensaje original|"
    r"messaggio originale|oorspronkelijk bericht|mensagem original|ursprungligt meddelande)"
    r"[ \t]*-{3,}",
    re.IGNORECASE,
)


def _quotes_below(line: str) -> bool:
    """Whether `line` (stripped) opens a reply's quoted history."""
    if _QUOTE_HEADER.match(line) or _ORIGINAL_MESSAGE.fullmatch(line):
        return True
    if not line.endswith(":") or len(line) > 500:
        return False
    # With a time of day, as every mail program writes it ("um 14:05"): "Am 3. Mai schrieb
    # mir der Vermieter:" is the owner's own sentence (a review).
    return _CLOCK_TIME.search(line) is not None and any(
        line.startswith(start) and word in line for start, word in _QUOTE_LINES
    )


_CLOCK_TIME = re.compile(r"\d:\d\d")


# A reply's subject: English, German, Scandinavian, Dutch, Polish, Turkish, Italian, Portuguese.
REPLY_SUBJECT = re.compile(
    r"^[ \t]*(?:re|aw|sv|antw|odp|ynt|rif|res)(?:[ \t]*\[\d+\])?[ \t]*:", re.I
)
# Outlook's line above the header block of the mail it answers.
_OUTLOOK_RULE = re.compile(r"^[ \t]*_{10,}[ \t]*\n?\Z")


def is_reply(subject: str, references: str, message_id: str) -> bool:
    """Whether a mail answers another (not a forward): it names an earlier mail of its
    thread, or its subject says Re: (AW:, SV:, ...)."""
    if FORWARDED_SUBJECT.match(subject):
        return False
    earlier = [i for i in references.split() if i != message_id]
    return bool(earlier) or REPLY_SUBJECT.match(subject) is not None


def trim_quoted(text: str, *, reply: bool = False) -> str:
    """Drop the quoted history of a reply: '>' lines and everything after 'On ... wrote:'.
    A reply's (`reply`) history under a mail program's header block (HEADER_BLOCK: Outlook's
    From:, Sent:, To:..., in any language, with or without its rule of underscores above)
    goes too: kept, the block read as a forward, and the owner's own reply was taken for
    someone else's words (a walkthrough); in a language it did not know, the history (a
    stranger's words, maybe) was the owner's request (a red team)."""
    text = text.replace("\r\n", "\n")  # (IMAP keeps CRLF: Outlook's rule line was kept)
    head = text[:FORWARD_SEARCH_CHARS]
    # (A forwarded part said to be one, "---------- Forwarded message", is a forward's even in
    # a thread: its header block is what it forwards, kept.)
    block = HEADER_BLOCK.search(head) if reply else None
    if block is not None and FORWARDED_BLOCK.search(head, 0, block.start()) is None:
        text = text[: block.start()]
        above, _, last = text.rstrip("\n").rpartition("\n")
        if _OUTLOOK_RULE.match(last):
            text = above
    kept = []
    # Below Apple Mail's opening line of a forward, in a mail that is not a reply and within
    # where forwarded_part looks (so that what is kept is said to be forwarded), '>' lines
    # are the mail it forwards: dropped, it was lost. Not in a reply (its '>' lines are the
    # history it answers, a stranger's maybe: kept, they read as endorsed by the owner: a
    # review), nor below other forward lines ("Original Message" opens a reply's history).
    forwarded, length = False, 0
    # At line feeds only: splitlines() also breaks at U+2028, U+0085, form feeds and lone
    # CRs, which a quoted line may hold, and the rest of a stranger's quoted line came out
    # unquoted, read as the sender's own words (a red team).
    for line in text.split("\n"):
        if _quotes_below(line.strip()):
            break
        if line.lstrip().startswith(">"):
            if forwarded and length < FORWARD_SEARCH_CHARS:
                kept.append(_unquoted(line))
                length += len(line) + 1
            continue
        forwarded = forwarded or (not reply and _QUOTED_FORWARD.fullmatch(line) is not None)
        kept.append(line)
        length += len(line) + 1
    return "\n".join(kept).strip()


def answer_below_quote(text: str) -> str:
    """The words a plain-text reply holds under its '>'-quoted history, when it holds none
    above it (Thunderbird's and mutt's way: an owner's "yes" below the quoted question was
    read as an empty mail: a walkthrough); "" when there are none, or when it is not plainly
    so. Strict, because what follows an attribution line is often someone else's (a red
    team): the text is split at line feeds only (U+2028 and its kind stay inside the quoted
    line they came in), every line of the history must be '>'-quoted (an HTML mail's
    blockquote, rewrapped quoted lines and unmarked history are not), the sender's words
    must come after a blank line below the last quoted line, and a `-- ` signature ends
    them. For text/plain bodies only: HTML's quotes are not marked."""
    lines = text.replace("\r\n", "\n").split("\n")
    start = next((n for n, line in enumerate(lines) if _quotes_below(line.strip())), None)
    if start is None or lines[start].strip().startswith("-"):  # Outlook's: unmarked below
        return ""
    if any(line.strip() for line in lines[:start]):
        return ""  # words above the quote: those are the reply (trim_quoted keeps them)
    rest = lines[start + 1 :]
    quoted = [n for n, line in enumerate(rest) if line.startswith(">")]
    if not quoted:
        return ""
    last = quoted[-1]
    if any(line.strip() and not line.startswith(">") for line in rest[:last]):
        return ""  # unmarked lines within the history: not plainly quoted
    tail = rest[last + 1 :]
    if not tail or tail[0].strip():
        return ""  # no blank line under the quote: a rewrapped quoted line, maybe
    words = []
    for line in tail:
        if line.rstrip() == "--" or line.startswith(">") or _quotes_below(line.strip()):
            break
        words.append(line)
    return "\n".join(words).strip()


def _unquoted(line: str) -> str:
    """A quoted line one level less quoted: its first '>' and one blank after it gone."""
    rest = line.lstrip()[1:]
    return rest[1:] if rest.startswith(" ") else rest


# A forwarded mail, as the common mail programs write one: the subject's prefix (English,
# German, French, Spanish, Italian, Dutch, Swedish, Danish/Norwegian, Portuguese, Polish),
# the line that opens the forwarded part (Gmail, Thunderbird, Outlook, Apple Mail), or a mail
# program's header block (HEADER_BLOCK). Blanks are [ \t], never \s: with MULTILINE, \s
# runs across lines and a body of blank lines took 25 s to search (a review).
FORWARDED_SUBJECT = re.compile(r"^[ \t]*(?:fwd?|wg|tr|rv|i|doorst|vb|vs|enc|pd)[ \t]*:", re.I)
FORWARDED_BLOCK = re.compile(
    r"^[ \t]*(?:-{2,}[ \t]*(?:forwarded message|original message|weitergeleitete nachricht|"
    r"message transféré)[ \t]*-{2,}|begin forwarded message:|"
    # Apple Mail's, in German, French, Spanish, Italian, Dutch.
    r"anfang der weitergeleiteten nachricht:|début du message réexpédié[ \t]?:|"
    r"inicio del mensaje reenviado:|inizio messaggio inoltrato:|begin doorgestuurd bericht:)"
    r"[ \t]*$",
    re.IGNORECASE | re.MULTILINE,
)
# Apple Mail's opening line of a forward whose mail follows as '>' lines (FORWARDED_BLOCK's).
_QUOTED_FORWARD = re.compile(
    r"[ \t]*(?:begin forwarded message|anfang der weitergeleiteten nachricht|"
    r"début du message réexpédié[ \t]?|inicio del mensaje reenviado|inizio messaggio inoltrato|"
    r"begin doorgestuurd bericht):[ \t]*",
    re.IGNORECASE,
)
# The word a mail program's header block begins with, in the languages of the common ones.
_FROM_WORDS = "from|von|de|van|da|från|fra|od|lähettäjä|feladó|kimden|от|від|差出人|发件人|寄件者"
# A header line ("Sent: Friday", "Verzonden: vrijdag"): a word or a few, a colon (or the
# full-width one), a value. Blanks are [ \t] and a value begins with a non-blank, so a run of
# blanks is matched one way only: `[ \t]*(.+)\n` tried every split of a run of 20 000 spaces
# (seconds of the event loop, from any sender's mail: a red team).
_HEADER_LINE = r"[ \t]*\*?[^\W\d_][\w .-]{0,24}[:\uff1a]\*?[ \t]*\S[^\n]*"
_FROM_LINE = rf"[ \t]*\*?(?:{_FROM_WORDS})[ \t]*[:\uff1a]\*?[ \t]*(\S[^\n]*)"
# A mail program's block above the mail a reply answers or a forward carries (Outlook's, in any
# language): its From line and two header lines more at least (Sent, To, Subject...). Two
# lines of the owner's own ("From: Amsterdam / Date: Friday") are not one.
HEADER_BLOCK = re.compile(
    rf"^{_FROM_LINE}\n{_HEADER_LINE}\n{_HEADER_LINE}", re.IGNORECASE | re.MULTILINE
)
FORWARDED_FROM = re.compile(rf"^{_FROM_LINE}$", re.IGNORECASE | re.MULTILINE)
# Where a forward is looked for: the start of a body (a forward's own words come first).
FORWARD_SEARCH_CHARS = 20_000
# The most of a forward's own lines above the forwarded part taken for the sender's own.
MAX_OWN_LINES_CHARS = 2_000
# Two header lines in a row ("Van: ...", "Verzonden: ..."), in any language: a mail's header
# block, written by a mail program, not the sender's own words.
HEADER_PAIR = re.compile(rf"^{_HEADER_LINE}\n{_HEADER_LINE}", re.MULTILINE)


def forwarded_part(subject: str, text: str) -> tuple[str, int] | None:
    """Who wrote the words of a mail that forwards another, and where in `text` the forwarded
    part begins (0: all of it, or it cannot be told); None: not a forward. The author is the
    first `From:` line after the forwarded part opens, else "someone else". The owner
    forwarding a stranger's mail ("please pay this") passed the stranger's words on as their
    own; the owner's own lines above the forwarded part stay theirs."""
    text = text[:FORWARD_SEARCH_CHARS]
    block = FORWARDED_BLOCK.search(text)
    headers = HEADER_BLOCK.search(text) if block is None else None
    if block is None and headers is None and not FORWARDED_SUBJECT.match(subject):
        return None
    author = headers or FORWARDED_FROM.search(text, block.end() if block is not None else 0)
    name = printable(author.group(1), 80) if author is not None else ""
    opened = block or headers
    at = opened.start() if opened is not None else 0
    # The lines above are the sender's own only when they are short and hold no header
    # block: a forward header we do not know (Dutch Outlook's Van:/Verzonden:) would leave
    # a marker the forwarded mail itself holds to split at, and the stranger's words above
    # it would read as the sender's (a review). Otherwise all of it is forwarded.
    above = text[:at]
    if len(above) > MAX_OWN_LINES_CHARS or HEADER_PAIR.search(above):
        at = 0
    return name or "someone else", at


def forwarded_author(subject: str, text: str) -> str | None:
    """`forwarded_part`'s author alone."""
    found = forwarded_part(subject, text)
    return found[0] if found is not None else None
