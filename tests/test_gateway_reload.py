"""Hot reload: editing `.mcp.json`, the `--config` file or a globbed server's file while the
gateway runs adds, removes or restarts only the servers that changed, and tells the host. A
new or changed server waits for a person's `butlers gateway approve` (gateway.toml `reload =
"approve"`, the default); a removed one goes at once.

The gateway runs as a host starts it (the `butlers gateway` command over stdio, the SDK's
client); its children are real processes (the small stdio mock, and the real npm
`server-everything`); `approve` is the real command, its store in the test's own
XDG_STATE_HOME. Every wait ends on something the gateway does (the host's
`notifications/tools/list_changed`, a log line, a pid written by a new child, the gateway's
exit) and is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from butlers.errors import ConfigError
from butlers.gateway.approvals import fingerprint
from butlers.gateway.children import ChildSpec, Skipped
from butlers.gateway.config import load_gateway_config
from butlers.gateway.reload import Reloader, hold, plan
from butlers.gateway.server import Gateway
from butlers.gateway.sources import ServerFiles
from tests.conftest import eventually
from tests.test_cli_client import run_cli
from tests.test_gateway import (
    BUTLERS,
    MOCK,
    Host,
    _alive,
    _env,
    mcp_json,
    stdio_host,
    survivors,
    text_of,
)

WAIT_S = 30  # bound of every wait: a bug fails the test instead of hanging it
INFO = ("--log-level", "info")  # what a reload changed is logged at info
WATCHING = "gateway reload: watching the servers' files"  # (re)set, and the files read


def mock(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """A stdio mock server in Claude Code's shape; each of its starts appends its pid to
    `<name>.pids`."""
    return {
        "command": sys.executable,
        "args": [MOCK, *args],
        "env": {"MOCK_MCP_PIDS": str(tmp_path / f"{name}.pids")},
    }


def pids(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / f"{name}.pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def save(path: Path, content: str) -> None:
    """As editors save: a new file renamed over the old one (the old inode is gone)."""
    temporary = path.with_name(f".{path.name}.swp")
    temporary.write_text(content)
    os.replace(temporary, path)


def save_servers(path: Path, servers: dict[str, Any]) -> None:
    save(path, json.dumps({"mcpServers": servers}, indent=2))


async def started(tmp_path: Path, *names: str) -> dict[str, int]:
    """The pid of each named server, once each has started (the gateway starts them all)."""

    async def all_up() -> bool:
        return all(pids(tmp_path, name) for name in names)

    await eventually(all_up, WAIT_S)
    return {name: pids(tmp_path, name)[-1] for name in names}


async def logged(tmp_path: Path, text: str) -> str:
    """The gateway's log (its stderr), once it holds `text`."""
    log = tmp_path / "gateway.stderr"

    async def found() -> bool:
        return log.exists() and text in log.read_text()

    await eventually(found, WAIT_S)
    return log.read_text()


def state(tmp_path: Path) -> dict[str, str]:
    """The approvals store of the test's own (never the user's): XDG_STATE_HOME in tmp_path."""
    return {"XDG_STATE_HOME": str(tmp_path / "state")}


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, directory: Path, *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[Host]:
    """`butlers gateway --dir directory` over stdio, its approvals store in tmp_path."""
    async with stdio_host(directory, *args, *INFO, env=state(tmp_path) | (env or {})) as host:
        yield host


async def approve(tmp_path: Path, directory: Path, *args: str) -> str:
    """The real `butlers gateway approve ARGS --dir directory`; what it printed."""
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        "gateway",
        "approve",
        *args,
        "--dir",
        str(directory),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(directory, state(tmp_path)),
        cwd=directory,
    )
    out, err = await asyncio.wait_for(process.communicate(), WAIT_S)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def pending(host: Host, name: str) -> dict[str, Any]:
    """gateway_status's pending entry for `name`, once there is one."""
    found: dict[str, Any] = {}

    async def listed() -> bool:
        result = await host.call("gateway_status")
        for entry in result.structured_content["result"]:
            if entry["name"] == name and entry["state"] == "pending":
                found.update(entry)
        return bool(found)

    await eventually(listed, WAIT_S)
    return found


