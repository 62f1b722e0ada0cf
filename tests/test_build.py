"""`butlers --version` names the commit of a git checkout (butlers.build), read from its
files as git itself would name it: a branch's loose ref, its packed ref, a detached HEAD."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from butlers import __version__
from butlers.build import build_label, checkout_commit


def git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


@pytest.mark.proc  # git
def test_the_commit_of_a_checkout_is_read_as_git_reads_it(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q", "-b", "main")
    assert checkout_commit(tmp_path) is None  # no commit yet: the branch has no ref
    (tmp_path / "a").write_text("1")
    git(tmp_path, "add", "a")
    git(tmp_path, "commit", "-q", "-m", "one")
    first = git(tmp_path, "rev-parse", "HEAD")
    assert checkout_commit(tmp_path) == first  # refs/heads/main, loose
    assert build_label(tmp_path) == f"{__version__} (git {first[:7]})"
    git(tmp_path, "pack-refs", "--all")
    assert not (tmp_path / ".git/refs/heads/main").exists()
    assert checkout_commit(tmp_path) == first  # packed
    (tmp_path / "a").write_text("2")
    git(tmp_path, "commit", "-q", "-am", "two")
    second = git(tmp_path, "rev-parse", "HEAD")
    assert checkout_commit(tmp_path) == second != first  # loose again, over the packed one
    git(tmp_path, "checkout", "-q", first)
    assert checkout_commit(tmp_path) == first  # detached


def test_an_installed_copy_says_its_release_alone(tmp_path: Path) -> None:
    assert build_label(tmp_path) == __version__
    (tmp_path / ".git").write_text("gitdir: /elsewhere\n")  # a worktree's pointer
    assert build_label(tmp_path) == __version__
    (tmp_path / ".git").unlink()
    (tmp_path / ".git").mkdir()
    outside = tmp_path / "outside"
    outside.write_text("a" * 40 + "\n")
    for head in (f"ref: {outside}", "ref: refs/../../outside"):  # nothing outside .git is read
        (tmp_path / ".git" / "HEAD").write_text(head + "\n")
        assert build_label(tmp_path) == __version__
