"""The MCP servers people have already declared, in the files their hosts use.

- Claude Code's project file, `.mcp.json` at `--dir`, and Claude Desktop's
  `claude_desktop_config.json` (`--config FILE`): `{"mcpServers": {"<name>": {"command",
  "args", "env"} | {"type": "http" | "sse", "url", "headers"}}}`.
- mcpflip's `servers.json` (`--config FILE`): `{"<alias>": {"command", "args", "env"}}`.
- Gemini CLI's `.gemini/settings.json` (`--config FILE`): `mcpServers` as above, where a
  streamable HTTP server's URL is `httpUrl`.
- Codex's `~/.codex/config.toml` (`--config FILE`, any `.toml`): `[mcp_servers.<name>]` tables
  with `command`, `args`, `env`, or `url` with `http_headers`, `env_http_headers` (header ->
  variable) and `bearer_token_env_var`; `enabled = false` leaves a server out. Its variables
  are read from the gateway's environment as `${VAR}`s are.
- Cursor's `.cursor/mcp.json` and VS Code's `.vscode/mcp.json` (`servers`) reach the gateway
  through `install`, which moves their servers into the record below.
- What `butlers gateway install` moved out of a host's file:
  `.butlers-gateway/<host>/servers.json` at `--dir`, in Claude Code's shape.

`${VAR}` and `${VAR:-default}` are expanded in commands, arguments, env values, URLs and
headers, as Claude Code does, from the gateway's environment; a variable that is not set and
has no default makes that server unusable (skipped, with a warning naming the file, the server
and the variable), never the others. `${BUTLERS_*}` is never expanded: those are the gateway's
own settings (its auth token among them), as `pass_env` refuses them; an entry that names one
is skipped the same way (the variable's value is never shown). Cursor's and VS Code's own
forms too, in what `install --host cursor|vscode` moved: `${env:VAR}` as `${VAR}`,
`${workspaceFolder}` as --dir, `${userHome}` as HOME; `${input:...}` (a value VS Code asks
its user for) cannot be asked here and skips that server, saying to use `${env:VAR}`. Each
file is read as
butlers.gateway.config.read_server_file reads it: a regular file of at most 1 MiB, else
skipped with a warning naming it. An entry that runs this very gateway (`butlers gateway`,
which `install` writes into `.mcp.json`) is left out: the gateway does not start itself.

`ServerFiles` reads them all, in the order that decides a name declared twice, for the
gateway's start and again for each hot reload (butlers.gateway.reload).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from butlers.errors import ConfigError, InvalidChild
from butlers.gateway.children import (
    ChildSpec,
    Skipped,
    declaration_hash,
    discover_mcp_files,
    log_skipped,
)
from butlers.gateway.config import read_server_file

PROJECT_FILE = ".mcp.json"
INSTALL_DIR = ".butlers-gateway"
# What install moved behind the gateway, per host (butlers.gateway.install).
INSTALLED_SERVERS = tuple(
    f"{INSTALL_DIR}/{host}/servers.json"
    for host in ("claude-code", "claude-desktop", "cursor", "vscode")
)
# ${VAR} and ${VAR:-default} (Claude Code's), and Cursor's and VS Code's ${env:VAR},
# ${input:id}, ${workspaceFolder} and ${userHome}.
_VARIABLE = re.compile(
    r"\$\{(?:(env|input):([^}]*)|(workspaceFolder|userHome)|"
    r"([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?)\}"
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The gateway's own settings: never expanded into a server's declaration.
OWN_PREFIX = "BUTLERS_"


class _Entry(BaseModel):
    # Hosts keep keys of their own in these files (disabled, autoApprove, timeout...): not ours
    # to refuse.
    model_config = ConfigDict(extra="ignore", frozen=True)


class StdioServer(_Entry):
    type: Literal["stdio"] = "stdio"
    command: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


class RemoteServer(_Entry):
    # Cursor and Gemini CLI write a bare `url`; which transport is the URL's business (an
    # `/sse` endpoint is SSE, butlers.gateway.clients).
    type: Literal["http", "sse", "streamable-http"] = "http"
    url: str = Field(min_length=1)
    headers: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class ServerFiles:
    """Every file the gateway's MCP servers are declared in (the butlers come from the
    registry instead): `--config`, the project's `.mcp.json` and what install moved, and
    the seed-000 files `discover_globs` match under `base_dir`."""

    directory: Path  # --dir: .mcp.json and .butlers-gateway/ are here
    environ: Mapping[str, str]  # where ${VAR}s are read
    config_file: Path | None = None  # --config
    discover_globs: tuple[str, ...] = ()
    base_dir: Path = Path(".")

    def as_written(self) -> ServerFiles:
        """The same files read with each variable standing for itself (`${VAR}`): what a
        person is shown, and which variables a declaration takes."""
        return dataclasses.replace(self, environ={name: f"${{{name}}}" for name in self.environ})

    def read(self) -> tuple[list[ChildSpec], list[Skipped]]:
        """The servers, in the order that decides a name declared twice (the first wins):
        --config, .mcp.json, what install moved, then the globs; and what could not be
        read, a whole file or one server in it, for the caller to report."""
        skipped: list[Skipped] = []
        specs: list[ChildSpec] = []
        if self.config_file is not None:
            try:
                specs += _config_servers(self.config_file, self.environ, skipped)
            except ConfigError as exc:
                skipped.append(Skipped(exc))
        specs += _project_servers(self.directory, self.environ, skipped)
        specs += discover_mcp_files(self.discover_globs, self.base_dir, skipped)
        return specs, skipped

    def named_files(self) -> list[Path]:
        """The files read by name (whether they exist or not); the globs' are found."""
        named = [self.directory / name for name in (PROJECT_FILE, *INSTALLED_SERVERS)]
        return [self.config_file, *named] if self.config_file is not None else named


