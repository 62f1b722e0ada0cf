"""What every command's process shares: the garbage collector paused while it imports (and
run less often by the long-running ones), and SIGINT/SIGTERM turned into a stop event for
those."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator


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


# Container objects allocated (net of those freed) before the youngest generation is collected.
# Python's 700 is passed in bursts by every request a server answers, garbage or not: with 16
# callers routing through `butlers up`, 2000-2500 collections in 10 s took 0.6-0.9 s of its
# 11-13 s of CPU (gc.callbacks, measured); at 10 000 there were 17-18, taking 0.1 s. In
# bench/route_overhead.py beside the code before (four runs): direct calls/s with 16 callers
# +5-37%, routed +4% (median), and direct's p99 with 16 callers 24-46 ms instead of 116-125 ms
# in three runs of four. What waits for a collection is at most that many objects (and what
# they hold): a reference cycle is freed a little later, each collection pauses ~6 ms, not ~0.3.
SERVING_GEN0_THRESHOLD = 10_000


def collect_as_a_server() -> None:
    """The collector's youngest generation collected every SERVING_GEN0_THRESHOLD objects
    instead of Python's 700, for a process that answers requests until it is stopped."""
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(SERVING_GEN0_THRESHOLD, gen1, gen2)


def keep_memory_private() -> None:
    """This process's memory and environment out of reach of other processes of its user:
    `PR_SET_DUMPABLE` 0 makes /proc/<pid>/environ, /mem and ptrace root's alone. A server's
    environment holds every secret of the fleet (the bot token, BUTLERS_AUTH_TOKEN, the
    database URL); a tool server it starts runs as the same user and could read them there
    (a red team did, then called every tool as the operator). Children are readable again
    once they exec (Linux resets the flag): see docs/tools.md for what a tool server can
    still reach. Elsewhere than Linux, nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:  # never expected: worth a line
        logging.getLogger(__name__).warning(
            "could not keep this process's memory private (prctl: %s)",
            os.strerror(ctypes.get_errno()),
        )


PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT or SIGTERM sets `stop`."""
    on_stop_signal(stop.set)


def on_stop_signal(callback: Callable[[], object]) -> None:
    """`callback` on the next SIGINT or SIGTERM (from now on, instead of what was there): a
    second Ctrl-C while a fleet stops hurries the stop."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, callback)
