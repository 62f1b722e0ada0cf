"""What already runs on a data directory: the live server named by its postmaster.pid, and
the stale lock files a dead (or since reused) pid left behind, which would block a start.

pids get reused: a pid counts only when psutil says it is a PostgreSQL server (on that data
directory, when one is given).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

# One logger for the whole package, named as it was when butlers.db was one module: log
# lines (their `logger` field) and any level set on it stay as they were.
logger = logging.getLogger("butlers.db")

PG_PORT = 5432


def _pid_is_postgres(pid: int, pgdata: Path | None = None) -> bool:
    """Whether `pid` is a live PostgreSQL server (on `pgdata`, when given): pids get reused.

    psutil is imported here, on first use: only starting (or asking after) the embedded server
    needs it, and importing it costs every process that imports butlers.db ~7 ms (measured).
    """
    import psutil

    try:
        process = psutil.Process(pid)
        if process.name() not in ("postgres", "postmaster"):
            return False
        if pgdata is None:
            return True
        return str(pgdata) in " ".join(process.cmdline()) or Path(process.cwd()) == pgdata
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _wait_ended(pid: int, timeout_s: float) -> bool:
    """Whether the process `pid` ended (or is a zombie: it only waits to be reaped) within
    `timeout_s`. `pg_ctl stop -w` returns once the postmaster removed its pid file, a moment
    before the process itself is gone (seen in CI: a postgres still in disk-sleep just
    after); a stop that says stopped should mean gone."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        except psutil.AccessDenied:
            return not psutil.pid_exists(pid)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


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
