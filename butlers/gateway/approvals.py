"""A person's yes for servers declared while the gateway runs (gateway.toml `reload = "approve"`).

Why: the files the gateway's servers are declared in (`.mcp.json`, what install moved, the
globbed `mcps/*/.mcp.json`) sit in the project, where the host's model may write without
asking. With hot reload, one such write would start a program, or send the gateway's
environment to a URL, within a second. So a reload applies removals at once, but holds a
server that is new, or whose declaration changed, as *pending*: not started, listed by
`gateway_status` with state "pending". At the gateway's next start everything declared starts
as before (a restart is a person's act too).

How a person says yes: `butlers gateway approve [NAME ...] [--dir D] [--config FILE]`. The
command cannot talk to the running gateway (over stdio only the host can), and it cannot know
what that gateway holds pending. So it reads the very files the gateway reads (ServerFiles,
with gateway.toml's globs) and records the *current declaration* of the named servers (every
declared one without a NAME) in a store outside the project, which the host's model cannot
write to without asking:

    $XDG_STATE_HOME/butlers/gateway-approvals.json   (default ~/.local/state/butlers/)

keyed by the project (the absolute --dir and --config, as the gateway was started with), the
server's name and a hash of its declaration (`fingerprint`: command, args, env, cwd, URL,
headers). Only the latest approved hash per server is kept: approving one declaration never
approves a later, different one. The running gateway watches the store too; on each reading it
starts a pending server whose declaration's hash is the one approved (a changed server is
restarted), and tells the hosts. Approving a declaration that already runs changes nothing.

The store is 0600 in a 0700 directory, written atomically (a new file renamed over the old)
under an exclusive lock on its directory (two `approve`s at once lose neither); the gateway
refuses a store another user owns or others may write (then nothing is approved). The hash
covers env and header values too, so that a changed secret counts as a change; the values
themselves are never stored nor printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from butlers.errors import CommandError, ConfigError
from butlers.gateway.children import ChildSpec
from butlers.gateway.config import load_gateway_config, read_server_file
from butlers.gateway.sources import ServerFiles

STORE_NAME = "gateway-approvals.json"
_VARIABLE = re.compile(r"\$\{(?:env:)?([A-Za-z_][A-Za-z0-9_]*)")  # ${VAR}, VS Code's ${env:VAR}
_VERSION = 1


def store_path(environ: Mapping[str, str]) -> Path:
    """`$XDG_STATE_HOME/butlers/gateway-approvals.json`; a relative XDG_STATE_HOME is ignored,
    as the XDG spec says, for `~/.local/state`."""
    state = environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        home = environ.get("HOME") or str(Path.home())
        state = os.path.join(home, ".local", "state")
    return Path(state) / "butlers" / STORE_NAME


def project_key(directory: Path, config_file: Path | None) -> str:
    """The project a gateway serves: its --dir and --config, absolute (symbolic links
    resolved, so two spellings of one directory agree)."""
    config = None if config_file is None else str(config_file.resolve())
    return json.dumps([str(directory.resolve()), config])


def fingerprint(spec: ChildSpec) -> str:
    """What a server runs or reaches, hashed: a description may change freely, the command,
    its arguments, env, cwd, URL and headers may not."""
    declared = {
        "cmd": spec.cmd,
        "args": list(spec.args),
        "env": dict(spec.env),
        "cwd": None if spec.cwd is None else str(spec.cwd),
        "url": spec.url,
        "headers": dict(spec.headers),
    }
    return hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ApprovalStore:
    """The file of approved declarations (see the module)."""

    path: Path

    @classmethod
    def for_environ(cls, environ: Mapping[str, str]) -> ApprovalStore:
        return cls(store_path(environ))

    def approved(self, key: str) -> dict[str, str]:
        """The approved hash of each server of project `key`; ConfigError naming the file when
        it cannot be trusted or read (blocking: the gateway calls it in a thread)."""
        return dict(self._read().get(key, {}))

    def approve(self, key: str, hashes: Mapping[str, str]) -> None:
        """Record `hashes` (server name -> fingerprint) for project `key`, keeping the rest."""
        with self._locked():
            everything = self._read()
            everything[key] = {**everything.get(key, {}), **hashes}
            self._write({"version": _VERSION, "approved": everything})

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(self.path, None, f"not readable: {exc.strerror}") from exc
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise ConfigError(
                self.path, None, "owned by another user or writable by others: not trusted"
            )
        try:
            data: Any = json.loads(read_server_file(self.path))
        except json.JSONDecodeError as exc:
            raise ConfigError(self.path, None, f"not readable JSON: {exc}") from exc
        approved = data.get("approved") if isinstance(data, dict) else None
        if not isinstance(approved, dict) or not all(
            isinstance(names, dict) and all(isinstance(h, str) for h in names.values())
            for names in approved.values()
        ):
            raise ConfigError(
                self.path, "approved", "expected an object of projects, each {name: hash}"
            )
        return approved

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise CommandError(f"{directory}: not a directory of yours: approvals not written")
        os.chmod(directory, 0o700)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, data: dict[str, Any]) -> None:
        temporary = self.path.with_name(f".{STORE_NAME}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump(data, file, indent=2, sort_keys=True)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
            raise


def approve_command(names: Sequence[str], directory: Path, config_file: Path | None) -> list[str]:
    """`butlers gateway approve --dir D [--config FILE] [NAME ...]`, as a shell would type it
    (for messages: where a pending server is told how to be let in)."""
    words = ["butlers", "gateway", "approve", *names, "--dir", str(directory.resolve())]
    if config_file is not None:
        words += ["--config", str(config_file.resolve())]
    return words


def approve(
    directory: Path,
    config_file: Path | None,
    names: Sequence[str],
    environ: Mapping[str, str],
) -> list[str]:
    """Approve the current declarations of `names` (every declared server when empty) for the
    gateway of --dir `directory` (and --config), and say what was approved: each server as
    written in its file (`described`), no value shown. CommandError when a name is not declared
    or the --config file cannot be read (blocking: run it in a thread)."""
    if not directory.is_dir():
        raise CommandError(f"--dir {directory}: not a directory")
    config = load_gateway_config(directory)
    files = ServerFiles(
        directory=directory,
        environ=environ,
        config_file=config_file,
        discover_globs=config.discover_globs,
        base_dir=config.base_dir,
    )
    declared, skipped = files.read()
    lines: list[str] = []
    for problem in skipped:
        if problem.server is None and problem.error.path == config_file:
            raise CommandError(str(problem.error))
        lines.append(f"not approved (cannot be read): {_shown(str(problem.error))}")
    current: dict[str, ChildSpec] = {}
    for spec in declared:
        current.setdefault(spec.name, spec)  # the first wins, as in the gateway
    unknown = [name for name in names if name not in current]
    if unknown:
        raise CommandError(
            f"not declared in the files of --dir {directory}"
            f"{f' and --config {config_file}' if config_file else ''}: {', '.join(unknown)}"
        )
    chosen = [current[name] for name in names] if names else list(current.values())
    if not chosen:
        return [*lines, "no servers are declared there: nothing to approve"]
    store = ApprovalStore.for_environ(environ)
    key = project_key(directory, config_file)
    try:
        known = store.approved(key)
    except ConfigError as exc:
        raise CommandError(str(exc)) from exc
    new = {spec.name: fingerprint(spec) for spec in chosen}
    fresh = [spec for spec in chosen if known.get(spec.name) != new[spec.name]]
    if not fresh:
        return [*lines, "nothing new to approve: " + ", ".join(new) + " already approved"]
    store.approve(key, {spec.name: new[spec.name] for spec in fresh})
    # The same files read again with each variable standing for itself: what is shown.
    written = {name: f"${{{name}}}" for name in environ}
    shown: dict[str, ChildSpec] = {}
    for spec in dataclasses.replace(files, environ=written).read()[0]:
        shown.setdefault(spec.name, spec)
    lines += [
        f"approved {_shown(spec.name)}: {described(shown.get(spec.name, spec))}" for spec in fresh
    ]
    lines += [f"already approved: {_shown(spec.name)}" for spec in chosen if spec not in fresh]
    lines.append(f"(recorded in {store.path}; a running gateway starts them now)")
    return lines


def described(spec: ChildSpec) -> str:
    """What a server runs or reaches, for a person to judge, from its declaration as written
    (`${VAR}`s not expanded, so that `?k=${ANTHROPIC_API_KEY}` is seen for what it sends): the
    command line (quoted as a shell would take it), the URL, the env's and headers' names and
    the variables they take. A value written out in the file may be a secret: never shown
    (a URL's literal query values as `...`)."""
    if spec.url is not None:
        url = urlsplit(spec.url)
        query = "&".join(
            f"{k}={v if '${' in v else '...'}"
            for k, v in parse_qsl(url.query, keep_blank_values=True)
        )
        first = url._replace(query=query, fragment="").geturl()
        rest = [f"headers: {_names(spec.headers)}"] if spec.headers else []
    else:
        first = shlex.join([spec.cmd or "", *spec.args])
        rest = [f"env: {_names(spec.env)}"] if spec.env else []
        if spec.cwd is not None:
            rest.append(f"in {spec.cwd}")
    return _shown(f"{first} ({'; '.join(rest)})" if rest else first)


def _names(values: Mapping[str, str]) -> str:
    """`KEY` for each entry, `KEY (from ${VAR})` when its value takes a variable."""
    shown = []
    for key, value in values.items():
        used = sorted(set(_VARIABLE.findall(value)))
        shown.append(f"{key} (from {', '.join(f'${{{v}}}' for v in used)})" if used else key)
    return ", ".join(shown)


def _shown(text: str) -> str:
    """Control characters of a hostile file escaped: they must not rewrite the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
