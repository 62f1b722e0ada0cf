"""Gateway children in real environments: `[suites.<child>] pass_env` hands a child the host
variables it names (a proxy, a CA file, DISPLAY) and no others, checked against the real npm
`server-everything` (its `get-env` tool prints the environment it got); and a child's
`initialize` is held to the call timeout, not the spawn timeout, so a slow first start (a cold
`npx -y` download) is not taken for a hung child; and `idle_timeout_s` stops an idle child,
started again by its next call, never in the middle of one."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from butlers.errors import ConfigError
from butlers.gateway.config import load_gateway_config
from tests.test_gateway import MOCK, _alive, child_pids, mcp_json, stdio_host, survivors, text_of

NAMED = "http://127.0.0.1:9/named-proxy"  # values no host environment holds by chance
UNNAMED = "unnamed.example.invalid"


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        (
            '["HTTPS-PROXY"]',
            "expected a list of variable names such as 'HTTPS_PROXY', item 0 is 'HTTPS-PROXY'",
        ),
        ('["SSL_CERT_FILE", "1DISPLAY"]', "item 1 is '1DISPLAY'"),
        ('["A=B"]', "item 0 is 'A=B'"),
        (
            '"HTTPS_PROXY"',
            "expected a list of variable names such as 'HTTPS_PROXY', got 'HTTPS_PROXY'",
        ),
        (
            '["BUTLERS_AUTH_TOKEN"]',
            "'BUTLERS_AUTH_TOKEN' is the gateway's own setting, never a child's",
        ),
    ],
)
def test_bad_pass_env_names_are_refused_naming_the_file_and_key(
    tmp_path: Path, names: str, problem: str
) -> None:
    (tmp_path / "gateway.toml").write_text(f"[suites.everything]\npass_env = {names}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_gateway_config(tmp_path)
    assert excinfo.value.key == "suites.everything.pass_env", str(excinfo.value)
    assert problem in excinfo.value.problem, str(excinfo.value)
    assert str(tmp_path / "gateway.toml") in str(excinfo.value)


def test_pass_env_in_both_spellings(tmp_path: Path) -> None:
    (tmp_path / "gateway.toml").write_text('[suites.docs]\npass_env = ["HTTPS_PROXY"]\n')
    assert load_gateway_config(tmp_path).suite("docs").pass_env == ("HTTPS_PROXY",)
    (tmp_path / "gateway.toml").unlink()
    (tmp_path / "switchboard.config.json").write_text(
        json.dumps({"suites": {"docs": {"passEnv": ["DISPLAY"]}}})
    )
    assert load_gateway_config(tmp_path).suite("docs").pass_env == ("DISPLAY",)


async def test_pass_env_gives_the_real_everything_server_only_the_named_variable(
    tmp_path: Path, npm_servers: Path
) -> None:
    servers = {
        "everything": {"command": str(npm_servers / "mcp-server-everything"), "args": ["stdio"]}
    }
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    # DISPLAY is named too: passed when the host has it, left out (not an error) when not.
    (tmp_path / "gateway.toml").write_text(
        '[suites.everything]\npass_env = ["HTTPS_PROXY", "DISPLAY"]\n'
    )
    host_env = {"HTTPS_PROXY": NAMED, "NO_PROXY": UNNAMED, "GATEWAY_ENV_UNNAMED": UNNAMED}
    async with stdio_host(tmp_path, env=host_env) as host:
        result = await host.suite("everything_suite", "call", "get-env")
        assert not result.is_error, text_of(result)
        seen = text_of(result)
    assert NAMED in seen  # named in pass_env: it arrived
    assert UNNAMED not in seen  # set in the gateway's environment, not named: it did not
    assert "GATEWAY_ENV_UNNAMED" not in seen and "NO_PROXY" not in seen


def slow_child(directory: Path, name: str, delay_s: float) -> None:
    """A mock child that takes `delay_s` before it reads anything, its `initialize` included
    (what `npx -y` does while it downloads the package)."""
    child = directory / "mcps" / name
    child.mkdir(parents=True)
    code = (
        "import os, sys, time\n"
        f"time.sleep({delay_s})\n"
        f"os.execv(sys.executable, [sys.executable, {MOCK!r}])\n"
    )
    command = {"cmd": sys.executable, "args": ["-c", code]}
    (child / ".mcp.json").write_text(json.dumps({"name": name, "command": command}))


async def test_a_slow_initialize_within_the_call_timeout_is_waited_for(tmp_path: Path) -> None:
    """It answers initialize after 1.5 s: five times child_spawn_ms, well within rpc_ms."""
    slow_child(tmp_path, "slow", 1.5)
    (tmp_path / "gateway.toml").write_text("[timeouts]\nchild_spawn_ms = 300\nrpc_ms = 60000\n")
    async with stdio_host(tmp_path, "--lazy") as host:
        result = await host.suite("slow_suite", "call", "echo", message="after a cold start")
        assert not result.is_error, text_of(result)
        assert "after a cold start" in text_of(result)


async def test_an_idle_child_is_stopped_and_started_again_by_its_next_call(
    tmp_path: Path,
) -> None:
    mcp_json(tmp_path, "plain")  # the mock writes each spawn's pid to tmp_path/pids
    (tmp_path / "gateway.toml").write_text("[suites.plain]\nidle_timeout_s = 1\n")
    async with stdio_host(tmp_path, "--lazy") as host:
        result = await host.suite("plain_suite", "call", "echo", message="first")
        assert not result.is_error, text_of(result)
        [first] = child_pids(tmp_path)
        assert await survivors([first], timeout_s=30) == []  # idle: stopped
        result = await host.suite("plain_suite", "call", "echo", message="second")
        assert not result.is_error, text_of(result)
        assert "second" in text_of(result)
        [_, second] = child_pids(tmp_path)  # started again, transparently
        assert _alive(second)
        assert (await host.status())["plain"]["state"] != "error"


async def test_an_idle_stop_never_cuts_a_call_short(tmp_path: Path, npm_servers: Path) -> None:
    """A quick call starts the idle countdown; a call of three seconds right after it must
    hold the child, though the countdown is one second."""
    servers = {
        "everything": {"command": str(npm_servers / "mcp-server-everything"), "args": ["stdio"]}
    }
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    (tmp_path / "gateway.toml").write_text("[suites.everything]\nidle_timeout_s = 1\n")
    async with stdio_host(tmp_path, "--lazy") as host:
        result = await host.suite("everything_suite", "call", "echo", message="quick")
        assert not result.is_error, text_of(result)
        result = await host.suite(
            "everything_suite", "call", "trigger-long-running-operation", duration=3, steps=3
        )
        assert not result.is_error, text_of(result)


async def test_a_result_past_max_result_bytes_is_refused_and_the_child_serves_on(
    tmp_path: Path,
) -> None:
    """One child's huge result made Claude Code close its connection to the gateway, and
    every child restarted with it (a walkthrough): a result past `max_result_bytes` is an
    error naming its size; the next call of the same child is answered."""
    mcp_json(tmp_path, "plain")
    (tmp_path / "gateway.toml").write_text("max_result_bytes = 5000\n")
    async with stdio_host(tmp_path) as host:
        result = await host.suite("plain_suite", "call", "echo", message="x" * 4000)
        assert result.is_error
        assert re.fullmatch(
            r"plain/echo: its result holds \d{4} bytes, more than max_result_bytes \(5000\) "
            r"in gateway.toml: not passed on",
            text_of(result),
        ), text_of(result)
        result = await host.suite("plain_suite", "call", "echo", message="y" * 900)
        assert not result.is_error and text_of(result) == "y" * 900
        assert len(child_pids(tmp_path)) == 1  # the same child throughout
