"""The children's prompts and resources through the gateway, in every mode: the real npm
`server-everything` behind the real `butlers gateway` over stdio (prompts with arguments, static
resources, templates, a blob, roots answered with `--dir`), a FastMCP child whose lists change
at run time (tests/fakes/lists_mcp.py), children added and removed while a host is connected
over SSE, the spans of prompts/get and resources/read, and a hostile raw JSON-RPC child
(tests/fakes/hostile_mcp.py): endless paging, a list never answered, an invalid prompt, line
breaks in what it logs, a catch-all template, a prompt name that collides."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.shared.exceptions import MCPError

from butlers.gateway.children import ChildSpec
from butlers.gateway.config import load_gateway_config
from butlers.gateway.passthrough import SERVER_META
from butlers.gateway.server import Gateway
from butlers.logs import TextFormatter
from tests.fakes.lists_mcp import build_lists
from tests.fakes.otlp import OtlpReceiver
from tests.fakes.peer_mcp import serve_peer_over_sse
from tests.npm_servers import PREFIX
from tests.test_gateway import Host, mcp_json, stdio_host, text_of

LISTS = str(Path(__file__).resolve().parent / "fakes" / "lists_mcp.py")
EVERYTHING_DOCS = PREFIX / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist"
STATIC = "demo://resource/static/document/architecture.md"
PROMPTS_CHANGED = "notifications/prompts/list_changed"
RESOURCES_CHANGED = "notifications/resources/list_changed"


def everything_project(root: Path, bin_dir: Path) -> Path:
    project = root / "project"
    project.mkdir()
    servers = {"everything": {"command": str(bin_dir / "mcp-server-everything"), "args": ["stdio"]}}
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    return project


def lists_child(directory: Path, name: str, secret: str = "") -> None:
    """The FastMCP child of tests/fakes/lists_mcp.py, declared in an `mcps/<name>/.mcp.json`."""
    child = directory / "mcps" / name
    child.mkdir(parents=True)
    env = {"LISTS_MCP_TAG": name, "LISTS_MCP_SECRET": secret, "FASTMCP_LOG_LEVEL": "WARNING"}
    command = {"cmd": sys.executable, "args": [LISTS], "env": env}
    (child / ".mcp.json").write_text(json.dumps({"name": name, "command": command}))


async def ready(host: Host, name: str, timeout_s: float = 60) -> None:
    """Until the gateway says the child runs (a cold npm start takes a while)."""
    async with asyncio.timeout(timeout_s):
        while (await host.status())[name]["state"] != "ready":  # noqa: ASYNC110 - its answer
            await asyncio.sleep(0.05)


def told(notifications: list[Any], method: str) -> int:
    return sum(1 for n in notifications if getattr(n, "method", "") == method)


async def wait_told(notifications: list[Any], method: str, count: int) -> None:
    async with asyncio.timeout(10):
        while told(notifications, method) < count:  # noqa: ASYNC110 - the client's handler fills it
            await asyncio.sleep(0.02)


async def prompt_names(client: ClientSession) -> set[str]:
    return {p.name for p in (await client.list_prompts()).prompts}


async def resource_uris(client: ClientSession) -> set[str]:
    return {str(r.uri) for r in (await client.list_resources()).resources}


async def everything_call(host: Host, mode: str, tool: str) -> str:
    """One of the everything server's tools, called the way `mode` offers it."""
    if mode == "search":
        return text_of(await host.call("gateway_call", name=tool, arguments={}))
    if mode == "activate":
        await host.call("gateway_activate", name="everything")
        return text_of(await host.call(tool))
    return text_of(await host.suite("everything_suite", "call", tool))


