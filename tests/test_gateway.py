"""Gateway mode: `butlers gateway` driven by the official `mcp` client over stdio and SSE, with
mock child MCPs in the shapes found in the wild and the real butlers behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import psutil
import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters, stdio_client

from butlers import __version__ as VERSION
from butlers.errors import ConfigError
from butlers.gateway.children import parse_mcp_json
from butlers.gateway.config import load_gateway_config
from butlers.gateway.summary import summarize
from butlers.mcp_connection.stdio import FrameReader
from tests.conftest import StartButler, free_port, log_records
from tests.fakes import wait_listening
from tests.fakes.mock_mcp import TOOLS as MOCK_TOOLS
from tests.fakes.squatter import squatting
from tests.fakes.sse_mcp import TOOLS as SCRIPTED_TOOLS
from tests.fakes.sse_mcp import SseMcpServer
from tests.test_route import make_fleet

REPO = Path(__file__).resolve().parent.parent
BUTLERS = str(Path(sys.executable).parent / "butlers")
MOCK = str(Path(__file__).resolve().parent / "fakes" / "mock_mcp.py")
PEER = str(Path(__file__).resolve().parent / "fakes" / "peer_mcp.py")


# -- pieces ---------------------------------------------------------------------------------


def test_summaries_stay_within_the_limit_and_cut_where_a_reader_would() -> None:
    sentence = "Echoes back the input message to verify communication between host and child."
    long = sentence + " This is useful for testing the protocol and the transport in both ways."
    assert summarize(long, 160) == long  # short enough: whitespace only
    assert summarize("a  b\n\t c", 160) == "a b c"
    assert summarize(long, 100) == sentence  # the sentence end lies past half the limit
    cut = summarize("word " * 100, 40)
    assert len(cut) <= 40 and cut.endswith("…") and cut[:-1].split() == ["word"] * 7
    emoji = summarize("😀" * 200, 50)  # code points, never split
    assert len(emoji) == 50 and emoji == "😀" * 49 + "…"
    for limit in (1, 2, 10, 33, 160):
        assert len(summarize(long * 3, limit)) <= limit


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_frame_reader_takes_both_framings_split_anywhere_and_skips_logs(chunk: int) -> None:
    first = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"x": "é"}}).encode()
    second = json.dumps({"jsonrpc": "2.0", "id": 2, "result": {}}).encode()
    stream = (
        b"starting up, not JSON\n"
        + b"Content-Length: "
        + str(len(first)).encode()
        + b"\r\nContent-Type: application/json\r\n\r\n"
        + first
        + b"\n[log] between messages\n"
        + second
        + b"\n{broken json\n"
    )
    reader = FrameReader()
    messages = []
    for start in range(0, len(stream), chunk):
        messages += reader.feed(stream[start : start + chunk])
    assert [m["id"] for m in messages] == [1, 2]
    assert messages[0]["result"] == {"x": "é"}
    assert reader.skipped == ["starting up, not JSON", "[log] between messages", "{broken json"]


def test_frame_reader_gives_up_a_message_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that never ends a line, or announces an absurd Content-Length, was buffered
    for ever (a red team's 256 MiB line); past MAX_MESSAGE_BYTES the connection is given up
    (its owner starts the child again). Up to it, a message passes."""
    from butlers.mcp_connection import stdio

    monkeypatch.setattr(stdio, "MAX_MESSAGE_BYTES", 1000)
    fits = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"x": "y" * 900}}).encode()
    assert [m["id"] for m in FrameReader().feed(fits + b"\n")] == [1]
    reader = FrameReader()
    reader.feed(b"x" * 600)
    with pytest.raises(stdio.MessageTooLarge, match="1200 bytes without ending a line"):
        reader.feed(b"x" * 600)
    with pytest.raises(stdio.MessageTooLarge, match="announced a message of 99999999999999"):
        FrameReader().feed(b"Content-Length: 99999999999999\r\n\r\n")


def test_config_files_snake_and_camel(tmp_path: Path) -> None:
    assert load_gateway_config(tmp_path).discover_globs == (
        ".switchboard/mcps/*/.mcp.json",
        "mcps/*/.mcp.json",
    )
    (tmp_path / "switchboard.config.json").write_text(
        json.dumps(
            {
                "discoverGlobs": ["kids/*/.mcp.json"],
                "suites": {"docs": {"suiteName": "handbook", "expose": {"deny": ["rm"]}}},
                "timeouts": {"childSpawnMs": 500, "rpcMs": 900},
                "introspection": {"mode": "full", "summaryMaxChars": 80},
            }
        )
    )
    config = load_gateway_config(tmp_path)
    assert config.discover_globs == ("kids/*/.mcp.json",)
    assert config.suite("docs").suite_name == "handbook" and config.suite("docs").deny == ("rm",)
    assert (config.child_spawn_ms, config.rpc_ms) == (500, 900)
    assert (config.introspection_mode, config.summary_max_chars) == ("full", 80)

    # gateway.toml wins when both exist.
    (tmp_path / "gateway.toml").write_text(
        'discover_globs = ["x/*.json"]\n[suites.docs]\nsummary_max_chars = 40\n'
        '[suites.docs.expose]\nallow = ["read"]\n[timeouts]\nrpc_ms = 1500\n'
    )
    config = load_gateway_config(tmp_path)
    assert config.discover_globs == ("x/*.json",) and config.rpc_ms == 1500
    assert config.suite("docs").allow == ("read",) and config.child_spawn_ms == 8000


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[timeouts]\nrpc_ms = -1\n", "timeouts.rpc_ms", "positive integer"),
        (
            '[introspection]\nmode = "loud"\n',
            "introspection.mode",
            "expected one of 'summary', 'full', 'redacted', got 'loud'",
        ),
        (
            "[suites.docs]\nsuitename = 1\n",
            "suites.docs.suitename",
            "unknown key, did you mean 'suite_name'?",
        ),
        # Each file in its own spelling: camelCase is unknown in gateway.toml.
        ("[timeouts]\nrpcMs = 5\n", "timeouts.rpcMs", "unknown key, did you mean 'rpc_ms'?"),
        ('discover_globs = "x"\n', "discover_globs", "list of strings"),
        ("[suites.docs.expose]\nallow = [1]\n", "suites.docs.expose.allow", "list of strings"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path: Path, text: str, key: str, problem) -> None:
    (tmp_path / "gateway.toml").write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_gateway_config(tmp_path)
    assert excinfo.value.key == key and problem in excinfo.value.problem
    assert str(tmp_path / "gateway.toml") in str(excinfo.value)


