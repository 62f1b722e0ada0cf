"""`[[mcp_servers]]` and `[runtime] builtin_tools` in butler.toml: what is accepted, what is
refused and why (the key named), and what the approval gate asks of the config."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from butlers.config import load_butler_config
from butlers.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
HEAD = '[butler]\nname = "x"\nport = 1\n'


def write(root: Path, text: str) -> Path:
    directory = root / "x"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "butler.toml"
    path.write_text(HEAD + text)
    return path


def test_servers_of_both_kinds_load_with_their_filters(tmp_path: Path) -> None:
    config = load_butler_config(
        write(
            tmp_path,
            """
[runtime]
builtin_tools = ["WebSearch", "WebFetch"]

[[mcp_servers]]
name = "files"
command = "npx"
args = ["-y", "@modelcontextprotocol/server-filesystem", "{data_dir}"]
env = { NODE_OPTIONS = "--no-warnings" }
pass_env = ["GITHUB_TOKEN"]
allow = ["read_*", "list_*", "write_file"]
deny = ["read_media_file"]
approval = ["write_*"]

[[mcp_servers]]
name = "notes"
url = "https://notes.example/mcp"
headers_env = { Authorization = "NOTES_AUTH" }
""",
        )
    )
    files, notes = config.mcp_servers
    assert (files.command, files.args[-1], files.pass_env) == (
        "npx",
        "{data_dir}",
        ("GITHUB_TOKEN",),
    )
    assert (notes.url, dict(notes.headers_env)) == (
        "https://notes.example/mcp",
        {"Authorization": "NOTES_AUTH"},
    )
    assert config.runtime.builtin_tools == ("WebSearch", "WebFetch")
    # allow, then deny wins
    assert files.offers("read_text_file") and files.offers("write_file")
    assert not files.offers("read_media_file")  # allowed by read_*, denied
    assert not files.offers("move_file")  # not allowed
    assert notes.offers("anything")  # the default allow is everything
    # The approval gate's question, by the proxied name.
    assert config.needs_approval("files__write_file")
    assert not config.needs_approval("files__read_text_file")
    assert not config.needs_approval("notes__write_file")  # notes has no approval globs
    assert not config.needs_approval("write_file")  # the butler's own: not a server's
    assert not config.needs_approval("nosuch__write_file")
    assert config.mcp_server_of("files__read_text_file") == (files, "read_text_file")


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[[mcp_servers]]\nname = 'files'\n", "mcp_servers[0].command", "exactly one of"),
        (
            "[[mcp_servers]]\nname = 'files'\ncommand = 'npx'\nurl = 'http://127.0.0.1:1/sse'\n",
            "mcp_servers[0].command",
            "exactly one of command",
        ),
        ("[[mcp_servers]]\nname = 'my__files'\ncommand = 'x'\n", "mcp_servers[0].name", "'__'"),
        # `notes_`'s `write` would be `notes___write`: server `notes`, tool `_write`.
        ("[[mcp_servers]]\nname = 'notes_'\ncommand = 'x'\n", "mcp_servers[0].name", "ends in '_'"),
        ("[[mcp_servers]]\nname = 'Files'\ncommand = 'x'\n", "mcp_servers[0].name", "a name"),
        (
            "[[mcp_servers]]\nname = 'a'\ncommand = 'x'\n[[mcp_servers]]\nname = 'b'\n"
            "command = 'y'\n[[mcp_servers]]\nname = 'a'\nurl = 'http://127.0.0.1:1/mcp'\n",
            "mcp_servers[2].name",
            "already declared",
        ),
        (
            "[[mcp_servers]]\nname = 'a'\nurl = 'http://127.0.0.1:1/mcp'\nargs = ['-v']\n",
            "mcp_servers[0].args",
            "stdio server",
        ),
        (
            "[[mcp_servers]]\nname = 'a'\ncommand = 'x'\nheaders_env = { Authorization = 'T' }\n",
            "mcp_servers[0].headers_env",
            "remote server",
        ),
        (
            "[[mcp_servers]]\nname = 'a'\ncommand = 'x'\nallow = ['']\n",
            "mcp_servers[0].allow",
            "",
        ),
        (
            "[[mcp_servers]]\nname = 'a'\ncommand = 'x'\nenv = { 'NOT A NAME' = '1' }\n",
            "mcp_servers[0].env.NOT A NAME",
            "'NOT A NAME'",
        ),
        ("[[mcp_servers]]\nname = 'a'\ncommand = 'x'\nallowed = ['*']\n", None, "allow"),
        ("[runtime]\nbuiltin_tools = ['Bash']\n", "runtime.builtin_tools", "shell"),
        ("[runtime]\nbuiltin_tools = ['WebSearch', 'Write']\n", "runtime.builtin_tools", "Write"),
        ("[runtime]\nbuiltin_tools = ['Edit']\n", "runtime.builtin_tools", "approval"),
        ("[runtime]\nbuiltin_tools = ['MultiEdit']\n", "runtime.builtin_tools", "writes files"),
        ("[runtime]\nbuiltin_tools = ['NotebookEdit']\n", "runtime.builtin_tools", "writes"),
        ("[runtime]\nbuiltin_tools = ['Read']\n", "runtime.builtin_tools", "explicit root"),
        ("[runtime]\nbuiltin_tools = ['Frobnicate']\n", "runtime.builtin_tools", "WebSearch"),
    ],
)
def test_refusals_name_the_key_and_say_why(
    tmp_path: Path, text: str, key: str | None, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_butler_config(path)
    if key is not None:
        assert excinfo.value.key == key, excinfo.value
    assert problem in excinfo.value.problem, excinfo.value


def test_a_refused_builtin_says_it_would_bypass_approval(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_butler_config(write(tmp_path, "[runtime]\nbuiltin_tools = ['Bash']\n"))
    problem = excinfo.value.problem
    assert "bypass the owner's approval" in problem
    assert "[[mcp_servers]] filesystem server with an explicit root" in problem


def test_the_schema_wants_one_kind_of_server() -> None:
    schema = json.loads((REPO / "schemas" / "butler.schema.json").read_text())
    good = tomllib.loads(HEAD + "[[mcp_servers]]\nname = 'a'\ncommand = 'x'\n")
    jsonschema.validate(good, schema)
    for bad in (
        "[[mcp_servers]]\nname = 'a'\n",
        "[[mcp_servers]]\nname = 'a'\ncommand = 'x'\nurl = 'http://127.0.0.1:1/mcp'\n",
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(tomllib.loads(HEAD + bad), schema)


def test_a_relative_data_dir_is_given_to_a_server_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default BUTLERS_DATA_DIR is relative (.butlers) and a server runs in its data
    directory: `{data_dir}` written relative named a directory inside itself, so the shipped
    `general`'s filesystem server found none and exited on every start."""
    from fastmcp import FastMCP

    from butlers.config import McpServerConfig
    from butlers.tool_servers import ToolServers

    monkeypatch.chdir(tmp_path)
    config = McpServerConfig(
        name="files", command="npx", args=("-y", "server", "{data_dir}", "{butler_dir}/x")
    )
    servers = ToolServers(
        [config],
        mcp=FastMCP("t"),
        environ={},
        data_dir=Path(".butlers/data/general"),
        butler_dir=Path("config/butlers/general"),
    )
    [server] = servers.servers
    spec = server.child.spec
    assert spec.args[2] == str(tmp_path / ".butlers" / "data" / "general")
    assert spec.args[3] == str(tmp_path / "config" / "butlers" / "general") + "/x"
    assert spec.cwd == tmp_path / ".butlers" / "data" / "general"
