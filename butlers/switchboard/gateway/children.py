"""The gateway's children: which MCP servers sit behind it, and how to reach each.

Two sources: every butler in the switchboard's registry (reached over its endpoint), and MCP
servers declared as `.mcp.json` files found by the configured globs:

    {"name": "docs", "description": "...", "switchboardDescription": "...",
     "command": {"cmd": "node", "args": ["server.js"], "env": {"K": "v"}}}   # a stdio child
    {"name": "search", "url": "http://127.0.0.1:9000/sse"}                  # a remote one

An invalid file is skipped with a warning naming it; it never stops the others.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class ChildSpec:
    name: str
    description: str | None = None
    switchboard_description: str | None = None
    # A stdio child: the command, run in `cwd` with PATH, HOME, locale and TZ plus `env`.
    cmd: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    # A remote child (a butler, or an .mcp.json with "url").
    url: str | None = None
    kind: str = "mcp"  # "butler" | "mcp"
    source: str = ""  # where it was declared, for messages


class InvalidChild(ValueError):
    pass


def parse_mcp_json(path: Path) -> ChildSpec:
    """One `.mcp.json`; raises InvalidChild saying what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidChild(f"not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidChild("expected a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidChild(f"name: expected a name like 'docs' ([A-Za-z0-9_.-]), got {name!r}")
    for key in ("description", "switchboardDescription"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise InvalidChild(f"{key}: expected a string")
    command, url = data.get("command"), data.get("url")
    if (command is None) == (url is None):
        raise InvalidChild('expected exactly one of "command" (stdio) or "url" (remote)')
    common = {
        "name": name,
        "description": data.get("description"),
        "switchboard_description": data.get("switchboardDescription"),
        "source": str(path),
    }
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidChild(f"url: expected an http(s) URL, got {url!r}")
        return ChildSpec(url=url, **common)
    if not isinstance(command, dict) or not isinstance(command.get("cmd"), str):
        raise InvalidChild('command: expected {"cmd": "...", "args": [...], "env": {...}}')
    args = command.get("args", [])
    env = command.get("env", {})
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidChild("command.args: expected a list of strings")
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise InvalidChild("command.env: expected an object of strings")
    return ChildSpec(
        cmd=command["cmd"], args=tuple(args), env=dict(env), cwd=path.parent.resolve(), **common
    )


def discover_mcp_files(globs: Iterable[str], base_dir: Path) -> list[ChildSpec]:
    found: dict[str, ChildSpec] = {}
    for pattern in globs:
        for match in sorted(glob.glob(str(base_dir / pattern), include_hidden=True)):
            path = Path(match)
            try:
                spec = parse_mcp_json(path)
            except InvalidChild as exc:
                logger.warning("skipping %s: %s", path, exc, extra={"action": "child_invalid"})
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
    """The switchboard registry's rows as children (list_butlers' shape)."""
    return [
        ChildSpec(
            name=row["name"],
            description=row.get("description") or None,
            url=row["endpoint_url"],
            kind="butler",
            source="butler_registry",
        )
        for row in registry
    ]
