"""`butlers gateway install` / `uninstall`: Claude Code's project `.mcp.json` (then the very
command Claude Code would run), Claude Desktop's config, and Claude Code's user scope through
the bundled `claude` binary (re-registered when the project or venv it named moved, never over
a `butlers` server we did not register); originals back byte for byte, never over the user's
edits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from butlers.gateway.install import SKILL, SKILL_TEXT, claude_binary, stale_user_registration
from tests.conftest import StartButler
from tests.test_cli import BUTLERS
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


@contextlib.asynccontextmanager
async def as_the_host_starts(server: dict, project: Path) -> AsyncIterator[ClientSession]:
    """An MCP session with the command an installed host file names, started from the
    project as the host starts it (no butlers behind it, none of our BUTLERS_* settings)."""
    params = StdioServerParameters(
        command=server["command"],
        args=[*server["args"], "--no-butlers"],
        env={k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")},
        cwd=str(project),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        yield client


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
    # Out of git: the record holds a copy of the host's config (its env values).
    await asyncio.to_thread(subprocess.run, ["git", "init", "-q", str(project)], check=True)
    for path in (record / "original.json", record / "servers.json"):
        ignored = await asyncio.to_thread(
            subprocess.run, ["git", "-C", str(project), "check-ignore", "-q", str(path)]
        )
        assert ignored.returncode == 0, path
    shutil.rmtree(project / ".git")

    code, out, err = await run_cli("gateway", "install", "--dir", str(project))
    assert code == 0, err
    assert "already installed, nothing changed" in out and mcp_json.read_bytes() == written

    # What Claude Code does with the file: start that command from the project.
    async with as_the_host_starts(server, project) as client:
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
    # Saved again by an editor that leaves out the final newline: not an edit (a walkthrough).
    mcp_json.write_bytes(written.rstrip())
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


# Claude Code's user config as a person's looks after a while: keys of its own, another
# server, two-space and four-space indents, no final newline.
USER_CONFIG = (
    '{\n  "numStartups": 7,\n    "theme": "dark",\n  "mcpServers": {"other": '
    '{"command": "npx", "args": ["-y", "other-server"]}},\n  "projects": {}\n}'
)


def _claude_user_env(home: Path) -> dict[str, str]:
    """Claude Code's user scope inside `home` (never the machine's own ~/.claude.json)."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def _registered(config: Path) -> dict:
    """The `butlers` entry of Claude Code's user config (KeyError: none)."""
    return json.loads(config.read_text())["mcpServers"]["butlers"]


def _project_with_notes(project: Path) -> Path:
    """A project whose .mcp.json has one server, `notes`, for the gateway to serve."""
    project.mkdir()
    (project / ".mcp.json").write_text(
        json.dumps({"mcpServers": {"notes": {"command": sys.executable, "args": [MOCK]}}})
    )
    return project


async def _notes_tools(server: dict, project: Path) -> set[str]:
    async with as_the_host_starts(server, project) as client:
        return {t.name for t in (await client.list_tools()).tools}


