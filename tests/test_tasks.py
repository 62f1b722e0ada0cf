"""butlers.tasks: a cancellation is never lost on its way to a background task or its owner.

Python 3.11's `asyncio.wait_for`, cancelled in the same turn of the event loop as the call it
waits on ends, returns that call's result instead of raising: a worker woken as it was
closed went on waiting, and `butlers up` ignored SIGTERM (seen under callgrind, where every
turn is slow). `within` is what the code uses instead; a test holds the code to it.

A cancellation that reaches a call through anyio can be swallowed (anyio #1214): `cancellable`
makes the caller's cancellation land on plain asyncio.
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
from pathlib import Path

import pytest

from butlers.tasks import cancel_and_wait, cancellable, within

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


async def test_cancellable_returns_the_answer_and_raises_the_failure() -> None:
    async def answer() -> str:
        await asyncio.sleep(0)
        return "answer"

    async def fail() -> None:
        raise LookupError("no such thing")

    assert await cancellable(answer()) == "answer"
    with pytest.raises(LookupError, match="no such thing"):
        await cancellable(fail())


async def test_a_caller_of_a_call_that_swallows_its_cancellation_is_cancelled_all_the_same(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What anyio's cancel scope can do to an httpx request (anyio #1214): the call takes
    the cancellation for its own and goes on. Its caller still ends at once, cancelled; the
    call is given its time to end and then left to end on its own, its failure read."""
    swallowed = asyncio.Event()

    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(0.5)  # (then it ends, as a poll whose connection is closed)
        raise ConnectionResetError("the connection was closed under it")

    caller = asyncio.create_task(cancellable(stubborn(), give_up_after_s=0.1))
    await asyncio.sleep(0.01)
    started = time.monotonic()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert time.monotonic() - started < 0.4  # its 0.1 s, not the call's 0.5 s, nor 30
    assert swallowed.is_set()
    await asyncio.sleep(0.6)  # the call ends: its failure is read, nothing reported
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_call_that_honours_its_cancellation_is_cancelled_with_its_caller() -> None:
    started = asyncio.Event()

    async def polite() -> None:
        started.set()
        await asyncio.sleep(30)

    call = polite()
    caller = asyncio.create_task(cancellable(call))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert call.cr_frame is None  # (the call's coroutine ended: cancelled, not left behind)


def test_no_code_waits_with_asyncio_wait_for() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\basyncio\.wait_for\(|^\s*from asyncio import .*\bwait_for\b", line)
    ]
    assert offenders == [], f"use butlers.tasks.within instead of asyncio.wait_for: {offenders}"
