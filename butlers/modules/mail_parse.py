"""Reading a mail: its envelope (from the header alone), its text, and what we may write back
in a header. Pure functions, no I/O: the email module runs them in a worker thread.

Whatever a sender writes, reading it costs bounded time and memory. The stdlib's parser does
not promise that, so the limits below are checked before it is asked:

- `policy.default` parses a header each time it is read, in time and memory quadratic in its
  length (a folded Subject of 256 KiB of `=?utf-8?q?abc?=` words took 2.1 GB): a header we
  read that is longer than MAX_HEADER_BYTES is refused unparsed (`HeaderTooLong`), those we
  never read are never parsed;
- it re-parses each MIME part's Content-Type several times while splitting a mail (2 ms a
  part: a 1 MB mail of 10,000 tiny parts took 20 s): past MAX_MIME_PARTS parts it stops;
- a charset whose decoder is quadratic (punycode) is read as latin-1, like an unknown one;
- an HTML body is converted only until there is text enough for MAX_TEXT_CHARS, and at most
  its first MAX_HTML_CHARS (converting takes ~0.6 s a MiB).

Attachments: a part whose bytes are an image, a PDF, audio or text (butlers.media.sniff; a
text file only when the sender also called it text: signatures, keys and other printable
data sent as application/* are not the sender's words) is kept for the message (`files`);
the others are listed by name in the text, as not read. The channel's own limits (bytes a
file, files a message) are applied by `within_limits`, which says in the text what they
refused.

A mail attached to a mail (message/rfc822: "Forward as attachment" in Gmail, Outlook and
Thunderbird) is read as a forward written inline would be: its sender, date, subject and text
follow the sender's own lines under a "Forwarded message" line, said to be someone else's
words (`ParsedMail.forwarded`), and its files are read like the mail's own. A mail attached to
that one is listed as not read.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import email._header_value_parser as header_syntax
import email.errors
import email.policy
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from email.message import EmailMessage, Message, MIMEPart
from email.parser import BytesHeaderParser, BytesParser
from email.policy import EmailPolicy, compat32
from html.parser import HTMLParser
from typing import Any

from butlers.errors import AttachmentRefused, HeaderTooLong, MailUnreadable
from butlers.media import Attachment, check_count, checked, kind_or_none, sniff
from butlers.text import printable

# A mail over its limit is not read (its envelope is kept as a failed inbox row). The limit is
# room for one attachment of `[modules.email] max_attachment_bytes` as base64 (4/3 of its
# bytes) and the rest of the mail, and never under MAX_MAIL_BYTES: a 10 MiB attachment came in
# a mail of ~13.6 MiB, which a fixed 10 MiB refused whole. Parsing costs ~10 times the mail's
# size in memory and about a second for each 10 MiB.
MAX_MAIL_BYTES = 10 * 1024 * 1024
MAIL_BESIDE_ATTACHMENT_BYTES = 2 * 1024 * 1024  # its text, headers, other parts


def mail_limit(max_attachment_bytes: int) -> int:
    """The largest mail read when one attachment may be `max_attachment_bytes`."""
    encoded = -(-max_attachment_bytes * 4 // 3)  # base64, rounded up
    return max(MAX_MAIL_BYTES, encoded + MAIL_BESIDE_ATTACHMENT_BYTES)


# The header block we fetch and read at most: mail servers write a few to some tens of KiB.
MAX_HEADER_BLOCK_BYTES = 256 * 1024
# One header we read (From, Subject, Message-ID, Content-Type...): a legitimate one is under
# 1 KiB (RFC 5322 lines stop at 998 characters); parsing 8 KiB costs policy.default at worst
# ~30 ms and ~6 MB, 100 KiB cost it 400 MB.
MAX_HEADER_BYTES = 8 * 1024
MAX_MIME_PARTS = 200  # a newsletter with its inline images has a few dozen
MAX_TEXT_CHARS = 100_000
# HTML converted at most (~0.6 s a MiB): far more markup than MAX_TEXT_CHARS of text needs.
MAX_HTML_CHARS = 2 * 1024 * 1024
MAX_ATTACHMENTS_LISTED = 20  # in the text; meta lists every name (at most MAX_MIME_PARTS)
MAX_ATTACHMENT_NAME_CHARS = 100
MAX_REFERENCES = 50  # Message-IDs of a thread kept for our reply's References
MAX_ATTACHED_MAILS = 5  # mails attached to a mail that are read (a forward carries one)
MAIL_TYPES = frozenset({"message/rfc822", "message/global"})  # a mail attached (RFC 6532)
MAX_AUTHOR_CHARS = 200  # a forwarded part's author, as the handoff and approvals name them
# The line an attached mail's text follows: one FORWARDED_BLOCK matches (Gmail's own).
ATTACHED_MAIL_LINE = "---------- Forwarded message ---------"
_PREVIEW_CHARS = 200  # of a header we will not parse, for the failed row and the log
_SLOW_CODECS = frozenset({"punycode", "idna"})  # pure Python, punycode quadratic


# -- parsing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedMail:
    message_id: str
    sender: str  # the one From address, lower-cased ("" when refused)
    sender_name: str
    subject: str
    text: str
    attachments: list[str] = field(default_factory=list)  # every attachment's name
    references: str = ""
    automated: str | None = None  # why this mail must not be answered, if it must not
    refused: str | None = None  # why its sender cannot be trusted (From), if it cannot
    authentication_results: tuple[str, ...] = ()  # Authentication-Results, topmost first
    unreadable: str | None = None  # why the rest cannot be read (a header too long, ...)
    # The attachments of a kind read here (image, PDF, audio, text), their type read from
    # their bytes; not yet checked against the channel's limits (`within_limits`).
    files: tuple[Attachment, ...] = ()
    not_read: tuple[str, ...] = ()  # the names of the attachments not read
    # Who wrote the forwarded words and where in `text` they begin (0: all of it), when a
    # mail came attached (message/rfc822); None: `forwarded_part` reads the text for a forward.
    forwarded: tuple[str, int] | None = None


class _BoundedPolicy(EmailPolicy):
    """policy.default, except that reading a header longer than MAX_HEADER_BYTES raises
    HeaderTooLong instead of parsing it. Every way a header is read goes through here:
    get/get_all, get_param, get_filename, get_content_type (the parser's own calls too)."""

    def header_fetch_parse(self, name: str, value: str) -> Any:
        if len(value) > MAX_HEADER_BYTES:
            raise HeaderTooLong(name, len(value), MAX_HEADER_BYTES)
        try:
            return super().header_fetch_parse(name, value)
        except RecursionError:  # comments nested a thousand deep
            raise MailUnreadable(f"the {name} header is nested too deeply") from None


READING = _BoundedPolicy()


class _PartCounter:
    """The parser's message factory, counting what it makes: the parser stops at the part past
    MAX_MIME_PARTS (it would spend seconds on a few thousand)."""

    def __init__(self) -> None:
        # Not counted: the call FeedParser makes up front (to probe the factory's signature),
        # and the message itself.
        self.parts = -2

    # FeedParser calls it with `policy=` (after probing that it takes one); the default only
    # makes it the `Callable[[], ...]` typeshed's BytesParser stub asks for.
    def __call__(self, policy: EmailPolicy | None = None) -> EmailMessage:
        self.parts += 1
        if self.parts > MAX_MIME_PARTS:
            raise MailUnreadable(f"it has more than {MAX_MIME_PARTS} MIME parts")
        return EmailMessage(policy=policy)


def parse_header(header: bytes, *, complete: bool = True) -> ParsedMail:
    """The envelope of a mail, from its header block alone (no text): enough to decide whether
    to read the rest. `complete=False`: the block was cut at MAX_HEADER_BLOCK_BYTES. Never
    raises: what cannot be read is said in `refused` (From) or `unreadable` (the rest)."""
    if not complete:
        header = header[: header.rfind(b"\n") + 1]  # the cut may have split a header
    try:
        # Split by compat32, which parses nothing (the parser itself reads Content-Type when
        # it closes), then read through READING.
        split = BytesHeaderParser(policy=compat32).parsebytes(header)
        message = EmailMessage(policy=READING)
        for name, value in split.raw_items():
            message.set_raw(name, value)
        mail = _read_headers(message)
    except Exception as exc:  # a stdlib failure on hostile input
        why = f"the header cannot be read ({_describe(exc)})"
        return ParsedMail("", "", "", "", "", refused=why, unreadable=why)
    if not complete:
        too_big = f"its header is over {MAX_HEADER_BLOCK_BYTES} bytes"
        mail = replace(mail, unreadable="; ".join(filter(None, [too_big, mail.unreadable])))
    return mail


def within_text_limit(text: str) -> str:
    """At most MAX_TEXT_CHARS of a mail's text, and a line saying where it was cut when it
    was (a long mail was cut mid-word and nobody was told: a walkthrough)."""
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return (
        text[:MAX_TEXT_CHARS]
        + f"\n\n[cut: the first {MAX_TEXT_CHARS} of its {len(text)} characters are above]"
    )


def not_read_note(names: Sequence[str], why: str = "") -> str:
    """The line a mail's text ends with when some of its attachments were not read (empty
    when all were): their names, at most MAX_ATTACHMENTS_LISTED, and `why` if given."""
    if not names:
        return ""
    listed = ", ".join(names[:MAX_ATTACHMENTS_LISTED])
    more = len(names) - MAX_ATTACHMENTS_LISTED
    return (
        f"\n\n[attachments not read: {listed}{f' and {more} more' if more > 0 else ''}"
        f"{f' ({why})' if why else ''}]"
    )


def parse_mail(raw: bytes, max_bytes: int = MAX_MAIL_BYTES) -> ParsedMail:
    """Parse a whole mail: text/plain preferred, HTML converted, any charset, attachments
    listed by name, quoted history trimmed, attached mails read as forwards. MailUnreadable
    when it is over a limit (see the module docstring; `max_bytes`: `mail_limit`'s); other
    exceptions are the stdlib failing on hostile input."""
    if len(raw) > max_bytes:
        raise MailUnreadable(f"it is {len(raw)} bytes, over the limit of {max_bytes}")
    parts = _PartCounter()
    try:
        message = BytesParser(_class=parts, policy=READING).parsebytes(raw)
        assert isinstance(message, EmailMessage)
        mail = _read_headers(message)
        if mail.unreadable:
            raise MailUnreadable(mail.unreadable)
        reply = is_reply(mail.subject, mail.references, mail.message_id)
        text = trim_quoted(_text_of(message), reply=reply)
        read = _Attachments()
        for part in _own_attachments(message):
            read.add(part, read.named(part))
        mail_parts = list(_mail_parts(message))
    except RecursionError:
        raise MailUnreadable("its MIME parts are nested too deeply") from None
    # After the sender's own files: the attached mails' files count against the same
    # limits, and the sender's own go first.
    attached: list[_AttachedMail] = []
    for mail_part in mail_parts:
        found = _attached(mail_part, parts) if len(attached) < MAX_ATTACHED_MAILS else None
        if found is None:
            read.add(mail_part, read.named(mail_part))  # listed as not read
            continue
        attached.append(found)
        read.names.append(read.named(mail_part))
        for file in found.files:
            read.add(file, read.named(file))
    forwarded = None
    if attached:
        own = text.rstrip()
        forwarded = _forwarded_with(mail.subject, own, attached)
        text = "\n\n".join([*([own] if own else []), *(a.block for a in attached)])
    text = within_text_limit(text) + not_read_note(read.not_read)
    return replace(
        mail,
        text=text.strip(),
        attachments=read.names,
        files=tuple(read.files),
        not_read=tuple(read.not_read),
        forwarded=forwarded,
    )


def _text_of(message: Message, max_html_chars: int | None = None, *, html: bool = False) -> str:
    """A mail's own text: text/plain preferred (`html`: the HTML, what a mail program
    shows), HTML converted (at most `max_html_chars`, else MAX_HTML_CHARS)."""
    assert isinstance(message, EmailMessage)
    body = message.get_body(preferencelist=("html", "plain") if html else ("plain", "html"))
    return _body_text(body, max_html_chars) if body is not None else ""


class _Attachments:
    """A mail's attachments as they are read: every name, the files read, the names not."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.files: list[Attachment] = []
        self.not_read: list[str] = []

    def named(self, part: MIMEPart) -> str:
        # Shown in the mail's text and the inbox row: no bidi or zero-width characters.
        name = printable(str(part.get_filename() or ""), MAX_ATTACHMENT_NAME_CHARS)
        return name or "(unnamed)"

    def add(self, part: MIMEPart, name: str) -> None:
        self.names.append(name)
        file = _readable(part, name)
        if file is None:
            self.not_read.append(name)
        else:
            self.files.append(file)


@dataclass(frozen=True)
class _AttachedMail:
    """A mail attached to a mail, read as a forward written inline (`block`)."""

    author: str  # its From, made printable
    subject: str
    block: str
    files: tuple[MIMEPart, ...]  # its attachments (not the mails attached to it)


def _own_attachments(message: EmailMessage) -> Iterator[EmailMessage]:
    """The sender's own attachments: those in its multiparts too (a signed mail's are in the
    multipart/mixed it signs, which was listed as "(unnamed)" and not read), but not the
    mails attached to it (`_mail_parts`)."""
    for part in message.iter_attachments():
        kind = part.get_content_type()
        if kind in MAIL_TYPES:
            continue
        if part.is_multipart() and part.get_content_maintype() == "multipart":
            yield from _own_attachments(part)
        else:  # (another message/*, a delivery report's: listed, not read)
            yield part


def _mail_parts(message: Message) -> Iterator[MIMEPart]:
    """The mails attached to `message` (message/rfc822 parts) wherever its multiparts hold
    them, in order, not looking inside them: at the top of multipart/mixed (Gmail,
    Thunderbird), under multipart/alternative or /related (Apple Mail's rich text), in
    multipart/signed (S/MIME, PGP), or as the whole mail."""
    if message.get_content_type() in MAIL_TYPES:
        assert isinstance(message, MIMEPart)
        yield message
    elif message.is_multipart():
        for part in message.get_payload():
            if isinstance(part, Message):
                yield from _mail_parts(part)


def _attached(part: MIMEPart, parts: _PartCounter) -> _AttachedMail | None:
    """The mail attached as `part`, read (`_forward_block`), or None where it cannot be: it
    is then listed as not read. Whatever its headers or parts do to the stdlib (a hostile
    parameter raises IndexError in it, a header over MAX_HEADER_BYTES, too many parts) costs
    only that, never the sender's own words (a red team: one header in a stranger's attached
    mail made the owner's whole mail unreadable)."""
    try:
        inner = _attached_mail(part, parts)
        if inner is None:
            return None
        files = tuple(inner.iter_attachments())  # not its attached mails: not read
        return _forward_block(inner, files)
    except Exception:  # MailUnreadable, RecursionError, the stdlib's own on hostile input
        return None


def _attached_mail(part: MIMEPart, parts: _PartCounter) -> EmailMessage | None:
    """The mail attached as `part` (message/rfc822), or None. Outlook and some webmails send
    it base64-encoded, which RFC 2046 does not allow and the stdlib's parser reads as a
    header-less mail of base64 text: decoded and parsed again, its parts counted with the
    rest."""
    payload = part.get_payload()
    inner = payload[0] if isinstance(payload, list) and payload else None
    if not isinstance(inner, EmailMessage):
        return None
    if str(part.get("Content-Transfer-Encoding", "")).strip().lower() == "base64":
        written = inner.get_payload()  # base64 has no header-like line: all of it is here
        if not isinstance(written, str):
            return None
        try:
            data = base64.b64decode(written.encode("ascii", "replace"))
        except (ValueError, binascii.Error):
            return None
        inner = BytesParser(_class=parts, policy=READING).parsebytes(data)
        assert isinstance(inner, EmailMessage)
    return inner if list(inner.keys()) else None


def _forward_block(inner: EmailMessage, files: tuple[MIMEPart, ...]) -> _AttachedMail:
    """An attached mail as a forward written inline: the Forwarded message line, its From,
    Date and Subject, and its text with its own quoted history trimmed. Its header lines
    cannot hold a line break (the sender's to write: a planted one would end the block). Its
    text is its HTML where it has both: what the owner's mail program showed them (its
    text/plain, the stranger's own, may say something else entirely: a red team)."""
    shown = {header: _shown(inner, header) for header in ("From", "Date", "Subject")}
    lines = [ATTACHED_MAIL_LINE, *(f"{name}: {value}" for name, value in shown.items() if value)]
    mail = _read_headers(inner)
    reply = is_reply(mail.subject, mail.references, mail.message_id)
    # The attached mails' HTML shares one more MAX_HTML_CHARS: a mail of five attached
    # newsletters converts at most twice what a mail alone does.
    html_chars = MAX_HTML_CHARS // MAX_ATTACHED_MAILS
    text = trim_quoted(_text_of(inner, html_chars, html=True), reply=reply)
    return _AttachedMail(
        author=printable(shown["From"], MAX_AUTHOR_CHARS) or "someone else",
        subject=shown["Subject"],
        block="\n".join(lines) + "\n\n" + text,
        files=files,
    )


def _forwarded_with(subject: str, own: str, attached: Sequence[_AttachedMail]) -> tuple[str, int]:
    """Who wrote the forwarded words of a mail with `attached` mails, and where they begin
    in its text (`own`, the sender's own lines, then the attached mails' blocks).

    A forward written inline in `own` comes first. Otherwise `own` is the sender's when
    forwarded_part would take lines above a forward for theirs (short, no mail program's
    header block) and the subject does not say "Fwd:" of something else: "Fwd: Invoice 42"
    above an attached "Invoice 42" is the attachment's, but "Fwd: Urgent" above text in a
    forward format we do not know says that text is forwarded too (a red team). Several
    attached mails by several people are said to be theirs, each named on its From line."""
    inline = forwarded_part("", own)
    if inline is not None:
        return inline
    authors = list(dict.fromkeys(a.author for a in attached))
    author = authors[0]
    if len(authors) > 1:
        author = printable("several senders: " + "; ".join(authors), MAX_AUTHOR_CHARS)
    theirs = bool(own) and len(own) <= MAX_OWN_LINES_CHARS and not _HEADER_PAIR.search(own)
    if FORWARDED_SUBJECT.match(subject):
        forwarded_subject = _without_forward_prefix(subject)
        theirs = theirs and forwarded_subject in {
            _without_forward_prefix(a.subject) for a in attached
        }
    return author, len(own) + 2 if theirs else 0


def _without_forward_prefix(subject: str) -> str:
    """A subject without its "Fwd:" prefixes (several, or none), for comparing."""
    subject = one_line(subject)
    while (prefix := FORWARDED_SUBJECT.match(subject)) is not None:
        subject = subject[prefix.end() :].strip()
    return subject.casefold()


def _shown(message: Message, header: str) -> str:
    """A header as one printable line: decoded, or its raw start where the stdlib cannot
    read it (a display name with a line break in an encoded word, a Date it cannot parse)."""
    try:
        return printable(str(message.get(header, "")), 300)
    except Exception:  # MailUnreadable; whatever else the stdlib raises on hostile input
        return printable((_raw(message, header) or [""])[0][:_PREVIEW_CHARS], 300)


def _raw(message: Message, name: str) -> list[str]:
    return [_unfold(v) for k, v in message.raw_items() if k.lower() == name.lower()]


def _readable(part: MIMEPart, name: str) -> Attachment | None:
    """The attachment `part` as a file we read, or None. Its type is read from its bytes (what
    the sender declared never makes us read a part: an executable called image/jpeg is not
    one); a text file also needs the sender to have called it text."""
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes) or not payload:  # an attached mail, an empty part
        return None
    mime_type = sniff(payload)
    kind = kind_or_none(mime_type) if mime_type is not None else None
    if mime_type is None or kind is None:
        return None
    if kind == "text" and part.get_content_maintype() != "text":
        return None
    return Attachment(name, mime_type, payload)