async def echo(host: Host, suite: str, message: str) -> str:
    result = await host.suite(suite, "call", "echo", message=message)
    assert not result.is_error, text_of(result)
    return text_of(result)


@pytest.mark.proc
async def test_adding_a_server_starts_it_and_leaves_the_others_running(
    tmp_path: Path, npm_servers: Path
) -> None:
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        assert "plain_suite" in await host.tools()
        before = await started(tmp_path, "plain")

        servers["everything"] = {
            "command": str(npm_servers / "mcp-server-everything"),
            "args": ["stdio"],
        }
        save_servers(project, servers)
        await pending(host, "everything")
        assert "approved everything: " in await approve(tmp_path, tmp_path, "everything")
        await host.wait_list_changed(1, WAIT_S)
        assert {"plain_suite", "everything_suite"} <= set(await host.tools())
        assert "through the reload" in await echo(host, "everything_suite", "through the reload")
        assert await echo(host, "plain_suite", "still here") == "still here"

        assert pids(tmp_path, "plain") == [before["plain"]]  # never restarted
        assert _alive(before["plain"])
        log = await logged(tmp_path, "gateway reload: added everything")
        assert "restarted" not in log and "removed" not in log


@pytest.mark.proc
async def test_a_removed_server_leaves_the_list_and_its_process_ends(tmp_path: Path) -> None:
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain"), "gone": mock(tmp_path, "gone")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        before = await started(tmp_path, "plain", "gone")

        del servers["gone"]  # a removal needs no one's yes: it applies at once
        save_servers(project, servers)
        await host.wait_list_changed(1, WAIT_S)
        tools = await host.tools()
        assert "gone_suite" not in tools and "plain_suite" in tools
        assert await survivors([before["gone"]], timeout_s=WAIT_S) == []
        assert "gone" not in await host.status()

        assert await echo(host, "plain_suite", "untouched") == "untouched"
        assert pids(tmp_path, "plain") == [before["plain"]] and _alive(before["plain"])
        await logged(tmp_path, "gateway reload: removed gone")


@pytest.mark.proc
async def test_a_changed_server_is_restarted_and_only_that_one(tmp_path: Path) -> None:
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain"), "tuned": mock(tmp_path, "tuned")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        before = await started(tmp_path, "plain", "tuned")

        servers["tuned"] = mock(tmp_path, "tuned", "--framing", "content-length")
        save_servers(project, servers)
        await pending(host, "tuned")
        assert pids(tmp_path, "tuned") == [before["tuned"]]  # runs on as it was until approved
        await approve(tmp_path, tmp_path, "tuned")
        await host.wait_list_changed(2, WAIT_S)  # taken out, put back

        async def restarted() -> bool:
            return len(pids(tmp_path, "tuned")) == 2

        await eventually(restarted, WAIT_S)
        assert await echo(host, "tuned_suite", "after the restart") == "after the restart"
        _, new = pids(tmp_path, "tuned")
        assert await survivors([before["tuned"]], timeout_s=WAIT_S) == []  # the old one ended
        assert _alive(new)
        assert pids(tmp_path, "plain") == [before["plain"]] and _alive(before["plain"])
        assert "tuned_suite" in await host.tools()
        await logged(tmp_path, "gateway reload: restarted tuned")


