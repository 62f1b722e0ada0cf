"""Reading a mail: its envelope (from the header alone), its text, and what we may write back
in a header. Pure functions, no I/O: the email module runs them in a worker thread. Beside
it: mail_limits (every bound), mail_sender (who sent it, whether to answer), mail_html (HTML
as its reader sees it), mail_quotes (whose words the text holds).

Whatever a sender writes, reading it costs bounded time and memory. The stdlib's parser does
not promise that, so the limits (mail_limits) are checked before it is asked:

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
text file only when the sender also called it text, or sent it as a calendar invite:
signatures, keys and other printable data sent as application/* are not the sender's words)
is kept for the message (`files`); the others are listed by name in the text, as not read.
The channel's own limits (bytes a file, files a message) are applied by `within_limits`,
which says in the text what they refused.

A mail attached to a mail (message/rfc822: "Forward as attachment" in Gmail, Outlook and
Thunderbird) is read as a forward written inline would be: its sender, date, subject and text
follow the sender's own lines under a "Forwarded message" line, said to be someone else's
words (`ParsedMail.forwarded`), and its files are read like the mail's own. A mail attached to
that one is listed as not read, and so is an attached mail the mail cannot be read with (too
many parts, nested too deeply: `_parsed`).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import email.utils
import itertools
import quopri
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC
from email.message import EmailMessage, Message, MIMEPart
from email.parser import BytesHeaderParser, BytesParser
from email.policy import EmailPolicy, compat32
from typing import Any
from urllib.parse import unquote

from butlers.errors import AttachmentRefused, HeaderTooLong, MailUnreadable
from butlers.media import Attachment, check_count, checked, kind_or_none, sniff
from butlers.modules.mail_html import html_to_text
from butlers.modules.mail_limits import (
    DECORATION_MAX_BYTES,
    MAX_ATTACHED_MAILS,
    MAX_ATTACHMENT_NAME_CHARS,
    MAX_ATTACHMENTS_LISTED,
    MAX_AUTHOR_CHARS,
    MAX_HEADER_BLOCK_BYTES,
    MAX_HEADER_BYTES,
    MAX_HTML_CHARS,
    MAX_MAIL_BYTES,
    MAX_MIME_PARTS,
    MAX_REFERENCES,
    MAX_TEXT_CHARS,
    PREVIEW_CHARS,
)
from butlers.modules.mail_quotes import (
    FORWARDED_SUBJECT,
    HEADER_PAIR,
    MAX_OWN_LINES_CHARS,
    REPLY_SUBJECT,
    answer_below_quote,
    forwarded_part,
    is_reply,
    trim_quoted,
)
from butlers.modules.mail_sender import automated_reason, single_address
from butlers.text import printable, within_limit

MAIL_TYPES = frozenset({"message/rfc822", "message/global"})  # a mail attached (RFC 6532)
# The line an attached mail's text follows: one FORWARDED_BLOCK matches (Gmail's own).
ATTACHED_MAIL_LINE = "---------- Forwarded message ---------"
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
    # When its sender's program says it was written (Date, ISO 8601), if it says so readably.
    sent_at: str | None = None


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
    """At most MAX_TEXT_CHARS of a mail's text, saying so when cut (butlers.text)."""
    return within_limit(text, MAX_TEXT_CHARS)


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
        message = _parsed(raw, parts)
        mail = _read_headers(message)
        if mail.unreadable:
            raise MailUnreadable(mail.unreadable)
        reply = is_reply(mail.subject, mail.references, mail.message_id)
        text = trim_quoted(_text_of(message), reply=reply)
        if not text and reply and (plain := _plain_of(message)):
            text = answer_below_quote(plain)  # a reply written below its quote
        read = _Attachments()
        for part in _files_of(message, _own_attachments(message)):
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


# The Content-Type line of a mail attached to a mail (MAIL_TYPES), as written.
_ATTACHED_MAIL_TYPE = re.compile(rb"^(content-type:[ \t]*)message/(?:rfc822|global)", re.I | re.M)
# What such a part is read as when the mail cannot be read with it (`_parsed`).
UNREAD_MAIL_TYPE = b"application/x-attached-mail"


