"""Who sent a mail, and whether to answer it: the one From address, read strictly (the
allowlist must not read a crafted header the way a lenient parser does), our own MTA's DMARC
verdict, the allowlist, and the marks of a mail no person wrote (auto-replies, bounces,
mailing lists), which must never be answered."""

from __future__ import annotations

import email._header_value_parser as header_syntax
import email.errors
import email.policy
import re
from collections.abc import Sequence
from email.message import Message

from butlers.modules.mail_limits import MAX_HEADER_BYTES, PREVIEW_CHARS


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
    shown = raw if len(raw) <= PREVIEW_CHARS else f"{raw[:PREVIEW_CHARS]}..."
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


def sender_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or address == entry or (entry.startswith("@") and address.endswith(entry)):
            return True
    return False


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
