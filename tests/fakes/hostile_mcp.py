"""A hostile stdio MCP child, for the gateway's pass-through tests (`python
tests/fakes/hostile_mcp.py`). It speaks raw JSON-RPC (no SDK: it may break the protocol's spirit
on purpose) and starts at once. `HOSTILE_TAG` names it in what it answers, `HOSTILE_PROMPT` is the
prompt it lists in the plain modes (default "hello"), and every request's method is appended as a
line to the file `HOSTILE_SEEN` (when set), so a test can count what the gateway asked.

`HOSTILE_MODE`:
  plain        one prompt, no resources, no templates
  same_cursor  prompts/list: a page and the same nextCursor "again", 300 times, then the end
  endless      prompts/list: a page and a new cursor each time, 300 pages, then the end
  many         prompts/list: 1,000 prompts a page, new cursors, 12 pages, then the end
  slow_pages   prompts/list: new cursors, each page after 50 ms, 80 pages, then the end
  silent       never answers prompts/list
  bad_prompt   lists a prompt whose `arguments` is not a list, and a fine one
  twins        two prompts whose names differ only where a command cannot hold them: "a:b", "a/b"
  forge        child-chosen text with line breaks: prompts/list fails with one in its message,
               resources/list has a URI holding one
  catchall     a template `{scheme}://{rest*}` (it matches every URI), no resources
  tools_same_cursor  tools/list: a page and the same nextCursor "again", 300 times, then the end
  tools_endless      tools/list: a page and a new cursor each time, 300 pages, then the end
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

MODE = os.environ.get("HOSTILE_MODE", "plain")
TAG = os.environ.get("HOSTILE_TAG", "hostile")
PROMPT = os.environ.get("HOSTILE_PROMPT", "hello")
SEEN = os.environ.get("HOSTILE_SEEN")
FORGED = "\n2026-11-26 10:00:00,000 ERROR butlers.gateway: FORGED line"


def send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def prompts_page(cursor: str | None) -> dict[str, Any] | None:
    """The result of prompts/list at `cursor` (None: no answer at all)."""
    if MODE == "silent":
        return None
    if MODE == "same_cursor":
        more = {"nextCursor": "again"} if _count() < 300 else {}
        return {"prompts": [{"name": f"p{i}"} for i in range(10)], **more}
    if MODE in ("endless", "many", "slow_pages"):
        page = int(cursor or "0")
        size, pages = {"endless": (10, 300), "many": (1000, 12), "slow_pages": (10, 80)}[MODE]
        if MODE == "slow_pages":
            time.sleep(0.05)
        more = {"nextCursor": str(page + 1)} if page + 1 < pages else {}
        return {"prompts": [{"name": f"p{page}_{i}"} for i in range(size)], **more}
    if MODE == "bad_prompt":
        return {"prompts": [{"name": "broken", "arguments": "bad"}, {"name": "fine"}]}
    if MODE == "twins":
        return {"prompts": [{"name": "a:b"}, {"name": "a/b"}]}
    return {"prompts": [{"name": PROMPT}]}


def tools_page(cursor: str | None) -> dict[str, Any]:
    """The result of tools/list at `cursor`."""
    tool = {"type": "object"}
    if MODE == "tools_same_cursor":
        more = {"nextCursor": "again"} if _asked.get("tools/list", 0) < 300 else {}
        return {"tools": [{"name": f"t{i}", "inputSchema": tool} for i in range(10)], **more}
    if MODE == "tools_endless":
        page = int(cursor or "0")
        more = {"nextCursor": str(page + 1)} if page + 1 < 300 else {}
        return {"tools": [{"name": f"t{page}_{i}", "inputSchema": tool} for i in range(10)], **more}
    return {"tools": []}


_asked: dict[str, int] = {}


def _count() -> int:
    return _asked.get("prompts/list", 0)


def answer(method: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The result of `method`, or {"error": ...}; None: no answer."""
    if method == "initialize":
        return {
            "protocolVersion": params["protocolVersion"],
            "capabilities": {"tools": {}, "prompts": {"listChanged": True}, "resources": {}},
            "serverInfo": {"name": TAG, "version": "1"},
        }
    if method == "tools/list":
        return tools_page(params.get("cursor"))
    if method == "prompts/list":
        if MODE == "forge":
            return {"error": {"code": -32603, "message": f"no prompts{FORGED}"}}
        return prompts_page(params.get("cursor"))
    if method == "prompts/get":
        text = f"{params['name']} from {TAG}"
        return {"messages": [{"role": "user", "content": {"type": "text", "text": text}}]}
    if method == "resources/list":
        if MODE == "forge":
            return {"resources": [{"uri": f"not a uri{FORGED}", "name": "n"}]}
        return {"resources": []}
    if method == "resources/templates/list":
        catchall = [{"uriTemplate": "{scheme}://{rest*}", "name": "all"}]
        return {"resourceTemplates": catchall if MODE == "catchall" else []}
    if method == "resources/read":
        return {"contents": [{"uri": params["uri"], "text": f"{params['uri']} from {TAG}"}]}
    return {"error": {"code": -32601, "message": f"no method {method}"}}


def main() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        mid, method = message.get("id"), message.get("method", "")
        if mid is None or not method:
            continue  # a notification, or an answer to a request of ours
        _asked[method] = _asked.get(method, 0) + 1
        if SEEN:
            with open(SEEN, "a") as seen:
                seen.write(method + "\n")
        result = answer(method, message.get("params") or {})
        if result is None:
            continue
        if "error" in result and len(result) == 1:
            send({"jsonrpc": "2.0", "id": mid, "error": result["error"]})
        else:
            send({"jsonrpc": "2.0", "id": mid, "result": result})


if __name__ == "__main__":
    main()
