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
import sys
import tempfile
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import croniter  # noqa: F401 - see below
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
    # A fixture that starts a process for its tests (none shared yet: the tests that start
    # one themselves are named in _PROC_TESTS).
    "proc": set(),
}
# Tests that start a process themselves (a `butlers` command, `claude --version`, a stdio MCP
# peer, pip): `proc`, by module ("*": all of its tests) or by name (with its parameters, or
# without: all of them). A new one is found by _ProcessGuard, which says to mark it; a mark in
# the test's own file (@pytest.mark.proc) does as well as a line here.
_PROC_TESTS: dict[str, frozenset[str]] = {
    module: frozenset(names.split())
    for module, names in {
        "test_cli.py": "test_help_imports_no_heavy_library "
        "test_version_and_a_command_started_with_stdin_closed",
        "test_cli_client.py": "*",
        "test_config_cli.py": "*",
        "test_deploy_kubernetes.py": "test_the_generated_manifests_are_what_config_butlers_makes",
        "test_doctor.py": "*",
        "test_email_arrivals.py": "*",
        "test_email_durability.py": "*",
        "test_email_limits.py": "test_a_big_mail_is_parsed_without_blocking_the_event_loop "
        "test_a_mail_being_read_when_the_process_died_twice_is_not_read_again "
        "test_a_mail_left_marked_once_is_read_once_more_and_twice_is_not "
        "test_a_mail_over_the_size_limit_is_recorded_as_failed_unread "
        "test_a_mail_that_cannot_be_parsed_is_kept_as_a_failed_row "
        "test_a_mail_whose_reading_a_clean_stop_interrupted_is_read_at_the_next_start "
        "test_a_server_that_keeps_no_keywords_is_used_and_said_so "
        "test_through_imap_a_quadratic_header_is_recorded_as_failed",
        "test_email_media.py": "test_a_mail_with_an_image_and_a_pdf_is_handed_on_with_both "
        "test_a_mail_forwarded_as_an_attachment_is_handed_on_with_its_files "
        "test_a_sender_over_the_hourly_limit_has_no_file_stored "
        "test_an_audio_attachment_is_marked_for_transcription_and_keeps_the_text "
        "test_the_limits_of_the_channel_and_the_switchboard_hold_through_imap",
        "test_email_secrets.py": "*",
        "test_email_sender.py": "test_refused_mail_is_logged_marked_seen_and_never_stored",
        "test_email_tls.py": "test_imap_reads_mail_and_notices_a_dropped_connection "
        "test_imap_refuses_a_certificate_for_another_host "
        "test_imap_refuses_a_plaintext_login_beyond_loopback "
        "test_imap_refuses_an_untrusted_certificate "
        "test_imap_refuses_to_log_in_when_starttls_is_not_offered",
        "test_gateway.py": "test_a_call_that_times_out_is_reported_and_costs_the_child_nothing "
        "test_a_child_that_never_initializes_is_reported_by_name_and_step "
        "test_a_child_that_pings_and_asks_the_gateway_gets_answers "
        "test_a_crashed_child_is_reported_restarted_and_loses_its_active_tools "
        "test_a_gateway_whose_input_is_not_a_pipe_ends_cleanly "
        "test_a_host_sees_suites_introspects_calls_and_closing_stdin_ends_every_child "
        "test_a_signal_stops_a_stdio_gateway_and_everything_it_started "
        "test_activate_injects_tools_with_list_changed_and_deactivate_removes_them "
        "test_an_existing_switchboard_config_json_is_honoured test_child_env_and_allow_deny "
        "test_gateway_over_streamable_http_and_sigterm_ends_its_children "
        "test_introspection_full_from_the_config_and_redacted_for_one_call "
        "test_killing_the_gateway_leaves_no_descendant_behind",
        "test_gateway_configs.py": "test_a_gateway_on_every_source_at_once",
        "test_gateway_env.py": "test_a_slow_initialize_within_the_call_timeout_is_waited_for "
        "test_an_idle_child_is_stopped_and_started_again_by_its_next_call "
        "test_a_result_past_max_result_bytes_is_refused_and_the_child_serves_on",
        "test_gateway_hosts.py": "*",
        "test_gateway_install.py": "*",
        "test_gateway_modes.py": "*",
        "test_gateway_protocol.py": "*",
        "test_gateway_reaper.py": "*",
        "test_gateway_report.py": "test_each_modes_bytes_are_what_the_gateway_writes_on_the_wire "
        "test_report_compares_direct_suite_activate_and_search test_search_mode_report_and_dry_run",
        "test_gateway_search.py": "test_gateway_call_is_a_suite_call_span_with_arguments_redacted "
        "test_the_index_follows_a_child_whose_tools_change "
        "test_a_server_that_never_starts_holds_up_one_search_and_no_call "
        "test_a_tool_several_servers_have_alike_is_one_result "
        "test_a_call_of_a_known_tool_never_waits_for_a_failing_server",
        "test_gateway_tracing.py": "*",
        "test_gateway_wrapper.py": "test_a_stdio_server_of_claude_code_gets_no_credentials_and_"
        "no_values_in_argv",
        "test_http.py": "test_an_mcp_path_moved_by_fastmcp_settings_still_needs_the_token",
        "test_init.py": "*",
        "test_install.py": "*",
        "test_logs.py": "*",
        "test_mcp_connection.py": "test_a_dropped_connection_fails_every_waiting_call_with_its_"
        "reason[stdio] test_a_timed_out_request_is_cancelled_at_the_peer[stdio] "
        "test_the_handshake_agrees_on_the_newest_revision_of_the_types_package[stdio] "
        "test_the_peers_other_requests_get_method_not_found[stdio] "
        "test_the_peers_ping_is_answered[stdio] test_tools_list_changed_reaches_the_owner[stdio]",
        "test_redaction_escaped.py": "test_an_awkward_secret_from_the_environment_never_shows_"
        "in_the_log",
        "test_schemas.py": "test_the_generator_writes_them_and_check_names_what_is_stale",
        "test_secrets.py": "test_redaction_survives_bad_logging_calls_and_covers_warnings",
        "test_settings.py": "test_the_command_line_reports_a_bad_variable_once_without_a_traceback",
        "test_tracing.py": "test_grpc_asked_for_without_the_extra_is_one_clear_error",
    }.items()
}
# The markers `make test-fast` deselects. A test carrying none of them is in the fast lane and
# may start no process: one that does (a `butlers` subprocess, a mock MCP server, a program's
# --version) marks itself `proc`, and a test in the lane that starts one anyway fails, naming
# the program (`_ProcessGuard`), so that the lane stays fast as tests are added.
_SLOW_MARKERS = frozenset({*_MARKER_FIXTURES, "proc"})


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
        proc = _PROC_TESTS.get(item.path.name, frozenset())
        if proc & {"*", item.name, getattr(item, "originalname", item.name)}:
            item.add_marker("proc")


