"""Gateway.close() ends the gateway's own tasks (a notification to the hosts, a child's tool
list read again), not only its warm-ups and children, and none starts once it is closing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from butlers.gateway.config import load_gateway_config
from butlers.gateway.server import Gateway


async def test_close_ends_the_gateways_tasks_and_starts_none_after(tmp_path: Path) -> None:
    gateway = Gateway(load_gateway_config(tmp_path), [], environ=dict(os.environ))
    started, never = asyncio.Event(), asyncio.Event()

    async def hanging() -> None:  # a host that never reads its notification
        started.set()
        await never.wait()

    gateway._spawn(hanging())
    await started.wait()
    [task] = gateway._notify_tasks
    async with asyncio.timeout(10):
        await gateway.close()
    assert task.cancelled()
    assert not gateway._notify_tasks

    ran: list[str] = []

    async def late() -> None:  # a child's notification arriving as the gateway closes
        ran.append("late")

    gateway._spawn(late())
    await asyncio.sleep(0.05)
    assert ran == [] and not gateway._notify_tasks
