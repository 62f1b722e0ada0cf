"""What does Claude Code itself send the model, with and without the gateway, with its own tool
search on and off? (Not a test: run it by hand; needs npm and node.)

    .venv/bin/python bench/gateway_host_load.py [--write]

The real bundled `claude` binary (claude-agent-sdk's) runs one prompt (`claude -p`, its
default built-in tools, `--strict-mcp-config`) against the scripted Messages API of the tests
(tests/fakes/messages_api.py, on loopback, which records each request), isolated from this
machine's Claude settings as the tests isolate it. Six cells:

- MCP servers: the official `server-filesystem`, `server-memory` and `server-everything` from
  npm (~/.cache/butlers-tests/npm, as the tests install them) declared directly; or
  `butlers gateway --mode suite` in front of the same three; or `--mode search`;
- Claude Code's tool search: `ENABLE_TOOL_SEARCH=true` (on; also the default) or `false` (off;
  the bundled CLI reads true/false, auto, auto:N; found in its strings and checked here by the
  tools each request carries).

For each cell the first request of the conversation (the one carrying the prompt): its JSON
size, its `tools` array (count and size; the `mcp__*` tools among them), whether it carries the
tool-search tool, and how many `mcp__*` names it announces without their definitions
(deferred). Sizes are compact JSON as recorded; tokens as `butlers gateway --report` counts
them (tiktoken only from its cache, else chars/4, labelled). The butlers themselves are left
out: they need PostgreSQL and a fleet, and `butlers gateway --report` measures them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_search import servers  # noqa: E402
from bench.route_overhead import write_docs_block  # noqa: E402
from butlers.claude_code import claude_binary, isolated_cli_env  # noqa: E402
from butlers.gateway.report import TokenCounter, find_token_counter, wire_json  # noqa: E402
from tests.fakes.messages_api import ScriptedMessagesAPI, text  # noqa: E402
from tests.npm_servers import PREFIX, install_npm_servers  # noqa: E402

BUTLERS = str(Path(sys.executable).parent / "butlers")
PROMPT = "Which MCP tools do you have? Answer in one line."
SETUPS = ("direct", "gateway suite", "gateway search")
TOOL_SEARCH = {"on": "true", "off": "false"}
MCP_NAME = re.compile(r"mcp__[A-Za-z0-9_-]+__[A-Za-z0-9_-]+")
RUN_TIMEOUT_S = 180


def mcp_config(setup: str, project: Path) -> dict[str, Any]:
    """The `--mcp-config` of a cell: the three servers, or the gateway in front of them (it
    reads them from the project's .mcp.json)."""
    if setup == "direct":
        return {"mcpServers": servers(project, PREFIX / "node_modules" / ".bin")}
    mode = setup.removeprefix("gateway ")
    args = ["gateway", "--dir", str(project), "--no-butlers", "--mode", mode]
    return {"mcpServers": {"gateway": {"command": BUTLERS, "args": args}}}


def is_prompt_request(body: dict[str, Any]) -> bool:
    """The conversation's first request: its first user message is the prompt (Claude Code
    also sends side requests, e.g. a title or a quota probe)."""
    messages = body.get("messages") or []
    return bool(messages) and PROMPT in json.dumps(messages[0]) and "tools" in body


def tool_search_tool(tools: list[dict[str, Any]]) -> str | None:
    """The name of the tool-search tool a request carries, if any."""
    for tool in tools:
        marker = f"{tool.get('name', '')} {tool.get('type', '')}".lower()
        if "toolsearch" in marker.replace("_", "") or "tool_search" in marker:
            return str(tool.get("name") or tool.get("type"))
    return None


async def run_cell(
    api: ScriptedMessagesAPI, setup: str, search: str, project: Path, work: Path
) -> dict[str, Any]:
    """One `claude -p` run; its first conversation request, measured."""
    api.reset()
    api.script([text("done")])
    cell = work / f"{setup.replace(' ', '-')}-{search}"
    home = cell / "home"
    home.mkdir(parents=True)
    config = cell / "mcp.json"
    config.write_text(json.dumps(mcp_config(setup, project)))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")},
        **isolated_cli_env(home, api.url, inherited=os.environ),
        "ENABLE_TOOL_SEARCH": TOOL_SEARCH[search],
    }
    process = await asyncio.create_subprocess_exec(
        claude_binary(),
        *("-p", PROMPT, "--mcp-config", str(config), "--strict-mcp-config"),
        *("--output-format", "json"),
        cwd=cell,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(RUN_TIMEOUT_S):
        out, err = await process.communicate()
    if process.returncode != 0:
        sys.exit(f"claude failed in cell {setup}/{search}: {err.decode()[-2000:]}{out.decode()}")
    bodies = [b for b in api.requests if is_prompt_request(b)]
    if not bodies:
        sys.exit(f"no conversation request in cell {setup}/{search}: {len(api.requests)} seen")
    body = bodies[0]
    tools: list[dict[str, Any]] = body.get("tools") or []
    mcp_tools = [t for t in tools if str(t.get("name", "")).startswith("mcp__")]
    request = wire_json(body)
    loaded = {t["name"] for t in mcp_tools}
    announced = set(MCP_NAME.findall(request)) - loaded
    return {
        "setup": setup,
        "tool_search": search,
        "request": request,
        "tools": tools,
        "mcp_tools": mcp_tools,
        "search_tool": tool_search_tool(tools),
        "deferred": sorted(announced),
        "requests": len(api.requests),
    }


def _row(cell: dict[str, Any], counter: TokenCounter) -> str:
    request, tools = cell["request"], wire_json(cell["tools"])
    mcp = len(wire_json(cell["mcp_tools"]).encode()) if cell["mcp_tools"] else 0
    return (
        f"| {cell['setup']} | {cell['tool_search']} | {len(request.encode())} | "
        f"{counter.count(request)} | {len(cell['tools'])} | {len(tools.encode())} | "
        f"{counter.count(tools)} | {len(cell['mcp_tools'])} | {mcp} | "
        f"{len(cell['deferred'])} | {cell['search_tool'] or '-'} |"
    )


def table(cells: list[dict[str, Any]], counter: TokenCounter, version: str) -> str:
    lines = [
        f"## gateway: what Claude Code sends, tool search on and off ({time.strftime('%Y-%m-%d')})",
        "",
        f"`.venv/bin/python bench/gateway_host_load.py --write`: the bundled Claude Code "
        f"({version}) runs one prompt against the scripted Messages API with the official "
        "`server-filesystem`, `server-memory` and `server-everything` from npm, directly or "
        "behind `butlers gateway`, with `ENABLE_TOOL_SEARCH=true` (on) or `false` (off). The "
        "first request of the conversation, compact JSON; its built-in tools included. "
        f"{counter.label}.",
        "",
        "| MCP servers | tool search | request bytes | request tokens | tools | tools bytes | "
        "tools tokens | mcp tools | mcp tools bytes | mcp names deferred | search tool |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += [_row(cell, counter) for cell in cells]
    return "\n".join(lines)


async def measure(project: Path, work: Path) -> list[dict[str, Any]]:
    api = ScriptedMessagesAPI()
    await api.start()
    try:
        return [
            await run_cell(api, setup, search, project, work)
            for setup in SETUPS
            for search in TOOL_SEARCH
        ]
    finally:
        await api.stop()


def main(write: bool, keep: Path | None) -> None:
    bin_dir = install_npm_servers()
    if bin_dir is None:
        sys.exit("npm is not installed")
    work = Path(tempfile.mkdtemp(prefix="butlers-host-load-"))
    try:
        project = work / "project"
        (project / "files").mkdir(parents=True)
        (project / ".mcp.json").write_text(json.dumps({"mcpServers": servers(project, bin_dir)}))
        cells = asyncio.run(measure(project, work))
        version = subprocess.run(
            [claude_binary(), "--version"], capture_output=True, text=True, check=True
        ).stdout.strip()
        counter = find_token_counter(os.environ)
        if keep is not None:
            keep.write_text(json.dumps(cells, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = table(cells, counter, version)
    print(result)
    for cell in cells:
        names = [t.get("name") for t in cell["tools"]]
        print(
            f"\n{cell['setup']} / tool search {cell['tool_search']}: {cell['requests']} "
            f"requests; tools: {', '.join(map(str, names))}"
        )
        if cell["deferred"]:
            print(f"  deferred: {', '.join(cell['deferred'])}")
    if write:
        write_docs_block("gateway_host_load", result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--keep", type=Path, help="also write every cell's recorded request to this JSON file"
    )
    args = parser.parse_args()
    main(args.write, args.keep)