# croniter's import asks `platform.architecture()`, which runs `file -b` on the interpreter:
# imported above, with this module, so the first schedule parsed by a fast-lane test is not a
# process (test_config's failed so when it came first in its worker).


class _ProcessGuard:
    """Notes every process started while a fast-lane test sets up and runs (not in its
    teardown, where the session's fixtures may end and stop their servers):
    `subprocess.Popen` (asyncio's subprocesses and `subprocess.run` go through it),
    `_posixsubprocess.fork_exec` (multiprocessing's too), `os.fork`, `os.posix_spawn` /
    `posix_spawnp`, `os.system`, and a pymap server asked of tests/fakes/mail's forker. The
    process still starts, so the test's own cleanup runs as it would; the test then fails,
    naming it."""

    def __init__(self) -> None:
        self.started: dict[str, None] = {}  # in order, once each
        self._undo: list[Callable[[], None]] = []

    def _note(self, owner: object, name: str, argv_of: Callable[..., object]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def noted(*args: object, **kwargs: object) -> object:
            self.started[_command(argv_of(*args, **kwargs))] = None
            return original(*args, **kwargs)

        setattr(owner, name, noted)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> _ProcessGuard:
        import _posixsubprocess
        import subprocess

        self._note(subprocess.Popen, "__init__", lambda popen, args, *_, **__: args)
        self._note(_posixsubprocess, "fork_exec", lambda args, *_, **__: args)
        self._note(os, "fork", lambda: "os.fork()")
        self._note(os, "system", lambda command: command)
        self._note(os, "posix_spawn", lambda path, argv, *_, **__: argv)
        self._note(os, "posix_spawnp", lambda path, argv, *_, **__: argv)
        # A pymap server is a process of its own, forked by a helper process (tests/fakes/mail).
        if (mail := sys.modules.get("tests.fakes.mail")) is not None:
            self._note(mail._PymapForker, "start", lambda _, argv, *__: ["pymap", *argv])
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _command(args: object) -> str:
    """A started process's command line, as the guard names it."""
    if isinstance(args, str | bytes | os.PathLike):
        return os.fsdecode(args)
    if isinstance(args, list | tuple):
        return " ".join(os.fsdecode(a) if isinstance(a, str | bytes) else str(a) for a in args)
    return repr(args)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item, "call"))