def within_limits(mail: ParsedMail, *, max_bytes: int, max_count: int) -> ParsedMail:
    """The mail's files that its channel reads (at most `max_count`, each at most `max_bytes`:
    butlers.media.checked); those refused are named in the text with why, in the words of
    the refusal (which limit), so that the butler that answers can tell the sender. CPU-bound
    on big text files: run it off the event loop."""
    files: list[Attachment] = []
    refusals: list[str] = []
    refused: list[str] = []  # their names
    for file in mail.files:
        try:
            files.append(checked(file.data, file.name, max_bytes=max_bytes))
        except AttachmentRefused as exc:
            refusals.append(str(exc))
            refused.append(file.name)
    try:
        check_count(len(files), max_count)
    except AttachmentRefused as exc:
        left = [f.name for f in files[max_count:]]
        refusals.append(f"{exc} (not read: {', '.join(map(repr, left))})")
        refused += left
        files = files[:max_count]
    if not refusals:
        return replace(mail, files=tuple(files))
    notes = "\n".join(f"[not read: {why}]" for why in refusals)
    return replace(
        mail,
        text=f"{mail.text}\n\n{notes}".strip(),
        files=tuple(files),
        not_read=(*mail.not_read, *refused),
    )


def _read_headers(message: Message) -> ParsedMail:
    """What the header says, each header read through READING. A header we read that is too
    long (or that the stdlib cannot parse) is reported in `unreadable`, and shown as the
    start of its raw text instead."""
    problems: list[str] = []

    def raw(name: str) -> list[str]:
        return _raw(message, name)

    def read(name: str) -> str:
        try:
            return str(message.get(name, "")).strip()
        except Exception as exc:  # MailUnreadable; whatever else the stdlib may raise
            problems.append(_header_problem(name, exc))
        return _printable((raw(name) or [""])[0][:_PREVIEW_CHARS])

    try:
        address, name = single_address(raw("From"))
        refused = None
    except ValueError as exc:
        address, name, refused = "", "", str(exc)
    message_id = read("Message-ID")
    subject = read("Subject")
    try:
        automated = automated_reason(message, address)
    except Exception as exc:
        automated = None
        problems.append(_header_problem("Content-Type (or an auto-reply header)", exc))
    results = raw("Authentication-Results")  # not parsed here: dmarc_refusal does, bounded
    problems += [
        str(HeaderTooLong("Authentication-Results", len(v), MAX_HEADER_BYTES))
        for v in results
        if len(v) > MAX_HEADER_BYTES
    ]
    return ParsedMail(
        message_id=message_id,
        sender=address,
        sender_name=name,
        subject=subject,
        text="",
        references=thread_references(
            (raw("References") or [""])[0], (raw("In-Reply-To") or [""])[0], message_id
        ),
        automated=automated,
        refused=refused,
        authentication_results=tuple(v.strip() for v in results),
        unreadable="; ".join(problems) or None,
    )


