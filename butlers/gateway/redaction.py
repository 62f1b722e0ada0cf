"""Argument redaction: `[suites.<name>] redact = ["password", "token"]` masks those keys'
values, at any depth of a call's arguments, in the gateway's logs and spans; what the child
receives is never touched.

Spans are built by the gateway (per suite's keys). Logs are not all ours: FastMCP logs every
call's arguments at DEBUG before any of our code runs, so the masking sits in the process's
log record factory (the same place secrets are redacted, butlers.redact) and masks every
suite's keys in any dict a log record carries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from butlers.redact import REDACTED


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
