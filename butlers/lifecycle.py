"""One lifecycle for every long-lived part of a butler: open once, close once, in order.

A component (the HTTP server, the switchboard, a butler's channel modules, its tool servers,
its ticker) is built first, with everything it needs passed in, and then opened; it refuses a
second `open` and cannot be opened again once closed, as python-telegram-bot's Application
refuses it: a second start is a bug in the caller, not something to paper over.

`Components` is the daemon's list: each part is opened in the order it is added and the
opened ones are closed in reverse, so the order is written once, where they start. A part
whose `open` raised is closed too (its `close` copes with a half-open part), and one part that
fails to close never keeps the others open. See docs/architecture.md for the daemon's list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal, Protocol, TypeVar

from butlers.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

State = Literal["new", "open", "closed"]


class Closeable(Protocol):
    async def close(self) -> None: ...


class Component(Closeable, Protocol):
    async def open(self) -> None: ...


class Once:
    """The state of one component: `opening()` refuses a second open, or one after close;
    `closing()` says whether there is anything to close (it was opened, even partly)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.state: State = "new"

    def opening(self) -> None:
        if self.state != "new":
            raise RuntimeError(f"{self.what} is {self.state}: it opens once")
        self.state = "open"

    def closing(self) -> bool:
        was, self.state = self.state, "closed"
        return was == "open"


C = TypeVar("C", bound=Component)
K = TypeVar("K", bound=Closeable)


class Components:
    """Parts opened in order, closed in reverse (see the module docstring)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._opened: list[tuple[str, Closeable]] = []

    async def open(self, name: str, component: C) -> C:
        """Open `component` and keep it for `close`; if its open raises, it is closed with
        the rest when the caller closes (the caller's start failed)."""
        self._opened.append((name, component))
        await component.open()
        return component

    def adopt(self, name: str, closeable: K) -> K:
        """A part that is open once made (a pool, a client): only its close is ours."""
        self._opened.append((name, closeable))
        return closeable

    def on_close(self, name: str, callback: Callable[[], object]) -> None:
        """Something plain to undo at close (a bound socket)."""
        self._opened.append((name, _Callback(callback)))

    async def close(self) -> None:
        while self._opened:
            name, component = self._opened.pop()
            try:
                await component.close()
            except Exception:
                logger.exception(
                    "%s: %s did not close cleanly",
                    self.owner,
                    name,
                    extra={"action": "close_failed"},
                )


class _Callback:
    def __init__(self, callback: Callable[[], object]) -> None:
        self._callback = callback

    async def close(self) -> None:
        self._callback()


class Background:
    """A loop of the component's owner (a butler's ticker) as a component: `open` starts it
    as a named task, `close` cancels it and waits for it to end."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
