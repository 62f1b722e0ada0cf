"""Shared fixtures: a real PostgreSQL, per-test databases, a scripted Messages API, live butlers.

PostgreSQL: TEST_DATABASE_URL if set, else a testcontainers server when a Docker engine
answers, else an embedded PostgreSQL 18 started for the session. Each test that needs a
database gets a fresh copy of a migrated template (CREATE DATABASE ... TEMPLATE).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import pytest

# What the fixtures use is imported where they use it: this module is loaded first by every
# pytest process, xdist's controller included, which runs no test (the daemon alone takes
# 1.3 s to import, before any worker can start).
if TYPE_CHECKING:
    from butlers.config import ButlerConfig
    from butlers.daemon import ButlerDaemon
    from butlers.db import EmbeddedServer, PostgresServer
    from butlers.settings import Settings
    from butlers.telemetry import Telemetry
    from tests.fakes.bot_api import FakeBotAPI
    from tests.fakes.messages_api import ScriptedMessagesAPI
    from tests.fakes.otlp import OtlpReceiver

pytest_plugins = ["tests.npm_servers"]

# Nothing of the host's Claude / Anthropic / butlers setup may leak into a test.
_LEAKY_PREFIXES = ("ANTHROPIC_", "CLAUDE_", "OTEL_", "BUTLERS_", "TELEGRAM_")


# Markers (registered in pyproject.toml) that `make test-fast` deselects, set from the fixtures
# a test uses (directly or through other fixtures), so a new test is marked without thinking of
# it. A test that starts Claude Code or PostgreSQL in some other way marks itself.
_MARKER_FIXTURES = {
    # pg_server, and the places tests give a PostgreSQL they start themselves (an embedded
    # server's home, a `butlers` subprocess's BUTLERS_DATA_DIR).
    "pg": {"pg_server", "pg_home", "embedded_env", "cli_env"},
    "claude": {"messages_api"},
    "npm": {"npm_servers"},
}


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """Collecting imports every test module and most libraries with them: as in the
    `butlers` command, with the garbage collector paused meanwhile (a worker collected the
    fast loop in 2.2 s instead of 3.8 s, measured)."""
    from butlers.cli import collector_paused

    with collector_paused():
        return (yield)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in _MARKER_FIXTURES.items():
            if used & fixtures:
                item.add_marker(marker)


@pytest.fixture(scope="session", autouse=True)
def _clean_environment() -> None:
    for key in list(os.environ):
        if key.startswith(_LEAKY_PREFIXES) or key == "DATABASE_URL":
            del os.environ[key]


def _docker_answers() -> bool:
    import gc
    import warnings

    with warnings.catch_warnings():
        # docker-py leaves the socket of a refused connection open (its transport's
        # unixconn.connect), kept alive by the exception's reference cycles until some later
        # garbage collection warns (an error, under our filterwarnings) in an unrelated test.
        # Collected here, where that warning is expected.
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker

            client = docker.from_env(timeout=2)
            try:
                client.ping()
            finally:
                client.close()
            answers = True
        except Exception:
            answers = False
        gc.collect()
    return answers


@pytest.fixture(scope="session")
async def pg_server() -> AsyncIterator[PostgresServer]:
    from butlers.db import ExternalServer

    url = os.environ.get("TEST_DATABASE_URL")
    if url:
        yield ExternalServer(url)
        return
    if _docker_answers():
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers before the community split
            from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:18-alpine", driver=None) as container:
            yield ExternalServer(container.get_connection_url())
        return
    async with embedded_server("butlers-test-pg-") as server:
        yield server


@contextlib.asynccontextmanager
async def embedded_server(prefix: str) -> AsyncIterator[EmbeddedServer]:
    """An embedded PostgreSQL in a directory of its own (named `prefix`...), stopped and
    removed afterwards: the session's server, and a test's own one that it may stop.

    Not under pytest's basetemp: pytest makes /tmp/pytest-of-<user> 0700 again whenever a
    session starts, which would cut a root-run server (it runs as an unprivileged user) off
    its data directory mid-run. Our own directory, traversable (not readable) by others.
    """
    from butlers.db import EmbeddedServer

    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o711)
    server = EmbeddedServer(root / "pgdata", environ=os.environ)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def drop_databases(server: PostgresServer, *names: str) -> None:
    """Drop `names` where they exist, connections to them or not: the templates' and test
    databases' cleanup, and that of tests whose `butlers` processes made their own."""
    conn = await asyncpg.connect(server.dsn("postgres"))
    try:
        for name in names:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture(scope="session")
async def core_template(pg_server: PostgresServer) -> AsyncIterator[str]:
    """A database with the core migrations applied, copied for each test."""
    from butlers.db import prepare_database

    name = f"tmpl_core_{uuid.uuid4().hex[:8]}"
    await prepare_database(pg_server, name, ("core",))
    yield name
    await drop_databases(pg_server, name)


