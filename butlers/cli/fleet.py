"""`butlers up`, `butlers run NAME` and `butlers db upgrade`: the fleet in this process.

PostgreSQL (embedded unless DATABASE_URL) starts in a thread while the butlers' libraries
import; then every butler starts (butlers.daemon), the ready table is printed, and SIGINT or
SIGTERM stops them in order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import gc
import io
import json
import logging
import os
import shlex
import stat
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers import logs
from butlers.build import build_label
from butlers.cli.process import (
    collect_as_a_server,
    collector_paused,
    install_stop_signals,
    keep_memory_private,
    on_stop_signal,
)
from butlers.cli.render import print_rows
from butlers.errors import ButlersError, CommandError, NotRegularFile
from butlers.files import read_regular
from butlers.text import printable

if TYPE_CHECKING:
    from butlers.config import ButlerConfig
    from butlers.context import ModuleStatus
    from butlers.daemon import ButlerDaemon
    from butlers.redact import Redactor
    from butlers.settings import Settings
    from butlers.telemetry import Telemetry

DEFAULT_CONFIG_DIR = Path("config/butlers")
logger = logging.getLogger(__name__)


def select_configs(
    config_dir: Path, only: Sequence[str] | None, settings: Settings
) -> list[ButlerConfig]:
    """The butlers to start: every one that loads (or those of `only`). Each config error is
    printed, and that butler left out."""
    return _selection(config_dir, only, settings)[0]


def _selection(
    config_dir: Path, only: Sequence[str] | None, settings: Settings
) -> tuple[list[ButlerConfig], list[str]]:
    """select_configs, and the names of the butlers left out for their config errors (of
    those asked for)."""
    from butlers.config import CONFIG_FILENAME, Placement, config_dir_problem, load_config_dir

    if (problem := config_dir_problem(config_dir)) is not None:
        raise CommandError(problem)
    fleet = load_config_dir(config_dir, Placement.from_environment(settings.environ))
    for error in fleet.errors:
        print(f"error: {error} (butler skipped)", file=sys.stderr)
    broken = [e.path.parent.name for e in fleet.errors if e.path.name == CONFIG_FILENAME]
    if only:
        unknown = [name for name in only if fleet.get(name) is None]
        if unknown:
            known = ", ".join(b.name for b in fleet.butlers) or "none"
            raise CommandError(
                f"no loadable butler named {', '.join(map(repr, unknown))} in {config_dir} "
                f"(loadable: {known})"
            )
        return [b for b in fleet.butlers if b.name in only], []
    if not fleet.butlers:
        raise CommandError(f"no loadable butler in {config_dir}")
    return list(fleet.butlers), broken


def data_dir_not_loaded(config_dir: Path, settings: Settings) -> str | None:
    """Why not to start (or upgrade) here: the config directory's `.env` names a data
    directory (`butlers init` writes it there) that this shell has not loaded, so the data
    would go elsewhere, an empty database made without a word (it did: `butlers db upgrade`
    said "up to date" of a new one). None when the environment sets BUTLERS_DATA_DIR itself
    (its choice wins) or both name the same place."""
    env_file = config_dir / ".env"
    if settings.environ.get("BUTLERS_DATA_DIR") or not env_file.is_file():
        return None
    from dotenv import dotenv_values

    try:
        named = dotenv_values(env_file).get("BUTLERS_DATA_DIR")
    except (OSError, UnicodeDecodeError):
        return None  # doctor says what is wrong with the file
    # Absolute and with `..` folded, both: the same place written two ways is the same.
    here = Path(os.path.abspath(settings.data_dir.expanduser()))
    if not named or Path(os.path.abspath(Path(named).expanduser())) == here:
        return None
    load = f"set -a; . {shlex.quote(str(env_file))}; set +a"
    # Made printable and cut: a quote left open runs on over the next lines (a secret's).
    shown = printable(named, 120) if "\n" not in named else "(a value over several lines)"
    return (
        f"{env_file} sets BUTLERS_DATA_DIR={shown}, which this shell has not loaded: the data "
        f"would be in {here} instead. Load it first ({load}), or set BUTLERS_DATA_DIR yourself"
    )


CLAIM_FILE = "config-dir"  # in BUTLERS_DATA_DIR: the config directory whose data it holds


def claim_data_dir(data_dir: Path, config_dir: Path) -> None:
    """The data directory belongs to one config directory, recorded at its first use.

    A shell that loaded one fleet's `.env` (its BUTLERS_DATA_DIR and bot token) and then ran
    `make up` started the shipped example config on that fleet's databases, polling its bot:
    the example's empty allowlist refused the owner's messages, and nothing of them was kept
    (a walkthrough followed the upgrade steps into it). So another config directory is
    refused here; one whose recorded directory is gone (moved, renamed) takes it over.

    All of it through the directory opened once (not through a link, and ours), under its
    lock: root may run this in a directory whose parent another user can rename."""
    mine = os.fsencode(config_dir.expanduser().resolve())
    try:
        directory = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CommandError(f"{data_dir}: cannot be opened as a directory ({exc.strerror})") from exc
    try:
        if os.fstat(directory).st_uid != os.geteuid():
            raise CommandError(f"{data_dir} is not yours: give butlers a directory of its own")
        fcntl.flock(directory, fcntl.LOCK_EX)
        recorded = _recorded_config_dir(directory, data_dir / CLAIM_FILE)
        if recorded == mine:
            return
        shown, wanted = os.fsdecode(recorded), os.fsdecode(mine)
        if recorded and _still_there(recorded, data_dir):
            raise CommandError(
                f"{data_dir} holds the databases of the butlers in {shown}, not of {wanted}. "
                f"Start those (butlers up --config-dir {shlex.quote(shown)}), or give these "
                "their own data directory (this shell may have loaded the other config's .env: "
                "unset BUTLERS_DATA_DIR, or set it to another directory). If that config "
                f"directory moved to {wanted}, remove {data_dir / CLAIM_FILE}"
            )
        if recorded:  # another config directory's data, taken over: worth a warning
            logger.warning(
                "%s now serves the config directory %s (%s is gone)",
                data_dir,
                wanted,
                shown,
                extra={"action": "data_dir_claimed"},
            )
        elif (data_dir / "pgdata").exists():  # data from before the claim existed: routine
            logger.info(
                "%s now serves the config directory %s (its data was there before)",
                data_dir.resolve(),
                wanted,
                extra={"action": "data_dir_claimed"},
            )
        new = f"{CLAIM_FILE}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(new, dir_fd=directory)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(new, flags, 0o600, dir_fd=directory)
        with os.fdopen(fd, "wb") as file:
            file.write(mine + b"\n")
        os.replace(new, CLAIM_FILE, src_dir_fd=directory, dst_dir_fd=directory)
    finally:
        os.close(directory)  # and with it the lock


def _still_there(recorded: bytes, data_dir: Path) -> bool:
    """Whether the config directory a claim names is still there: it is, unless looking finds
    nothing. One that cannot be looked at (a parent closed to this user, a loop of links) is
    not taken for gone: its data would have been taken over while the fleet still lived."""
    try:
        return stat.S_ISDIR(os.stat(recorded).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        shown = os.fsdecode(recorded)
        raise CommandError(
            f"{data_dir} holds the databases of the butlers in {shown}, which cannot be looked "
            f"at ({exc.strerror}): start those, or if that directory moved away, remove "
            f"{data_dir / CLAIM_FILE}"
        ) from exc


def _recorded_config_dir(directory: int, shown: Path) -> bytes:
    """The config directory the claim names (b"" without one): a regular file only, not
    through a link, nor stuck on a FIFO."""
    try:
        return read_regular(CLAIM_FILE, 4096, dir_fd=directory).removesuffix(b"\n")
    except FileNotFoundError:
        return b""
    except NotRegularFile:
        raise CommandError(f"{shown} is not a regular file; remove it") from None
    except OSError as exc:
        raise CommandError(f"{shown}: cannot be read ({exc.strerror}); remove it") from exc


def follow_moved_config_dir(data_dir: Path, config_dir: Path) -> None:
    """As root, before the server is located: the data directory inside a config directory
    that moved (its claim names a config directory that is gone) has its PostgreSQL data,
    kept under /var/lib/butlers by the data directory's old path, follow it
    (`pg_root_home.follow_move`). The claim is read as `claim_data_dir` reads it: through the
    directory opened once, not through a link, root's own, under its lock (the directory
    above is the user's, who could swap in one with a claim of their choosing: a review)."""
    if os.geteuid() != 0:
        return
    try:
        inside = data_dir.resolve().relative_to(config_dir.resolve())
        directory = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (OSError, ValueError):  # not there (nothing to follow); not inside
        return
    try:
        if os.fstat(directory).st_uid != 0:
            return  # someone else's: `make_private_dir` refuses it
        fcntl.flock(directory, fcntl.LOCK_EX)
        claim = _recorded_config_dir(directory, data_dir / CLAIM_FILE)
        recorded = os.fsdecode(claim)
        if not recorded or recorded == str(config_dir.resolve()):
            return
        try:
            if _still_there(claim, data_dir):
                return
        except CommandError:  # cannot tell: not followed (claim_data_dir says why)
            return
        from butlers import pg_root_home

        old = Path(recorded) / inside / "pgdata"
        pg_root_home.follow_move(old, data_dir.resolve() / "pgdata")
    finally:
        os.close(directory)


