"""What a host's tool list holds in each mode (`suite`, `activate`, `both`), per-call
introspection verbosity, and `butlers gateway --dry-run`: the real `butlers gateway` driven by
the official `mcp` client, with the mock children of test_gateway."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import free_port
from tests.fakes.mock_mcp import TOOLS as MOCK_TOOLS
from tests.fakes.mock_mcp import lists_read_once_settled
from tests.test_cli_client import run_cli
from tests.test_gateway import MOCK, mcp_json, stdio_host, text_of

CONTROL = ["gateway_activate", "gateway_deactivate", "gateway_status"]
MOCK_NAMES = [t["name"] for t in MOCK_TOOLS]


async def test_activate_mode_lists_only_the_gateway_tools_until_a_child_is_activated(
    tmp_path: Path,
) -> None:
    mcp_json(tmp_path, "plain")
    mcp_json(tmp_path, "framed", "--framing", "content-length")
    # --mode wins over the file.
    (tmp_path / "gateway.toml").write_text('mode = "both"\n')
    async with stdio_host(tmp_path, "--mode", "activate") as host:
        assert sorted(await host.tools()) == CONTROL
        status = await host.status()
        assert set(status) == {"plain", "framed"} and status["plain"]["suite"] is None
        result = await host.call("plain_suite", action="introspect")
        assert result.is_error  # there is no suite tool to call

        result = await host.call("gateway_activate", name="plain")
        assert result.structured_content["tools"] == MOCK_NAMES
        await host.wait_list_changed(1)
        assert sorted(await host.tools()) == sorted(CONTROL + MOCK_NAMES)
        assert text_of(await host.call("add", a=2, b=40)) == "42"

        result = await host.call("gateway_deactivate", name="plain")
        assert result.structured_content["removed"] == MOCK_NAMES
        await host.wait_list_changed(2)
        assert sorted(await host.tools()) == CONTROL
        result = await host.call("gateway_activate", name="nobody")
        assert result.is_error and "no MCP server named 'nobody'" in text_of(result)


async def test_both_mode_swaps_a_suite_for_its_tools_and_introspect_takes_a_verbosity(
    tmp_path: Path,
) -> None:
    mcp_json(tmp_path, "plain")
    mcp_json(tmp_path, "framed", "--framing", "content-length")
    (tmp_path / "gateway.toml").write_text(
        'mode = "both"\n[introspection]\nmode = "redacted"\nsummary_max_chars = 12\n'
    )
    async with stdio_host(tmp_path) as host:
        suites = ["framed_suite", "plain_suite"]
        assert sorted(await host.tools()) == sorted(CONTROL + suites)

        await host.call("gateway_activate", name="plain")
        await host.wait_list_changed(1)
        assert sorted(await host.tools()) == sorted([*CONTROL, "framed_suite", *MOCK_NAMES])
        await host.call("gateway_deactivate", name="plain")
        await host.wait_list_changed(2)
        assert sorted(await host.tools()) == sorted(CONTROL + suites)
        assert text_of(await host.suite("plain_suite", "call", "add", a=1, b=2)) == "3"

        # The configured mode (redacted), then each verbosity asked for in the call.
        def introspected(result) -> dict[str, dict]:
            assert not result.is_error, text_of(result)
            return {t["name"]: t for t in result.structured_content["tools"]}

        tools = introspected(await host.suite("plain_suite", "introspect"))
        assert "summary" not in tools["add"]
        tools = introspected(await host.call("plain_suite", action="introspect", verbosity="full"))
        assert tools["add"]["summary"] == "Add two   numbers\n   together."
        assert tools["long_description"]["summary"] == MOCK_TOOLS[3]["description"]
        tools = introspected(
            await host.call("plain_suite", action="introspect", verbosity="summary")
        )
        assert all(len(t["summary"]) <= 12 for t in tools.values())
        result = await host.call("plain_suite", action="introspect", verbosity="loud")
        assert result.is_error and "verbosity must be one of summary, full, redacted" in (
            text_of(result)
        )


async def test_a_renamed_tool_never_takes_another_servers_name(tmp_path: Path) -> None:
    """`a` has `echo` and its own `b_echo`; `b`'s `echo`, renamed `b_echo`, shadowed `a`'s,
    and deactivating `b` removed `a`'s from the host's list (a walkthrough). Now it is
    `b_echo_2`."""
    mcp_json(tmp_path, "a", "--odd-tool", "b_echo")
    mcp_json(tmp_path, "b")
    async with stdio_host(tmp_path, "--mode", "activate") as host:
        await host.call("gateway_activate", name="a")
        result = await host.call("gateway_activate", name="b")
        assert "b_echo_2" in result.structured_content["tools"], result.structured_content
        assert text_of(await host.call("b_echo")) == "ok"  # a's own (the mock's odd tool)
        assert text_of(await host.call("b_echo_2", message="from b")) == "from b"
        await host.call("gateway_deactivate", name="b")
        assert "b_echo" in await host.tools() and "b_echo_2" not in await host.tools()


async def test_a_tool_whose_name_is_no_tools_name_is_left_out(tmp_path: Path) -> None:
    """A child lists a tool named with a line break (it forged a line of the listing) and one
    with a terminal escape: left out of the listing, the host's tool list and the search, with
    a warning naming them as written; a name as MCP has them (`admin.tools/list`) stays."""
    mcp_json(
        tmp_path,
        "odd",
        *("--odd-tool", "bad\nname  Forged line"),
        *("--odd-tool", "\x1b]52;c;x\x07esc"),
        *("--odd-tool", "admin.tools/list"),
    )
    code, out, err = await run_cli("gateway", "--dry-run", "--no-butlers", "--dir", str(tmp_path))
    assert code == 0, (out, err)
    assert "odd (mcp, ready): 5 subtools, suite odd_suite" in out.splitlines()
    assert "Forged line" not in out and "\x1b" not in out
    assert "admin.tools/list" in out
    assert "2 tool(s) left out, their names not a tool's" in err
    assert "'bad\\nname  Forged line'" in err and "\x1b" not in err
    async with stdio_host(tmp_path, "--mode", "activate") as host:
        activated = await host.call("gateway_activate", name="odd")
        assert not activated.is_error, text_of(activated)
        tools = await host.tools()
        assert "admin.tools/list" in tools or "odd_admin.tools/list" in tools
        assert not [t for t in tools if "\n" in t or "\x1b" in t]


async def test_dry_run_lists_children_states_and_subtools_and_fails_on_a_broken_one(
    tmp_path: Path,
) -> None:
    mcp_json(tmp_path, "plain")
    mcp_json(tmp_path, "mute", "--silent")
    (tmp_path / "gateway.toml").write_text(
        '[timeouts]\nrpc_ms = 300\n[suites.plain.expose]\ndeny = ["crash"]\n'
    )
    code, out, err = await run_cli("gateway", "--dry-run", "--no-butlers", "--dir", str(tmp_path))
    assert code == 1, (out, err)  # mute never answers
    lines = out.splitlines()
    assert lines[0] == "mode: suite, 2 children"
    assert "plain (mcp, ready): 3 subtools, suite plain_suite" in lines
    assert any(line.split() == ["add", "Add", "two", "numbers", "together."] for line in lines)
    assert not any(line.split()[:1] == ["crash"] for line in lines)  # denied
    assert (
        "mute (mcp, error): child 'mute': no answer to initialize within 300 ms (timeouts.rpc_ms)"
    ) in lines

    (tmp_path / "mcps" / "mute" / ".mcp.json").unlink()
    code, out, err = await run_cli(
        "gateway",
        "--dry-run",
        "--json",
        "--mode",
        "activate",
        "--no-butlers",
        "--dir",
        str(tmp_path),
    )
    assert code == 0, err
    listing = json.loads(out)
    assert listing["mode"] == "activate"
    [plain] = listing["children"]
    assert (plain["state"], plain["suite"]) == ("ready", None)
    assert [t["name"] for t in plain["subtools"]] == ["echo", "add", "long_description"]


async def test_dry_run_shows_an_unreachable_remote_child_in_error(tmp_path: Path) -> None:
    """A remote child nobody listens on is a child in error, not a traceback (FastMCP's
    client raised the transport's error again when the failed connection was closed)."""
    (tmp_path / ".mcp.json").write_text(
        json.dumps(
            {"mcpServers": {"dead": {"type": "http", "url": f"http://127.0.0.1:{free_port()}/mcp"}}}
        )
    )
    code, out, err = await run_cli("gateway", "--dry-run", "--no-butlers", "--dir", str(tmp_path))
    assert code == 1, (out, err)
    assert "Traceback" not in err
    assert any(
        line.startswith("dead (mcp, error): child 'dead': cannot connect to")
        for line in out.splitlines()
    )


async def test_dry_run_fails_when_the_butlers_cannot_be_listed(tmp_path: Path) -> None:
    """The switchboard did not answer: the dry run said "2 children" and exited 0, nothing
    of the butlers (a walkthrough). It names them in error, and fails."""
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {}}))
    url = f"http://127.0.0.1:{free_port()}/sse"  # nobody listens
    code, out, err = await run_cli("gateway", "--dry-run", "--url", url, "--dir", str(tmp_path))
    assert code == 1, (out, err)
    assert (
        f"butlers (error): no butlers behind the gateway: cannot reach the switchboard at {url}"
        in out
    ), out


async def test_a_flood_of_list_changed_is_read_a_few_times_and_tells_the_host_nothing(
    tmp_path: Path,
) -> None:
    """A child says 500 times at once that its tools changed (they did not): the gateway
    reads its list a few times, not 500, and tells the host nothing (3000 notices were 3000
    readings and 3000 host notifications: a walkthrough)."""
    lists = tmp_path / "lists"
    child = tmp_path / "mcps" / "plain"
    child.mkdir(parents=True)
    command = {
        "cmd": sys.executable,
        "args": [MOCK, "--flood"],
        "env": {"MOCK_MCP_LISTS": str(lists)},
    }
    (child / ".mcp.json").write_text(json.dumps({"name": "plain", "command": command}))
    async with stdio_host(tmp_path, "--mode", "activate") as host:
        activated = await host.call("gateway_activate", name="plain")
        assert not activated.is_error, text_of(activated)
        seen = host.list_changed
        result = await host.call("flood", n=500)
        assert text_of(result) == "flooded"

        last = await lists_read_once_settled(lists)
        assert last <= 5, last  # the first listing, then a few at most
        assert host.list_changed == seen
        assert "flood" in await host.tools()
