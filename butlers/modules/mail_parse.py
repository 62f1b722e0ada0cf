"""Reading a mail: its text, who sent it (and whether to believe it), and what we may write
back in a header. Pure functions, no I/O: the email module applies them."""

from __future__ import annotations

import email
import email.errors
import email.policy
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from email.message import EmailMessage
from html.parser import HTMLParser
from typing import Any

MAX_TEXT_CHARS = 100_000


# -- parsing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedMail:
    message_id: str
    sender: str  # the one From address, lower-cased ("" when refused)
    sender_name: str
    subject: str
    text: str
    attachments: list[str] = field(default_factory=list)
    references: str = ""
    automated: str | None = None  # why this mail must not be answered, if it must not
    refused: str | None = None  # why its sender cannot be trusted (From), if it cannot
    authentication_results: tuple[str, ...] = ()  # Authentication-Results, topmost first


class _HTMLText(HTMLParser):
    """HTML-only mail as readable text: block elements become line breaks."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "table", "blockquote"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _HTMLText()
    parser.feed(html)
    text = "".join(parser.parts)
    lines = [re.sub(r"[ \t\xa0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


_QUOTE_HEADER = re.compile(r"^(On .+ wrote:|-----Original Message-----|Le .+ a écrit :)\s*$")


def trim_quoted(text: str) -> str:
    """Drop the quoted history of a reply: '>' lines and everything after 'On ... wrote:'."""
    kept = []
    for line in text.splitlines():
        if _QUOTE_HEADER.match(line.strip()):
            break
        if line.lstrip().startswith(">"):
            continue
        kept.append(line)
    return "\n".join(kept).strip()


def automated_reason(message: EmailMessage, sender: str) -> str | None:
    auto = str(message.get("Auto-Submitted", "no")).strip().lower()
    if auto and auto != "no":
        return f"Auto-Submitted: {auto}"
    precedence = str(message.get("Precedence", "")).strip().lower()
    if precedence in ("bulk", "junk", "list", "auto_reply"):
        return f"Precedence: {precedence}"
    if message.get("X-Autoreply") or message.get("X-Autorespond"):
        return "auto-reply header"
    if str(message.get("Return-Path", "")).strip() == "<>":
        return "bounce (empty Return-Path)"
    local = sender.split("@")[0]
    if local in ("mailer-daemon", "postmaster", "noreply", "no-reply"):
        return f"sent by {local}"
    if message.get_content_type() == "multipart/report":
        return "delivery report"
    return None


def parse_mail(raw: bytes) -> ParsedMail:
    """Parse with the stdlib (policy.default): text/plain preferred, HTML converted, any
    charset, attachments listed by name, quoted history trimmed."""
    message = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    try:
        address, name = single_address(message.get_all("From") or [])
        refused = None
    except ValueError as exc:
        address, name, refused = "", "", str(exc)
    body = message.get_body(preferencelist=("plain", "html"))
    text = ""
    if body is not None:
        try:
            content = body.get_content()
        except (LookupError, UnicodeDecodeError):  # an unknown or lying charset
            content = (body.get_payload(decode=True) or b"").decode("latin-1")
        text = html_to_text(content) if body.get_content_type() == "text/html" else content
    attachments = [part.get_filename() or "(unnamed)" for part in message.iter_attachments()]
    text = trim_quoted(text)[:MAX_TEXT_CHARS]
    if attachments:
        text += f"\n\n[attachments not read: {', '.join(attachments)}]"
    message_id = str(message.get("Message-ID", "")).strip()
    references = " ".join(filter(None, [str(message.get("References", "")).strip(), message_id]))
    return ParsedMail(
        message_id=message_id,
        sender=address,
        sender_name=name,
        subject=str(message.get("Subject", "")).strip(),
        text=text,
        attachments=attachments,
        references=references,
        automated=automated_reason(message, address),
        refused=refused,
        authentication_results=tuple(
            str(value) for value in message.get_all("Authentication-Results") or []
        ),
    )


# -- who sent it --------------------------------------------------------------------------------


def single_address(values: Sequence[object], header_name: str = "From") -> tuple[str, str]:
    """(address lower-cased, display name) of the one address a From (or To) header names;
    ValueError saying why when there is not exactly one well-formed address.

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
    raw = values[0]
    what = f"{header_name} {str(raw)[:200]!r}"
    header = raw if hasattr(raw, "addresses") else _header_factory(header_name, str(raw))
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
    return address.addr_spec.lower(), address.display_name


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
        except authres.AuthResError:
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


def sender_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or address == entry or (entry.startswith("@") and address.endswith(entry)):
            return True
    return False


# -- what we write ------------------------------------------------------------------------------


def one_line(value: str) -> str:
    """Header text as one line: a CR or LF in a header we write is refused by the email package
    (the reply would be lost) and, were it not, would start a header of the sender's choosing."""
    return re.sub(r"\s*[\x00-\x1f\x7f]+\s*", " ", value).strip()


def reply_subject(subject: str | None) -> str:
    subject = one_line(subject or "")
    return subject if subject.lower().startswith("re:") else f"Re: {subject}".strip()