def moved_data_refusal(config_dir: Path, settings: Settings, pgdata: Path) -> str | None:
    """Why not to start empty databases in `pgdata` (where the server's data is, located):
    there are none there yet, but the config directory's own data directory (`.butlers` in
    it, where `butlers init` puts it) holds its butlers' databases. Its BUTLERS_DATA_DIR
    points elsewhere: a `.env` naming the directory the config directory was moved from, or
    a relative path read from another working directory. Each started a fresh, empty fleet
    (no schedules, memories or pairings) without a word (a walkthrough). None otherwise."""
    from butlers.settings import DEFAULT_DATA_DIR

    if (pgdata / "PG_VERSION").exists():
        return None
    own = (config_dir / DEFAULT_DATA_DIR).resolve()
    here = settings.data_dir.expanduser().resolve()
    if own == here or not _holds_databases(own / "pgdata"):
        return None
    env_file = config_dir / ".env"
    where = f"in {env_file}, then load it" if env_file.is_file() else "in the environment"
    return (
        f"BUTLERS_DATA_DIR is {here}, which holds no databases, but {own}, this config "
        f"directory's own data directory, holds its butlers' databases (did the config "
        "directory move, or is BUTLERS_DATA_DIR a relative path read from another "
        "directory?). butlers does not start empty ones in their place: set "
        f"BUTLERS_DATA_DIR={shlex.quote(str(own))} {where}. To start afresh on purpose, "
        f"move {own / 'pgdata'} away first"
    )


