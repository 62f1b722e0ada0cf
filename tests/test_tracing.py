"""One message, one trace, exported over OTLP by the real `butlers up` to a local receiver.

The full path runs for real: fake Telegram Bot API -> switchboard (python-telegram-bot) ->
inbox -> the classifier's Claude Code (real binary, scripted Messages API) -> `route` ->
the general butler's `trigger` -> its own Claude Code session -> reply. Every span of it —
the switchboard's, both Claude Code sessions' own, the general butler's — must carry the
routing_log row's trace id and hang in one tree under `switchboard.receive`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from fastmcp import Client

from butlers.errors import ButlersError
from butlers.settings import Settings
from butlers.telemetry import Telemetry
from tests.conftest import (
    StartButler,
    butler_config,
    drop_databases,
    free_port,
    write_butler_dir,
)
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.fakes.otlp import OtlpReceiver, ReceivedSpan
from tests.test_cli import REPO, Butlers, fleet_env
from tests.test_inbox import model
from tests.test_registry import call

CHAT = 4242


class Fleet:
    """`butlers up` with a general butler and a Telegram switchboard, exporting to `otlp`."""

    def __init__(self, tmp_path: Path, bot_api: FakeBotAPI, scripted_api, pg_server) -> None:
        self.suffix = uuid.uuid4().hex[:8]
        self.pg_server = pg_server
        self.config_dir = tmp_path / "config"
        write_butler_dir(
            self.config_dir,
            "general",
            free_port(),
            extra=f'[butler.db]\nname = "{self.database("general")}"\n',
        )
        write_butler_dir(
            self.config_dir,
            "switchboard",
            free_port(),
            extra=(
                f'[butler.db]\nname = "{self.database("switchboard")}"\n'
                f'[modules.telegram]\nallowed_chat_ids = ["{CHAT}"]\n'
                f'api_base_url = "{bot_api.url}"\n'
                "[switchboard]\n"  # what makes it the switchboard
            ),
        )
        self.env = fleet_env(
            tmp_path, pg_server, bot_api, scripted_api, left_out=("BUTLERS_", "OTEL_")
        )

    def database(self, name: str) -> str:
        return f"trace_{name}_{self.suffix}"

    def export_to(self, otlp: OtlpReceiver, protocol: str, *, every_ms: int | None = None) -> None:
        """Export to `otlp`; by default on the SDK's own 5 s schedule, so what arrives right
        after a stop was flushed by the shutdown."""
        self.env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url(protocol),
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc" if protocol == "grpc" else "http/protobuf",
        )
        if every_ms is not None:
            self.env["OTEL_BSP_SCHEDULE_DELAY"] = str(every_ms)

    def up(self) -> Butlers:
        return Butlers("up", "--config-dir", str(self.config_dir), env=self.env)

    async def routing_log(self) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.pg_server.dsn(self.database("switchboard")))
        try:
            return await conn.fetch("SELECT * FROM routing_log ORDER BY created_at")
        finally:
            await conn.close()

    async def drop(self) -> None:
        await drop_databases(
            self.pg_server, *(self.database(name) for name in ("general", "switchboard"))
        )


@pytest.fixture
async def fleet(tmp_path, bot_api, scripted_api, pg_server) -> AsyncIterator[Fleet]:
    fleet = Fleet(tmp_path, bot_api, scripted_api, pg_server)
    yield fleet
    await fleet.drop()


def assert_one_tree(spans: list[ReceivedSpan], trace_id: str) -> ReceivedSpan:
    """All spans in `trace_id`, each parent present, one root: `switchboard.receive`."""
    assert {s.trace_id for s in spans} == {trace_id}, sorted({(s.trace_id, s.name) for s in spans})
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if s.parent_span_id is None]
    assert [(r.service, r.name) for r in roots] == [("butler-switchboard", "switchboard.receive")]
    orphans = [
        (s.service, s.name) for s in spans if s.parent_span_id and s.parent_span_id not in by_id
    ]
    assert orphans == [], f"spans whose parent never arrived: {orphans}"
    return roots[0]


def without_killed_session(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    """Drop what the SIGKILLed process's Claude Code may have exported on its way out: a
    `claude_code.interaction` (and its children) whose parent, the classifier's session span,
    died unfinished with the process. Nothing else may lack its parent."""
    by_id = {s.span_id: s for s in spans}

    def top(span: ReceivedSpan) -> ReceivedSpan:
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
        return span

    def killed(span: ReceivedSpan) -> bool:
        head = top(span)
        return (
            head.parent_span_id is not None
            and head.name == "claude_code.interaction"
            and head.attributes.get("butler") == "switchboard"
        )

    return [s for s in spans if not killed(s)]


def ancestors(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[str]:
    by_id = {s.span_id: s for s in spans}
    names = []
    while span.parent_span_id:
        span = by_id[span.parent_span_id]
        names.append(span.name)
    return names


def services(spans: list[ReceivedSpan]) -> set[str]:
    return {s.service for s in spans}


def is_claude_code(span: ReceivedSpan) -> bool:
    return span.service == "claude-code"


def interactions(spans: list[ReceivedSpan]) -> int:
    """Finished Claude Code sessions (each exports one `claude_code.interaction`)."""
    return sum(1 for s in spans if is_claude_code(s) and s.name == "claude_code.interaction")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_one_telegram_message_is_one_trace(
    protocol: str,
    fleet: Fleet,
    otlp: OtlpReceiver,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    scripted_api.respond_with(model("general", {"general": "Milk is on the list."}))
    fleet.export_to(otlp, protocol)
    butlers = fleet.up()
    await butlers.start()
    try:
        await butlers.wait_ready()
        await bot_api.push_text(CHAT, "add milk to my list")
        [sent] = await bot_api.wait_sent(1, timeout_s=90)
        assert sent["text"] == "Milk is on the list."
    except BaseException:
        await butlers.stop_quietly()  # the first failure is the one to see
        raise
    assert await butlers.stop() == 0, butlers.stderr
    # Exported every 5 s, so the reply's span can only have come with the flush on shutdown.
    assert any(s.name == "switchboard.reply" for s in otlp.spans)

    [row] = await fleet.routing_log()
    assert (row["routed_to"], row["source_channel"], row["success"]) == (
        "general",
        "telegram",
        True,
    )
    trace_id = row["trace_id"]
    assert len(trace_id) == 32 and int(trace_id, 16)

    # Claude Code exports on its own schedule: wait until both sessions' spans are in.
    spans = await otlp.wait_for(lambda got: interactions(got) >= 2)
    assert {s.protocol for s in spans} == {protocol}
    root = assert_one_tree(spans, trace_id)
    assert root.attributes["channel"] == "telegram"
    assert root.attributes["source_id"] == str(CHAT)

    assert services(spans) == {"butler-switchboard", "butler-general", "claude-code"}
    names = {(s.service, s.name) for s in spans}
    for expected in [
        ("butler-switchboard", "switchboard.classify"),
        ("butler-switchboard", "switchboard.route"),
        ("butler-switchboard", "switchboard/route"),  # the classifier's call, over MCP
        ("butler-switchboard", "switchboard.reply"),
        ("butler-general", "general/trigger"),
        ("butler-general", "butler.session"),
    ]:
        assert expected in names, sorted(names)

    [route] = [s for s in spans if s.name == "switchboard.route"]
    assert (route.attributes["target"], route.attributes["tool_name"]) == ("general", "trigger")
    assert route.status != "error"
    [trigger] = [s for s in spans if s.name == "general/trigger"]
    assert trigger.parent_span_id == route.span_id
    [reply] = [s for s in spans if s.name == "switchboard.reply"]
    assert ancestors(reply, spans) == ["switchboard.receive"]
    # Both Claude Code sessions (the classifier's and the general butler's) joined the trace
    # under their own butler.session span.
    sessions = [s for s in spans if s.name == "butler.session"]
    assert len(sessions) == 2
    for session in sessions:
        children = [s for s in spans if s.parent_span_id == session.span_id]
        assert any(is_claude_code(c) for c in children), (session.service, children)
    assert "Traceback" not in butlers.stderr, butlers.stderr


async def test_a_crash_between_receipt_and_processing_keeps_one_trace(
    fleet: Fleet, otlp: OtlpReceiver, bot_api: FakeBotAPI, scripted_api: ScriptedMessagesAPI
) -> None:
    scripted_api.respond_with(model("general", {"general": "Noted, after all."}))
    scripted_api.delay_s = 30  # the classifier "thinks" until we pull the plug
    fleet.export_to(otlp, "http", every_ms=100)  # the receipt is exported before the SIGKILL
    first = fleet.up()
    await first.start()
    second = None
    try:
        await first.wait_ready()
        await bot_api.push_text(CHAT, "note: buy stamps")
        await otlp.wait_for(lambda got: any(s.name == "switchboard.receive" for s in got))
        async with asyncio.timeout(60):
            while not scripted_api.requests:  # noqa: ASYNC110 - classification has begun
                await asyncio.sleep(0.05)
        await first.crash()
        assert bot_api.sent == []
        scripted_api.delay_s = 0
        second = fleet.up()
        await second.start()
        await second.wait_ready()
        [sent] = await bot_api.wait_sent(1, timeout_s=90)
        assert sent["text"] == "Noted, after all."
        assert await second.stop() == 0, second.stderr
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()

    [row] = await fleet.routing_log()
    spans = await otlp.wait_for(lambda got: "switchboard.reply" in {s.name for s in got})
    assert {s.trace_id for s in spans} == {row["trace_id"]}
    root = assert_one_tree(without_killed_session(spans), row["trace_id"])
    # Received by the first process, classified, routed and answered by the second.
    [classify] = [s for s in spans if s.name == "switchboard.classify"]
    assert classify.parent_span_id == root.span_id
    assert {"switchboard.route", "general/trigger", "switchboard.reply"} <= {s.name for s in spans}


async def test_tracing_off_means_no_exporter_yet_real_trace_ids(
    start_butler: StartButler, tmp_path: Path, db_conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    telemetry = Telemetry.from_settings(Settings.from_environ())
    assert not telemetry.exporting and telemetry.for_butler("general").cli_env == {}

    config_dir = tmp_path / "config"
    general = await start_butler(butler_config("general"), telemetry=telemetry)
    write_butler_dir(config_dir, "general", general.port)
    switchboard = await start_butler(
        butler_config("switchboard"), config_dir=config_dir, telemetry=telemetry
    )
    async with Client(switchboard.sse_url) as client:
        await call(
            client,
            "route",
            butler_name="general",
            tool_name="state_set",
            args={"key": "k", "value": 7},
        )
    general_db = await db_conn(general.config.database)
    assert await general_db.fetchval("SELECT value::text FROM state WHERE key = 'k'") == "7"
    exporters = [t.name for t in threading.enumerate() if "Otel" in t.name or "Export" in t.name]
    assert exporters == []
    conn = await db_conn(switchboard.config.database)
    trace_id = await conn.fetchval("SELECT trace_id FROM routing_log")
    assert len(trace_id) == 32 and int(trace_id, 16)  # ids still tie routes and sessions
    telemetry.shutdown()  # nothing to flush; must not fail


def test_a_process_that_exports_nothing_still_passes_on_sampled_ids() -> None:
    """Without an exporter spans are not recorded, yet their ids propagate as the SDK's default
    sampler would: a root is sampled, so a butler of another process that exports keeps its
    spans of the trace; a parent's unsampled flag and trace state are kept."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from butlers.telemetry import context_from_carrier, current_carrier, current_trace_id

    quiet = Telemetry().for_butler("switchboard").tracer
    with quiet.start_as_current_span("switchboard.route") as root:
        assert not root.is_recording()
        carrier, trace_id = current_carrier(), current_trace_id()
        with quiet.start_as_current_span("child") as child:
            assert format(child.get_span_context().trace_id, "032x") == trace_id
            assert child.get_span_context().span_id != root.get_span_context().span_id
    assert trace_id is not None and carrier["traceparent"].endswith("-03")
    assert carrier["traceparent"].split("-")[1] == trace_id

    exported = InMemorySpanExporter()
    loud = Telemetry(SimpleSpanProcessor(exported)).for_butler("general").tracer
    token = otel_context.attach(context_from_carrier(carrier))  # type: ignore[arg-type]
    try:
        with loud.start_as_current_span("general.tool"):
            pass
    finally:
        otel_context.detach(token)
    (span,) = exported.get_finished_spans()
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.parent is not None and span.parent.span_id == root.get_span_context().span_id

    unsampled = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-00", "tracestate": "vendor=1"}
    token = otel_context.attach(context_from_carrier(unsampled))  # type: ignore[arg-type]
    try:
        with quiet.start_as_current_span("child"):
            passed_on = current_carrier()
            assert trace.get_current_span().get_span_context().trace_state.get("vendor") == "1"
    finally:
        otel_context.detach(token)
    assert passed_on["traceparent"].startswith(f"00-{'ab' * 16}-")
    assert passed_on["traceparent"].endswith("-00") and passed_on["tracestate"] == "vendor=1"


