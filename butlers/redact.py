"""Configured secrets never leave the process in a log line, a span or a routing_log row.

Libraries log what they are given: httpx logs every request URL at INFO, and the Telegram Bot
API puts the bot token in the URL; an exception text may quote a connection string. Rather
than hunting each one down, every log record is checked against the secrets this process was
configured with (the environment variables that hold them, in `Settings.environ`), at the
moment it is created, so no handler, formatter or level ever sees the original text. Spans
go through the same Redactor on their way out (`butlers.telemetry.RedactingSpanExporter`, kept
there so that this module, which every command loads, does not import the tracing SDK).

A secret is rarely written out as it is when it holds anything but letters and digits: `%r`
escapes quotes and backslashes, `json.dumps` escapes `"` and `\\` and (by default) every
non-ASCII character as `\\uXXXX`, Jinja's `tojson` also `<>&'`, HTML `&<>"'`, a URL
percent-encodes. So each secret is looked for in every such form (`written_forms`), and in
those forms escaped once more (a JSON string holding JSON, a `%r` of a JSON text). For a
secret of letters, digits, `-`, `_` and `.` (most tokens) the forms are the secret itself:
the cost is paid only for secrets that need it.
"""

from __future__ import annotations

import html
import json
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

from butlers.text import printable

if TYPE_CHECKING:
    from butlers.config import ButlerConfig

REDACTED = "[redacted]"
MIN_SECRET_CHARS = 6  # shorter values would blank out ordinary words

# Variables that hold secrets whatever the config says, and a pattern for the rest.
SECRET_NAMES = (
    "BUTLERS_AUTH_TOKEN",
    "BUTLERS_EMAIL_WEBHOOK_TOKEN",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "CLAUDE_CODE_OAUTH_TOKEN",
)
SECRET_NAME_PATTERN = re.compile(
    r"(TOKEN|PASSWORD|PASSWD|SECRET|SECRET_ACCESS_KEY|API_KEY|PRIVATE_KEY|CREDENTIALS)$"
)
# "key=value,key2=value2" lists of headers (an OTLP collector's API key): each value.
HEADER_LIST_NAMES = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")


def _json_ascii(text: str) -> str:
    """As inside a `json.dumps` string (the default, ensure_ascii: `\\u00fc` for `ü`)."""
    return json.dumps(text)[1:-1]


def _json_utf8(text: str) -> str:
    """As inside a `json.dumps(..., ensure_ascii=False)` string (JSON log lines, responses)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _jinja_tojson(text: str) -> str:
    """As Jinja's `tojson` writes it into a page: JSON, with `<>&'` as `\\u` escapes too."""
    return (
        _json_ascii(text)
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("'", "\\u0027")
    )


def _repr_forms(text: str) -> tuple[str, ...]:
    """As inside `repr()` (`%r`, `{!r}`, a container or exception printed), `ascii()` and the
    repr of its UTF-8 bytes. Which quote repr escapes depends on the whole string the secret
    is part of, not on the secret: both ways, then. (Appending a `"` makes repr quote with
    `'` and escape each `'`; appending a `'` to a text without `"` makes it quote with `"`
    and escape none.)"""
    forms = [repr(text + '"')[1:-2], ascii(text + '"')[1:-2], repr((text + '"').encode())[2:-2]]
    if '"' not in text:
        forms += [
            repr(text + "'")[1:-2],
            ascii(text + "'")[1:-2],
            repr((text + "'").encode())[2:-2],
        ]
    return tuple(forms)


def _html_forms(text: str) -> tuple[str, ...]:
    """As HTML escapes it: markupsafe's (Jinja's autoescape: `&#39;`, `&#34;`) and the
    standard library's (`&#x27;`, `&quot;`; and without quotes)."""
    markupsafe = (
        text.replace("&", "&amp;")
        .replace(">", "&gt;")
        .replace("<", "&lt;")
        .replace("'", "&#39;")
        .replace('"', "&#34;")
    )
    return markupsafe, html.escape(text), html.escape(text, quote=False)


def _url_forms(text: str) -> tuple[str, ...]:
    """As a URL carries it: percent-encoded in a path or query (`+` or `%20` for a space)."""
    return quote(text, safe=""), quote(text), quote_plus(text), quote_plus(text, safe="/")


# Escapings applied to each form once more: what a value passes through twice (a JSON text
# inside JSON, a JSON or HTML text printed with %r).
_NESTING: tuple[Callable[[str], Iterable[str]], ...] = (
    lambda text: (_json_ascii(text), _json_utf8(text)),
    _repr_forms,
)


