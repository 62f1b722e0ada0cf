"""Gateway configuration: `gateway.toml` (snake_case), or an existing `switchboard.config.json`
from the TypeScript Switchboard (camelCase) when there is no gateway.toml.

Both are read into the same typed objects; errors name the file and the key. The JSON Schema
for editors is `schemas/gateway.schema.json` (TOML) and `schemas/switchboard.config.schema.json`.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from butlers.errors import ConfigError

TOML_NAME = "gateway.toml"
JSON_NAME = "switchboard.config.json"
DEFAULT_GLOBS = (".switchboard/mcps/*/.mcp.json", "mcps/*/.mcp.json")
INTROSPECTION_MODES = ("summary", "full", "redacted")


@dataclass(frozen=True)
class SuiteConfig:
    suite_name: str | None = None
    description: str | None = None
    allow: tuple[str, ...] | None = None  # None: every subtool
    deny: tuple[str, ...] = ()
    summary_max_chars: int | None = None

    def exposes(self, subtool: str) -> bool:
        if subtool in self.deny:
            return False
        return self.allow is None or subtool in self.allow


@dataclass(frozen=True)
class GatewayConfig:
    discover_globs: tuple[str, ...] = DEFAULT_GLOBS
    suites: dict[str, SuiteConfig] = field(default_factory=dict)
    child_spawn_ms: int = 8000
    rpc_ms: int = 60000
    introspection_mode: str = "summary"
    summary_max_chars: int = 160
    source: Path | None = None  # the file it came from, if any
    base_dir: Path = Path(".")  # globs are relative to this

    def suite(self, child: str) -> SuiteConfig:
        return self.suites.get(child, SuiteConfig())


# The two spellings of every key: (snake_case in gateway.toml, camelCase in the JSON file).
_KEYS = {
    "discover_globs": "discoverGlobs",
    "suites": "suites",
    "timeouts": "timeouts",
    "introspection": "introspection",
    "suite_name": "suiteName",
    "description": "description",
    "expose": "expose",
    "allow": "allow",
    "deny": "deny",
    "summary_max_chars": "summaryMaxChars",
    "child_spawn_ms": "childSpawnMs",
    "rpc_ms": "rpcMs",
    "mode": "mode",
    "$schema": "$schema",
}


class _Reader:
    """Takes keys out of one table, in the file's own spelling, with errors naming file + key."""

    def __init__(self, path: Path, camel: bool, data: Any, where: str = "") -> None:
        self.path, self.camel, self.where = path, camel, where
        if not isinstance(data, dict):
            raise ConfigError(path, where or None, f"expected a table, got {_kind(data)}")
        self.data = dict(data)

    def key(self, name: str) -> str:
        spelled = _KEYS[name] if self.camel else name
        return f"{self.where}.{spelled}" if self.where else spelled

    def _raw(self, name: str) -> Any:
        return self.data.pop(_KEYS[name] if self.camel else name, None)

    def table(self, name: str) -> _Reader | None:
        raw = self._raw(name)
        return None if raw is None else _Reader(self.path, self.camel, raw, self.key(name))

    def tables(self, name: str) -> dict[str, _Reader]:
        sub = self.table(name)
        if sub is None:
            return {}
        return {
            child: _Reader(self.path, self.camel, raw, f"{sub.where}.{child}")
            for child, raw in sub.data.items()
        }

    def string(self, name: str) -> str | None:
        raw = self._raw(name)
        if raw is not None and not (isinstance(raw, str) and raw.strip()):
            raise ConfigError(
                self.path, self.key(name), f"expected a non-empty string, got {raw!r}"
            )
        return raw

    def strings(self, name: str) -> tuple[str, ...] | None:
        raw = self._raw(name)
        if raw is None:
            return None
        if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
            raise ConfigError(self.path, self.key(name), f"expected a list of strings, got {raw!r}")
        return tuple(raw)

    def positive(self, name: str) -> int | None:
        raw = self._raw(name)
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0):
            raise ConfigError(
                self.path, self.key(name), f"expected a positive integer, got {raw!r}"
            )
        return raw

    def done(self) -> None:
        self.data.pop("$schema", None)
        if self.data:
            unknown = ", ".join(sorted(self.data))
            raise ConfigError(self.path, self.where or None, f"unknown key(s): {unknown}")


def _kind(value: Any) -> str:
    return type(value).__name__


def load_gateway_config(directory: Path) -> GatewayConfig:
    """gateway.toml in `directory`, else switchboard.config.json, else the defaults."""
    for name, language, loads in (
        (TOML_NAME, "TOML", tomllib.loads),
        (JSON_NAME, "JSON", json.loads),
    ):
        path = directory / name
        if path.is_file():
            try:
                data = loads(path.read_text(encoding="utf-8"))
            except ValueError as exc:  # TOML and JSON decode errors, bad UTF-8
                raise ConfigError(path, None, f"is not valid {language}: {exc}") from exc
            return _parse(path, data, camel=language == "JSON", base_dir=directory)
    return GatewayConfig(base_dir=directory)


def _parse(path: Path, data: Any, *, camel: bool, base_dir: Path) -> GatewayConfig:
    root = _Reader(path, camel, data)
    defaults = GatewayConfig()
    globs = root.strings("discover_globs")
    suites = {}
    for child, table in root.tables("suites").items():
        expose = table.table("expose")
        allow = deny = None
        if expose is not None:
            allow, deny = expose.strings("allow"), expose.strings("deny")
            expose.done()
        suites[child] = SuiteConfig(
            suite_name=table.string("suite_name"),
            description=table.string("description"),
            allow=allow,
            deny=deny or (),
            summary_max_chars=table.positive("summary_max_chars"),
        )
        table.done()
    spawn_ms = rpc_ms = None
    if (timeouts := root.table("timeouts")) is not None:
        spawn_ms, rpc_ms = timeouts.positive("child_spawn_ms"), timeouts.positive("rpc_ms")
        timeouts.done()
    mode = max_chars = None
    if (introspection := root.table("introspection")) is not None:
        mode = introspection.string("mode")
        if mode is not None and mode not in INTROSPECTION_MODES:
            raise ConfigError(
                path,
                introspection.key("mode"),
                f"expected one of {', '.join(INTROSPECTION_MODES)}, got {mode!r}",
            )
        max_chars = introspection.positive("summary_max_chars")
        introspection.done()
    root.done()
    return GatewayConfig(
        discover_globs=globs if globs is not None else defaults.discover_globs,
        suites=suites,
        child_spawn_ms=spawn_ms or defaults.child_spawn_ms,
        rpc_ms=rpc_ms or defaults.rpc_ms,
        introspection_mode=mode or defaults.introspection_mode,
        summary_max_chars=max_chars or defaults.summary_max_chars,
        source=path,
        base_dir=base_dir,
    )
