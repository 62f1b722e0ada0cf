"""Never lose a message: SIGKILL the switchboard's process while a message is being
processed, start it again, and the message is processed and answered. And the embedded
PostgreSQL after a SIGKILL: a server left running is adopted, stale locks are cleaned, the
data is there, and no server is left behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import psutil
import pytest
from fastmcp import Client

from butlers.spawner import ABANDONED
from butlers.switchboard.process_name import lock_key
from tests.conftest import drop_databases, eventually, free_port, write_butler_dir
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI, text
from tests.test_cli import Butlers, fleet_env
from tests.test_leases import settled

CHAT = 777


def fleet_databases(prefix: str) -> dict[str, str]:
    """Fresh database names for `general` and `switchboard`: `butlers up` creates them."""
    suffix = uuid.uuid4().hex[:8]
    return {name: f"{prefix}_{name}_{suffix}" for name in ("general", "switchboard")}


def write_fleet(
    tmp_path: Path, bot_api: FakeBotAPI, databases: dict[str, str], switchboard: str = ""
) -> Path:
    """tmp_path/config for `butlers up`: `general`, and a switchboard polling `bot_api` that
    allows CHAT and sends every Telegram message to general; each on its database.
    `switchboard`: more keys of its `[switchboard]` table."""
    config_dir = tmp_path / "config"
    write_butler_dir(
        config_dir, "general", free_port(), extra=f'[butler.db]\nname = "{databases["general"]}"\n'
    )
    write_butler_dir(
        config_dir,
        "switchboard",
        free_port(),
        extra=(
            f'[butler.db]\nname = "{databases["switchboard"]}"\n'
            f'[modules.telegram]\nallowed_chat_ids = ["{CHAT}"]\n'
            f'api_base_url = "{bot_api.url}"\n'
            f"[switchboard]\n{switchboard}\n"
            '[[switchboard.triage]]\nchannel = "telegram"\nbutler = "general"\n'
        ),
    )
    return config_dir


async def test_sigkill_mid_message_then_restart_answers_it(
    tmp_path: Path, bot_api: FakeBotAPI, scripted_api: ScriptedMessagesAPI, pg_server, db_conn
) -> None:
    """A restart resumes at once what its crashed process of the same name (host and port)
    left, not after the lease (an hour here), but not while the process that claimed it
    holds its lock: a live twin's messages under way stay its own
    (butlers.switchboard.process_name)."""
    databases = fleet_databases("crash")
    config_dir = write_fleet(tmp_path, bot_api, databases, switchboard="message_lease_s = 3600")
    env = fleet_env(tmp_path, pg_server, bot_api, scripted_api)

    scripted_api.script([text("Survived the crash.")])
    scripted_api.delay_s = 30  # the model "thinks" long enough for us to pull the plug
    first = Butlers("up", "--config-dir", str(config_dir), env=env)
    await first.start()
    second = None
    try:
        await first.wait_ready()
        await bot_api.push_text(CHAT, "are you there?")
        async with asyncio.timeout(60):  # the general butler's session began
            await scripted_api.wait_for_request(lambda body: True)
        sessions = [
            child
            for child in psutil.Process(first.process.pid).children(recursive=True)
            if any("claude" in part for part in child.cmdline()[:8])
        ]
        assert sessions

        async def sessions_ended() -> None:
            # Its Claude Code ends with it (the parent-death signal): it ran on, its model
            # request open (30 s here), spending for a butler that was gone (a bad day's
            # walkthrough).
            _, alive = await asyncio.to_thread(psutil.wait_procs, sessions, timeout=10)
            assert alive == [], [p.cmdline()[:3] for p in alive]

        await first.crash(then=sessions_ended)

        conn = await db_conn(databases["switchboard"])
        row = await conn.fetchrow("SELECT status, attempts, claimed_by FROM inbox")
        assert (row["status"], row["attempts"]) == ("processing", 1)
        assert bot_api.sent == []
        scripted_api.delay_s = 0

        # While the process that claimed it still holds its lock (a live twin of the same
        # host name and port, as far as a restart can tell), nothing of it is resumed.
        claimant = row["claimed_by"]
        key = lock_key(claimant)
        twin = await asyncpg.connect(pg_server.dsn(databases["switchboard"]))
        try:

            async def took_its_lock() -> bool:  # (the killed one's: gone with its socket)
                return await twin.fetchval("SELECT pg_try_advisory_lock($1)", key)

            await eventually(took_its_lock)
            second = Butlers("up", "--config-dir", str(config_dir), env=env)
            await second.start()
            await second.wait_ready()
            assert await conn.fetchval("SELECT claimed_by FROM inbox") == claimant
            assert await second.stop() == 0
        finally:
            await twin.close()

        second = Butlers("up", "--config-dir", str(config_dir), env=env)
        await second.start()
        await second.wait_ready()
        [sent] = await bot_api.wait_sent(1, timeout_s=60)
        assert sent == {"chat_id": CHAT, "text": "Survived the crash."}

        async def finished() -> bool:  # the row is finished right after the reply is sent
            return await conn.fetchval("SELECT status FROM inbox") != "processing"

        await eventually(finished)
        row = await conn.fetchrow("SELECT status, attempts FROM inbox")
        assert (row["status"], row["attempts"]) == ("done", 2)
        assert await second.stop() == 0
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
        await drop_databases(pg_server, *databases.values())


async def test_sigterm_mid_message_hands_it_back_without_counting_an_attempt(
    tmp_path: Path, bot_api: FakeBotAPI, scripted_api: ScriptedMessagesAPI, pg_server, db_conn
) -> None:
    """Guards InboxWorker.stop and InboxStore.release: `butlers up` stopped with SIGTERM while
    a message is being processed (the general butler's session waits on the model) exits
    cleanly and hands the message back: queued, unclaimed, its attempt not counted (a stop is
    not a crash: MAX_ATTEMPTS must not give up on a message because of restarts), and the
    session's Claude Code CLI ends with it (claude_code's transport: it used to run on, its
    model request open, holding the stderr of the `butlers up` that was gone). The next
    start answers it once. The message would be let finish for `stop_drain_s`: a second
    SIGTERM (a second Ctrl-C) hands it back at once (the 300 s drain would outlast the
    stop's wait)."""
    databases = fleet_databases("term")
    config_dir = write_fleet(tmp_path, bot_api, databases, switchboard="stop_drain_s = 300")
    env = fleet_env(tmp_path, pg_server, bot_api, scripted_api)
    scripted_api.script([text("Answered after the restart.")])
    scripted_api.delay_for = lambda body: 600.0  # the model never answers this first run
    first = Butlers("up", "--config-dir", str(config_dir), env=env)
    second = None
    sessions: list[psutil.Process] = []
    try:
        await first.start()
        await first.wait_ready()
        await bot_api.push_text(CHAT, "are you there?")
        async with asyncio.timeout(60):  # the general butler's session began
            await scripted_api.wait_for_request(lambda body: True)
        conn = await db_conn(databases["switchboard"])
        row = await conn.fetchrow("SELECT status, attempts FROM inbox")
        assert (row["status"], row["attempts"]) == ("processing", 1)

        sessions += [  # the general butler's session: a Claude Code CLI of its own
            p
            for p in psutil.Process(first.process.pid).children(recursive=True)
            if "claude" in " ".join(p.cmdline())
        ]
        assert sessions
        assert first.process is not None
        first.process.send_signal(signal.SIGTERM)
        await first.wait_stderr("1 message under way: up to 300 s to finish (Ctrl-C again", 30)
        try:
            code = await first.stop(timeout_s=30)  # SIGTERM again
        except TimeoutError:  # it exited, but something it started holds its stderr open
            alive = [p.pid for p in sessions if not _ended(p)]
            pytest.fail(f"Claude Code session(s) {alive} outlived the stopped `butlers up`")
        assert code == 0 and all(_ended(p) for p in sessions)
        assert "Traceback" not in first.stderr, first.stderr
        row = await conn.fetchrow("SELECT status, attempts, claimed_by, finished_at FROM inbox")
        assert tuple(row) == ("queued", 0, None, None)
        assert bot_api.sent == []
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
        # The general butler's session that was cut short says so (it stayed "running").
        general = await db_conn(databases["general"])
        cut = await general.fetchrow("SELECT finished_at, success, error FROM sessions")
        assert cut["finished_at"] is not None and cut["success"] is False, dict(cut)
        assert cut["error"] == (  # (the switchboard's stop cut it: the fleet's, it says)
            "interrupted: the session was stopped before it finished (the butler stopped)"
        ), dict(cut)

        # Rows an older release left "running" when it was stopped (it recorded no stop):
        # one that started longer ago than a session may run, and one that did not.
        old, recent = [
            await general.fetchval(
                "INSERT INTO sessions (trigger_source, prompt, started_at) VALUES "
                "('trigger', $1, now() - make_interval(secs => $2)) RETURNING id",
                prompt,
                age_s,
            )
            for prompt, age_s in (("old", 7200.0), ("recent", 5.0))
        ]

        scripted_api.delay_for = None
        second = Butlers("up", "--config-dir", str(config_dir), env=env)
        await second.start()
        await second.wait_ready()
        left = await general.fetchrow(
            "SELECT finished_at, success, error FROM sessions WHERE id = $1", old
        )
        assert left["finished_at"] is not None and left["success"] is False, dict(left)
        assert left["error"] == ABANDONED
        # A replica's session may still run: left until it is older than the timeout.
        assert (
            await general.fetchval("SELECT finished_at FROM sessions WHERE id = $1", recent) is None
        )
        await bot_api.wait_sent(1, timeout_s=60)
        await eventually(lambda: settled(conn))
        assert bot_api.sent == [{"chat_id": CHAT, "text": "Answered after the restart."}]
        row = await conn.fetchrow("SELECT status, attempts FROM inbox")
        assert (row["status"], row["attempts"]) == ("done", 1)
        assert await second.stop() == 0
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
        for session in sessions:  # only if the test failed: started by our `butlers up`
            if not _ended(session):
                session.kill()
        await drop_databases(pg_server, *databases.values())


async def test_ctrl_c_in_the_terminal_lets_the_message_under_way_finish(
    tmp_path: Path, bot_api: FakeBotAPI, scripted_api: ScriptedMessagesAPI, pg_server, db_conn
) -> None:
    """Ctrl-C in the terminal running `butlers up` signals its whole process group: the
    Claude Code session answering a message was in it, died at once, and the message failed
    ("[ede_diagnostic]"; a walkthrough), where a SIGINT to `butlers up` alone lets it finish
    (stop_drain_s). Sessions run in a session of their own: the message finishes."""
    databases = fleet_databases("ctrlc")
    config_dir = write_fleet(tmp_path, bot_api, databases)
    env = fleet_env(tmp_path, pg_server, bot_api, scripted_api)
    scripted_api.script([text("Finished in the drain.")])
    scripted_api.delay_s = 3  # the model answers while `butlers up` drains
    up = Butlers("up", "--config-dir", str(config_dir), env=env, terminal=True)
    try:
        await up.start()
        await up.wait_ready()
        await bot_api.push_text(CHAT, "are you there?")
        async with asyncio.timeout(60):  # the general butler's session began
            await scripted_api.wait_for_request(lambda body: True)
        up.interrupt()
        await up.wait_stderr("1 message under way: up to 10 s to finish", 30)
        assert up.process is not None
        async with asyncio.timeout(60):
            code = await up.process.wait()
        assert code == 0, up.stderr
        conn = await db_conn(databases["switchboard"])
        row = await conn.fetchrow("SELECT status, attempts, error FROM inbox")
        assert tuple(row) == ("done", 1, None), up.stderr
        # ... and its reply went out before `butlers up` exited, not at its next start.
        assert bot_api.sent == [{"chat_id": CHAT, "text": "Finished in the drain."}]
    finally:
        up.kill()
        await drop_databases(pg_server, *databases.values())


# -- the embedded PostgreSQL after a SIGKILL --------------------------------------------------


@pytest.fixture
def embedded_env() -> Iterator[dict[str, str]]:
    """`butlers up` with its own embedded PostgreSQL, in a data directory of this test's.
    Not under pytest's basetemp (0700): as root the server runs as an unprivileged user,
    who must pass through every directory above its data."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "DATABASE_URL"))}
    root = Path(tempfile.mkdtemp(prefix="butlers-test-crash-"))
    os.chmod(root, 0o711)
    env["BUTLERS_DATA_DIR"] = str(root / "data")
    yield env
    pgdata = root / "data" / "pgdata"
    for process in _postgres_on(pgdata):  # only if a test failed half-way: ours to end
        process.kill()
    shutil.rmtree(root, ignore_errors=True)


def _postgres_on(pgdata: Path) -> list[psutil.Process]:
    """The postmaster serving `pgdata` (its children name no data directory)."""
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "postgres" and str(pgdata) in " ".join(
            process.info["cmdline"] or []
        ):
            found.append(process)
    return found


def _ended(process: psutil.Process) -> bool:
    """Whether a process has exited (a zombie has: it only waits for its parent, here
    whichever process adopted the detached server, to collect it)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().splitlines()[0])