def written_forms(secret: str) -> frozenset[str]:
    """Every way `secret` may appear in a text that went through escaping: itself, as JSON
    (with and without ensure_ascii; Jinja's `tojson`), as repr/ascii, HTML-escaped and
    URL-encoded, and each of those through JSON or repr once more."""
    forms = {
        secret,
        _json_ascii(secret),
        _json_utf8(secret),
        _jinja_tojson(secret),
        *_repr_forms(secret),
        *_html_forms(secret),
        *_url_forms(secret),
    }
    for form in list(forms):
        for escape in _NESTING:
            forms.update(escape(form))
    return frozenset(forms)


def _trie_pattern(words: Iterable[str]) -> str:
    """One regular expression matching any of `words`, longest first where one is a prefix of
    another, written as a trie (`p(?:&amp;ss|%26ss|...)`): at each place in a text the regex
    engine follows one branch per character instead of trying every word, so the cost stays
    near that of one search however many forms the secrets have. Iterative along runs of
    single children: a long secret (a private key) must not hit Python's recursion limit.
    Greedy: where a form ends inside a longer one, the longer one is tried first."""
    root: dict[str, Any] = {}
    for word in words:
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        parts: list[str] = []
        while True:
            ends = "" in node
            children = [(c, child) for c, child in node.items() if c != ""]
            if not children:
                return "".join(parts)
            if len(children) == 1 and not ends:
                char, node = children[0]
                parts.append(re.escape(char))
                continue
            branches = "|".join(re.escape(c) + build(child) for c, child in sorted(children))
            parts.append(f"(?:{branches}){'?' if ends else ''}")
            return "".join(parts)

    return build(root)


class Redactor:
    """Replaces each known secret, in any of its written forms, with `[redacted]`.

    Up to `LOOP_MAX_FORMS` forms (plain tokens: one form each, two with a `:`) it tests each
    with `in`, the fastest way for a few; past that (a password with quotes, `&`, `<`,
    non-ASCII: ~40 forms) one trie-shaped regular expression finds any of them. Measured on a
    177-character log line without a secret: 5 plain tokens (8 forms), 0.37-0.54 µs with the
    loop, 0.72 µs with the regex; with such a password too (50 forms), 0.75-0.9 µs with the
    regex, 2 µs with the loop.
    """

    LOOP_MAX_FORMS = 16

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets: tuple[str, ...] = ()
        # (forms for the loop, or the regex): one attribute, replaced whole by add(), so a
        # record logged by another thread meanwhile sees the old matcher or the new one.
        self._matcher: tuple[tuple[str, ...], re.Pattern[str] | None] = ((), None)
        self._forms: tuple[str, ...] = ()  # every form, longest first (for `clipped`)
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """More secrets (e.g. those the butler.toml files name, once they are loaded)."""
        known = {*self.secrets, *(s for s in secrets if len(s) >= MIN_SECRET_CHARS)}
        # Longest first, so that a form containing another (a secret containing another, an
        # escaped form containing the plain one) is replaced whole.
        forms = sorted(
            {f for secret in known for f in written_forms(secret)}, key=len, reverse=True
        )
        if len(forms) > self.LOOP_MAX_FORMS:
            self._matcher = ((), re.compile(_trie_pattern(forms)))
        else:
            self._matcher = (tuple(forms), None)
        self._forms = tuple(forms)
        self.secrets = tuple(sorted(known, key=len, reverse=True))

    def __call__(self, text: str) -> str:
        """`text` without any secret. Returned as it came (the same object) when it holds
        none; a `Markup` (a Jinja filter's HTML-safe output, `tojson`) stays Markup, or
        autoescape would escape that output a second time: `[redacted]` in place of a secret
        adds no markup. It is searched as plain text, so that no Markup method is involved
        (markupsafe 2's `replace` HTML-escaped what it looked for)."""
        forms, pattern = self._matcher
        plain = text if type(text) is str else str.__str__(text)
        redacted = plain
        if pattern is not None:
            if pattern.search(plain) is not None:
                redacted = pattern.sub(REDACTED, plain)
        else:
            for form in forms:
                if form in redacted:
                    redacted = redacted.replace(form, REDACTED)
        if redacted is plain:
            return text
        if hasattr(text, "__html__"):
            return type(text)(redacted)
        return redacted

    # The shortest beginning of a secret `clipped` takes for one: shorter, and the ends of
    # ordinary texts would be taken for secrets; a few characters of one give nothing away.
    CLIPPED_MIN_CHARS = 6

    def clipped(self, text: str) -> str:
        """`text` without any secret, nor the beginning of one at its very end: what a text
        cut at a length (a span's status, at 200 characters, before the exporter sees it)
        shows of a secret that straddled the cut. A scan per form: for span texts at export,
        not for every log record."""
        redacted = self(text)
        for form in self._forms:
            for size in range(len(form) - 1, self.CLIPPED_MIN_CHARS - 1, -1):
                if redacted.endswith(form[:size]):
                    return redacted[:-size] + REDACTED
        return redacted

    def __bool__(self) -> bool:
        return bool(self.secrets)

    @classmethod
    def from_environment(
        cls, configs: Iterable[ButlerConfig] = (), *, environ: Mapping[str, str]
    ) -> Redactor:
        """The secrets in `environ` (`Settings.environ`): the variables butler.toml names for
        tokens and passwords (a tool server's `pass_env` and `headers_env` too: a header's value
        with and without its scheme), the well-known ones, any
        *_TOKEN/*_PASSWORD/*_SECRET/*_API_KEY, and the password in DATABASE_URL."""
        from butlers.channels import spec_of

        names = set(SECRET_NAMES)
        headers: set[str] = set()  # whole header values ("Bearer <token>")
        for config in configs:
            for channel, table in config.channels.items():  # each channel names its own
                spec = spec_of(channel)
                if spec is not None:
                    names |= set(spec.secret_variables(table))
            if config.switchboard is not None:  # the speech-to-text service's key
                names.add(config.switchboard.transcription.api_key_env)
            for server in config.mcp_servers:  # what its tool servers take from us
                names |= set(server.pass_env)
                headers |= set(server.headers_env.values())
        names |= {name for name in environ if SECRET_NAME_PATTERN.search(name)}
        values = [environ[name] for name in names | headers if environ.get(name)]
        # A header's credential also without its scheme (what a server may echo).
        values += [environ[name].partition(" ")[2] for name in headers if environ.get(name)]
        for name in HEADER_LIST_NAMES:
            for pair in (environ.get(name) or "").split(","):
                values.append(pair.partition("=")[2].strip())
        database_url = environ.get("DATABASE_URL")
        if database_url:
            try:
                password = urlsplit(database_url).password
            except ValueError:
                password = None
            if password:  # as the URL writes it (percent-encoded), and as it is
                values += [password, unquote(password)]
        return cls(values)


