"""The reaper's `group_alive`: whether a child's process group still has a running member.

Real processes in process groups of their own, as the gateway starts its children: a group
whose leader has exited but is not reaped yet (a zombie, which kill(0) still finds), and one
whose leader has exited while a grandchild it started runs on (what `sh -c` / npx leave).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from butlers.gateway.reaper import group_alive


def exited_unreaped(process: subprocess.Popen[bytes]) -> None:
    """Wait until `process` has exited, leaving it a zombie (WNOWAIT: not reaped)."""
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)


def ended(process: psutil.Process) -> bool:
    """Whether `process` has exited: gone, or a zombie until its parent reaps it (a zombie of
    the group stays in it, and kill(0) finds it)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts, each a session (so a process group) of its own; killed and
    reaped at the end, whatever the test did."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_group_of_only_a_zombie_is_not_alive(started: list[subprocess.Popen[bytes]]) -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    started.append(process)
    exited_unreaped(process)
    os.killpg(process.pid, 0)  # kill(0) still finds the group: the zombie is in it
    assert psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE
    assert group_alive(process.pid) is False
    process.wait()
    assert group_alive(process.pid) is False  # no such group at all


def test_a_group_lives_while_the_grandchild_of_an_exited_leader_runs(
    started: list[subprocess.Popen[bytes]],
) -> None:
    wrapper = subprocess.Popen(
        ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    started.append(wrapper)
    assert wrapper.stdout is not None
    grandchild = psutil.Process(int(wrapper.stdout.readline()))
    wrapper.stdout.close()
    exited_unreaped(wrapper)  # the leader is a zombie now; its sleep runs on in the group
    assert os.getpgid(grandchild.pid) == wrapper.pid
    assert group_alive(wrapper.pid) is True

    grandchild.kill()
    while not ended(grandchild):  # no handle on its exit: it is init's child now
        time.sleep(0.01)
    assert group_alive(wrapper.pid) is False
