"""The `butlers` command as a user runs it: a real subprocess, real ports, real signals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import psutil
import pytest
from fastmcp import Client

from butlers.build import build_label
from butlers.claude_code import claude_binary, isolated_cli_env
from tests.conftest import eventually, free_port, log_records, migration_heads

if TYPE_CHECKING:
    from butlers.db import PostgresServer
    from tests.fakes.bot_api import FakeBotAPI
    from tests.fakes.messages_api import ScriptedMessagesAPI

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "config" / "butlers"
BUTLERS = str(Path(sys.executable).parent / "butlers")
READY = "Press Ctrl-C to stop."


def _free_ports(count: int, offset: int = 0) -> list[int]:
    """`count` ports free now, each also free when moved by `offset` (`--port-offset`): a port
    picked free with its moved twin unchecked once collided with another test's listener."""
    ports: list[int] = []
    for _ in range(200):
        if len(ports) == count:
            return ports
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in ports or not 0 < port + offset <= 65535 or port + offset in ports:
            continue
        if offset:
            try:
                with socket.socket() as moved:
                    moved.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        ports.append(port)
    raise AssertionError(f"no {count} free ports with free twins at +{offset}")


def copy_shipped_config(target: Path, offset: int = 0) -> dict[str, int]:
    """The shipped config, with its ports moved to free ones so tests never collide (and free
    again at `port + offset`, for a fleet moved by `--port-offset`)."""
    shutil.copytree(SHIPPED, target)
    ports = {}
    for directory, port in zip(sorted(target.iterdir()), _free_ports(4, offset), strict=True):
        toml = directory / "butler.toml"
        toml.write_text(re.sub(r"(?m)^port = \d+$", f"port = {port}", toml.read_text()))
        ports[directory.name] = port
    return ports


class Butlers:
    """One `butlers ...` subprocess, with its output collected."""

    def __init__(self, *args: str, env: dict[str, str], terminal: bool = False) -> None:
        """`terminal`: in a process group of its own, as a shell runs a command in the
        foreground: Ctrl-C (`interrupt()`) signals the whole group, children too."""
        self.args = args
        self.env = env
        self.terminal = terminal
        self.process: asyncio.subprocess.Process | None = None
        self.stdout = ""
        self.stderr = ""
        self.orphans: list[psutil.Process] = []

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            BUTLERS,
            *self.args,
            env=self.env,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=self.terminal,
        )
        self._stderr_task = asyncio.create_task(self._drain_stderr())

    def interrupt(self) -> None:
        """Ctrl-C in the terminal running it: SIGINT to its whole process group."""
        assert self.process is not None and self.terminal
        os.killpg(self.process.pid, signal.SIGINT)

    async def _drain_stderr(self) -> None:
        assert self.process and self.process.stderr
        async for line in self.process.stderr:
            self.stderr += line.decode()

    async def wait_ready(self, timeout_s: float = 90) -> float:
        """Seconds until the ready line; fails with the output if the process died first."""
        assert self.process and self.process.stdout
        started = time.monotonic()
        async with asyncio.timeout(timeout_s):
            while READY not in self.stdout:
                line = await self.process.stdout.readline()
                if not line:
                    await self.process.wait()
                    await self._stderr_task
                    raise AssertionError(
                        f"butlers exited {self.process.returncode}:\n{self.stdout}\n{self.stderr}"
                    )
                self.stdout += line.decode()
        return time.monotonic() - started

    async def wait_json(self, timeout_s: float = 90) -> dict:
        """`up --json`: the ready report, the first line on stdout."""
        assert self.process and self.process.stdout
        async with asyncio.timeout(timeout_s):
            line = await self.process.stdout.readline()
        if not line:
            await self.process.wait()
            await self._stderr_task
            raise AssertionError(f"butlers exited {self.process.returncode}:\n{self.stderr}")
        self.stdout += line.decode()
        return json.loads(line)

    async def wait_stderr(self, text: str, timeout_s: float = 10) -> None:
        """stderr is drained by its own task: give it a moment to catch up."""
        async with asyncio.timeout(timeout_s):
            while text not in self.stderr:  # noqa: ASYNC110 - polling a string another task fills
                await asyncio.sleep(0.05)

    async def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Signal, then wait for the exit code. `timeout_s` only keeps a hung process from
        hanging the test: how fast it stops is measured by bench/startup.py."""
        assert self.process and self.process.stdout
        self.process.send_signal(signum)
        async with asyncio.timeout(timeout_s):
            rest = await self.process.stdout.read()
            code = await self.process.wait()
            await self._stderr_task
        self.stdout += rest.decode()
        return code

    async def run(self, timeout_s: float = 90) -> int:
        await self.start()
        assert self.process and self.process.stdout
        async with asyncio.timeout(timeout_s):
            self.stdout = (await self.process.stdout.read()).decode()
            code = await self.process.wait()
            await self._stderr_task
        return code

    async def crash(self, *, then: Callable[[], Awaitable[None]] | None = None) -> None:
        """SIGKILL, like a power cut; `then` runs right after. Its Claude Code sessions are
        then ours to end (they end with it by themselves: `then` may check that)."""
        assert self.process is not None
        self.orphans = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGKILL)
        if then is not None:
            await then()
        self._end_orphans()
        await self.process.wait()  # (returns only once the orphans have let go of its pipes)

    def _end_orphans(self) -> None:
        for orphan in self.orphans:
            if orphan.is_running():
                orphan.kill()

    def kill(self) -> None:
        if self.process and self.process.returncode is None:
            self.process.kill()
        self._end_orphans()

    async def stop_quietly(self) -> None:
        """After a failure: stop it (killed if a signal does not do), raising nothing, so the
        failure that got us here is the one reported."""
        with contextlib.suppress(Exception):
            await self.stop(timeout_s=20)
        self.kill()


@pytest.fixture
def cli_env() -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "DATABASE_URL"))}
    # Not under pytest's basetemp (0700): as root the embedded PostgreSQL runs as an
    # unprivileged user, who must pass through every directory above its data.
    root = Path(tempfile.mkdtemp(prefix="butlers-test-cli-"))
    os.chmod(root, 0o711)
    env["BUTLERS_DATA_DIR"] = str(root / "data")
    yield env
    shutil.rmtree(root, ignore_errors=True)


def fleet_env(
    tmp_path: Path,
    pg_server: PostgresServer,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    *,
    left_out: tuple[str, ...] = ("BUTLERS_",),
) -> dict[str, str]:
    """The environment of `butlers` processes serving a Telegram fleet on the tests'
    PostgreSQL: nothing inherited that starts with `left_out`, Claude Code isolated in
    tmp_path/home against the scripted API, the fake Bot API's token, data in tmp_path/data.
    The crash, replica and tracing tests start theirs with it, so each is set up alike."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(left_out)}
    env.update(isolated_cli_env(home, scripted_api.url, inherited=env))
    env.update(
        DATABASE_URL=pg_server.dsn("postgres"),
        TELEGRAM_BOT_TOKEN=bot_api.token,
        BUTLERS_DATA_DIR=str(tmp_path / "data"),
    )
    return env