@pytest.mark.parametrize("mode", ["suite", "activate", "both", "search"])
async def test_the_everything_servers_prompts_resources_and_roots_in_every_mode(
    mode: str, tmp_path: Path, npm_servers: Path
) -> None:
    project = everything_project(tmp_path, npm_servers)
    async with stdio_host(project, "--mode", mode) as host:
        client = host.client
        await ready(host, "everything")

        prompts = {p.name: p for p in (await client.list_prompts()).prompts}
        assert {"everything_simple-prompt", "everything_args-prompt"} <= set(prompts)
        args_prompt = prompts["everything_args-prompt"]
        assert (args_prompt.meta or {})[SERVER_META] == "everything"
        assert [(a.name, a.required) for a in args_prompt.arguments or []] == [
            ("city", True),
            ("state", False),
        ]
        got = await client.get_prompt("everything_args-prompt", {"city": "Oslo", "state": "Ohio"})
        [message] = got.messages
        assert (message.role, getattr(message.content, "text", None)) == (
            "user",
            "What's weather in Oslo, Ohio?",
        )

        resources = {str(r.uri): r for r in (await client.list_resources()).resources}
        assert STATIC in resources  # the URI exactly as the server gave it
        assert (resources[STATIC].meta or {})[SERVER_META] == "everything"
        assert resources[STATIC].name == "everything_architecture.md"
        [content] = (await client.read_resource(STATIC)).contents
        assert (
            getattr(content, "text", None)
            == (EVERYTHING_DOCS / "docs" / "architecture.md").read_text()
        )
        templates = {
            t.uri_template for t in (await client.list_resource_templates()).resource_templates
        }
        assert "demo://resource/dynamic/text/{resourceId}" in templates
        [content] = (await client.read_resource("demo://resource/dynamic/text/7")).contents
        assert getattr(content, "text", "").startswith("Resource 7: ")  # only a template has it
        [content] = (await client.read_resource("demo://resource/dynamic/blob/8")).contents
        assert base64.b64decode(getattr(content, "blob", "")).startswith(b"Resource 8: ")

        with pytest.raises(MCPError, match="'everything_no-such-prompt'"):
            await client.get_prompt("everything_no-such-prompt", {})
        with pytest.raises(MCPError, match="'demo://nowhere/x'"):
            await client.read_resource("demo://nowhere/x")
        assert "everything_simple-prompt" in await prompt_names(client)  # still serving

        # The server offers get-roots-list only to a client with roots; it got --dir.
        roots = await everything_call(host, mode, "get-roots-list")
        assert f"URI: {project.as_uri()}" in roots, roots


@pytest.mark.proc  # its children are processes
async def test_a_child_that_adds_a_prompt_and_a_resource_tells_the_host(tmp_path: Path) -> None:
    lists_child(tmp_path, "notes")
    async with stdio_host(tmp_path) as host:
        client = host.client
        initialized = client.initialize_result
        assert initialized is not None
        capabilities = initialized.capabilities  # what the gateway announces
        assert capabilities.prompts is not None and capabilities.prompts.list_changed
        assert capabilities.resources is not None and capabilities.resources.list_changed
        await ready(host, "notes")
        assert await prompt_names(client) == {"notes_greet"}
        got = await client.get_prompt("notes_greet", {"name": "Ann"})
        assert getattr(got.messages[0].content, "text", None) == "Hello, Ann, from notes!"
        prompts_told = told(host.notifications, PROMPTS_CHANGED)
        resources_told = told(host.notifications, RESOURCES_CHANGED)

        result = await host.suite("notes_suite", "call", "add_prompt", name="bye", text="Bye!")
        assert text_of(result) == "added"
        await wait_told(host.notifications, PROMPTS_CHANGED, prompts_told + 1)
        assert await prompt_names(client) == {"notes_greet", "notes_bye"}
        got = await client.get_prompt("notes_bye", {})
        assert getattr(got.messages[0].content, "text", None) == "Bye!"

        result = await host.suite(
            "notes_suite", "call", "add_resource", uri="note://notes/new", text="fresh"
        )
        assert text_of(result) == "added"
        await wait_told(host.notifications, RESOURCES_CHANGED, resources_told + 1)
        assert "note://notes/new" in await resource_uris(client)
        [content] = (await client.read_resource("note://notes/new")).contents
        assert getattr(content, "text", None) == "fresh"


