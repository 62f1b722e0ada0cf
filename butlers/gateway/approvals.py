"""A person's yes for the servers behind the gateway, and for its settings.

Why: the files the gateway's servers are declared in (`.mcp.json`, what install moved, the
globbed `mcps/*/.mcp.json`) and its settings (gateway.toml: `reload`, `pass_env`, `expose`)
sit in the project, where the host's model may write without asking. The host approved one
server, the gateway; what runs behind it is ours to guard. With hot reload one such write
would start a program, or send the gateway's environment to a URL, within a second; without
it, at the next start (a restart of the host). So a server runs only in the declaration a
person approved, and the gateway runs the settings a person approved:

- at the gateway's first start for a project (no record of it here yet), and at `butlers
  gateway install`, what is declared then is recorded as approved (the person who installs or
  starts it is looking at it; later writes are not);
- after that, a server that is new, or whose declaration changed, is *pending*: not started
  (a changed one runs on as it was while the gateway runs), listed by `gateway_status` with
  state "pending" and the command that lets it in; removals apply at once;
- a gateway.toml (or switchboard.config.json) that changed since it was approved is not used:
  the gateway runs the approved copy, kept in the store, and `gateway_status` says so;
- gateway.toml `reload = "apply"` (in the approved settings) starts whatever is declared.

How a person says yes: `butlers gateway approve [NAME ...] [--dir D] [--config FILE]`. The
command cannot talk to the running gateway (over stdio only the host can), and it cannot know
what that gateway holds pending. So it reads the very files the gateway reads (ServerFiles,
with gateway.toml's globs) and records the *current declaration* of the named servers (every
declared one, and the settings, without a NAME) in a store outside the project, which the
host's model cannot write to without asking:

    $XDG_STATE_HOME/butlers/gateway-approvals.json   (default ~/.local/state/butlers/)

keyed by the project (the absolute --dir and --config, as the gateway was started with), the
server's name and a hash of its declaration (`fingerprint`: command, args, env, cwd, URL,
headers), and the settings file's name and text. Only the latest approved hash per server is
kept: approving one declaration never approves a later, different one. The running gateway
watches the store too; on each reading it starts a pending server whose declaration's hash is
the one approved (a changed server is restarted), and tells the hosts. Settings approved while
it runs count from its next start.

The store is 0600 in a 0700 directory, written atomically (a new file renamed over the old)
under an exclusive lock on its directory (two `approve`s at once lose neither); the gateway
refuses a store another user owns or others may write (then nothing is approved). The hash
covers env and header values too, so that a changed secret counts as a change; the values
themselves are never stored nor printed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import stat
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from butlers.errors import CommandError, ConfigError
from butlers.gateway.children import ChildSpec, declaration_hash
from butlers.gateway.config import (
    JSON_NAME,
    MAX_STORE_BYTES,
    GatewayConfig,
    SettingsText,
    read_server_file,
)
from butlers.gateway.sources import ServerFiles
from butlers.text import printable

STORE_NAME = "gateway-approvals.json"
_VARIABLE = re.compile(r"\$\{(?:env:)?([A-Za-z_][A-Za-z0-9_]*)")  # ${VAR}, VS Code's ${env:VAR}
_VERSION = 2  # 1: servers only (no settings: a project's next start is its first)


def store_path(environ: Mapping[str, str]) -> Path:
    """`$XDG_STATE_HOME/butlers/gateway-approvals.json`; a relative XDG_STATE_HOME is ignored,
    as the XDG spec says, for `~/.local/state`."""
    state = environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        home = environ.get("HOME") or str(Path.home())
        state = os.path.join(home, ".local", "state")
    return Path(state) / "butlers" / STORE_NAME


def project_key(directory: Path, config_file: Path | None = None) -> str:
    """The project a gateway serves: its --dir, absolute (symbolic links resolved, so two
    spellings of one directory agree). Not its --config: a `--config` added to the host's
    entry made a new project, whose first start approved everything (a walkthrough); the
    servers of every --config it is started with are approved under the one project."""
    return json.dumps([str(directory.resolve()), None])


def fingerprint(spec: ChildSpec) -> str:
    """What a server runs or reaches, hashed, as its file writes it (`declared_as`: a token
    rotated in the environment, or a shell with other values, is no change of the file; a
    token that moved into the file is): a description may change freely, the command, its
    arguments, env, cwd, URL and headers may not."""
    return spec.declared_as or declaration_hash(
        cmd=spec.cmd,
        args=spec.args,
        env=spec.env,
        cwd=spec.cwd,
        url=spec.url,
        headers=spec.headers,
    )


@dataclass(frozen=True)
class ProjectRecord:
    """What a person approved for one project: each server's declaration (its hash), and the
    settings; `settings` None: nothing recorded for it yet (its first start)."""

    servers: Mapping[str, str]
    settings: SettingsText | None


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
        return dict(self._read()["approved"].get(key, {}))

    def record(self, key: str) -> ProjectRecord:
        """Everything approved for project `key` (ConfigError as `approved`)."""
        data = self._read()
        settings = data["settings"].get(key)
        return ProjectRecord(
            servers=dict(data["approved"].get(key, {})),
            settings=None if settings is None else SettingsText(settings["file"], settings["text"]),
        )

    def approve(
        self, key: str, hashes: Mapping[str, str], settings: SettingsText | None = None
    ) -> None:
        """Record `hashes` (server name -> fingerprint) for project `key`, keeping the rest,
        and `settings` when given."""
        with self._locked():
            self._write_approved(self._read(), key, hashes, settings)

    def approve_first(self, key: str, hashes: Mapping[str, str], settings: SettingsText) -> bool:
        """What a first start (or install) approves: `hashes` and `settings`, only if nothing
        is recorded for project `key` yet; whether it was recorded now."""
        with self._locked():
            data = self._read()
            if key in data["settings"]:
                return False
            self._write_approved(data, key, hashes, settings)
            return True

    def _write_approved(
        self,
        data: dict[str, dict[str, Any]],
        key: str,
        hashes: Mapping[str, str],
        settings: SettingsText | None,
    ) -> None:
        data["approved"][key] = {**data["approved"].get(key, {}), **hashes}
        if settings is not None:
            data["settings"][key] = {"file": settings.name, "text": settings.text}
        self._write({"version": _VERSION, **data})

    def _read(self) -> dict[str, dict[str, Any]]:
        """{"approved": {project: {name: hash}}, "settings": {project: {"file", "text"}}}."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return {"approved": {}, "settings": {}}
        except OSError as exc:
            raise ConfigError(self.path, None, f"not readable: {exc.strerror}") from exc
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise ConfigError(
                self.path, None, "owned by another user or writable by others: not trusted"
            )
        try:
            data: Any = json.loads(read_server_file(self.path, limit=MAX_STORE_BYTES))
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
        settings = data.get("settings", {})
        if not isinstance(settings, dict) or not all(
            isinstance(s, dict)
            and isinstance(s.get("file"), str | None)
            and isinstance(s.get("text"), str | None)
            for s in settings.values()
        ):
            raise ConfigError(
                self.path, "settings", 'expected an object of projects, each {"file", "text"}'
            )
        return {"approved": approved, "settings": settings}

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


