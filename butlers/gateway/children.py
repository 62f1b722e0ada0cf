"""The gateway's children: which MCP servers sit behind it, and how to reach each.

Two sources: every butler in the switchboard's registry (reached over its endpoint), and MCP
servers declared as `.mcp.json` files found by the configured globs:

    {"name": "docs", "description": "...", "switchboardDescription": "...",
     "command": {"cmd": "node", "args": ["server.js"], "env": {"K": "v"}}}   # a stdio child
    {"name": "search", "url": "http://127.0.0.1:9000/sse"}                  # a remote one

An invalid file is skipped with a warning naming it; it never stops the others. (A reload,
butlers.gateway.reload, keeps the child of such a file running as it was instead.)
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from butlers.errors import ConfigError, InvalidChild
from butlers.gateway.config import load_mcp_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildSpec:
    name: str
    description: str | None = None
    switchboard_description: str | None = None
    # A stdio child: the command, run in `cwd` with the base variables (PATH, HOME, USER,
    # LOGNAME, SHELL, TMPDIR, TERM, locale and TZ: butlers.environment) plus `env`.
    cmd: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    # A remote child (a butler, or an .mcp.json with "url"), and the headers it asks for.
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    kind: str = "mcp"  # "butler" | "mcp"
    source: str = ""  # where it was declared, for messages
    # What an approval is of (butlers.gateway.approvals.fingerprint): the declaration as
    # written, `${VAR}`s unexpanded, hashed ("": as read, there were none to expand).
    declared_as: str = ""


def declaration_hash(
    *,
    cmd: str | None,
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: Path | None,
    url: str | None,
    headers: Mapping[str, str],
) -> str:
    declared = {
        "cmd": cmd,
        "args": list(args),
        "env": dict(env),
        "cwd": None if cwd is None else str(cwd),
        "url": url,
        "headers": dict(headers),
    }
    """A server's declaration, hashed: what an approval is of (butlers.gateway.approvals)."""
    return hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Skipped:
    """A file, or one server in it, that could not be read. At start it is left out with a
    warning; a reload keeps what it declared running as it was (a file caught half-written,
    or saved with a typo, must not stop servers that are in use)."""

    error: ConfigError  # names the file, the key and what is wrong
    server: str | None = None  # the server's name; None: the whole file


def log_skipped(skipped: Iterable[Skipped]) -> None:
    for problem in skipped:
        # One server of a file: the file's others are read (the path leads the text).
        rest = "" if problem.server is None else " (only this server; the file's others are read)"
        logger.warning("skipping %s%s", problem.error, rest, extra={"action": "child_invalid"})


def parse_mcp_json(path: Path) -> ChildSpec:
    """One `.mcp.json` (the gateway.config.McpJson model); raises InvalidChild saying which
    key is wrong and how."""
    try:
        declared = load_mcp_json(path)
    except ConfigError as exc:
        raise InvalidChild(f"{exc.key}: {exc.problem}" if exc.key else exc.problem) from exc
    command = declared.command
    return ChildSpec(
        name=declared.name,
        description=declared.description,
        switchboard_description=declared.switchboard_description,
        cmd=command.cmd if command else None,
        args=command.args if command else (),
        env=dict(command.env) if command else {},
        cwd=path.parent.resolve() if command else None,
        url=declared.url,
        source=str(path),
    )


def discover_mcp_files(
    globs: Iterable[str], base_dir: Path, skipped: list[Skipped]
) -> list[ChildSpec]:
    """The seed-000 files the globs match (one child each); one that is not valid goes to
    `skipped`."""
    found: dict[str, ChildSpec] = {}
    for pattern in globs:
        for match in sorted(glob.glob(str(base_dir / pattern), include_hidden=True)):
            path = Path(match)
            try:
                spec = parse_mcp_json(path)
            except InvalidChild as exc:
                skipped.append(Skipped(ConfigError(path, None, str(exc))))
                continue
            if spec.name in found:
                logger.warning(
                    "skipping %s: child %r is already declared by %s",
                    path,
                    spec.name,
                    found[spec.name].source,
                )
                continue
            found[spec.name] = spec
    return list(found.values())


def butler_children(registry: Iterable[Mapping[str, Any]]) -> list[ChildSpec]:
    """The switchboard registry's rows as children (list_butlers' shape), but not the stale
    ones: discover did not find them in the config directory, so their address may be
    anyone's now, and a child of kind butler is sent the fleet's token (a red team); route
    refuses them too."""
    rows = list(registry)
    for row in rows:
        if row.get("stale"):
            logger.warning(
                "butler %r left out: the switchboard's registry marks it stale (its config "
                "directory no longer holds it; `butlers discover` after restoring it)",
                row.get("name"),
            )
    return [
        ChildSpec(
            name=row["name"],
            description=row.get("description") or None,
            url=row["endpoint_url"],
            kind="butler",
            source="butler_registry",
        )
        for row in rows
        if not row.get("stale")
    ]