@pytest.mark.claude  # runs the real Claude Code binary (its `mcp add` / `mcp remove`)
async def test_user_scope_follows_a_moved_project_and_uninstall_keeps_what_changed_between(
    tmp_path: Path,
) -> None:
    """Installed at user scope from A; the user then removes a server holding an old key with
    `claude mcp remove`; A is renamed B, so the registered command no longer starts.
    Installing from B re-registers it (saying so), and the command then serves B's servers.
    Uninstall from B gives back the config as it was just before the re-registration (our
    entry removed), not the copy from the first install: the removed server and its key do
    not come back (review M3). Installing twice from one place changes nothing."""
    home = tmp_path / "home"
    env = _claude_user_env(home)
    config = home / ".claude" / ".claude.json"
    config.parent.mkdir(parents=True)
    with_leaky = json.loads(USER_CONFIG)
    with_leaky["mcpServers"]["leaky"] = {"command": "npx", "env": {"API_KEY": "sk-OLD-key"}}
    config.write_text(json.dumps(with_leaky, indent=2))
    first_original = config.read_text()
    first, moved = tmp_path / "first", tmp_path / "moved"
    _project_with_notes(first)
    assert claude_binary(os.environ) is not None  # the SDK bundles one

    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(first), env=env
    )
    assert code == 0, err
    assert "`claude mcp add -s user butlers -- " in out
    assert _registered(config)["args"] == ["gateway", "--dir", str(first)]
    assert (home / SKILL).is_file()
    record = home / ".claude" / ".butlers-gateway" / "claude-code-user"
    assert (record / "original.json").read_text() == first_original
    # Claude Code's user config may hold API keys (servers' env, the account): so may its copy.
    assert record.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in record.iterdir()} == {0o600}
    registered = config.read_bytes()
    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(first), env=env
    )
    assert code == 0, err
    assert out == f"{config}: `butlers` already registered, nothing changed\n"
    assert config.read_bytes() == registered  # no second entry, nothing rewritten

    assert stale_user_registration(env) is None
    claude = claude_binary(os.environ)
    assert claude is not None
    removed = await _butlers_in(
        tmp_path, "mcp", "remove", "-s", "user", "leaky", env=env, program=[claude]
    )
    assert removed[0] == 0, removed[1]
    assert "sk-OLD-key" not in config.read_text()
    os.rename(first, moved)
    stale = stale_user_registration(env)  # what a health check can ask, without a `claude` run
    assert stale is not None and (stale.config, stale.gone) == (config, [str(first)])
    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(moved), env=env
    )
    assert code == 0, err
    assert out.splitlines()[0] == (
        f"re-registered: the gateway was installed from {first}, which moved; now {moved}"
    )
    server = _registered(config)
    assert server["args"] == ["gateway", "--dir", str(moved)]
    assert list(json.loads(config.read_text())["mcpServers"]) == ["other", "butlers"]
    assert stale_user_registration(env) is None
    # What Claude Code does with it in any project: start that command.
    assert "notes_suite" in await _notes_tools(server, moved)

    assert "sk-OLD-key" not in (record / "original.json").read_text()
    code, out, err = await run_cli(
        "gateway", "uninstall", "--scope", "user", "--dir", str(moved), env=env
    )
    assert code == 0, err
    assert f"{config}: the original is back" in out
    given_back = json.loads(config.read_text())
    assert "sk-OLD-key" not in config.read_text()  # the removed server stays removed
    assert given_back["mcpServers"] == json.loads(USER_CONFIG)["mcpServers"]
    assert given_back["numStartups"] == 7  # Claude Code's own keys, as it left them
    assert not (home / ".claude" / ".butlers-gateway").exists()
    assert not (home / SKILL).exists()


@pytest.mark.claude
async def test_user_scope_puts_the_skill_where_claude_code_reads_it(tmp_path: Path) -> None:
    """With CLAUDE_CONFIG_DIR set, Claude Code reads a user's skills from it: the skill went
    to ~/.claude, where Claude Code never saw it (a walkthrough)."""
    home = tmp_path / "home"
    env = {**_claude_user_env(home), "CLAUDE_CONFIG_DIR": str(tmp_path / "ccd")}
    project = _project_with_notes(tmp_path / "project")
    code, _, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(project), env=env
    )
    assert code == 0, err
    skill = tmp_path / "ccd" / "skills" / "butlers-gateway" / "SKILL.md"
    assert skill.is_file() and not (home / SKILL).exists()
    code, _, err = await run_cli("gateway", "uninstall", "--scope", "user", env=env)
    assert code == 0, err
    assert not (tmp_path / "ccd" / "skills").exists() and (tmp_path / "ccd").is_dir()


async def test_user_scope_follows_a_venv_rebuilt_elsewhere(tmp_path: Path) -> None:
    """The program the registration runs is gone (the venv was moved or rebuilt elsewhere):
    installing with the new one re-registers the gateway with it. Here a venv made of links to
    this one, so that it can be moved; its `python -m butlers` is what install registers."""
    home = tmp_path / "home"
    env = _claude_user_env(home)
    config = home / ".claude" / ".claude.json"
    project = _project_with_notes(tmp_path / "project")
    old, new = tmp_path / "old-venv", tmp_path / "new-venv"
    (old / "bin").mkdir(parents=True)
    venv = Path(sys.prefix)
    (old / "pyvenv.cfg").write_bytes((venv / "pyvenv.cfg").read_bytes())
    (old / "bin" / "python").symlink_to(sys.executable)
    (old / "lib").symlink_to(venv / "lib")

    async def install(python: Path) -> tuple[int, str]:
        return await _butlers_in(
            tmp_path,
            "gateway",
            "install",
            "--scope",
            "user",
            "--dir",
            str(project),
            env=env,
            program=[str(python), "-m", "butlers"],
        )

    code, out = await install(old / "bin" / "python")
    assert code == 0, out
    assert _registered(config)["command"] == str(old / "bin" / "python")
    os.rename(old, new)
    code, out = await install(new / "bin" / "python")
    assert code == 0, out
    assert out.splitlines()[0] == (
        f"re-registered: the gateway was installed from {old / 'bin' / 'python'}, which "
        f"moved; now {new / 'bin' / 'python'}"
    )
    server = _registered(config)
    assert server["command"] == str(new / "bin" / "python")
    assert "notes_suite" in await _notes_tools(server, project)
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--scope", "user", env=env)
    assert code == 0, out
    # Given back as it was just before the re-registration: Claude Code's own state, which it
    # wrote at the first `claude mcp add`, stays; no `butlers` server.
    assert f"{config}: the original is back" in out
    assert json.loads(config.read_text()).get("mcpServers", {}) == {}