def read_config_file(path: Path, environ: Mapping[str, str]) -> list[ChildSpec]:
    """`--config FILE`: a claude_desktop_config.json or Gemini CLI settings.json (they have
    `mcpServers`), an mcpflip servers.json, or Codex's config.toml. ConfigError when the
    file is not JSON (TOML) or not one of these shapes; a server that is not valid is
    skipped with a warning naming it."""
    skipped: list[Skipped] = []
    specs = _config_servers(path, environ, skipped)
    log_skipped(skipped)
    return specs


def project_servers(directory: Path, environ: Mapping[str, str]) -> list[ChildSpec]:
    """Claude Code's `.mcp.json` at `directory` (the servers beside `butlers gateway`, if
    install put it there), then the servers install moved behind the gateway. A file or
    server that is not valid is skipped with a warning naming it."""
    skipped: list[Skipped] = []
    specs = _project_servers(directory, environ, skipped)
    log_skipped(skipped)
    return specs


def _config_servers(
    path: Path, environ: Mapping[str, str], skipped: list[Skipped]
) -> list[ChildSpec]:
    if path.suffix == ".toml":
        servers = _codex_servers(path, skipped)
        return _servers(path, servers, environ, skipped, cwd=None, key="mcp_servers")
    data = _read_json(path)
    if "mcpServers" in data:
        return _servers(path, data["mcpServers"], environ, skipped, cwd=None)
    return _servers(path, data, environ, skipped, cwd=path.parent.resolve(), key="")


def _project_servers(
    directory: Path, environ: Mapping[str, str], skipped: list[Skipped]
) -> list[ChildSpec]:
    specs: list[ChildSpec] = []
    cwd = directory.resolve()
    for name in (PROJECT_FILE, *INSTALLED_SERVERS):
        path = directory / name
        if not os.path.lexists(path):
            continue  # (a FIFO or a directory there is read, refused and reported)
        try:
            data = _read_json(path)
            servers = data.get("mcpServers")
            if servers is None and isinstance(data.get("servers"), dict):
                raise ConfigError(
                    path,
                    "servers",
                    "VS Code's shape (`servers`), where the gateway reads Claude Code's "
                    "(`mcpServers`): keep it in .vscode/mcp.json and run `butlers gateway "
                    "install --host vscode`, or rename the key",
                )
            if servers is None:
                continue  # a seed-000 file of one child (name, command): the globs' business
            specs += _servers(path, servers, environ, skipped, cwd=cwd)
        except ConfigError as exc:
            skipped.append(Skipped(exc))
    return specs


def _codex_servers(path: Path, skipped: list[Skipped]) -> dict[str, Any]:
    """Codex's `[mcp_servers.<name>]` tables in Claude Code's shape, its variable names
    turned into `${VAR}`s: the values stay in the environment until the gateway needs them,
    and an unset one skips that server with a warning naming it."""
    text = read_server_file(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, None, f"not readable TOML: {exc}") from exc
    tables = data.get("mcp_servers")
    if not isinstance(tables, dict):
        raise ConfigError(path, "mcp_servers", "expected [mcp_servers.<name>] tables")
    servers: dict[str, Any] = {}
    for name, table in tables.items():
        if isinstance(table, dict) and table.get("enabled") is False:
            continue
        if not isinstance(table, dict) or "url" not in table:
            servers[name] = table  # stdio: the same keys (or wrong: _spec says what)
            continue
        literal = table.get("http_headers") or {}
        env_headers = table.get("env_http_headers") or {}
        from_env = dict(env_headers) if isinstance(env_headers, dict) else {"": None}
        bearer = table.get("bearer_token_env_var")
        names = [*from_env.values(), *([bearer] if bearer is not None else [])]
        problem = (
            "http_headers: expected a table of strings"
            if not isinstance(literal, dict)
            or not all(isinstance(v, str) for v in literal.values())
            else "env_http_headers / bearer_token_env_var: expected variable names"
            if not all(isinstance(v, str) and _NAME.fullmatch(v) for v in names)
            else None
        )
        if problem is not None:
            skipped.append(Skipped(ConfigError(path, f"mcp_servers.{name}", problem), name))
            continue
        headers = {**literal, **{k: f"${{{v}}}" for k, v in from_env.items()}}
        if bearer is not None:
            headers["Authorization"] = f"Bearer ${{{bearer}}}"
        servers[name] = {"type": "http", "url": table["url"], "headers": headers}
    return servers


