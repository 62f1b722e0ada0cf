"""`butlers gateway install --host cursor|vscode`: the project's `.cursor/mcp.json`
(`mcpServers`) or `.vscode/mcp.json` (`servers`, each entry typed) is rewritten to the one
`butlers` server, whose command really serves the servers it moved; uninstall gives the file
back byte for byte, and removes the file and folder install created."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from butlers.errors import ConfigError
from butlers.gateway.sources import read_config_file
from tests.test_gateway import MOCK, text_of
from tests.test_gateway_install import _butlers_in, _tree, as_the_host_starts

# Hand-written, as people write them: odd spacing, keys of the host's own, a remote server,
# no final newline.
CURSOR = (
    '{\n\t"mcpServers" : {\n'
    f'   "notes":{{"command": "{sys.executable}", "args": ["{MOCK}"], "disabled": false}},\n'
    '   "remote": {"url": "http://127.0.0.1:9/mcp", "headers": {"X-Team": "a"}}\n'
    '\t},\n  "x-team-note":   "keep me"\n}'
)
VSCODE = (
    '{\n  "inputs": [{"type": "promptString", "id": "key", "password": true}],\n'
    '  "servers": {\n'
    f'      "notes":   {{"type": "stdio", "command": "{sys.executable}", "args": ["{MOCK}"]}},\n'
    '      "remote": {"type": "http", "url": "http://127.0.0.1:9/mcp"}\n'
    "  }\n}"
)
HOSTS = {
    "cursor": (Path(".cursor") / "mcp.json", "mcpServers", CURSOR),
    "vscode": (Path(".vscode") / "mcp.json", "servers", VSCODE),
}


@pytest.mark.parametrize("host", list(HOSTS))
async def test_install_rewrites_the_hosts_file_and_uninstall_restores_it(
    tmp_path: Path, host: str
) -> None:
    relative, key, original = HOSTS[host]
    project = tmp_path / "project"
    (project / relative).parent.mkdir(parents=True)
    config = project / relative
    config.write_text(original)
    before = _tree(project)

    code, out = await _butlers_in(
        tmp_path, "gateway", "install", "--dir", str(project), "--host", host
    )
    assert code == 0, out
    installed = json.loads(config.read_text())
    assert [k for k in installed if k != key] == [k for k in json.loads(original) if k != key]
    [(name, server)] = installed[key].items()
    assert name == "butlers" and Path(server["command"]).is_absolute()
    assert server["args"] == ["gateway", "--dir", str(project)]
    if host == "vscode":
        assert server["type"] == "stdio"  # VS Code wants each entry typed
    else:
        assert "type" not in server
    record = project / ".butlers-gateway" / host
    moved = json.loads((record / "servers.json").read_text())["mcpServers"]
    assert moved == json.loads(original)[key]  # the remote one with its type and headers
    assert (record / "original.json").read_text() == original
    assert not (project / ".claude").exists()  # the skill is Claude Code's, not theirs
    written = config.read_bytes()
    code, out = await _butlers_in(
        tmp_path, "gateway", "install", "--dir", str(project), "--host", host
    )
    assert code == 0 and "already installed, nothing changed" in out, out
    assert config.read_bytes() == written

    code, out = await _butlers_in(
        tmp_path, "gateway", "uninstall", "--dir", str(project), "--host", host
    )
    assert code == 0, out
    assert config.read_text() == original  # byte for byte
    assert _tree(project) == before


@pytest.mark.parametrize("host", list(HOSTS))
async def test_the_hosts_command_serves_the_servers_install_moved(
    tmp_path: Path, host: str
) -> None:
    """What Cursor or VS Code does with the file: start the command it names, from the
    project; the server that was in the file answers behind the gateway."""
    relative, key, _ = HOSTS[host]
    project = tmp_path / "project"
    (project / relative).parent.mkdir(parents=True)
    entry: dict[str, object] = {"command": sys.executable, "args": [MOCK]}
    if host == "vscode":
        entry["type"] = "stdio"
    (project / relative).write_text(json.dumps({key: {"notes": entry}}))
    code, out = await _butlers_in(
        tmp_path, "gateway", "install", "--dir", str(project), "--host", host
    )
    assert code == 0, out
    server = json.loads((project / relative).read_text())[key]["butlers"]
    async with as_the_host_starts(server, project) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        assert "notes_suite" in tools and "butlers_suite" not in tools
        result = await client.call_tool(
            "notes_suite", {"action": "call", "subtool": "add", "args": {"a": 2, "b": 3}}
        )
        assert text_of(result) == "5"


@pytest.mark.parametrize("host", list(HOSTS))
async def test_a_project_without_the_file_gets_it_and_uninstall_removes_file_and_folder(
    tmp_path: Path, host: str
) -> None:
    relative, key, _ = HOSTS[host]
    project = tmp_path / "project"
    project.mkdir()
    code, out = await _butlers_in(
        tmp_path, "gateway", "install", "--dir", str(project), "--host", host
    )
    assert code == 0, out
    assert list(json.loads((project / relative).read_text())[key]) == ["butlers"]
    code, out = await _butlers_in(
        tmp_path, "gateway", "uninstall", "--dir", str(project), "--host", host
    )
    assert code == 0, out
    assert f"{project / relative}: removed (there was none before install)" in out
    assert _tree(project) == {}  # no file, and no empty .cursor/ or .vscode/ left behind


async def test_dir_before_or_after_install_writes_the_same_files(tmp_path: Path) -> None:
    """`butlers gateway --dir D install` and `butlers gateway install --dir D` leave the very
    same files in D (and none where they ran); so do their uninstalls."""
    project, cwd = tmp_path / "project", tmp_path / "cwd"
    (project / ".cursor").mkdir(parents=True)
    cwd.mkdir()
    (project / ".cursor" / "mcp.json").write_text(CURSOR)
    (project / ".mcp.json").write_text('{"mcpServers": {}}')
    original = _tree(project)
    spellings = {
        "before": ("gateway", "--dir", str(project), "{action}", "--host", "cursor"),
        "after": ("gateway", "{action}", "--dir", str(project), "--host", "cursor"),
    }
    installed: dict[str, dict[str, bytes | None]] = {}
    for name, spelling in spellings.items():
        code, out = await _butlers_in(cwd, *(a.format(action="install") for a in spelling))
        assert code == 0, out
        installed[name] = _tree(project)
        assert _tree(cwd) == {}
        code, out = await _butlers_in(cwd, *(a.format(action="uninstall") for a in spelling))
        assert code == 0, out
        assert _tree(project) == original and _tree(cwd) == {}
    assert installed["before"] == installed["after"] != original


async def test_user_scope_is_refused_for_other_hosts(tmp_path: Path) -> None:
    for action in ("install", "uninstall"):
        code, out = await _butlers_in(
            tmp_path,
            "gateway",
            action,
            "--dir",
            str(tmp_path),
            "--scope",
            "user",
            "--host",
            "cursor",
        )
        assert code == 1
        assert out == "error: --scope user is Claude Code's; --host cursor has no such scope\n"
    assert _tree(tmp_path) == {}


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (b'{\n  // my servers\n  "servers": {}\n}', "not readable JSON"),
        (b'{"servers": ["a list"]}', 'expected an object with a "servers" object'),
    ],
    ids=["jsonc-comment", "servers-not-an-object"],
)
async def test_a_vscode_file_it_cannot_rewrite_is_named_and_left_untouched(
    tmp_path: Path, content: bytes, complaint: str
) -> None:
    """VS Code accepts comments in its mcp.json; rewriting such a file would lose them, and
    the promise is the file back byte for byte: install refuses, naming the file."""
    project = tmp_path / "project"
    config = project / ".vscode" / "mcp.json"
    config.parent.mkdir(parents=True)
    config.write_bytes(content)
    code, out = await _butlers_in(
        tmp_path, "gateway", "install", "--dir", str(project), "--host", "vscode"
    )
    assert code == 1 and out.startswith(f"error: {config}: {complaint}"), out
    assert _tree(project) == {".vscode": None, ".vscode/mcp.json": content}


def _codex_toml(tmp_path: Path) -> Path:
    """A Codex config.toml as Codex writes it: a stdio server, a remote one with its token
    and a header from the environment, one switched off, and settings of Codex's own."""
    config = tmp_path / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text(
        'model = "gpt-5"\n\n'
        "[mcp_servers.notes]\n"
        f"command = {json.dumps(sys.executable)}\n"
        f"args = [{json.dumps(MOCK)}]\n"
        'env = { "MOCK_SETTING" = "from codex" }\n\n'
        "[mcp_servers.docs]\n"
        'url = "http://127.0.0.1:9/mcp"\n'
        'bearer_token_env_var = "DOCS_TOKEN"\n'
        'http_headers = { "X-Client" = "butlers" }\n'
        'env_http_headers = { "X-Team" = "DOCS_TEAM" }\n\n'
        "[mcp_servers.off]\n"
        'command = "npx"\n'
        "enabled = false\n"
    )
    return config