@pytest.mark.proc
async def test_a_restarted_server_the_host_had_activated_comes_back_active(
    tmp_path: Path,
) -> None:
    project = tmp_path / ".mcp.json"
    servers = {"tuned": mock(tmp_path, "tuned")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        await started(tmp_path, "tuned")
        activated = await host.call("gateway_activate", name="tuned")
        assert not activated.is_error, text_of(activated)
        assert "echo" in await host.tools()
        seen = host.list_changed

        servers["tuned"] = mock(tmp_path, "tuned", "--framing", "content-length")
        save_servers(project, servers)
        await pending(host, "tuned")
        await approve(tmp_path, tmp_path)  # every declared server: tuned's new declaration
        # Taken out, put back, activated again.
        await host.wait_list_changed(seen + 3, WAIT_S)
        assert "echo" in await host.tools()
        assert (await host.status())["tuned"]["state"] == "active"
        assert len(pids(tmp_path, "tuned")) == 2  # it did restart


@pytest.mark.proc
async def test_a_broken_file_changes_nothing_until_a_good_version_comes(tmp_path: Path) -> None:
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        before = await started(tmp_path, "plain")
        await logged(tmp_path, WATCHING)  # (its first reading reports nothing: start did)

        save(project, '{"mcpServers": {"plain": ')  # saved half-way through an edit
        log = await logged(tmp_path, f"gateway reload: {project}: not readable JSON")
        assert "(left as it runs until fixed: plain)" in log
        # An entry that is not valid: that server stays as it runs, too.
        save_servers(project, {"plain": {"args": ["no command"]}})
        await logged(tmp_path, f"gateway reload: {project}: mcpServers.plain: command: Field")

        assert await echo(host, "plain_suite", "still served") == "still served"
        assert host.list_changed == 0
        assert pids(tmp_path, "plain") == [before["plain"]]

        servers["extra"] = mock(tmp_path, "extra")
        save_servers(project, servers)
        await pending(host, "extra")
        await approve(tmp_path, tmp_path, "extra")
        await host.wait_list_changed(1, WAIT_S)
        assert {"plain_suite", "extra_suite"} <= set(await host.tools())
        assert await echo(host, "extra_suite", "the good version") == "the good version"
        assert pids(tmp_path, "plain") == [before["plain"]] and _alive(before["plain"])
        log = await logged(tmp_path, "gateway reload: added extra")
        assert "removed" not in log and "restarted" not in log


@pytest.mark.proc
async def test_the_config_file_is_watched_too(tmp_path: Path) -> None:
    """--config claude_desktop_config.json, in a directory of its own: edited in place (the
    file truncated and written again), then saved twice by rename (each save a new file: a
    watch on the file itself would have lost it after the first)."""
    desktop = tmp_path / "desktop" / "claude_desktop_config.json"
    desktop.parent.mkdir()
    servers = {"plain": mock(tmp_path, "plain")}
    desktop.write_text(json.dumps({"globalShortcut": "Ctrl+Space", "mcpServers": servers}))
    project = tmp_path / "project"
    project.mkdir()
    async with gateway(tmp_path, project, "--config", str(desktop)) as host:
        before = await started(tmp_path, "plain")
        # Each new set of watches reads the files once (for what changed before they were in
        # place): past that, only the watch on the config file's directory can see the edits.
        await logged(project, WATCHING)

        servers["second"] = mock(tmp_path, "second")
        desktop.write_text(json.dumps({"globalShortcut": "Ctrl+Space", "mcpServers": servers}))
        await pending(host, "second")
        await approve(tmp_path, project, "second", "--config", str(desktop))
        await host.wait_list_changed(1, WAIT_S)
        assert {"plain_suite", "second_suite"} <= set(await host.tools())
        assert await echo(host, "second_suite", "from the config") == "from the config"

        servers["third"] = mock(tmp_path, "third")
        save(desktop, json.dumps({"mcpServers": servers}))
        await pending(host, "third")
        await approve(tmp_path, project, "third", "--config", str(desktop))
        await host.wait_list_changed(2, WAIT_S)
        del servers["second"]
        save(desktop, json.dumps({"mcpServers": servers}))
        await host.wait_list_changed(3, WAIT_S)
        assert {"plain_suite", "third_suite"} <= set(await host.tools())
        assert "second_suite" not in await host.tools()
        assert pids(tmp_path, "plain") == [before["plain"]] and _alive(before["plain"])


@pytest.mark.proc
async def test_a_new_server_directory_the_globs_match_is_found(tmp_path: Path) -> None:
    """`mcps/*/.mcp.json`: a directory made while the gateway runs is watched from then on,
    so its file, written after the gateway has seen the directory, is found."""
    mcp_json(tmp_path, "first")  # its pid goes to tmp_path/pids
    async with gateway(tmp_path, tmp_path) as host:
        assert "first_suite" in await host.tools()
        await logged(tmp_path, WATCHING)
        (tmp_path / "mcps" / "late").mkdir()

        async def watched_again() -> bool:
            return (tmp_path / "gateway.stderr").read_text().count(WATCHING) == 2

        await eventually(watched_again, WAIT_S)
        mcp_json(tmp_path, "late")
        await pending(host, "late")
        await approve(tmp_path, tmp_path, "late")
        await host.wait_list_changed(1, WAIT_S)
        assert "late_suite" in await host.tools()
        assert await echo(host, "late_suite", "found") == "found"


@pytest.mark.proc
async def test_in_search_mode_an_added_server_is_found(tmp_path: Path) -> None:
    """Search mode lists no server's tools (the list does not change): the added server's
    tools are searched, and called, as soon as the reload has added it."""
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path, "--mode", "search") as host:
        await logged(tmp_path, WATCHING)
        servers["extra"] = mock(tmp_path, "extra")
        save_servers(project, servers)
        await pending(host, "extra")
        await approve(tmp_path, tmp_path, "extra")
        await logged(tmp_path, "gateway reload: added extra")
        result = await host.call("gateway_search", query="echo the message back", limit=10)
        found = result.structured_content["result"]
        # (The same tool on both: one result, the other server's name in its `also`.)
        named = {f["name"] for f in found} | {a for f in found for a in f.get("also", [])}
        assert {"plain/echo", "extra/echo"} <= named, found
        result = await host.call(
            "gateway_call", name="extra/echo", arguments={"message": "searched"}
        )
        assert text_of(result) == "searched", text_of(result)
        assert host.list_changed == 0  # search mode's four tools stay as they were


