"""butlers.tasks: a cancellation is never lost on its way to a background task or its owner.

Python 3.11's `asyncio.wait_for`, cancelled in the same turn of the event loop as the call it
waits on ends, returns that call's result instead of raising: a worker woken as it was
closed went on waiting, and `butlers up` ignored SIGTERM (seen under callgrind, where every
turn is slow). `within` is what the code uses instead; a test holds the code to it.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from butlers.tasks import cancel_and_wait, within

PACKAGE = Path(__file__).resolve().parent.parent / "butlers"


async def _loop_on_wakes(wake: asyncio.Event, rounds: list[int]) -> None:
    while True:
        try:
            await within(wake.wait(), 10)
        except TimeoutError:
            pass
        wake.clear()
        rounds.append(1)


async def test_a_cancel_that_meets_a_wake_ends_the_loop() -> None:
    wake, rounds = asyncio.Event(), []
    task = asyncio.create_task(_loop_on_wakes(wake, rounds))
    await asyncio.sleep(0.01)  # waiting for a wake
    wake.set()
    task.cancel()  # in the same turn: the wake's waiter and the cancel are both pending
    async with asyncio.timeout(5):
        await asyncio.wait({task})
    assert task.cancelled() and rounds == []


async def test_within_times_out_and_returns_what_the_call_returns() -> None:
    with pytest.raises(TimeoutError):
        await within(asyncio.sleep(10), 0.01)
    assert await within(asyncio.sleep(0, result="answer"), 1) == "answer"
    assert await within(asyncio.sleep(0, result="no limit"), None) == "no limit"


async def test_cancel_and_wait_passes_the_callers_own_cancellation_on() -> None:
    """A task that will not end (it swallows its cancellation) holds its owner only until the
    owner's own deadline: that deadline's cancellation is the owner's, not the task's."""
    stop = asyncio.Event()

    async def stubborn() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # what a badly behaved library does

    async def close_within_its_deadline() -> None:
        async with asyncio.timeout(0.2):
            await cancel_and_wait(task)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    owner = asyncio.create_task(close_within_its_deadline())
    try:
        done, _ = await asyncio.wait({owner}, timeout=5)
        assert owner in done, "cancel_and_wait held its owner past the owner's own deadline"
        assert isinstance(owner.exception(), TimeoutError)
        assert not task.done()
    finally:
        stop.set()
        task.cancel()
        await asyncio.wait({task, owner})


async def test_cancel_and_wait_raises_what_the_task_failed_with() -> None:
    async def failing() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            raise RuntimeError("closing went wrong")

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="closing went wrong"):
        await cancel_and_wait(task)
    await cancel_and_wait(None)  # nothing to do


def test_no_code_waits_with_asyncio_wait_for() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\basyncio\.wait_for\(|^\s*from asyncio import .*\bwait_for\b", line)
    ]
    assert offenders == [], f"use butlers.tasks.within instead of asyncio.wait_for: {offenders}"
