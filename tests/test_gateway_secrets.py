"""What a server's declaration sends it that is secret (a URL's `?key=`, a header, the
variables the declaration takes) never reaches the host in the gateway's own words: not in a
refusal (a child that cannot be reached names its URL), not in gateway_status, not in a
child's stderr the gateway relays (which Claude Code keeps in its log files). Its own log is
redacted as every butlers process's. The gateway runs as a host starts it (the `butlers
gateway` command over stdio)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.test_gateway import stdio_host, text_of

pytestmark = pytest.mark.proc

# The first named like no secret (no *_TOKEN, *_KEY): only its declaration says it is one.
REMOTE_VALUE = "remote-value-0a1b2c3d4e"
ARGUMENT_VALUE = "argument-value-5f6a7b8c"
LITERAL_VALUE = "literal-query-value-9d8e"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_declarations_secrets_stay_out_of_refusals_status_and_relayed_stderr(
    tmp_path: Path,
) -> None:
    port = free_port()  # nothing listens there: the remote child cannot be reached
    servers = {
        "remote": {
            "type": "http",
            "url": f"http://127.0.0.1:{port}/mcp?key=${{REMOTE_SETTING}}&sig={LITERAL_VALUE}",
        },
        "failing": {
            "command": "sh",
            "args": ["-c", 'echo "auth failed for key $1" >&2; exit 3', "sh", "${CLI_SECRET}"],
        },
    }
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    env = {"REMOTE_SETTING": REMOTE_VALUE, "CLI_SECRET": ARGUMENT_VALUE}
    async with stdio_host(tmp_path, env=env) as host:
        refused = await host.suite("remote_suite", "introspect")
        assert refused.is_error
        said = text_of(refused)
        # Its URL as scheme, host and port: a path or query may hold a credential.
        assert f"cannot connect to http://127.0.0.1:{port}/…: " in said, said
        assert REMOTE_VALUE not in said and LITERAL_VALUE not in said
        failed = await host.suite("failing_suite", "introspect")
        assert failed.is_error
        status = await host.status()
        assert status["failing"]["state"] == "error"
        shown = json.dumps(status)
        assert "auth failed for key [redacted]" in shown  # its stderr, as gateway_status has it
        for secret in (REMOTE_VALUE, ARGUMENT_VALUE, LITERAL_VALUE):
            assert secret not in shown
    relayed = (tmp_path / "gateway.stderr").read_text()
    assert "[failing] auth failed for key [redacted]" in relayed
    for secret in (REMOTE_VALUE, ARGUMENT_VALUE, LITERAL_VALUE):
        assert secret not in relayed