@pytest.mark.claude
async def test_user_scope_keeps_a_live_registration_and_the_owners_later_changes(
    tmp_path: Path,
) -> None:
    """Installing from a second project while the first is still there refuses (the
    registration is the first one's, and it still starts). Once Claude Code has changed its
    user config (it keeps its own state there), uninstall removes only our entry."""
    home = tmp_path / "home"
    env = _claude_user_env(home)
    config = home / ".claude" / ".claude.json"
    config.parent.mkdir(parents=True)
    config.write_text(USER_CONFIG)
    first = _project_with_notes(tmp_path / "first")
    second = _project_with_notes(tmp_path / "second")
    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(first), env=env
    )
    assert code == 0, err
    registered = config.read_bytes()
    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(second), env=env
    )
    assert code == 1
    assert err.startswith(f"error: {config}: the gateway is registered from {first} ("), err
    assert "run `butlers gateway uninstall --scope user` first" in err
    assert config.read_bytes() == registered

    changed = json.loads(config.read_text())
    changed["numStartups"] = 8  # what Claude Code does each time it starts
    config.write_text(json.dumps(changed, indent=2))
    code, out, err = await run_cli("gateway", "uninstall", "--scope", "user", env=env)
    assert code == 0, err
    assert "changed since install" in out and "only `butlers` was removed" in out
    left = json.loads(config.read_text())
    assert left["numStartups"] == 8 and list(left["mcpServers"]) == ["other"]
    assert not (home / ".claude" / ".butlers-gateway").exists()
    left_bytes = config.read_bytes()
    code, out, err = await run_cli("gateway", "uninstall", "--scope", "user", env=env)
    assert code == 0, err
    assert out == f"{config}: no `butlers` server registered, nothing to do\n"
    assert config.read_bytes() == left_bytes


@pytest.mark.parametrize(
    "entry",
    [
        {"command": "/opt/tools/bin/butlers-mcp", "args": ["--stdio", "--token", "sk-live-1"]},
        # A gateway's, but not one this install registered (no record of it): its paths are
        # gone, yet it is not ours to replace.
        {"command": "/gone/venv/bin/butlers", "args": ["gateway", "--dir", "/gone/project"]},
    ],
    ids=["another-server", "a-gateway-without-our-record"],
)
async def test_user_scope_never_replaces_a_butlers_server_it_did_not_register(
    tmp_path: Path, entry: dict
) -> None:
    home = tmp_path / "home"
    env = _claude_user_env(home)
    config = home / ".claude" / ".claude.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"mcpServers": {"butlers": entry}}))
    project = _project_with_notes(tmp_path / "project")
    before = _tree(home)
    code, _, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(project), env=env
    )
    assert code == 1
    assert err.startswith(
        f"error: {config}: Claude Code's user scope already has an MCP server `butlers` ("
    ), err
    assert "that `butlers gateway install` did not register" in err and "Traceback" not in err
    # Named by its command alone: its arguments may hold a key (review L8).
    assert f"(command {entry['command']})" in err and entry["args"][-1] not in err
    assert _tree(home) == before
    if entry["args"][0] != "gateway":
        code, _, err = await run_cli("gateway", "uninstall", "--scope", "user", env=env)
        assert code == 1
        assert (
            err.startswith(f"error: {config}: its `butlers` server (") and "not removing it" in err
        )
        assert "sk-live-1" not in err
        assert _tree(home) == before


