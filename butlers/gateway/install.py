"""`butlers gateway install` / `uninstall`: put the gateway in front of a host's MCP servers,
and take it away again byte for byte.

Claude Code, project scope (the default): the servers of `D/.mcp.json` move behind the gateway
(`D/.butlers-gateway/claude-code/servers.json`, which the gateway reads, `${VAR}`s unexpanded),
and `D/.mcp.json` is rewritten so that its only server is `butlers`, this installation's
`butlers gateway --dir D` by absolute path. The original file is kept byte for byte beside it,
and so is what we wrote: uninstalling puts the original back only while `.mcp.json` is still
what we wrote (an edit of the user's is never overwritten). `--host claude-desktop` does the
same with `claude_desktop_config.json` (its other settings kept). Each also writes the
`/butlers-gateway` skill. Installing twice changes nothing.

`--scope user` registers the gateway with Claude Code's own `claude mcp add -s user` (or prints
that command when there is no `claude` binary: Claude Code rewrites its user config as it
runs, so adding and removing entries is left to it). The config as it was before (or that
there was none) and as the registration left it are kept beside it (`UserScope`), in a
directory that must be the user's own (checked before anything is registered): uninstall
puts the original back byte for byte while the file is still what we left, else has Claude
Code remove only our entry; and a
`butlers` entry we did not register is never replaced or removed. When the project or the
program a registration of ours names has moved away (a renamed checkout, a venv rebuilt
elsewhere), installing again re-registers it from here and says so, and from then on "the
original" is the config as it was just before that (our old entry removed): what the user
changed in between stays changed. While both are still there, install refuses rather than
take the registration away from the other project.

`--host cursor` (`D/.cursor/mcp.json`, `mcpServers`) and `--host vscode` (`D/.vscode/mcp.json`,
`servers`, each entry with a `type`) go through the very same take-over and give-back: a host
differs only in where its file is, which key holds the servers and what one entry looks like
(`HOSTS`). They get no skill: it is a Claude Code skill.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from butlers.errors import CommandError
from butlers.gateway.approvals import approve_as_declared
from butlers.gateway.sources import INSTALL_DIR, PROJECT_FILE, runs_this_gateway

Host = Literal["claude-code", "claude-desktop", "cursor", "vscode"]
Scope = Literal["project", "user"]
SERVER_NAME = "butlers"
SKILL = Path(".claude") / "skills" / "butlers-gateway" / "SKILL.md"
GITIGNORE = ".gitignore"  # in `.butlers-gateway`: all of it stays out of git


@dataclass(frozen=True)
class HostFile:
    """What differs between hosts: where the file is, which key holds its servers, and
    whether an entry names its `type` (VS Code's does: `stdio` for a command, `http` for a
    URL); the rest of the install is the same for all."""

    key: str  # the object of servers in the host's file
    project_file: Path | None  # relative to --dir; None: the user's own (Claude Desktop)
    typed: bool  # each entry carries "type"
    skill: Literal["project", "home"] | None  # where the /butlers-gateway skill goes


HOSTS: dict[str, HostFile] = {
    "claude-code": HostFile("mcpServers", Path(PROJECT_FILE), typed=False, skill="project"),
    "claude-desktop": HostFile("mcpServers", None, typed=False, skill="home"),
    "cursor": HostFile("mcpServers", Path(".cursor") / "mcp.json", typed=False, skill=None),
    "vscode": HostFile("servers", Path(".vscode") / "mcp.json", typed=True, skill=None),
}


@dataclass(frozen=True)
class Install:
    """Where one host's install of the gateway for project `directory` keeps its files."""

    directory: Path  # the gateway's --dir
    host: Host
    config: Path  # the host's file we rewrite

    @property
    def shape(self) -> HostFile:
        return HOSTS[self.host]

    @property
    def record(self) -> Path:
        return self.directory / INSTALL_DIR / self.host

    @property
    def servers(self) -> Path:
        return self.record / "servers.json"

    @property
    def original(self) -> Path:
        return self.record / "original.json"

    @property
    def absent(self) -> Path:
        """Marks that there was no file to keep: uninstall removes the one we wrote."""
        return self.record / "original.absent"

    @property
    def written(self) -> Path:
        return self.record / "installed.json"