def _no_databases(settings: Settings, data_dir: Path) -> str:
    named = (
        "BUTLERS_DATA_DIR"
        if settings.variable("BUTLERS_DATA_DIR")
        else "the default, BUTLERS_DATA_DIR being unset: read from the directory you are in"
    )
    return (
        f"no databases in {data_dir} ({named}): `butlers db upgrade` migrates the databases "
        "of butlers that ran before. If yours did, their data is where `butlers up` ran from: "
        "set BUTLERS_DATA_DIR to that directory's .butlers. A new fleet needs no upgrade: "
        "`butlers up` makes its databases"
    )


def _holds_databases(pgdata: Path) -> bool:
    """Whether the data asked for at `pgdata` exists: there, or (as root) where it is kept."""
    if (pgdata / "PG_VERSION").exists():
        return True
    if os.geteuid() != 0:
        return False
    from butlers import pg_root_home

    kept = pg_root_home.kept_data(pgdata)
    return kept is not None and (kept / "PG_VERSION").exists()


def make_private_dir(directory: Path, *, create: bool = True, passable: bool = False) -> None:
    """`directory` (BUTLERS_DATA_DIR: sessions' files, private MCP configs, the butlers'
    token), made when it is missing (`create`): 0700, or 0711 (`passable`: as root, the
    embedded PostgreSQL's own account passes through to its data below); its parents as
    `mkdir -p` makes them. Made here, not left to whoever comes first: another user could
    otherwise make it between a check and its use. One that `data_dir_refusal` refuses is
    a CommandError; write access for others on one of ours is taken away (said in the log).
    Read access is doctor's to warn of, as the files below are each private."""
    if create:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
            if passable:
                directory.chmod(0o711)
    if (refusal := data_dir_refusal(directory)) is not None:
        raise CommandError(refusal)
    try:
        mode = directory.stat().st_mode
    except FileNotFoundError:
        return  # (create=False) nothing there yet
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        logger.warning(
            "%s was writable by other users (%s): taking that away",
            directory,
            stat.filemode(mode),
        )
        directory.chmod(stat.S_IMODE(mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def data_dir_refusal(directory: Path) -> str | None:
    """Why `directory` cannot be the data directory (None: it can, or is not there yet).

    It must be ours, or root's and closed to others' writes: another user's (say one made in
    a shared /tmp before us), or a symbolic link of theirs, could be read and rearranged by
    its owner, who would then hold what the sessions see and the token that drives the
    butlers. A directory everyone shares (the sticky bit: /tmp) is refused, and never changed.
    """
    shown = f"the data directory {directory} (BUTLERS_DATA_DIR)"
    try:
        link = directory.lstat()
        info = directory.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot use {shown}: {exc.strerror}"
    me = os.geteuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        return _not_yours(shown, link, "a symbolic link, and its owner could point it elsewhere")
    if not stat.S_ISDIR(info.st_mode):
        return f"{shown} is not a directory: set BUTLERS_DATA_DIR to one"
    if info.st_uid not in (me, 0):
        return _not_yours(
            shown, info, "and its owner could read the sessions' files and the token kept there"
        )
    others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    below = (
        "Set BUTLERS_DATA_DIR to a directory below it, which butlers makes: "
        f"{directory / 'butlers'}"
    )
    if others_write and info.st_mode & stat.S_ISVTX:
        return (
            f"refusing {shown}: it is a directory everyone shares "
            f"({stat.filemode(info.st_mode)}). {below}"
        )
    if others_write and info.st_uid != me:  # root's, open to all (a container's emptyDir)
        return (
            f"refusing {shown}: it is root's and others may write in it "
            f"({stat.filemode(info.st_mode)}), which butlers cannot change. {below}"
        )
    return None


def _not_yours(shown: str, info: os.stat_result, why: str) -> str:
    from butlers.db.reach import owner_names

    return (
        f"refusing {shown}: it belongs to {owner_names(info)[0]} (uid {info.st_uid}), not to "
        f"you, {why}. Set BUTLERS_DATA_DIR to a directory of your own."
    )


def print_ready_table(
    daemons: Sequence[ButlerDaemon], db_description: str, warnings: Sequence[str] = ()
) -> None:
    """The table, then the warnings (stderr) above the last line, where they are seen."""
    rows = [("NAME", "MCP (SSE)", "STREAMABLE HTTP", "HEALTH")]
    rows += [
        (d.config.name, d.sse_url, f"{d.base_url}/mcp", f"{d.base_url}/health") for d in daemons
    ]
    print(f"Butlers {build_label()} ready ({db_description}):")
    print_rows(rows, indent="  ")
    for daemon in daemons:  # (with --port-offset the docs' 8100 is not where it is)
        if (url := dashboard_url(daemon)) is not None:
            print(f"Dashboard: {url}")
    sys.stdout.flush()  # (two streams: the table first on a terminal)
    print_warnings(warnings)
    print("Press Ctrl-C to stop.", flush=True)


def dashboard_url(daemon: ButlerDaemon) -> str | None:
    """Where the switchboard's dashboard is served; None for another butler."""
    switchboard = daemon.switchboard
    if switchboard is None or switchboard.dashboard is None:
        return None
    return f"{daemon.base_url}/ui"


def print_warnings(warnings: Sequence[str]) -> None:
    for note in warnings:
        logs.ready_warning(note)


def ready_warnings(
    running: Sequence[ButlerDaemon],
    not_loaded: Sequence[str],
    config_dir: Path,
    settings: Settings,
    *,
    whole_directory: bool = True,
    failed: Sequence[str] = (),
) -> list[str]:
    """What the ready table does not say but a person starting the fleet must hear: a butler
    left out for its config error (printed long before, scrolled away by start-up), no
    switchboard (nothing takes messages), a channel that is not running (its variables
    unset: often a .env not loaded), and where the client commands find a switchboard that
    is not at their default address."""
    from butlers.cli.client import DEFAULT_SWITCHBOARD_URL

    notes = [f"not started: {name} (its config error is above)" for name in not_loaded]
    # A butler that could not start (its port taken: already running?) is out of the table.
    notes += [f"not started: {name} (its error is above)" for name in failed]
    if not _claude_code_credentials(settings):
        from butlers.claude_code import claude_binary

        # The bundled binary's path: `claude` is on no PATH the install made (a walkthrough).
        notes.append(
            "Claude Code has no credentials (no ANTHROPIC_API_KEY, no `claude` login): every "
            "session will fail; set ANTHROPIC_API_KEY (in the config's .env, then load it) or "
            f"log in with {claude_binary()} /login"
        )
    switchboards = [d for d in running if d.config.is_switchboard]
    if not switchboards and whole_directory:  # (`--only` leaves it to another process)
        notes.append(
            "no switchboard is running: no message is taken (Telegram, email, `butlers ask`)"
        )
    env_file = config_dir / ".env"
    in_env_file = _names_in_env_file(env_file)
    for daemon in running:
        for module in daemon.context.module_statuses() if daemon.context else ():
            if module.status not in ("skipped", "failed"):
                continue
            note = f"{daemon.config.name}: {module.name} is not running ({module.status}: "
            note += f"{module.detail})"
            if module.missing and in_env_file is not None:
                note += _where_to_set(module, env_file, in_env_file)
            notes.append(note)
    for daemon in switchboards:
        if daemon.sse_url != (settings.switchboard_url or DEFAULT_SWITCHBOARD_URL):
            notes.append(
                f"the client commands (ask, inbox, log...) look for the switchboard at "
                f"{settings.switchboard_url or DEFAULT_SWITCHBOARD_URL}; for this one: "
                f"export BUTLERS_SWITCHBOARD_URL={daemon.sse_url} (or pass --url)"
            )
    return notes


def _where_to_set(module: ModuleStatus, env_file: Path, in_env_file: frozenset[str]) -> str:
    """What to do about a module's unset variables, given what the config's .env sets."""
    absent = [name for name in module.missing if name not in in_env_file]
    if not absent:
        quoted = shlex.quote(str(env_file))
        return f"; it is in {env_file}: load that before starting: set -a; . {quoted}; set +a"
    # Loading .env would not help: the variable's name is wrong, or it was never written.
    one = len(absent) == 1
    return (
        f"; {', '.join(absent)} {'is' if one else 'are'} not in {env_file} either: set "
        f"{'it' if one else 'them'} there, or check the name{'' if one else 's'} "
        f"[modules.{module.name}] gives {'it' if one else 'them'}"
    )


ENV_FILE_BYTES = 1024 * 1024  # of a config directory's .env read for `up`'s hints


def _names_in_env_file(env_file: Path) -> frozenset[str] | None:
    """The variables a config directory's .env sets (names only), or None without one that
    can be read: what `up` may tell a person to load."""
    from dotenv import dotenv_values

    try:  # a regular file only: a FIFO there would hang the start (read_regular)
        text = read_regular(env_file, ENV_FILE_BYTES).decode(errors="replace")
    except OSError:  # (dotenv reads an unreadable file as empty)
        return None
    return frozenset(
        name for name, value in dotenv_values(stream=io.StringIO(text)).items() if value
    )


def _claude_code_credentials(settings: Settings) -> bool:
    """Whether Claude Code has credentials to use, as `doctor` checks them (a HOME that cannot
    be read counts as having them: a warning must never stop a fleet that started)."""
    from butlers.doctor.local import CLOUD_SWITCHES, CREDENTIAL_VARIABLES, claude_login

    if any(settings.variable(n) for n in (*CREDENTIAL_VARIABLES, *CLOUD_SWITCHES)):
        return True
    try:
        return claude_login(settings.environ) is not None
    except OSError:
        return True


def ready_report(
    daemons: Sequence[ButlerDaemon], failed: dict[str, str], db_description: str
) -> dict[str, Any]:
    """The ready table as data (`butlers up --json`): every butler asked for, running or not."""
    butlers: list[dict[str, Any]] = [
        {
            "name": d.config.name,
            "status": "running",
            "url": d.sse_url,
            "mcp_url": f"{d.base_url}/mcp",
            "health_url": f"{d.base_url}/health",
            **({"dashboard_url": url} if (url := dashboard_url(d)) else {}),
        }
        for d in daemons
    ]
    butlers += [{"name": n, "status": "failed", "error": error} for n, error in failed.items()]
    return {"database": db_description, "butlers": sorted(butlers, key=lambda b: b["name"])}


def progress(text: str) -> None:
    """A start-up step, for the person waiting (stderr: stdout stays the ready table or JSON)."""
    logs.progress(text)


@dataclass(frozen=True)
class PortChoice:
    """Ports other than the butler.toml's: `run --port P` (one butler) or `up --port-offset K`
    (every butler). With `--port`, what the registry stores stays the butler.toml's:
    replicas sit behind one address (docs/scaling.md). With `--port-offset` the whole fleet
    moved, and is registered where it listens (Placement.port_offset)."""

    port: int | None = None
    offset: int = 0

    def apply(self, configs: Sequence[ButlerConfig]) -> list[ButlerConfig]:
        chosen = []
        for config in configs:
            port = self.port if self.port is not None else config.port + self.offset
            if not 1 <= port <= 65535:
                option = "--port" if self.port is not None else f"--port-offset {self.offset}"
                raise CommandError(
                    f"{option}: butler {config.name!r} would listen on port {port}; "
                    "expected a port number between 1 and 65535"
                )
            chosen.append(replace(config, port=port))
        return chosen


async def serve(
    config_dir: Path,
    only: Sequence[str] | None,
    *,
    strict: bool,
    redactor: Redactor,
    settings: Settings,
    as_json: bool = False,
    ports: PortChoice | None = None,
) -> int:
    """Run butlers until SIGINT/SIGTERM. `strict`: any butler failing to start is fatal.
    `redactor`: the process's log redaction, told the secrets the configs name."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    collect_as_a_server()
    keep_memory_private()  # its environment holds the fleet's secrets
    selected, not_loaded = _selection(config_dir, only, settings)
    if (elsewhere := data_dir_not_loaded(config_dir, settings)) is not None:
        raise CommandError(elsewhere)
    configs = (ports or PortChoice()).apply(selected)
    from butlers.db import EmbeddedServer, running, server_for

    server = server_for(settings)
    # Someone else's is refused before anything is made for it (locating may make a home).
    await asyncio.to_thread(make_private_dir, settings.data_dir, create=False)
    if isinstance(server, EmbeddedServer):
        await asyncio.to_thread(follow_moved_config_dir, settings.data_dir, config_dir)
        await server.locate()  # as root, the data may live elsewhere: say where it is
        if (refusal := moved_data_refusal(config_dir, settings, server.pgdata)) is not None:
            raise CommandError(refusal)
    # As root the embedded server's own account passes through to its data, when kept here.
    passable = (
        isinstance(server, EmbeddedServer)
        and server.pgdata == server.requested_pgdata
        and os.geteuid() == 0
    )
    await asyncio.to_thread(make_private_dir, settings.data_dir, passable=passable)
    if isinstance(server, EmbeddedServer):  # DATABASE_URL's databases are that server's
        await asyncio.to_thread(claim_data_dir, settings.data_dir, config_dir)
    if isinstance(server, EmbeddedServer):
        first = not (server.pgdata / "PG_VERSION").exists()
        progress(
            f"Initialising PostgreSQL in {server.pgdata} (first start)..."
            if first
            else f"Starting PostgreSQL in {server.pgdata}..."
        )
    async with contextlib.AsyncExitStack() as stack:
        # PostgreSQL starts in a worker thread (initdb alone takes most of a second) while this
        # one imports what the butlers need: on a cold start the two overlap.
        starting = asyncio.create_task(
            stack.enter_async_context(running(server)), name="postgres:start"
        )
        await asyncio.sleep(0)  # let it hand the start to its thread before the imports
        try:
            with collector_paused():
                import butlers.daemon  # noqa: F401 - loaded here, with the collector paused
                from butlers.settings import reveal
                from butlers.telemetry import Telemetry

                logs.adopt_fastmcp_logging()
        finally:
            await starting
        from butlers.redact import Redactor

        redactor.add(Redactor.from_environment(configs, environ=settings.environ).secrets)
        telemetry = Telemetry.from_settings(settings, redact=redactor.clipped)
        async with _flushed(telemetry):
            await _serve_fleet(
                configs,
                server,
                config_dir,
                telemetry,
                settings=settings,
                auth_token=reveal(settings.auth_token),
                stop=stop,
                strict=strict,
                as_json=as_json,
                port_offset=(ports or PortChoice()).offset,
                not_loaded=not_loaded,
                only=only,
            )
    return 0


async def _serve_fleet(
    configs: Sequence[ButlerConfig],
    server: Any,
    config_dir: Path,
    telemetry: Telemetry,
    *,
    settings: Settings,
    auth_token: str | None,
    stop: asyncio.Event,
    strict: bool,
    as_json: bool,
    port_offset: int = 0,
    not_loaded: Sequence[str] = (),
    only: Sequence[str] | None = None,
) -> None:
    from butlers.daemon import hurry_fleet, start_fleet, stop_fleet

    report = await start_fleet(
        configs,
        server,
        data_dir=settings.data_dir,
        settings=settings,
        auth_token=auth_token,
        config_dir=config_dir,
        telemetry=telemetry,
        progress=progress,
        port_offset=port_offset,
    )
    try:
        for name, error in report.failed.items():
            print(f"error: butler {name!r} not started: {error}", file=sys.stderr)
        if as_json and not report.running:  # a script reads stdout: what failed, and why
            print(json.dumps(ready_report([], report.failed, server.description)), flush=True)
        if report.too_new:
            # An older build than the data: half a fleet ran on (the switchboard refused,
            # `general` serving schedules whose answers went nowhere), and exited 0 (an
            # upgrade walkthrough's rollback).
            raise CommandError(
                f"{', '.join(report.too_new)}: the database was migrated by a newer butlers; "
                "none of this build's butlers is started"
            )
        if not report.running or (strict and report.failed):
            raise CommandError(
                "no butler is running" if not report.running else "a butler failed to start"
            )
        notes = ready_warnings(
            report.running,
            not_loaded,
            config_dir,
            settings,
            whole_directory=not only,
            failed=list(report.failed),
        )
        if as_json:
            ready = ready_report(report.running, report.failed, server.description)
            print(json.dumps(ready, ensure_ascii=False), flush=True)
            print_warnings(notes)
        else:
            print_ready_table(report.running, server.description, notes)
        # What the start built lives as long as the fleet: out of the collector's way, so its
        # collections while serving walk only what requests create (bench/route_instructions.py
        # measures it).
        gc.collect()
        gc.freeze()
        await stop.wait()
        progress("Stopping...")
        on_stop_signal(lambda: hurry_fleet(report.running))
    finally:
        await stop_fleet(report.running)


@contextlib.asynccontextmanager
async def _flushed(telemetry: Telemetry) -> AsyncIterator[None]:
    """The last spans of a run are exported before the process ends (in a thread: a flush
    blocks for as long as the collector takes to answer)."""
    try:
        yield
    finally:
        await asyncio.to_thread(telemetry.shutdown)


async def db_upgrade(config_dir: Path, names: Sequence[str], settings: Settings) -> int:
    configs = select_configs(config_dir, names, settings)  # a config error before the imports
    # With DATABASE_URL the data directory holds no database: nothing to get wrong here.
    if (
        settings.database_url is None
        and (elsewhere := data_dir_not_loaded(config_dir, settings)) is not None
    ):
        raise CommandError(elsewhere)
    if settings.database_url is None and settings.data_dir.is_dir():
        if (refusal := data_dir_refusal(settings.data_dir)) is not None:
            raise CommandError(refusal)
        # Before the claim names this config directory: the claim says where it moved from.
        follow_moved_config_dir(settings.data_dir, config_dir)
        claim_data_dir(settings.data_dir, config_dir)
    with collector_paused():
        from butlers.daemon import migration_branches
        from butlers.db import EmbeddedServer, prepare_database, running, server_for
        from butlers.db.migrations import revisions

    server = server_for(settings)
    if isinstance(server, EmbeddedServer):
        requested = settings.data_dir.expanduser().resolve() / "pgdata"
        if not _holds_databases(requested):
            # An upgrade is of data that exists: from the wrong directory (a relative
            # BUTLERS_DATA_DIR, `.butlers` by default), it made a new, empty PostgreSQL there,
            # said "migrated" of each butler, and the next `up` served an empty fleet (a
            # walkthrough).
            raise CommandError(
                moved_data_refusal(config_dir, settings, requested)
                or _no_databases(settings, requested.parent)
            )
        await server.locate()
        if (refusal := moved_data_refusal(config_dir, settings, server.pgdata)) is not None:
            raise CommandError(refusal)
    failed = False
    async with running(server):
        for config in configs:
            try:
                before = await revisions(server, config.database)
                migrated = await prepare_database(
                    server, config.database, migration_branches(config)
                )
                after = await revisions(server, config.database) if migrated else before
            except ButlersError as exc:
                print(f"error: {config.name}: {exc}", file=sys.stderr)
                failed = True
                continue
            # Which revisions it went from and to (an upgrader asked what had been applied).
            done = (
                f"migrated, now up to date ({' '.join(sorted(before)) or 'new'} -> "
                f"{' '.join(sorted(after))})"
                if migrated
                else "up to date, nothing to do"
            )
            print(f"{config.name}: database {config.database}: {done}")
    return 1 if failed else 0


async def run_up(args: argparse.Namespace, settings: Settings, redactor: Redactor) -> int:
    """`butlers up`: every butler of the config directory (or `--only` these), one process."""
    return await serve(
        args.config_dir,
        args.only,
        strict=False,
        redactor=redactor,
        settings=settings,
        as_json=args.json,
        ports=PortChoice(offset=args.port_offset),
    )


async def run_butler(args: argparse.Namespace, settings: Settings, redactor: Redactor) -> int:
    """`butlers run NAME`: one butler in the foreground; its failing to start is fatal."""
    return await serve(
        args.config_dir,
        [args.name],
        strict=True,
        redactor=redactor,
        settings=settings,
        ports=PortChoice(port=args.port),
    )


async def run_db_upgrade(args: argparse.Namespace, settings: Settings, _redactor: object) -> int:
    return await db_upgrade(args.config_dir, args.names, settings)
