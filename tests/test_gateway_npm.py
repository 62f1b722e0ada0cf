"""The gateway with the real MCP servers from npm (filesystem, memory, everything): installed
in front of a standard `.mcp.json`, started the way Claude Code starts it, used through the
suite tools, uninstalled byte for byte; and `--mode activate` with the memory server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.test_cli_client import run_cli
from tests.test_gateway import Host, stdio_host, text_of
from tests.test_gateway_install import as_the_host_starts


def project_with_npm_servers(root: Path, bin_dir: Path) -> Path:
    project = root / "project"
    (project / "files").mkdir(parents=True)
    (project / "files" / "note.txt").write_text("hello from a file\n")
    servers = {
        "files": {
            "command": str(bin_dir / "mcp-server-filesystem"),
            "args": [str(project / "files")],
        },
        "memory": {
            "command": str(bin_dir / "mcp-server-memory"),
            "env": {"MEMORY_FILE_PATH": "${MEMORY_FILE:-" + str(root / "memory.jsonl") + "}"},
        },
        "everything": {"command": str(bin_dir / "mcp-server-everything"), "args": ["stdio"]},
    }
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": servers}, indent=2))
    return project


def entity(name: str) -> dict[str, Any]:
    return {"name": name, "entityType": "person", "observations": ["likes tea"]}


async def test_install_in_front_of_real_servers_then_uninstall(
    tmp_path: Path, npm_servers: Path
) -> None:
    project = project_with_npm_servers(tmp_path, npm_servers)
    original = (project / ".mcp.json").read_bytes()
    code, _, err = await run_cli("gateway", "install", "--dir", str(project))
    assert code == 0, err
    [server] = json.loads((project / ".mcp.json").read_text())["mcpServers"].values()

    async with as_the_host_starts(server, project) as client:
        host = Host(client, [])
        assert {"files_suite", "memory_suite", "everything_suite"} <= set(await host.tools())

        path = str(project / "files" / "note.txt")
        result = await host.suite("files_suite", "call", "read_text_file", path=path)
        assert "hello from a file" in text_of(result), text_of(result)

        result = await host.suite(
            "memory_suite", "call", "create_entities", entities=[entity("Ann")]
        )
        assert not result.is_error, text_of(result)
        result = await host.suite("memory_suite", "call", "open_nodes", names=["Ann"])
        assert "likes tea" in text_of(result)

        result = await host.suite("everything_suite", "call", "echo", message="through")
        assert "through" in text_of(result)
        progress: list[float] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append(done)

        call = {
            "action": "call",
            "subtool": "trigger-long-running-operation",
            "args": {"duration": 1, "steps": 3},
        }
        result = await client.call_tool("everything_suite", call, progress_callback=on_progress)
        assert not result.is_error, text_of(result)
        assert progress == sorted(progress) and len(progress) >= 3  # forwarded to the host

    code, _, err = await run_cli("gateway", "uninstall", "--dir", str(project))
    assert code == 0, err
    assert (project / ".mcp.json").read_bytes() == original


async def test_activate_mode_with_the_real_memory_server(tmp_path: Path, npm_servers: Path) -> None:
    project = project_with_npm_servers(tmp_path, npm_servers)
    async with stdio_host(
        project, "--mode", "activate", env={"MEMORY_FILE": str(tmp_path / "m.jsonl")}
    ) as host:
        control = ["gateway_activate", "gateway_deactivate", "gateway_status"]
        assert sorted(await host.tools()) == control
        result = await host.call("gateway_activate", name="memory")
        assert "create_entities" in result.structured_content["tools"]
        await host.wait_list_changed(1)
        assert {"create_entities", "read_graph"} <= set(await host.tools())
        result = await host.call("create_entities", entities=[entity("Bob")])
        assert not result.is_error, text_of(result)
        assert "Bob" in text_of(await host.call("read_graph"))
    assert (tmp_path / "m.jsonl").is_file()  # ${MEMORY_FILE:-...} from the environment


async def test_the_filesystem_servers_first_call_after_each_start_has_the_roots(
    tmp_path: Path, npm_servers: Path
) -> None:
    """The filesystem server asks for the roots after its handshake and applies them then:
    its first call after every start (idle stops included) went before, and a file of the
    project outside its argv's directory was refused (a walkthrough: 3 calls of 3)."""
    project = project_with_npm_servers(tmp_path, npm_servers)
    (project / "readme.txt").write_text("the project's own\n")
    (project / "gateway.toml").write_text("[suites.files]\nidle_timeout_s = 1\n")
    code, _, err = await run_cli("gateway", "install", "--dir", str(project))
    assert code == 0, err
    [server] = json.loads((project / ".mcp.json").read_text())["mcpServers"].values()
    async with as_the_host_starts(server, project) as client:
        host = Host(client, [])
        assert "files_suite" in await host.tools()
        for attempt in range(3):
            if attempt:
                await asyncio.sleep(2.5)  # idle: stopped, started again by the call below
            result = await host.suite(
                "files_suite", "call", "read_text_file", path=str(project / "readme.txt")
            )
            assert "the project's own" in text_of(result), (attempt, text_of(result))