@pytest.mark.proc  # its children are processes
async def test_a_child_without_prompts_or_not_running_is_left_out_never_a_failure(
    tmp_path: Path,
) -> None:
    """A tools-only child (its capabilities offer no prompts or resources) is never asked
    for them; a child in error is absent (one that crashes leaves, and the host is told); the
    others' lists come through."""
    lists_child(tmp_path, "notes")
    lists_child(tmp_path, "fragile")
    mcp_json(tmp_path, "plain")  # tests/fakes/mock_mcp.py: {"tools": {}} only
    (tmp_path / "mcps" / "gone").mkdir()
    missing = {"cmd": str(tmp_path / "no-such-server")}
    (tmp_path / "mcps" / "gone" / ".mcp.json").write_text(
        json.dumps({"name": "gone", "command": missing})
    )
    async with stdio_host(tmp_path) as host:
        client = host.client
        for name in ("notes", "plain", "fragile"):
            await ready(host, name)
        assert (await host.status())["gone"]["state"] == "error"
        assert await prompt_names(client) == {"notes_greet", "fragile_greet"}
        prompts_told = told(host.notifications, PROMPTS_CHANGED)
        resources_told = told(host.notifications, RESOURCES_CHANGED)
        assert (await host.suite("fragile_suite", "call", "exit")).is_error
        await wait_told(host.notifications, PROMPTS_CHANGED, prompts_told + 1)
        await wait_told(host.notifications, RESOURCES_CHANGED, resources_told + 1)
        assert await prompt_names(client) == {"notes_greet"}
        assert "note://fragile/secret" not in await resource_uris(client)
        assert await text_at(client, "note://shared") == "shared note of notes"
        templates = (await client.list_resource_templates()).resource_templates
        assert [t.uri_template for t in templates] == ["note://notes/page/{n}"]
    log = (tmp_path / "gateway.stderr").read_text()
    assert "child 'plain'" not in log, log  # not asked: no "prompts/list failed" about it


@contextlib.asynccontextmanager
async def sse_host(url: str) -> AsyncIterator[Host]:
    notifications: list[Any] = []

    async def handler(message: Any) -> None:
        notifications.append(message)

    async with (
        sse_client(url) as (read, write),
        ClientSession(read, write, message_handler=handler) as client,
    ):
        await client.initialize()
        yield Host(client, notifications)


def lists_spec(directory: Path, name: str) -> ChildSpec:
    env = {"LISTS_MCP_TAG": name, "FASTMCP_LOG_LEVEL": "WARNING"}
    return ChildSpec(name, cmd=sys.executable, args=(LISTS,), env=env, cwd=directory)


async def text_at(client: ClientSession, uri: str) -> str | None:
    [content] = (await client.read_resource(uri)).contents
    return getattr(content, "text", None)


