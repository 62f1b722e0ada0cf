"""One exception family for the package; third-party errors are wrapped where they enter."""

from __future__ import annotations

import logging
from pathlib import Path

from fastmcp.exceptions import ToolError


class ButlersError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(ButlersError):
    """A butler.toml is malformed: names the file, the key and what was expected."""

    def __init__(self, path: Path | str, key: str | None, problem: str) -> None:
        self.path = Path(path)
        self.key = key
        self.problem = problem
        where = f"{self.path}: {key}: " if key else f"{self.path}: "
        super().__init__(where + problem)


class DatabaseError(ButlersError):
    """The PostgreSQL server could not be started, reached, created or migrated."""


class SpawnError(ButlersError):
    """A Claude Code session could not run, or ran without its tools."""


class McpCallError(ButlersError):
    """A request we sent to another MCP server got no result (butlers.mcp_connection).

    route, notify and the gateway catch this family; which subclass says whether sending the
    request again elsewhere is safe. Each message is written for the person or model who
    will read it, by whoever knows most about the call (the connection, or its owner).
    """


class ConnectionClosed(McpCallError):
    """The connection is gone, or never opened. Raised as itself, the request was not sent:
    sending it again on a new connection cannot run anything twice (AnswerLost: it was)."""


class AnswerLost(ConnectionClosed):
    """The request was sent, then the connection went away before its answer: the tool may
    or may not have run, so it must not be sent again blindly."""


class CallTimedOut(McpCallError):
    """The peer took the request but sent no answer within the timeout (we told it to stop:
    `notifications/cancelled`)."""


class RemoteError(McpCallError):
    """The peer answered with a JSON-RPC error (a tool's own error is a result, not this)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ToolRefusal(ToolError):
    """A tool call answered with a message for the caller instead of a result.

    FastMCP logs every ToolError at ERROR, which reads like a crash in the butler's log. A
    caller's mistake (empty text, no such name) is routine and logged at INFO; sites where
    something failed that an operator may want to see pass `log_level=logging.WARNING`.
    """

    def __init__(self, *args: object, log_level: int = logging.INFO) -> None:
        super().__init__(*args, log_level=log_level)
