"""`butlers gateway --report`: what a host loads, every server directly and the gateway in each
mode, in bytes of the tools/list JSON a host receives (checked against the bytes the gateway
really writes on stdio) and in tokens, counted by a real tokenizer only when one works offline,
else an estimate that says so."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import mcp_types
import pytest

from tests.fakes.mock_mcp import TOOLS as MOCK_TOOLS
from tests.test_cli_client import run_cli
from tests.test_gateway import BUTLERS, _env, mcp_json

SEARCH_TOOLS = ["gateway_search", "gateway_describe", "gateway_call", "gateway_status"]
CHILD_KEYS = {
    "name",
    "kind",
    "state",
    "error",
    "tools",
    "direct_bytes",
    "direct_tokens",
    "suite_tool",
    "suite_bytes",
    "suite_tokens",
    "wrapper_chars",
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """Two real (mock) stdio children, one with instructions (so it is wrapped), and a child
    that cannot start."""
    mcp_json(tmp_path, "plain", description="plain things")
    mcp_json(tmp_path, "framed", "--framing", "content-length")
    (tmp_path / "mcps" / "plain" / "CLAUDE.md").write_text("You run plain things.")
    child = tmp_path / "mcps" / "gone"
    child.mkdir(parents=True)
    (child / ".mcp.json").write_text(
        json.dumps({"name": "gone", "command": {"cmd": str(tmp_path / "no-such-binary")}})
    )
    return tmp_path


async def report(project: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    code, out, err = await run_cli(
        "gateway", "--report", "--json", "--no-butlers", "--dir", str(project), *args, env=env
    )
    assert code == 0, err
    return json.loads(out)


@contextlib.asynccontextmanager
async def raw_stdio_gateway(project: Path, mode: str) -> AsyncIterator[Any]:
    """`butlers gateway` over stdio driven by hand: JSON-RPC lines in, the very lines it
    writes out (no MCP client library between them and the test)."""
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        *("gateway", "--dir", str(project), "--no-butlers", "--lazy", "--mode", mode),
        env=_env(project),
        cwd=project,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        limit=16 * 1024 * 1024,
    )
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    async def ask(request_id: int, method: str, params: dict[str, Any]) -> str:
        message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        stdin.write(json.dumps(message).encode() + b"\n")
        await stdin.drain()
        async with asyncio.timeout(30):
            while True:
                line = (await stdout.readline()).decode()
                assert line, "the gateway closed its output"
                if json.loads(line).get("id") == request_id:
                    return line.rstrip("\n")

    try:
        await ask(
            1,
            "initialize",
            {
                "protocolVersion": mcp_types.LATEST_PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "1"},
            },
        )
        stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        yield ask
    finally:
        stdin.close()
        async with asyncio.timeout(15):
            await process.wait()


async def wire_listing(project: Path, mode: str) -> str:
    """The JSON text of the `result` of tools/list exactly as the gateway wrote it."""
    async with raw_stdio_gateway(project, mode) as ask:
        line = await ask(2, "tools/list", {})
    head = '{"jsonrpc":"2.0","id":2,"result":'
    assert line.startswith(head) and line.endswith("}"), line[:80]
    result = line[len(head) : -1]
    assert json.loads(result) == json.loads(line)["result"]
    return result


async def test_report_compares_direct_suite_activate_and_search(project: Path) -> None:
    no_tokenizer = {"TIKTOKEN_CACHE_DIR": str(project / "no-cache")}  # should tiktoken be here
    data = await report(project, env=no_tokenizer)
    assert set(data) == {"mode", "tokens", "listings", "children"}
    assert data["mode"] == "suite"
    assert list(data["listings"]) == ["direct", "suite", "activate", "search"]
    children = {c["name"]: c for c in data["children"]}
    assert set(children) == {"plain", "framed", "gone"}
    assert all(set(c) == CHILD_KEYS for c in children.values())

    # Directly: each child's own tools/list, as the child lists it (the mock's four tools).
    plain = children["plain"]
    assert (plain["state"], plain["tools"]) == ("ready", len(MOCK_TOOLS))
    own = json.dumps({"tools": MOCK_TOOLS}, separators=(",", ":"), ensure_ascii=False)
    assert plain["direct_bytes"] == len(own.encode())
    assert plain["direct_tokens"] == math.ceil(len(own) / 4)
    gone = children["gone"]
    assert gone["state"] == "error" and "no-such-binary" in gone["error"]
    assert (gone["tools"], gone["direct_bytes"]) == (0, 0)  # a host would load nothing of it
    direct = data["listings"]["direct"]
    assert direct["tools"] == 2 * len(MOCK_TOOLS)
    assert direct["bytes"] == sum(c["direct_bytes"] for c in children.values())

    # Each mode: the gateway's own tools/list at start.
    listings = data["listings"]
    assert sorted(listings["suite"]["names"]) == [
        "framed_suite",
        "gateway_activate",
        "gateway_deactivate",
        "gateway_status",
        "gone_suite",
        "plain_suite",
    ]
    assert listings["activate"]["names"] == [
        "gateway_activate",
        "gateway_deactivate",
        "gateway_status",
    ]
    assert listings["search"]["names"] == SEARCH_TOOLS
    assert all(children[n]["suite_bytes"] > 0 for n in ("plain", "framed", "gone"))
    assert listings["suite"]["bytes"] > sum(c["suite_bytes"] for c in children.values())
    for mode in ("suite", "activate", "search"):
        share = round(100 * listings[mode]["bytes"] / direct["bytes"], 1)
        assert listings[mode]["percent_of_direct"] == share

    # A wrapped child's natural_language sessions load its instructions and tools.
    assert plain["wrapper_chars"] == len("You run plain things.") + sum(
        len(json.dumps(t)) for t in MOCK_TOOLS
    )
    assert children["framed"]["wrapper_chars"] is None

    code, out, err = await run_cli(
        "gateway", "--report", "--no-butlers", "--dir", str(project), env=no_tokenizer
    )
    assert code == 0, err
    assert out.splitlines()[0].startswith("tokens: estimate, chars/4")
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("|")}
    assert {"plain", "framed", "gone", "every server directly", "gateway --mode search"} <= set(
        rows
    )
    cells = [c.strip() for c in rows["gateway --mode search"].split("|")[1:-1]]
    assert cells[1:4] == [str(listings["search"][k]) for k in ("tools", "bytes", "tokens")]
    assert [c.strip() for c in rows["plain"].split("|")[1:-1]][-1] == str(plain["wrapper_chars"])


async def test_each_modes_bytes_are_what_the_gateway_writes_on_the_wire(project: Path) -> None:
    """Measured apart from the report: the result of tools/list as `butlers gateway` writes
    it on stdio, in each mode; search mode's is the four gateway tools, nothing per child."""
    (project / "mcps" / "gone").joinpath(".mcp.json").unlink()
    # A description with non-ASCII text: the wire carries UTF-8, and bytes are bytes.
    (project / "gateway.toml").write_text('[suites.framed]\ndescription = "Für Gerät: 設定"\n')
    env = {"TIKTOKEN_CACHE_DIR": str(project / "no-cache")}
    data, *wire = await asyncio.gather(
        report(project, env=env),
        *(wire_listing(project, mode) for mode in ("suite", "activate", "search")),
    )
    for mode, text in zip(("suite", "activate", "search"), wire, strict=True):
        listing = data["listings"][mode]
        assert listing["bytes"] == len(text.encode()), mode
        assert listing["tokens"] == math.ceil(len(text) / 4), mode
        assert listing["names"] == [t["name"] for t in json.loads(text)["tools"]]
    assert [t["name"] for t in json.loads(wire[2])["tools"]] == SEARCH_TOOLS


