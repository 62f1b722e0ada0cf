"""Helpers for the background tasks components own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task we own and wait until it has really ended (None: nothing to do). An
    exception it ended with (other than its cancellation) is raised here.

    The caller's own cancellation is passed on, never taken for the task's: a stop bounded by
    a timeout must be able to give up on a task that does not end. (`await task` inside a
    suppress(CancelledError) could not tell the two apart, and once hid a worker that had
    swallowed its cancellation: its close returned only when the caller's timeout cancelled
    the task a second time.) `asyncio.wait` raises CancelledError only for the waiter.
    """
    if task is None:
        return
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """`await awaitable`, or TimeoutError after `timeout_s` (None: no limit).

    What `asyncio.wait_for` is for, without its flaw in Python 3.11: cancelled at the moment
    the awaited call ends, it returns that call's result instead of raising, so the caller's
    cancellation is lost. A background loop waiting on a wake-up or a heartbeat then went on
    for ever and its owner's close never returned (a fleet that ignored SIGTERM; fixed in 3.12
    by building wait_for on `asyncio.timeout`, as this is).
    """
    async with asyncio.timeout(timeout_s):
        return await awaitable


class Coalesced:
    """Runs `reading()` on request, never twice at once: requests that come while it runs
    make one more run after it, at most one every `every_s`. For a peer's
    `notifications/tools/list_changed`: a server that sent 3000 of them in 30 s was listed
    3000 times (a walkthrough, then a red team on the butlers' tool servers)."""

    def __init__(self, reading: Callable[[], Awaitable[None]], every_s: float) -> None:
        self.reading = reading
        self.every_s = every_s
        self.running = False
        self._again = False

    def request(self) -> Coroutine[Any, Any, None] | None:
        """The run to start as a task of the caller's, or None when one is under way (it will
        run once more)."""
        if self.running:
            self._again = True
            return None
        self.running = True
        return self._runs()

    async def _runs(self) -> None:
        try:
            while True:
                self._again = False
                await self.reading()
                if not self._again:
                    return
                await asyncio.sleep(self.every_s)
        finally:
            self.running = False