def same_settings(a: SettingsText | None, b: SettingsText, directory: Path) -> bool:
    """Whether two settings files say the same: the same text, or the same once parsed (a
    comment or the layout changed: no approval needed, a walkthrough found that friction)."""
    if a is None:
        return False
    if a == b:
        return True
    try:
        return a.config(directory).model_dump() == b.config(directory).model_dump()
    except ConfigError:
        return False


@dataclass(frozen=True)
class StartTrust:
    """What a gateway starting for a project may run (see the module): the settings to use,
    the servers to hold pending, and what to tell about either."""

    config: GatewayConfig
    held: tuple[ChildSpec, ...] = ()  # declared, not approved: pending
    changed: frozenset[str] = frozenset()  # of those, the ones approved once as declared then
    settings_note: str | None = None  # the settings file changed since its approval
    first: bool = False  # nothing was recorded for the project: all approved as declared now
    current: SettingsText | None = None  # the settings file as it was at this start


def start_trust(
    directory: Path,
    config_file: Path | None,
    environ: Mapping[str, str],
    read_servers: Callable[[GatewayConfig], list[ChildSpec]],
    *,
    record: bool,
) -> StartTrust:
    """What the gateway of `directory` (and `config_file`) may run at its start, from the
    approvals store; `read_servers` reads what the servers' files declare under given
    settings. At the project's first start, what is declared is approved (recorded, when
    `record`: not for a dry run). ConfigError when the settings file or the store cannot be
    read (blocking: it reads files)."""
    current = SettingsText.of(directory)
    store = ApprovalStore.for_environ(environ)
    key = project_key(directory, config_file)
    try:
        approved = store.record(key)
    except ConfigError as exc:
        raise ConfigError(
            exc.path,
            exc.key,
            f"{exc.problem}: the gateway cannot tell which servers were approved; fix the file "
            "(removing it makes the next start of every project approve what is declared then)",
        ) from None
    if approved.settings is None:  # the first start here
        config = current.config(directory)
        declared = first_declared(read_servers(config))
        if not record:
            return StartTrust(config, first=True, current=current)
        hashes = {name: fingerprint(spec) for name, spec in declared.items()}
        if store.approve_first(key, hashes, current):
            return StartTrust(config, first=True, current=current)
        # Another start (or install) recorded first, meanwhile: what it recorded counts.
        approved = store.record(key)
        assert approved.settings is not None, "approve_first saw it recorded"
    note = None
    if not same_settings(approved.settings, current, directory):
        command = shlex.join(approve_command((), directory, config_file))
        note = (
            f"{current.shown_name} changed since it was approved: the gateway runs the "
            f"approved one; `{command} --show` shows the changes, `{command} --settings` "
            "approves them alone (then restart)"
        )
        config = approved.settings.config(directory)
    else:
        config = current.config(directory)
    if config.reload == "apply":  # a person approved starting whatever is declared
        return StartTrust(config, settings_note=note, current=current)
    held = tuple(
        spec
        for spec in first_declared(read_servers(config)).values()
        if approved.servers.get(spec.name) != fingerprint(spec)
    )
    changed = frozenset(spec.name for spec in held if spec.name in approved.servers)
    return StartTrust(config, held, changed, note, current=current)