@pytest.fixture(scope="session")
async def switchboard_template(pg_server: PostgresServer) -> AsyncIterator[str]:
    """Core, then the switchboard branch: what the switchboard's database gets."""
    from butlers.db import prepare_database

    name = f"tmpl_switchboard_{uuid.uuid4().hex[:8]}"
    await prepare_database(pg_server, name, ("core", "switchboard"))
    yield name
    await drop_databases(pg_server, name)


@pytest.fixture
async def make_database(
    pg_server: PostgresServer, core_template: str
) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    created: list[str] = []

    async def make(template: str = core_template) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        conn = await asyncpg.connect(pg_server.dsn("postgres"))
        try:
            await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        finally:
            await conn.close()
        created.append(name)
        return name

    yield make
    # At once: each DROP DATABASE waits for a checkpoint, and concurrent ones share it.
    errors = [
        e
        for e in await asyncio.gather(
            *(drop_databases(pg_server, name) for name in created), return_exceptions=True
        )
        if isinstance(e, BaseException)
    ]
    if errors:
        raise BaseExceptionGroup(f"{len(errors)} test database(s) not dropped", errors)


@pytest.fixture
async def db_conn(pg_server: PostgresServer) -> AsyncIterator[Callable[[str], Awaitable]]:
    """Open asyncpg connections to a test database, closed after the test."""
    conns: list[asyncpg.Connection] = []

    async def connect(database: str) -> asyncpg.Connection:
        conn = await asyncpg.connect(pg_server.dsn(database))
        conns.append(conn)
        return conn

    yield connect
    for conn in conns:
        await conn.close()


@pytest.fixture(scope="session")
async def messages_api() -> AsyncIterator[ScriptedMessagesAPI]:
    from tests.fakes.messages_api import ScriptedMessagesAPI

    api = ScriptedMessagesAPI()
    await api.start()
    yield api
    await api.stop()


WEBHOOK_SECRET = "hook-Secret_0123456789"


@pytest.fixture
async def bot_api(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeBotAPI]:
    """A fake Telegram Bot API on loopback; its (random) token and a webhook secret are in the
    environment, where a butler reads them."""
    from tests.fakes.bot_api import FakeBotAPI

    api = FakeBotAPI(token=f"123456:{uuid.uuid4().hex}")
    await api.start()
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", api.token)
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", WEBHOOK_SECRET)
    yield api
    await api.stop()


@pytest.fixture
async def otlp() -> AsyncIterator[OtlpReceiver]:
    """A local OTLP receiver (HTTP and gRPC) for the spans real exporters send."""
    from tests.fakes.otlp import OtlpReceiver

    receiver = OtlpReceiver()
    await receiver.start()
    yield receiver
    await receiver.stop()


@pytest.fixture
def scripted_api(messages_api: ScriptedMessagesAPI) -> ScriptedMessagesAPI:
    """The session's scripted Messages API, with a clean script and log for this test."""
    messages_api.reset()
    return messages_api


@pytest.fixture
def claude_env(tmp_path: Path, scripted_api: ScriptedMessagesAPI) -> dict[str, str]:
    """Environment for the real Claude Code binary: isolated home, scripted API, fake key."""
    from butlers.claude_code import isolated_cli_env

    home = tmp_path / "claude-home"
    home.mkdir()
    return isolated_cli_env(home, scripted_api.url, inherited=os.environ)