def _guarded(item: pytest.Item, phase: str) -> Iterator[None]:
    """The fast lane's rule (_SLOW_MARKERS), checked for every test without those markers,
    in every run: `make test` fails such a test as `make test-fast` would."""
    if any(next(item.iter_markers(name), None) for name in _SLOW_MARKERS):
        return (yield)
    with _ProcessGuard() as guard:
        result = yield
    if guard.started:
        pytest.fail(
            f"this test starts a process (in its {phase}: {'; '.join(guard.started)}): "
            "mark it proc (@pytest.mark.proc in its file, its name in _PROC_TESTS in "
            "tests/conftest.py, or the fixture that starts it in _MARKER_FIXTURES there); "
            "the fast lane runs no process",
            pytrace=False,
        )
    return result


@pytest.fixture(scope="session", autouse=True)
def _clean_environment(tmp_path_factory: pytest.TempPathFactory) -> None:
    for key in list(os.environ):
        if key.startswith(_LEAKY_PREFIXES) or key == "DATABASE_URL":
            del os.environ[key]
    # The gateway records what it approved at a project's first start (and `gateway install`
    # too): in the session's own state directory, never the user's ~/.local/state.
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))


@pytest.fixture(autouse=True)
def _log_record_factory_put_back() -> Iterator[None]:
    """`install_log_redaction` (every CLI command's start, doctor, init) is process-wide and
    permanent, as it must be in a `butlers` process: a test that reaches it in-process would
    leave every later test of its worker redacting with its secrets, and warnings captured
    into logging (seen once: an in-process init test failed test_ticker's and test_secrets'
    log checks in the same xdist worker). Both are put back here; the tests that change
    handlers or levels put those back themselves."""
    factory, showwarning = logging.getLogRecordFactory(), warnings.showwarning
    yield
    if logging.getLogRecordFactory() is not factory:
        logging.setLogRecordFactory(factory)
    if warnings.showwarning is not showwarning:
        logging.captureWarnings(False)
        warnings.showwarning = showwarning


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
async def switchboard_pool(
    pg_server: PostgresServer,
    switchboard_template: str,
    make_database: Callable[..., Awaitable[str]],
) -> AsyncIterator[asyncpg.Pool]:
    """A switchboard's database of the test's own (from the template), and a pool on it."""
    from butlers.db import create_pool

    pool = await create_pool(pg_server, await make_database(switchboard_template))
    yield pool
    await pool.close()


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


async def recorded_as_sent(conn: Any, message_id: int) -> None:
    """Until the outbox has recorded the chat message `message_id` (which the fake Bot API
    got) as sent: only then is a reply to it known to answer a question. The Bot API has it
    a moment before (a reply within that moment, which no person types, is no answer: a
    test that did not wait failed under a loaded CI)."""

    async def recorded() -> bool:
        return bool(
            await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE status = 'sent' AND $1 = ANY(sent_ids)",
                str(message_id),
            )
        )

    await eventually(recorded)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    """Until `check()` is true: for state another process or task changes (a database row),
    which offers nothing to wait on."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 (nothing to wait on but the state itself)
            await asyncio.sleep(0.05)
