"""A mock child MCP server on stdio, in the shapes found in the wild (run as a script).

    python mock_mcp.py [--framing lines|content-length] [--split] [--logs]
                       [--crash-on TOOL] [--silent] [--name NAME]

Reads requests one JSON per line (what the gateway sends). Answers one JSON per line, or with
`Content-Length:` frames; `--split` writes each answer in small pieces with pauses; `--logs`
prints non-JSON log lines to stdout between answers; `--crash-on` exits when that tool is
called; `--silent` never answers anything;
`--hang-on` never answers calls of that tool;
`--linger` outlives the end of its stdin; `--odd-tool NAME` lists a tool of that name (again
for more); `--flood` a tool `flood` that says its tools changed `n` times at once (and
MOCK_MCP_LISTS names a file where each tools/list adds a line); `--protocol V` answers
initialize with revision V;
`--start-delay S` waits S seconds before it reads anything (an npx server's first start);
`--extras` adds the tools `progress` (reports progress and logs a message before it answers)
and `grow` (adds the tool `extra` and says its tool list changed). Tools: echo, add, crash,
long_description.
Every spawn appends its pid to $MOCK_MCP_PIDS (a file), so tests can find the process; every
call appends its tool's name to $MOCK_MCP_CALLS, so tests know a call has reached it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

LONG = (
    "Echoes back the input message to verify communication between host and child MCP. "
    "This is useful for testing the JSON-RPC protocol, verifying parameter passing, and "
    "ensuring that the stdio transport is working correctly in both directions. " * 3
)

TOOLS = [
    {
        "name": "echo",
        "description": "Echo the message back.",
        "inputSchema": {
            "type": "object",
            "properties": {"message": {"type": "string"}},
            "required": ["message"],
        },
    },
    {
        "name": "add",
        "description": "Add two   numbers\n   together.",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        },
    },
    {"name": "crash", "description": "Exit at once.", "inputSchema": {"type": "object"}},
    {"name": "long_description", "description": LONG, "inputSchema": {"type": "object"}},
]

EXTRAS = [
    {"name": "progress", "description": "Report progress.", "inputSchema": {"type": "object"}},
    {"name": "grow", "description": "Add a tool.", "inputSchema": {"type": "object"}},
]


def lists_read(lists: Path) -> int:
    """How many tools/list requests the `--flood` server answered (MOCK_MCP_LISTS's lines)."""
    return len(lists.read_text().splitlines()) if lists.exists() else 0


async def lists_read_once_settled(lists: Path, pause_s: float = 0.5) -> int:
    """`lists_read` once no listing came for three pauses in a row (a bound, not a timing),
    within 30 s."""
    import asyncio

    last, still = lists_read(lists), 0
    async with asyncio.timeout(30):
        while still < 3:
            await asyncio.sleep(pause_s)
            now = lists_read(lists)
            still, last = (still + 1, now) if now == last else (0, now)
    return last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framing", choices=("lines", "content-length"), default="lines")
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--logs", action="store_true")
    parser.add_argument("--crash-on")
    parser.add_argument("--silent", action="store_true")
    parser.add_argument("--hang-on", help="never answer calls of this tool")
    parser.add_argument("--linger", action="store_true", help="keep running after stdin ends")
    parser.add_argument("--name", default="mock")
    parser.add_argument("--protocol", help="the revision to answer initialize with")
    parser.add_argument("--extras", action="store_true")
    parser.add_argument("--odd-tool", action="append", default=[], help="a tool of this name")
    parser.add_argument("--flood", action="store_true", help="a tool `flood` (n list_changed)")
    parser.add_argument("--start-delay", type=float, default=0.0, help="seconds before it reads")
    options = parser.parse_args()
    time.sleep(options.start_delay)  # an npx server downloading itself
    if pids := os.environ.get("MOCK_MCP_PIDS"):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
    out = sys.stdout.buffer

    def write(message: dict) -> None:
        body = json.dumps(message).encode()
        if options.framing == "content-length":
            data = b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        else:
            data = body + b"\n"
        if options.logs:
            out.write(b"[mock] handling a request\n")
        if options.split:
            # Pieces of 7 bytes, with a pause after every 8th: the reader gets frames cut at
            # every kind of place (header, body, between frames) in a few dozen reads, not one
            # 2 ms pause per 7 bytes (0.8 s for a tools/list).
            for piece, start in enumerate(range(0, len(data), 7)):
                out.write(data[start : start + 7])
                if piece % 8 == 7:
                    out.flush()
                    time.sleep(0.002)
        else:
            out.write(data)
        out.flush()

    if options.logs:
        out.write(b"mock MCP server starting (this line is not JSON)\n")
        out.flush()
    tools = [*TOOLS, *(EXTRAS if options.extras else [])]
    tools += [
        {"name": odd, "description": "Oddly named.", "inputSchema": {"type": "object"}}
        for odd in options.odd_tool
    ]
    if options.flood:
        tools.append(
            {
                "name": "flood",
                "description": "Say n times: changed.",
                "inputSchema": {"type": "object"},
            }
        )
    for line in sys.stdin.buffer:
        if options.silent or not line.strip():
            continue
        request = json.loads(line)
        method, request_id = request.get("method"), request.get("id")
        if request_id is None:
            continue  # a notification
        if method == "initialize":
            result = {
                "protocolVersion": options.protocol or request["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": options.name, "version": "1"},
            }
        elif method == "tools/list":
            result = {"tools": tools}
            if lists := os.environ.get("MOCK_MCP_LISTS"):  # each tools/list, a line
                with open(lists, "a") as f:
                    f.write("tools/list\n")
        elif method == "tools/call":
            name = request["params"]["name"]
            args = request["params"].get("arguments") or {}
            if calls := os.environ.get("MOCK_MCP_CALLS"):
                with open(calls, "a") as f:
                    f.write(f"{name}\n")
            if name == "crash" or name == options.crash_on:
                sys.exit(3)
            if name == options.hang_on:
                continue
            if name == "echo":
                result = {
                    "content": [{"type": "text", "text": args.get("message", "")}],
                    "structuredContent": {
                        "echo": args.get("message"),
                        "cwd": os.getcwd(),
                        "env": os.environ.get("MOCK_SETTING"),
                    },
                }
            elif name == "progress":
                token = (request["params"].get("_meta") or {}).get("progressToken")
                for step in (1, 2, 3):
                    if token is not None:
                        params = {"progressToken": token, "progress": step, "total": 3}
                        write(
                            {
                                "jsonrpc": "2.0",
                                "method": "notifications/progress",
                                "params": params | {"message": f"step {step}"},
                            }
                        )
                log = {"level": "warning", "logger": "mock", "data": "half way there"}
                write({"jsonrpc": "2.0", "method": "notifications/message", "params": log})
                result = {"content": [{"type": "text", "text": "done"}]}
            elif name == "grow":
                tools.append(
                    {
                        "name": "extra",
                        "description": "Added later.",
                        "inputSchema": {"type": "object"},
                    }
                )
                write({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
                result = {"content": [{"type": "text", "text": "grown"}]}
            elif name == "flood":  # its tool list "changed", n times at once
                for _ in range(int(args.get("n", 100))):
                    write({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
                result = {"content": [{"type": "text", "text": "flooded"}]}
            elif name == "add":
                result = {"content": [{"type": "text", "text": str(args["a"] + args["b"])}]}
            else:
                result = {"content": [{"type": "text", "text": "ok"}]}
        else:
            write(
                {
                    "jsonrpc": "2.0",
                    "id": request_id,
                    "error": {"code": -32601, "message": f"Method not found: {method}"},
                }
            )
            continue
        write({"jsonrpc": "2.0", "id": request_id, "result": result})
    while options.linger:  # a server that does not notice its parent is gone
        time.sleep(1)


if __name__ == "__main__":
    main()
