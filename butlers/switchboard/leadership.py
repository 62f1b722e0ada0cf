"""Leadership: which of several switchboard processes on one database runs what must run once.

Every switchboard process serves MCP, takes webhooks and processes the inbox. The Telegram
getUpdates loop, the IMAP session and the outbox's senders must run in exactly one of them:
Telegram answers a second poller with 409 Conflict, a mailbox read twice is read for nothing,
and replies go out in order and within the Bot API's flood limit only from one sender.

The leader is the process holding a PostgreSQL advisory lock (`pg_try_advisory_lock`) on a
connection of its own. PostgreSQL releases the lock when that connection ends, so when the
leader dies (a SIGKILL closes its socket at once) another process gets the lock at its next
try, within `retry_s`. A leader that cannot reach the database any more (a network split: its
check fails within `check_s`) steps down on its own; PostgreSQL drops the lock's connection of
a leader that vanished without closing its socket, or stopped checking (LIVENESS_SETTINGS).
A leader stepping down lets a reply under way finish, and the next one leaves a reply another
process is sending alone for a while (butlers.switchboard.outbox): two leaders for a moment
send nothing twice.

A lone switchboard takes the lock at its first try, inside `start()`: it runs as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

import asyncpg

from butlers.db import CONNECTION_ERRORS, close_connection
from butlers.tasks import cancel_and_wait, within

logger = logging.getLogger(__name__)

# The lock's key: any bigint, the same in every process of one switchboard's database
# (advisory locks are per database). "butlers" in ASCII.
LOCK_KEY = 0x6275746C657273
RETRY_S = 2.0  # a follower tries the lock this often: a dead leader is replaced within this
CHECK_S = 3.0  # a leader checks its lock's connection this often
# What makes PostgreSQL end the lock's connection, and so the leadership, of a leader that
# cannot lead any more:
# - server-side keepalives: one that vanished without closing its socket (its machine lost),
#   within about idle + interval * count seconds;
# - idle_session_timeout (PostgreSQL 14+): one whose process is paused (SIGSTOP, a frozen
#   VM) or whose event loop hangs, which no longer asks `SELECT 1` every CHECK_S while its
#   kernel still answers the keepalives (a red team: a paused leader was never replaced).
KEEPALIVE_SETTINGS = {
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "2",
}
LIVENESS_SETTINGS = {**KEEPALIVE_SETTINGS, "idle_session_timeout": f"'{int(CHECK_S * 5)}s'"}


@runtime_checkable
class LeaderDuty(Protocol):
    """Something only the leader runs (a channel's poller, the outbox's senders)."""

    name: str

    async def lead(self) -> None:
        """Start it: this process is the leader now."""
        ...

    async def step_down(self) -> None:
        """Stop it: this process is no longer the leader (or is stopping)."""
        ...


Connect = Callable[[], Awaitable[asyncpg.Connection]]


class Leadership:
    """Holds (or waits for) the leader's lock, and runs the duties while it holds it."""

    def __init__(
        self,
        connect: Connect,
        duties: Sequence[LeaderDuty],
        *,
        replica: str,
        retry_s: float = RETRY_S,
        check_s: float = CHECK_S,
    ) -> None:
        self._connect = connect
        self.duties = tuple(duties)
        self.replica = replica
        self.retry_s = retry_s
        self.check_s = check_s
        self.is_leader = False
        # How many times this process has asked PostgreSQL for the lock: what a follower's
        # "still not leading" is measured in (tests wait on it, not on the clock).
        self.tries = 0
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Future[None] | None = None  # the duties' latest step-down

    async def open(self) -> None:
        """Try the lock once now (a lone switchboard leads from its first moment), then keep
        trying, or keep checking it, in the background."""
        with contextlib.suppress(*CONNECTION_ERRORS):
            await self._try_lock()
        self._task = asyncio.create_task(self._run(), name="switchboard:leadership")

    async def close(self) -> None:
        """Step down and let the lock go, so that another process takes over at once."""
        await cancel_and_wait(self._task)
        self._task = None
        await self._step_down()
        if self._stopping is not None:  # (begun by the task: the lock was lost)
            await self._stopping
        await self._close()

    async def _run(self) -> None:
        while True:
            try:
                if not self.is_leader:
                    await self._try_lock()
                if self.is_leader:
                    await self._hold()
                else:
                    await asyncio.sleep(self.retry_s)
            except CONNECTION_ERRORS as exc:
                # The lock's connection is gone, and with it the lock: stop leading first.
                was_leader = self.is_leader
                await self._step_down()
                await self._close()
                log = logger.warning if was_leader else logger.info
                log(
                    "switchboard %s: the leader's lock is unreachable (%s); trying again",
                    self.replica,
                    exc,
                    extra={"action": "leader_lost" if was_leader else "leader_retry"},
                )
                await asyncio.sleep(self.retry_s)

    async def _try_lock(self) -> None:
        if self._conn is None or self._conn.is_closed():
            self._conn = await within(self._connect(), self.retry_s * 5)
            for name, value in LIVENESS_SETTINGS.items():
                with contextlib.suppress(asyncpg.PostgresError):  # a pooler, an old server
                    await self._conn.execute(f"SET {name} = {value}")
        got = await within(
            self._conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY), self.retry_s * 5
        )
        self.tries += 1
        if got:
            await self._lead()

    async def _hold(self) -> None:
        """While leading: the lock holds as long as its connection answers."""
        assert self._conn is not None
        while True:
            await asyncio.sleep(self.check_s)
            await within(self._conn.fetchval("SELECT 1"), self.check_s)

    async def _lead(self) -> None:
        self.is_leader = True
        logger.info(
            "switchboard %s leads: it runs %s",
            self.replica,
            ", ".join(d.name for d in self.duties) or "nothing more",
            extra={"action": "leader_elected"},
        )
        for duty in self.duties:
            try:
                await duty.lead()
            except Exception:  # one duty that cannot start must not keep the others down
                logger.exception("switchboard %s: %s did not start", self.replica, duty.name)

    async def _step_down(self) -> None:
        """Every duty stops at once, side by side: the outbox lets a reply under way finish
        (up to its STEP_DOWN_DRAIN_S) while the pollers, which another leader may run
        already, stop now (one after the other, they polled on for the outbox's drain: a
        review). Shielded: a close() that cancels the leadership's task in the middle of it
        still finds every duty stopped."""
        if not self.is_leader:
            return
        self.is_leader = False
        self._stopping = asyncio.ensure_future(self._stop_duties())
        await asyncio.shield(self._stopping)

    async def _stop_duties(self) -> None:
        outcomes = await asyncio.gather(
            *(duty.step_down() for duty in self.duties), return_exceptions=True
        )
        for duty, outcome in zip(self.duties, outcomes, strict=True):
            if isinstance(outcome, Exception):
                logger.error(
                    "switchboard %s: %s did not stop cleanly",
                    self.replica,
                    duty.name,
                    exc_info=outcome,
                )
        logger.info(
            "switchboard %s stepped down", self.replica, extra={"action": "leader_stepped_down"}
        )

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        await close_connection(conn)