def test_codex_config_toml_is_a_source(tmp_path: Path) -> None:
    config = _codex_toml(tmp_path)
    environ = {"DOCS_TOKEN": "t0k", "DOCS_TEAM": "blue"}
    notes, docs = read_config_file(config, environ)
    assert (notes.name, notes.cmd, notes.args) == ("notes", sys.executable, (MOCK,))
    assert notes.env == {"MOCK_SETTING": "from codex"}
    assert (docs.name, docs.url, docs.cmd) == ("docs", "http://127.0.0.1:9/mcp", None)
    assert docs.headers == {"X-Client": "butlers", "X-Team": "blue", "Authorization": "Bearer t0k"}
    # Without its token the remote server is left out, the others stay.
    assert [s.name for s in read_config_file(config, {"DOCS_TEAM": "blue"})] == ["notes"]


@pytest.mark.parametrize(
    ("table", "complaint"),
    [
        ('url = "http://x/mcp"\nbearer_token_env_var = "NOT A NAME"', "expected variable names"),
        ('url = "http://x/mcp"\nenv_http_headers = "DOCS"', "expected variable names"),
        ('url = "http://x/mcp"\nhttp_headers = ["a"]', "http_headers: expected a table"),
        ('command = ["npx"]', "command: Input should be a valid string"),
    ],
)
def test_a_broken_codex_server_is_skipped_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, table: str, complaint: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[mcp_servers.bad]\n{table}\n\n[mcp_servers.good]\ncommand = "npx"\n')
    assert [s.name for s in read_config_file(config, {})] == ["good"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"skipping {config}: mcp_servers.bad: ") and complaint in warning