def test_camel_case_errors_use_the_files_own_spelling(tmp_path: Path) -> None:
    (tmp_path / "switchboard.config.json").write_text('{"timeouts": {"rpcMs": "slow"}}')
    with pytest.raises(ConfigError, match=r"switchboard.config.json: timeouts.rpcMs: expected"):
        load_gateway_config(tmp_path)


def test_shipped_json_schemas_accept_good_and_reject_bad_configs() -> None:
    toml_schema = json.loads((REPO / "schemas" / "gateway.schema.json").read_text())
    json_schema = json.loads((REPO / "schemas" / "switchboard.config.schema.json").read_text())
    good_toml = {
        "discover_globs": ["mcps/*/.mcp.json"],
        "suites": {"docs": {"suite_name": "h", "expose": {"allow": ["a"]}}},
        "timeouts": {"child_spawn_ms": 8000, "rpc_ms": 60000},
        "introspection": {"mode": "summary", "summary_max_chars": 160},
    }
    jsonschema.validate(good_toml, toml_schema)
    jsonschema.validate({"suites": {"docs": {"suiteName": "h"}}}, json_schema)
    for bad, schema in [
        ({"timeouts": {"rpc_ms": 0}}, toml_schema),
        ({"introspection": {"mode": "loud"}}, toml_schema),
        ({"suites": {"docs": {"suiteName": 3}}}, json_schema),
        ({"unknown": True}, toml_schema),
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_mcp_json_files_are_checked(tmp_path: Path) -> None:
    path = tmp_path / ".mcp.json"
    path.write_text('{"name": "docs", "command": {"cmd": "node", "args": ["a.js"]}}')
    spec = parse_mcp_json(path)
    assert (spec.cmd, spec.args, spec.cwd) == ("node", ("a.js",), tmp_path.resolve())
    path.write_text('{"name": "web", "url": "http://127.0.0.1:9/sse"}')
    assert parse_mcp_json(path).url == "http://127.0.0.1:9/sse"
    for bad, problem in [
        ("[]", "expected an object, got "),
        ('{"name": "x", "url": "http://x", "urll": 1}', "urll: unknown key, did you mean 'url'"),
        ('{"name": "a b", "url": "http://x"}', "name"),
        ('{"name": "x"}', 'exactly one of "command"'),
        ('{"name": "x", "command": {"cmd": "n", "args": "a"}}', "command.args"),
        ("{nope", "not readable JSON"),
    ]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=problem):
            parse_mcp_json(path)


# -- the gateway process ----------------------------------------------------------------------


