"""Ending the gateway's children with everything they started, whatever way the gateway goes.

A child runs in a process group of its own (start_new_session), so a closed child's whole group
is ended (`end_group`): its `sh -c` / `npx` / `uvx` wrapper and the real server it started. For a
gateway that is killed (SIGKILL: no code of ours runs), the watchdog (butlers/gateway/watchdog.py,
a tiny process of its own) holds the list of live groups and ends them when the gateway's end of
its pipe closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

WATCHDOG = Path(__file__).with_name("watchdog.py")


class Watchdog:
    """The gateway's side of the watchdog: started on first use, told each child group as it
    starts and ends, closed (which ends it) when the gateway closes."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._pipe: int | None = None

    def watch(self, group: int) -> None:
        self._send(f"+{group}\n")

    def forget(self, group: int) -> None:
        self._send(f"-{group}\n")

    def _send(self, line: str) -> None:
        if self._pipe is None and not self._start():
            return
        assert self._pipe is not None
        try:
            os.write(self._pipe, line.encode())
        except OSError as exc:  # it died: children still end with close() and PDEATHSIG
            logger.warning("gateway watchdog gone: %s", exc, extra={"action": "watchdog_lost"})
            self._close_pipe()

    def _start(self) -> bool:
        read_end, write_end = os.pipe()
        try:
            # Its own session: a terminal's signals to the gateway's group do not reach it, and
            # it outlives the gateway (no PDEATHSIG). No stdout/stderr of the host's: a host
            # waiting for the gateway's output to end is not kept waiting by it.
            self._process = subprocess.Popen(
                [sys.executable, "-S", str(WATCHDOG)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            os.close(write_end)
            logger.warning(
                "cannot start the gateway watchdog (%s): a killed gateway may leave "
                "grandchildren behind",
                exc,
                extra={"action": "watchdog_failed"},
            )
            return False
        finally:
            os.close(read_end)
        self._pipe = write_end
        return True

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.close(self._pipe)
            self._pipe = None

    async def close(self) -> None:
        """End of input: it ends what is still recorded (nothing, after a clean close) and
        exits."""
        self._close_pipe()
        process, self._process = self._process, None
        if process is not None:
            await asyncio.to_thread(process.wait)


async def end_group(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM to the child's process group, SIGKILL to what is left of it after `grace_s`:
    the child and what it started, even when the child itself has already exited."""
    group = process.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if process.returncode is None:
            # asyncio.wait, not a timeout: this runs in a task being cancelled (a call cut
            # short ends its child), where some 3.11 releases take a timeout's expiry for the
            # task's own cancellation and would skip the SIGKILL below.
            exiting = asyncio.ensure_future(process.wait())
            try:
                await asyncio.wait({exiting}, timeout=max(0.0, deadline - loop.time()))
            finally:
                exiting.cancel()
        elif await asyncio.to_thread(group_alive, group):
            await asyncio.sleep(0.05)
        else:
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    await process.wait()


def group_alive(group: int) -> bool:
    """Whether a process of `group` still runs. An orphaned grandchild that has exited stays a
    zombie until init reaps it (here up to a second: measured), which kill(0) still finds; so
    the group's members are looked for among psutil's processes, zombies left out.

    Blocking (it reads the process table): called in a worker thread. psutil has no process
    group of its own, so os.getpgid names each process's. psutil is imported on first use: a
    gateway that never ends a child does not pay for it at start-up.
    """
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    import psutil

    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == group and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue  # gone meanwhile
    return False