async def test_search_mode_report_and_dry_run(project: Path) -> None:
    """This gateway's mode is named; the comparison is the same whatever the mode; --dry-run
    names no suite in search mode."""
    env = {"TIKTOKEN_CACHE_DIR": str(project / "no-cache")}
    searching, suite = await asyncio.gather(
        report(project, "--mode", "search", env=env), report(project, env=env)
    )
    assert searching["mode"] == "search"
    assert searching["listings"] == suite["listings"]
    code, out, err = await run_cli(
        "gateway", "--dry-run", "--mode", "search", "--no-butlers", "--dir", str(project)
    )
    assert code == 1  # the child that cannot start
    assert "plain (mcp, ready): 5 subtools" in out, err  # natural_language too
    assert "suite " not in out  # no suite tool is listed in search mode


def _tiktoken_installed() -> bool:
    return importlib.util.find_spec("tiktoken") is not None


@pytest.mark.skipif(
    not _tiktoken_installed(),
    reason="tiktoken is not installed (the optional `report` extra; not in the dev extra: "
    "CI could not fetch its BPE file, so there it counts the estimate, tested above)",
)
async def test_tiktoken_without_its_cached_file_is_not_used_and_fetches_nothing(
    project: Path,
) -> None:
    """tiktoken downloads a BPE file it does not find in its cache, or finds there damaged
    (o200k_base's here: its hash is wrong; cl100k_base's is missing): the report must not.
    Any request for one would go to this proxy on loopback, which sees none."""
    from butlers.gateway.report import _tiktoken_bpe_file

    requests: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readline())
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cache = project / "tiktoken-cache"
    cache.mkdir()
    bpe = _tiktoken_bpe_file("o200k_base")  # where tiktoken fetches it from, and its hash
    assert bpe is not None
    damaged = cache / hashlib.sha1(bpe[0].encode()).hexdigest()  # tiktoken's file name
    damaged.write_bytes(b"not the BPE file\n")
    env = {
        "TIKTOKEN_CACHE_DIR": str(cache),
        **{name: f"http://127.0.0.1:{port}" for name in ("HTTPS_PROXY", "HTTP_PROXY")},
        "NO_PROXY": "",
    }
    try:
        data = await report(project, env=env)
    finally:
        server.close()
        await server.wait_closed()
    assert data["tokens"] == {
        "method": "estimate",
        "encoding": None,
        "label": "tokens: estimate, chars/4",
    }
    assert requests == [] and list(cache.iterdir()) == [damaged]  # tiktoken would delete it


