"""POST /email/inbound's JSON body as a mail, by the same rules as one read over IMAP.

A mail provider (or a reverse proxy in front of us) posts a `WebhookMail`: {from, subject?,
text | html, message_id, headers?} (docs/configuration.md, schemas/email-webhook.schema.json).
The HTTP layer caps the body at max_request_bytes (1 MiB); the model checks each field's type
and size, and every way the body can be wrong is a MailUnreadable naming the field (a 400),
never an exception of the JSON, pydantic or email packages (a 500): JSON nested a thousand
deep, a From of nested comments, an integer of 5,000 digits, a lone UTF-16 surrogate. The
email module runs this in a worker thread (HTML conversion is ~0.6 s a MB).
"""

from __future__ import annotations

import json
import re
from email.message import EmailMessage
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError
from pydantic_core import ErrorDetails

from butlers.errors import MailUnreadable
from butlers.modules.mail_html import html_to_text
from butlers.modules.mail_limits import (
    MAX_ATTACHMENT_NAME_CHARS,
    MAX_HEADER_BYTES,
    MAX_HTML_CHARS,
    MAX_MIME_PARTS,
    MAX_TEXT_CHARS,
)
from butlers.modules.mail_parse import (
    READING,
    ParsedMail,
    not_read_note,
    one_line,
    thread_references,
    within_text_limit,
)
from butlers.modules.mail_quotes import is_reply, trim_quoted
from butlers.modules.mail_sender import automated_reason, single_address

# What automated_reason reads; the webhook's other headers are never parsed.
_AUTOMATION_HEADERS = (
    "auto-submitted",
    "precedence",
    "x-autoreply",
    "x-autorespond",
    "return-path",
    "list-id",
    "list-unsubscribe",
    "x-auto-response-suppress",
)

Line = Annotated[str, Strict(), Field(max_length=MAX_HEADER_BYTES)]
Body = Annotated[str, Strict()]