def approve_as_declared(
    directory: Path, config_file: Path | None, environ: Mapping[str, str]
) -> list[str]:
    """What `butlers gateway install` approves: the servers declared now and the settings, if
    nothing is recorded for the project yet (its gateway's first start would approve the
    same, later, when others may have written there meanwhile); a line saying so, or none."""
    try:
        settings = SettingsText.of(directory)
        declared = first_declared(
            _server_files(directory, config_file, environ, settings).read()[0]
        )
        recorded = ApprovalStore.for_environ(environ).approve_first(
            project_key(directory, config_file),
            {name: fingerprint(spec) for name, spec in declared.items()},
            settings,
        )
    except ConfigError as exc:
        raise CommandError(f"{exc} (nothing was approved)") from exc
    if not recorded:
        return []
    return [
        f"approved as declared now: {', '.join(map(_shown, declared)) or 'no servers'} and "
        f"{settings.shown_name if settings.name else 'the default settings'}; a server added "
        "or changed later starts once `butlers gateway approve` says so"
    ]


def _server_files(
    directory: Path, config_file: Path | None, environ: Mapping[str, str], settings: SettingsText
) -> ServerFiles:
    config = settings.config(directory)
    return ServerFiles(
        directory=directory,
        environ=environ,
        config_file=config_file,
        discover_globs=config.discover_globs,
        base_dir=config.base_dir,
    )


def pending_detail(
    spec: ChildSpec, directory: Path, config_file: Path | None, *, changed: bool, running: bool
) -> str:
    """What gateway_status and the log say of a server held pending: new or changed since its
    approval, where, the command that lets it in, and whether its approved one runs on."""
    command = approve_command((), directory, config_file)
    let_in = shlex.join([*command[:3], spec.name, *command[3:]])
    return (
        f"{'changed' if changed else 'new'} in {spec.source} and not approved: not started "
        f"until a person runs `{let_in}`" + ("; the running one stays as it was" if running else "")
    )