@pytest.fixture
async def processes():
    started: list[Butlers] = []
    yield started
    for process in started:
        process.kill()
        if process.process is not None:
            await process.process.wait()


def _postgres_on(pgdata: Path) -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] == "postgres" and str(pgdata) in " ".join(p.info["cmdline"] or [])
    ]


async def _health(port: int) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/health") as response:
            assert response.status == 200
            return await response.json()


async def test_up_serves_shipped_butlers_stops_cleanly_and_keeps_data(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    ports = copy_shipped_config(tmp_path / "config")
    # A butler with a config error, and a .env (as `butlers init` writes) not loaded.
    (tmp_path / "config" / "broken").mkdir()
    (tmp_path / "config" / "broken" / "butler.toml").write_text("[butler]\nname = 3\n")
    env_file = tmp_path / "config" / ".env"
    env_file.write_text("TELEGRAM_BOT_TOKEN=123:abc\n")
    # No credentials for Claude Code at all (no key, no login in this HOME).
    for name in [n for n in cli_env if n.startswith(("ANTHROPIC_", "CLAUDE_"))]:
        del cli_env[name]
    cli_env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    up = Butlers("up", "--config-dir", str(tmp_path / "config"), env=cli_env)
    processes.append(up)
    await up.start()
    await up.wait_ready()  # (how long it takes: bench/startup.py, bench/cli_startup.py)
    # Its environment (the fleet's secrets) is root's to read alone, not a tool server's of
    # the same user (keep_memory_private; as root this holds anyway).
    assert up.process is not None and os.stat(f"/proc/{up.process.pid}/environ").st_uid == 0
    # Under the ready table, what it does not show (printed long before, or not at all).
    await up.wait_stderr("warning: the client commands")
    warnings = [line for line in up.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        "warning: not started: broken (its config error is above)",
        "warning: Claude Code has no credentials (no ANTHROPIC_API_KEY, no `claude` login): "
        "every session will fail; set ANTHROPIC_API_KEY (in the config's .env, then load it) "
        f"or log in with {claude_binary()} /login",
        "warning: switchboard: telegram is not running (skipped: TELEGRAM_BOT_TOKEN not set); "
        f"it is in {env_file}: load that before starting: set -a; . {env_file}; set +a",
        # (not in .env: loading it would not help; a misspelt variable name looks like this)
        "warning: switchboard: email is not running (skipped: BUTLERS_EMAIL_USER, "
        "BUTLERS_EMAIL_PASSWORD not set); BUTLERS_EMAIL_USER, BUTLERS_EMAIL_PASSWORD are not "
        f"in {env_file} either: set them there, or check the names [modules.email] gives them",
        "warning: the client commands (ask, inbox, log...) look for the switchboard at "
        "http://127.0.0.1:8100/sse; for this one: export BUTLERS_SWITCHBOARD_URL="
        f"http://127.0.0.1:{ports['switchboard']}/sse (or pass --url)",
    ], up.stderr
    # The data directory it made is closed to others (as root, passable by PostgreSQL's
    # account: its data lies below).
    data_dir = Path(cli_env["BUTLERS_DATA_DIR"])
    mode = stat.S_IMODE(os.stat(data_dir).st_mode)
    assert mode == (0o711 if os.geteuid() == 0 else 0o700), oct(mode)
    steps = ("Initialising PostgreSQL in", "Migrating 4 databases...", "Starting 4 butlers...")
    await up.wait_stderr(steps[-1])
    assert all(step in up.stderr for step in steps), up.stderr  # a cold start's steps
    assert sorted(steps, key=up.stderr.index) == list(steps), up.stderr  # in this order

    # Which code runs (after a pull: the new one?), then each butler's endpoints.
    assert f"Butlers {build_label()} ready (embedded PostgreSQL in " in up.stdout
    for name, port in ports.items():
        assert f"http://127.0.0.1:{port}/sse" in up.stdout
        health = await _health(port)
        assert health["name"] == name and health["database"]["ok"] is True
    # Where the dashboard is (with --port-offset, not the docs' 8100: a walkthrough).
    assert f"Dashboard: http://127.0.0.1:{ports['switchboard']}/ui\n" in up.stdout
    switchboard = await _health(ports["switchboard"])
    assert {m["name"]: (m["state"], m["detail"]) for m in switchboard["modules"]} == {
        "telegram": ("skipped", "TELEGRAM_BOT_TOKEN not set"),
        "email": ("skipped", "BUTLERS_EMAIL_USER, BUTLERS_EMAIL_PASSWORD not set"),
    }
    async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
        await client.call_tool("state_set", {"key": "survives", "value": {"restart": True}})

    assert await up.stop(signal.SIGTERM) == 0
    assert "Traceback" not in up.stderr, up.stderr
    pgdata = Path(cli_env["BUTLERS_DATA_DIR"]) / "pgdata"
    assert _postgres_on(pgdata) == []

    again = Butlers("up", "--config-dir", str(tmp_path / "config"), "--json", env=cli_env)
    processes.append(again)
    await again.start()
    ready = await again.wait_json()
    assert ready["database"].startswith("embedded PostgreSQL")
    assert {b["name"]: (b["status"], b["url"]) for b in ready["butlers"]} == {
        name: ("running", f"http://127.0.0.1:{port}/sse") for name, port in ports.items()
    }
    assert all(b["health_url"] == b["url"].replace("/sse", "/health") for b in ready["butlers"])
    dashboards = {b["name"]: b["dashboard_url"] for b in ready["butlers"] if "dashboard_url" in b}
    assert dashboards == {"switchboard": f"http://127.0.0.1:{ports['switchboard']}/ui"}
    assert "Starting PostgreSQL in" in again.stderr and "Initialising" not in again.stderr
    async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
        value = (await client.call_tool("state_get", {"key": "survives"})).data
    assert value == {"restart": True}
    assert await again.stop(signal.SIGINT) == 0
    assert "Traceback" not in again.stderr, again.stderr
    assert _postgres_on(pgdata) == []


async def test_up_without_its_switchboard_says_nothing_takes_messages(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    """The switchboard's butler.toml broken (a typo): the others start, and under the ready
    table `up` says that no message is taken, not only the config error scrolled away above."""
    ports = copy_shipped_config(tmp_path / "config")
    toml = tmp_path / "config" / "switchboard" / "butler.toml"
    toml.write_text(toml.read_text().replace("[switchboard]", "[switchbord]", 1))
    cli_env["ANTHROPIC_API_KEY"] = "sk-ant-not-used"  # no session runs: no warning of it
    up = Butlers("up", "--config-dir", str(tmp_path / "config"), env=cli_env)
    processes.append(up)
    await up.start()
    await up.wait_ready()
    await up.wait_stderr("warning: no switchboard is running")
    assert f"http://127.0.0.1:{ports['general']}/sse" in up.stdout
    assert f"http://127.0.0.1:{ports['switchboard']}/sse" not in up.stdout
    warnings = [line for line in up.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        "warning: not started: switchboard (its config error is above)",
        "warning: no switchboard is running: no message is taken (Telegram, email, `butlers ask`)",
    ], up.stderr
    assert await up.stop(signal.SIGINT) == 0


async def test_a_second_fleet_with_a_port_offset_shares_postgresql_and_the_switchboard(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    """`butlers up --port-offset K` beside a running `butlers up`, on the same embedded
    PostgreSQL: every butler again on its port + K, the switchboard a replica on the same
    database; stopping the second fleet leaves the first one's PostgreSQL running."""
    offset = 7
    ports = copy_shipped_config(tmp_path / "config", offset)
    args = ("up", "--config-dir", str(tmp_path / "config"))
    first = Butlers(*args, env=cli_env)
    second = Butlers(*args, "--port-offset", str(offset), "--json", env=cli_env)
    processes.extend([first, second])
    await first.start()
    await first.wait_ready()
    await second.start()
    ready = await second.wait_json()
    assert {b["name"]: b["url"] for b in ready["butlers"]} == {
        name: f"http://127.0.0.1:{port + offset}/sse" for name, port in ports.items()
    }
    for name, port in ports.items():
        assert (await _health(port + offset))["name"] == name
    async with Client(f"http://127.0.0.1:{ports['general'] + offset}/sse") as client:
        await client.call_tool("state_set", {"key": "fleet", "value": "second"})
    async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
        assert (await client.call_tool("state_get", {"key": "fleet"})).data == "second"

    # A third on the first one's ports starts no butler: with --json it still says so on
    # stdout, one object naming each butler and why (it printed nothing there).
    clash = Butlers(*args, "--json", env=cli_env)
    processes.append(clash)
    assert await clash.run() == 1
    report = json.loads(clash.stdout.splitlines()[0])
    assert [b["status"] for b in report["butlers"]] == ["failed"] * 4, report
    assert "no butler is running" in clash.stderr

    assert await second.stop() == 0
    pgdata = Path(cli_env["BUTLERS_DATA_DIR"]) / "pgdata"
    assert _postgres_on(pgdata) != []
    assert (await _health(ports["switchboard"]))["database"]["ok"] is True
    assert await first.stop() == 0
    assert _postgres_on(pgdata) == []

    bad = Butlers(*args, "--port-offset", "70000", env=cli_env)
    processes.append(bad)
    assert await bad.run() != 0
    assert "would listen on port" in bad.stderr and "Traceback" not in bad.stderr


async def test_a_fleet_moved_by_a_port_offset_is_registered_and_routed_where_it_listens(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    """Alone on its own data (a second checkout, a new user's `make up UP_ARGS=...`): the
    registry holds the moved ports, so `route` reaches its own butlers, not whatever listens
    on the butler.toml's ports (it was refused there: "unreachable at ...:8101")."""
    from tests.test_cli_client import run_cli

    offset = 11
    ports = copy_shipped_config(tmp_path / "config", offset)
    fleet = Butlers(
        "up",
        "--config-dir",
        str(tmp_path / "config"),
        "--port-offset",
        str(offset),
        "--json",
        env=cli_env,
    )
    processes.append(fleet)
    await fleet.start()
    ready = await fleet.wait_json()
    assert {b["name"]: b["status"] for b in ready["butlers"]} == dict.fromkeys(ports, "running")
    url = f"http://127.0.0.1:{ports['switchboard'] + offset}/sse"
    code, out, err = await run_cli("list", "--url", url, "--json", env=cli_env)
    assert code == 0, err
    assert {b["name"]: b["endpoint_url"] for b in json.loads(out)} == {
        name: f"http://127.0.0.1:{port + offset}/sse" for name, port in ports.items()
    }
    code, out, err = await run_cli("route", "general", "status", "{}", "--url", url, env=cli_env)
    assert code == 0, err
    assert '"name": "general"' in out
    assert await fleet.stop() == 0


def _postmaster_of(data_dir: Path) -> int:
    """The pid of the embedded PostgreSQL a fleet with `data_dir` runs (as root its data lives
    under /var/lib/butlers, in the directory whose origin names `data_dir`)."""
    pid_file = next(data_dir.rglob("postmaster.pid"), None)
    if pid_file is None:
        pid_file = next(
            place / "pgdata" / "postmaster.pid"
            for place in Path("/var/lib/butlers/data").iterdir()
            if (place / "origin").read_text().startswith(str(data_dir))
        )
    return int(pid_file.read_text().split()[0])


async def test_postgresql_stopped_under_a_fleet_is_said_and_started_again(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    """PostgreSQL stopped under a running fleet (killed, a PANIC on a full disk): `up` went on
    without it, its log full of connection errors, until someone restarted it (a bad day's
    walkthrough). Now it says so once and starts it again, and again until it can (here its
    settings broken for a while); meanwhile a call that needs the database is told the
    butler cannot reach it (not FastMCP's masked "Error calling tool 'list_butlers'"), and
    doctor fails saying `up` runs without it. Nothing is lost: what was written is there."""
    from fastmcp import Client

    from tests.test_cli_client import run_cli

    ports = copy_shipped_config(tmp_path / "config")
    fleet = Butlers("up", "--config-dir", str(tmp_path / "config"), "--json", env=cli_env)
    processes.append(fleet)
    await fleet.start()
    await fleet.wait_json()
    async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
        await client.call_tool("state_set", {"key": "before", "value": "the crash"})
    pgdata = Path(cli_env["BUTLERS_DATA_DIR"]) / "pgdata"
    postmaster = await asyncio.to_thread(_postmaster_of, Path(cli_env["BUTLERS_DATA_DIR"]))
    settings = pgdata / "postgresql.conf"
    written = settings.read_text()
    settings.write_text(written + "\nthis line is not a setting\n")  # it cannot start again
    try:
        os.kill(postmaster, signal.SIGKILL)
        await eventually(lambda: asyncio.to_thread(lambda: not psutil.pid_exists(postmaster)))
        await fleet.wait_stderr("has stopped; starting it again", timeout_s=20)
        await fleet.wait_stderr("cannot start the embedded PostgreSQL on", timeout_s=20)
        url = f"http://127.0.0.1:{ports['switchboard']}/sse"
        code, _out, err = await run_cli("list", "--url", url, env=cli_env)
        assert code == 1
        assert "switchboard cannot reach its database now" in err, err
        assert "Error calling tool" not in err
        # doctor said "not running; `butlers up` starts it": `up` runs, without it.
        config = str(tmp_path / "config")
        code, out, _err = await run_cli("doctor", "--config-dir", config, env=cli_env)
        assert code == 1, out
        assert "is not running, though `butlers up` is (its " in out, out
    finally:
        settings.write_text(written)
    await fleet.wait_stderr("runs again", timeout_s=60)
    assert fleet.stderr.count("has stopped; starting it again") == 1  # said once
    async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
        assert (await client.call_tool("state_get", {"key": "before"})).data == "the crash"
    code, out, err = await run_cli("list", "--url", url, env=cli_env)
    assert code == 0, err
    assert await fleet.stop() == 0


async def test_broken_butler_and_busy_port_do_not_stop_the_others(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers], pg_server
) -> None:
    ports = copy_shipped_config(tmp_path / "config")
    broken = tmp_path / "config" / "relationship" / "butler.toml"
    broken.write_text(broken.read_text() + "\nsurprise = 1\n")
    cli_env["DATABASE_URL"] = pg_server.dsn("postgres")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports["health"]))
        busy.listen()
        up = Butlers("up", "--config-dir", str(tmp_path / "config"), env=cli_env)
        processes.append(up)
        await up.start()
        await up.wait_ready()
        await up.wait_stderr(f"error: {broken}: runtime.surprise: unknown key")
        await up.wait_stderr(
            f"error: butler 'health' not started: butler 'health' cannot listen on "
            f"127.0.0.1:{ports['health']}"
        )
        assert (await _health(ports["general"]))["name"] == "general"
        assert (await _health(ports["switchboard"]))["name"] == "switchboard"
        # Said again under the ready table, where it does not scroll away.
        await up.wait_stderr("warning: not started: health (its error is above)")
        assert await up.stop() == 0
    # Once: not again by a logger, nor by the switchboard's discover of the same directory.
    assert up.stderr.count(str(broken)) == 1, up.stderr


async def test_run_refuses_a_broken_butler_with_a_clear_error(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    copy_shipped_config(tmp_path / "config")
    broken = tmp_path / "config" / "health" / "butler.toml"
    broken.write_text(broken.read_text().replace("port = ", "port = -"))
    run = Butlers("run", "health", "--config-dir", str(tmp_path / "config"), env=cli_env)
    processes.append(run)
    assert await run.run() == 1
    assert "butler.port: expected a port number between 1 and 65535" in run.stderr
    assert "no loadable butler named 'health'" in run.stderr
    assert "Traceback" not in run.stderr


async def test_run_one_butler_in_the_foreground(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers], pg_server
) -> None:
    ports = copy_shipped_config(tmp_path / "config")
    cli_env["DATABASE_URL"] = pg_server.dsn("postgres")
    run = Butlers("run", "health", "--config-dir", str(tmp_path / "config"), env=cli_env)
    processes.append(run)
    await run.start()
    await run.wait_ready()
    assert (await _health(ports["health"]))["name"] == "health"
    with pytest.raises(aiohttp.ClientConnectionError):
        await _health(ports["general"])
    assert await run.stop(signal.SIGINT) == 0


async def test_a_data_directory_serves_the_config_directory_it_was_made_for(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    """A shell that loaded one fleet's .env and then ran `make up` started the shipped
    example on that fleet's databases and bot, and the owner's messages were refused and
    lost. Another config directory is refused on its data directory; once the first config
    directory is gone (moved), the data directory is the new one's."""
    mine, example = tmp_path / "mine", tmp_path / "example"
    copy_shipped_config(mine)
    copy_shipped_config(example)
    fleet = Butlers("up", "--config-dir", str(mine), "--json", env=cli_env)
    processes.append(fleet)
    await fleet.start()
    await fleet.wait_json()
    assert await fleet.stop() == 0
    for args in (
        ("up", "--config-dir", str(example)),
        ("db", "upgrade", "--config-dir", str(example)),
    ):
        refused = Butlers(*args, env=cli_env)
        processes.append(refused)
        assert await refused.run() == 1, refused.stderr
        assert f"holds the databases of the butlers in {mine.resolve()}, not of" in refused.stderr
        assert "Traceback" not in refused.stderr
    shutil.rmtree(mine)  # moved away: the data directory goes with the config that is left
    upgrade = Butlers("db", "upgrade", "--config-dir", str(example), env=cli_env)
    processes.append(upgrade)
    assert await upgrade.run() == 0, upgrade.stderr
    claim = Path(cli_env["BUTLERS_DATA_DIR"]) / "config-dir"
    assert claim.read_text().strip() == str(example.resolve())


def test_a_claimed_data_directory_is_taken_over_only_from_a_config_directory_that_is_gone(
    tmp_path: Path,
) -> None:
    """Its recorded config directory unreadable (a parent closed to this user, a loop of
    links) was taken for gone, and the data directory for another config's ("(... is
    gone)"), while that fleet still lived. Only one that is not there is gone."""
    from butlers.cli.fleet import CLAIM_FILE, claim_data_dir
    from butlers.errors import CommandError

    data_dir, old, new = tmp_path / "data", tmp_path / "old", tmp_path / "new"
    for directory in (data_dir, old, new):
        directory.mkdir(mode=0o700)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    (data_dir / CLAIM_FILE).write_bytes(os.fsencode(loop / "config") + b"\n")
    with pytest.raises(CommandError, match=r"which cannot be looked at \(Too many levels"):
        claim_data_dir(data_dir, new)
    (data_dir / CLAIM_FILE).write_bytes(os.fsencode(old) + b"\n")
    with pytest.raises(CommandError, match=f"holds the databases of the butlers in {old}, not"):
        claim_data_dir(data_dir, new)
    old.rmdir()  # moved away: gone
    with log_records("butlers.cli.fleet") as records:
        claim_data_dir(data_dir, new)
    assert (data_dir / CLAIM_FILE).read_bytes() == os.fsencode(new) + b"\n"
    assert [r.getMessage() for r in records] == [
        f"{data_dir} now serves the config directory {new} ({old} is gone)"
    ]


async def test_a_moved_config_directory_keeps_its_data_and_never_starts_empty_databases(
    cli_env: dict[str, str], processes: list[Butlers]
) -> None:
    """`mv ~/my-butlers ~/bots/my-butlers` with the .env still naming the old data directory
    started a fresh, empty fleet (no schedules, memories or pairings) without a word, and
    `db upgrade` said "migrated" of it (a walkthrough). Both refuse now, naming where the data
    is; with BUTLERS_DATA_DIR set to it, the moved fleet has its data."""
    base = Path(cli_env["BUTLERS_DATA_DIR"]).parent  # 0711: as root, the data stays here
    mine, moved = base / "mine", base / "bots" / "mine"
    ports = copy_shipped_config(mine)
    env = {**cli_env, "BUTLERS_DATA_DIR": str(mine / ".butlers")}
    fleet = Butlers("up", "--config-dir", str(mine), "--json", env=env)
    processes.append(fleet)
    await fleet.start()
    await fleet.wait_json()
    async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
        await client.call_tool("state_set", {"key": "moved", "value": "with it"})
    assert await fleet.stop() == 0
    moved.parent.mkdir()
    mine.rename(moved)

    for args in (("up",), ("db", "upgrade")):
        stale = Butlers(*args, "--config-dir", str(moved), env=env)
        processes.append(stale)
        assert await stale.run() == 1, stale.stderr
        assert (
            f"error: BUTLERS_DATA_DIR is {mine / '.butlers'}, which holds no databases, but "
            f"{moved / '.butlers'}, this config directory's own data directory, holds its "
            "butlers' databases"
        ) in stale.stderr, stale.stderr
        assert f"set BUTLERS_DATA_DIR={moved / '.butlers'} in the environment" in stale.stderr
        assert "Traceback" not in stale.stderr
    assert not (mine / ".butlers" / "pgdata").exists()

    env["BUTLERS_DATA_DIR"] = str(moved / ".butlers")
    again = Butlers("up", "--config-dir", str(moved), "--json", env=env)
    processes.append(again)
    await again.start()
    await again.wait_json()
    assert "Initialising" not in again.stderr, again.stderr
    async with Client(f"http://127.0.0.1:{ports['general']}/sse") as client:
        assert (await client.call_tool("state_get", {"key": "moved"})).data == "with it"
    assert await again.stop() == 0


def test_a_relative_data_directory_read_from_elsewhere_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BUTLERS_DATA_DIR=.butlers in .env is relative to where `up` starts: started from
    another directory, a fresh, empty fleet (a walkthrough). Refused while the config
    directory's own .butlers holds the databases; not once the data directory has its own."""
    from butlers.cli.fleet import moved_data_refusal
    from butlers.settings import Settings

    config, elsewhere = tmp_path / "config", tmp_path / "elsewhere"
    (config / ".butlers" / "pgdata").mkdir(parents=True)
    (config / ".butlers" / "pgdata" / "PG_VERSION").write_text("18\n")
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    settings = Settings.from_environ({"BUTLERS_DATA_DIR": ".butlers"})
    pgdata = elsewhere / ".butlers" / "pgdata"
    said = moved_data_refusal(config, settings, pgdata)
    assert said is not None and said.startswith(
        f"BUTLERS_DATA_DIR is {elsewhere / '.butlers'}, which holds no databases, but "
        f"{config / '.butlers'}"
    )
    monkeypatch.chdir(config)  # started from the config directory: its own
    assert moved_data_refusal(config, settings, config / ".butlers" / "pgdata") is None
    monkeypatch.chdir(elsewhere)
    pgdata.mkdir(parents=True)
    (pgdata / "PG_VERSION").write_text("18\n")  # a fleet of its own there: not a first start
    assert moved_data_refusal(config, settings, pgdata) is None


async def test_db_upgrade_creates_and_migrates(
    tmp_path: Path, cli_env: dict[str, str], processes: list[Butlers], pg_server, db_conn
) -> None:
    copy_shipped_config(tmp_path / "config")
    (tmp_path / "config" / "health" / "butler.toml").write_text(
        '[butler]\nname = "health"\nport = 9999\n[butler.db]\nname = "t_upgrade_health"\n'
    )
    cli_env["DATABASE_URL"] = pg_server.dsn("postgres")
    upgrade = Butlers(
        "db", "upgrade", "health", "--config-dir", str(tmp_path / "config"), env=cli_env
    )
    processes.append(upgrade)
    try:
        assert await upgrade.run() == 0, upgrade.stderr
        heads = " ".join(sorted(migration_heads("core")))
        assert (
            f"health: database t_upgrade_health: migrated, now up to date (new -> {heads})"
        ) in upgrade.stdout, upgrade.stdout
        conn = await db_conn("t_upgrade_health")
        versions = {r[0] for r in await conn.fetch("SELECT version_num FROM alembic_version")}
        assert versions == migration_heads("core")
        again = Butlers(*upgrade.args, env=cli_env)
        processes.append(again)
        assert await again.run() == 0, again.stderr
        assert "t_upgrade_health: up to date, nothing to do" in again.stdout
        # A database a newer butlers migrated (a rollback): said so, nothing changed.
        await conn.execute("UPDATE alembic_version SET version_num = 'core_9999'")
        older = Butlers(*upgrade.args, env=cli_env)
        processes.append(older)
        assert await older.run() == 1
        assert (
            "error: health: database 't_upgrade_health' was migrated by a newer butlers (its "
            "schema revision 'core_9999' is unknown to this one): run that newer butlers, or "
            "restore a backup of the data made before it ran"
        ) in older.stderr, older.stderr
        assert await conn.fetchval("SELECT version_num FROM alembic_version") == "core_9999"
        # `up` on it: none of the fleet starts, and it exits 1 (it started the others, which
        # served on without the refused one, and exited 0: an upgrade walkthrough's rollback).
        general_port = free_port()
        (tmp_path / "config" / "general" / "butler.toml").write_text(
            f'[butler]\nname = "general"\nport = {general_port}\n'
            '[butler.db]\nname = "t_upgrade_general"\n'
        )
        up = Butlers(
            "up", "--only", "general", "health", "--config-dir", str(tmp_path / "config"),
            env=cli_env,
        )  # fmt: skip
        processes.append(up)
        assert await up.run() == 1, up.stdout + up.stderr
        assert (
            "health: the database was migrated by a newer butlers; none of this build's "
            "butlers is started"
        ) in up.stderr, up.stderr
        assert "ready" not in up.stdout and "Starting" not in up.stderr
        await conn.close()
    finally:
        import asyncpg

        admin = await asyncpg.connect(pg_server.dsn("postgres"))
        for name in ("t_upgrade_health", "t_upgrade_general"):
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


# What `--help` (and the parser every command builds) may import: none of these, which take
# seconds to import on a small machine (bench/cli_startup.py measures the effect).
HEAVY_LIBRARIES = ("fastmcp", "mcp", "opentelemetry", "telegram", "claude_agent_sdk", "uvicorn")


def test_help_imports_no_heavy_library() -> None:
    # Every command imports butlers.errors (ConfigError...): it must stay light, which is why
    # ToolRefusal (a FastMCP ToolError) lives in butlers.tool_errors.
    script = (
        "import json, sys\n"
        "from butlers.cli import main\n"
        "for argv in (['--help'], ['up', '--help'], ['list', '--help'], ['gateway', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    imported = set(json.loads(done.stdout.splitlines()[-1]))
    assert "argparse" in imported  # (it did run)
    assert imported.isdisjoint(HEAVY_LIBRARIES), sorted(imported & set(HEAVY_LIBRARIES))


def test_the_collector_is_paused_only_while_a_command_imports() -> None:
    """Paused for the imports, frozen after (what they built is never traversed again), and
    on again for the life of the command, nested or not: a long-running fleet or gateway with
    the collector left off would keep every reference cycle it ever made."""
    import gc

    from butlers.cli import collector_paused

    frozen_before = gc.get_freeze_count()
    try:
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner one leaves the outer's pause alone
            built = [[n] for n in range(1000)]  # what an import leaves behind
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(built)
        with contextlib.suppress(RuntimeError), collector_paused():
            raise RuntimeError("an import failed")
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_up_collects_its_youngest_generation_less_often_and_a_short_command_does_not(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """`butlers up` and `run` answer requests for as long as they run: Python's 700 objects
    between collections cost them 5-7% of their CPU under load (butlers.cli.process). A
    one-off command keeps Python's default."""
    script = (
        "import gc, json, sys\n"
        "from butlers.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as exc:\n"
        "    print(json.dumps({'code': exc.code, 'threshold': gc.get_threshold()}))\n"
    )

    def threshold_after(*argv: str) -> list[int]:
        done = subprocess.run(
            [sys.executable, "-c", script, *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env=cli_env,
        )
        assert "no loadable butler" in done.stderr, done.stderr
        return json.loads(done.stdout.splitlines()[-1])["threshold"]

    import gc

    from butlers.cli.process import SERVING_GEN0_THRESHOLD

    # (No butler to start: each ends there, having set up its process as it always does.)
    defaults = list(gc.get_threshold())
    serving = [SERVING_GEN0_THRESHOLD, *defaults[1:]]
    assert threshold_after("up", "--config-dir", str(tmp_path)) == serving
    assert threshold_after("run", "--config-dir", str(tmp_path), "general") == serving
    assert threshold_after("db", "upgrade", "--config-dir", str(tmp_path)) == defaults


def test_version_and_a_command_started_with_stdin_closed() -> None:
    """`butlers --version` prints the package's version (and this checkout's commit: the
    clone CI runs in is one); a command whose stdin is closed
    (some service managers start it so) does not abort in the event loop (uvloop asserted
    on its own pipe taking fd 0: exit 134)."""
    import butlers
    from butlers.build import build_label

    butlers_bin = str(Path(sys.executable).parent / "butlers")
    version = subprocess.run([butlers_bin, "--version"], capture_output=True, text=True, timeout=60)
    assert (version.returncode, version.stdout.strip()) == (0, f"butlers {build_label()}")
    assert build_label().startswith(butlers.__version__)
    closed = subprocess.run(
        [butlers_bin, "doctor", "--config-dir", "/nonexistent", "--json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(0),
    )
    assert closed.returncode == 1, closed.stderr
    checks = {c["name"]: c["status"] for c in json.loads(closed.stdout)["checks"]}
    assert checks["config"] == "fail"
