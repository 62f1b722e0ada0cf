"""What the gateway refuses to read from the servers' files (review findings M1 and L7).

`${BUTLERS_*}` is never expanded into a server's declaration (those are the gateway's own
settings, its auth token among them): the entry is skipped with a warning naming the file, the
server and the variable, never its value. And a file is read only when it is a regular file of
at most 1 MiB: a FIFO there would block the reading (and the gateway's exit), a device such as
/dev/zero never ends.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from butlers.errors import ConfigError
from butlers.gateway.config import MAX_FILE_BYTES, load_gateway_config, read_server_file
from butlers.gateway.sources import ServerFiles, project_servers, read_config_file

TOKEN = "the-gateway-s-own-token"


def test_butlers_variables_are_never_expanded_anywhere_in_an_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    own = "${BUTLERS_AUTH_TOKEN}"
    servers = {
        "in_url": {"type": "http", "url": f"http://127.0.0.1:9/mcp?k={own}"},
        "in_header": {"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": own}},
        "in_args": {"command": "node", "args": ["s.js", f"--token={own}"]},
        "in_env": {"command": "node", "env": {"T": own}},
        "in_command": {"command": own},
        "with_default": {"command": "node", "env": {"T": "${BUTLERS_URL:-http://x}"}},
        "fine": {"command": "node", "env": {"T": "${OTHER}"}},
    }
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    environ = {"BUTLERS_AUTH_TOKEN": TOKEN, "BUTLERS_URL": "http://y", "OTHER": "o"}
    with caplog.at_level(logging.WARNING):
        specs = project_servers(tmp_path, environ)
    assert [s.name for s in specs] == ["fine"]
    for name, variable in [(n, "BUTLERS_AUTH_TOKEN") for n in list(servers)[:5]] + [
        ("with_default", "BUTLERS_URL")
    ]:
        assert (
            f"skipping {tmp_path / '.mcp.json'}: mcpServers.{name}: ${{{variable}}} is the "
            "gateway's own setting (BUTLERS_*), never expanded"
        ) in caplog.text, name
    assert TOKEN not in caplog.text and "http://y" not in caplog.text


def test_cursor_and_vscode_variables_are_expanded_or_refused_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What `install --host cursor|vscode` moves keeps those editors' forms: `${env:VAR}`,
    `${workspaceFolder}` and `${userHome}` are expanded (they reached the child as written);
    `${input:...}`, which VS Code asks its user for, skips that server saying what to do; a
    BUTLERS_ variable is refused in this form too; and a value is never expanded again."""
    servers = {
        "cursor": {
            "command": "node",
            "args": ["${workspaceFolder}/server.js"],
            "env": {"X": "${env:HOME}", "Y": "${userHome}/y", "Z": "${env:TRICKY}"},
        },
        "vscode": {
            "type": "http",
            "url": "http://127.0.0.1:9/mcp",
            "headers": {"Authorization": "Bearer ${input:tok}"},
        },
        "own": {"command": "node", "env": {"T": "${env:BUTLERS_AUTH_TOKEN}"}},
    }
    installed = tmp_path / ".butlers-gateway" / "cursor" / "servers.json"
    installed.parent.mkdir(parents=True)
    installed.write_text(json.dumps({"mcpServers": servers}))
    environ = {"HOME": "/home/me", "TRICKY": "${HOME}", "BUTLERS_AUTH_TOKEN": TOKEN}
    with caplog.at_level(logging.WARNING):
        [cursor] = project_servers(tmp_path, environ)
    assert cursor.args == (f"{tmp_path.resolve()}/server.js",)
    assert cursor.env == {"X": "/home/me", "Y": "/home/me/y", "Z": "${HOME}"}
    assert "mcpServers.vscode: ${input:tok} is a value VS Code asks its user for" in caplog.text
    assert "write ${env:NAME}" in caplog.text
    assert "mcpServers.own: ${BUTLERS_AUTH_TOKEN} is the gateway's own setting" in caplog.text
    assert TOKEN not in caplog.text


def test_a_codex_bearer_token_from_a_butlers_variable_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[mcp_servers.docs]\nurl = "http://127.0.0.1:9/mcp"\n'
        'bearer_token_env_var = "BUTLERS_AUTH_TOKEN"\n'
    )
    with caplog.at_level(logging.WARNING):
        assert read_config_file(config, {"BUTLERS_AUTH_TOKEN": TOKEN}) == []
    assert "mcp_servers.docs: ${BUTLERS_AUTH_TOKEN} is the gateway's own setting" in caplog.text
    assert TOKEN not in caplog.text


def test_only_a_regular_file_of_at_most_one_mib_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    # A writer is there (so that a reader that checks nothing blocks on read, not on open:
    # the test then fails instead of hanging).
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        with pytest.raises(ConfigError, match=r"fifo\.json: is a FIFO, not a regular file"):
            read_server_file(fifo)
    finally:
        os.close(writer)
    with pytest.raises(ConfigError, match=r"is a directory, not a regular file"):
        read_server_file(tmp_path)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")  # what the link leads to is checked
    with pytest.raises(ConfigError, match=r"zero\.json: is a device, not a regular file"):
        read_server_file(zero)
    big = tmp_path / "big.json"
    big.write_text(" " * MAX_FILE_BYTES + "{}")
    with pytest.raises(ConfigError, match=r"big\.json: larger than 1048576 bytes \(1 MiB\)"):
        read_server_file(big)
    big.write_text(" " * (MAX_FILE_BYTES - 2) + "{}")
    assert read_server_file(big).endswith("{}")  # the limit itself is fine


def test_special_files_where_servers_are_declared_are_skipped_naming_them(
    tmp_path: Path,
) -> None:
    """`.mcp.json` a directory, a FIFO among the globbed files, `--config` a link to a device:
    each one skipped (the reading goes on), each named."""
    (tmp_path / ".mcp.json").mkdir()
    trap = tmp_path / "mcps" / "trap"
    trap.mkdir(parents=True)
    os.mkfifo(trap / ".mcp.json")
    device = tmp_path / "desktop.json"
    device.symlink_to("/dev/zero")
    files = ServerFiles(
        directory=tmp_path,
        environ={},
        config_file=device,
        discover_globs=("mcps/*/.mcp.json",),
        base_dir=tmp_path,
    )
    declared, skipped = files.read()
    assert declared == []
    assert sorted(str(s.error) for s in skipped) == sorted(
        [
            f"{device}: is a device, not a regular file: not read",
            f"{tmp_path / '.mcp.json'}: is a directory, not a regular file: not read",
            f"{trap / '.mcp.json'}: is a FIFO, not a regular file: not read",
        ]
    )


def test_reload_is_approve_apply_or_off(tmp_path: Path) -> None:
    assert load_gateway_config(tmp_path).reload == "approve"
    (tmp_path / "gateway.toml").write_text('reload = "apply"\n')
    assert load_gateway_config(tmp_path).reload == "apply"
    (tmp_path / "gateway.toml").write_text('reload = "always"\n')
    with pytest.raises(ConfigError, match=r"gateway\.toml: reload: "):
        load_gateway_config(tmp_path)