class WebhookMail(BaseModel):
    """The JSON body of `POST /email/inbound`. Fields a provider adds beyond these are
    ignored (providers post many); `null` and `""` count as absent."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sender: Line = Field(
        alias="from",
        min_length=1,
        description="The From header: one address, with or without a display name.",
    )
    subject: Line | None = Field(default=None, description="The Subject header.")
    text: Body | None = Field(default=None, description="The plain-text body.")
    html: Body | None = Field(
        default=None, description="The HTML body, used (as text) when there is no `text`."
    )
    message_id: Line | None = Field(
        default=None,
        description="The Message-ID (else `headers`' Message-ID); required: it makes a "
        "redelivery harmless.",
    )
    headers: dict[str, Line | list[Line]] | None = Field(
        default=None,
        description="More headers, a string or a list of strings each (any case): "
        "References, In-Reply-To (threading), Auto-Submitted, Precedence... (automated "
        "mail is not answered), Authentication-Results.",
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
    given = {key: _clean(value) for key, value in data.items() if value not in ("", None)}
    try:
        mail = WebhookMail.model_validate(given)
    except ValidationError as exc:
        raise MailUnreadable(_problem(exc.errors(include_url=False)[0], given)) from None
    try:
        address, name = single_address([mail.sender])
    except ValueError as exc:
        raise MailUnreadable(f"'from': {exc}") from None
    headers: dict[str, list[str]] = {}
    for key, value in (mail.headers or {}).items():
        headers.setdefault(key.lower(), []).extend(value if isinstance(value, list) else [value])
    message_id = mail.message_id or _first(headers, "message-id")
    if not message_id:
        raise MailUnreadable("'message_id' is required (it makes a redelivery harmless)")
    text = mail.text or ""
    if not text and mail.html:
        text = html_to_text(mail.html[:MAX_HTML_CHARS], max_chars=2 * MAX_TEXT_CHARS)
    attached = _attachment_names(data)
    references = thread_references(
        _first(headers, "references"), _first(headers, "in-reply-to"), message_id
    )
    reply = is_reply(mail.subject or "", references, message_id)
    return ParsedMail(
        message_id=message_id,
        sender=address,
        sender_name=name,
        subject=mail.subject or "",
        text=(
            within_text_limit(trim_quoted(text, reply=reply))
            + not_read_note(attached, "the mail webhook takes text only")
        ).strip(),
        references=references,
        automated=_automated(headers, address, mail.subject or ""),
        authentication_results=tuple(headers.get("authentication-results", [])),
    )


def _attachment_names(data: dict[str, Any]) -> list[str]:
    """The files a provider posted with the mail (`attachments`, as most providers name
    them), by name: the webhook reads none, and the butler is told which it did not see (they
    vanished without a word). Nothing else of them is looked at."""
    posted: list[Any] = next(
        (data[key] for key in ("attachments", "Attachments") if isinstance(data.get(key), list)),
        [],
    )
    names = []
    for item in posted[:MAX_MIME_PARTS]:
        named = item if isinstance(item, dict) else {}
        name = next(
            (v for k in ("filename", "name", "Name") if isinstance(v := named.get(k), str) and v),
            "(unnamed)",
        )
        names.append(one_line(name)[:MAX_ATTACHMENT_NAME_CHARS])
    return names


def _problem(error: ErrorDetails, data: dict[str, Any]) -> str:
    """What a sender of the body can act on: the field, as the JSON spells it, and why."""
    loc, kind, given = error["loc"], error["type"], error.get("input")
    field = str(loc[0])
    if field == "headers" and len(loc) > 1:
        key, value = str(loc[1]), data["headers"][loc[1]]
        if kind == "string_too_long":
            return (
                f"'headers': {key!r} is {len(given)} characters long, "
                f"over the limit of {MAX_HEADER_BYTES}"
            )
        items = value if isinstance(value, list) else [value]
        wrong = next((v for v in items if not isinstance(v, str)), value)
        return f"'headers': {key!r} must be a string or a list of strings, not {_kind(wrong)}"
    if kind in ("missing", "string_too_short"):
        return f"'{field}' is required"
    if kind == "string_too_long":
        return f"'{field}' is {len(given)} characters long, over the limit of {MAX_HEADER_BYTES}"
    if field == "headers":
        return f"'headers' must be an object, not {_kind(given)}"
    return f"'{field}' must be a string, not {_kind(given)}"


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else "null"
    )


def _first(headers: dict[str, list[str]], key: str) -> str:
    return headers.get(key, [""])[0]


def _automated(headers: dict[str, list[str]], address: str, subject: str) -> str | None:
    """automated_reason on the headers it reads, parsed as an IMAP mail's would be."""
    message = EmailMessage(policy=READING)
    try:
        for key in _AUTOMATION_HEADERS:
            if value := _first(headers, key):
                message[key] = value
        if subject:
            message["Subject"] = one_line(subject)
        return automated_reason(message, address)
    except RecursionError:
        raise MailUnreadable("'headers': nested too deeply") from None
    except ValueError as exc:  # a line break in a value, say
        raise MailUnreadable(f"'headers': {exc}") from None


def _clean(value: Any, *, objects: bool = True) -> Any:
    """`value` with valid strings, in the shapes a field may have (a string, a list of them,
    an object of those); anything deeper is left to the model to refuse, unread."""
    if isinstance(value, str):
        return _valid_unicode(value)
    if isinstance(value, list):
        return [_valid_unicode(v) if isinstance(v, str) else v for v in value]
    if objects and isinstance(value, dict):
        return {_valid_unicode(k): _clean(v, objects=False) for k, v in value.items()}
    return value


def _valid_unicode(value: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which no database or mail can hold: each
    becomes U+FFFD, as undecodable bytes in a mail do."""
    return value if value.isascii() else _SURROGATE.sub("\ufffd", value)


_SURROGATE = re.compile("[\ud800-\udfff]")