@pytest.mark.claude
@pytest.mark.parametrize(
    ("variables", "claude_writes"),
    [
        ({}, ".claude/.config.json"),
        ({"CLAUDE_CONFIG_DIR": ""}, ".claude.json"),
        (
            {
                "CLAUDE_CONFIG_DIR": "{home}/cc",
                "CLAUDE_CODE_CUSTOM_OAUTH_URL": "http://127.0.0.1:9",
            },
            "cc/.claude-custom-oauth.json",
        ),
    ],
    ids=["older-file", "config-dir-empty", "custom-oauth"],
)
async def test_user_scope_uses_the_file_claude_code_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variables: dict, claude_writes: str
) -> None:
    """Which file is Claude Code's user config (measured with the bundled binary): the older
    `~/.claude/.config.json` when it is there, `~/.claude.json` is not and CLAUDE_CONFIG_DIR
    is unset; with CLAUDE_CONFIG_DIR set, even empty, `.claude.json` in it (or in the home);
    `.claude-custom-oauth.json` with a custom OAuth URL. Install reads, keeps and gives back
    the very file Claude Code wrote."""
    for name in ("CLAUDE_CONFIG_DIR", "CLAUDE_CODE_CUSTOM_OAUTH_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    env = _claude_user_env(home)
    del env["CLAUDE_CONFIG_DIR"]
    env.update({k: v.format(home=home) for k, v in variables.items()})
    legacy = home / ".claude" / ".config.json"
    legacy.parent.mkdir(parents=True)
    legacy.write_text(USER_CONFIG)
    written = home / claude_writes
    project = _project_with_notes(tmp_path / "project")
    # Run from a directory of the test's own: with CLAUDE_CONFIG_DIR empty Claude Code writes
    # its backups to `./backups` (seen in the checkout).
    code, out = await _butlers_in(
        tmp_path, "gateway", "install", "--scope", "user", "--dir", str(project), env=env
    )
    assert code == 0, out
    assert _registered(written)["args"] == ["gateway", "--dir", str(project)]
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--scope", "user", env=env)
    assert code == 0, out
    given_back = "the original is back" if written == legacy else "removed (there was none"
    assert f"{written}: {given_back}" in out
    assert legacy.read_text() == USER_CONFIG
    assert [p for p in home.rglob("*.json") if p != legacy] == []


async def _butlers_in(
    cwd: Path, *args: str, env: dict[str, str] | None = None, program: list[str] | None = None
) -> tuple[int, str]:
    """A real `butlers ...` (or `program ...`) run from `cwd` (so that `.` is a directory of
    the test's own); its exit code and everything it printed."""
    process = await asyncio.create_subprocess_exec(
        *(program or [BUTLERS]),
        *args,
        cwd=cwd,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")},
            **(env or {}),
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(60):
        out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode()


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a directory): what a command left."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in root.rglob("*")
    }


@pytest.mark.parametrize(
    "spelling",
    [
        ("gateway", "--dir", "{project}", "{action}"),
        ("gateway", "{action}", "--dir", "{project}"),
    ],
    ids=["dir-before-action", "dir-after-action"],
)
async def test_dir_before_or_after_install_means_the_same(
    tmp_path: Path, spelling: tuple[str, ...]
) -> None:
    """`butlers gateway --dir D install` installs into D, as `gateway install --dir D` does,
    not into the directory it runs from; uninstall the same."""
    project, cwd = tmp_path / "project", tmp_path / "cwd"
    project.mkdir()
    cwd.mkdir()
    (project / ".mcp.json").write_text(ORIGINAL)
    (cwd / ".mcp.json").write_text('{"mcpServers": {}}')
    before = _tree(cwd)

    def argv(action: str) -> list[str]:
        return [a.format(project=project, action=action) for a in spelling]

    code, out = await _butlers_in(cwd, *argv("install"))
    assert code == 0, out
    assert list(json.loads((project / ".mcp.json").read_text())["mcpServers"]) == ["butlers"]
    assert _tree(cwd) == before  # nothing written where it ran
    code, out = await _butlers_in(cwd, *argv("uninstall"))
    assert code == 0, out
    assert (project / ".mcp.json").read_text() == ORIGINAL
    assert _tree(cwd) == before