async def _up(config_dir: Path, env: dict[str, str], started: list[Butlers]) -> Butlers:
    up = Butlers("up", "--config-dir", str(config_dir), env=env)
    started.append(up)
    await up.start()
    await up.wait_ready()
    return up


async def _state(port: int, key: str, value: object = None) -> object:
    """state_set (with a value) or state_get on the butler listening on `port`."""
    async with Client(f"http://127.0.0.1:{port}/sse") as client:
        if value is not None:
            return (await client.call_tool("state_set", {"key": key, "value": value})).data
        return (await client.call_tool("state_get", {"key": key})).data


@pytest.fixture
async def started() -> AsyncIterator[list[Butlers]]:
    processes: list[Butlers] = []
    yield processes
    for process in processes:
        process.kill()
        if process.process is not None:
            await process.process.wait()


async def test_postgres_left_by_a_killed_butlers_up_is_adopted_and_stopped(
    tmp_path: Path, embedded_env: dict[str, str], started: list[Butlers]
) -> None:
    """Guards EmbeddedServer's adoption: `butlers up` killed with SIGKILL leaves its embedded
    PostgreSQL running (pg_ctl detached it); the next `butlers up` on the same data directory
    takes that server over (rather than failing on its lock), finds the data, and stops it
    on SIGTERM: no server is left behind."""
    port = free_port()
    write_butler_dir(tmp_path / "config", "general", port)
    pgdata = Path(embedded_env["BUTLERS_DATA_DIR"]) / "pgdata"
    first = await _up(tmp_path / "config", embedded_env, started)
    await _state(port, "before-the-kill", {"kept": True})
    postmaster = psutil.Process(_postmaster_pid(pgdata))
    await first.crash()
    assert not _ended(postmaster)  # not a child of butlers: it outlives the SIGKILL

    second = await _up(tmp_path / "config", embedded_env, started)
    assert _postmaster_pid(pgdata) == postmaster.pid  # the same server, adopted
    assert await _state(port, "before-the-kill") == {"kept": True}
    assert await second.stop() == 0
    assert "Traceback" not in second.stderr, second.stderr
    assert _ended(postmaster) and _postgres_on(pgdata) == []