def _parsed(raw: bytes, parts: _PartCounter) -> EmailMessage:
    """The mail's parts. The parser reads an attached mail's parts as it reads the mail's
    own: too many of them, or nested too deeply (a stranger's, or a newsletter's, forwarded
    as an attachment), made the sender's own words unreadable. Then the mail is read again
    with its attached mails as files it does not read (listed as not read)."""
    try:
        message = BytesParser(_class=parts, policy=READING).parsebytes(raw)
    except (MailUnreadable, RecursionError):
        opaque = _ATTACHED_MAIL_TYPE.sub(rb"\1" + UNREAD_MAIL_TYPE, raw)
        if opaque == raw:
            raise
        message = BytesParser(_class=_PartCounter(), policy=READING).parsebytes(opaque)
    assert isinstance(message, EmailMessage)
    return message


def _text_of(message: Message, max_html_chars: int | None = None, *, html: bool = False) -> str:
    """A mail's own text: text/plain preferred (`html`: the HTML, what a mail program
    shows), HTML converted (at most `max_html_chars`, else MAX_HTML_CHARS)."""
    assert isinstance(message, EmailMessage)
    body = message.get_body(preferencelist=("html", "plain") if html else ("plain", "html"))
    return _body_text(body, max_html_chars) if body is not None else ""


def _plain_of(message: Message) -> str:
    """A mail's text/plain body, "" when it has none (its quotes are marked; HTML's not)."""
    assert isinstance(message, EmailMessage)
    body = message.get_body(preferencelist=("plain",))
    return _body_text(body) if body is not None else ""


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


def _files_of(message: EmailMessage, attachments: Iterable[MIMEPart]) -> list[MIMEPart]:
    """A mail's files: its `attachments`, then the pictures its HTML shows among its words
    (`_shown_parts`), each once, without its decoration (`_decoration`)."""
    shown = _shown_ids(message)
    files: list[MIMEPart] = []
    seen: set[int] = set()
    for part in itertools.chain(attachments, _shown_parts(message)):
        if id(part) not in seen and not _decoration(part, shown):
            seen.add(id(part))
            files.append(part)
    return files


def _shown_parts(message: MIMEPart) -> Iterator[MIMEPart]:
    """What a multipart/related holding the mail's text shows within it (a photo pasted among
    the words, a signature's logo: Outlook's and Apple Mail's way), which iter_attachments
    leaves with the text: a photo pasted into an Outlook mail was never read. Not looking
    inside attached mails (`_mail_parts`) or attachments."""
    for part in message.iter_parts() if message.get_content_maintype() == "multipart" else ():
        if part.get_content_maintype() != "multipart" or part.is_attachment():
            continue
        if part.get_content_type() == "multipart/related":
            # All but its root: what the root shows; not a mail attached there (Apple Mail's
            # rich text), which `_mail_parts` reads as a forward (it counted twice: a review).
            yield from (
                p for p in part.iter_attachments() if p.get_content_type() not in MAIL_TYPES
            )
        yield from _shown_parts(part)


# The Content-IDs an HTML text shows (`<img src="cid:...">`), as RFC 2392 writes them.
_CID = re.compile(r"""cid:([^\s"'<>()]{1,250})""", re.IGNORECASE)


def _shown_ids(message: EmailMessage) -> frozenset[str]:
    """The Content-IDs the mail's HTML text shows (ASCII: read from its first MAX_HTML_CHARS
    bytes, whatever its charset)."""
    html = message.get_body(preferencelist=("html",))
    payload = html.get_payload(decode=True) if html is not None else None
    if not isinstance(payload, bytes):
        return frozenset()
    return frozenset(
        unquote(m).lower() for m in _CID.findall(payload[:MAX_HTML_CHARS].decode("latin-1"))
    )


def _decoration(part: MIMEPart, shown: frozenset[str]) -> bool:
    """Whether `part` is a picture the HTML shows and at most DECORATION_MAX_BYTES: a
    signature's logo, a social icon, not the sender's file."""
    if part.get_content_maintype() != "image":
        return False
    content_id = str(part.get("Content-ID", "")).strip().removeprefix("<").removesuffix(">")
    if not content_id or content_id.lower() not in shown:
        return False
    payload = part.get_payload(decode=True)
    return isinstance(payload, bytes) and len(payload) <= DECORATION_MAX_BYTES


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
        # (Its attached mails too, listed as not read.)
        files = tuple(_files_of(inner, inner.iter_attachments()))
        return _forward_block(inner, files)
    except Exception:  # MailUnreadable, RecursionError, the stdlib's own on hostile input
        return None