@pytest.mark.proc  # its children are processes
async def test_children_added_and_removed_while_running_join_and_leave_the_lists(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Gateway.add_child / remove_child (hot reload's half), a host over SSE: the lists follow
    and the host is told; a URI two children list is the first's (config order), said once."""
    config = load_gateway_config(tmp_path)
    gateway = Gateway(config, [lists_spec(tmp_path, "first")], environ=dict(os.environ))
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    try:
        await gateway.warm_all()
        async with serve_peer_over_sse(gateway.mcp) as (url, _), sse_host(url) as host:
            client, notes = host.client, host.notifications
            assert await prompt_names(client) == {"first_greet"}
            assert await text_at(client, "note://shared") == "shared note of first"

            await gateway.add_child(lists_spec(tmp_path, "second"))
            await wait_told(notes, PROMPTS_CHANGED, 1)
            await wait_told(notes, RESOURCES_CHANGED, 1)
            assert await prompt_names(client) == {"first_greet", "second_greet"}
            assert {"note://first/secret", "note://second/secret"} <= await resource_uris(client)
            assert await text_at(client, "note://shared") == "shared note of first"
            assert await text_at(client, "note://second/page/4") == "page 4 of second"
            await resource_uris(client)  # listed again: still said once
            duplicates = [r for r in caplog.records if "note://shared" in r.getMessage()]
            assert len(duplicates) == 1, [r.getMessage() for r in duplicates]
            assert "'first'" in duplicates[0].getMessage()

            await gateway.remove_child("first")
            await wait_told(notes, PROMPTS_CHANGED, 2)
            await wait_told(notes, RESOURCES_CHANGED, 2)
            assert await prompt_names(client) == {"second_greet"}
            assert "note://first/secret" not in await resource_uris(client)
            assert await text_at(client, "note://shared") == "shared note of second"
            with pytest.raises(MCPError, match="'note://first/page/1'"):
                await client.read_resource("note://first/page/1")
    finally:
        await gateway.close()


@pytest.mark.proc  # its child is a process
async def test_an_idle_child_keeps_its_prompts_listed_and_is_started_by_a_get(
    tmp_path: Path,
) -> None:
    """`idle_timeout_s` stops a child, not its prompts: they stay listed (listing does not
    start it again), and a prompts/get starts it."""
    (tmp_path / "gateway.toml").write_text("[suites.notes]\nidle_timeout_s = 1\n")
    config = load_gateway_config(tmp_path)
    gateway = Gateway(config, [lists_spec(tmp_path, "notes")], environ=dict(os.environ))
    child = gateway.slots["notes"].child
    try:
        await gateway.warm_all()
        async with serve_peer_over_sse(gateway.mcp) as (url, _), sse_host(url) as host:
            client = host.client
            assert await prompt_names(client) == {"notes_greet"}
            async with asyncio.timeout(30):
                while child.running():  # noqa: ASYNC110 - the idle stop has no event of its own
                    await asyncio.sleep(0.05)
            assert await prompt_names(client) == {"notes_greet"}
            assert "note://shared" in await resource_uris(client)
            assert not child.running()  # listing did not start it
            got = await client.get_prompt("notes_greet", {"name": "Cy"})
            assert getattr(got.messages[0].content, "text", None) == "Hello, Cy, from notes!"
            assert await prompt_names(client) == {"notes_greet"}
    finally:
        await gateway.close()


async def test_a_remote_child_over_streamable_http_passes_through_too(tmp_path: Path) -> None:
    """A `/mcp` child (FastMCP's client under the gateway): its prompts, resources and
    templates pass through as a stdio child's do. (A FastMCP server on the 2026-07-28 revision
    announces no list changes and cannot ask its client for roots: neither is tried here.)"""
    config = load_gateway_config(tmp_path)
    async with serve_peer_over_sse(build_lists("far", ""), transport="http") as (far, _):
        spec = ChildSpec("far", url=far)
        gateway = Gateway(config, [spec], environ=dict(os.environ), directory=tmp_path)
        try:
            await gateway.warm_all()
            async with serve_peer_over_sse(gateway.mcp) as (url, _), sse_host(url) as host:
                client = host.client
                assert await prompt_names(client) == {"far_greet"}
                got = await client.get_prompt("far_greet", {"name": "Bo"})
                assert getattr(got.messages[0].content, "text", None) == "Hello, Bo, from far!"
                assert await text_at(client, "note://far/page/2") == "page 2 of far"
                resources = {str(r.uri): r for r in (await client.list_resources()).resources}
                assert (resources["note://shared"].meta or {})[SERVER_META] == "far"
                assert await text_at(client, "note://shared") == "shared note of far"
        finally:
            await gateway.close()


SECRET = "s3cret-note-7781"
PROMPT_SECRET = "tok-prompt-4242"


@pytest.mark.proc  # its children are processes
async def test_prompts_get_and_resources_read_are_spans_without_the_contents(
    tmp_path: Path, otlp: OtlpReceiver
) -> None:
    lists_child(tmp_path, "notes", secret=SECRET)
    (tmp_path / "gateway.toml").write_text('[suites.notes]\nredact = ["name"]\n')
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url("http"),
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "BUTLERS_LOG_LEVEL": "debug",
    }
    async with stdio_host(tmp_path, env=env) as host:
        await ready(host, "notes")
        got = await host.client.get_prompt("notes_greet", {"name": PROMPT_SECRET})
        assert PROMPT_SECRET in getattr(got.messages[0].content, "text", "")  # unchanged
        assert await text_at(host.client, "note://notes/secret") == SECRET
    spans = await otlp.wait_for(
        lambda spans: {"gateway.prompt", "gateway.resource"} <= {s.name for s in spans}
    )
    [prompt] = [s for s in spans if s.name == "gateway.prompt"]
    assert (prompt.attributes["child"], prompt.attributes["prompt"]) == ("notes", "greet")
    assert json.loads(prompt.attributes["arguments"]) == {"name": "[redacted]"}
    [resource] = [s for s in spans if s.name == "gateway.resource"]
    assert resource.attributes["child"] == "notes"
    assert resource.attributes["uri"] == "note://notes/secret"
    recorded = json.dumps([s.attributes for s in spans])
    assert SECRET not in recorded and PROMPT_SECRET not in recorded
    assert SECRET not in (tmp_path / "gateway.stderr").read_text()


# -- hostile children (tests/fakes/hostile_mcp.py) ------------------------------------------

HOSTILE = str(Path(__file__).resolve().parent / "fakes" / "hostile_mcp.py")


def hostile_spec(
    directory: Path, name: str, mode: str, *, seen: Path | None = None, prompt: str = "hello"
) -> ChildSpec:
    env = {"HOSTILE_MODE": mode, "HOSTILE_TAG": name, "HOSTILE_PROMPT": prompt}
    if seen is not None:
        env["HOSTILE_SEEN"] = str(seen)
    return ChildSpec(name, cmd=sys.executable, args=(HOSTILE,), env=env, cwd=directory)


def asked(seen: Path, method: str) -> int:
    """How many `method` requests the hostile child received."""
    return seen.read_text().splitlines().count(method) if seen.exists() else 0


def warned(caplog: pytest.LogCaptureFixture, action: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "action", None) == action]