async def test_after_a_power_cut_stale_locks_are_cleaned_and_the_data_is_there(
    tmp_path: Path, embedded_env: dict[str, str], started: list[Butlers]
) -> None:
    """Guards the stale-lock cleaning of EmbeddedServer.start and the durability of a write:
    `butlers up` and its PostgreSQL are both SIGKILLed (a power cut), and the pid their locks
    name (postmaster.pid, the socket's lock) now belongs to another live process of the
    server's user, as after a reboot. PostgreSQL alone refuses to start on such locks; the
    next `butlers up` removes them, starts, and a value written before the cut is there."""
    port = free_port()
    write_butler_dir(tmp_path / "config", "general", port)
    pgdata = Path(embedded_env["BUTLERS_DATA_DIR"]) / "pgdata"
    first = await _up(tmp_path / "config", embedded_env, started)
    await _state(port, "before-the-cut", {"committed": 1})
    postmaster = psutil.Process(_postmaster_pid(pgdata))
    server_processes = [postmaster, *postmaster.children()]
    await first.crash()
    postmaster.kill()
    _, alive = await asyncio.to_thread(psutil.wait_procs, server_processes, timeout=30)
    assert alive == []  # its backends follow the postmaster down
    socket_lock = pgdata / ".s.PGSQL.5432.lock"
    assert (pgdata / "postmaster.pid").exists() and socket_lock.exists()

    other = subprocess.Popen(  # noqa: ASYNC220 - a short-lived helper, started once
        ["sleep", "120"], user="embedded_postgres" if os.geteuid() == 0 else None
    )
    try:
        for lock in (pgdata / "postmaster.pid", socket_lock):
            lines = lock.read_text().splitlines()
            lock.write_text("\n".join([str(other.pid), *lines[1:]]) + "\n")
        second = await _up(tmp_path / "config", embedded_env, started)
        assert other.poll() is None  # the other process was left alone
    finally:
        other.kill()
        other.wait()
    new_postmaster = psutil.Process(_postmaster_pid(pgdata))
    assert new_postmaster.pid not in (postmaster.pid, other.pid)
    assert await _state(port, "before-the-cut") == {"committed": 1}
    assert await second.stop() == 0
    assert "Traceback" not in second.stderr, second.stderr
    assert _ended(new_postmaster) and _postgres_on(pgdata) == []
