"""POST /email/inbound's JSON body as a mail, by the same rules as one read over IMAP.

A mail provider (or a reverse proxy in front of us) posts {from, subject?, text | html,
message_id, headers?}. The HTTP layer caps the body at max_request_bytes (1 MiB); here each
field is checked for its type and size, and every way it can be wrong is a MailUnreadable
naming the field (a 400), never an exception of the JSON or email packages (a 500): JSON
nested a thousand deep, a From of nested comments, an integer of 5,000 digits, a lone UTF-16
surrogate. The email module runs this in a worker thread (HTML conversion is ~0.6 s a MB).
"""

from __future__ import annotations

import json
import re
from email.message import EmailMessage
from typing import Any

from butlers.modules.mail_parse import (
    MAX_HEADER_BYTES,
    MAX_HTML_CHARS,
    MAX_TEXT_CHARS,
    READING,
    MailUnreadable,
    ParsedMail,
    automated_reason,
    html_to_text,
    single_address,
    thread_references,
    trim_quoted,
)

# What automated_reason reads; the webhook's other headers are never parsed.
_AUTOMATION_HEADERS = (
    "auto-submitted",
    "precedence",
    "x-autoreply",
    "x-autorespond",
    "return-path",
)


def parse_webhook(body: bytes) -> ParsedMail:
    """The mail in a webhook body; MailUnreadable saying which field is wrong, and how."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise MailUnreadable("the body is not JSON we take: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 5,000 digits
        raise MailUnreadable(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MailUnreadable(f"the body must be a JSON object, not {_kind(data)}")
    sender = _string(data, "from", required=True, limit=MAX_HEADER_BYTES)
    try:
        address, name = single_address([sender])
    except ValueError as exc:
        raise MailUnreadable(f"'from': {exc}") from None
    headers = _headers(data.get("headers"))
    message_id = _string(data, "message_id", limit=MAX_HEADER_BYTES) or _first(
        headers, "message-id"
    )
    if not message_id:
        raise MailUnreadable("'message_id' is required (it makes a redelivery harmless)")
    text = _string(data, "text")
    if not text and (html := _string(data, "html")):
        text = html_to_text(html[:MAX_HTML_CHARS], max_chars=2 * MAX_TEXT_CHARS)
    return ParsedMail(
        message_id=message_id,
        sender=address,
        sender_name=name,
        subject=_string(data, "subject", limit=MAX_HEADER_BYTES),
        text=trim_quoted(text)[:MAX_TEXT_CHARS],
        references=thread_references(
            _first(headers, "references"), _first(headers, "in-reply-to"), message_id
        ),
        automated=_automated(headers, address),
        authentication_results=tuple(headers.get("authentication-results", [])),
    )


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else "null"
    )


def _string(data: dict[str, Any], key: str, *, required: bool = False, limit: int = 0) -> str:
    value = data.get(key)
    if value is None or value == "":
        if required:
            raise MailUnreadable(f"'{key}' is required")
        return ""
    if not isinstance(value, str):
        raise MailUnreadable(f"'{key}' must be a string, not {_kind(value)}")
    if limit and len(value) > limit:
        raise MailUnreadable(f"'{key}' is {len(value)} characters long, over the limit of {limit}")
    return _valid_unicode(value)


def _headers(given: object) -> dict[str, list[str]]:
    """`headers`: an object of strings or lists of strings; names lower-cased."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise MailUnreadable(f"'headers' must be an object, not {_kind(given)}")
    headers: dict[str, list[str]] = {}
    for key, value in given.items():
        values = value if isinstance(value, list) else [value]
        for item in values:
            if not isinstance(item, str):
                raise MailUnreadable(
                    f"'headers': {key!r} must be a string or a list of strings, not {_kind(item)}"
                )
            if len(item) > MAX_HEADER_BYTES:
                raise MailUnreadable(
                    f"'headers': {key!r} is {len(item)} characters long, "
                    f"over the limit of {MAX_HEADER_BYTES}"
                )
        headers.setdefault(key.lower(), []).extend(_valid_unicode(v) for v in values)
    return headers


def _first(headers: dict[str, list[str]], key: str) -> str:
    return headers.get(key, [""])[0]


def _automated(headers: dict[str, list[str]], address: str) -> str | None:
    """automated_reason on the headers it reads, parsed as an IMAP mail's would be."""
    message = EmailMessage(policy=READING)
    try:
        for key in _AUTOMATION_HEADERS:
            if value := _first(headers, key):
                message[key] = value
        return automated_reason(message, address)
    except RecursionError:
        raise MailUnreadable("'headers': nested too deeply") from None
    except ValueError as exc:  # a line break in a value, say
        raise MailUnreadable(f"'headers': {exc}") from None


def _valid_unicode(value: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which no database or mail can hold: each
    becomes U+FFFD, as undecodable bytes in a mail do."""
    return value if value.isascii() else _SURROGATE.sub("\ufffd", value)


_SURROGATE = re.compile("[\ud800-\udfff]")