def test_a_sampler_asked_for_still_decides_without_an_exporter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_TRACES_SAMPLER is the SDK's to honour: with it set, the SDK's tracer runs (and
    records for nobody), so the ids propagate as that sampler says."""
    from butlers.telemetry import current_carrier

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracer = Telemetry.from_settings(Settings.from_environ()).for_butler("general").tracer
    with tracer.start_as_current_span("root"):
        flags = int(current_carrier()["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 0x01 == 0  # not sampled


def test_service_names_and_protocol_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    telemetry = Telemetry.from_settings(Settings.from_environ())
    resource = telemetry.resource("health")
    assert resource.attributes["service.name"] == "butler-health"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-health")
    telemetry = Telemetry.from_settings(Settings.from_environ())
    resource = telemetry.resource("health")
    assert resource.attributes["service.name"] == "my-health"

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ButlersError, match="OTEL_EXPORTER_OTLP_PROTOCOL='carrier-pigeon'"):
        Settings.from_environ()


async def test_without_a_protocol_spans_go_over_http(
    otlp: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTLP over HTTP is the default (its exporter is the one dependency; gRPC's is the
    `otlp-grpc` extra): the real exporter's spans reach the receiver's HTTP endpoint, and
    Claude Code sessions are told the same protocol."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.url("http"))
    telemetry = Telemetry.from_settings(Settings.from_environ())
    assert telemetry.for_butler("general").cli_env["OTEL_EXPORTER_OTLP_PROTOCOL"] == (
        "http/protobuf"
    )
    with telemetry.for_butler("general").tracer.start_as_current_span("over.http"):
        pass
    await asyncio.to_thread(telemetry.shutdown)  # flushes: the exporter's request is done
    [span] = await otlp.wait_for(lambda got: any(s.name == "over.http" for s in got))
    assert (span.service, span.protocol) == ("butler-general", "http")


async def test_grpc_asked_for_without_the_extra_is_one_clear_error(tmp_path: Path) -> None:
    """A real `butlers gateway` whose Python cannot import the OTLP gRPC exporter (as in an
    install without the `otlp-grpc` extra): one line naming the variable and the extra,
    exit 1, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "OTEL_"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317", OTEL_EXPORTER_OTLP_PROTOCOL="grpc"
    )
    without_grpc = (
        "import sys; sys.modules['opentelemetry.exporter.otlp.proto.grpc'] = None; "
        "from butlers.cli import main; main()"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        without_grpc,
        *("gateway", "--no-butlers", "--dry-run", "--dir", str(tmp_path)),
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode == 1, (out, err)
    [line] = err.decode().splitlines()
    assert line.startswith(
        "error: OTEL_EXPORTER_OTLP_PROTOCOL=grpc: the OTLP gRPC exporter is not installed ("
    )
    assert line.endswith(
        "Install it with `pip install 'butlers[otlp-grpc]'`, or export over HTTP: "
        "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (the default; a collector's OTLP HTTP "
        "port is usually 4318)"
    )


def _pulled_in(requirements: list[str]) -> set[str]:
    """Every distribution an install of `requirements` pulls in, by the installed packages'
    own metadata (their requirements, extras and environment markers as pip reads them)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [(Requirement(r), frozenset[str]()) for r in requirements]
    while todo:
        requirement, extras = todo.pop()
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in (extras or {""})):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            below = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [(Requirement(r), frozenset(requirement.extras)) for r in below]
    return seen


def test_an_install_pulls_no_grpc_unless_the_extra_asks() -> None:
    """OTLP over HTTP is the dependency; grpcio (a large native wheel) comes only with the
    `otlp-grpc` extra."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    installed = _pulled_in(project["dependencies"])
    assert "opentelemetry-exporter-otlp-proto-http" in installed
    assert not {name for name in installed if "grpc" in name}, sorted(installed)
    with_extra = _pulled_in(project["dependencies"] + project["optional-dependencies"]["otlp-grpc"])
    assert {"grpcio", "opentelemetry-exporter-otlp-proto-grpc"} <= with_extra