def desktop_config_path(environ: Mapping[str, str]) -> Path:
    """Claude Desktop's config, where it keeps it on this platform."""
    home = Path(environ.get("HOME") or Path.home())
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json"
    if sys.platform == "win32":
        return Path(environ.get("APPDATA", home)) / "Claude" / "claude_desktop_config.json"
    config_home = environ.get("XDG_CONFIG_HOME") or str(home / ".config")
    return Path(config_home) / "Claude" / "claude_desktop_config.json"


def gateway_command(directory: Path, env_file: Path | None = None) -> tuple[str, list[str]]:
    """How a host starts this installation's gateway for `directory` (reading the fleet's
    token from `env_file`, when given): absolute paths only."""
    butlers = Path(sys.executable).parent / "butlers"
    target = ["gateway", "--dir", str(directory.resolve())]
    if env_file is not None:
        target += ["--env-file", str(env_file.resolve())]
    if butlers.is_file():
        return str(butlers), target
    return sys.executable, ["-m", "butlers", *target]


def install(
    directory: Path,
    *,
    host: Host = "claude-code",
    scope: Scope = "project",
    config: Path | None = None,
    environ: Mapping[str, str],
    env_file: Path | None = None,
) -> list[str]:
    """Install; returns what was done, a line each (nothing done: says so). `env_file`: the
    gateway the host starts reads the fleet's token from it (`butlers gateway --env-file`)."""
    if not directory.is_dir():
        raise CommandError(f"--dir {directory}: not a directory")
    if scope == "user":
        if host != "claude-code":
            raise CommandError(f"--scope user is Claude Code's; --host {host} has no such scope")
        return [
            *_register_user(directory, environ, env_file),
            *approve_as_declared(directory, None, environ),
            *_write_skill(_user_skill(environ)[0]),
        ]
    done = _take_over(_place(directory, host, config, environ), env_file)
    done += approve_as_declared(directory, None, environ)  # what the host will start: --dir
    root = _skill_root(directory, host, environ)
    return done + (_write_skill(root / SKILL) if root is not None else [])


def uninstall(
    directory: Path,
    *,
    host: Host = "claude-code",
    scope: Scope = "project",
    config: Path | None = None,
    environ: Mapping[str, str],
) -> list[str]:
    if scope == "user":
        if host != "claude-code":
            raise CommandError(f"--scope user is Claude Code's; --host {host} has no such scope")
        return [*_unregister_user(environ), *_remove_skill(*_user_skill(environ))]
    done = _give_back(_place(directory, host, config, environ))
    root = _skill_root(directory, host, environ)
    return done + (_remove_skill(root / SKILL, root) if root is not None else [])


def _place(directory: Path, host: Host, config: Path | None, environ: Mapping[str, str]) -> Install:
    """The host's file: `--config FILE`, else where that host keeps it."""
    relative = HOSTS[host].project_file
    default = directory / relative if relative is not None else desktop_config_path(environ)
    return Install(directory, host, config or default)


def _skill_root(directory: Path, host: Host, environ: Mapping[str, str]) -> Path | None:
    where = HOSTS[host].skill
    if where is None:
        return None
    return directory if where == "project" else _user_home(environ)


# -- one host file ------------------------------------------------------------------------


