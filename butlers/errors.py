"""One exception family for the package; third-party errors are wrapped where they enter."""

from __future__ import annotations

from pathlib import Path


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