_TOOL_ERROR_CHARS = 300


def _with_the_tool_error(
    record: logging.LogRecord, message: str, redact: Callable[[str], str]
) -> str:
    """FastMCP logs a tool call that raised a tool error as "Error calling tool 'route'",
    without the error (no exc_info): `butlers up` printed a warning that said nothing of why.
    It logs it inside its `except`, so the error in hand is that one: added here, redacted
    whole before it is cut (a cut secret is no longer recognised) and made printable (an
    error may carry a stranger's text: a line break would forge a log line)."""
    if record.name != "fastmcp.server.server" or not message.startswith("Error calling tool"):
        return message
    error = sys.exc_info()[1]
    if error is None or record.exc_info or str(error) in message:
        return message
    return f"{message}: {printable(redact(str(error)), _TOOL_ERROR_CHARS)}"


def install_log_redaction(redactor: Redactor) -> None:
    """Redact every log record of this process as it is created (process-wide, like logging),
    and route `warnings` through logging so that they are redacted too.

    The message is formatted here, once, and an exception's traceback too (as text: handlers
    then print that text instead of formatting the exception again from its objects). Secrets
    added to `redactor` later are redacted from then on. A record whose message cannot be
    formatted (a logging call with the wrong arguments) is left for logging's own error report.
    """
    make_record = logging.getLogRecordFactory()
    formatter = logging.Formatter()
    logging.captureWarnings(True)

    def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            formatted = record.getMessage()
        except Exception:
            return record  # logging reports it ("--- Logging error ---") when it is emitted
        message = _with_the_tool_error(record, formatted, redactor if redactor else str)
        redacted = redactor(message) if redactor else message
        if redacted is not formatted:
            record.msg, record.args = redacted, None
        if not redactor:
            return record
        if record.exc_info:
            record.exc_text = redactor(formatter.formatException(record.exc_info))
            record.exc_info = None
        if record.stack_info:
            record.stack_info = redactor(record.stack_info)
        return record

    logging.setLogRecordFactory(redacting_factory)
