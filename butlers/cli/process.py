"""What every command's process shares: the garbage collector paused while it imports, and
SIGINT/SIGTERM turned into a stop event for the long-running ones."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The garbage collector off while a command imports its libraries, and what they built
    frozen after (never traversed again). Python 3.11 collects over and over while some 900
    modules import, pydantic's models above all: measured, `butlers gateway` imports in 0.7 s
    instead of 0.8-0.95 s this way, with under a thousand garbage objects left behind."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
