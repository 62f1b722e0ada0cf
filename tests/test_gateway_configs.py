"""The MCP server configs people already have, read by the gateway: Claude Code's `.mcp.json`
(`mcpServers`, with `${VAR}` expansion), Claude Desktop's config and mcpflip's servers.json
(`--config`), beside the seed-000 per-directory files."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from butlers.errors import ConfigError
from butlers.gateway.sources import project_servers, read_config_file
from tests.fakes.sse_mcp import SseMcpServer
from tests.test_gateway import MOCK, mcp_json, stdio_host, text_of


def stdio(*args: str, **env: str) -> dict:
    return {"command": sys.executable, "args": [MOCK, *args], "env": env}


def test_claude_codes_mcp_json_with_variables(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / ".mcp.json").write_text(
        json.dumps(
            {
                "mcpServers": {
                    "docs": {
                        "command": "${NODE:-node}",
                        "args": ["server.js", "--root=${HOME}/docs"],
                        "env": {"API_KEY": "${DOCS_KEY}", "MODE": "${MODE:-fast}"},
                        "disabled": False,  # a host's own key: not ours to refuse
                    },
                    "search": {
                        "type": "http",
                        "url": "https://${SEARCH_HOST}/mcp",
                        "headers": {"Authorization": "Bearer ${SEARCH_TOKEN}"},
                    },
                    "unset": {"command": "x", "env": {"K": "${NOT_SET_ANYWHERE}"}},
                    "broken": {"args": ["no command"]},
                    "butlers": {
                        "command": "/opt/venv/bin/butlers",
                        "args": ["gateway", "--dir", "."],
                    },
                }
            }
        )
    )
    environ = {
        "HOME": "/home/u",
        "DOCS_KEY": "k-1",
        "SEARCH_HOST": "s.example",
        "SEARCH_TOKEN": "t",
    }
    with caplog.at_level(logging.WARNING):
        specs = {s.name: s for s in project_servers(tmp_path, environ)}
    assert set(specs) == {"docs", "search"}  # `butlers gateway` itself is never a child
    docs = specs["docs"]
    assert (docs.cmd, docs.args) == ("node", ("server.js", "--root=/home/u/docs"))
    assert docs.env == {"API_KEY": "k-1", "MODE": "fast"} and docs.cwd == tmp_path.resolve()
    search = specs["search"]
    assert search.url == "https://s.example/mcp"
    assert search.headers == {"Authorization": "Bearer t"}
    assert (
        f"skipping {tmp_path / '.mcp.json'}: mcpServers.unset: ${{NOT_SET_ANYWHERE}} is not set "
        "and has no default"
    ) in caplog.text
    assert f"skipping {tmp_path / '.mcp.json'}: mcpServers.broken: command: Field required" in (
        caplog.text
    )


def test_claude_desktop_config_and_mcpflip_servers_json(tmp_path: Path) -> None:
    desktop = tmp_path / "claude_desktop_config.json"
    desktop.write_text(
        json.dumps(
            {
                "globalShortcut": "",
                "mcpServers": {
                    "memory": stdio(),
                    "web": {"type": "sse", "url": "http://127.0.0.1:9/sse"},
                },
            }
        )
    )
    specs = read_config_file(desktop, {})
    assert [(s.name, s.cmd or s.url) for s in specs] == [
        ("memory", sys.executable),
        ("web", "http://127.0.0.1:9/sse"),
    ]
    flip = tmp_path / "servers.json"
    flip.write_text(json.dumps({"fs": {"command": "npx", "args": ["-y", "x"]}, "mem": stdio()}))
    specs = read_config_file(flip, {})
    assert [(s.name, s.cmd, s.args) for s in specs] == [
        ("fs", "npx", ("-y", "x")),
        ("mem", sys.executable, (MOCK,)),
    ]
    assert specs[0].cwd == tmp_path.resolve()
    flip.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"servers\.json: expected an object, got list"):
        read_config_file(flip, {})


async def test_a_gateway_on_every_source_at_once(tmp_path: Path) -> None:
    """--config servers.json, the project's .mcp.json (a stdio and a remote server with a
    header from the environment) and a seed-000 directory; a name declared twice is taken
    from the first source, with a warning that names both files."""
    project_dir = str(tmp_path)  # (resolved already)
    flip = tmp_path / "elsewhere" / "servers.json"
    flip.parent.mkdir()
    flip.write_text(json.dumps({"flipped": stdio(), "twice": stdio()}))
    async with SseMcpServer() as scripted:
        (tmp_path / ".mcp.json").write_text(
            json.dumps(
                {
                    "mcpServers": {
                        "project": stdio(
                            "--framing", "content-length", MOCK_SETTING="${FROM_ENV:-none}"
                        ),
                        "remote": {
                            "type": "sse",
                            "url": scripted.url,
                            "headers": {"X-Api-Key": "${REMOTE_KEY}"},
                        },
                    }
                }
            )
        )
        mcp_json(tmp_path, "twice")  # a seed-000 file of the same name
        env = {"FROM_ENV": "expanded", "REMOTE_KEY": "key-123"}
        async with stdio_host(tmp_path, "--config", str(flip), env=env) as host:
            tools = set(await host.tools())
            assert {"flipped_suite", "twice_suite", "project_suite", "remote_suite"} <= tools
            result = await host.suite("project_suite", "call", "echo", message="hi")
            assert text_of(result) == "hi" and result.structured_content["env"] == "expanded"
            # Claude Code runs a project's servers in the project's directory.
            assert result.structured_content["cwd"] == project_dir
            result = await host.suite("flipped_suite", "call", "add", a=1, b=2)
            assert text_of(result) == "3"
            result = await host.suite("remote_suite", "call", "echo", n=1)
            assert result.structured_content == {"echo": {"n": 1}}
        assert any(h.get("X-Api-Key") == "key-123" for h in scripted.headers)
    stderr = (tmp_path / "gateway.stderr").read_text()
    assert (
        f"child 'twice' from {tmp_path / 'mcps' / 'twice' / '.mcp.json'} ignored: the name is "
        f"taken by {flip}"
    ) in stderr


async def test_a_suite_table_naming_no_server_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`[suites.alpah]` for the server `alpha`: its redaction would quietly apply to nothing;
    the gateway says so at start, with the likely name. A table naming a server is silent."""
    from butlers.gateway.run import GatewayOptions, build_gateway

    servers = {"alpha": {"command": "node"}, "beta": {"command": "node"}}
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    (tmp_path / "gateway.toml").write_text(
        '[suites.alpah]\nredact = ["message"]\n[suites.beta]\nredact = ["message"]\n'
    )
    with caplog.at_level(logging.WARNING, logger="butlers.gateway.run"):
        gateway, _ = await build_gateway(GatewayOptions(directory=tmp_path, environ={}), None)
        await gateway.close()
    warned = [r.getMessage() for r in caplog.records if getattr(r, "action", "") == "suite_unknown"]
    assert warned == [
        f"{tmp_path / 'gateway.toml'}: [suites.alpah] names no server behind the gateway (did "
        "you mean 'alpha'?): its settings apply to nothing"
    ]