def test_unreadable_codex_toml_is_named(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[mcp_servers.x\n")
    with pytest.raises(ConfigError, match=r"config\.toml: not readable TOML"):
        read_config_file(config, {})
    config.write_text('model = "gpt-5"\n')
    with pytest.raises(ConfigError, match=r"mcp_servers: expected \[mcp_servers.<name>\] tables"):
        read_config_file(config, {})


def test_gemini_settings_json_is_a_source(tmp_path: Path) -> None:
    settings = tmp_path / ".gemini" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(
        json.dumps(
            {
                "theme": "Dracula",
                "mcpServers": {
                    "notes": {"command": sys.executable, "args": [MOCK], "trust": False},
                    "github": {"httpUrl": "http://127.0.0.1:9/mcp", "headers": {"X": "${T}"}},
                    "events": {"url": "http://127.0.0.1:9/sse", "timeout": 5000},
                },
            }
        )
    )
    specs = read_config_file(settings, {"T": "v"})
    assert [(s.name, s.cmd or s.url, dict(s.headers)) for s in specs] == [
        ("notes", sys.executable, {}),
        ("github", "http://127.0.0.1:9/mcp", {"X": "v"}),
        ("events", "http://127.0.0.1:9/sse", {}),
    ]


async def test_the_gateway_serves_a_codex_config(tmp_path: Path) -> None:
    """`butlers gateway --config ~/.codex/config.toml`: the real gateway starts Codex's
    stdio server; the remote one, whose header's variable is not set, is left out with a
    warning that names it."""
    config = _codex_toml(tmp_path)
    code, out = await _butlers_in(
        tmp_path,
        "gateway",
        "--dry-run",
        "--json",
        "--no-butlers",
        "--dir",
        str(tmp_path),
        "--config",
        str(config),
    )
    assert code == 1, out  # a declared server left out: the check fails
    warning, listing = out.split("\n", 1)
    assert f"skipping {config}: mcp_servers.docs: ${{DOCS_TEAM}} is not set" in warning
    [docs] = json.loads(listing)["skipped"]
    assert docs["server"] == "docs" and "${DOCS_TEAM} is not set" in docs["error"]
    [notes] = json.loads(listing)["children"]
    assert (notes["name"], notes["state"]) == ("notes", "ready")
    assert [t["name"] for t in notes["subtools"]][:2] == ["echo", "add"]
