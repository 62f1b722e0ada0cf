"""One log stream: what `butlers --log-level ... --log-format ...` prints, as a user runs it.

A real `butlers run` subprocess on the test PostgreSQL; its stderr is the stream. FastMCP's,
the MCP SDK's and uvicorn's records must arrive there in our format, with the butler's name
and, inside a tool call, the trace and span ids.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
from pathlib import Path

from fastmcp import Client

from butlers import logs
from butlers.logs import LEVELS
from tests.conftest import free_port, write_butler_dir
from tests.test_cli import Butlers

TOKEN = "log-stream-token-0123456789"  # BUTLERS_AUTH_TOKEN: a secret the stream must not show
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "DATABASE_URL"))}
    return env | (extra or {})


async def test_a_bad_log_level_or_format_is_a_usage_error_naming_the_choices() -> None:
    typed = Butlers("--log-level", "foo", "list", env=_env())
    assert await typed.run() == 2
    assert "argument --log-level: invalid choice: 'FOO'" in typed.stderr
    assert all(level in typed.stderr for level in LEVELS)
    assert "Traceback" not in typed.stderr

    after = Butlers("list", "--log-format", "xml", env=_env())
    assert await after.run() == 2
    assert "argument --log-format: invalid choice: 'xml'" in after.stderr

    from_env = Butlers("list", env=_env({"BUTLERS_LOG_LEVEL": "loud"}))
    assert await from_env.run() != 0
    assert "BUTLERS_LOG_LEVEL" in from_env.stderr and "'loud'" in from_env.stderr.lower()
    assert "Traceback" not in from_env.stderr


async def _run_general(tmp_path: Path, pg_server, *log_args: str) -> Butlers:
    """`butlers run general` with these log options, a refused tool call made to it (logged
    by FastMCP inside the call's span) and a value holding the token stored; then stopped."""
    port = free_port()
    write_butler_dir(tmp_path / "config", "general", port)
    env = _env(
        {
            "DATABASE_URL": pg_server.dsn("postgres"),
            "BUTLERS_DATA_DIR": str(tmp_path / "data"),
            "BUTLERS_AUTH_TOKEN": TOKEN,
        }
    )
    # No credentials for Claude Code (none here, no login in this HOME): `run` warns of it.
    env = {k: v for k, v in env.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    run = Butlers(*log_args, "run", "general", "--config-dir", str(tmp_path / "config"), env=env)
    await run.start()
    try:
        await run.wait_ready()
        async with Client(f"http://127.0.0.1:{port}/sse", auth=TOKEN) as client:
            await client.call_tool("state_set", {"key": "secret", "value": TOKEN})
            refused = await client.call_tool("state_get", {"key": ""}, raise_on_error=False)
            assert refused.is_error
        await run.wait_stderr("Error calling tool 'state_get'")
        assert await run.stop(signal.SIGTERM) == 0
    finally:
        run.kill()
    return run


async def test_json_lines_carry_every_library_the_butler_and_the_trace(
    tmp_path: Path, pg_server
) -> None:
    run = await _run_general(tmp_path, pg_server, "--log-level", "debug", "--log-format", "json")

    records = []
    for line in run.stderr.splitlines():
        records.append(json.loads(line))  # every line: one object (no Rich, no uvicorn lines)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)

    def find(logger: str, text: str) -> dict:
        found = [r for r in records if r["logger"].startswith(logger) and text in r["message"]]
        assert found, f"no {logger} record with {text!r}"
        return found[0]

    started = find("butlers.daemon", "serving on")
    assert started["action"] == "butler_started" and started["butler"] == "general"
    assert find("uvicorn", "Application startup complete")["butler"] == "general"
    assert find("fastmcp", "Handler called: call_tool")["level"] == "DEBUG"
    refused = find("fastmcp", "Error calling tool 'state_get'")
    assert refused["level"] == "INFO" and refused["butler"] == "general"
    # With why (FastMCP's own line says only which tool).
    assert refused["message"] == "Error calling tool 'state_get': state key must not be empty"
    assert re.fullmatch(r"[0-9a-f]{32}", refused["trace_id"])
    assert re.fullmatch(r"[0-9a-f]{16}", refused["span_id"])
    assert any(r["action"] == "startup" for r in records if "action" in r)  # the progress
    # What `run` says under its ready table is a record too (it was a plain line).
    warned = find("butlers", "Claude Code has no credentials")
    assert (warned["level"], warned["action"]) == ("WARNING", "ready_warning")
    assert TOKEN not in run.stderr and "[redacted]" in run.stderr  # FastMCP logs the arguments


async def test_text_lines_at_info_show_action_and_butler_and_no_debug(
    tmp_path: Path, pg_server
) -> None:
    run = await _run_general(tmp_path, pg_server, "--log-format", "text", "--log-level", "info")

    lines = [line for line in run.stderr.splitlines() if TEXT_LINE.match(line)]
    assert any(
        "INFO butlers.daemon: butler general serving on" in line
        and line.endswith("[action=butler_started butler=general]")
        for line in lines
    ), run.stderr
    assert any("INFO uvicorn.error: Application startup complete." in line for line in lines)
    refused = [line for line in lines if "INFO fastmcp" in line and "state_get" in line]
    assert refused and re.search(r"butler=general trace_id=[0-9a-f]{32} span_id=", refused[0])
    assert not [line for line in lines if " DEBUG " in line]
    assert "Handler called" not in run.stderr  # FastMCP's DEBUG record
    assert TOKEN not in run.stderr


def test_a_record_a_library_lowers_below_the_level_is_not_printed() -> None:
    """FastMCP's `to_client` logger lowers what a server sends its client to DEBUG after the
    logger let it through at its own level: at WARNING, a child's warning forwarded to the
    host printed "DEBUG fastmcp.server.context.to_client: Sending WARNING to client". Not any
    more; at DEBUG it is there."""
    import fastmcp
    from fastmcp.server.context import to_client_logger

    root, library = logging.getLogger(), logging.getLogger("fastmcp")
    saved = (root.handlers[:], root.level, fastmcp.settings.log_enabled)
    saved_library = (library.handlers[:], library.propagate, library.level)
    try:
        for level, shown in (("WARNING", False), ("DEBUG", True)):
            stream = io.StringIO()
            logs.configure_logging(level, "text", stream=stream)
            to_client_logger.warning("Sending WARNING to client (alpha): half way there")
            assert ("half way there" in stream.getvalue()) is shown, (level, stream.getvalue())
    finally:  # the process's logging as it was (configure_logging adopted FastMCP's too)
        root.handlers[:], root.level, fastmcp.settings.log_enabled = saved
        library.handlers[:], library.propagate, library.level = saved_library
