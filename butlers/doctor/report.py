"""What doctor looks at (`Subject`), what it finds (`Check`), and how it is printed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from butlers.config import ButlerConfig, FleetConfig, Placement
    from butlers.redact import Redactor
    from butlers.settings import Settings

Status = Literal["ok", "warn", "fail"]
ENV_FILE = ".env"


@dataclass(frozen=True)
class Check:
    """One finding: `detail` says what was found, and when not ok, what to do."""

    name: str
    status: Status
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def warn(name: str, detail: str) -> Check:
    return Check(name, "warn", detail)


def fail(name: str, detail: str) -> Check:
    return Check(name, "fail", detail)


@dataclass
class Subject:
    """The config directory under examination and the environment its butlers would run in.

    `environ` is the process's environment over the variables of `<config dir>/.env`;
    `from_file` names those only the file set. `settings` are read from `environ`."""

    config_dir: Path
    fleet: FleetConfig
    environ: Mapping[str, str]
    settings: Settings
    env_file: Path | None = None
    from_file: frozenset[str] = frozenset()
    timeout_s: float = 10.0
    # Filled by the database check when the server answered: the connection string of a
    # database by name (the online checks read the switchboard's registry with it).
    dsn: dict[str, str] = field(default_factory=dict)

    @property
    def butlers(self) -> tuple[ButlerConfig, ...]:
        return self.fleet.butlers

    def variable(self, name: str) -> str | None:
        """A variable's value (None when unset or empty): for checking and sending, never
        for printing."""
        return self.environ.get(name) or None

    def where_to_set(self, *names: str) -> str:
        """Where the owner should put a variable: the .env file doctor read, else the
        environment `butlers` runs with."""
        target = self.env_file or (self.config_dir / ENV_FILE)
        return f"set {' and '.join(names)} in {target} or in the environment `butlers` runs with"


@dataclass(frozen=True)
class Findings:
    checks: list[Check]
    redactor: Redactor


async def examine(
    config_dir: Path, settings: Settings, *, online: bool, timeout_s: float, port_offset: int = 0
) -> Findings:
    """Every check, in a stable order: the offline ones, then (`online`) the ones that ask
    other servers, which run at once. `port_offset`: the fleet `butlers up --port-offset`
    starts (its ports are checked, and asked at --online)."""
    from butlers.doctor import local, offline
    from butlers.redact import Redactor

    # Reading files and directories: off the event loop.
    subject, checks = await asyncio.to_thread(
        load_subject, config_dir, settings, timeout_s, port_offset
    )
    redactor = Redactor.from_environment(subject.butlers, environ=subject.environ)
    redactor.add(Redactor.from_environment(subject.butlers, environ=settings.environ).secrets)
    with _redacted_logs(redactor):
        checks += await asyncio.to_thread(offline.checks, subject)
        checks += await local.checks(subject)
        if online:
            from butlers.doctor import online as online_checks

            checks += await online_checks.checks(subject)
    return Findings(checks, redactor)


def load_subject(
    config_dir: Path, settings: Settings, timeout_s: float, port_offset: int = 0
) -> tuple[Subject, list[Check]]:
    """The configs and the environment; a directory that is missing or unreadable, a broken
    butler.toml or a bad .env are checks of their own (fail), never a traceback."""
    from butlers.config import Placement
    from butlers.errors import ButlersError
    from butlers.settings import Settings as SettingsClass

    checks: list[Check] = []
    environ: dict[str, str] = dict(settings.environ)
    env_file = config_dir / ENV_FILE
    from_file: set[str] = set()
    has_env_file = _is_file(env_file)
    if has_env_file:
        try:
            file_values = _read_env_file(env_file)
        except (OSError, UnicodeDecodeError) as exc:
            checks.append(fail("env-file", f"cannot read {env_file}: {exc}; fix its permissions"))
            file_values = {}
        for name, value in file_values.items():
            if value and not environ.get(name):
                environ[name] = value
                from_file.add(name)
    try:
        merged = SettingsClass.from_environ(environ)
    except ButlersError as exc:
        checks.append(fail("env-file", f"{env_file}: {exc}"))
        merged, environ = settings, dict(settings.environ)
    try:
        placement = Placement.from_environment(environ)
    except ButlersError as exc:
        checks.append(fail("environment", f"{exc}"))
        placement = Placement()
    fleet, found = _load_fleet(config_dir, placement)
    checks += found
    if port_offset:
        from butlers.cli.fleet import PortChoice  # a port out of range: as `up` says it

        fleet = replace(fleet, butlers=tuple(PortChoice(offset=port_offset).apply(fleet.butlers)))
    if has_env_file and not any(c.name == "env-file" for c in checks):
        checks.append(_env_file_check(env_file, from_file))
    checks.sort(key=lambda c: c.name.split(".")[0] != "config")  # first: the rest follows from it
    subject = Subject(
        config_dir=config_dir,
        fleet=fleet,
        environ=environ,
        settings=merged,
        env_file=env_file if has_env_file else None,
        from_file=frozenset(from_file),
        timeout_s=timeout_s,
    )
    return subject, checks


def _load_fleet(config_dir: Path, placement: Placement) -> tuple[FleetConfig, list[Check]]:
    """The butlers of `config_dir`, and the checks of what did not load."""
    from butlers.config import FleetConfig, config_dir_problem, load_config_dir

    nothing = FleetConfig((), ())
    if (problem := config_dir_problem(config_dir)) is not None:
        return nothing, [fail("config", problem)]
    try:
        fleet = load_config_dir(config_dir, placement)
    except OSError as exc:
        return nothing, [
            fail(
                "config",
                f"cannot read the config directory {config_dir}: {exc.strerror or exc}; fix its "
                "permissions",
            )
        ]
    return fleet, _config_checks(config_dir, fleet)


def _is_file(path: Path) -> bool:
    """Whether `path` is a file; False also when a directory above it cannot be entered
    (that is said of the config directory itself)."""
    try:
        return path.is_file()
    except OSError:
        return False


def _read_env_file(path: Path) -> dict[str, str | None]:
    """`NAME=value` lines, as docker compose and python-dotenv read them (python-dotenv comes
    with pydantic-settings)."""
    from dotenv import dotenv_values

    path.open("rb").close()  # an unreadable file is an error, not an empty file
    return dotenv_values(path)


def _env_file_check(env_file: Path, from_file: set[str]) -> Check:
    if not from_file:
        return ok("env-file", f"read {env_file}; the environment already sets what it sets")
    names = ", ".join(sorted(from_file))
    return warn(
        "env-file",
        f"set only in {env_file}, which `butlers up` does not read: {names}; export them "
        f"before starting (set -a; . {env_file}; set +a) or put them in the service's "
        "environment",
    )


def _config_checks(config_dir: Path, fleet: FleetConfig) -> list[Check]:
    checks = [
        fail(f"config.{error.path.parent.name}", f"{error}; fix it (that butler does not start)")
        for error in fleet.errors
    ]
    names = ", ".join(b.name for b in fleet.butlers)
    if not fleet.butlers and not fleet.errors:
        checks.append(
            fail(
                "config",
                f"no butler in {config_dir} (no <name>/butler.toml): create one with "
                f"`butlers init`, or name your config directory with --config-dir",
            )
        )
    elif fleet.butlers:
        checks.insert(
            0, ok("config", f"{len(fleet.butlers)} butlers load from {config_dir}: {names}")
        )
    return checks


@contextlib.contextmanager
def _redacted_logs(redactor: Redactor) -> Iterator[None]:
    """Every log record made while doctor runs is redacted with what doctor knows (the
    variables of .env too, which the CLI's own redactor never saw); the previous record
    factory is put back after."""
    from butlers.redact import install_log_redaction

    factory = logging.getLogRecordFactory()
    install_log_redaction(redactor)
    try:
        yield
    finally:
        logging.setLogRecordFactory(factory)


def print_report(checks: list[Check], redactor: Redactor, *, as_json: bool) -> None:
    """One line per check (`status  name  detail`), or one JSON object; redacted whatever the
    checks wrote."""
    clean = [Check(c.name, c.status, redactor(c.detail)) for c in checks]
    if as_json:
        print(json.dumps({"checks": [c.as_dict() for c in clean]}))
        return
    width = max((len(c.name) for c in clean), default=0)
    for check in clean:
        # One line per check, whatever a library's message held (a server's log lines).
        detail = "; ".join(part.strip() for part in check.detail.splitlines() if part.strip())
        print(f"{check.status:<4}  {check.name:<{width}}  {detail}")
    sys.stdout.flush()
