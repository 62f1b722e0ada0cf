"""Bounds on a peer's paged list (`tools/list`): a peer we connect to may be hostile.

A peer that answers every page with the same cursor, or with pages without end, would grow our
memory and hold the event loop for as long as it likes (found by the gateway's security review
for prompts and resources; `tools/list` had the same loop, here and in route's and the tool
servers' connections). The list stops being read at a cursor the peer already gave, past
MAX_PAGES pages or MAX_ITEMS items, and the caller gets a McpCallError naming the peer and
which bound it crossed. The whole list is also held to the caller's timeout (each page was).
"""

from __future__ import annotations

from butlers.errors import McpCallError

MAX_PAGES = 100
MAX_ITEMS = 10_000


class PageGuard:
    """One list being read: `check(cursor, items)` after each page."""

    def __init__(self, label: str, method: str) -> None:
        self.label = label
        self.method = method
        self.pages = 0
        self._cursors: set[str] = set()

    def check(self, cursor: object, items: int) -> None:
        """Raise McpCallError when the page just read crosses a bound; `cursor` is its
        nextCursor, `items` how many items the list holds so far."""
        self.pages += 1
        if items > MAX_ITEMS:
            self._refuse(f"more than {MAX_ITEMS} items")
        if not cursor:
            return
        if self.pages >= MAX_PAGES:
            self._refuse(f"more than {MAX_PAGES} pages")
        key = str(cursor)
        if key in self._cursors:
            self._refuse("a cursor it had already given")
        self._cursors.add(key)

    def _refuse(self, why: str) -> None:
        raise McpCallError(f"{self.label}: its {self.method} did not end ({why}): not read")