def approve(
    directory: Path,
    config_file: Path | None,
    names: Sequence[str],
    environ: Mapping[str, str],
    *,
    record: bool = True,
    settings_only: bool = False,
) -> list[str]:
    """Approve the current declarations of `names` (every declared server, and the settings
    file, when empty) for the gateway of --dir `directory` (and --config), and say what was
    approved: each server as written in its file (`described`), no value shown; the settings'
    changes since their last approval. CommandError when a name is not declared, or the
    settings or the --config file cannot be read (blocking: run it in a thread). `record`
    False (`--show`): what it would approve, recorded nothing."""
    if not directory.is_dir():
        raise CommandError(f"--dir {directory}: not a directory")
    try:
        settings = SettingsText.of(directory)
        files = _server_files(directory, config_file, environ, settings)
    except ConfigError as exc:
        raise CommandError(f"{exc} (fix it, then approve)") from exc
    declared, skipped = files.read()
    lines: list[str] = []
    for problem in skipped:
        if problem.server is None and problem.error.path == config_file:
            raise CommandError(str(problem.error))
        lines.append(f"not approved (cannot be read): {_shown(str(problem.error))}")
    current = first_declared(declared)
    unknown = [name for name in names if name not in current]
    unreadable = {p.server: p for p in skipped if p.server is not None}
    if cannot := [name for name in unknown if name in unreadable]:
        raise CommandError(
            "; ".join(f"{_shown(str(unreadable[name].error))}" for name in cannot)
            + ": declared, but not readable with this shell's environment (set what it "
            "names, then approve)"
        )
    if unknown:
        raise CommandError(
            f"not declared in the files of --dir {directory}"
            f"{f' and --config {config_file}' if config_file else ''}: {', '.join(unknown)}"
        )
    if settings_only and names:
        raise CommandError("--settings approves gateway.toml alone: name no server with it")
    chosen = (
        []
        if settings_only
        else [current[name] for name in names]
        if names
        else list(current.values())
    )
    store = ApprovalStore.for_environ(environ)
    key = project_key(directory, config_file)
    try:
        known = store.record(key)
    except ConfigError as exc:
        raise CommandError(str(exc)) from exc
    new = {spec.name: fingerprint(spec) for spec in chosen}
    fresh = [spec for spec in chosen if known.servers.get(spec.name) != new[spec.name]]
    settings_changed = not names and not same_settings(known.settings, settings, directory)
    if not fresh and not settings_changed:
        if settings_only:
            return [*lines, f"{settings.shown_name}: nothing new to approve"]
        if not chosen:
            return [*lines, "no servers are declared there: nothing to approve"]
        return [*lines, "nothing new to approve: " + ", ".join(new) + " already approved"]
    if record:
        store.approve(
            key,
            {spec.name: new[spec.name] for spec in fresh},
            settings if settings_changed else None,
        )
    shown = first_declared(files.as_written().read()[0])  # as written: what is shown
    verb = "approved" if record else "would approve"
    if settings_changed:
        lines.append(f"{verb} {settings.shown_name}: {settings_changes(known.settings, settings)}")
    lines += [
        f"{verb} {_shown(spec.name)}: {described(shown.get(spec.name, spec))}" for spec in fresh
    ]
    lines += [f"already approved: {_shown(spec.name)}" for spec in chosen if spec not in fresh]
    if names and not same_settings(known.settings, settings, directory):
        lines.append(
            f"not approved: {settings.shown_name}, changed since its approval (`--settings` "
            "approves it alone)"
        )
    if not record:
        lines.append("(nothing recorded: run it without --show to approve)")
        return lines
    lines.append(
        f"(recorded in {store.path}; a running gateway starts the servers now"
        + (
            f", and uses this {settings.shown_name} from its next start)"
            if settings_changed
            else ")"
        )
    )
    return lines


def first_declared(declared: Iterable[ChildSpec]) -> dict[str, ChildSpec]:
    """Each name's first declaration: where a name comes twice the first wins, as in the
    gateway."""
    current: dict[str, ChildSpec] = {}
    for spec in declared:
        current.setdefault(spec.name, spec)
    return current


def settings_changes(before: SettingsText | None, after: SettingsText) -> str:
    """What changed in the settings, key by key (`reload: "approve" -> "apply"`), for a person
    to judge; settings hold names and choices, no secrets (those are in the environment)."""
    if before is None:
        return "as it is now (no earlier approval)"
    if before.name is not None and after.name is not None and before.name != after.name:
        return f"now {after.shown_name}, was {before.shown_name}"
    old, new = _flat(before), _flat(after)
    changes = [
        f"{key}: {_value(old.get(key))} -> {_value(new.get(key))}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, _ABSENT) != new.get(key, _ABSENT)
    ]
    return "; ".join(changes) if changes else "only its layout or comments changed"


_ABSENT = object()


def _flat(settings: SettingsText) -> dict[str, Any]:
    """A settings file's keys, dotted (`suites.files.pass_env`); {} when it cannot be parsed
    (the approval of a file that does not parse is refused before this)."""
    if settings.text is None:
        return {}
    try:
        data = (
            json.loads(settings.text)
            if settings.name == JSON_NAME
            else tomllib.loads(settings.text)
        )
    except ValueError:
        return {}
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value

    walk("", data)
    return flat


def _value(value: Any) -> str:
    if value is None:
        return "(unset)"
    return _shown(printable(json.dumps(value, ensure_ascii=False), 80))


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
