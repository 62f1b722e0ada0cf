"""Wake-ups between switchboard processes: PostgreSQL LISTEN/NOTIFY.

A message stored by one process (its webhook, the leader's poller, an `ask`) must not wait
for another process's next look at the inbox; a reply queued by any process must reach the
leader's outbox at once; an `ask` waiting in one process must hear that another finished its
message. Triggers notify (migration switchboard_0005); this listens, on a connection of its
own, and calls back. The workers' periodic look at their tables stays as the fallback for
whatever was said while this connection was down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

from butlers.db import CONNECTION_ERRORS, close_connection
from butlers.tasks import cancel_and_wait, within

logger = logging.getLogger(__name__)

INBOX_QUEUED = "butlers_inbox"
INBOX_FINISHED = "butlers_inbox_finished"  # payload: the inbox id
OUTBOX_QUEUED = "butlers_outbox"  # payload: the channel
RECONNECT_S = 2.0
CHECK_S = 10.0  # a silent connection is checked this often (a dead one hears nothing)


@dataclass(frozen=True)
class WakeupHandlers:
    queued: Callable[[], None]
    finished: Callable[[int], None]
    outbox: Callable[[str], None]


class Wakeups:
    """LISTEN on the switchboard's channels for as long as the process runs; reconnects."""

    def __init__(
        self, connect: Callable[[], Awaitable[asyncpg.Connection]], handlers: WakeupHandlers
    ) -> None:
        self._connect = connect
        self.handlers = handlers
        self.listening = False
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self._task = asyncio.create_task(self._run(), name="switchboard:wakeups")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await within(self._connect(), RECONNECT_S * 5)
                await conn.add_listener(INBOX_QUEUED, self._on_notification)
                await conn.add_listener(INBOX_FINISHED, self._on_notification)
                await conn.add_listener(OUTBOX_QUEUED, self._on_notification)
                self.listening = True
                # What was said before we listened is found by the workers' own look.
                self.handlers.queued()
                while True:
                    await asyncio.sleep(CHECK_S)
                    await within(conn.fetchval("SELECT 1"), CHECK_S)
            except CONNECTION_ERRORS as exc:
                logger.info("switchboard: not listening for wake-ups (%s); again soon", exc)
            finally:
                self.listening = False
                await close_connection(conn)
            await asyncio.sleep(RECONNECT_S)

    def _on_notification(self, _conn: object, _pid: int, channel: str, payload: object) -> None:
        if channel == INBOX_QUEUED:
            self.handlers.queued()
        elif channel == INBOX_FINISHED:
            with contextlib.suppress(ValueError):
                self.handlers.finished(int(str(payload)))
        elif channel == OUTBOX_QUEUED:
            self.handlers.outbox(str(payload))