def _unfold(value: str) -> str:
    """A raw header value as policy.default unfolds it (CR and LF removed)."""
    return value.replace("\r", "").replace("\n", "")


def _printable(raw: str) -> str:
    """The start of a raw header value, for a failed row and the log: one line, its 8-bit
    bytes (kept as surrogates by the parser, which no database takes) read as UTF-8."""
    text = raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return one_line(text)


def _header_problem(name: str, exc: Exception) -> str:
    if isinstance(exc, MailUnreadable):  # names the header already
        return str(exc)
    return f"the {name} header cannot be read ({_describe(exc)})"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return f"{type(exc).__name__}: {exc}"[:_PREVIEW_CHARS]


def thread_references(references: str, in_reply_to: str, message_id: str) -> str:
    """References for our reply: the thread's Message-IDs (References, else In-Reply-To, as
    RFC 5322 3.6.4 has a reply build them; the last MAX_REFERENCES: a long thread's header
    may be long, it is split, never parsed), then this mail's."""
    ids = [i for i in (references or in_reply_to).split() if len(i) <= 998][-MAX_REFERENCES:]
    return " ".join(filter(None, [*ids, message_id]))


def _body_text(part: MIMEPart, max_html_chars: int | None = None) -> str:
    """The text of a text/plain or text/html part, decoded by its charset; an unknown, lying
    or slow one (punycode is quadratic) read as latin-1."""
    payload = part.get_payload(decode=True)
    data = payload if isinstance(payload, bytes) else b""
    charset = str(part.get_param("charset", "us-ascii"))
    try:
        codec = codecs.lookup(charset)
        if not codec._is_text_encoding or codec.name in _SLOW_CODECS:
            raise LookupError(charset)
        content = data.decode(codec.name, "replace")
    except (LookupError, UnicodeError, ValueError, TypeError):
        content = data.decode("latin-1")
    if part.get_content_type() == "text/html":
        html = content[: MAX_HTML_CHARS if max_html_chars is None else max_html_chars]
        return html_to_text(html, max_chars=2 * MAX_TEXT_CHARS)
    return content