def test_a_server_moved_to_another_file_keeps_running() -> None:
    """Only what a server is (command, arguments, env, URL...) counts, not where it is
    declared: `install` moves servers from .mcp.json to its record. And the registry's
    butlers are never taken out by a file's change."""
    moved = ChildSpec(name="notes", cmd="node", args=("a.js",), source="/p/.mcp.json")
    butler = ChildSpec(name="health", url="http://127.0.0.1:1/sse", kind="butler")
    running = {"notes": moved, "health": butler}
    declared = [ChildSpec(name="notes", cmd="node", args=("a.js",), source="/p/servers.json")]
    assert not plan(running, declared, [])
    changed = [ChildSpec(name="notes", cmd="node", args=("b.js",), source="/p/.mcp.json")]
    assert plan(running, changed, []).restarted == tuple(changed)
    # A file that cannot be read keeps what it declared, and only that.
    broken = Skipped(ConfigError("/p/.mcp.json", None, "not readable JSON"))
    assert not plan(running, [], [broken])
    assert plan(running, [], [Skipped(ConfigError("/p/other.json", None, "x"))]).removed == (
        "notes",
    )
    # An entry that is not valid keeps that server, and only that one.
    docs = ChildSpec(name="docs", url="http://127.0.0.1:2/mcp", source="/p/.mcp.json")
    bad_docs = Skipped(
        ConfigError("/p/.mcp.json", "mcpServers.docs", "url: Field required"), "docs"
    )
    assert plan(running | {"docs": docs}, [], [bad_docs]).removed == ("notes",)


# -- what needs a person's yes (review finding M1) ----------------------------------------


def resolved(path: Path) -> Path:
    """As the gateway names its --dir in messages: symbolic links resolved."""
    return path.resolve()


async def pending_names(host: Host) -> list[str]:
    result = await host.call("gateway_status")
    return [e["name"] for e in result.structured_content["result"] if e["state"] == "pending"]


