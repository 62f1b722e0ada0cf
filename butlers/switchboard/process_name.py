"""Which switchboard process is which on one database, and whose messages a restart resumes.

A process is named after its host and port (`host:8100`): the same after a restart, so that
a restarted process resumes the messages it left `processing` when it crashed, at once
instead of after their leases. But a name is not a process: two live processes may share one
(two machines called `raspberrypi` on one PostgreSQL server, two containers given one
hostname). Trusting the name, one's start took the other's messages under way (and a butler
could be asked twice, or the message answered "the answer was lost").

So each process claims messages under an id of its own, `host:8100/<random>` (`claimant`),
and holds an advisory lock on that id, on a connection of its own, for as long as it runs.
At start it resumes what a process of its name left only where that process's lock is free:
the process is gone (PostgreSQL lets a lock go with its connection: at once for a killed
process, within about 10 s for a vanished machine, through TCP keepalives). A live twin
holds its lock, so its messages stay its own; ids are never reused, so a free lock is never
a live process's but in one case: its connection was cut (a database restart) and it has not
taken the lock again yet. It takes it again within seconds (`_keep`); a restart of a process
of the same name in those seconds would take its messages as a lease's end would (its claim
is checked before a butler is asked: butlers.switchboard.worker).

Claims of older releases (the bare name, or none) are resumed as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets

import asyncpg

from butlers.db import CONNECTION_ERRORS, close_connection
from butlers.switchboard.leadership import CHECK_S, KEEPALIVE_SETTINGS, RETRY_S, Connect
from butlers.switchboard.store import InboxQueue
from butlers.tasks import cancel_and_wait, within

logger = logging.getLogger(__name__)

TIMEOUT_S = 10.0  # connecting, a statement on the lock's connection


def lock_key(claimant: str) -> int:
    """The advisory lock's key for a claimant id: a signed 64-bit hash, the same in every
    process (Python's own hash() is salted per process)."""
    digest = hashlib.blake2b(f"butlers claimant {claimant}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class ProcessName:
    """This process's name (`name`, its host and port) and its own claimant id (`claimant`:
    the name and a random suffix), held as a lock while it runs."""

    def __init__(self, connect: Connect, name: str) -> None:
        self._connect = connect
        self.name = name
        self.claimant = f"{name}/{secrets.token_hex(4)}"
        self.held = False
        self._conn: asyncpg.Connection | None = None
        self._keeper: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Take this process's lock (a database that cannot be reached now: it is taken once
        it can be), and keep it."""
        with contextlib.suppress(*CONNECTION_ERRORS):
            await self._take()
        self._keeper = asyncio.create_task(self._keep(), name="switchboard:claimant-lock")

    async def close(self) -> None:
        """Let the lock go (its connection ends, and with it the lock)."""
        await cancel_and_wait(self._keeper)
        self._keeper = None
        await self._drop()

    async def resumable(self, inbox: InboxQueue) -> list[str]:
        """The claimants whose messages under way this process resumes at start: those of
        processes of its name that are gone (their locks free), and its bare name (claims of
        older releases). Asked before this process claims anything."""
        if self._conn is None:  # no lock, no proof of anyone's death: leases will tell
            return []
        gone = []
        for claimant in await inbox.claimants_under_way(self.name):
            if claimant == self.name:
                gone.append(claimant)
            elif claimant != self.claimant and await self._free(claimant):
                gone.append(claimant)
        return gone

    async def _free(self, claimant: str) -> bool:
        """Whether `claimant`'s lock is free: its process is gone (its id is never used
        again, so the lock taken to see is let go at once)."""
        assert self._conn is not None
        key = lock_key(claimant)
        if not await within(self._conn.fetchval("SELECT pg_try_advisory_lock($1)", key), TIMEOUT_S):
            return False
        await within(self._conn.fetchval("SELECT pg_advisory_unlock($1)", key), TIMEOUT_S)
        return True

    async def _take(self) -> None:
        self._conn = await within(self._connect(), TIMEOUT_S)
        # A process that vanished without closing its socket lets its lock go within about
        # 10 s; no idle_session_timeout (a paused process keeps its claims until the lease).
        for setting, value in KEEPALIVE_SETTINGS.items():
            with contextlib.suppress(asyncpg.PostgresError):  # a pooler, an old server
                await within(self._conn.execute(f"SET {setting} = {value}"), TIMEOUT_S)
        with contextlib.suppress(asyncpg.PostgresError):
            await within(self._conn.execute("SET idle_session_timeout = 0"), TIMEOUT_S)
        key = lock_key(self.claimant)
        self.held = bool(
            await within(self._conn.fetchval("SELECT pg_try_advisory_lock($1)", key), TIMEOUT_S)
        )

    async def _keep(self) -> None:
        """Check the lock's connection; when it is gone, connect and take the lock again."""
        while True:
            try:
                if not self.held:
                    await self._drop()
                    await self._take()
                    if self.held:
                        logger.info(
                            "switchboard %s holds its claims' lock again",
                            self.claimant,
                            extra={"action": "claimant_lock_taken"},
                        )
                await asyncio.sleep(CHECK_S if self.held else RETRY_S)
                if self.held:
                    assert self._conn is not None
                    await within(self._conn.fetchval("SELECT 1"), CHECK_S)
            except CONNECTION_ERRORS as exc:
                if self.held:
                    logger.warning(
                        "switchboard %s: its claims' lock is unreachable (%s); taking it again",
                        self.claimant,
                        exc,
                        extra={"action": "claimant_lock_lost"},
                    )
                self.held = False
                await asyncio.sleep(RETRY_S)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self.held = False
        await close_connection(conn)