def _take_over(place: Install, env_file: Path | None = None) -> list[str]:
    current = place.config.read_bytes() if place.config.is_file() else None
    if place.written.is_file() and _put_back_by_hand(place, current):
        _forget(place)  # a record of an install that was undone: installed afresh below
    if place.written.is_file():
        if _same_file(current, place.written.read_bytes()):
            return [f"{place.config}: already installed, nothing changed"]
        raise CommandError(
            f"{place.config} changed since `butlers gateway install` (kept in "
            f"{place.record}): run `butlers gateway uninstall` first, or put the servers "
            f"you added into {place.servers}"
        )
    data: dict[str, Any] = {}
    if current is not None:
        try:
            data = json.loads(current)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CommandError(
                f"{place.config}: not readable JSON: {exc} (comments and trailing commas, "
                "which some editors accept, are not JSON: take them out, then install)"
            ) from exc
        key = place.shape.key
        if not isinstance(data, dict) or not isinstance(data.get(key, {}), dict):
            raise CommandError(f'{place.config}: expected an object with a "{key}" object')
    servers = {
        name: entry
        for name, entry in data.get(place.shape.key, {}).items()
        if not _is_gateway_entry(entry)
    }
    command, args = gateway_command(place.directory, env_file)
    entry: dict[str, Any] = {"command": command, "args": args}
    if place.shape.typed:
        entry = {"type": "stdio", **entry}
    data[place.shape.key] = {SERVER_NAME: entry}
    written = (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()

    # The servers' env may hold API keys: the record is the user's alone, whatever the
    # host's file allowed.
    _private_dir(place.record)
    # The directories we create for the file (`.cursor/`, `.vscode/`), one a line in the
    # absent marker: uninstall removes them again when they are still empty.
    folder = place.config.parent.absolute()
    created = [d for d in (folder, *folder.parents) if not d.exists()]
    if current is None:
        _write_private(place.absent, "".join(f"{d}\n" for d in created).encode())
    else:
        _write_private(place.original, current)
    _write_private(place.servers, (json.dumps({"mcpServers": servers}, indent=2) + "\n").encode())
    _write_private(place.written, written)
    place.config.parent.mkdir(parents=True, exist_ok=True)
    _replace(place.config, written)
    moved = ", ".join(servers) or "none"
    return [
        f"{place.config}: its one server is now `butlers` ({shlex.join([command, *args])})",
        f"{place.servers}: the servers behind the gateway ({moved})",
        f"{place.original if current is not None else place.absent}: the original, for "
        "`butlers gateway uninstall`",
    ]


def _give_back(place: Install) -> list[str]:
    if not place.written.is_file():
        raise CommandError(f"{place.config}: the gateway is not installed there ({place.record})")
    current = place.config.read_bytes() if place.config.is_file() else None
    unchanged = _same_file(current, place.written.read_bytes())
    if not unchanged and _put_back_by_hand(place, current):
        _forget(place)
        return [f"{place.config}: the original was already back; the gateway's record removed"]
    if not unchanged:
        original = place.original if place.original.is_file() else None
        back = (
            f"put it back by hand (cp {shlex.quote(str(original))} "
            f"{shlex.quote(str(place.config))})"
            if original is not None
            else "remove it by hand (there was none before install)"
        )
        raise CommandError(
            f"{place.config} was edited since `butlers gateway install`: not overwriting your "
            f"edits. To undo the install, {back} and run uninstall again, which then only "
            "removes the gateway's record; or undo the edit and run uninstall again"
        )
    before = None if place.absent.is_file() else place.original.read_bytes()
    kept = _servers_kept(place, before)
    if kept is not None:
        config, names = kept
        _replace(place.config, config)
        done = (
            f"{place.config}: the original is back, with the servers added or changed behind "
            f"the gateway since install ({names})"
        )
    elif before is None:
        place.config.unlink()
        done = f"{place.config}: removed (there was none before install)"
    else:
        _replace(place.config, before)
        done = f"{place.config}: the original is back"
    _forget(place)
    return [done]


_REFERENCE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")  # `${NAME}`, no default written out
# An argument that usually carries a secret, and the one after such a flag.
_SECRET_ARG = re.compile(r"--?[\w-]*(token|key|secret|password|passwd|auth)[\w-]*", re.I)


def _literal_values(entry: dict[str, Any]) -> list[str]:
    """Where a server entry holds a value written out that may be a secret: every `env` and
    `headers` value that is not a bare `${NAME}` reference (a default, `${KEY:-sk-...}`, is
    written out too; so is a number), the argument after a `--token`-like flag (or its
    `=value`), and a `url` with a user, a password or a query. Names, never the values."""
    found = [
        key
        for table in ("env", "headers")
        if isinstance(values := entry.get(table), dict)
        for key, value in values.items()
        if value not in ("", None) and not (isinstance(value, str) and _REFERENCE.fullmatch(value))
    ]
    args = entry.get("args")
    if isinstance(args, list):
        for i, arg in enumerate(args):
            if not isinstance(arg, str) or not _SECRET_ARG.match(arg):
                continue
            value = (
                arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            )
            if isinstance(value, str) and value and not _REFERENCE.fullmatch(value):
                found.append(f"args {arg.split('=', 1)[0]}")
    url = entry.get("url")
    if isinstance(url, str):
        parts = urlsplit(url)
        if ("@" in parts.netloc and not _REFERENCE.fullmatch(parts.netloc.split("@")[0])) or (
            parts.query and "${" not in parts.query
        ):
            found.append("url")
    return found


def _servers_kept(place: Install, original: bytes | None) -> tuple[bytes, str] | None:
    """The host's file to put back when the servers behind the gateway are no longer the
    ones install moved there (the docs say to add new ones to servers.json: uninstall
    deleted them, their tokens with them, a walkthrough): the original with those servers in
    its place, and which ones differ. None when nothing changed: the original goes back byte
    for byte."""
    try:
        behind = json.loads(place.servers.read_bytes())["mcpServers"]
        if not isinstance(behind, dict):
            raise TypeError("mcpServers is not an object")
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CommandError(
            f"{place.servers}: not readable ({exc}): it holds the servers behind the gateway; "
            "fix it (or move your servers out of it), then run uninstall again"
        ) from exc
    data: Any = json.loads(original) if original is not None else {}
    before = data.get(place.shape.key, {}) if isinstance(data, dict) else None
    if not isinstance(before, dict):  # (install read it as an object: edited since)
        raise CommandError(
            f"{place.original}: not the object install kept; put {place.config} back by hand"
        )
    moved = {name: entry for name, entry in before.items() if not _is_gateway_entry(entry)}
    if behind == moved:
        return None
    changed = sorted(n for n in behind.keys() | moved.keys() if behind.get(n) != moved.get(n))
    # A value written into servers.json (private, 0600, ignored by git) must not move into
    # the host's file, which a project commits: a token added there went into .mcp.json (a
    # review). `${VAR}` references move; literal values stay where they are, said so.
    literal = [
        f"{name}: {', '.join(keys)}"
        for name in changed
        if isinstance(behind.get(name), dict) and (keys := _literal_values(behind[name]))
    ]
    if literal:
        raise CommandError(
            f"{place.servers} holds servers added or changed behind the gateway with values "
            f"written out ({'; '.join(literal)}): moving them into {place.config} would put "
            "those values in a file a project commits. Make them `${VAR}` references (set in "
            "your environment), or move the servers yourself, then run uninstall again"
        )
    gateway = {name: entry for name, entry in before.items() if _is_gateway_entry(entry)}
    data[place.shape.key] = {**gateway, **behind}
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode(), ", ".join(changed)


def _same_file(current: bytes | None, written: bytes) -> bool:
    """Whether the host's file is still what install wrote, but for the white space at its end
    (an editor that saved it without the final newline made it "edited": a walkthrough)."""
    return current is not None and current.rstrip() == written.rstrip()


def _put_back_by_hand(place: Install, current: bytes | None) -> bool:
    """Whether the host's file is as it was before install (its original back, or no file
    where there was none): an install undone by hand, whose record only is left."""
    if place.absent.is_file():
        return current is None
    return place.original.is_file() and current == place.original.read_bytes()


def _forget(place: Install) -> None:
    """The record of one install, gone (the `.butlers-gateway` folders too, once empty), and
    the folders it created for a host's file that was not there, if they are empty again."""
    if place.absent.is_file():
        for created in place.absent.read_text(encoding="utf-8").splitlines():
            folder = Path(created)
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    for path in (place.servers, place.original, place.absent, place.written):
        path.unlink(missing_ok=True)
    _remove_if_empty(place.record)


def _remove_if_empty(record: Path) -> None:
    """A record directory left empty goes, and `.butlers-gateway` above it once it holds
    nothing but its .gitignore."""
    if record.is_dir() and not any(record.iterdir()):
        record.rmdir()
    top = record.parent
    if top.is_dir() and {p.name for p in top.iterdir()} <= {GITIGNORE}:
        (top / GITIGNORE).unlink(missing_ok=True)
        top.rmdir()


def _private_dir(record: Path) -> None:
    """Make the record directory (and `.butlers-gateway` above it) ours alone, or refuse:
    it gets copies of host configs that hold API keys. A directory someone else owns could
    be emptied or swapped under us, and a link would put the copies wherever it points; so
    each must be a real directory owned by us (then made 0700). Runs before anything is
    registered or rewritten, so a refusal leaves nothing half done."""
    record.parent.parent.mkdir(parents=True, exist_ok=True)
    for folder in (record.parent, record):  # each checked before anything goes into it
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        info = folder.lstat()
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise CommandError(
                f"{folder}: a symbolic link or not a directory; butlers keeps copies of your "
                "host config there (they may hold API keys): remove it and run again"
            )
        if info.st_uid != os.getuid():
            raise CommandError(
                f"{folder}: owned by user id {info.st_uid}, not by you; butlers keeps copies "
                "of your host config there (they may hold API keys): remove it and run again"
            )
        if stat.S_IMODE(info.st_mode) != 0o700:
            folder.chmod(0o700)
    # Kept out of a git repository the project is in: original.json is a host config, with
    # whatever `env` values it held.
    if not (record.parent / GITIGNORE).exists():
        with contextlib.suppress(FileExistsError):
            _create(record.parent / GITIGNORE, b"# butlers gateway: copies of host configs\n*\n")


def _create(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` into a new file `path`, mode 0600 from its first byte (`mode` applied only
    once the data is in). O_EXCL|O_NOFOLLOW: never through a link left at that name, never
    into a file someone else already holds open."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        if mode is not None:
            os.fchmod(file.fileno(), mode)


def _write_private(path: Path, data: bytes) -> None:
    """A file of the record (0600). Whatever was at that name goes first, a link as a link."""
    path.unlink(missing_ok=True)
    _create(path, data)


def _replace(path: Path, data: bytes, new_mode: int | None = None) -> None:
    """Write `data` to `path` all at once (a host reading it never sees half a file), keeping
    the file's permissions. The data goes into a temporary file that only the user can read
    until it is complete; a leftover of an interrupted run (or a link planted at that name)
    is removed first, not written through, and a failed write leaves no temporary behind.
    A link at `path` itself is replaced by the file (its target left alone); `new_mode` is
    the mode of a file that was not there (default: 0600)."""
    temporary = path.with_name(f".{path.name}.butlers-tmp")
    try:
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else new_mode
        temporary.unlink(missing_ok=True)
        _create(temporary, data, mode)
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise CommandError(f"{path}: could not write it: {exc}") from exc


def _is_gateway_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("command"), str):
        return False
    args = entry.get("args") or []
    return runs_this_gateway(entry["command"], [str(a) for a in args])


# -- Claude Code's user scope -------------------------------------------------------------


def claude_binary(environ: Mapping[str, str]) -> str | None:
    """`claude` on PATH, else the one claude-agent-sdk bundles."""
    found = shutil.which("claude", path=environ.get("PATH"))
    if found:
        return found
    try:
        import claude_agent_sdk
    except ImportError:
        return None
    bundled = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
    return str(bundled) if bundled.is_file() else None


def user_config_path(environ: Mapping[str, str]) -> Path:
    """The file `claude mcp add -s user` writes, found the way Claude Code finds it (measured
    with its 2.1 binary): with CLAUDE_CONFIG_DIR in the environment, `.claude.json` in it (in
    the home directory when it is empty); else `~/.claude.json`, unless only the older
    `~/.claude/.config.json` is there (not empty, or writable). CLAUDE_CODE_CUSTOM_OAUTH_URL
    makes it `.claude-custom-oauth.json`. What it misses, `_check_registered` catches."""
    home = _user_home(environ)
    custom = bool(environ.get("CLAUDE_CODE_CUSTOM_OAUTH_URL"))
    name = ".claude-custom-oauth.json" if custom else ".claude.json"
    if "CLAUDE_CONFIG_DIR" in environ:
        return Path(environ["CLAUDE_CONFIG_DIR"] or home) / name
    current, legacy = home / name, home / ".claude" / ".config.json"
    if not current.exists() and legacy.is_file():
        stat = legacy.stat()
        if stat.st_size > 0 or stat.st_mode & 0o222:
            return legacy
    return current


@dataclass(frozen=True)
class UserScope:
    """Claude Code's user config and what `install --scope user` keeps beside it: the file as
    it was before the last registration (a re-registration: without our old entry; or that
    there was none) and as that registration left it, so that uninstall can give it back
    byte for byte, and so that a `butlers` entry can be told ours (the one we registered)
    from someone else's."""

    config: Path

    @property
    def record(self) -> Path:
        return self.config.parent / INSTALL_DIR / "claude-code-user"

    @property
    def original(self) -> Path:
        return self.record / "original.json"

    @property
    def absent(self) -> Path:
        return self.record / "original.absent"

    @property
    def written(self) -> Path:
        return self.record / "installed.json"

    def read(self) -> tuple[bytes | None, dict[str, Any] | None]:
        """The file's bytes (None: no file) and its `butlers` entry (None: not registered)."""
        return _user_entry(self.config, self.config.read_bytes() if self.config.is_file() else None)

    def recorded_entry(self) -> dict[str, Any] | None:
        """The entry our last registration wrote; None without a record of one."""
        if not self.written.is_file():
            return None
        return _user_entry(self.written, self.written.read_bytes())[1]

    def ours(self, entry: Mapping[str, Any]) -> bool:
        recorded = self.recorded_entry()
        return recorded is not None and _command_of(recorded) == _command_of(entry)

    def keep(self, before: bytes | None, after: bytes) -> None:
        """Record a registration: the file before it (or its absence), and after."""
        for path in (self.original, self.absent, self.written):
            path.unlink(missing_ok=True)
        _private_dir(self.record)  # the user config holds API keys (servers' env, accounts)
        if before is None:
            _write_private(self.absent, b"")
        else:
            _write_private(self.original, before)
        _write_private(self.written, after)

    def drop(self) -> None:
        for path in (self.original, self.absent, self.written):
            path.unlink(missing_ok=True)
        _remove_if_empty(self.record)


@dataclass(frozen=True)
class StaleRegistration:
    """A user-scope `butlers` registration of ours whose command can no longer start: the
    project it serves or the program it runs was moved or removed."""

    config: Path
    directory: str | None  # the registered --dir
    gone: list[str]  # the registered paths that no longer exist


def stale_user_registration(environ: Mapping[str, str]) -> StaleRegistration | None:
    """Our user-scope registration, if its paths are gone: reads one file and looks at two
    paths (no `claude` run, no server started), so a health check can afford it."""
    scope = UserScope(user_config_path(environ))
    try:
        _, entry = scope.read()
    except CommandError:
        return None
    if entry is None or not _is_gateway_entry(entry):
        return None
    gone = _gone(entry)
    return StaleRegistration(scope.config, _registered_dir(entry), gone) if gone else None


def _user_entry(path: Path, data: bytes | None) -> tuple[bytes | None, dict[str, Any] | None]:
    if data is None:
        return None, None
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CommandError(f"{path}: not readable JSON: {exc}") from exc
    servers = parsed.get("mcpServers", {}) if isinstance(parsed, dict) else None
    if not isinstance(servers, dict):
        raise CommandError(f'{path}: expected an object with a "mcpServers" object')
    entry = servers.get(SERVER_NAME)
    if entry is not None and not isinstance(entry, dict):
        raise CommandError(f"{path}: mcpServers.{SERVER_NAME}: expected an object")
    return data, entry


def _command_of(entry: Mapping[str, Any]) -> tuple[Any, Any]:
    return entry.get("command"), entry.get("args") or []


def _registered_dir(entry: Mapping[str, Any]) -> str | None:
    args = [str(a) for a in entry.get("args") or []]
    if "--dir" in args[:-1]:
        return args[args.index("--dir") + 1]
    return None


def _gone(entry: Mapping[str, Any]) -> list[str]:
    """The paths a registered gateway command needs that are not there any more: the program
    (a venv rebuilt elsewhere) and the project (`--dir`, moved or renamed)."""
    gone = []
    command = entry.get("command")
    if isinstance(command, str) and not Path(command).is_file():
        gone.append(command)
    directory = _registered_dir(entry)
    if directory is not None and not Path(directory).is_dir():
        gone.append(directory)
    return gone


def _register_user(
    directory: Path, environ: Mapping[str, str], env_file: Path | None = None
) -> list[str]:
    scope = UserScope(user_config_path(environ))
    command, args = gateway_command(directory, env_file)
    wanted = {"command": command, "args": args}
    add = ["mcp", "add", "-s", "user", SERVER_NAME, "--", command, *args]
    before, entry = scope.read()
    if entry is None:
        if claude_binary(environ) is None:
            return [_yourself(add)]
        _private_dir(scope.record)  # before `claude mcp add`: no registration without a record
        try:
            _run_claude(add, environ)
            after = _check_registered(scope, wanted, environ)
        except CommandError:
            scope.drop()
            raise
        scope.keep(before, after)
        return [
            f"`{_shown(add)}`: done",
            f"{scope.record}: the original {scope.config}, for "
            "`butlers gateway uninstall --scope user`",
        ]
    if _command_of(entry) == _command_of(wanted):
        return [f"{scope.config}: `{SERVER_NAME}` already registered, nothing changed"]
    if not scope.ours(entry):
        raise CommandError(
            f"{scope.config}: Claude Code's user scope already has an MCP server "
            f"`{SERVER_NAME}` (command {_entry_line(entry)}) "
            f"that `butlers gateway install` did not register (no record of it in "
            f"{scope.record}): not replacing it. Remove it with `claude mcp remove -s user "
            f"{SERVER_NAME}` if it is not needed, then install again"
        )
    gone = _gone(entry)
    old_dir = _registered_dir(entry)
    if not gone:
        raise CommandError(
            f"{scope.config}: the gateway is registered from {old_dir} "
            f"({entry.get('command')}), which is still there: run `butlers gateway uninstall "
            "--scope user` first to register it from here instead"
        )
    remove = ["mcp", "remove", "-s", "user", SERVER_NAME]
    if claude_binary(environ) is None:
        return [
            f"the gateway was installed from {old_dir}, which moved: "
            f"{_yourself(remove)}, then `{_shown(add)}`"
        ]
    _private_dir(scope.record)
    _run_claude(remove, environ)
    # What uninstall gives back from now on: the config as it is without our old entry, not
    # the copy from the first install (servers removed and keys rotated since stay so).
    without_ours, _ = scope.read()
    _run_claude(add, environ)
    scope.keep(without_ours, _check_registered(scope, wanted, environ))
    old, new = old_dir, str(directory.resolve())
    if old in (None, new):  # the same project, another program (a venv rebuilt elsewhere)
        old, new = str(entry.get("command")), command
    return [f"re-registered: the gateway was installed from {old}, which moved; now {new}"]


def _check_registered(
    scope: UserScope, wanted: Mapping[str, Any], environ: Mapping[str, str]
) -> bytes:
    """The user config after `claude mcp add`, which must be the file we read and hold the
    entry we asked for: else Claude Code keeps it elsewhere (a CLAUDE_CONFIG_DIR or a file
    name of a newer release), the registration is undone and install refuses, so that no
    record describes a file Claude Code does not use."""
    after, entry = scope.read()
    if after is None or entry is None or _command_of(entry) != _command_of(wanted):
        with contextlib.suppress(CommandError):
            _run_claude(["mcp", "remove", "-s", "user", SERVER_NAME], environ)
        raise CommandError(
            f"`claude mcp add -s user` did not write {scope.config}, where butlers looks for "
            "Claude Code's user config: registration undone (is CLAUDE_CONFIG_DIR set "
            "differently for Claude Code?)"
        )
    return after


def _unregister_user(environ: Mapping[str, str]) -> list[str]:
    scope = UserScope(user_config_path(environ))
    remove = ["mcp", "remove", "-s", "user", SERVER_NAME]
    current, entry = scope.read()
    if entry is None:
        scope.drop()  # a record of a registration someone else removed since
        return [f"{scope.config}: no `{SERVER_NAME}` server registered, nothing to do"]
    if not scope.ours(entry):
        if scope.written.is_file() or not _is_gateway_entry(entry):
            raise CommandError(
                f"{scope.config}: its `{SERVER_NAME}` server "
                f"(command {_entry_line(entry)}) is not the "
                f"one `butlers gateway install` registered (recorded in {scope.record}): not "
                "removing it"
            )
        # A gateway registered before install kept records (an older butlers): only the
        # entry goes, as it always did.
        return [f"`{_shown(remove)}`: done" if _run_claude(remove, environ) else _yourself(remove)]
    if current == scope.written.read_bytes():
        if scope.absent.is_file():
            scope.config.unlink()
            done = f"{scope.config}: removed (there was none before install)"
        else:
            # Through a symbolic link (a dotfile manager's), as Claude Code writes it: the
            # link stays a link.
            _replace(scope.config.resolve(), scope.original.read_bytes())
            done = f"{scope.config}: the original is back"
    elif _run_claude(remove, environ) is None:
        return [_yourself(remove)]
    else:
        # Claude Code keeps its own state in that file and rewrites it as it runs: putting
        # the original back would undo that. Only our entry leaves.
        done = (
            f"{scope.config}: changed since install (Claude Code keeps its state there), so "
            f"only `{SERVER_NAME}` was removed (`{_shown(remove)}`), the rest left as it is"
        )
    scope.drop()
    return [done]


def _run_claude(args: list[str], environ: Mapping[str, str]) -> str | None:
    """Run Claude Code's own `claude ARGS`: its output, or None when there is no `claude`."""
    claude = claude_binary(environ)
    if claude is None:
        return None
    result = subprocess.run(
        [claude, *args], env=dict(environ), capture_output=True, text=True, timeout=60
    )
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        raise CommandError(f"`{_shown(args)}` failed: {output or f'exit {result.returncode}'}")
    return output


def _shown(args: list[str]) -> str:
    """A `claude` command as the user would type it, quoted so that pasting it into a shell
    runs exactly that (a directory with spaces or `;` in its name included)."""
    return shlex.join(["claude", *args])


def _entry_line(entry: Mapping[str, Any]) -> str:
    """A server entry that is not ours, named by its command only: its arguments may hold a
    key (`--token ...`), and a refusal message ends up in terminals and logs."""
    return shlex.quote(str(entry.get("command")))


def _yourself(args: list[str]) -> str:
    return f"no `claude` binary here: run `{_shown(args)}` yourself"


def _user_home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or Path.home())