def no_credentials_env(home: Path) -> dict[str, str]:
    """A Claude Code environment with no API key, no login and no API override."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_API_KEY": "",
        "ANTHROPIC_BASE_URL": "",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def butler_config(name: str = "alpha", **overrides) -> ButlerConfig:
    """A butler on an ephemeral loopback port, no background ticker unless asked. The one
    named `switchboard` is the switchboard (it has a [switchboard] table: the defaults, unless
    `switchboard=` gives one); any other becomes one with `switchboard=`."""
    from butlers.config import ButlerConfig, RuntimeConfig, SwitchboardConfig

    runtime = overrides.pop("runtime", RuntimeConfig(timeout_s=60, tick_interval_s=0))
    # A channel's table by its name (`telegram=TelegramConfig(...)`), as ButlerConfig.channels.
    channels = {
        channel: table
        for channel in ("telegram", "email")
        if (table := overrides.pop(channel, None)) is not None
    }
    if channels:
        overrides["channels"] = channels
    if name == "switchboard":
        overrides.setdefault("switchboard", SwitchboardConfig())
    return replace(
        ButlerConfig(name=name, port=0, description=f"{name} test butler"),
        runtime=runtime,
        **overrides,
    )


StartButler = Callable[..., Awaitable["ButlerDaemon"]]


@pytest.fixture
async def start_butler(
    pg_server: PostgresServer,
    make_database: Callable[..., Awaitable[str]],
    switchboard_template: str,
    tmp_path: Path,
    claude_env: dict[str, str],
    telemetry: Telemetry,
) -> AsyncIterator[StartButler]:
    """Start real butler daemons on loopback, each on a fresh database; stopped after the test.

    A switchboard (a config with a [switchboard] table) gets the switchboard's tables and
    discovers `config_dir`.
    Pass `database=` to start again on an earlier daemon's database (a restart). Its
    Settings are read from the environment when it starts (after any monkeypatch.setenv),
    unless `settings=` is given.
    """
    from butlers.daemon import ButlerDaemon
    from butlers.settings import Settings

    daemons: list[ButlerDaemon] = []

    async def start(
        config: ButlerConfig | None = None,
        *,
        auth_token: str | None = None,
        session_env: dict[str, str] | None = None,
        config_dir: Path | None = None,
        database: str | None = None,
        telemetry: Telemetry = telemetry,
        settings: Settings | None = None,
    ) -> ButlerDaemon:
        config = config or butler_config()
        if database is None:
            database = (
                await make_database(switchboard_template)
                if config.is_switchboard
                else await make_database()
            )
        config = replace(config, db_name=database)
        daemon = ButlerDaemon(
            config,
            pg_server,
            data_dir=tmp_path / "data",
            settings=Settings.from_environ() if settings is None else settings,
            auth_token=auth_token,
            session_env=claude_env if session_env is None else session_env,
            config_dir=config_dir,
            telemetry=telemetry,
        )
        await daemon.start()
        daemons.append(daemon)
        return daemon

    yield start
    await _stop_all(daemons)


async def _stop_all(daemons: list[ButlerDaemon]) -> None:
    """Stop every daemon, as `butlers up` does: a switchboard (it holds connections to the others)
    first, then the rest at once. Every one is stopped; what went wrong is raised afterwards,
    all of it, so a broken stop() fails the test instead of hiding behind the others."""
    errors: list[Exception] = []

    async def stop(daemon: ButlerDaemon) -> None:
        try:
            await daemon.stop()
        except Exception as exc:
            exc.add_note(f"while stopping butler {daemon.config.name!r}")
            errors.append(exc)

    clients = [d for d in daemons if d.switchboard is not None]
    for daemon in clients:
        await stop(daemon)
    await asyncio.gather(*(stop(d) for d in daemons if d not in clients))
    if errors:
        raise ExceptionGroup(f"{len(errors)} butler(s) did not stop cleanly", errors)


@pytest.fixture(scope="session")
def _span_exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter()


@pytest.fixture(scope="session")
def telemetry(_span_exporter) -> Telemetry:
    """What `butlers up` builds from the environment, exporting to memory instead of OTLP:
    every in-process butler's spans land in `spans`."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from butlers.telemetry import Telemetry, let_butlers_own_mcp_spans

    let_butlers_own_mcp_spans()  # as Telemetry.from_environment does
    return Telemetry(SimpleSpanProcessor(_span_exporter))


@pytest.fixture
def spans(_span_exporter):
    """The finished spans of this test (cleared at its start)."""
    _span_exporter.clear()
    return _span_exporter


def write_butler_dir(
    root: Path, name: str, port: int, *, description: str | None = None, extra: str = ""
) -> Path:
    """A config/butlers/<name>/butler.toml for a butler listening on `port`."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    description = description if description is not None else f"{name} test butler"
    (directory / "butler.toml").write_text(
        f'[butler]\nname = "{name}"\ndescription = "{description}"\nport = {port}\n{extra}'
    )
    return directory


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def migration_heads(*branches: str) -> set[str]:
    """What `alembic_version` holds once `branches` are migrated to their heads: each branch's
    head, less any head another of them depends on (alembic records only the dependant).
    Read from the migration scripts, so a new migration needs no test edited."""
    from alembic.script import ScriptDirectory

    from butlers.db import migrations_dir

    script = ScriptDirectory(str(migrations_dir()))
    heads = {script.get_revision(f"{branch}@head").revision for branch in branches}
    below = {
        revision.revision
        for head in heads
        for revision in script.iterate_revisions(head, "base")
        if revision.revision != head
    }
    return heads - below


@contextlib.contextmanager
def log_records(logger_name: str) -> Iterator[list[logging.LogRecord]]:
    """The records that reach `logger_name` (children included) while the block runs.

    uvicorn's and FastMCP's logging configurations keep their records away from the root
    logger, so caplog never sees them; this listens on their own logger. Enter it after the
    daemon started: uvicorn's config resets the handlers of its loggers.
    """
    records: list[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Collect(level=logging.DEBUG)
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    """Until `check()` is true: for state another process or task changes (a database row),
    which offers nothing to wait on."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 (nothing to wait on but the state itself)
            await asyncio.sleep(0.05)