@contextlib.asynccontextmanager
async def gateway_host(
    directory: Path, specs: list[ChildSpec], rpc_ms: int | None = None
) -> AsyncIterator[Host]:
    """An in-process Gateway over `specs`, warmed, and a host connected to it over SSE."""
    if rpc_ms is not None:
        (directory / "gateway.toml").write_text(f"[timeouts]\nrpc_ms = {rpc_ms}\n")
    config = load_gateway_config(directory)
    gateway = Gateway(config, specs, environ=dict(os.environ), directory=directory)
    try:
        await gateway.warm_all()
        async with serve_peer_over_sse(gateway.mcp) as (url, _), sse_host(url) as host:
            yield host
    finally:
        await gateway.close()


@pytest.mark.proc  # its children are processes
@pytest.mark.parametrize(
    ("mode", "asks", "why"),
    [
        ("same_cursor", 2, "a cursor it gave before"),
        ("endless", 100, "more than 100 pages"),
        ("many", 11, "more than 10000 items"),
        ("slow_pages", None, "(timeouts.rpc_ms)"),
    ],
)
async def test_a_child_whose_prompt_list_never_ends_has_none_listed_and_the_others_do(
    mode: str, asks: int | None, why: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review M2: paging stops at a repeated cursor, at 100 pages, at 10,000 items, and when
    the whole list has not come within timeouts.rpc_ms (each page in time). Past any of these
    the child's prompts are absent, said once, not asked again; the other child's are listed.
    (The fake ends its list after 300, 300, 12 or 80 pages: unbounded paging would list it.)"""
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    seen = tmp_path / "seen"
    specs = [
        hostile_spec(tmp_path, "evil", mode, seen=seen),
        hostile_spec(tmp_path, "good", "plain"),
    ]
    async with gateway_host(tmp_path, specs, rpc_ms=2000 if mode == "slow_pages" else None) as host:
        assert await prompt_names(host.client) == {"good_hello"}
        first_asks = asked(seen, "prompts/list")
        if asks is not None:
            assert first_asks == asks
        assert await prompt_names(host.client) == {"good_hello"}
        assert asked(seen, "prompts/list") == first_asks  # not asked again
    [refused] = warned(caplog, "passthrough_list_refused")
    assert "'evil'" in refused and why in refused, refused


@pytest.mark.proc  # its children are processes
async def test_a_child_that_never_answers_its_list_is_waited_for_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review L1: a child silent on prompts/list is asked once per connection (hosts listing
    at once share the one request), not again by every list, prompts/get and resources/read
    of the other children's; the failure is said once."""
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    seen = tmp_path / "seen"
    specs = [
        hostile_spec(tmp_path, "silent", "silent", seen=seen),
        hostile_spec(tmp_path, "good", "plain"),
    ]
    async with gateway_host(tmp_path, specs, rpc_ms=1000) as host:
        client = host.client
        both = await asyncio.gather(prompt_names(client), prompt_names(client))
        assert both == [{"good_hello"}, {"good_hello"}]
        for _ in range(2):
            got = await client.get_prompt("good_hello", {})
            assert getattr(got.messages[0].content, "text", None) == "hello from good"
        assert await prompt_names(client) == {"good_hello"}
        assert asked(seen, "prompts/list") == 1
    # Its own request's timeout or the whole list's, whichever ends first: said once.
    failed = warned(caplog, "passthrough_list_failed") + warned(caplog, "passthrough_list_refused")
    assert len(failed) == 1 and "'silent'" in failed[0], failed


@pytest.mark.proc  # its children are processes
async def test_one_childs_invalid_prompt_leaves_out_only_that_prompt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review L2: a prompt whose `arguments` is not a list is left out, with one warning
    naming the child and the prompt; its other prompt and the other child's prompts are
    listed and served."""
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    specs = [hostile_spec(tmp_path, "evil", "bad_prompt"), hostile_spec(tmp_path, "good", "plain")]
    async with gateway_host(tmp_path, specs) as host:
        assert await prompt_names(host.client) == {"evil_fine", "good_hello"}
        assert await prompt_names(host.client) == {"evil_fine", "good_hello"}
        got = await host.client.get_prompt("good_hello", {})
        assert getattr(got.messages[0].content, "text", None) == "hello from good"
        with pytest.raises(MCPError, match="'evil_broken'"):
            await host.client.get_prompt("evil_broken", {})
    [unusable] = warned(caplog, "passthrough_unusable")  # listed twice, got once: said once
    assert "'evil'" in unusable and "'broken'" in unusable, unusable


@pytest.mark.proc  # its child is a process
async def test_a_childs_line_breaks_cannot_forge_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review L4: a child's error text and a URI holding a line break are logged on one line
    (TextFormatter, the gateway's stderr format): no forged line of their own."""
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    async with gateway_host(tmp_path, [hostile_spec(tmp_path, "evil", "forge")]) as host:
        assert await prompt_names(host.client) == set()
        assert await resource_uris(host.client) == set()
    records = [r for r in caplog.records if r.name == "butlers.gateway.passthrough"]
    actions = {getattr(r, "action", None) for r in records}
    assert {"passthrough_list_failed", "passthrough_unusable"} <= actions, actions
    lines = [TextFormatter().format(r) for r in records]
    assert all("FORGED" in line for line in lines if "evil" in line), lines
    assert not [line for line in lines if "\n" in line or "\r" in line], lines


@pytest.mark.proc  # its children are processes
async def test_a_catch_all_template_cannot_take_another_childs_uris(tmp_path: Path) -> None:
    """Review L3: an earlier child's template `{scheme}://{rest*}` matches every URI. A URI a
    later child's template matches too is refused, the error naming both, and the earlier
    child never sees it; a URI the later child lists outright is its; a URI only the
    catch-all matches is the earlier child's."""
    seen = tmp_path / "seen"
    specs = [hostile_spec(tmp_path, "evil", "catchall", seen=seen), lists_spec(tmp_path, "good")]
    async with gateway_host(tmp_path, specs) as host:
        client = host.client
        with pytest.raises(MCPError, match="'evil', 'good'") as refused:
            await client.read_resource("note://good/page/7")
        assert "note://good/page/7" in str(refused.value)
        assert asked(seen, "resources/read") == 0
        assert await text_at(client, "note://shared") == "shared note of good"
        assert await text_at(client, "other://x") == "other://x from evil"
        assert asked(seen, "resources/read") == 1


@pytest.mark.proc  # its children are processes
async def test_two_prompts_with_the_same_prefixed_name_list_the_first_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review L3: server `my`'s prompt `docs_search` and server `my_docs`'s `search` are both
    `my_docs_search`: the first by the config's order is listed and served, the other left
    out, and one warning names both servers (listing again says nothing more)."""
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    specs = [
        hostile_spec(tmp_path, "my", "plain", prompt="docs_search"),
        hostile_spec(tmp_path, "my_docs", "plain", prompt="search"),
    ]
    async with gateway_host(tmp_path, specs) as host:
        assert await prompt_names(host.client) == {"my_docs_search"}
        got = await host.client.get_prompt("my_docs_search", {})
        assert getattr(got.messages[0].content, "text", None) == "docs_search from my"
        assert await prompt_names(host.client) == {"my_docs_search"}
    [duplicate] = warned(caplog, "passthrough_duplicate")
    assert "'my'" in duplicate and "'my_docs'" in duplicate, duplicate


@pytest.mark.proc  # its child is a process
async def test_two_prompts_of_one_child_that_meet_in_one_name_are_told_apart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One child's "a:b" and "a/b" are both `twin_a_b`: the first it listed is served, and
    the warning names each by the name it was listed under (not the server twice)."""
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    async with gateway_host(tmp_path, [hostile_spec(tmp_path, "twin", "twins")]) as host:
        assert await prompt_names(host.client) == {"twin_a_b"}
        got = await host.client.get_prompt("twin_a_b", {})
        assert getattr(got.messages[0].content, "text", None) == "a:b from twin"
    [duplicate] = warned(caplog, "passthrough_duplicate")
    assert "by 'twin' (as 'a:b') and by 'twin' (as 'a/b')" in duplicate, duplicate


@pytest.mark.proc  # its children are processes
async def test_a_childs_prompt_name_is_kept_to_what_a_command_may_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt name with an escape sequence, a line break, `:`, `/` and `__` is listed with
    each of those as one `_` (a host makes a slash command of it), and its get reaches the
    child under the child's own name; letters of any script stay; a name with nothing usable
    is left out, said once."""
    caplog.set_level(logging.WARNING, logger="butlers.gateway.passthrough")
    specs = [
        hostile_spec(tmp_path, "evil", "plain", prompt="\x1b[31mrm -rf:/ now\n__ok"),
        hostile_spec(tmp_path, "blank", "plain", prompt="\x1b:/\n"),
        # Decomposed (e and a combining accent), as some systems write it.
        hostile_spec(tmp_path, "fr", "plain", prompt="re\u0301sume\u0301 du jour"),
        hostile_spec(tmp_path, "wide", "plain", prompt="\uff52\uff4d"),  # full-width
    ]
    async with gateway_host(tmp_path, specs) as host:
        assert await prompt_names(host.client) == {
            "evil_31mrm_-rf_now_ok",
            "fr_résumé_du_jour",
            "wide_rm",
        }
        got = await host.client.get_prompt("fr_résumé_du_jour", {})
        assert getattr(got.messages[0].content, "text", None) == (
            "re\u0301sume\u0301 du jour from fr"
        )
        got = await host.client.get_prompt("evil_31mrm_-rf_now_ok", {})
        assert getattr(got.messages[0].content, "text", None) == (
            "\x1b[31mrm -rf:/ now\n__ok from evil"
        )
        assert len(await prompt_names(host.client)) == 3
    [unusable] = warned(caplog, "passthrough_unusable")
    assert "'blank'" in unusable and "no usable name" in unusable and "\n" not in unusable
