"""Bad input to the tools: a clear error naming what was wrong, and nothing else disturbed."""

from __future__ import annotations

import re
import uuid

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from butlers.core_tools import MAX_VALUE_BYTES
from tests.conftest import StartButler


@pytest.fixture
async def client(start_butler: StartButler):
    daemon = await start_butler()
    async with Client(daemon.sse_url) as c:
        c.daemon = daemon  # type: ignore[attr-defined]
        yield c


@pytest.mark.parametrize(
    ("cron", "said"),
    [
        ("61 * * * *", "its minute '61' is not valid: it takes 0-59"),
        ("not a cron", r"expected five fields .* \(got 3\)"),
        ("* * *", r"expected five fields .* \(got 3\)"),
        ("0 25 * * *", "its hour '25' is not valid: it takes 0-23"),
        ("", r"expected five fields .* \(got 0\)"),
    ],
)
async def test_invalid_cron_is_a_clear_error_and_nothing_is_stored(
    client, db_conn, cron, said
) -> None:
    with pytest.raises(ToolError, match=rf"invalid cron expression '{re.escape(cron)}': {said}"):
        await client.call_tool("schedule_create", {"name": "bad", "cron": cron, "prompt": "p"})
    conn = await db_conn(client.daemon.config.database)
    assert await conn.fetchval("SELECT count(*) FROM scheduled_tasks") == 0


async def test_unknown_and_malformed_session_ids(client) -> None:
    missing = str(uuid.uuid4())
    with pytest.raises(ToolError, match=f"session '{missing}' not found"):
        await client.call_tool("session_get", {"id": missing})
    with pytest.raises(ToolError, match="session id 'nope' is not a UUID"):
        await client.call_tool("session_get", {"id": "nope"})


async def test_oversized_state_value_is_refused_and_old_value_kept(client) -> None:
    await client.call_tool("state_set", {"key": "big", "value": "small"})
    with pytest.raises(
        ToolError,
        match=rf"value for key 'big' is \d+ bytes of JSON; the limit is {MAX_VALUE_BYTES}",
    ):
        await client.call_tool("state_set", {"key": "big", "value": "x" * (MAX_VALUE_BYTES + 1)})
    assert (await client.call_tool("state_get", {"key": "big"})).data == "small"


async def test_empty_and_overlong_keys(client) -> None:
    with pytest.raises(ToolError, match="state key must not be empty"):
        await client.call_tool("state_set", {"key": "", "value": 1})
    with pytest.raises(ToolError, match="the limit is 512"):
        await client.call_tool("state_get", {"key": "k" * 513})


async def test_sessions_list_limit_is_validated(client) -> None:
    with pytest.raises(ToolError):
        await client.call_tool("sessions_list", {"limit": 0})
    with pytest.raises(ToolError):
        await client.call_tool("sessions_list", {"limit": 10_000})


async def test_missing_and_undeclared_arguments_are_rejected(client) -> None:
    with pytest.raises(ToolError, match="key"):
        await client.call_tool("state_set", {"value": 1})
    with pytest.raises(ToolError):
        await client.call_tool("state_get", {"key": "k", "surprise": True})


async def test_internal_errors_are_masked(client, pg_server) -> None:
    # Break the database under the butler: the caller gets a generic error, no SQL or driver text.
    conn = await __import__("asyncpg").connect(pg_server.dsn(client.daemon.config.database))
    try:
        await conn.execute("ALTER TABLE state RENAME TO state_gone")
        with pytest.raises(ToolError) as excinfo:
            await client.call_tool("state_get", {"key": "k"})
        message = str(excinfo.value)
        assert "state_gone" not in message and "relation" not in message
        assert "state_get" in message
        # ...and the butler is still serving other tools.
        assert (await client.call_tool("status", {})).data["name"] == client.daemon.config.name
    finally:
        await conn.execute("ALTER TABLE state_gone RENAME TO state")
        await conn.close()
