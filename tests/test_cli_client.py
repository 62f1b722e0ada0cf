"""`butlers list | discover | route | trace` against a running switchboard, as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from tests.conftest import StartButler, write_butler_dir
from tests.fakes.squatter import squatting
from tests.test_route import Fleet, make_fleet

BUTLERS = str(Path(sys.executable).parent / "butlers")


async def run_cli(
    *args: str, token: str | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "JAEGER_"))},
        **(env or {}),
    }
    if token:
        env["BUTLERS_AUTH_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        BUTLERS, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(60):
        stdout, stderr = await process.communicate()
    return process.returncode, stdout.decode(), stderr.decode()


@pytest.fixture
async def fleet(start_butler: StartButler, tmp_path: Path) -> Fleet:
    return await make_fleet(start_butler, tmp_path, names=("general",), auth_token="cli-token")


async def test_list_human_and_json(fleet: Fleet) -> None:
    url = fleet.switchboard.sse_url
    (code, out, err), (json_code, json_out, json_err) = await asyncio.gather(
        run_cli("list", "--url", url, token="cli-token"),
        run_cli("list", "--url", url, "--json", token="cli-token"),
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ENDPOINT", "MODULES", "LAST", "SEEN", "DESCRIPTION"]
    assert any(
        line.startswith("general ") and fleet.targets["general"].sse_url in line for line in lines
    )
    assert json_code == 0, json_err
    rows = json.loads(json_out)
    assert {r["name"] for r in rows} == {"general", "switchboard"}


async def test_discover_reports_changes(fleet: Fleet) -> None:
    write_butler_dir(fleet.config_dir, "health", 18999)
    code, out, err = await run_cli(
        "discover", "--url", fleet.switchboard.sse_url, token="cli-token"
    )
    assert code == 0, err
    assert "added:     health" in out and "stale:     -" in out
    # Registered is not running: said, with how to start it.
    assert err == (
        "note: an added butler runs once started (restart `butlers up`, or `butlers run NAME`); "
        "until then route says it cannot reach it\n"
        "note: health is registered at http://127.0.0.1:18999/sse: "
        "`butlers run health --port 18999` serves it there\n"
    )
    code, out, _ = await run_cli(
        "discover", "--url", fleet.switchboard.sse_url, "--json", token="cli-token"
    )
    assert json.loads(out)["unchanged"] == ["general", "health", "switchboard"]


async def test_list_marks_a_stale_butler(fleet: Fleet) -> None:
    """A butler whose directory is gone is still a row (rows are never deleted): `list`
    says it is stale, which is why route and the classifier pass it by."""
    import shutil

    url = fleet.switchboard.sse_url
    write_butler_dir(fleet.config_dir, "health", 18999)
    assert (await run_cli("discover", "--url", url, token="cli-token"))[0] == 0
    shutil.rmtree(fleet.config_dir / "health")
    assert (await run_cli("discover", "--url", url, token="cli-token"))[0] == 0
    code, out, err = await run_cli("list", "--url", url, token="cli-token")
    assert code == 0, err
    (health,) = [line for line in out.splitlines() if line.startswith("health ")]
    assert "stale, " in health
    (general,) = [line for line in out.splitlines() if line.startswith("general ")]
    assert "stale" not in general


async def test_route_prints_the_targets_answer(fleet: Fleet) -> None:
    url = fleet.switchboard.sse_url
    code, out, err = await run_cli(
        "route",
        "general",
        "state_set",
        '{"key": "cli", "value": [1, 2]}',
        "--url",
        url,
        token="cli-token",
    )
    assert code == 0, err
    assert json.loads(out)["key"] == "cli"
    code, out, err = await run_cli(
        "route", "general", "state_get", '{"key": "cli"}', "--url", url, "--json", token="cli-token"
    )
    assert json.loads(out) == [1, 2]


async def test_errors_are_one_clear_line(fleet: Fleet) -> None:
    url = fleet.switchboard.sse_url
    ghost, not_json, unreachable, no_token = await asyncio.gather(  # independent: at once
        run_cli("route", "ghost", "status", "--url", url, token="cli-token"),
        run_cli("route", "general", "status", "{not json", "--url", url, token="cli-token"),
        run_cli("list", "--url", "http://127.0.0.1:9/sse"),
        run_cli("list", "--url", url),  # no token
    )
    code, _, err = ghost
    assert code == 1 and "error: butler 'ghost' not found" in err and "Traceback" not in err
    code, _, err = not_json
    assert code == 1 and "ARGS must be a JSON object" in err
    code, _, err = unreachable
    assert code == 1 and "cannot reach the switchboard at http://127.0.0.1:9/sse" in err
    assert "Traceback" not in err
    code, _, err = no_token
    assert code == 1 and "401 Unauthorized: set BUTLERS_AUTH_TOKEN" in err
    assert "Traceback" not in err, err
    # A wrong --url is told what is wrong with it, not that nothing runs.
    base = url.removesuffix("/sse")
    general = fleet.targets["general"].sse_url
    no_path, no_scheme, a_butler = await asyncio.gather(
        run_cli("list", "--url", base, token="cli-token"),
        run_cli("list", "--url", base.removeprefix("http://") + "/sse", token="cli-token"),
        run_cli("list", "--url", general, token="cli-token"),
    )
    assert no_path[0] == 1 and f"its MCP endpoint ends in /sse (or /mcp): {base}/sse" in no_path[2]
    assert no_scheme[0] == 1 and "is not a URL: http://HOST:PORT/sse" in no_scheme[2]
    assert (
        a_butler[0] == 1
        and f"{general} has no tool 'list_butlers': is it the switchboard?" in a_butler[2]
    )


async def test_trace_prints_the_jaeger_link(fleet: Fleet, db_conn) -> None:
    url = fleet.switchboard.sse_url
    code, _, err = await run_cli("route", "general", "status", "--url", url, token="cli-token")
    assert code == 0, err
    conn = await db_conn(fleet.switchboard.config.database)
    row = await conn.fetchrow("SELECT id::text AS id, trace_id FROM routing_log")

    # An inbox message, as a channel stores it with its trace's context.
    message_trace = "ab" * 16
    inbox_id = await conn.fetchval(
        "INSERT INTO inbox (channel, external_id, text, trace_context, status) VALUES "
        "('telegram', 'u-trace', 'hi', $1, 'done') RETURNING id",
        json.dumps({"traceparent": f"00-{message_trace}-{'cd' * 8}-01"}),
    )
    # 600 newer ones: it was looked for among the newest 500, and "not found".
    await conn.execute(
        "INSERT INTO inbox (channel, external_id, text, status) "
        "SELECT 'telegram', 'newer-' || g, 'hi', 'done' FROM generate_series(1, 600) g"
    )

    jaeger = {"JAEGER_UI_URL": "http://jaeger.lan:16686/"}
    missing = "00000000-0000-0000-0000-000000000000"
    (
        by_row,
        by_trace_id,
        as_json,
        not_an_id,
        an_inbox_id,
        no_row,
        no_message,
        older,
        a_page,
    ) = await asyncio.gather(
        run_cli("trace", row["id"], "--url", url, token="cli-token"),
        run_cli("trace", row["trace_id"].upper(), env=jaeger),  # no switchboard
        run_cli("trace", row["id"], "--url", url, "--json", token="cli-token", env=jaeger),
        run_cli("trace", "not-an-id"),
        # The inbox's number, as `butlers inbox` shows it (a walkthrough's first guess).
        run_cli("trace", str(inbox_id), "--url", url, "--json", token="cli-token"),
        run_cli("trace", missing, "--url", url, token="cli-token"),
        run_cli("trace", str(inbox_id + 1000), "--url", url, token="cli-token"),
        # A page of older messages: those before the newest, not them.
        run_cli("inbox", "--before", str(inbox_id + 2), "--url", url, "--json", token="cli-token"),
        run_cli("inbox", "--limit", "3", "--url", url, token="cli-token"),
    )
    code, out, err = by_row
    assert code == 0, err
    assert out.strip() == f"http://localhost:16686/trace/{row['trace_id']}"
    assert "mcp -> general.status" in err and "ok" in err
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z+\-0-9]+, ok\)", err), err  # zoned

    code, out, _ = by_trace_id
    assert out.strip() == f"http://jaeger.lan:16686/trace/{row['trace_id']}"
    code, out, _ = as_json
    found = json.loads(out)
    assert found["trace_id"] == row["trace_id"] and found["route"]["routed_to"] == "general"

    code, _, err = not_an_id
    assert code == 1 and "neither a trace id (32 hex characters), an inbox message's" in err
    code, out, err = an_inbox_id
    assert code == 0, err
    found = json.loads(out)
    assert (found["trace_id"], found["inbox_id"]) == (message_trace, inbox_id)
    assert found["url"] == f"http://localhost:16686/trace/{message_trace}"
    code, _, err = no_row
    assert code == 1 and f"no routing_log row with id {missing}" in err
    code, _, err = no_message
    assert code == 1 and f"no inbox message {inbox_id + 1000} (`butlers inbox`" in err
    code, out, err = older
    assert code == 0, err
    assert [row["id"] for row in json.loads(out)][:2] == [inbox_id + 1, inbox_id]
    code, out, err = a_page  # a full page says how to ask for the one before it
    assert code == 0 and f"(3 shown; older ones: --before {inbox_id + 598})" in err, err


async def test_every_client_command_says_what_to_check_when_the_switchboard_is_down() -> None:
    # A port held bound and never listened on: nothing can take it meanwhile (a free port let
    # go could be taken by another test's butler, which then answered 401: seen in CI).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        await _all_say_what_to_check(f"http://127.0.0.1:{closed.getsockname()[1]}/sse")


async def _all_say_what_to_check(url: str) -> None:
    # nothing listens at `url`
    commands = [
        ("list",),
        ("discover",),
        ("route", "general", "status"),
        ("ask", "hello"),
        ("trace", "00000000-0000-0000-0000-000000000000"),
        ("inbox",),
        ("log",),
        ("retry", "1"),
        ("outbox",),
    ]
    # One interpreter runs butlers.cli.main for every command in turn, each with its own
    # stdout/stderr: nine `butlers` processes cost 4.8 s of CPU, most of it the same imports.
    # The `butlers` script itself is run by the tests above.
    driver = (
        "import contextlib, io, json, sys\n"
        "from butlers.cli import main\n"
        "results = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    out, err = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as exc:\n"
        "            code = exc.code\n"
        "    results.append([code, out.getvalue(), err.getvalue()])\n"
        "print(json.dumps(results))\n"
    )
    argvs = [[*command, "--url", url] for command in commands]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        driver,
        json.dumps(argvs),
        env={k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "JAEGER_"))},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    results = json.loads(stdout)
    for command, (code, out, err) in zip(commands, results, strict=True):
        assert code == 1 and out == "", (command, out, err)
        assert err.startswith(
            f"error: cannot reach the switchboard at {url}: is `butlers up` running? ("
        ), (command, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (command, err)


async def test_gateway_report_as_json(fleet: Fleet, tmp_path: Path) -> None:
    code, out, err = await run_cli(
        "gateway",
        "--report",
        "--json",
        "--url",
        fleet.switchboard.sse_url,
        "--dir",
        str(tmp_path),
        token="cli-token",
    )
    assert code == 0, err
    report = json.loads(out)
    children = {child["name"]: child for child in report["children"]}
    assert set(children) == {"general", "switchboard"}
    assert all(c["state"] == "ready" and c["tools"] > 0 for c in children.values())
    listings = report["listings"]
    assert listings["activate"]["names"] == [
        "gateway_activate",
        "gateway_deactivate",
        "gateway_status",
    ]
    assert listings["direct"]["bytes"] == sum(c["direct_bytes"] for c in children.values())
    assert listings["suite"]["bytes"] > sum(c["suite_bytes"] for c in children.values())
    assert 0 < listings["suite"]["percent_of_direct"] < 100


async def test_every_listing_pages_with_before_and_a_full_page_names_the_next(
    fleet: Fleet, db_conn
) -> None:
    """`log`, `outbox`, `approvals` and `memory` page as `inbox` does: a full page ends with
    "--before ID", and that page holds the rest, none twice (routes logged in one write share
    their time: the page breaks between them too)."""
    url = fleet.switchboard.sse_url
    switchboard = await db_conn(fleet.switchboard.config.database)
    await switchboard.execute(  # five routes logged at one time, as one batch writes them
        "INSERT INTO routing_log (source_channel, routed_to, tool_name, created_at) "
        "SELECT 'mcp', 'general', 'status', now() FROM generate_series(1, 5)"
    )
    await switchboard.execute(
        "INSERT INTO outbox (kind, channel, recipient, text, status, sent_at) "
        "SELECT 'reply', 'telegram', '1', 'r' || g, 'sent', now() FROM generate_series(1, 5) g"
    )
    await switchboard.execute(
        "INSERT INTO approvals (butler, tool, arguments, status, expires_at) "
        "SELECT 'general', 't' || g, '{}', 'denied', now() FROM generate_series(1, 5) g"
    )
    general = await db_conn(fleet.targets["general"].config.database)
    await general.execute(
        "INSERT INTO memories (text, tags, private, language, words, person, from_owner) "
        "SELECT 'm' || g, '{}', false, 'simple', to_tsvector('simple', 'm' || g), '', true "
        "FROM generate_series(1, 5) g"
    )
    listings = {
        "log": ("log",),
        "outbox": ("outbox", "--status", "sent"),
        "approvals": ("approvals",),
        "memory": ("memory", "general"),
    }

    async def cli(*args: str) -> tuple[int, str, str]:
        return await run_cli(*args, "--url", url, token="cli-token")

    for name, command in listings.items():
        code, out, _ = await cli(*command, "--json", "--limit", "100")
        assert code == 0
        every = [row["id"] for row in json.loads(out)]
        assert len(every) == 5, (name, every)
        code, out, err = await cli(*command, "--json", "--limit", "3")
        first = [row["id"] for row in json.loads(out)]
        code, _, table_err = await cli(*command, "--limit", "3")
        assert code == 0 and f"(3 shown; older ones: --before {first[-1]})" in table_err, name
        code, out, err = await cli(*command, "--json", "--limit", "3", "--before", str(first[-1]))
        assert code == 0, err
        rest = [row["id"] for row in json.loads(out)]
        assert first + rest == every, name
        code, _, table_err = await cli(*command, "--limit", "3", "--before", str(first[-1]))
        assert "older ones" not in table_err, name  # a page not full is the last

    missing = "00000000-0000-0000-0000-000000000000"
    code, _, err = await cli("log", "--before", missing)
    assert code == 1 and f"before: no routing_log row {missing}" in err
    code, _, err = await cli("log", "--before", "12")
    assert code == 1 and "before: '12' is not a routing_log id" in err
    code, _, err = await cli("memory", "general", "--search", "m1", "--before", "3")
    assert code == 1 and "--before pages `butlers memory BUTLER`; a --search is ranked" in err
    # An id no row can have is named, not a database error (a review).
    for command in (("inbox",), ("outbox",), ("approvals",)):
        code, _, err = await cli(*command, "--before", str(2**63))
        assert code == 1 and "before must be a row's id (1..9223372036854775807)" in err, err
    code, _, err = await cli("memory", "general", "--before", "0")
    assert code == 1 and "before" in err and "Traceback" not in err, err


async def test_the_token_goes_only_to_a_switchboard_that_proves_it_holds_it(
    fleet: Fleet,
) -> None:
    """With the fleet down, another program on the switchboard's port was sent the operator's
    token by every command, and by the gateway's first call (a review, a walkthrough). Now
    what cannot prove it holds the token is not connected to, and the command says why; the
    real switchboard proves it."""
    forged = {"name": "switchboard", "proof": "0" * 64}
    async with squatting(answer=forged) as [squatter]:
        squatted, real = await asyncio.gather(
            run_cli("list", "--url", squatter.sse_url, token="cli-token"),
            run_cli("list", "--url", fleet.switchboard.sse_url, token="cli-token"),
        )
    code, _, err = squatted
    assert code == 1 and "answered /health with a proof of another token" in err, err
    assert "not connected to" in err and "Traceback" not in err
    assert squatter.heard == ["/health -"], squatter.heard
    assert real[0] == 0, real[2]


async def test_route_sends_no_token_to_what_took_a_stopped_butlers_port(fleet: Fleet) -> None:
    """A butler stopped (still in the config, so not stale): another program on its port was
    sent the operator's token by route (a review). It is not connected to."""
    general = fleet.targets["general"]
    port = general.port
    await general.stop()
    async with squatting(port) as [squatter]:
        url = fleet.switchboard.sse_url
        code, _, err = await run_cli("route", "general", "status", "--url", url, token="cli-token")
    assert code == 1 and "not connected to" in err, err
    assert squatter.heard == ["/health -"], squatter.heard