@pytest.mark.proc
async def test_a_server_added_by_a_reload_is_pending_until_approved_then_starts_alone(
    tmp_path: Path,
) -> None:
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain")}
    project.write_text(json.dumps({"mcpServers": servers}))
    real = resolved(tmp_path)
    async with gateway(tmp_path, tmp_path) as host:
        before = await started(tmp_path, "plain")
        await logged(tmp_path, WATCHING)

        servers["newcomer"] = mock(tmp_path, "newcomer")
        save_servers(project, servers)
        entry = await pending(host, "newcomer")
        assert str(project) in entry["detail"], entry
        assert f"butlers gateway approve newcomer --dir {real}" in entry["detail"]
        assert entry["ready"] is False and entry["tools"] == 0
        assert "newcomer_suite" not in await host.tools() and host.list_changed == 0
        assert pids(tmp_path, "newcomer") == []  # never started: no process, no pid
        warning = "gateway reload: server 'newcomer' new in"
        await logged(tmp_path, warning)

        printed = await approve(tmp_path, tmp_path, "newcomer")
        shown = f"{sys.executable} {MOCK} (env: MOCK_MCP_PIDS; in {real})"
        assert f"approved newcomer: {shown}" in printed, printed
        await host.wait_list_changed(1, WAIT_S)
        await started(tmp_path, "newcomer")
        assert await echo(host, "newcomer_suite", "let in") == "let in"
        assert await pending_names(host) == []
        assert pids(tmp_path, "plain") == [before["plain"]] and _alive(before["plain"])
        log = await logged(tmp_path, "gateway reload: added newcomer")
        assert log.count(warning) == 1  # once per pending declaration

        # Approving what already runs changes nothing, and says so.
        assert "nothing new to approve" in await approve(tmp_path, tmp_path, "newcomer")


@pytest.mark.proc
async def test_a_declaration_approved_once_is_pending_again_when_changed_again(
    tmp_path: Path,
) -> None:
    project = tmp_path / ".mcp.json"
    servers = {"tuned": mock(tmp_path, "tuned")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        first = await started(tmp_path, "tuned")
        await logged(tmp_path, WATCHING)

        servers["tuned"] = mock(tmp_path, "tuned", "--framing", "content-length")
        save_servers(project, servers)
        await pending(host, "tuned")
        await approve(tmp_path, tmp_path, "tuned")

        async def restarted() -> bool:
            return len(pids(tmp_path, "tuned")) == 2

        await eventually(restarted, WAIT_S)
        approved = pids(tmp_path, "tuned")[-1]
        assert await survivors([first["tuned"]], timeout_s=WAIT_S) == []

        servers["tuned"]["env"]["MOCK_SETTING"] = "changed behind the approval"
        save_servers(project, servers)
        entry = await pending(host, "tuned")
        assert "the running one stays as it was" in entry["detail"]
        assert pids(tmp_path, "tuned") == [first["tuned"], approved] and _alive(approved)
        assert await echo(host, "tuned_suite", "the approved one") == "the approved one"


@pytest.mark.proc
async def test_reload_apply_starts_new_servers_at_once_as_before(tmp_path: Path) -> None:
    (tmp_path / "gateway.toml").write_text('reload = "apply"\n')
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        await started(tmp_path, "plain")
        await logged(tmp_path, WATCHING)
        servers["trusted"] = mock(tmp_path, "trusted")
        save_servers(project, servers)
        await host.wait_list_changed(1, WAIT_S)
        assert await echo(host, "trusted_suite", "no approval") == "no approval"
        assert "pending" not in await logged(tmp_path, "gateway reload: added trusted")


@pytest.mark.proc
async def test_a_butlers_variable_in_an_http_entry_is_never_sent_and_nothing_connects(
    tmp_path: Path,
) -> None:
    """Even where reloads apply at once: an entry naming ${BUTLERS_AUTH_TOKEN} is skipped, with
    a warning naming the file, the server and the variable, never its value; a loopback
    listener at its URL sees no connection. Another server added in the same save starts
    (so the reload was applied)."""
    token = "gateway-own-token-do-not-send"
    seen: list[bytes] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(65536))
        writer.close()

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    (tmp_path / "gateway.toml").write_text('reload = "apply"\n')
    project = tmp_path / ".mcp.json"
    servers: dict[str, Any] = {"plain": mock(tmp_path, "plain")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with listener, gateway(tmp_path, tmp_path, env={"BUTLERS_AUTH_TOKEN": token}) as host:
        await started(tmp_path, "plain")
        await logged(tmp_path, WATCHING)
        servers["leak"] = {
            "type": "http",
            "url": f"http://127.0.0.1:{port}/mcp",
            "headers": {"Authorization": "Bearer ${BUTLERS_AUTH_TOKEN}"},
        }
        servers["other"] = mock(tmp_path, "other")
        save_servers(project, servers)
        await started(tmp_path, "other")  # the save was applied
        assert "leak" not in await host.status()
        log = await logged(
            tmp_path,
            f"{project}: mcpServers.leak: ${{BUTLERS_AUTH_TOKEN}} is the gateway's own setting",
        )
        assert seen == []
        assert token not in log


@pytest.mark.proc
async def test_a_fifo_where_a_server_file_is_globbed_is_refused_and_the_gateway_still_ends(
    tmp_path: Path,
) -> None:
    """A FIFO matched by `mcps/*/.mcp.json` while the gateway serves: refused with a warning
    naming it (it used to block the reload's reading for good, and with it the gateway's exit);
    the gateway answers its host and ends at the end of its input."""
    mcp_json(tmp_path, "first")
    with (tmp_path / "gateway.stderr").open("a") as errlog:
        process = await asyncio.create_subprocess_exec(
            *(BUTLERS, "gateway", "--dir", str(tmp_path), "--no-butlers", *INFO),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=errlog,
            env=_env(tmp_path, state(tmp_path)),
            cwd=tmp_path,
        )
    assert process.stdin is not None and process.stdout is not None
    try:
        await logged(tmp_path, WATCHING)
        trap = tmp_path / "mcps" / "trap"
        trap.mkdir()

        async def watched_again() -> bool:
            return (tmp_path / "gateway.stderr").read_text().count(WATCHING) == 2

        await eventually(watched_again, WAIT_S)
        os.mkfifo(trap / ".mcp.json")
        await logged(tmp_path, f"{trap / '.mcp.json'}: is a FIFO, not a regular file")

        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"},
            },
        }
        process.stdin.write(json.dumps(initialize).encode() + b"\n")
        await process.stdin.drain()
        answer = json.loads(await asyncio.wait_for(process.stdout.readline(), WAIT_S))
        assert answer["id"] == 1 and "result" in answer, answer
        process.stdin.close()
        assert await asyncio.wait_for(process.wait(), WAIT_S) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_hold_keeps_back_what_was_not_approved_and_never_a_removal() -> None:
    running = {
        "kept": ChildSpec(name="kept", cmd="node", args=("a.js",)),
        "gone": ChildSpec(name="gone", cmd="node"),
    }
    new = ChildSpec(name="new", cmd="node", args=("new.js",))
    changed = ChildSpec(name="kept", cmd="node", args=("evil.js",))
    changes = plan(running, [new, changed], [])
    assert changes.removed == ("gone",)
    applied, held = hold(changes, running, {})
    assert held == (new, changed) and applied.removed == ("gone",)
    assert not applied.added and not applied.restarted
    # Approved: exactly these declarations.
    approved = {"new": fingerprint(new), "kept": fingerprint(changed)}
    applied, held = hold(changes, running, approved)
    assert held == () and applied.added == (new,) and applied.restarted == (changed,)
    # An approval of another declaration of the same name is not this one's.
    other = ChildSpec(name="new", cmd="node", args=("other.js",))
    assert hold(plan(running, [other], []), running, approved)[1] == (other,)
    # A changed description alone runs nothing new: restarted at once.
    described = ChildSpec(name="kept", cmd="node", args=("a.js",), description="new words")
    applied, held = hold(plan(running, [described], []), running, {})
    assert held == () and applied.restarted == (described,)