class _HTMLText(HTMLParser):
    """HTML mail as readable text: block elements become line breaks; what a mail program
    does not show is left out: the head (its title), scripts, styles, frames' fallbacks, and
    elements hidden by the `hidden` attribute, an inline style of display:none or
    visibility:hidden, or such a rule of a <style> for their class or id (`.x`, `div.x`,
    `#x`, not within @media) that comes before them (a stranger's attached mail showed the
    owner one thing and told the model another in them: a red team, and two reviews). Other
    ways of hiding text (a zero font size, white on white, other selectors) are not told."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "table", "blockquote"}
    UNSHOWN = {"script", "style", "head", "title", "template", "iframe", "noembed", "noframes"}
    # Elements with no content (no end tag): hiding one hides nothing after it.
    VOID = {
        "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
        "source", "track", "wbr",
    }  # fmt: skip
    # A hidden <p> whose end tag is left out ends where a browser ends it: at the next p or
    # block (it cannot hold one). (Other implied ends, li's and td's, need their lists' and
    # tables' nesting: not told, their hidden element hides on to its end.)
    IMPLIED_END = {"p": BLOCKS | {"ul", "ol", "h5", "h6", "pre", "form", "section", "article"}}
    FOREIGN = {"svg", "math"}  # within them `<x/>` ends x, as the parser takes it
    # Their content is text to a browser, never tags (HTMLParser knew script and style only:
    # `<textarea></div></textarea>` closed a hidden div early for it, not for a browser).
    CDATA_CONTENT_ELEMENTS = (  # type: ignore[misc]  # (Final in typeshed; read as self.)
        "script", "style", "textarea", "title", "xmp", "iframe", "noembed", "noframes",
    )  # fmt: skip
    MAX_CSS_CHARS = 256 * 1024  # of <style> read for its hiding rules

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.chars = 0  # of text data so far
        self._hidden: str | None = None  # the element whose content is not shown, while in it
        self._depth = 0  # of that tag, nested within itself
        self._foreign = 0  # svg and math elements open
        self._styling = False  # within a <style> (its rules are read, hidden or not)
        self._css: list[str] = []
        self._css_chars = 0
        self._hiding = _HidingRules()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "style":
            self._styling = True
        if tag in self.FOREIGN:
            self._foreign += 1
        if self._hidden is not None:
            if self._depth == 1 and tag in self.IMPLIED_END.get(self._hidden, ()):
                pass  # `<p hidden>one<p>two`: the second p ends the first, and is shown
            elif tag == self._hidden:
                self._depth += 1
                return
            elif tag == "body" and self._hidden == "head":  # a head never closed
                self._hidden = None
                return
            else:
                return
            self._hidden = None
        if tag in self.UNSHOWN or (tag not in self.VOID and self._hiding.hides(tag, attrs)):
            self._hidden, self._depth = tag, 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        # `<div style="display:none"/>`: a browser ignores the slash of an HTML element that
        # has content, and hides what follows; HTMLParser ended it at once. In svg and math
        # the slash does end it.
        self.handle_starttag(tag, attrs)
        if self._foreign or tag in self.FOREIGN:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.FOREIGN and self._foreign:
            self._foreign -= 1
        if tag == "style" and self._styling:
            self._styling = False
            self._hiding.read("".join(self._css))
            self._css, self._css_chars = [], 0
        if self._hidden is not None:
            if tag == self._hidden:
                self._depth -= 1
                if not self._depth:
                    self._hidden = None
            return
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._styling:  # in the head, or hidden: a browser applies it all the same
            if self._css_chars < self.MAX_CSS_CHARS:
                self._css.append(data)
                self._css_chars += len(data)
        elif self._hidden is None:
            self.parts.append(data)
            self.chars += len(data)


_CSS_ESCAPE = re.compile(r"\\(?:([0-9a-fA-F]{1,6})[ \t\n]?|(.))", re.DOTALL)
_SIMPLE_SELECTOR = re.compile(r"([a-z][a-z0-9]*)?([.#])([\w-]+)", re.IGNORECASE)
_HTML_SPACE = re.compile(r"[ \t\n\f\r]+")  # what separates class names (not all of Unicode's)


def _css_plain(css: str, *, keep_blanks: bool = False) -> str:
    """CSS as it means: comments and HTML comment marks gone (a scan, not a lazy regex: an
    unclosed `/*` repeated made that quadratic), escapes decoded (`\\6e one` is "none"),
    lower case, no blanks (`keep_blanks`: runs of them as one, for selectors)."""
    kept, at = [], 0
    while (opened := css.find("/*", at)) >= 0:
        kept.append(css[at:opened])
        closed = css.find("*/", opened + 2)
        at = len(css) if closed < 0 else closed + 2
    kept.append(css[at:])

    def decoded(match: re.Match[str]) -> str:
        if match[1] is not None:
            code = int(match[1], 16)
            return chr(code) if 0 < code <= 0x10FFFF else ""
        return match[2]

    text = _CSS_ESCAPE.sub(decoded, "".join(kept).replace("<!--", " ").replace("-->", " "))
    return " ".join(text.lower().split()) if keep_blanks else "".join(text.lower().split())


def _display(css: str) -> bool | None:
    """What a block of declarations says of being shown: False (display:none or
    visibility:hidden), True (another display or visibility), None (nothing)."""
    plain = _css_plain(css)
    if "display:none" in plain or "visibility:hidden" in plain:
        return False
    if "display:" in plain or "visibility:" in plain:
        return True
    return None


def _screen_media(prelude: str) -> bool:
    """Whether an at-rule's prelude is `@media screen` or `@media all`, with no condition."""
    words = _css_plain(prelude, keep_blanks=True).split()
    return (
        len(words) >= 2
        and words[0] == "@media"
        and all(word in ("screen", "all", "only", ",") for word in words[1:])
    )