def _read_json(path: Path) -> dict[str, Any]:
    text = read_server_file(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(path, None, f"not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(path, None, f"expected an object, got {type(data).__name__}")
    return data


def _servers(
    path: Path,
    servers: Any,
    environ: Mapping[str, str],
    skipped: list[Skipped],
    *,
    cwd: Path | None,
    key: str = "mcpServers",
) -> list[ChildSpec]:
    if not isinstance(servers, dict):
        raise ConfigError(path, key or None, f"expected an object, got {type(servers).__name__}")
    specs = []
    for name, entry in servers.items():
        where = f"{key}.{name}" if key else name
        try:
            spec = _spec(path, name, entry, environ, cwd)
        except InvalidChild as exc:
            skipped.append(Skipped(ConfigError(path, where, str(exc)), name))
            continue
        if spec is not None:
            specs.append(spec)
    return specs


def _spec(
    path: Path, name: str, entry: Any, environ: Mapping[str, str], cwd: Path | None
) -> ChildSpec | None:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise InvalidChild("a server name is letters, digits, '_' and '-'")
    if not isinstance(entry, dict):
        raise InvalidChild(f"expected an object, got {type(entry).__name__}")
    if "httpUrl" in entry and "url" not in entry:  # Gemini CLI's streamable HTTP
        entry = {**entry, "url": entry["httpUrl"], "type": "http"}

    def expand(text: str) -> str:
        return _expand(text, environ, workspace=cwd)

    try:
        if "url" in entry or entry.get("type") in ("http", "sse", "streamable-http"):
            remote = RemoteServer.model_validate(entry)
            return ChildSpec(
                name=name,
                url=expand(remote.url),
                headers={k: expand(v) for k, v in remote.headers.items()},
                source=str(path),
                declared_as=declaration_hash(
                    cmd=None,
                    args=(),
                    env={},
                    cwd=None,
                    url=remote.url,
                    headers=remote.headers,
                ),
            )
        stdio = StdioServer.model_validate(entry)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        key = ".".join(str(part) for part in first["loc"]) or "entry"
        raise InvalidChild(f"{key}: {first['msg']}") from None
    command = expand(stdio.command)
    args = tuple(expand(arg) for arg in stdio.args)
    if runs_this_gateway(command, args):
        return None
    return ChildSpec(
        name=name,
        cmd=command,
        args=args,
        env={k: expand(v) for k, v in stdio.env.items()},
        cwd=cwd,
        source=str(path),
        # As written: the same entry, the variables unexpanded (what a person approves).
        declared_as=declaration_hash(
            cmd=stdio.command, args=stdio.args, env=stdio.env, cwd=cwd, url=None, headers={}
        ),
    )


def _expand(text: str, environ: Mapping[str, str], *, workspace: Path | None = None) -> str:
    """`text` with its variables' values, in one pass (a value is never expanded again); the
    module's docstring says which forms. InvalidChild naming a variable that has no value.
    `workspace`: what `${workspaceFolder}` is (the project's directory), None where there is
    none (a --config file's servers)."""

    def value(match: re.Match[str]) -> str:
        kind, argument, editor, variable, default = match.groups()
        if kind == "input":
            raise InvalidChild(
                f"${{input:{argument}}} is a value VS Code asks its user for, which the gateway "
                "cannot: put it in the gateway's environment and write ${env:NAME}"
            )
        if kind == "env":
            if not _NAME.fullmatch(argument):
                raise InvalidChild(f"${{env:{argument}}} does not name a variable")
            variable = argument
        elif editor == "userHome":
            return environ.get("HOME") or str(Path.home())
        elif editor == "workspaceFolder":
            if workspace is None:
                raise InvalidChild("${workspaceFolder} is known only for a project's servers")
            return str(workspace)
        if variable.startswith(OWN_PREFIX):
            raise InvalidChild(
                f"${{{variable}}} is the gateway's own setting ({OWN_PREFIX}*), never expanded "
                "into a server's declaration"
            )
        if variable in environ:
            return environ[variable]
        if default is not None:
            return default
        raise InvalidChild(f"${{{variable}}} is not set and has no default (${{{variable}:-...}})")

    return _VARIABLE.sub(value, text)


def runs_this_gateway(command: str, args: tuple[str, ...] | list[str]) -> bool:
    """`butlers gateway ...` or `python -m butlers gateway ...`: the entry install writes."""
    program = Path(command).name
    if program == "butlers":
        return bool(args) and args[0] == "gateway"
    return program.startswith("python") and list(args[:3]) == ["-m", "butlers", "gateway"]
