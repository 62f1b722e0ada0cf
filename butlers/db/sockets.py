"""Where the embedded server's Unix socket lives: in pgdata when its path fits a sockaddr_un,
else in a private directory under $XDG_RUNTIME_DIR or /tmp, checked so no other user can
plant a socket (or a symlink) there and answer as the database.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from butlers.db.account import _ServerAccount
from butlers.db.postmaster import PG_PORT
from butlers.db.reach import owner_names
from butlers.errors import DatabaseError

# One logger for the whole package, named as it was when butlers.db was one module: log
# lines (their `logger` field) and any level set on it stay as they were.
logger = logging.getLogger("butlers.db")

# sockaddr_un.sun_path holds 108 bytes on Linux, its terminating NUL included.
SOCKET_PATH_MAX = 107


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
                f"{owner_names(st)[0]} (uid {st.st_uid}), not to {account.name!r} who runs "
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