def mcp_json(directory: Path, name: str, *mock_args: str, **fields: Any) -> Path:
    child = directory / "mcps" / name
    child.mkdir(parents=True, exist_ok=True)
    # A child gets PATH, HOME, locale and TZ plus what its .mcp.json declares, nothing else
    # of the gateway's environment: the mock finds the pid file through its declared env.
    command = {
        "cmd": sys.executable,
        "args": [MOCK, *mock_args],
        "env": {
            "MOCK_MCP_PIDS": str(directory / "pids"),
            "MOCK_MCP_CALLS": str(directory / "calls"),
        },
    }
    spec = {"name": name, "command": command, **fields}
    (child / ".mcp.json").write_text(json.dumps(spec))
    return child


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A project with the mock children in the shapes the issue lists."""
    mcp_json(tmp_path, "plain", description="plain things")
    mcp_json(tmp_path, "framed", "--framing", "content-length", "--split")
    mcp_json(tmp_path, "chatty", "--logs", switchboardDescription="A child that logs.")
    mcp_json(tmp_path, "brittle", "--crash-on", "add")
    (tmp_path / "mcps" / "broken").mkdir()
    (tmp_path / "mcps" / "broken" / ".mcp.json").write_text("{not json")
    return tmp_path


class Host:
    """The official MCP client (the SDK's ClientSession), plus the notifications it received."""

    def __init__(self, client: ClientSession, notifications: list[Any]) -> None:
        self.client = client
        self.notifications = notifications

    async def status(self) -> dict[str, dict[str, Any]]:
        result = await self.call("gateway_status")
        return {s["name"]: s for s in result.structured_content["result"]}

    async def tools(self) -> list[str]:
        return [t.name for t in (await self.client.list_tools()).tools]

    async def call(self, tool: str, **arguments: Any):
        return await self.client.call_tool(tool, arguments)

    async def suite(self, suite: str, action: str, subtool: str | None = None, **args: Any):
        arguments: dict[str, Any] = {"action": action}
        if subtool is not None:
            arguments |= {"subtool": subtool, "args": args}
        return await self.client.call_tool(suite, arguments)

    async def wait_list_changed(self, count: int, timeout_s: float = 10) -> None:
        async with asyncio.timeout(timeout_s):
            while self.list_changed < count:  # noqa: ASYNC110 - filled by the client's handler
                await asyncio.sleep(0.02)

    @property
    def list_changed(self) -> int:
        return sum(
            1
            for n in self.notifications
            if getattr(n, "method", "") == "notifications/tools/list_changed"
        )


def _env(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
    env["TELEGRAM_BOT_TOKEN"] = GATEWAY_SECRET  # the gateway's, never a child's
    return env | (extra or {})


@contextlib.asynccontextmanager
async def stdio_host(
    workdir: Path, *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[Host]:
    notifications: list[Any] = []

    async def handler(message: Any) -> None:
        notifications.append(message)

    params = StdioServerParameters(
        command=BUTLERS,
        args=["gateway", "--dir", str(workdir), "--no-butlers", *args],
        env=_env(workdir, env),
        cwd=str(workdir),
    )
    with _append(workdir / "gateway.stderr") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write, message_handler=handler) as client,
        ):
            await client.initialize()
            yield Host(client, notifications)


def _append(path: Path):
    return path.open("a")


GATEWAY_SECRET = "7000:gateway-process-secret"


def child_environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def child_pids(workdir: Path) -> list[int]:
    path = workdir / "pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def text_of(result) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


async def test_a_host_sees_suites_introspects_calls_and_closing_stdin_ends_every_child(
    workdir: Path,
) -> None:
    (workdir / "gateway.toml").write_text("[introspection]\nsummary_max_chars = 60\n")
    async with stdio_host(workdir, "--lazy") as host:
        assert sorted(await host.tools()) == [
            "brittle_suite",
            "chatty_suite",
            "framed_suite",
            "gateway_activate",
            "gateway_deactivate",
            "gateway_status",
            "plain_suite",
        ]
        assert child_pids(workdir) == []  # --lazy: nothing spawned before first use
        listed = {t.name: t for t in (await host.client.list_tools()).tools}
        assert listed["chatty_suite"].description == "A child that logs."
        assert listed["plain_suite"].description == (
            "Use this tool for plain things. Actions: 'introspect' | 'call'"
        )
        assert listed["plain_suite"].input_schema["required"] == ["action"]

        for suite in ("plain_suite", "framed_suite", "chatty_suite"):
            result = await host.suite(suite, "introspect")
            tools = {t["name"]: t for t in result.structured_content["tools"]}
            assert set(tools) == {"echo", "add", "crash", "long_description"}, suite
            assert all(len(t["summary"]) <= 60 for t in tools.values())
            assert tools["add"]["summary"] == "Add two numbers together."
            assert tools["echo"]["inputSchema"]["required"] == ["message"]

            result = await host.suite(suite, "call", "echo", message=f"hi {suite}")
            assert not result.is_error
            assert text_of(result) == f"hi {suite}"
            # Unchanged pass-through; run in the .mcp.json's directory.
            assert result.structured_content["echo"] == f"hi {suite}"
            assert result.structured_content["cwd"] == str(workdir / "mcps" / suite[:-6])
        assert len(child_pids(workdir)) == 3  # spawned once each, then reused
        for pid in child_pids(workdir):  # an allowlisted environment plus the declared env
            environment = child_environment(pid)
            assert "TELEGRAM_BOT_TOKEN" not in environment
            assert GATEWAY_SECRET not in json.dumps(environment)
            assert {"PATH", "MOCK_MCP_PIDS"} <= set(environment)
        result = await host.suite("plain_suite", "call", "add", a=2, b=3)
        pids = child_pids(workdir)
        assert text_of(result) == "5" and len(pids) == 3

        result = await host.suite("plain_suite", "call", "nope")
        assert result.is_error and "Subtool 'nope' not found in suite 'plain_suite'" in text_of(
            result
        )
        result = await host.call("plain_suite", action="dance")
        assert result.is_error and "action must be 'introspect' or 'call'" in text_of(result)
    stderr = (workdir / "gateway.stderr").read_text()
    assert f"skipping {workdir / 'mcps' / 'broken' / '.mcp.json'}" in stderr
    # The host closed the gateway's stdin: the gateway ended, and every child with it.
    assert await survivors(pids) == []


async def test_child_env_and_allow_deny(workdir: Path) -> None:
    mcp_json(workdir, "plain", description="plain things")
    spec = json.loads((workdir / "mcps" / "plain" / ".mcp.json").read_text())
    spec["command"]["env"] = {"MOCK_SETTING": "from .mcp.json"}
    (workdir / "mcps" / "plain" / ".mcp.json").write_text(json.dumps(spec))
    (workdir / "gateway.toml").write_text(
        '[suites.plain]\nsuite_name = "everyday"\ndescription = "Everyday tools."\n'
        '[suites.plain.expose]\ndeny = ["crash"]\n'
        '[suites.framed.expose]\nallow = ["echo"]\n'
    )
    async with stdio_host(workdir) as host:
        tools = await host.tools()
        assert "everyday" in tools and "plain_suite" not in tools
        result = await host.suite("everyday", "call", "echo", message="x")
        assert result.structured_content["env"] == "from .mcp.json"
        result = await host.suite("everyday", "call", "crash")
        assert result.is_error
        assert text_of(result) == "Subtool 'crash' not allowed by suite 'everyday'"
        introspected = (await host.suite("framed_suite", "introspect")).structured_content
        assert [t["name"] for t in introspected["tools"]] == ["echo"]
        result = await host.suite("framed_suite", "call", "add", a=1, b=1)
        assert text_of(result) == "Subtool 'add' not allowed by suite 'framed_suite'"
        # gateway_status counts what the host may call, not what the child has.
        status = await host.status()
        assert (status["plain"]["tools"], status["framed"]["tools"]) == (3, 1), status


async def test_a_child_that_never_initializes_is_reported_by_name_and_step(
    tmp_path: Path,
) -> None:
    """It never answers, so the call timeout its initialize is held to runs out, however
    fast the machine."""
    mcp_json(tmp_path, "mute", "--silent")
    (tmp_path / "gateway.toml").write_text("[timeouts]\nrpc_ms = 300\n")
    async with stdio_host(tmp_path, "--lazy") as host:
        result = await host.suite("mute_suite", "introspect")
        assert result.is_error
        assert text_of(result) == (
            "child 'mute': no answer to initialize within 300 ms (timeouts.rpc_ms)"
        )
        status = await host.status()
        assert status["mute"]["state"] == "error" and "initialize" in status["mute"]["error"]


async def test_a_call_that_times_out_is_reported_and_costs_the_child_nothing(
    tmp_path: Path,
) -> None:
    """Children get all the time in the world to start (a loaded machine must not fail this);
    a call the child never answers runs out of rpc_ms."""
    mcp_json(tmp_path, "plain")
    mcp_json(tmp_path, "mute", "--silent")
    mcp_json(tmp_path, "sleepy", "--hang-on", "add")
    (tmp_path / "gateway.toml").write_text("[timeouts]\nchild_spawn_ms = 120000\nrpc_ms = 1500\n")
    async with stdio_host(tmp_path) as host:
        result = await host.suite("plain_suite", "call", "echo", message="fine")
        assert text_of(result) == "fine"
        # Pre-warming in parallel: the child that never answers holds up nobody.
        assert (await host.status())["mute"]["state"] == "warming"
        result = await host.suite("sleepy_suite", "call", "add", a=1, b=2)
        assert result.is_error
        assert text_of(result) == (
            "child 'sleepy': no answer to tools/call 'add' within 1500 ms (timeouts.rpc_ms)"
        )
        result = await host.suite("sleepy_suite", "call", "echo", message="still here")
        assert text_of(result) == "still here"  # a timeout does not cost the child
        status = await host.status()
        assert status["sleepy"]["state"] == "ready" and status["sleepy"]["tools"] == 4
        assert len(child_pids(tmp_path)) == 3  # nobody was restarted


async def test_a_child_that_pings_and_asks_the_gateway_gets_answers(tmp_path: Path) -> None:
    """A real FastMCP server as a stdio child, turning to the gateway in the middle of a call:
    its ping is answered (its call waited for ever before), its roots/list answered with the
    gateway's --dir, its tools/list_changed taken."""
    (tmp_path / "mcps" / "peer").mkdir(parents=True)
    (tmp_path / "mcps" / "peer" / ".mcp.json").write_text(
        json.dumps(
            {
                "name": "peer",
                "command": {
                    "cmd": sys.executable,
                    "args": [PEER],
                    "env": {"FASTMCP_LOG_LEVEL": "WARNING"},
                },
            }
        )
    )
    (tmp_path / "gateway.toml").write_text("[timeouts]\nchild_spawn_ms = 120000\nrpc_ms = 10000\n")
    async with stdio_host(tmp_path, "--lazy") as host:
        result = await host.suite("peer_suite", "call", "ping_client")
        assert not result.is_error and text_of(result) == "pong", text_of(result)
        result = await host.suite("peer_suite", "call", "ask_roots")
        assert f"FileUrl('{tmp_path.as_uri()}')" in text_of(result), text_of(result)
        result = await host.suite("peer_suite", "call", "change_tools")
        assert text_of(result) == "sent"
        assert (await host.status())["peer"]["state"] == "ready"


async def test_introspection_full_from_the_config_and_redacted_for_one_call(
    tmp_path: Path,
) -> None:
    """full: each tool's own description, whole (no summary limit); redacted: none at all."""
    mcp_json(tmp_path, "plain")
    (tmp_path / "gateway.toml").write_text(
        '[introspection]\nmode = "full"\nsummary_max_chars = 40\n'
    )
    async with stdio_host(tmp_path, "--lazy") as host:
        full = await host.suite("plain_suite", "introspect")
        redacted = await host.call("plain_suite", action="introspect", verbosity="redacted")
    for result, mode in ((full, "full"), (redacted, "redacted")):
        assert not result.is_error, text_of(result)
        listed = result.structured_content["tools"]
        assert [t["name"] for t in listed] == [t["name"] for t in MOCK_TOOLS]
        for entry, tool in zip(listed, MOCK_TOOLS, strict=True):
            expected = {"name": tool["name"], "inputSchema": tool["inputSchema"]}
            if mode == "full":
                expected["summary"] = tool["description"]  # "Add two   numbers\n   together." too
            assert entry == expected
        assert set(result.structured_content) == {"tools"}  # nothing beside the entries


async def test_a_crashed_child_is_reported_restarted_and_loses_its_active_tools(
    workdir: Path,
) -> None:
    async with stdio_host(workdir, "--lazy") as host:
        result = await host.suite("brittle_suite", "call", "echo", message="one")
        assert text_of(result) == "one"
        [first] = child_pids(workdir)
        result = await host.suite("brittle_suite", "call", "add", a=1, b=2)
        assert result.is_error and text_of(result) == "child 'brittle' exited (code 3)"
        status = (await host.call("gateway_status")).structured_content["result"]
        assert [s["state"] for s in status if s["name"] == "brittle"] == ["error"]
        result = await host.suite("brittle_suite", "call", "echo", message="two")
        assert text_of(result) == "two"
        [_, second] = child_pids(workdir)
        assert second != first and not psutil.pid_exists(first)
        status = (await host.call("gateway_status")).structured_content["result"]
        assert [s["state"] for s in status if s["name"] == "brittle"] == ["ready"]

        # Dying while active, it takes its tools out of the list, and the host is told.
        await host.call("gateway_activate", name="brittle")
        await host.wait_list_changed(1)
        assert "echo" in await host.tools()
        result = await host.call("crash")
        assert result.is_error
        await host.wait_list_changed(2)
        assert "echo" not in await host.tools()
        status = {
            s["name"]: s for s in (await host.call("gateway_status")).structured_content["result"]
        }
        assert status["brittle"]["state"] == "error"
        assert "exited" in status["brittle"]["error"]
        # Its suite still works: the next call restarts it.
        assert text_of(await host.suite("brittle_suite", "call", "echo", message="back")) == "back"


async def test_an_existing_switchboard_config_json_is_honoured(workdir: Path) -> None:
    (workdir / "switchboard.config.json").write_text(
        json.dumps(
            {
                "discoverGlobs": ["mcps/framed/.mcp.json", "mcps/plain/.mcp.json"],
                "suites": {
                    "plain": {"suiteName": "p", "expose": {"allow": ["add"]}, "summaryMaxChars": 12}
                },
                "introspection": {"mode": "summary"},
            }
        )
    )
    async with stdio_host(workdir) as host:
        assert sorted(await host.tools())[:2] == ["framed_suite", "gateway_activate"]
        assert "p" in await host.tools() and "chatty_suite" not in await host.tools()
        [tool] = (await host.suite("p", "introspect")).structured_content["tools"]
        assert tool["name"] == "add" and len(tool["summary"]) <= 12


async def test_activate_injects_tools_with_list_changed_and_deactivate_removes_them(
    workdir: Path,
) -> None:
    async with stdio_host(workdir) as host:
        before = await host.tools()
        result = await host.call("gateway_activate", name="plain")
        assert result.structured_content["tools"] == ["echo", "add", "crash", "long_description"]
        await host.wait_list_changed(1)
        tools = await host.tools()
        assert set(tools) == set(before) | {"echo", "add", "crash", "long_description"}
        result = await host.call("add", a=20, b=22)  # straight to the child
        assert text_of(result) == "42"
        # A second child with the same tool names gets them under its own prefix.
        result = await host.call("gateway_activate", name="framed")
        assert "framed_echo" in result.structured_content["tools"]
        await host.wait_list_changed(2)
        assert text_of(await host.call("framed_echo", message="via framed")) == "via framed"

        await host.call("gateway_deactivate", name="plain")
        await host.wait_list_changed(3)
        tools = await host.tools()
        assert "add" not in tools and "framed_add" in tools
        status = {
            s["name"]: s for s in (await host.call("gateway_status")).structured_content["result"]
        }
        assert status["plain"]["state"] == "ready" and status["framed"]["state"] == "active"
        # Still reachable through its suite, and re-activation is instant (same process).
        pids = child_pids(workdir)
        assert text_of(await host.suite("plain_suite", "call", "add", a=1, b=1)) == "2"
        await host.call("gateway_activate", name="plain")
        assert child_pids(workdir) == pids

        result = await host.call("gateway_activate", name="ghost")
        assert result.is_error and "no MCP server named 'ghost'" in text_of(result)


def wrapped_child(directory: Path, name: str) -> None:
    """A child the way npx / uvx / `sh -c` start one: the real server is a grandchild, here
    beside a `sleep` that nothing but its process group would end."""
    child = directory / "mcps" / name
    child.mkdir(parents=True, exist_ok=True)
    command = {
        "cmd": "sh",
        "args": ["-c", f"sleep 300 & exec {sys.executable} {MOCK}"],
        "env": {"MOCK_MCP_PIDS": str(directory / "pids")},
    }
    (child / ".mcp.json").write_text(json.dumps({"name": name, "command": command}))


async def start_gateway(
    workdir: Path, children: int, wrapped: int
) -> tuple[asyncio.subprocess.Process, list[int]]:
    """`butlers gateway` over stdio with its input held open, once it pre-warmed `children`
    children (`wrapped` of them by `wrapped_child`): the process, and every descendant of it
    (children, the wrapped ones' sleeps, the watchdog)."""
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        *("gateway", "--dir", str(workdir), "--no-butlers"),
        env=_env(workdir),
        cwd=workdir,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    async with asyncio.timeout(30):
        while len(child_pids(workdir)) < children:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        expected = children + wrapped + 1  # the sleeps, the watchdog
        while len(psutil.Process(process.pid).children(recursive=True)) < expected:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    descendants = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
    return process, descendants


async def test_killing_the_gateway_leaves_no_descendant_behind(workdir: Path) -> None:
    mcp_json(workdir, "stubborn", "--linger")  # would outlive its stdin's end
    wrapped_child(workdir, "wrapped")
    process, descendants = await start_gateway(workdir, 6, wrapped=1)
    try:
        watchdog = [p for p in descendants if "watchdog.py" in " ".join(_cmdline(p))]
        assert len(watchdog) == 1 and set(child_pids(workdir)) < set(descendants)
        process.send_signal(signal.SIGKILL)  # the host died and took the gateway with it
        await process.wait()
        # Children, the wrapped server's sleep, and the watchdog once it did its work.
        assert await survivors(descendants, timeout_s=5) == []
    finally:
        if process.returncode is None:
            process.kill()
        _kill_left(descendants)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_a_stdio_gateway_and_everything_it_started(
    tmp_path: Path, signum: int
) -> None:
    mcp_json(tmp_path, "plain")
    wrapped_child(tmp_path, "wrapped")
    process, descendants = await start_gateway(tmp_path, 2, wrapped=1)
    try:
        process.send_signal(signum)
        async with asyncio.timeout(15):
            assert await process.wait() == 0
        assert await survivors(descendants, timeout_s=5) == []
    finally:
        if process.returncode is None:
            process.kill()
        _kill_left(descendants)


@pytest.mark.proc  # the gateway and its child are processes
async def test_a_host_gone_with_an_answer_pending_ends_the_gateway_quietly(tmp_path: Path) -> None:
    """The host dies (both pipes closed) while a call waits on a child: the gateway has an
    answer it cannot write. It ends with exit 0 and no traceback (it printed 60 lines of
    BrokenPipeError and exited 1), and its child with it. Its serverInfo is ours."""
    mcp_json(tmp_path, "plain", "--hang-on", "echo")
    process = await _gateway_process(tmp_path, stdin=asyncio.subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    assert process.stderr is not None

    def send(message: dict[str, Any]) -> None:
        assert process.stdin is not None
        process.stdin.write((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())

    try:
        send(
            {
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "dying-host", "version": "1"},
                },
            }
        )
        async with asyncio.timeout(30):
            answer = json.loads(await process.stdout.readline())
        assert answer["result"]["serverInfo"] == {"name": "butlers-gateway", "version": VERSION}
        send({"method": "notifications/initialized"})
        call = {"action": "call", "subtool": "echo", "args": {"message": "x"}}
        send(
            {"id": 2, "method": "tools/call", "params": {"name": "plain_suite", "arguments": call}}
        )
        await process.stdin.drain()
        async with asyncio.timeout(30):
            while not any("echo" in line for line in _calls(tmp_path)):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        pids = child_pids(tmp_path)
        process._transport.get_pipe_transport(1).close()  # type: ignore[attr-defined]
        process.stdin.close()
        async with asyncio.timeout(30):
            err = (await process.stderr.read()).decode()
            assert await process.wait() == 0, err
        assert "Traceback" not in err and "BrokenPipeError" not in err, err
        assert await survivors(pids) == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _gateway_process(directory: Path, *, stdin: int) -> asyncio.subprocess.Process:
    """`butlers gateway --no-butlers` on `directory` over stdio, its output piped."""
    return await asyncio.create_subprocess_exec(
        BUTLERS,
        *("gateway", "--dir", str(directory), "--no-butlers"),
        env=_env(directory),
        stdin=stdin,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def _calls(directory: Path) -> list[str]:
    path = directory / "calls"
    return path.read_text().splitlines() if path.exists() else []


async def test_a_gateway_whose_input_is_not_a_pipe_ends_cleanly(tmp_path: Path) -> None:
    """/dev/null as standard input (a script, a host misconfigured): the input ends, and the
    gateway with it, exit 0. (Handed to the event loop, a character device made uvloop abort
    the process: exit 134.)"""
    process = await _gateway_process(tmp_path, stdin=asyncio.subprocess.DEVNULL)
    async with asyncio.timeout(30):
        _, err = await process.communicate()
    assert process.returncode == 0, err.decode()


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []


def _kill_left(pids: list[int]) -> None:
    """What a failed test left (only processes it started)."""
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


async def survivors(pids: list[int], timeout_s: float = 10) -> list[int]:
    """The processes still alive once they all ended, or `timeout_s` ran out."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while [p for p in pids if _alive(p)]:  # noqa: ASYNC110 - no handle on others' exits
                await asyncio.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_butlers_behind_the_gateway_over_sse(
    start_butler: StartButler, tmp_path: Path, workdir: Path
) -> None:
    """The real switchboard's registry, the real general butler, served over SSE."""
    fleet = await make_fleet(start_butler, tmp_path, names=("general",), auth_token="gw-token")
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        "gateway",
        "--dir",
        str(workdir),
        "--transport",
        "sse",
        "--port",
        str(port),
        "--url",
        fleet.switchboard.sse_url,
        env=_env(workdir, {"BUTLERS_AUTH_TOKEN": "gw-token"}),
        cwd=workdir,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    notifications: list[Any] = []

    async def handler(message: Any) -> None:
        notifications.append(message)

    try:
        await wait_listening(port)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/sse") as response:
                assert response.status == 401  # the gateway asks for the token too
            headers = {"Host": f"evil.example:{port}", "Authorization": "Bearer gw-token"}
            async with http.get(f"http://127.0.0.1:{port}/sse", headers=headers) as response:
                assert response.status == 421
        async with (
            sse_client(
                f"http://127.0.0.1:{port}/sse", headers={"Authorization": "Bearer gw-token"}
            ) as (read, write),
            ClientSession(read, write, message_handler=handler) as client,
        ):
            await client.initialize()
            host = Host(client, notifications)
            tools = await host.tools()
            assert {"general_suite", "switchboard_suite", "plain_suite"} <= set(tools)
            introspected = (await host.suite("general_suite", "introspect")).structured_content
            assert "state_set" in {t["name"] for t in introspected["tools"]}
            await host.suite("general_suite", "call", "state_set", key="via", value="gateway")
            result = await host.suite("general_suite", "call", "state_get", key="via")
            assert result.structured_content == {"result": "gateway"}
            await host.call("gateway_activate", name="general")
            await host.wait_list_changed(1)
            assert "state_get" in await host.tools()
            assert (await host.call("state_get", key="via")).structured_content == {
                "result": "gateway"
            }
            # The butler goes away while active: its tools go too, and the host is told.
            await fleet.targets["general"].stop()
            result = await host.call("state_get", key="via")
            assert result.is_error and "child 'general'" in text_of(result)
            await host.wait_list_changed(2)
            assert "state_get" not in await host.tools()
            assert (await host.status())["general"]["state"] == "error"
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            await process.wait()


async def test_remote_mcp_json_children_through_the_gateway(
    start_butler: StartButler, tmp_path: Path, db_conn
) -> None:
    """`.mcp.json` with "url": a real butler over streamable HTTP and the scripted SSE server,
    introspected and called through the gateway; one that is not there is an error naming
    it. The gateway's own BUTLERS_AUTH_TOKEN goes to butlers only, never to such a server."""
    butler = await start_butler()
    gone = f"http://127.0.0.1:{free_port()}/sse"
    async with SseMcpServer() as scripted:
        for name, url in [
            ("remote", f"{butler.base_url}/mcp"),
            ("scripted", scripted.url),
            ("gone", gone),
        ]:
            (tmp_path / "mcps" / name).mkdir(parents=True)
            (tmp_path / "mcps" / name / ".mcp.json").write_text(
                json.dumps({"name": name, "url": url, "description": f"{name} things"})
            )
        async with stdio_host(tmp_path, env={"BUTLERS_AUTH_TOKEN": "gateway-only"}) as host:
            assert {"remote_suite", "scripted_suite", "gone_suite"} <= set(await host.tools())

            listed = (await host.suite("remote_suite", "introspect")).structured_content
            assert {"state_set", "state_get", "status", "trigger"} <= {
                t["name"] for t in listed["tools"]
            }
            result = await host.suite(
                "remote_suite", "call", "state_set", key="via", value={"gateway": True}
            )
            assert not result.is_error, text_of(result)
            assert result.structured_content["key"] == "via"
            result = await host.suite("remote_suite", "call", "status")
            assert result.structured_content["name"] == butler.config.name

            listed = (await host.suite("scripted_suite", "introspect")).structured_content
            assert [(t["name"], t["summary"]) for t in listed["tools"]] == [
                (t["name"], t["description"]) for t in SCRIPTED_TOOLS
            ]
            result = await host.suite("scripted_suite", "call", "echo", n=7)
            assert result.structured_content == {"echo": {"n": 7}}
            result = await host.suite("scripted_suite", "call", "error")
            assert result.is_error and "scripted failure" in text_of(result)
            result = await host.suite("scripted_suite", "call", "echo", n=8)  # reconnected
            assert result.structured_content == {"echo": {"n": 8}}

            result = await host.suite("gone_suite", "introspect")
            assert result.is_error
            # (Its URL as scheme, host and port: a path or query may hold a credential.)
            origin = gone.removesuffix("/sse")
            assert text_of(result).startswith(f"child 'gone': cannot connect to {origin}/…")
            status = await host.status()
            assert (status["remote"]["state"], status["scripted"]["state"]) == ("ready", "ready")
            assert status["gone"]["state"] == "error"
        assert scripted.methods().count("tools/call") == 3
        assert scripted.headers and not [h for h in scripted.headers if "Authorization" in h]
    conn = await db_conn(butler.config.database)
    assert json.loads(await conn.fetchval("SELECT value FROM state WHERE key = 'via'")) == {
        "gateway": True
    }


async def test_gateway_over_streamable_http_and_sigterm_ends_its_children(workdir: Path) -> None:
    from fastmcp import Client

    port = free_port()
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        *("gateway", "--no-butlers", "--dir", str(workdir), "--transport", "http"),
        *("--port", str(port)),
        env=_env(workdir),
        cwd=workdir,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_listening(port)
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            assert "plain_suite" in {t.name for t in await client.list_tools()}
            result = await client.call_tool(
                "plain_suite", {"action": "call", "subtool": "add", "args": {"a": 1, "b": 2}}
            )
            assert result.content[0].text == "3"
        pids = child_pids(workdir)
        assert pids
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await process.wait() == 0
        assert [p for p in pids if _alive(p)] == []
    finally:
        if process.returncode is None:
            process.kill()


async def test_gateway_status_says_why_no_butlers_are_behind_it(tmp_path: Path) -> None:
    """The switchboard was not reachable when the gateway started (the config install writes
    does not pass --no-butlers): gateway_status, which the host's model reads (a host hides
    the gateway's stderr), says so and what to do."""
    from butlers.errors import CommandError
    from butlers.gateway.run import GatewayOptions, build_gateway

    async def unreachable() -> list[dict[str, Any]]:
        raise CommandError("cannot reach the switchboard at http://127.0.0.1:9/sse")

    options = GatewayOptions(directory=tmp_path, environ={})
    gateway, skipped = await build_gateway(options, unreachable)
    try:
        assert skipped == []
        result = await gateway.mcp.call_tool("gateway_status", {})
        [butlers] = [e for e in result.structured_content["result"] if e["name"] == "butlers"]
        assert (butlers["state"], butlers["ready"]) == ("error", False)
        assert "cannot reach the switchboard at http://127.0.0.1:9/sse" in butlers["error"]
        assert "`butlers up`" in butlers["error"] and "--no-butlers" in butlers["error"]
    finally:
        await gateway.close()
    gateway, _ = await build_gateway(options, None)  # --no-butlers: nothing to say
    try:
        result = await gateway.mcp.call_tool("gateway_status", {})
        assert result.structured_content["result"] == []
    finally:
        await gateway.close()


@pytest.mark.proc  # its child is a process
async def test_a_server_that_fails_at_start_is_heard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that says why on stderr and exits (as most do: "missing API key"):
    gateway_status keeps what it said, and the gateway's stderr shows the line naming the
    server (it passed through unnamed, and the status said only that it exited)."""
    from butlers.gateway.run import GatewayOptions, build_gateway

    said = "import sys; print('boom: missing \\x1b[2JAPI key', file=sys.stderr); sys.exit(3)"
    servers = {"crasher": {"command": sys.executable, "args": ["-c", said]}}
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    gateway, _ = await build_gateway(GatewayOptions(directory=tmp_path, environ={}), None)
    try:
        await gateway.warm_all()
        async with asyncio.timeout(10):
            while True:
                result = await gateway.mcp.call_tool("gateway_status", {})
                [crasher] = result.structured_content["result"]
                if crasher.get("stderr"):
                    break
                await asyncio.sleep(0.05)
    finally:
        await gateway.close()
    assert crasher["state"] == "error" and "exited" in crasher["error"]
    assert crasher["stderr"] == ["boom: missing [2JAPI key"]  # no escape reaches a terminal
    assert "[crasher] boom: missing [2JAPI key" in capsys.readouterr().err


async def test_a_childs_stderr_is_read_on_past_a_line_too_long() -> None:
    """A line over the reader's limit is left out and reading goes on (the reader ended on
    it, and a child whose stderr pipe then filled would block on its next write)."""
    from butlers.gateway.clients import StdioChild

    reader = asyncio.StreamReader(limit=16)
    reader.feed_data(b"x" * 100 + b"\nafter it\n")
    reader.feed_eof()
    said: list[str] = []
    async with asyncio.timeout(5):
        await StdioChild._read_stderr(reader, said.append)
    assert said == ["(a line too long to show was left out)", "after it"]


@pytest.mark.proc  # its child is a process
async def test_a_call_during_the_start_waits_for_that_start_not_a_second_one(
    tmp_path: Path,
) -> None:
    """A server that never answers its initialize, called while the gateway's prewarm is
    still waiting for it: the call takes that start's outcome (a timeout), and the server is
    started once, not once more after it (a call cost two whole timeouts)."""
    from butlers.gateway.run import GatewayOptions, build_gateway

    mcp_json(tmp_path, "silent", "--silent")
    (tmp_path / "gateway.toml").write_text("[timeouts]\nrpc_ms = 1000\n")
    gateway, _ = await build_gateway(GatewayOptions(directory=tmp_path, environ={}), None)
    try:
        gateway.start_warming()
        await asyncio.sleep(0.2)  # the prewarm is waiting for its initialize
        with pytest.raises(ToolError, match="child 'silent'"):
            await gateway.mcp.call_tool("silent_suite", {"action": "introspect"})
        assert len(child_pids(tmp_path)) == 1
    finally:
        await gateway.close()


@pytest.mark.proc  # its child is a process
async def test_a_child_lost_in_a_call_is_warned_of_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A child that exits in the middle of a call: its exit and the call it broke both say
    so; one warning (there were two, the same line)."""
    from butlers.gateway.run import GatewayOptions, build_gateway

    mcp_json(tmp_path, "brittle", "--crash-on", "add")
    gateway, _ = await build_gateway(GatewayOptions(directory=tmp_path, environ={}), None)
    try:
        await gateway.warm_all()
        with caplog.at_level(logging.WARNING, logger="butlers.gateway.server"):
            with pytest.raises(ToolError, match="brittle"):
                call = {"action": "call", "subtool": "add", "args": {"a": 1, "b": 2}}
                await gateway.mcp.call_tool("brittle_suite", call)
            await asyncio.sleep(0.3)  # the exit's own report, if it comes after the call's
    finally:
        await gateway.close()
    lost = [r.getMessage() for r in caplog.records if getattr(r, "action", "") == "child_lost"]
    assert len(lost) == 1, lost


async def test_the_fleets_token_goes_only_to_a_butler_that_proves_it_holds_it(
    start_butler: StartButler, tmp_path: Path
) -> None:
    """The gateway sent the operator's token to every registry row: a stale one (its butler
    removed, its port anyone's) and one whose port another user took (a red team); then,
    without the token, still served the impostor to the host as the butler (a walkthrough).
    A stale row is left out; what cannot prove it holds the token is not connected to, and
    gateway_status says why; the real butlers prove it, and take calls as before."""
    from butlers.gateway.run import GatewayOptions, build_gateway

    token = "fleet-token-0123456789abcdefghijkl"
    fleet = await make_fleet(start_butler, tmp_path, names=("general",), auth_token=token)
    general = fleet.targets["general"]

    async def registry() -> list[dict[str, Any]]:
        return [
            {"name": "general", "endpoint_url": general.sse_url, "description": "real"},
            {"name": "gone", "endpoint_url": gone.sse_url, "stale": True},
            {"name": "taken", "endpoint_url": taken.sse_url},
        ]

    options = GatewayOptions(directory=tmp_path, environ={}, auth_token=token)
    with log_records("butlers.gateway") as records:
        async with squatting(ports=2) as [gone, taken]:
            gateway, _ = await build_gateway(options, registry)
            try:
                await gateway.warm_all()
                assert "gone" not in gateway.slots
                result = await gateway.mcp.call_tool(
                    "general_suite",
                    {"action": "call", "subtool": "state_get", "args": {"key": "x"}},
                )
                assert not result.is_error
                status = await gateway.mcp.call_tool("gateway_status", {})
                [state] = [e for e in status.structured_content["result"] if e["name"] == "taken"]
            finally:
                await gateway.close()
    assert gone.heard == [] and taken.heard == ["/health -"], taken.heard  # its proof, no more
    assert state["state"] == "error", state
    assert "answered /health with no butler's answer: not connected to" in state["error"], state
    warned = [r.getMessage() for r in records]
    assert any("butler 'gone' left out" in line for line in warned), warned


async def test_the_owners_decisions_are_not_offered_through_the_gateway_unless_allowed(
    start_butler: StartButler, tmp_path: Path
) -> None:
    """The gateway calls a butler as the operator: its host's model could approve what the
    owner's veto holds on whatever a tool result told it (a red team). approval_decide and
    the pairing decisions are not offered, unless a suite's `expose.allow` names them."""
    from butlers.gateway.run import GatewayOptions, build_gateway

    fleet = await make_fleet(start_butler, tmp_path, names=("general",))

    async def registry() -> list[dict[str, Any]]:
        async with Client(fleet.switchboard.sse_url) as client:
            return (await client.call_tool("list_butlers", {})).structured_content["result"]

    async def offered(directory: Path) -> tuple[set[str], str]:
        gateway, _ = await build_gateway(GatewayOptions(directory=directory, environ={}), registry)
        try:
            listed = await gateway.mcp.call_tool("switchboard_suite", {"action": "introspect"})
            decide = {"id": 1, "decision": "approve"}
            try:
                called = await gateway.mcp.call_tool(
                    "switchboard_suite",
                    {"action": "call", "subtool": "approval_decide", "args": decide},
                )
                said = text_of(called)
            except Exception as exc:  # (in process: a refusal is raised, not returned)
                said = str(exc)
            return {t["name"] for t in listed.structured_content["tools"]}, said
        finally:
            await gateway.close()

    names, said = await offered(tmp_path)
    assert "route" in names and "approvals_list" in names
    assert not {"approval_decide", "pairing_decide", "pairing_revoke"} & names
    assert not {"approval_request", "approval_claim"} & names  # (the butlers' daemons')
    assert "Subtool 'approval_decide' not allowed by suite 'switchboard_suite'" in said
    allowing = tmp_path / "allowing"
    allowing.mkdir()
    (allowing / "gateway.toml").write_text(
        '[suites.switchboard.expose]\nallow = ["approval_decide", "route"]\n'
    )
    names, said = await offered(allowing)
    assert names == {"approval_decide", "route"}
    assert "no approval" in said or "approval 1" in said, said