# -- the skill ----------------------------------------------------------------------------


def _user_skill(environ: Mapping[str, str]) -> tuple[Path, Path]:
    """Where Claude Code reads a user's skills (the file, and the folder it is under): in
    CLAUDE_CONFIG_DIR when that is set (the skill went to ~/.claude while Claude Code read
    the other: a walkthrough), else in ~/.claude."""
    configured = environ.get("CLAUDE_CONFIG_DIR")
    if configured:
        root = Path(configured)
        return root / SKILL.relative_to(".claude"), root
    home = _user_home(environ)
    return home / SKILL, home


def _write_skill(path: Path) -> list[str]:
    """The skill at `path` (its folders made as needed)."""
    if path.is_file() and path.read_text(encoding="utf-8") == SKILL_TEXT:
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not write_text: a cloned project may carry a link at that name, to a file of yours.
    _replace(path, SKILL_TEXT.encode(), new_mode=0o644)
    return [f"{path}: the /butlers-gateway skill"]


def _remove_skill(path: Path, root: Path) -> list[str]:
    if not path.is_file() or path.read_text(encoding="utf-8") != SKILL_TEXT:
        return []  # not there, or the user's own now
    path.unlink()
    # Its folder, and `.claude/skills` and `.claude` above it, when install's was the only
    # thing in them (install made them as needed; an empty folder is nobody's).
    for folder in (path.parent, path.parent.parent, path.parent.parent.parent):
        if folder == root or any(folder.iterdir()):
            break
        folder.rmdir()
    return [f"{path}: removed"]


