"""A peer's paged tools/list is bounded (butlers.mcp_connection.paging): a hostile child that
repeats its cursor, or pages without end, is put in error, naming why, after a bounded number
of requests; it cannot grow our memory or hold the event loop."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from butlers.errors import McpCallError
from butlers.gateway.children import ChildSpec
from butlers.gateway.config import load_gateway_config
from butlers.gateway.server import Gateway
from butlers.mcp_connection.paging import MAX_ITEMS, MAX_PAGES, PageGuard

HOSTILE = str(Path(__file__).parent / "fakes" / "hostile_mcp.py")


def test_a_list_that_ends_passes() -> None:
    guard = PageGuard("peer", "tools/list")
    for page in range(MAX_PAGES - 1):
        guard.check(str(page), 10)
    guard.check(None, 10 * MAX_PAGES)


@pytest.mark.parametrize(
    ("pages", "why"),
    [
        ([("a", 1), ("a", 2)], "a cursor it had already given"),
        ([(str(n), n) for n in range(MAX_PAGES)], f"more than {MAX_PAGES} pages"),
        ([(None, MAX_ITEMS + 1)], f"more than {MAX_ITEMS} items"),
    ],
)
def test_a_list_that_does_not_end_is_refused(pages: list, why: str) -> None:
    guard = PageGuard("peer", "tools/list")
    with pytest.raises(McpCallError, match=rf"peer: its tools/list did not end \({why}\)"):
        for cursor, items in pages:
            guard.check(cursor, items)


@pytest.mark.proc
@pytest.mark.parametrize(
    ("mode", "asked", "why"),
    [
        ("tools_same_cursor", 2, "a cursor it had already given"),
        ("tools_endless", MAX_PAGES, f"more than {MAX_PAGES} pages"),
    ],
)
async def test_a_hostile_childs_endless_tool_list_puts_it_in_error(
    tmp_path: Path, mode: str, asked: int, why: str
) -> None:
    seen = tmp_path / "seen"
    spec = ChildSpec(
        "evil",
        cmd=sys.executable,
        args=(HOSTILE,),
        env={"HOSTILE_MODE": mode, "HOSTILE_SEEN": str(seen)},
        cwd=tmp_path,
    )
    gateway = Gateway(load_gateway_config(tmp_path), [spec], environ=dict(os.environ))
    try:
        slot = gateway.slots["evil"]
        await gateway.warm(slot)
        assert slot.state == "error"
        assert f"its tools/list did not end ({why}): not read" in (slot.error or "")
        assert seen.read_text().split().count("tools/list") == asked
    finally:
        await gateway.close()