class _HidingRules:
    """The classes and ids a mail's <style> hides (`.preheader {display: none}`), by tag
    when its selector names one; a later rule that shows them again undoes it."""

    def __init__(self) -> None:
        self.hidden: set[tuple[str, str, str]] = set()  # (tag or "", "." or "#", name)

    def read(self, css: str) -> None:
        """The rules of `css` a screen applies, in a scan (a regex over rules tried every
        start of a style without braces: minutes for 256 KiB): those at the top, and within
        `@media screen` or `@media all`; not those of a conditional at-rule (a small
        screen's, print's: hiding what a desktop shows would drop the owner's words)."""
        depth, selector_from, body_from, nested = 0, 0, 0, False
        media = False  # within `@media screen { ... }`: its rules are top-level ones
        for at, char in enumerate(css):
            top = 1 if media else 0
            if char == "{":
                if depth == 0 and _screen_media(css[selector_from:at]):
                    media, depth, selector_from = True, 1, at + 1
                    continue
                depth += 1
                if depth == top + 1:
                    body_from = at + 1
                else:
                    nested = True
            elif char == "}" and depth:
                depth -= 1
                if depth == top:
                    if not nested:
                        self._rule(css[selector_from : body_from - 1], css[body_from:at])
                    selector_from, nested = at + 1, False
                elif media and depth == 0:
                    media, selector_from = False, at + 1
            elif char == ";" and depth == top:  # after a statement: `@import url(x);`
                selector_from = at + 1

    def _rule(self, selectors: str, body: str) -> None:
        shown = _display(body)
        if shown is None:
            return
        for selector in _css_plain(selectors, keep_blanks=True).split(","):
            simple = _SIMPLE_SELECTOR.fullmatch(selector.strip())
            if simple is None:
                continue
            key = (simple[1] or "", simple[2], simple[3])
            if shown:
                self.hidden.discard(key)
            else:
                self.hidden.add(key)

    def hides(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        """Whether an element is hidden: by an inline style, else by `hidden` or a rule for
        its class or id (an inline display:block shows it whatever they say)."""
        inline = None
        hidden = False
        for name, value in attrs:
            if name == "style" and value:
                inline = _display(value)
            elif name == "hidden":
                hidden = True
            elif name in ("class", "id") and value and self.hidden:
                names = _HTML_SPACE.split(value.strip()) if name == "class" else [value]
                kind = "." if name == "class" else "#"
                hidden = hidden or any(
                    (scope, kind, each.lower()) in self.hidden
                    for each in names
                    for scope in ("", tag)
                )
        return not inline if inline is not None else hidden


_HTML_CHUNK = 64 * 1024


def html_to_text(html: str, *, max_chars: int | None = None) -> str:
    """HTML as text. With `max_chars`, conversion stops once that much text was found (the
    rest would be cut anyway; converting takes ~0.6 s a MB)."""
    parser = _HTMLText()
    for start in range(0, len(html), _HTML_CHUNK):
        parser.feed(html[start : start + _HTML_CHUNK])
        if max_chars is not None and parser.chars >= max_chars:
            break
    parser.close()
    text = "".join(parser.parts)
    lines = [re.sub(r"[ \t\xa0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


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
    for line in text.splitlines():
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


def _unquoted(line: str) -> str:
    """A quoted line one level less quoted: its first '>' and one blank after it gone."""
    rest = line.lstrip()[1:]
    return rest[1:] if rest.startswith(" ") else rest


def automated_reason(message: Message, sender: str) -> str | None:
    auto = str(message.get("Auto-Submitted", "no")).strip().lower()
    if auto and auto != "no":
        return f"Auto-Submitted: {auto}"
    precedence = str(message.get("Precedence", "")).strip().lower()
    if precedence in ("bulk", "junk", "list", "auto_reply"):
        return f"Precedence: {precedence}"
    if message.get("X-Autoreply") or message.get("X-Autorespond"):
        return "auto-reply header"
    if message.get("List-Id") or message.get("List-Unsubscribe"):
        # A mailing list's copy (of the owner's own post, say): answering it answers the
        # list (a walkthrough: an allowed sender's list mail was answered).
        return "mailing list (List-Id)"
    subject = str(message.get("Subject", "")).strip().lower()
    if message.get("X-Auto-Response-Suppress") and subject.startswith(
        (
            "automatic reply:",
            "auto reply:",
            "out of office",
            "automatische antwort:",
            "réponse automatique",
            "automatisch antwoord:",
            "respuesta automática:",
            "risposta automatica:",
        )
    ):
        return "auto-reply (Exchange)"  # its out-of-office notes carry no Auto-Submitted
    if str(message.get("Return-Path", "")).strip() == "<>":
        return "bounce (empty Return-Path)"
    local = sender.split("@")[0]
    if local in ("mailer-daemon", "postmaster", "noreply", "no-reply"):
        return f"sent by {local}"
    if message.get_content_type() == "multipart/report":
        return "delivery report"
    return None


# -- who sent it --------------------------------------------------------------------------------


def single_address(values: Sequence[str], header_name: str = "From") -> tuple[str, str]:
    """(address lower-cased, display name) of the one address a From (or To) header names
    (raw, unfolded values); ValueError saying why when there is not exactly one well-formed
    address of at most MAX_HEADER_BYTES.

    `email.utils.parseaddr` reads `user@example.com)<attacker@evil.example>` and
    `<user@example.com>attacker@evil.example` as user@example.com (CVE-2023-27043): the
    allowlist must not rely on it. policy.default's header parser records such input as
    defects. Obsolete syntax (RFC 5322 section 4: `Dr. Ada <ada@example.com>`, a route) is
    unambiguous, and receivers must accept it, so only that kind of defect is tolerated.
    """
    if not values:
        raise ValueError(f"no {header_name} header")
    if len(values) > 1:
        raise ValueError(f"{len(values)} {header_name} headers")
    raw = str(values[0])
    shown = raw if len(raw) <= _PREVIEW_CHARS else f"{raw[:_PREVIEW_CHARS]}..."
    what = f"{header_name} {shown!r}"
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(
            f"{what} is {len(raw)} characters long, over the limit of {MAX_HEADER_BYTES}"
        )
    try:
        header = _header_factory(header_name, raw)
    except RecursionError:  # comments nested a thousand deep: no address is written so
        raise ValueError(f"{what} is malformed (nested too deeply)") from None
    defects = [d for d in header.defects if not isinstance(d, email.errors.ObsoleteHeaderDefect)]
    if defects:
        raise ValueError(f"{what} is malformed ({'; '.join(map(str, defects))})")
    if len(header.addresses) != 1:
        raise ValueError(f"{what} names {len(header.addresses)} addresses, not one")
    if len(header.groups) != 1 or header.groups[0].display_name is not None:
        raise ValueError(f"{what} uses group syntax")
    address = header.addresses[0]
    if not address.username or not address.domain:
        raise ValueError(f"{what} is not a complete address")
    if "=?" in raw and _encoded_word_in_address(raw):
        raise ValueError(
            f"{what} has an RFC 2047 encoded-word inside the address (only a display name "
            "may be encoded)"
        )
    if _written_addr_spec(raw) != address.addr_spec:
        raise ValueError(
            f"{what} does not spell out its address {address.addr_spec!r} as it is (comments, "
            "spaces, quotes or encoding inside the address)"
        )
    if ":" in address.addr_spec or "/" in address.domain:
        # A quoted `"a:b"@x.com` read as person `"a` in a conversation id (`email:<address>:
        # <thread>`), the same as `"a:c"@y.com`; no domain holds a `/`.
        raise ValueError(
            f"{what} has a ':' in its address or a '/' in its domain, which no mailbox we "
            "answer may have"
        )
    return address.addr_spec.lower(), address.display_name


def _encoded_word_in_address(raw: str) -> bool:
    """Whether an RFC 2047 encoded-word stands in the addr-spec of `raw` (an address header).

    RFC 2047 section 5 forbids one there, yet the stdlib decodes it: `user@=?utf-8?b?
    ZXhhbXBsZS5jb20=?=` reads as user@example.com. The sender's DMARC check saw the undecoded
    domain, which has no policy (so nothing failed); our allowlist would see example.com. A
    display name may be encoded (it is only shown); a comment's text is never decoded.
    Walked with a stack: comments may nest a thousand deep."""
    tree, _ = header_syntax.get_address_list(raw)
    stack: list[tuple[header_syntax.TokenList, bool]] = [(tree, False)]
    while stack:
        tokens, in_address = stack.pop()
        for token in tokens:
            inside = in_address or token.token_type == "addr-spec"
            if inside and token.token_type == "encoded-word":
                return True
            if isinstance(token, header_syntax.TokenList) and token.token_type != "comment":
                stack.append((token, inside))
    return False


# A comment (without nested ones) at the start or the end of an addr-spec's text.
_EDGE_COMMENT = re.compile(r"^\((?:[^()\\]|\\.)*\)|\((?:[^()\\]|\\.)*\)$")


def _written_addr_spec(raw: str) -> str | None:
    """The addr-spec as `raw` writes it (the first one; `single_address` has made sure there
    is one), comments and spaces included, or None.

    It must read exactly as the address the parser decodes: `x (ada@example.com)
    <ada@example.(evil.com)com>` decodes to ada@example.com, and a search of the whole header
    would find that text in the comment; an MTA's DMARC check may read the address otherwise.
    Walked with a stack, as comments may nest deeply."""
    tree, _ = header_syntax.get_address_list(raw)
    stack: list[header_syntax.TokenList] = [tree]
    while stack:
        tokens = stack.pop()
        for token in tokens:
            if token.token_type == "addr-spec":
                # A comment before or after the address is fine (`ada@example.com (Ada)`,
                # old-style); inside it, not.
                written = str(token).strip()
                while (trimmed := _EDGE_COMMENT.sub("", written).strip()) != written:
                    written = trimmed
                return written
        stack.extend(
            reversed(
                [
                    t
                    for t in tokens
                    if isinstance(t, header_syntax.TokenList) and t.token_type != "comment"
                ]
            )
        )
    return None


_header_factory = email.policy.default.header_factory


def dmarc_refusal(results: Sequence[str], authserv_id: str, from_domain: str) -> str | None:
    """None when our own MTA (`authserv_id`) says dmarc=pass for the From domain; else why not.

    Anyone can write an Authentication-Results header, so only those of our authserv-id count,
    and the topmost with a DMARC result decides: a receiving MTA adds its own above what the
    mail arrived with (and RFC 8601 section 5 has it delete forged ones of its id). A header
    that does not parse cannot be attributed to anyone and is skipped.
    """
    import authres

    for value in results:
        try:
            header = authres.AuthenticationResultsHeader.parse_value(value)
        except (authres.AuthResError, RecursionError):  # nested comments recurse in authres
            continue
        if (header.authserv_id or "").lower() != authserv_id.lower():
            continue
        dmarc = next((r for r in header.results if r.method.lower() == "dmarc"), None)
        if dmarc is None:
            continue
        if dmarc.result.lower() != "pass":
            return f"DMARC {dmarc.result} according to {authserv_id}"
        header_from = [p.value for p in dmarc.properties if (p.type, p.name) == ("header", "from")]
        if header_from and header_from[0].lower() != from_domain.lower():
            return f"DMARC passed for {header_from[0]!r}, not for the From domain {from_domain}"
        return None
    return f"no DMARC result from {authserv_id} (Authentication-Results)"


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
_HEADER_PAIR = re.compile(rf"^{_HEADER_LINE}\n{_HEADER_LINE}", re.MULTILINE)


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
    if len(above) > MAX_OWN_LINES_CHARS or _HEADER_PAIR.search(above):
        at = 0
    return name or "someone else", at


def forwarded_author(subject: str, text: str) -> str | None:
    """`forwarded_part`'s author alone."""
    found = forwarded_part(subject, text)
    return found[0] if found is not None else None


def sender_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or address == entry or (entry.startswith("@") and address.endswith(entry)):
            return True
    return False


# -- what we write ------------------------------------------------------------------------------

# Every character str.splitlines() breaks at: the email package refuses a header holding one
# (our reply would be lost), and were it not, a CR or LF would start a header of the sender's
# choosing.
_BREAKS = "\x00-\x1f\x7f\x85\u2028\u2029"
_SPACE_RUN = re.compile(rf"[\s{_BREAKS}]+")
_BREAK = re.compile(rf"[{_BREAKS}]")


def one_line(value: str) -> str:
    """Header text as one line: a run of white space holding a line break (or any control
    character) becomes one space. In linear time: each run is matched once."""
    return _SPACE_RUN.sub(lambda m: " " if _BREAK.search(m.group()) else m.group(), value).strip()


def reply_subject(subject: str | None) -> str:
    """ "Re: " and the subject, unless it says it is a reply already (Re:, AW:, SV:...): an
    Outlook German thread grew "Re: AW: Re: AW:" (a walkthrough)."""
    subject = one_line(subject or "")
    return subject if REPLY_SUBJECT.match(subject) else f"Re: {subject}".strip()
