"""The Claude wrapper: a suite's `natural_language` subtool answered by the real Claude Code
binary (against the scripted Messages API) holding that one child's tools."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from butlers.claude_code import McpTarget, StdioServer, isolated_cli_env
from butlers.gateway.children import ChildSpec
from butlers.gateway.config import load_gateway_config
from butlers.gateway.wrapper import _target, instructions_for, load_descriptions
from tests.fakes.messages_api import ScriptedMessagesAPI, text, tool_use
from tests.fakes.otlp import OtlpReceiver
from tests.test_gateway import (
    GATEWAY_SECRET,
    child_environment,
    child_pids,
    mcp_json,
    stdio_host,
    survivors,
    text_of,
)

INSTRUCTIONS = "You add numbers for the user with the add tool. Answer with the sum only."


def test_instructions_come_from_the_config_then_claude_md_then_mcp_descriptions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "gateway.toml").write_text('[suites.a]\nclaude = "from the config"\n')
    for name in ("a", "b", "c", "d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "CLAUDE.md").write_text(f"CLAUDE.md of {name}" if name != "d" else " ")
    (tmp_path / "mcp-descriptions.json").write_text(
        json.dumps({"mcps": {"b": {"claude": "descriptions of b"}, "c": {"claude": "of c"}}})
    )
    config = load_gateway_config(tmp_path)
    descriptions = load_descriptions(tmp_path)

    def found(name: str, cwd: Path | None) -> str | None:
        spec = ChildSpec(name=name, cmd="x", cwd=cwd)
        instructions = instructions_for(spec, config, descriptions)
        return instructions.text if instructions else None

    assert found("a", tmp_path / "a") == "from the config"  # over its CLAUDE.md
    assert found("b", tmp_path / "b") == "CLAUDE.md of b"  # over mcp-descriptions.json
    assert found("c", None) == "of c"  # no directory (a host's .mcp.json entry)
    assert found("d", tmp_path / "d") is None  # a blank CLAUDE.md is no instructions
    assert found("e", None) is None

    (tmp_path / ".switchboard").mkdir()
    (tmp_path / ".switchboard" / "mcp-descriptions.json").write_text("{broken")
    with caplog.at_level(logging.WARNING):
        assert set(load_descriptions(tmp_path)) == {"b", "c"}
    assert "mcp-descriptions.json: not readable" in caplog.text


def test_a_stdio_server_of_claude_code_gets_no_credentials_and_no_values_in_argv(
    tmp_path: Path,
) -> None:
    target = McpTarget(
        name="docs",
        stdio=StdioServer("env", (), {"DOCS_TOKEN": "declared-secret"}, str(tmp_path)),
    )
    config = target.server_config()
    assert config["type"] == "stdio" and config["env"] == {"DOCS_TOKEN": "declared-secret"}
    assert "declared-secret" not in json.dumps([config["command"], *config["args"]])
    # What Claude Code would do with it: start the command with its own environment plus
    # the declared env. The server (here `env`, printing what it got) sees the base and
    # its declared variable only.
    claude_code_environment = {
        "PATH": os.environ["PATH"],
        "LC_ALL": "C.UTF-8",
        "ANTHROPIC_API_KEY": "sk-claude-codes-own",
        "CLAUDE_CODE_MESSAGING_TOKEN": "claude-code-internal",
        **config["env"],
    }
    printed = subprocess.run(
        [config["command"], *config["args"]],
        env=claude_code_environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert dict(line.split("=", 1) for line in printed.splitlines()) == {
        "PATH": os.environ["PATH"],
        "LC_ALL": "C.UTF-8",
        "DOCS_TOKEN": "declared-secret",
    }
    pwd = subprocess.run(
        [config["command"], *config["args"][:-1], "pwd"],
        env=claude_code_environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert pwd.strip() == str(tmp_path)  # run in its directory, as the gateway runs it


def test_a_remote_childs_headers_and_a_butlers_token_go_to_claude_codes_config() -> None:
    remote = ChildSpec(name="web", url="https://x.example/mcp", headers={"X-Api-Key": "k-1"})
    assert _target(remote, ["search"], ["admin"], None).server_config() == {
        "type": "http",
        "url": "https://x.example/mcp",
        "headers": {"X-Api-Key": "k-1"},
    }
    butler = ChildSpec(name="general", url="http://127.0.0.1:8101/sse", kind="butler")
    config = _target(butler, ["state_get"], [], "tok-123456").server_config()
    assert config["type"] == "sse" and config["headers"] == {"Authorization": "Bearer tok-123456"}


@pytest.fixture
def wrapped(tmp_path: Path) -> Path:
    """`plain` wrapped by gateway.toml (its `crash` denied), `framed` by its CLAUDE.md,
    `chatty` not at all."""
    mcp_json(tmp_path, "plain")
    framed = mcp_json(tmp_path, "framed", "--framing", "content-length")
    (framed / "CLAUDE.md").write_text("You echo.")
    mcp_json(tmp_path, "chatty", "--logs")
    (tmp_path / "gateway.toml").write_text(
        f'[suites.plain]\nclaude = "{INSTRUCTIONS}"\n[suites.plain.expose]\ndeny = ["crash"]\n'
        "[timeouts]\nchild_spawn_ms = 120000\n"
    )
    return tmp_path


async def test_natural_language_runs_claude_code_with_the_child_as_its_only_server(
    wrapped: Path, scripted_api: ScriptedMessagesAPI, otlp: OtlpReceiver
) -> None:
    seen: dict[str, Any] = {}

    def model(body: dict[str, Any]) -> list[dict[str, Any]]:
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if turn == 0:
            seen["system"] = json.dumps(body.get("system"))
            # (Claude Code's own DeferredToolPlaceholder aside: no built-in tools)
            names = [t["name"] for t in body.get("tools", [])]
            seen["tools"] = sorted(n for n in names if n != "DeferredToolPlaceholder")
            # The child Claude Code started is running now: the newest pid in the file.
            seen["child_env"] = child_environment(child_pids(wrapped)[-1])
            return [tool_use("mcp__plain__add", {"a": 2, "b": 3})]
        return [text("2 + 3 = 5")]

    scripted_api.respond_with(model)
    home = wrapped / "claude-home"
    home.mkdir()
    env = isolated_cli_env(home, scripted_api.url, inherited=os.environ)
    env |= {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url("http"),
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    async with stdio_host(wrapped, env=env) as host:
        listed = (await host.suite("plain_suite", "introspect")).structured_content["tools"]
        [entry] = [t for t in listed if t["name"] == "natural_language"]
        assert entry["inputSchema"]["required"] == ["query"]
        framed = (await host.suite("framed_suite", "introspect")).structured_content["tools"]
        assert "natural_language" in {t["name"] for t in framed}  # from its CLAUDE.md
        chatty = (await host.suite("chatty_suite", "introspect")).structured_content["tools"]
        assert "natural_language" not in {t["name"] for t in chatty}
        result = await host.suite("chatty_suite", "call", "natural_language", query="hi")
        assert result.is_error and "not found in suite 'chatty_suite'" in text_of(result)

        before = child_pids(wrapped)
        result = await host.suite("plain_suite", "call", "natural_language", query="What is 2 + 3?")
        assert not result.is_error, text_of(result)
        assert text_of(result) == "2 + 3 = 5"
        assert result.structured_content == {
            "answer": "2 + 3 = 5",
            "tool_calls": [{"name": "add", "input": {"a": 2, "b": 3}}],
        }
        # The real child answered the model's call; the run's child was its own process.
        [added] = scripted_api.tool_results()
        assert "5" in json.dumps(added["content"]) and not added.get("is_error")
        [claude_child] = [p for p in child_pids(wrapped) if p not in before]
        assert claude_child not in before
        # Only the child's allowed tools, as the only MCP server; the instructions as system.
        assert seen["tools"] == [
            "mcp__plain__add",
            "mcp__plain__echo",
            "mcp__plain__long_description",
        ]
        assert INSTRUCTIONS in seen["system"]
        # The child got the base and its declared env: no credentials of Claude Code's.
        child_env = seen["child_env"]
        assert "MOCK_MCP_PIDS" in child_env and "PATH" in child_env
        assert not [k for k in child_env if k.startswith(("ANTHROPIC_", "CLAUDE_"))]
        assert "sk-test" not in json.dumps(child_env)
        assert GATEWAY_SECRET not in json.dumps(child_env)
        assert await survivors([claude_child]) == []  # ended with its run

        result = await host.suite("plain_suite", "call", "natural_language", query=" ")
        assert result.is_error and "needs 'query'" in text_of(result)

        # Activated, the wrapper is one of the child's own tools.
        activated = await host.call("gateway_activate", name="plain")
        assert "natural_language" in activated.structured_content["tools"]
        assert "crash" not in activated.structured_content["tools"]

    # Traced: the wrapper's session is a span inside the suite call's.
    spans = await otlp.wait_for(lambda spans: "gateway.natural_language" in {s.name for s in spans})
    [session] = [s for s in spans if s.name == "gateway.natural_language"]
    [call] = [
        s
        for s in spans
        if s.name == "gateway.suite_call"
        and s.attributes.get("subtool") == "natural_language"
        and s.trace_id == session.trace_id
    ]
    assert session.parent_span_id == call.span_id and session.attributes["child"] == "plain"