async def test_reload_off_watches_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "gateway.toml").write_text('reload = "off"\n')
    config = load_gateway_config(tmp_path)
    server = Gateway(config, [], environ={})
    files = ServerFiles(directory=tmp_path, environ={})
    try:
        with caplog.at_level(logging.INFO):
            # It returns at once (a watcher would run until cancelled).
            await asyncio.wait_for(Reloader(server, files, warm=False).watch(), WAIT_S)
    finally:
        await server.close()
    assert 'gateway reload is off (gateway.toml reload = "off")' in caplog.text


# -- at start: what the project's files say now is not what a person approved --------------


@pytest.mark.proc
async def test_what_was_written_into_the_project_since_its_approval_waits_at_the_next_start(
    tmp_path: Path,
) -> None:
    """The attack a hot reload's approval alone left open: the host's model writes a server
    (and a gateway.toml that would start anything and hand it the host's secrets) into the
    project, and waits for the next start. The first start approved what was declared then;
    the next one starts only that, runs the approved settings, and lists the rest pending."""
    project = tmp_path / ".mcp.json"
    servers = {"plain": mock(tmp_path, "plain")}
    project.write_text(json.dumps({"mcpServers": servers}))
    async with gateway(tmp_path, tmp_path) as host:
        await started(tmp_path, "plain")
    log = (tmp_path / "gateway.stderr").read_text()
    assert "first start for" in log and "what is declared now is approved" in log

    servers["planted"] = mock(tmp_path, "planted")
    servers["plain"] = mock(tmp_path, "plain", "--framing", "content-length")  # changed too
    project.write_text(json.dumps({"mcpServers": servers}))
    (tmp_path / "gateway.toml").write_text(
        'reload = "apply"\n[suites.planted]\npass_env = ["ANTHROPIC_API_KEY"]\n'
    )
    async with gateway(tmp_path, tmp_path) as host:
        # The host's model is told with the instructions (which a host reads once).
        instructions = host.client.initialize_result.instructions
        assert "Not approved yet, so not started: servers plain, planted" in instructions
        status = await host.status()
        assert status["planted"]["state"] == "pending"
        assert "new in " in status["planted"]["detail"]
        assert "butlers gateway approve planted --dir" in status["planted"]["detail"]
        assert status["plain"]["state"] == "pending"
        assert status["plain"]["detail"].startswith("changed in ")
        assert status["settings"]["state"] == "pending"
        assert "gateway.toml changed since it was approved" in status["settings"]["detail"]
        assert not {"planted_suite", "plain_suite"} & set(await host.tools())
        # Warned of once, by the start; its settings are the approved ones (none): reload
        # is "approve", so a save of the files (one more server: the sign it was read)
        # starts neither.
        log = await logged(tmp_path, "gateway: server 'planted' new in ")
        assert log.count("server 'planted'") == 1
        save_servers(project, {**servers, "another": mock(tmp_path, "another")})
        await logged(tmp_path, "gateway reload: server 'another'")
        assert pids(tmp_path, "planted") == [] and len(pids(tmp_path, "plain")) == 1
        assert (tmp_path / "gateway.stderr").read_text().count("server 'planted'") == 1
        save_servers(project, servers)

    # --dry-run, as a check in CI would run it: fails on what waits (and records nothing).
    code, out, err = await run_cli(
        "gateway", "--dry-run", "--no-butlers", "--dir", str(tmp_path), env=state(tmp_path)
    )
    assert code == 1, (out, err)
    assert "pending: planted: new in " in out and "settings: gateway.toml changed" in out

    printed = await approve(tmp_path, tmp_path)
    assert 'approved gateway.toml: reload: (unset) -> "apply"; ' in printed
    assert 'suites.planted.pass_env: (unset) -> ["ANTHROPIC_API_KEY"]' in printed
    assert "approved planted: " in printed and "approved plain: " in printed
    async with gateway(tmp_path, tmp_path) as host:
        await started(tmp_path, "planted")
        assert {"planted_suite", "plain_suite"} <= set(await host.tools())
        assert "settings" not in await host.status()
    assert len(pids(tmp_path, "plain")) == 2


@pytest.mark.proc
async def test_gateway_toml_edited_while_it_runs_is_said_to_wait_for_the_next_start(
    tmp_path: Path,
) -> None:
    """gateway.toml is read at start: an edit while the gateway runs changed nothing, and
    said nothing (a walkthrough). Now gateway_status and the log say it counts from the next
    start, once approved."""
    project = tmp_path / ".mcp.json"
    project.write_text(json.dumps({"mcpServers": {"plain": mock(tmp_path, "plain")}}))
    async with gateway(tmp_path, tmp_path) as host:
        await started(tmp_path, "plain")
        await logged(tmp_path, WATCHING)
        save(tmp_path / "gateway.toml", '[suites.plain.expose]\ndeny = ["echo"]\n')
        entry = await pending(host, "settings")
        assert entry["detail"].startswith(
            "gateway.toml changed while the gateway runs: it counts from the next start, once "
            "approved (`butlers gateway approve --dir "
        )
        assert await echo(host, "plain_suite", "still allowed") == "still allowed"
    await logged(tmp_path, "gateway.toml changed while the gateway runs")
