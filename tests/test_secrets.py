"""No configured secret can be read where it should not be: not in any process's command line,
not in a Claude Code session's environment, not in the log (DEBUG included), not in a span,
not in routing_log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tomllib
import uuid
import warnings
from pathlib import Path

import psutil
import pytest
from fastmcp import Client

from butlers.claude_code import isolated_cli_env
from butlers.redact import REDACTED, Redactor, install_log_redaction
from butlers.switchboard.inbox import IncomingMessage
from butlers.switchboard.route import summarize
from butlers.telemetry import RedactingSpanExporter
from tests.conftest import StartButler
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.fakes.otlp import OtlpReceiver
from tests.test_cli import Butlers
from tests.test_inbox import is_classifier, model, start_fleet
from tests.test_tracing import CHAT, Fleet

HELD_S = 60.0


def claude_processes(butler: str) -> list[psutil.Process]:
    """The Claude Code CLIs this test process started for `butler` (by their MCP config's
    place: <data>/sessions/<butler>/.mcp/)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            args = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if (
            "--mcp-config" in args
            and f"/sessions/{butler}/" in args[args.index("--mcp-config") + 1]
        ):
            found.append(process)
    return found


def proc_bytes(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def environment_of(pid: int) -> dict[str, str]:
    entries = proc_bytes(pid, "environ").decode(errors="replace").split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


async def held_session(api: ScriptedMessagesAPI, matches, butler: str) -> psutil.Process:
    """`butler`'s Claude Code process, while the API holds its request that `matches`."""
    await asyncio.wait_for(api.wait_for_request(matches), 60)
    [process] = claude_processes(butler)
    return process


async def test_claude_code_has_no_secret_in_its_command_line_or_environment(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secrets = {
        "TELEGRAM_BOT_TOKEN": f"7000:bot-token-{uuid.uuid4().hex}",
        "BUTLERS_EMAIL_PASSWORD": f"mail-pw-{uuid.uuid4().hex}",
        "DATABASE_URL": f"postgresql://u:db-pw-{uuid.uuid4().hex}@db/x",
        "SOME_UNRELATED_VARIABLE": f"unrelated-{uuid.uuid4().hex}",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    auth_token = f"auth-{uuid.uuid4().hex}"
    scripted_api.respond_with(model("health", {"health": "Logged."}))
    scripted_api.delay_for = lambda body: HELD_S
    switchboard, targets = await start_fleet(
        start_butler, tmp_path, names=("general", "health"), auth_token=auth_token
    )
    worker = switchboard.switchboard.worker
    inbox_id = await worker.accept(IncomingMessage("telegram", "u1", "log 75kg", source_id="42"))

    # The classifier: its MCP headers carry the auth token and this message's credential.
    classifier = await held_session(scripted_api, is_classifier, "switchboard")
    [dispatch] = worker.dispatcher._open
    forbidden = [*secrets.values(), auth_token, dispatch.credential]
    check_process(classifier, forbidden, secrets)
    await scripted_api.release_held()

    # The health butler's own session: its MCP headers carry the auth token.
    butler = await held_session(scripted_api, lambda body: not is_classifier(body), "health")
    check_process(butler, [*secrets.values(), auth_token], secrets)
    await scripted_api.release_held()

    row = await asyncio.wait_for(worker.wait_for(inbox_id), 60)
    assert (row["status"], row["reply"]) == ("done", "Logged.")
    # The private MCP config files are gone with their sessions.
    for daemon in (switchboard, targets["health"]):
        config_dir = daemon.data_dir / "sessions" / daemon.config.name / ".mcp"
        assert config_dir.is_dir() and list(config_dir.iterdir()) == []
        assert config_dir.stat().st_mode & 0o777 == 0o700


def check_process(process: psutil.Process, forbidden: list[str], secrets: dict) -> None:
    argv = proc_bytes(process.pid, "cmdline")
    environ = proc_bytes(process.pid, "environ")
    for value in forbidden:
        assert value.encode() not in argv, f"{value} in argv"
        assert value.encode() not in environ, f"{value} in environ"
    names = environment_of(process.pid)
    assert not set(secrets) & set(names), sorted(names)
    # What Claude Code does need is there; and no traffic but the Messages API's (telemetry,
    # error reports, update checks), which the tests' environment does not ask for.
    assert {"PATH", "HOME", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"} <= set(names)
    assert b"\0CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1\0" in b"\0" + environ
    # Its MCP config is a path to a file only we can read, not JSON on the command line.
    args = argv.decode().split("\0")
    config = Path(args[args.index("--mcp-config") + 1])
    assert config.is_file() and config.stat().st_mode & 0o777 == 0o600
    assert b"X-Butlers-Classification" not in argv and b"Authorization" not in argv


async def test_mcp_config_files_a_killed_run_left_are_removed_at_start(
    start_butler: StartButler, tmp_path: Path
) -> None:
    leftovers = tmp_path / "data" / "sessions" / "alpha" / ".mcp"
    leftovers.mkdir(parents=True)
    (leftovers / "0123.json").write_text('{"headers": {"Authorization": "Bearer t"}}')
    await start_butler()
    assert list(leftovers.iterdir()) == []


async def test_a_running_replicas_mcp_config_files_are_left_alone(
    start_butler: StartButler, tmp_path: Path
) -> None:
    """Two switchboard processes on one data directory: the one starting removes what a
    killed process left, not the files of the other one's sessions in flight."""
    leftovers = tmp_path / "data" / "sessions" / "alpha" / ".mcp"
    leftovers.mkdir(parents=True)
    other = await asyncio.create_subprocess_exec("sleep", "60")
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    try:
        (leftovers / f"{other.pid}-a.json").write_text("{}")
        (leftovers / f"{dead.pid}-b.json").write_text("{}")
        await start_butler()
        assert [p.name for p in leftovers.iterdir()] == [f"{other.pid}-a.json"]
    finally:
        other.kill()
        await other.wait()


async def test_secrets_stay_out_of_debug_logs_spans_and_routing_log(
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    otlp: OtlpReceiver,
    pg_server,
) -> None:
    """The real `butlers up --log-level DEBUG`, with every kind of secret configured, takes a
    Telegram message through classification, route and reply, and a direct route whose
    arguments quote a secret; then the whole log and every exported span are searched."""
    fleet = Fleet(tmp_path, bot_api, scripted_api, pg_server)
    try:
        await _run_with_secrets(fleet, tmp_path, bot_api, scripted_api, otlp)
    finally:
        await fleet.drop()


async def _run_with_secrets(
    fleet: Fleet,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    otlp: OtlpReceiver,
) -> None:
    secrets = {
        "BUTLERS_AUTH_TOKEN": f"auth-{uuid.uuid4().hex}",
        "TELEGRAM_WEBHOOK_SECRET": f"hook-{uuid.uuid4().hex}",
        "BUTLERS_EMAIL_PASSWORD": f"mail-{uuid.uuid4().hex}",
        "BUTLERS_EMAIL_WEBHOOK_TOKEN": f"mailhook-{uuid.uuid4().hex}",
    }
    api_key = f"sk-ant-{uuid.uuid4().hex}"
    fleet.env.update(secrets)
    fleet.env.update(
        isolated_cli_env(tmp_path / "home", scripted_api.url, api_key=api_key, inherited=fleet.env)
    )
    fleet.env.update(BUTLERS_EMAIL_USER="butler@example.com")
    switchboard_toml = fleet.config_dir / "switchboard" / "butler.toml"
    switchboard_toml.write_text(
        switchboard_toml.read_text()
        + '[modules.email]\nmode = "webhook"\nsmtp_host = "127.0.0.1"\nsmtp_port = 9\n'
        'allowed_senders = ["*"]\n'
    )
    forbidden = [*secrets.values(), api_key, bot_api.token]
    scripted_api.respond_with(model("general", {"general": "Milk is on the list."}))
    fleet.export_to(otlp, "http", every_ms=200)
    butlers = Butlers(
        "--log-level", "DEBUG", "up", "--config-dir", str(fleet.config_dir), env=fleet.env
    )
    await butlers.start()
    try:
        await butlers.wait_ready()
        await bot_api.push_text(CHAT, "add milk to my list")
        [sent] = await bot_api.wait_sent(1, timeout_s=90)
        assert sent["text"] == "Milk is on the list."
        port = tomllib.loads(switchboard_toml.read_text())["butler"]["port"]
        url = f"http://127.0.0.1:{port}/sse"
        async with Client(url, auth=secrets["BUTLERS_AUTH_TOKEN"]) as client:
            await client.call_tool(
                "route",
                {
                    "butler_name": "general",
                    "tool_name": "state_set",
                    "args": {"key": "k", "value": f"token is {bot_api.token}"},
                },
            )
        await otlp.wait_for(lambda spans: any(s.name == "switchboard.reply" for s in spans))
    finally:
        assert await butlers.stop() == 0, butlers.stderr
    log = butlers.stdout + butlers.stderr
    assert " DEBUG " in log and "getUpdates" in log  # it did log at DEBUG, the Bot API too
    for value in forbidden:
        assert value not in log, f"{value} in the log:\n{_around(log, value)}"
        assert all(value.encode() not in raw for raw in otlp.exports), f"{value} in a span"
    rows = [dict(r) for r in await fleet.routing_log()]
    assert len(rows) == 2 and all(value not in json.dumps(rows, default=str) for value in forbidden)
    assert f"token is {REDACTED}" in rows[1]["prompt_summary"]


def _around(text: str, value: str) -> str:
    at = text.index(value)
    return text[max(0, at - 300) : at + 100]


def test_log_redaction_covers_messages_arguments_and_tracebacks() -> None:
    redactor = Redactor()
    saved = logging.getLogRecordFactory()
    install_log_redaction(redactor)
    try:
        redactor.add(["s3cret-value", "short"[:3]])  # too short to redact: ignored
        logger = logging.getLogger("tests.redaction")
        records: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record)

        logger.addHandler(Keep())
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        logger.debug("url %s/bot%s/getUpdates", "http://x", "s3cret-value")
        try:
            raise RuntimeError("connect to postgresql://u:s3cret-value@db failed")
        except RuntimeError:
            logger.exception("failed")
        formatted = "\n".join(logging.Formatter().format(r) for r in records)
        assert "s3cret-value" not in formatted
        assert "bot[redacted]/getUpdates" in formatted
        assert "RuntimeError: connect to postgresql://u:[redacted]@db failed" in formatted
        assert redactor.secrets == ("s3cret-value",)
        assert Redactor.from_environment(
            environ={"DATABASE_URL": "postgresql://u:pg-password@h/db", "MY_API_KEY": "k" * 8}
        ).secrets == ("pg-password", "k" * 8)
    finally:
        logging.captureWarnings(False)
        logging.setLogRecordFactory(saved)


def test_redaction_survives_bad_logging_calls_and_covers_warnings() -> None:
    redactor = Redactor(["w4rning-secret"])
    saved = logging.getLogRecordFactory()
    # From a known state: a test before this one in the same process may have left warnings
    # captured inside a `catch_warnings` that has since put `showwarning` back, and then
    # captureWarnings(True) would think it already captures (seen under pytest-xdist).
    logging.captureWarnings(False)
    install_log_redaction(redactor)
    try:
        logger = logging.getLogger("tests.redaction.bad")
        record = logger.makeRecord(
            logger.name, logging.INFO, __file__, 1, "two %s %s", ("a",), None
        )
        assert record.msg == "two %s %s"  # left for logging's own error report, not raised
        seen: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(record)

        handler = Keep()
        logging.getLogger("py.warnings").addHandler(handler)
        try:
            warnings.warn("token w4rning-secret expired", UserWarning, stacklevel=1)
        finally:
            logging.getLogger("py.warnings").removeHandler(handler)
        [warned] = seen
        assert "w4rning-secret" not in warned.getMessage() and REDACTED in warned.getMessage()
    finally:
        logging.captureWarnings(False)
        logging.setLogRecordFactory(saved)


def test_a_tool_errors_line_says_why_and_what_it_says_is_redacted() -> None:
    """FastMCP's "Error calling tool 'x'" (no exc_info, inside its except) gets the error in
    hand added, redacted like the rest; another logger's line, or one outside an except, is
    left as it was."""
    saved = logging.getLogRecordFactory()
    install_log_redaction(Redactor(["t00l-secret"]))
    try:
        fastmcp = logging.getLogger("fastmcp.server.server")

        def made(logger: logging.Logger, message: str) -> str:
            return logger.makeRecord(
                logger.name, logging.WARNING, __file__, 1, message, (), None
            ).getMessage()

        try:
            raise ValueError("refused: token t00l-secret is wrong")
        except ValueError:
            said = made(fastmcp, "Error calling tool 'route'")
            other = made(logging.getLogger("tests.other"), "Error calling tool 'route'")
        assert said == f"Error calling tool 'route': refused: token {REDACTED} is wrong"
        assert other == "Error calling tool 'route'"
        # Redacted whole before it is cut (a secret across the cut), one line whatever it held.
        try:
            raise ValueError("x" * 290 + " t00l-secret\nFORGED forged line")
        except ValueError:
            long = made(fastmcp, "Error calling tool 'route'")
        assert "t00l" not in long and "\n" not in long and len(long) < 340, long
        assert made(fastmcp, "Error calling tool 'route'") == "Error calling tool 'route'"
    finally:
        logging.setLogRecordFactory(saved)


def test_a_secret_is_redacted_before_it_is_cut_to_fit() -> None:
    secret = "7312345678:AAHk3vR9xQpL2-secret-bot-token-zz"
    redactor = Redactor([secret])
    for pad in range(150, 200):
        summary = summarize({"note": "x" * pad + secret}, redactor)
        assert secret[:8] not in summary, pad


def test_exported_spans_carry_no_secret() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Status, StatusCode

    secret = "span-secret-0123456789"
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(
        SimpleSpanProcessor(RedactingSpanExporter(memory, Redactor([secret])))
    )
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(f"call {secret}") as span:
        span.set_attribute("url", f"https://api/bot{secret}/getMe")
        span.set_attribute("list", [secret, "ok"])
        span.record_exception(RuntimeError(f"refused: {secret}"))
        span.set_status(Status(StatusCode.ERROR, f"failed with {secret}"))
    provider.shutdown()
    [exported] = memory.get_finished_spans()
    assert secret not in exported.to_json()
    assert exported.attributes["url"] == f"https://api/bot{REDACTED}/getMe"
    assert exported.status.status_code is StatusCode.ERROR
    assert exported.events[0].attributes["exception.message"] == f"refused: {REDACTED}"


@pytest.mark.proc
def test_a_servers_environment_is_out_of_its_users_other_processes_reach() -> None:
    """`butlers up`, `run` and `gateway` hold every secret of the fleet in their environment;
    a tool server they start runs as the same user and read it in /proc/<pid>/environ (a red
    team's, which then called every tool as the operator). keep_memory_private makes that
    root's alone (PR_SET_DUMPABLE 0); a child is readable again once it execs, with its own
    environment only."""
    import subprocess
    import sys

    probe = (
        "import ctypes, os\n"
        "from butlers.cli.process import keep_memory_private\n"
        "keep_memory_private()\n"
        "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))\n"  # PR_GET_DUMPABLE
        "print(os.stat(f'/proc/{os.getpid()}/environ').st_uid)\n"
    )
    dumpable, owner = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert (dumpable, owner) == ("0", "0")  # not dumpable; its /proc files are root's
