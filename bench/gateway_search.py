"""Does `butlers gateway --mode search` find the right tool, how fast, and what does a host load?
(Not a test: run it by hand; needs npm and node.)

    .venv/bin/python bench/gateway_search.py [--rounds 5] [--write]

Over the official `@modelcontextprotocol/server-filesystem`, `server-memory` and
`server-everything` (installed into ~/.cache/butlers-tests/npm, as the tests do; 36 tools):

- accuracy: REQUESTS below, plain-language requests each with the tool that should answer it,
  written down before the ranking was looked at and never tuned against it; top-1 and top-3
  of `gateway_search` (limit 3) through the real gateway, and every miss named;
- latency: p50/p90 of one `gateway_search` call through the real gateway over MCP stdio (the
  host's view: JSON-RPC, the gateway's checks, the index), and of `SearchIndex.search` alone
  in-process; the index's build time over the same 36 tools;
- size: what `butlers gateway --report --json` measures: the `tools/list` a host loads, every
  server loaded directly vs the gateway in `suite`, `activate` and `search` mode, in bytes as
  the gateway writes it, and tokens (tiktoken only when its BPE file is already cached, never
  a download: not Claude's tokenizer either; else chars/4; the table says which).
  `bench/gateway_host_load.py` measures what Claude Code itself then sends.

It runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.route_overhead import write_docs_block  # noqa: E402
from butlers.gateway.search import Entry, SearchIndex  # noqa: E402
from tests.npm_servers import PREFIX, install_npm_servers  # noqa: E402

BUTLERS = str(Path(sys.executable).parent / "butlers")

# (request, the tool that should answer it, other tools that answer it just as well).
# Written down first, from the servers' tool names and what a person would ask; not tuned.
REQUESTS: list[tuple[str, str, tuple[str, ...]]] = [
    # filesystem
    ("show me what's in notes.txt", "read_text_file", ("read_file",)),
    ("read a text file", "read_text_file", ("read_file",)),
    ("open the photo holiday.png and show it", "read_media_file", ()),
    ("play the audio recording memo.mp3", "read_media_file", ()),
    ("read several files at once", "read_multiple_files", ()),
    ("save this text to a new file", "write_file", ()),
    ("overwrite report.md with new content", "write_file", ()),
    ("replace a line in config.yaml", "edit_file", ()),
    ("change one word in a document without rewriting it", "edit_file", ()),
    ("make a new folder called archive", "create_directory", ()),
    ("list the files in a directory", "list_directory", ("list_directory_with_sizes",)),
    ("which files in downloads are the biggest", "list_directory_with_sizes", ()),
    ("show the folder structure as a tree", "directory_tree", ()),
    ("rename draft.txt to final.txt", "move_file", ()),
    ("move a file into another folder", "move_file", ()),
    ("find all pdf files under my documents", "search_files", ()),
    ("when was this file last modified", "get_file_info", ()),
    ("how big is backup.tar", "get_file_info", ("list_directory_with_sizes",)),
    ("which directories am I allowed to access", "list_allowed_directories", ()),
    # memory
    ("remember that Alice is my sister", "create_entities", ("create_relations",)),
    ("add a new person to the knowledge graph", "create_entities", ()),
    ("link Bob to Acme: he works there", "create_relations", ()),
    ("note that Alice likes tea", "add_observations", ()),
    ("forget everything about Bob", "delete_entities", ()),
    ("remove the fact that Alice likes tea", "delete_observations", ()),
    ("Bob no longer works at Acme, delete that relation", "delete_relations", ()),
    ("show me everything you remember", "read_graph", ()),
    ("what do you know about Alice", "search_nodes", ("open_nodes",)),
    ("search the knowledge graph for coffee", "search_nodes", ()),
    ("open the nodes named Alice and Bob", "open_nodes", ()),
    # everything
    ("echo back what I say", "echo", ()),
    ("repeat this message to me", "echo", ()),
    ("add 17 and 25", "get-sum", ()),
    ("what is the sum of two numbers", "get-sum", ()),
    ("print the environment variables", "get-env", ()),
    ("show the server's configuration for debugging", "get-env", ()),
    ("give me a tiny image", "get-tiny-image", ()),
    ("compress a file with gzip", "gzip-file-as-resource", ()),
    ("start a long running task with progress", "trigger-long-running-operation", ()),
    ("turn logging on or off", "toggle-simulated-logging", ()),
    ("do deep research on a question", "simulate-research-query", ()),
    ("return structured content with an output schema", "get-structured-content", ()),
    ("a message with annotations", "get-annotated-message", ()),
    ("links to a few resources", "get-resource-links", ()),
    ("turn resource subscription updates on", "toggle-subscriber-updates", ()),
]
LIMIT = 3
IN_PROCESS_ROUNDS = 200


def servers(project: Path, bin_dir: Path) -> dict[str, dict[str, Any]]:
    """The three servers as a `.mcp.json` declares them."""
    return {
        "filesystem": {
            "command": str(bin_dir / "mcp-server-filesystem"),
            "args": [str(project / "files")],
        },
        "memory": {
            "command": str(bin_dir / "mcp-server-memory"),
            "env": {"MEMORY_FILE_PATH": str(project / "memory.jsonl")},
        },
        "everything": {"command": str(bin_dir / "mcp-server-everything"), "args": ["stdio"]},
    }


@asynccontextmanager
async def session(
    params: StdioServerParameters, errlog: Path, root: Path
) -> AsyncIterator[ClientSession]:
    """An initialized MCP client session over stdio; the child's stderr goes to `errlog`. It
    offers roots (`root`), as the gateway does to its children: server-everything lists one
    tool more (get-roots-list) to a client that does, and the in-process index must see the
    same tools as the gateway's."""

    async def roots(context: Any) -> mcp_types.ListRootsResult:
        return mcp_types.ListRootsResult(roots=[mcp_types.Root(uri=root.as_uri())])

    with errlog.open("a") as err:
        async with (
            stdio_client(params, errlog=err) as (read, write),
            ClientSession(read, write, list_roots_callback=roots) as client,
        ):
            await client.initialize()
            yield client


