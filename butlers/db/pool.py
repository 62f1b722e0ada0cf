"""A butler's asyncpg pool: JSONB as Python values, no reset query on release; the errors a
call on a connection that went away raises, and how a connection of its own is ended."""

from __future__ import annotations

import contextlib

import asyncpg

from butlers.db.server import PostgresServer
from butlers.errors import DatabaseError
from butlers.tasks import within


async def _init_connection(conn: asyncpg.Connection) -> None:
    import json

    # JSONB in and out as Python values, so no call site encodes by hand.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _skip_reset(conn: asyncpg.Connection) -> None:
    """Release without asyncpg's default reset query (`RESET ALL; UNLISTEN *; ...`).

    That query is a second round trip after every pooled statement. Butlers never leave state
    on a connection (no SET, LISTEN, advisory locks or open cursors), and asyncpg still rolls
    back a transaction left open, so there is nothing to reset.
    """


# What a database call on a connection that went away raises, besides PostgreSQL's own errors
# (asyncpg's InterfaceError: "connection is closed").
CONNECTION_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)
CLOSE_TIMEOUT_S = 5.0


async def close_connection(conn: asyncpg.Connection | None) -> None:
    """End a connection of its own (a lock's, a listener's): politely within CLOSE_TIMEOUT_S,
    else at once (a server that stopped answering must not hold a stop up)."""
    if conn is None or conn.is_closed():
        return
    with contextlib.suppress(Exception):
        await within(conn.close(), CLOSE_TIMEOUT_S)
    if not conn.is_closed():
        conn.terminate()


async def create_pool(server: PostgresServer, database: str, *, max_size: int = 5) -> asyncpg.Pool:
    """A pool on `database`, its connections set up by `_init_connection` and released
    without a reset query (`_skip_reset`); an unreachable server is a DatabaseError."""
    try:
        return await asyncpg.create_pool(
            server.dsn(database),
            min_size=1,
            max_size=max_size,
            init=_init_connection,
            reset=_skip_reset,
            timeout=10,
        )
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise DatabaseError(f"cannot open a pool on {database!r}: {exc}") from exc
