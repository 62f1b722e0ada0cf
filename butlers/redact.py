"""Configured secrets never leave the process in a log line, a span or a routing_log row.

Libraries log what they are given: httpx logs every request URL at INFO, and the Telegram Bot
API puts the bot token in the URL; an exception text may quote a connection string. Rather
than hunting each one down, every log record is checked against the secrets this process was
configured with (the environment variables that hold them, in `Settings.environ`), at the
moment it is created, so no handler, formatter or level ever sees the original text. Spans
go through the same Redactor on their way out (`butlers.telemetry.RedactingSpanExporter`, kept
there so that this module, which every command loads, does not import the tracing SDK).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

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


class Redactor:
    """Replaces each known secret in a text with `[redacted]`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets: tuple[str, ...] = ()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """More secrets (e.g. those the butler.toml files name, once they are loaded)."""
        known = {*self.secrets, *(s for s in secrets if len(s) >= MIN_SECRET_CHARS)}
        # Longest first, so that a secret containing another is replaced whole.
        self.secrets = tuple(sorted(known, key=len, reverse=True))

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    def __bool__(self) -> bool:
        return bool(self.secrets)

    @classmethod
    def from_environment(
        cls, configs: Iterable[ButlerConfig] = (), *, environ: Mapping[str, str]
    ) -> Redactor:
        """The secrets in `environ` (`Settings.environ`): the variables butler.toml names for
        tokens and passwords, the well-known ones, any *_TOKEN/*_PASSWORD/*_SECRET/*_API_KEY,
        and the password in DATABASE_URL."""
        names = set(SECRET_NAMES)
        for config in configs:
            if config.telegram is not None:
                names |= {config.telegram.token_env, config.telegram.webhook_secret_env}
            if config.email is not None:
                names.add(config.email.password_env)
        names |= {name for name in environ if SECRET_NAME_PATTERN.search(name)}
        values = [environ[name] for name in names if environ.get(name)]
        for name in HEADER_LIST_NAMES:
            for pair in (environ.get(name) or "").split(","):
                values.append(pair.partition("=")[2].strip())
        database_url = environ.get("DATABASE_URL")
        if database_url:
            try:
                password = urlsplit(database_url).password
            except ValueError:
                password = None
            if password:
                values.append(password)
        return cls(values)


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
        if not redactor:
            return record
        try:
            message = record.getMessage()
        except Exception:
            return record  # logging reports it ("--- Logging error ---") when it is emitted
        redacted = redactor(message)
        if redacted is not message:
            record.msg, record.args = redacted, None
        if record.exc_info:
            record.exc_text = redactor(formatter.formatException(record.exc_info))
            record.exc_info = None
        if record.stack_info:
            record.stack_info = redactor(record.stack_info)
        return record

    logging.setLogRecordFactory(redacting_factory)
