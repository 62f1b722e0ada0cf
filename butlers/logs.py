"""One log stream per process: ours, FastMCP's, the MCP SDK's and uvicorn's records, all
through the root logger's one handler, in one format, at the one level `--log-level` names.

Libraries that bring their own handlers are made to propagate instead: FastMCP installs a Rich
handler on the `fastmcp` logger when it is imported (`adopt_fastmcp_logging()` undoes that),
and uvicorn does the same unless it is given `log_config=None` (what the daemons pass).

Every line carries the structured fields the code passes (`extra={"action": ...}`), the
butler it concerns (`butler_context()`; set by the daemon for everything it starts) and the
trace and span ids when a span is current. `text` is for people, `json` one object per line
for a log shipper. Secrets are redacted where each record is made (butlers.redact), before any
handler sees it, so neither format can print one.

Nothing heavy is imported here: the CLI configures logging for every command, `--help` and
the client commands included, and those must start fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextvars import Context, ContextVar
from typing import Any, Literal, TextIO

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
LogFormat = Literal["text", "json"]
DEFAULT_LEVEL = "WARNING"
DEFAULT_FORMAT: LogFormat = "text"

# The fields a line may carry beside the message, in the order text lines print them.
FIELDS = ("action", "butler", "trace_id", "span_id")

# Loggers that print a secret at INFO: httpx logs every request URL, and Bot API URLs carry
# the bot token. Redaction would catch a configured token; these stay quiet above DEBUG anyway.
CHATTY_LOGGERS = ("httpx", "httpx2")

# Which butler a record concerns. A context variable, so that every task a butler's start-up
# creates (its server, ticker, worker, channels) carries it, whichever butler logs next.
_BUTLER: ContextVar[str | None] = ContextVar("butlers_log_butler", default=None)


@contextlib.contextmanager
def butler_context(name: str) -> Iterator[None]:
    """Records logged inside the block, and in every task created inside it, name `name`."""
    token = _BUTLER.set(name)
    try:
        yield
    finally:
        _BUTLER.reset(token)


def context_of_butler(name: str) -> Context:
    """A fresh context, with nothing of the current one, whose records name `name`: for work
    done for a butler from another butler's task (butlers.mcp_connection.local)."""
    context = Context()
    context.run(_BUTLER.set, name)
    return context


def parse_level(value: str) -> str:
    """`debug`, `Info`... as logging's name; ValueError (argparse: a usage error) otherwise."""
    level = value.strip().upper()
    if level not in LEVELS:
        raise ValueError(f"{value!r} is not one of {', '.join(LEVELS)}")
    return level


def _current_span_fields() -> dict[str, str]:
    """The current span's trace and span ids, and the butler its tracer belongs to.

    Only when OpenTelemetry is already imported: a process that never imported it has no
    span, and importing it here would cost every command (`--help` included) its import.
    """
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return {}
    span = trace.get_current_span()
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    fields = {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }
    resource = getattr(span, "resource", None)  # an SDK span: the butler's tracer provider
    butler = resource.attributes.get("butler") if resource is not None else None
    if isinstance(butler, str):
        fields["butler"] = butler
    return fields


class ContextFilter(logging.Filter):
    """Adds `action`, `butler`, `trace_id` and `span_id` to each record (None when unknown).

    A handler's filter runs in the thread and context of the logging call, so the context
    variable and the current span are the caller's.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        found = _current_span_fields()
        butler = _BUTLER.get() or found.get("butler")
        record.butler = getattr(record, "butler", None) or butler
        record.trace_id = found.get("trace_id")
        record.span_id = found.get("span_id")
        if not hasattr(record, "action"):
            record.action = None
        return True


class TextFormatter(logging.Formatter):
    """`2026-11-24 10:00:00,123 INFO butlers.daemon: butler general serving on ... [action=
    butler_started butler=general]`: the classic line, with the known fields after it."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = [f"{name}={value}" for name in FIELDS if (value := getattr(record, name, None))]
        return f"{line} [{' '.join(fields)}]" if fields else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the known
    fields that have a value, and the traceback (`exc`) or stack (`stack`) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _utc_iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value:
                line[name] = value
        # The redacting record factory leaves a traceback as text (exc_text), not exc_info.
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def _utc_iso(created: float) -> str:
    seconds = int(created)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return f"{stamp}.{int((created - seconds) * 1000):03d}Z"


def configure_logging(
    level: str = DEFAULT_LEVEL, log_format: LogFormat = DEFAULT_FORMAT, stream: TextIO | None = None
) -> logging.Handler:
    """Make the root logger's one handler (stderr) the process's log stream; returns it.

    Replaces whatever handlers the root logger had (a second call reconfigures). Libraries
    already imported that keep their own handlers are made to propagate; for those imported
    later, see `adopt_fastmcp_logging()`.
    """
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(parse_level(level))
    # The handler keeps the level too: a library's filter may lower a record's level after
    # its logger let it through (FastMCP's `to_client` logger turns every message it sends a
    # host into DEBUG: a child's WARNING reached stderr as a DEBUG line at WARNING).
    handler.setLevel(root.level)
    quiet = logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
    if "fastmcp" in sys.modules:
        adopt_fastmcp_logging()
    return handler


def progress(text: str, *, action: str = "startup") -> None:
    """A step of a long start (or stop), for the person waiting: a plain line on stderr, or,
    when the log stream is JSON (what a log shipper reads), an INFO record with `action`
    instead, so that every line there stays one object."""
    if _json_stream():
        logging.getLogger("butlers").info(text, extra={"action": action})
    else:
        print(text, file=sys.stderr, flush=True)


def ready_warning(text: str) -> None:
    """What `up` says under its ready table: a `warning: ...` line on stderr, or, when the
    log stream is JSON, a WARNING record with action `ready_warning` (a plain line there broke
    a log shipper reading one object a line)."""
    if _json_stream():
        logging.getLogger("butlers").warning(text, extra={"action": "ready_warning"})
    else:
        print(f"warning: {text}", file=sys.stderr, flush=True)


def _json_stream() -> bool:
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def adopt_fastmcp_logging() -> None:
    """FastMCP's records go to our stream: its own (Rich) handler off, its logger propagating
    at the root's level. Call after importing FastMCP: its import installs that handler, and
    `fastmcp.settings.log_enabled = False` keeps it from coming back (a server's `run` with a
    log level re-installs it otherwise)."""
    import fastmcp

    fastmcp.settings.log_enabled = False
    logger = logging.getLogger("fastmcp")
    for handler in logger.handlers[:]:
        logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
