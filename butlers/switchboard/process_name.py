"""Which switchboard process is which on one database, and whose messages a restart resumes.

A process is named after its host and port (`host:8100`): the same after a restart, so that
a restarted process resumes the messages it left `processing` when it crashed, at once
instead of after their leases. But a name is not a process: two live processes may share one
(two machines called `raspberrypi` on one PostgreSQL server, two containers given one
hostname). Trusting the name, the second one's start took the first's messages under way
(and a butler could be asked twice, or the message answered "the answer was lost").

So each process claims messages under a name of its own, `host:8100/<random>`, and resumes
at start only while it holds an advisory lock on `host:8100` (on a connection of its own,
for as long as it runs): then no other live process goes by that name, and what processes
of that name left `processing` was left by processes that died. Without the lock (another
live process holds it) nothing is resumed at start; what a dead one left is taken over when
its leases end, as another replica's would be.

If the lock's connection ends later (a database restart), the lock is not taken again: a
process of the same name starting then resumes this one's messages under way, which is a
takeover like any other (the inbox's claims are fenced on the process's own name, and its
claim is checked before a butler is asked: butlers.switchboard.worker).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets

import asyncpg

from butlers.db import CONNECTION_ERRORS, close_connection
from butlers.switchboard.leadership import KEEPALIVE_SETTINGS, Connect
from butlers.tasks import within

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


def lock_key(name: str) -> int:
    """The advisory lock's key for a process name: a signed 64-bit hash, the same in every
    process (Python's own hash() is salted per process)."""
    digest = hashlib.blake2b(f"butlers process {name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class ProcessName:
    """This process's name (`name`, its host and port) and its own claimant id (`claimant`,
    the name and a random suffix), and whether it alone holds the name."""

    def __init__(self, connect: Connect, name: str) -> None:
        self._connect = connect
        self.name = name
        self.claimant = f"{name}/{secrets.token_hex(4)}"
        self.held = False
        self._conn: asyncpg.Connection | None = None

    async def open(self) -> bool:
        """Take the name's lock if no other live process holds it; whether it was taken. A
        database that cannot be reached now: not taken (nothing is resumed at start)."""
        try:
            self._conn = await within(self._connect(), CONNECT_TIMEOUT_S)
            # A process that vanished without closing its socket lets the name go within
            # about 10 s. No idle_session_timeout: the connection sits idle by design.
            for setting, value in KEEPALIVE_SETTINGS.items():
                with contextlib.suppress(asyncpg.PostgresError):  # a pooler, an old server
                    await self._conn.execute(f"SET {setting} = {value}")
            self.held = bool(
                await within(
                    self._conn.fetchval("SELECT pg_try_advisory_lock($1)", lock_key(self.name)),
                    CONNECT_TIMEOUT_S,
                )
            )
        except CONNECTION_ERRORS as exc:
            logger.warning(
                "switchboard %s: could not take its name's lock (%s): what a crash of it left "
                "under way is taken over when the leases end",
                self.name,
                exc,
                extra={"action": "process_name_unreachable"},
            )
            await self.close()
            return False
        if not self.held:
            logger.warning(
                "another live switchboard process on this database is named %s (the same host "
                "name and port); this one claims messages as %s and resumes nothing at start. "
                "Give each process its own host name or port",
                self.name,
                self.claimant,
                extra={"action": "process_name_shared"},
            )
            await self.close()
        return self.held

    async def close(self) -> None:
        """Let the name go (its connection ends, and with it the lock)."""
        conn, self._conn = self._conn, None
        self.held = False
        await close_connection(conn)