def tool_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    """A tools/list answer's tools as the JSON a host receives (and the gateway indexes)."""
    return [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in tools]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def gateway_params(project: Path, mode: str) -> StdioServerParameters:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
    args = ["gateway", "--dir", str(project), "--no-butlers", "--mode", mode]
    return StdioServerParameters(command=BUTLERS, args=args, env=env, cwd=str(project))


async def gateway_report(project: Path, errlog: Path) -> dict[str, Any]:
    """`butlers gateway --report --json` over the project: the sizes of every way of loading."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
    with errlog.open("a") as err:
        process = await asyncio.create_subprocess_exec(
            BUTLERS,
            *("gateway", "--report", "--json", "--no-butlers", "--dir", str(project)),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
        out, _ = await process.communicate()
    if process.returncode != 0:
        sys.exit(f"gateway --report failed ({process.returncode}): see {errlog}")
    report: dict[str, Any] = json.loads(out)
    return report


def judge(found: list[str], expected: str, also: tuple[str, ...]) -> tuple[bool, bool]:
    good = {expected, *also}
    return bool(found) and found[0] in good, any(name in good for name in found[:LIMIT])


async def measure(project: Path, rounds: int) -> dict[str, Any]:
    bin_dir = PREFIX / "node_modules" / ".bin"
    declared = servers(project, bin_dir)
    errlog = project / "stderr.log"
    direct: dict[str, list[dict[str, Any]]] = {}
    for name, spec in declared.items():
        params = StdioServerParameters(
            command=spec["command"],
            args=spec.get("args", []),
            env={"PATH": os.environ["PATH"], **spec.get("env", {})},
        )
        async with session(params, errlog, project) as client:
            direct[name] = tool_dicts((await client.list_tools()).tools)

    # The index alone, in-process, over the same tools the gateway indexes.
    sources = list(direct.items())
    entries = [Entry(name, tool) for name, tools in sources for tool in tools]
    builds = []
    for _ in range(IN_PROCESS_ROUNDS):
        start = time.perf_counter()
        index = SearchIndex.build(entries, sources)
        builds.append(time.perf_counter() - start)
    local: list[float] = []
    for _ in range(IN_PROCESS_ROUNDS // 10):
        for request, _expected, _also in REQUESTS:
            start = time.perf_counter()
            index.search(request, LIMIT)
            local.append(time.perf_counter() - start)
    in_process = {r: [e.name for e in index.search(r, LIMIT)] for r, _, _ in REQUESTS}

    sizes = await gateway_report(project, errlog)
    remote: list[float] = []
    ranked: dict[str, list[str]] = {}
    async with session(gateway_params(project, "search"), errlog, project) as client:
        await client.call_tool("gateway_search", {"query": "warm up", "limit": LIMIT})
        for _ in range(rounds):
            for request, _expected, _also in REQUESTS:
                start = time.perf_counter()
                result = await client.call_tool(
                    "gateway_search", {"query": request, "limit": LIMIT}
                )
                remote.append(time.perf_counter() - start)
                if result.is_error:
                    sys.exit(f"gateway_search failed for {request!r}: {result.content}")
                found = (result.structured_content or {}).get("result", [])
                ranked[request] = [f["name"] for f in found]
    return {
        "direct": direct,
        "sizes": sizes,
        "ranked": ranked,
        "in_process": in_process,
        "builds": builds,
        "local": local,
        "remote": remote,
    }


def report(m: dict[str, Any], rounds: int) -> str:
    ranked: dict[str, list[str]] = m["ranked"]
    top1 = top3 = 0
    misses: list[str] = []
    for request, expected, also in REQUESTS:
        first, three = judge(ranked[request], expected, also)
        top1 += first
        top3 += three
        if not first:
            got = ", ".join(f"`{n}`" for n in ranked[request]) or "nothing"
            mark = "in top 3" if three else "**missed**"
            misses.append(f"| {request} | `{expected}` | {got} | {mark} |")
    n = len(REQUESTS)
    same = sum(m["in_process"][r] == ranked[r] for r, _, _ in REQUESTS)
    direct_tools = [t for tools in m["direct"].values() for t in tools]
    sizes = m["sizes"]
    rows = [("all 3 servers loaded directly", sizes["listings"]["direct"])] + [
        (f"gateway `--mode {mode}`", sizes["listings"][mode])
        for mode in ("suite", "activate", "search")
    ]
    ms = 1000.0
    lines = [
        f"## gateway search: accuracy, latency, size ({time.strftime('%Y-%m-%d')})",
        "",
        f"`.venv/bin/python bench/gateway_search.py --rounds {rounds} --write`: the official "
        "`server-filesystem`, `server-memory` and `server-everything` from npm "
        f"({len(direct_tools)} tools) behind `butlers gateway`; {n} plain-language requests, "
        "each with the tool that should answer it, written down before the ranking was seen "
        "(`REQUESTS` in the file; a few name a second tool that answers just as well).",
        "",
        "| what | result |",
        "| --- | ---: |",
        f"| top-1 accuracy (`gateway_search`, limit {LIMIT}) | "
        f"{top1}/{n} ({100 * top1 / n:.0f}%) |",
        f"| top-3 accuracy | {top3}/{n} ({100 * top3 / n:.0f}%) |",
        f"| same ranking through the gateway as in-process | {same}/{n} |",
        f"| `gateway_search` over MCP stdio, p50 / p90 ({len(m['remote'])} calls) | "
        f"{statistics.median(m['remote']) * ms:.2f} / {percentile(m['remote'], 0.9) * ms:.2f} ms |",
        f"| `SearchIndex.search` in-process, p50 / p90 ({len(m['local'])} calls) | "
        f"{statistics.median(m['local']) * ms:.3f} / {percentile(m['local'], 0.9) * ms:.3f} ms |",
        f"| index build, {len(direct_tools)} tools, p50 ({len(m['builds'])} builds) | "
        f"{statistics.median(m['builds']) * ms:.3f} ms |",
        "",
        "What a host loads at start (`butlers gateway --report`: the `tools/list` JSON as a host "
        f"receives it, one per server when loaded directly; {sizes['tokens']['label']}):",
        "",
        "| tool list | tools | bytes | tokens | of direct |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, listing in rows:
        lines.append(
            f"| {label} | {listing['tools']} | {listing['bytes']} | {listing['tokens']} | "
            f"{listing['percent_of_direct']:.1f}% |"
        )
    lines += ["", "Requests whose first answer was not the expected tool:", ""]
    if misses:
        lines += ["| request | expected | top 3 | |", "| --- | --- | --- | --- |", *misses]
    else:
        lines.append("none.")
    return "\n".join(lines)


def main(rounds: int, write: bool) -> None:
    bin_dir = install_npm_servers()
    if bin_dir is None:
        sys.exit("npm is not installed")
    project = Path(tempfile.mkdtemp(prefix="butlers-gateway-search-"))
    try:
        (project / "files").mkdir()
        mcp = {"mcpServers": servers(project, bin_dir)}
        (project / ".mcp.json").write_text(json.dumps(mcp))
        table = report(asyncio.run(measure(project, rounds)), rounds)
    finally:
        shutil.rmtree(project, ignore_errors=True)
    print(table)
    if write:
        write_docs_block("gateway_search", table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="passes over the requests")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    main(args.rounds, args.write)