async def test_config_before_or_after_install_means_the_same(tmp_path: Path) -> None:
    """`--config FILE` (Claude Desktop's file) given before `install` is the file rewritten."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    for n, place in enumerate(("before", "after")):
        desktop = tmp_path / f"desktop-{place}.json"
        desktop.write_text('{"mcpServers": {"notes": {"command": "npx"}}}')
        project = tmp_path / f"project-{n}"
        project.mkdir()
        option = ["--config", str(desktop)]
        args = [*option, "install"] if place == "before" else ["install", *option]
        code, out = await _butlers_in(
            cwd,
            "gateway",
            "--dir",
            str(project),
            *args,
            "--host",
            "claude-desktop",
            env={"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")},
        )
        assert code == 0, out
        assert list(json.loads(desktop.read_text())["mcpServers"]) == ["butlers"], place
    assert not (home / ".config" / "Claude").exists()  # the default place was never used


async def _installed_project(tmp_path: Path) -> tuple[Path, Path]:
    """A project whose `.mcp.json` (ORIGINAL) the gateway was installed in front of: the
    project and its `.mcp.json`."""
    project = tmp_path / "project"
    project.mkdir()
    mcp_json = project / ".mcp.json"
    mcp_json.write_text(ORIGINAL)
    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 0, out
    return project, mcp_json


async def test_reinstall_over_an_edited_mcp_json_refuses_and_keeps_both(tmp_path: Path) -> None:
    """Installing again after the user edited the installed `.mcp.json` would take their
    edited file for the original (and lose the real original): it refuses, naming the file
    and what to do, and changes nothing."""
    project, mcp_json = await _installed_project(tmp_path)
    installed = json.loads(mcp_json.read_text())
    installed["mcpServers"]["added-later"] = {"command": "npx", "args": ["server-x"]}
    mcp_json.write_text(json.dumps(installed))
    before = _tree(project)

    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 1
    assert f"error: {mcp_json} changed since `butlers gateway install`" in out
    assert "run `butlers gateway uninstall` first" in out and "Traceback" not in out
    assert _tree(project) == before  # the edit and the kept original both intact
    original = project / ".butlers-gateway" / "claude-code" / "original.json"
    assert original.read_text() == ORIGINAL


async def test_an_install_undone_by_hand_as_uninstall_advises_is_not_stuck(
    tmp_path: Path,
) -> None:
    """Uninstall refuses over an edited `.mcp.json` and says how to put the original back;
    done so, uninstall clears the gateway's record and a later install works (both refused
    for ever before: "changed since install" / "edited since install")."""
    project, mcp_json = await _installed_project(tmp_path)
    mcp_json.write_text(mcp_json.read_text().replace("butlers", "butlers-edited"))
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    original = project / ".butlers-gateway" / "claude-code" / "original.json"
    assert code == 1 and f"put it back by hand (cp {original} {mcp_json})" in out, out

    shutil.copyfile(original, mcp_json)  # what the message says
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    assert code == 0, out
    assert "the original was already back; the gateway's record removed" in out
    assert mcp_json.read_text() == ORIGINAL and not (project / ".butlers-gateway").exists()

    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 0, out
    shutil.copyfile(original, mcp_json)  # undone by hand again: install starts afresh
    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 0, out
    assert list(json.loads(mcp_json.read_text())["mcpServers"]) == ["butlers"]
    assert original.read_text() == ORIGINAL


async def test_a_project_without_mcp_json_gets_one_and_uninstall_removes_it(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    mcp_json = project / ".mcp.json"
    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 0, out
    assert list(json.loads(mcp_json.read_text())["mcpServers"]) == ["butlers"]
    servers = project / ".butlers-gateway" / "claude-code" / "servers.json"
    assert json.loads(servers.read_text()) == {"mcpServers": {}}
    assert "original.absent" in out
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    assert code == 0, out
    assert f"{mcp_json}: removed (there was none before install)" in out
    # Nothing left: no file, and not the .claude/skills folders install made for its skill.
    assert _tree(project) == {}
    assert not mcp_json.exists() and not (project / ".butlers-gateway").exists()


async def test_uninstall_keeps_the_servers_added_behind_the_gateway(tmp_path: Path) -> None:
    """The docs say to add a server to servers.json once installed; uninstall put the
    original back and deleted servers.json, the added server and its token with it, saying
    only "the original is back" (a walkthrough). Now the original comes back with the servers
    as they are behind the gateway; without any, and with nothing changed, as before."""
    project = tmp_path / "project"
    project.mkdir()
    mcp_json = project / ".mcp.json"
    notes = {"command": "npx", "args": ["-y", "notes-server"]}
    mcp_json.write_text(json.dumps({"mcpServers": {"notes": notes}, "other": 1}))
    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 0, out
    servers = project / ".butlers-gateway" / "claude-code" / "servers.json"
    behind = json.loads(servers.read_text())
    # A token written out stays in the private servers.json: moved into .mcp.json it would be
    # in a file a project commits (a review). Uninstall refuses, naming the server and key.
    behind["mcpServers"]["github"] = {"command": "npx", "env": {"GITHUB_TOKEN": "ghp_kept"}}
    servers.write_text(json.dumps(behind))
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    assert code != 0 and "(github: GITHUB_TOKEN)" in out and "ghp_kept" not in out, out
    assert "ghp_kept" not in mcp_json.read_text() and servers.is_file()
    # As a reference to a variable, it moves.
    github = {"command": "npx", "args": ["-y", "gh"], "env": {"GITHUB_TOKEN": "${GH_TOKEN}"}}
    behind["mcpServers"]["github"] = github
    servers.write_text(json.dumps(behind))
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    assert code == 0, out
    assert "with the servers added or changed behind the gateway since install (github)" in out
    restored = json.loads(mcp_json.read_text())
    assert restored == {"mcpServers": {"notes": notes, "github": github}, "other": 1}
    assert not (project / ".butlers-gateway").exists()
    # Unreadable, it is not deleted: the uninstall refuses and says which file.
    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 0, out
    servers.write_text('{"mcpServers": {"github": ')
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    assert code != 0 and f"{servers}: not readable" in out, out
    assert servers.is_file()


@pytest.mark.parametrize(
    ("entry", "found"),
    [
        ({"env": {"API_KEY": "${API_KEY:-sk-live-0}"}}, ["API_KEY"]),  # a default spelled out
        ({"env": {"PIN": 12345678}}, ["PIN"]),
        ({"headers": {"Authorization": {"value": "Bearer x"}}}, ["Authorization"]),
        ({"args": ["--token", "sk-live"]}, ["args --token"]),
        ({"args": ["--api-key=sk-live"]}, ["args --api-key"]),
        ({"url": "https://api.example.com/mcp?key=sk"}, ["url"]),
        ({"url": "https://user:pw@api.example.com/mcp"}, ["url"]),
        ({"env": {"A": "${A}"}, "args": ["-y", "pkg", "--token", "${T}"]}, []),
        ({"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/p"]}, []),
    ],
)
def test_a_value_written_out_is_found_in_what_uninstall_would_move(
    entry: dict, found: list[str]
) -> None:
    """What uninstall would write into a committed .mcp.json: a review found defaults,
    numbers, arguments and URLs it missed."""
    from butlers.gateway.install import _literal_values

    assert _literal_values(entry) == found


@pytest.mark.parametrize(
    "content",
    [b'{"mcpServers": {"notes": {"command": "npx",}}}', b"\xff\xfe{not utf-8", b'["a list"]'],
    ids=["trailing-comma", "not-utf-8", "not-an-object"],
)
async def test_unreadable_mcp_json_is_named_and_left_untouched(
    tmp_path: Path, content: bytes
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    mcp_json = project / ".mcp.json"
    mcp_json.write_bytes(content)
    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 1
    assert out.startswith(f"error: {mcp_json}: ") and "Traceback" not in out
    assert "not readable JSON" in out or 'expected an object with a "mcpServers" object' in out
    assert _tree(project) == {".mcp.json": content}  # untouched, no record, no skill


async def test_uninstall_with_nothing_installed_says_so_and_changes_nothing(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / ".mcp.json").write_text(ORIGINAL)
    skill = project / SKILL  # the user's own skill of that name: not ours to remove
    skill.parent.mkdir(parents=True)
    skill.write_text(SKILL_TEXT)
    before = _tree(project)
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    assert code == 1
    assert out == (
        f"error: {project / '.mcp.json'}: the gateway is not installed there "
        f"({project / '.butlers-gateway' / 'claude-code'})\n"
    )
    assert _tree(project) == before


async def test_claude_desktop_uninstall_keeps_edits_made_after_install(tmp_path: Path) -> None:
    """Claude Desktop rewrites its own file (settings, servers added in its UI): uninstall
    then refuses to put the original back over those edits, and leaves everything as it is."""
    home = tmp_path / "home"
    home.mkdir()
    desktop = tmp_path / "claude_desktop_config.json"
    original = json.dumps({"globalShortcut": "Ctrl+Space", "mcpServers": {"a": {"command": "x"}}})
    desktop.write_text(original)
    args = ("--dir", str(tmp_path), "--host", "claude-desktop", "--config", str(desktop))
    env = {"HOME": str(home)}
    code, out = await _butlers_in(tmp_path, "gateway", "install", *args, env=env)
    assert code == 0, out
    edited = json.loads(desktop.read_text())
    edited["globalShortcut"] = "Alt+Space"
    desktop.write_text(json.dumps(edited, indent=2))
    before = _tree(tmp_path)
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", *args, env=env)
    assert code == 1
    assert f"error: {desktop} was edited since `butlers gateway install`" in out
    assert "not overwriting your edits" in out
    assert _tree(tmp_path) == before  # the edit, the kept original, the skill: all there
    kept = tmp_path / ".butlers-gateway" / "claude-desktop" / "original.json"
    assert kept.read_text() == original


@pytest.mark.claude
@pytest.mark.parametrize("planted", ["record-is-a-link", "folder-of-another-user"])
async def test_user_scope_refuses_a_record_directory_not_its_own_before_registering(
    tmp_path: Path, planted: str
) -> None:
    """The record (copies of the user config, API keys in them) goes only into a directory
    that is really ours: a link there, or a `.butlers-gateway` someone else owns, is refused
    with its path named BEFORE `claude mcp add`, so no registration is left without a record
    and nothing is written where the link points (review L5)."""
    home = tmp_path / "home"
    env = _claude_user_env(home)
    config = home / ".claude" / ".claude.json"
    config.parent.mkdir(parents=True)
    config.write_text(USER_CONFIG)
    record = home / ".claude" / ".butlers-gateway" / "claude-code-user"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    record.parent.mkdir()
    if planted == "record-is-a-link":
        record.symlink_to(elsewhere)
        named = record
    else:
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(record.parent, 65534, 65534)
        named = record.parent
    project = _project_with_notes(tmp_path / "project")
    before = _tree(home)
    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(project), env=env
    )
    assert code == 1, out
    assert err.startswith(f"error: {named}: ") and "remove it and run again" in err, err
    assert "Traceback" not in err
    assert config.read_text() == USER_CONFIG  # not registered
    assert _tree(home) == before and list(elsewhere.iterdir()) == []


async def test_links_planted_where_install_writes_are_not_written_through(
    tmp_path: Path,
) -> None:
    """A project (a cloned repository) can carry links at the names install writes: its
    temporary `.mcp.json`, the record's files and the skill. Nothing goes where they point
    (not the servers' env with its keys, not the skill over a file of yours); the links are
    replaced by files of the user's own, the record's mode 0600 (review L5)."""
    project = tmp_path / "project"
    project.mkdir()
    mcp_json = project / ".mcp.json"
    mcp_json.write_text(ORIGINAL.replace("from default", "sk-secret-default"))
    mcp_json.chmod(0o600)
    record = project / ".butlers-gateway" / "claude-code"
    record.mkdir(parents=True)
    bait = tmp_path / "bait"
    bait.mkdir()
    planted = {
        project / "..mcp.json.butlers-tmp": bait / "tmp",
        record / "servers.json": bait / "servers",
        record / "original.json": bait / "original",
        project / SKILL: bait / "skill",
    }
    for link, target in planted.items():
        target.write_text("bait")
        target.chmod(0o644)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
    code, out = await _butlers_in(tmp_path, "gateway", "install", "--dir", str(project))
    assert code == 0, out
    for target in planted.values():
        assert target.read_text() == "bait" and target.stat().st_mode & 0o777 == 0o644
    assert not (project / "..mcp.json.butlers-tmp").exists()
    assert not mcp_json.is_symlink() and mcp_json.stat().st_mode & 0o777 == 0o600
    assert (project / SKILL).read_text() == SKILL_TEXT and not (project / SKILL).is_symlink()
    for name in ("servers.json", "original.json"):
        assert not (record / name).is_symlink()
        assert (record / name).stat().st_mode & 0o777 == 0o600
    assert "sk-secret-default" in (record / "servers.json").read_text()
    code, out = await _butlers_in(tmp_path, "gateway", "uninstall", "--dir", str(project))
    assert code == 0, out
    assert mcp_json.read_text() == ORIGINAL.replace("from default", "sk-secret-default")


# Run inside `python -c`: Python's audit events fire just before each open, chmod and
# rename, so at each of them every file install may have put a key into is looked at.
_WATCH = """
import json, os, stat, sys
from pathlib import Path
project = Path(sys.argv[1])
os.umask(0o022)  # the usual one: a file created without a mode of its own is 0644
loose = []

def look(event, args):
    if event not in ("open", "os.chmod", "os.rename"):
        return
    for path in [*project.glob(".*.butlers-tmp"), *project.glob(".butlers-gateway/*/*")]:
        info = path.lstat()
        if stat.S_ISREG(info.st_mode) and info.st_size and info.st_mode & 0o077:
            loose.append(f"{path.name} {oct(stat.S_IMODE(info.st_mode))} at {event}")

sys.addaudithook(look)
from butlers.cli.main import main
for action in ("install", "uninstall"):
    try:
        main(["gateway", action, "--dir", str(project)])
    except SystemExit as exc:
        assert not exc.code, exc.code
print(json.dumps(sorted(set(loose))))
"""


async def test_a_copy_holding_keys_is_never_readable_by_others_while_it_is_written(
    tmp_path: Path,
) -> None:
    """`.mcp.json` is 0600 (its servers' env holds a key): the temporary file that replaces it
    and the record's copies are 0600 from the moment they hold a byte, under the usual umask
    022, not only once complete (review L5: the temporary was 0644 until copymode)."""
    project = tmp_path / "project"
    project.mkdir()
    mcp_json = project / ".mcp.json"
    mcp_json.write_text(ORIGINAL.replace("from default", "sk-secret-default"))
    mcp_json.chmod(0o600)
    code, out = await _butlers_in(tmp_path, "-c", _WATCH, str(project), program=[sys.executable])
    assert code == 0, out
    assert json.loads(out.splitlines()[-1]) == []
    assert mcp_json.stat().st_mode & 0o777 == 0o600


@pytest.mark.claude
async def test_user_scope_through_a_linked_config_and_commands_to_paste(tmp_path: Path) -> None:
    """A dotfile manager's `~/.claude.json` is a link: Claude Code writes through it, and so
    does uninstall (the link stays a link, the file it points to gets the original back).
    And the command install shows is quoted for a shell: pasted, it runs exactly what was
    run, for a project directory named with a space and `;` (review L5, L8)."""
    home = tmp_path / "home"
    env = _claude_user_env(home)
    config = home / ".claude" / ".claude.json"
    config.parent.mkdir(parents=True)
    dotfiles = tmp_path / "dotfiles" / "claude.json"
    dotfiles.parent.mkdir()
    dotfiles.write_text(USER_CONFIG)
    config.symlink_to(dotfiles)
    project = _project_with_notes(tmp_path / "my project; touch pwned")
    code, out, err = await run_cli(
        "gateway", "install", "--scope", "user", "--dir", str(project), env=env
    )
    assert code == 0, err
    shown = out.splitlines()[0]
    assert shown.startswith("`") and shown.endswith("`: done"), shown
    server = _registered(config)
    assert shlex.split(shown[1 : -len("`: done")]) == [
        "claude", "mcp", "add", "-s", "user", "butlers", "--", server["command"], *server["args"]
    ]  # fmt: skip
    assert server["args"] == ["gateway", "--dir", str(project)]
    assert config.is_symlink()
    code, out, err = await run_cli("gateway", "uninstall", "--scope", "user", env=env)
    assert code == 0, err
    assert f"{config}: the original is back" in out
    assert config.is_symlink() and config.readlink() == dotfiles
    assert dotfiles.read_text() == USER_CONFIG


async def test_an_installed_gateway_reads_the_fleets_token_from_its_env_file(
    start_butler: StartButler, tmp_path: Path
) -> None:
    """The installed gateway took the fleet's token from the host's environment only, where
    the host's model (its shell) could print it (a walkthrough). With --env-file the host
    runs it reading the token and the switchboard's address from the fleet's .env, and its
    own environment holds neither; a file others may read is refused."""
    from tests.test_route import make_fleet

    token = "env-file-token-0123456789abcdefghij"
    fleet = await make_fleet(start_butler, tmp_path, names=("general",), auth_token=token)
    project = tmp_path / "project"
    project.mkdir()
    env_file = tmp_path / "fleet.env"
    env_file.write_text(
        f"BUTLERS_AUTH_TOKEN={token}\nBUTLERS_SWITCHBOARD_URL={fleet.switchboard.sse_url}\n"
    )
    env_file.chmod(0o644)
    code, _, err = await run_cli(
        "gateway", "install", "--dir", str(project), "--env-file", str(env_file)
    )
    assert code == 1 and f"--env-file {env_file}: others may read it (mode 644)" in err, err
    assert not (project / ".mcp.json").exists()
    env_file.chmod(0o600)
    code, _, err = await run_cli(
        "gateway", "install", "--dir", str(project), "--env-file", str(env_file)
    )
    assert code == 0, err
    [server] = json.loads((project / ".mcp.json").read_text())["mcpServers"].values()
    assert server["args"] == ["gateway", "--dir", str(project), "--env-file", str(env_file)]
    params = StdioServerParameters(
        command=server["command"],
        args=server["args"],
        env={k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")},
        cwd=str(project),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        call = {"action": "call", "subtool": "state_set", "args": {"key": "k", "value": 1}}
        result = await client.call_tool("general_suite", call)
        assert not result.is_error, text_of(result)