def _attached_mail(part: MIMEPart, parts: _PartCounter) -> EmailMessage | None:
    """The mail attached as `part` (message/rfc822), or None. Outlook and some webmails send
    it base64-encoded, which RFC 2046 does not allow (RFC 6532 does, for message/global, and
    quoted-printable too) and the stdlib's parser reads as a header-less mail of encoded
    text: decoded and parsed again, its parts counted with the rest."""
    payload = part.get_payload()
    inner = payload[0] if isinstance(payload, list) and payload else None
    if not isinstance(inner, EmailMessage):
        return None
    encoding = str(part.get("Content-Transfer-Encoding", "")).strip().lower()
    if encoding in ("base64", "quoted-printable"):
        data = _decoded(inner, encoding)
        if data is None:
            return None
        inner = BytesParser(_class=parts, policy=READING).parsebytes(data)
        assert isinstance(inner, EmailMessage)
    return inner if list(inner.keys()) else None


# A mail written back as it was read: no header folded anew (compat32's folding of a 50 KB
# line of words took 9.5 s, quadratic in its words: a review), none parsed (the raw values),
# every line as long as it came.
_WRITTEN_AS_READ = EmailPolicy(refold_source="none", max_line_length=None, linesep="\n")


def _decoded(inner: EmailMessage, encoding: str) -> bytes | None:
    """The bytes of an attached mail sent in `encoding`, which the parser took for a
    header-less mail of that text (a quoted-printable one's first lines may have parsed as
    headers: they are put back), or None."""
    if encoding == "base64":
        written = inner.get_payload()  # base64 has no header-like line: all of it is here
        if not isinstance(written, str):
            return None
        try:
            return base64.b64decode(written.encode("ascii", "replace"))
        except (ValueError, binascii.Error):
            return None
    # Written back as it came: no header folded anew, and no blank line where the parser
    # found none. A soft line break (a line's last "=") in a header ends what the parser
    # reads as the header block; the line written after it is the generator's own (a real
    # separator after a soft break would be no separator once decoded).
    text = inner.as_string(policy=_WRITTEN_AS_READ)
    head, _, body = text.partition("\n\n")
    if head.endswith("="):
        text = f"{head}\n{body}"
    return quopri.decodestring(text.encode("ascii", "replace"))


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
    theirs = bool(own) and len(own) <= MAX_OWN_LINES_CHARS and not HEADER_PAIR.search(own)
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
        return printable((_raw(message, header) or [""])[0][:PREVIEW_CHARS], 300)


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
    if kind == "text" and not _sent_as_text(part):
        return None
    return Attachment(name, mime_type, payload)


# Text the sender's mail program sends under an application/* type: a calendar invite
# (Gmail, Apple Mail and Outlook attach "invite.ics" as application/ics), which says when,
# where and who in fields a butler reads; a signature or a key says nothing of the kind.
_TEXT_SENT_AS_APPLICATION = frozenset({"application/ics"})


def _sent_as_text(part: MIMEPart) -> bool:
    return (
        part.get_content_maintype() == "text"
        or part.get_content_type() in _TEXT_SENT_AS_APPLICATION
    )


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
        return _printable((raw(name) or [""])[0][:PREVIEW_CHARS])

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
        sent_at=_sent_at((raw("Date") or [""])[0]),
        unreadable="; ".join(problems) or None,
    )


def _sent_at(date: str) -> str | None:
    """A Date header as ISO 8601 (a zone of -0000, "unknown", read as UTC), or None."""
    if not date or len(date) > MAX_HEADER_BYTES:
        return None
    try:
        written = email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return (written if written.tzinfo else written.replace(tzinfo=UTC)).isoformat()


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
    return f"{type(exc).__name__}: {exc}"[:PREVIEW_CHARS]


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


@dataclass(frozen=True)
class MailThread:
    """A mail an answer is to land in the thread of: the owner's answer to a question (an
    approval, a pairing), which is told what it did."""

    subject: str
    message_id: str
    references: str


def reply_subject(subject: str | None) -> str:
    """ "Re: " and the subject, unless it says it is a reply already (Re:, AW:, SV:...): an
    Outlook German thread grew "Re: AW: Re: AW:" (a walkthrough)."""
    subject = one_line(subject or "")
    return subject if REPLY_SUBJECT.match(subject) else f"Re: {subject}".strip()
