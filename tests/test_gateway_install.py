"""`butlers gateway install` / `uninstall`: Claude Code's project `.mcp.json` (then the very
command Claude Code would run), Claude Desktop's config, and Claude Code's user scope through
the bundled `claude` binary; originals back byte for byte, never over the user's edits."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from butlers.gateway.install import SKILL, SKILL_TEXT, claude_binary
from tests.test_cli_client import run_cli
from tests.test_gateway import MOCK, text_of

# Hand-written, as people write them: odd spacing, a key of the host's own, no final newline.
ORIGINAL = (
    '{\n    "mcpServers": {\n'
    f'      "notes":   {{"command": "{sys.executable}", "args": ["{MOCK}"]}},\n'
    f'      "framed": {{"command": "{sys.executable}", "args": ["{MOCK}", "--framing", '
    '"content-length"], "env": {"MOCK_SETTING": "${SETTING:-from default}"}}\n'
    '    },\n    "x-team-note": "keep me"\n}'
)


async def test_install_runs_the_servers_behind_the_gateway_and_uninstall_restores_them(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    mcp_json = project / ".mcp.json"
    mcp_json.write_text(ORIGINAL)
    code, out, err = await run_cli("gateway", "install", "--dir", str(project))
    assert code == 0, err
    installed = json.loads(mcp_json.read_text())
    assert installed["x-team-note"] == "keep me"  # the rest of the file stays
    [(name, server)] = installed["mcpServers"].items()
    assert name == "butlers" and Path(server["command"]).is_absolute()
    assert server["args"] == ["gateway", "--dir", str(project)]
    assert (project / SKILL).read_text() == SKILL_TEXT
    written = mcp_json.read_bytes()
    record = project / ".butlers-gateway" / "claude-code"
    assert record.stat().st_mode & 0o777 == 0o700  # the servers' env may hold API keys
    assert {p.stat().st_mode & 0o777 for p in record.iterdir()} == {0o600}

    code, out, err = await run_cli("gateway", "install", "--dir", str(project))
    assert code == 0, err
    assert "already installed, nothing changed" in out and mcp_json.read_bytes() == written

    # What Claude Code does with the file: start that command from the project.
    params = StdioServerParameters(
        command=server["command"],
        args=[*server["args"], "--no-butlers"],
        env={k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")},
        cwd=str(project),
    )
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        tools = {t.name for t in (await client.list_tools()).tools}
        assert {"notes_suite", "framed_suite"} <= tools and "butlers_suite" not in tools
        call = {"action": "call", "subtool": "echo", "args": {"message": "via install"}}
        result = await client.call_tool("framed_suite", call)
        assert text_of(result) == "via install"
        assert result.structured_content["env"] == "from default"  # ${...} still expanded
        result = await client.call_tool(
            "notes_suite", {"action": "call", "subtool": "add", "args": {"a": 2, "b": 2}}
        )
        assert text_of(result) == "4"

    # An edit of the user's is never overwritten.
    mcp_json.write_text(mcp_json.read_text().replace("keep me", "edited"))
    edited = mcp_json.read_bytes()
    code, out, err = await run_cli("gateway", "uninstall", "--dir", str(project))
    assert code == 1 and f"{mcp_json} was edited since `butlers gateway install`" in err
    assert mcp_json.read_bytes() == edited
    mcp_json.write_bytes(written)
    code, out, err = await run_cli("gateway", "uninstall", "--dir", str(project))
    assert code == 0, err
    assert mcp_json.read_text() == ORIGINAL  # byte for byte
    assert not (project / ".butlers-gateway").exists() and not (project / SKILL).exists()


async def test_claude_desktop_config_with_a_backup(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    desktop = tmp_path / "claude_desktop_config.json"
    original = json.dumps(
        {"globalShortcut": "Ctrl+Space", "mcpServers": {"notes": {"command": "npx"}}}, indent=4
    )
    desktop.write_text(original)
    args = ("--dir", str(tmp_path), "--host", "claude-desktop", "--config", str(desktop))
    code, _, err = await run_cli("gateway", "install", *args, env={"HOME": str(home)})
    assert code == 0, err
    rewritten = json.loads(desktop.read_text())
    assert rewritten["globalShortcut"] == "Ctrl+Space"
    assert list(rewritten["mcpServers"]) == ["butlers"]
    moved = tmp_path / ".butlers-gateway" / "claude-desktop" / "servers.json"
    assert json.loads(moved.read_text()) == {"mcpServers": {"notes": {"command": "npx"}}}
    assert (tmp_path / ".butlers-gateway" / "claude-desktop" / "original.json").read_text() == (
        original
    )
    assert (home / SKILL).is_file()  # Claude Desktop has no project: the user's skills
    code, _, err = await run_cli("gateway", "uninstall", *args, env={"HOME": str(home)})
    assert code == 0, err
    assert desktop.read_text() == original and not (home / SKILL).exists()


@pytest.mark.claude  # runs the real Claude Code binary (its `mcp add`), 2-3 s each
async def test_user_scope_registers_through_claude_codes_own_command(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    assert claude_binary(os.environ) is not None  # the SDK bundles one
    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(tmp_path), env=env
    )
    assert code == 0, err
    assert "`claude mcp add -s user butlers -- " in out
    registered = json.loads((home / ".claude" / ".claude.json").read_text())["mcpServers"]
    assert registered["butlers"]["args"] == ["gateway", "--dir", str(tmp_path)]
    assert (home / SKILL).is_file()
    code, out, err = await run_cli(
        "gateway", "uninstall", "--scope", "user", "--dir", str(tmp_path), env=env
    )
    assert code == 0, err
    registered = json.loads((home / ".claude" / ".claude.json").read_text())
    assert "butlers" not in registered.get("mcpServers", {})
    assert not (home / SKILL).exists()