def _cached_tiktoken_encoding() -> str | None:
    """An encoding whose BPE file is in this machine's tiktoken cache (never on CI)."""
    from butlers.gateway.report import cached_tiktoken_encoding

    return cached_tiktoken_encoding(os.environ)


@pytest.mark.skipif(
    _cached_tiktoken_encoding() is None,
    reason="no tiktoken BPE file in its cache here (it is never downloaded by the report)",
)
async def test_tiktoken_from_its_cache_counts_real_tokens(project: Path) -> None:
    import tiktoken

    name = _cached_tiktoken_encoding()
    assert name is not None
    data, text = await asyncio.gather(report(project), wire_listing(project, "search"))
    assert data["tokens"]["method"] == "tiktoken" and data["tokens"]["encoding"] == name
    assert "not Claude's tokenizer" in data["tokens"]["label"]
    encoding = tiktoken.get_encoding(name)
    assert data["listings"]["search"]["tokens"] == len(encoding.encode_ordinary(text))


@pytest.mark.proc  # the gateway is a process
async def test_dry_run_fails_on_what_it_could_not_read_and_on_a_wrong_dir(tmp_path: Path) -> None:
    """--dry-run checks a config: a .mcp.json that is not JSON, a server missing its command,
    and VS Code's shape in .mcp.json are each listed as skipped and make it exit 1 (it said
    "0 children", exit 0); a --dir that is not there is an error, not an empty gateway."""
    mcp_json(tmp_path, "plain")
    broken = tmp_path / "mcps" / "broken"
    broken.mkdir(parents=True)
    (broken / ".mcp.json").write_text("{not json")
    project = tmp_path / ".mcp.json"
    project.write_text(json.dumps({"mcpServers": {"typo": {"comand": "x"}}}))
    code, out, err = await run_cli(
        "gateway", "--dry-run", "--no-butlers", "--dir", str(tmp_path), env=_env(tmp_path)
    )
    assert code == 1, (out, err)
    assert out.splitlines()[0] == "mode: suite, 1 child"
    skipped = [line for line in out.splitlines() if line.startswith("skipped: ")]
    assert len(skipped) == 2, out
    assert any(str(broken / ".mcp.json") in line for line in skipped), out
    assert any(f"{project}: mcpServers.typo" in line for line in skipped), out
    assert "plain (mcp, ready)" in out
    assert "(only this server; the file's others are read)" in err  # the log says so too

    project.write_text(json.dumps({"servers": {"x": {"command": "y"}}}))  # VS Code's
    code, out, _ = await run_cli(
        "gateway",
        "--dry-run",
        "--json",
        "--no-butlers",
        "--dir",
        str(tmp_path),
        env=_env(tmp_path),
    )
    assert code == 1
    listed = json.loads(out)
    assert [c["name"] for c in listed["children"]] == ["plain"]
    [vscode] = [s for s in listed["skipped"] if str(project) in s["error"]]
    assert "VS Code's shape (`servers`)" in vscode["error"] and vscode["server"] is None

    for wrong, said in ((tmp_path / "nope", "no such directory"), (project, "not a directory")):
        code, out, err = await run_cli(
            "gateway", "--dry-run", "--no-butlers", "--dir", str(wrong), env=_env(tmp_path)
        )
        assert (code, out) == (1, ""), err
        assert f"--dir {wrong}: {said}" in err and "Traceback" not in err
