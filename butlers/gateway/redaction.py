"""Argument redaction: `[suites.<name>] redact = ["password", "token"]` masks those keys'
values, at any depth of a call's arguments, in the gateway's logs and spans; what the child
receives is never touched.

And the servers' own secrets (`declared_secrets`): what a declaration sends a server (its
headers, a URL's `?key=`, an env entry named like a secret, and every `${VAR}` those take)
joins the process's Redactor (butlers.redact), so that no log line, no error the gateway
answers the host (`cannot connect to https://...?key=...`), no child's stderr relayed and no
gateway_status shows it.

Spans are built by the gateway (per suite's keys). Logs are not all ours: FastMCP logs every
call's arguments at DEBUG before any of our code runs, so the masking sits in the process's
log record factory (the same place secrets are redacted, butlers.redact) and masks every
suite's keys in any dict a log record carries.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from butlers.gateway.children import ChildSpec
from butlers.gateway.sources import ServerFiles
from butlers.redact import REDACTED, SECRET_NAME_PATTERN

# Headers whose values are never credentials (the rest may be: X-Api-Key, Authorization...).
_PLAIN_HEADERS = frozenset(
    {"accept", "accept-language", "content-type", "user-agent", "mcp-protocol-version"}
)
# Variables a declaration may take that are no secret (their values are ordinary words).
_NOT_SECRET = frozenset({"HOME", "PATH", "PWD", "USER", "LOGNAME", "SHELL", "TMPDIR", "LANG"})
_VARIABLE = re.compile(r"\$\{(?:env:)?([A-Za-z_][A-Za-z0-9_]*)")


def server_secrets(files: ServerFiles, running: Iterable[ChildSpec]) -> list[str]:
    """What the servers that run (`running`, of those `files` declare) are sent that is
    secret: see `declared_secrets`, and the values of the variables their URL, headers and
    env take (read again as written: `${VAR}` standing for itself), but those that are no
    secret (HOME, PATH...). Only what runs: a pending declaration's values are the project
    writer's to choose, and each would blank its words in every later line. Blocking: it
    reads the files."""
    running = list(running)
    names_running = {spec.name for spec in running}
    texts = [
        text
        for spec in files.as_written().read()[0]
        if spec.name in names_running
        for text in (spec.url or "", *spec.headers.values(), *spec.env.values())
    ]
    names = {n for text in texts for n in _VARIABLE.findall(text)} - _NOT_SECRET
    taken = [files.environ[n] for n in sorted(names) if files.environ.get(n)]
    return declared_secrets(running) + taken


def declared_secrets(specs: Iterable[ChildSpec]) -> list[str]:
    """The values the servers' declarations send them that are secrets: every header value
    but the few that never are (Content-Type...), and its credential without the scheme; a
    URL's password and every value of its query; an env value whose name is a secret's
    (`*_TOKEN`, `*_API_KEY`, ...)."""
    secrets: list[str] = []
    for spec in specs:
        for header, value in spec.headers.items():
            if header.lower() not in _PLAIN_HEADERS:
                secrets += [value, value.partition(" ")[2]]
        if spec.url is not None:
            try:
                parts = urlsplit(spec.url)
                password, query = parts.password, parts.query
            except ValueError:
                password, query = None, ""
            secrets += [password or "", *(v for _, v in parse_qsl(query))]
        secrets += [v for k, v in spec.env.items() if SECRET_NAME_PATTERN.search(k.upper())]
    return [s for s in secrets if s]


def redact_arguments(value: Any, keys: frozenset[str]) -> Any:
    """A copy of `value` with the value of every key in `keys` replaced, in nested objects and
    lists too."""
    if not keys:
        return value
    if isinstance(value, dict):
        return {k: REDACTED if k in keys else redact_arguments(v, keys) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_arguments(v, keys) for v in value)
    return value


def install_argument_redaction(keys: Iterable[str]) -> None:
    """From now on, every log record's arguments have `keys` masked (no-op without keys)."""
    masked = frozenset(keys)
    if not masked:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if isinstance(record.args, tuple):
            record.args = tuple(redact_arguments(a, masked) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = redact_arguments(record.args, masked)
        return record

    logging.setLogRecordFactory(factory)
