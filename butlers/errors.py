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


class ToolRefusal(ToolError):
    """A tool call answered with a message for the caller instead of a result.

    FastMCP logs every ToolError at ERROR, which reads like a crash in the butler's log. A
    caller's mistake (empty text, no such name) is routine and logged at INFO; sites where
    something failed that an operator may want to see pass `log_level=logging.WARNING`.
    """

    def __init__(self, *args: object, log_level: int = logging.INFO) -> None:
        super().__init__(*args, log_level=log_level)
