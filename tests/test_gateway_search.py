"""`butlers gateway --mode search` with the real MCP servers from npm (filesystem, memory,
everything): the host sees only the gateway's own four tools, finds the children's tools in
plain words, reads one's schema and calls it through the suite call's path (expose, timeouts,
redaction, tracing); and the index follows a child whose tools change."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from butlers.gateway.search import Entry, SearchIndex, words
from butlers.gateway.server import SEARCH_RETRY_S, search_retry_after_s
from tests.conftest import StartButler
from tests.fakes.otlp import OtlpReceiver
from tests.test_gateway import Host, child_pids, mcp_json, stdio_host, text_of
from tests.test_gateway_npm import project_with_npm_servers
from tests.test_gateway_tracing import PARENT_ID, SECRET, TRACE_ID

SEARCH_TOOLS = ["gateway_call", "gateway_describe", "gateway_search", "gateway_status"]
# Plain requests and the tool each must find among the first three (written before tuning).
REQUESTS = [
    ("write a file", "files", "write_file"),
    ("add two numbers", "everything", "get-sum"),
    ("read a text file", "files", "read_text_file"),
    ("list the files in a directory", "files", "list_directory"),
    ("show the environment variables", "everything", "get-env"),
    ("search the knowledge graph", "memory", "search_nodes"),
    ("echo back a message", "everything", "echo"),
    ("compress a file with gzip", "everything", "gzip-file-as-resource"),
    ("find files matching a pattern", "files", "search_files"),
    ("get a file's size and modification time", "files", "get_file_info"),
]


def search_project(root: Path, bin_dir: Path, toml: str) -> Path:
    project = project_with_npm_servers(root, bin_dir)
    (project / "gateway.toml").write_text(toml)
    return project


async def search(host: Host, query: str, limit: int = 3) -> list[dict[str, str]]:
    result = await host.call("gateway_search", query=query, limit=limit)
    assert not result.is_error, text_of(result)
    found: list[dict[str, str]] = result.structured_content["result"]
    return found


async def test_search_mode_lists_four_tools_and_finds_tools_in_plain_words(
    tmp_path: Path, npm_servers: Path
) -> None:
    toml = 'mode = "search"\n[suites.files]\nexpose.deny = ["move_file"]\n'
    project = search_project(tmp_path, npm_servers, toml)
    async with stdio_host(project, env={"MEMORY_FILE": str(tmp_path / "m.jsonl")}) as host:
        assert sorted(await host.tools()) == SEARCH_TOOLS
        for query, server, name in REQUESTS:
            found = await search(host, query)
            assert {"name": name, "server": server} in [
                {"name": f["name"], "server": f["server"]} for f in found
            ], (query, found)
            assert all(set(f) == {"name", "server", "summary"} for f in found)
            assert all(len(f["summary"]) <= 160 for f in found), found
        # A tool its server's expose keeps back is never found.
        found = await search(host, "move or rename a file", limit=20)
        assert found and "move_file" not in [f["name"] for f in found], found
        # Bad input: refused, naming the argument.
        result = await host.call("gateway_search", query="a file", limit=0)
        assert result.is_error and "'limit' must be a whole number from 1 to 50" in text_of(result)
        result = await host.call("gateway_search", query="  ")
        assert result.is_error and "'query' must be a non-empty string" in text_of(result)


async def test_describe_and_call_through_the_suite_path(tmp_path: Path, npm_servers: Path) -> None:
    toml = '[suites.files]\nexpose.deny = ["move_file"]\n'
    project = search_project(tmp_path, npm_servers, toml)
    env = {"MEMORY_FILE": str(tmp_path / "m.jsonl")}
    async with stdio_host(project, "--mode", "search", "--lazy", env=env) as host:
        [first, *_] = await search(host, "write a file")
        assert (first["name"], first["server"]) == ("write_file", "files")

        result = await host.call("gateway_describe", name=first["name"])
        assert not result.is_error, text_of(result)
        described = result.structured_content
        assert described["server"] == "files"
        assert set(described["inputSchema"]["required"]) == {"path", "content"}
        assert described["description"].startswith("Create a new file or completely overwrite")
        # The child's hints, for a host that asks its user by them.
        assert described["annotations"]["destructiveHint"] is True
        assert described["annotations"]["readOnlyHint"] is False

        target = project / "files" / "written.txt"
        arguments = {"path": str(target), "content": "through gateway_call\n"}
        result = await host.call("gateway_call", name=first["name"], arguments=arguments)
        assert not result.is_error, text_of(result)
        assert target.read_text() == "through gateway_call\n"

        result = await host.call("gateway_call", name="get-sum", arguments={"a": 2, "b": 3})
        assert not result.is_error and "5" in text_of(result), text_of(result)
        result = await host.call("gateway_call", name="everything/echo", arguments={"message": "x"})
        assert not result.is_error and "x" in text_of(result), text_of(result)

        moved = {"source": str(target), "destination": str(target.with_suffix(".moved"))}
        for tool in ("gateway_call", "gateway_describe"):
            result = await host.call(tool, name="move_file", arguments=moved)
            assert result.is_error and text_of(result) == (
                f"{tool}: tool 'move_file' of server 'files' is not allowed "
                "(expose in [suites.files])"
            )
        assert target.exists() and not target.with_suffix(".moved").exists()

        result = await host.call("gateway_call", name="launch_rockets", arguments={})
        assert result.is_error and text_of(result) == (
            "gateway_call: no tool named 'launch_rockets' behind the gateway "
            "(gateway_search finds tools)"
        )
        result = await host.call("gateway_call", name="files/write_file", arguments=[1])
        assert result.is_error and "'arguments' must be an object" in text_of(result)
        status = await host.status()
        assert status["files"]["suite"] is None and status["files"]["state"] == "ready"


async def test_the_index_follows_a_child_whose_tools_change(tmp_path: Path) -> None:
    """The mock child's `grow` adds a tool and sends tools/list_changed: the next searches
    find it (the gateway reads the list again; the index sees a new list)."""
    mcp_json(tmp_path, "plain", "--extras")  # `grow` among its tools
    async with stdio_host(tmp_path, "--mode", "search") as host:
        assert [f["name"] for f in await search(host, "later")] == []
        result = await host.call("gateway_call", name="grow", arguments={})
        assert text_of(result) == "grown", text_of(result)
        async with asyncio.timeout(10):
            # The sentinel is the gateway's own answer: found once it has read the list again.
            while not await search(host, "later"):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        [found] = await search(host, "later")
        assert found == {"name": "extra", "server": "plain", "summary": "Added later."}
        result = await host.call("gateway_call", name="extra", arguments={})
        assert text_of(result) == "ok", text_of(result)


async def test_a_server_that_never_starts_holds_up_one_search_and_no_call(
    tmp_path: Path,
) -> None:
    """A child that never answers its initialize (its timeout ten minutes away): the first
    search waits a few seconds for it, then answers from the others; later searches and a
    call of the others' tools do not wait for it at all. (Every search and call waited for
    it to the end: a walkthrough with a hung server.) The bound is the test's, not a timing:
    waiting for the hung child would never end within it."""
    mcp_json(tmp_path, "plain")
    mcp_json(tmp_path, "hung", "--silent")
    (tmp_path / "gateway.toml").write_text("[timeouts]\nrpc_ms = 600000\n")
    async with stdio_host(tmp_path, "--mode", "search") as host:
        async with asyncio.timeout(60):
            found = await search(host, "echo back a message")
            assert [(f["name"], f["server"]) for f in found][:1] == [("echo", "plain")]
            assert (await host.status())["hung"]["state"] == "warming"
            again = await search(host, "echo back a message")
            assert again == found
            result = await host.call("gateway_call", name="echo", arguments={"message": "hi"})
            assert not result.is_error and text_of(result) == "hi", text_of(result)


async def test_a_call_of_a_known_tool_never_waits_for_a_failing_server(tmp_path: Path) -> None:
    """A server that hangs at start fails (rpc_ms) and is tried again by searches; a call of
    a healthy server's tool named in the index neither waits for it nor starts it again (one
    call stalled 8 s every 74 s: a walkthrough). Its spawns are counted: the mock writes its
    pid at each."""
    mcp_json(tmp_path, "plain")
    mcp_json(tmp_path, "hung", "--silent")
    (tmp_path / "gateway.toml").write_text("[timeouts]\nrpc_ms = 1000\n")
    async with stdio_host(tmp_path, "--mode", "search") as host:
        await search(host, "echo back a message")
        async with asyncio.timeout(30):
            while (await host.status())["hung"]["state"] != "error":  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        spawned = len(child_pids(tmp_path))
        await asyncio.sleep(SEARCH_RETRY_S + 1)  # past the time a search tries it again
        result = await host.call("gateway_call", name="echo", arguments={"message": "hi"})
        assert not result.is_error and text_of(result) == "hi", text_of(result)
        assert len(child_pids(tmp_path)) == spawned  # not started again for the call


def test_a_server_failing_again_and_again_is_tried_less_and_less_often() -> None:
    waits = [search_retry_after_s(failures) for failures in range(1, 9)]
    assert waits == [10, 20, 40, 80, 160, 320, 600, 600]


def test_a_name_two_servers_share_is_qualified() -> None:
    """`echo` of two servers: each result names what gateway_call takes, `server/echo`;
    the bare name means both."""
    tools: dict[str, list[dict[str, Any]]] = {
        "one": [{"name": "echo", "description": "Echo a message."}],
        "two": [{"name": "echo", "description": "Echo it back."}, {"name": "getSum"}],
    }
    entries = [Entry(server, tool) for server, listed in tools.items() for tool in listed]
    index = SearchIndex.build(entries, list(tools.items()))
    assert [index.callable_name(e) for e in index.search("echo", 5)] == ["one/echo", "two/echo"]
    assert [e.server for e in index.resolve("echo")] == ["one", "two"]
    assert [e.server for e in index.resolve("two/echo")] == ["two"]
    assert index.callable_name(entries[2]) == "getSum"
    assert index.fresh(list(tools.items()))
    assert not index.fresh([("one", tools["one"]), ("two", [*tools["two"]])])  # a new list


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("list_directory_with_sizes", ["list", "directory", "siz"]),
        ("get-sum", ["get", "sum"]),
        ("readMultipleFiles", ["read", "multipl", "fil"]),
        ("Entries of the graph", ["entry", "graph"]),
    ],
)
def test_words_split_names_and_fold_plurals(text: str, expected: list[str]) -> None:
    assert words(text) == expected


@pytest.mark.parametrize(
    ("forms"),
    [
        # The S-stemmer alone made these "compresse", "searche", "matche", "processe": a
        # request in the base word missed "Compresses a single file" (a walkthrough).
        ("compress", "compresses"),
        ("search", "searches"),
        ("match", "matches"),
        ("process", "processes"),
        ("box", "boxes"),
        ("file", "files"),
        ("cache", "caches"),
        ("schedule", "schedules", "scheduled"),
        ("directory", "directories"),
    ],
)
def test_a_words_forms_fold_alike(forms: tuple[str, ...]) -> None:
    assert len({tuple(words(form)) for form in forms}) == 1, [words(f) for f in forms]


async def test_a_tool_several_servers_have_alike_is_one_result(tmp_path: Path) -> None:
    """Every butler has `state_set`: four copies of each tool filled a fleet's five results
    (a walkthrough). One result, the others named in its `also`."""
    mcp_json(tmp_path, "one")
    mcp_json(tmp_path, "two")
    async with stdio_host(tmp_path, "--mode", "search") as host:
        found = await search(host, "echo back a message", limit=2)
    assert found[0]["name"] == "one/echo" and found[0]["also"] == ["two/echo"], found
    assert len({f["name"] for f in found}) == 2 and "two/echo" not in [f["name"] for f in found]


async def test_gateway_call_is_a_suite_call_span_with_arguments_redacted(
    tmp_path: Path, otlp: OtlpReceiver
) -> None:
    """gateway_call takes the suite call's path: its `gateway.suite_call` span is in the
    host's trace, and the suite's `redact` keys are masked there and in the debug log (where
    FastMCP logs the gateway_call arguments, the child's nested inside) while the child gets
    them unchanged."""
    mcp_json(tmp_path, "plain")
    (tmp_path / "gateway.toml").write_text(
        'mode = "search"\n[suites.plain]\nredact = ["message"]\n'
    )
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url("http"),
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "BUTLERS_LOG_LEVEL": "debug",
    }
    async with stdio_host(tmp_path, env=env) as host:
        call = {"name": "echo", "arguments": {"message": SECRET}}
        meta: Any = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        result = await host.client.call_tool("gateway_call", call, meta=meta)
        assert text_of(result) == SECRET  # the child got it unchanged
    spans = await otlp.wait_for(lambda spans: "gateway.suite_call" in {s.name for s in spans})
    [span] = [s for s in spans if s.name == "gateway.suite_call"]
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert (span.attributes["child"], span.attributes["subtool"]) == ("plain", "echo")
    assert span.attributes["via"] == "gateway_call"
    assert json.loads(span.attributes["arguments"])["args"] == {"message": "[redacted]"}
    log = (tmp_path / "gateway.stderr").read_text()
    assert "Handler called: call_tool gateway_call" in log
    assert SECRET not in log and SECRET not in json.dumps([s.attributes for s in spans])


async def test_a_butler_down_when_the_gateway_started_is_found_once_it_is_back(
    start_butler: StartButler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In search mode a butler that was down at the gateway's start had no tool to call, so
    no call restarted it: it stayed unknown for the host's whole session (a walkthrough).
    A search tries it again (at most every SEARCH_RETRY_S), and it is found."""
    from dataclasses import replace

    from butlers.gateway import server
    from butlers.gateway.run import GatewayOptions, build_gateway
    from tests.test_route import make_fleet

    monkeypatch.setattr(server, "SEARCH_RETRY_S", 0.0, raising=False)
    fleet = await make_fleet(start_butler, tmp_path, names=("general",))
    general = fleet.targets["general"]
    config, port, database = general.config, general.port, general.config.database
    await general.stop()

    async def registry() -> list[dict[str, Any]]:
        return [{"name": "general", "endpoint_url": general.sse_url, "description": "g"}]

    options = GatewayOptions(directory=tmp_path, environ={}, mode="search")
    gateway, _ = await build_gateway(options, registry)
    try:
        await gateway.warm_all()
        assert gateway.slots["general"].state == "error"
        await start_butler(replace(config, port=port), database=database)
        called = await gateway.mcp.call_tool(
            "gateway_call", {"name": "general/state_get", "arguments": {"key": "k"}}
        )
        assert not called.is_error
    finally:
        await gateway.close()