SKILL_TEXT = """\
---
name: butlers-gateway
description: >-
  Show, activate or deactivate the MCP servers behind the butlers gateway. Use for
  "/butlers-gateway status", "/butlers-gateway activate NAME" and "/butlers-gateway
  deactivate NAME", or when the user asks which MCP servers or tools are available or wants
  one switched on or off.
---

# The butlers gateway

This project's MCP servers sit behind one MCP server, `butlers`. Its tools:
`mcp__butlers__gateway_status` (every server: name, state, tool count, whether active),
`mcp__butlers__gateway_activate` and `mcp__butlers__gateway_deactivate` (argument `name`).
A server's own tools appear in your tool list only while it is active. In search mode there
is no activating: `gateway_search` finds a tool of any server, `gateway_call` runs it; if
`gateway_activate` is not among your tools, say so instead of activating.

## Finding the server the user means

Always call `gateway_status` first and match NAME against the names it lists:
1. an exact name (ignoring case) wins;
2. otherwise the names that start with NAME, then the names that contain it;
3. exactly one match: use it; several: list them and ask the user which one, and do nothing
   else until they answer; none: say so and list every name.

## /butlers-gateway status

Call `gateway_status` and show one line per server: name, state (warming, ready, active,
error, pending), number of tools, and its error or detail if it has one. A `pending` one is
not approved: show its detail, which names the command that lets it in; never run that
command yourself, it is the user's decision.

## /butlers-gateway activate NAME

1. Find the server (above).
2. If it is already active, say so and stop. If its state is `error`, show the error and stop.
3. Call `gateway_activate` with its exact name and tell the user which tools are now available.

## /butlers-gateway deactivate NAME

1. Find the server (above).
2. If it is not active, say so and stop.
3. It is active: ask the user to confirm ("Deactivate NAME? Its tools leave your tool list.")
   and wait for the answer. Only on a yes, call `gateway_deactivate` with its exact name.
"""
