"""Which build is running: the release, and in a git checkout its commit.

Every checkout said "butlers 0.1.0" whatever it held, so an owner who had pulled could not
tell whether the fleet ran the new code (a backup walkthrough). The commit is read from the
checkout's `.git` files, not by running git: `--version` answers at once, and git need not
be on the PATH of the user who runs the fleet.
"""

from __future__ import annotations

import re
from pathlib import Path

from butlers import __version__

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the checkout, when run from one


def checkout_commit(root: Path = _SOURCE_ROOT) -> str | None:
    """The commit the git checkout at `root` has checked out (HEAD), or None: not a checkout
    (an installed wheel), a worktree's `.git` file, or files it cannot read."""
    git = root / ".git"
    try:
        head = (git / "HEAD").read_text(encoding="ascii").strip()
        if _COMMIT.fullmatch(head):  # detached
            return head
        if not head.startswith("ref: "):
            return None
        ref = head.removeprefix("ref: ").strip()
        if not ref.startswith("refs/") or ".." in ref:  # (nothing outside .git is read)
            return None
        loose = git / ref
        if loose.is_file():
            commit = loose.read_text(encoding="ascii").strip()
            return commit if _COMMIT.fullmatch(commit) else None
        for line in (git / "packed-refs").read_text(encoding="ascii").splitlines():
            commit, _, name = line.partition(" ")
            if name == ref and _COMMIT.fullmatch(commit):
                return commit
    except (OSError, UnicodeDecodeError):
        return None
    return None


def build_label(root: Path = _SOURCE_ROOT) -> str:
    """'0.1.0', or '0.1.0 (git d40159e)' when run from a git checkout."""
    commit = checkout_commit(root)
    return f"{__version__} (git {commit[:7]})" if commit else __version__
