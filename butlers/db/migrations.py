"""Each butler's database: created when missing, then migrated by alembic, one process at
a time.

The alembic scripts themselves are the package data in butlers/migrations (branch `core` for
every butler, `switchboard` for the switchboard); this module runs them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import asyncpg

from butlers.db.server import PostgresServer
from butlers.errors import DatabaseError, SchemaTooNew

# One logger for the whole package, named as it was when butlers.db was one module: log
# lines (their `logger` field) and any level set on it stay as they were.
logger = logging.getLogger("butlers.db")

# alembic's scripts are package data of `butlers` (butlers/migrations), so a wheel or pipx
# install migrates from wherever it is installed; alembic resolves "package:path" through
# importlib.resources.
MIGRATIONS_RESOURCE = "butlers:migrations"


async def ensure_database(server: PostgresServer, database: str) -> bool:
    """Create `database` if it does not exist; returns True when it was created."""
    try:
        conn = await asyncpg.connect(server.dsn("postgres"), timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise DatabaseError(f"cannot reach {server.description}: {exc}") from exc
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        if exists:
            return False
        try:
            await conn.execute(f'CREATE DATABASE "{database}"')
        except (asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
            # Created concurrently by another process (at the same moment, PostgreSQL says
            # so with the catalog's unique index rather than "already exists").
            return False
        logger.info("created database %s", database, extra={"action": "db_create"})
        return True
    except asyncpg.PostgresError as exc:
        raise DatabaseError(f"cannot create database {database!r}: {exc}") from exc
    finally:
        await conn.close()


def migrations_dir() -> Path:
    """The directory of the alembic scripts inside the installed `butlers` package.

    Raises DatabaseError, saying how to repair it, when the install lacks them (a wheel built
    without its package data, files deleted): without it alembic's own error would only name
    a path.
    """
    from importlib import resources

    package, _, name = MIGRATIONS_RESOURCE.partition(":")
    location = resources.files(package) / name
    # A regular install is a directory on disk; alembic needs one (it lists versions/).
    if not isinstance(location, Path) or not (location / "env.py").is_file():
        raise DatabaseError(
            f"this butlers installation has no database migrations (looked for {location}/"
            "env.py); the package was installed without its data files: reinstall it "
            "(pip install --force-reinstall butlers, or pip install . from a checkout)"
        )
    return location


def _alembic_config(dsn: str):
    from alembic.config import Config

    migrations_dir()  # fail with the repair hint before alembic fails with a bare path
    config = Config()
    config.set_main_option("script_location", MIGRATIONS_RESOURCE)
    config.attributes["dsn"] = dsn
    return config


# alembic keeps the migration being run in module-level state (`alembic.context`, `op`):
# two upgrades in two threads of one process would run each other's scripts.
_alembic_running = threading.Lock()


def _upgrade_blocking(dsn: str, branches: Sequence[str]) -> None:
    from alembic import command

    config = _alembic_config(dsn)
    with _alembic_running:
        for branch in branches:
            command.upgrade(config, f"{branch}@head")


# An advisory lock held while a database is migrated ("butlers" in ASCII, + 1): replicas
# starting together (a Kubernetes Deployment) migrate one after the other, the later ones
# finding the database at its heads, instead of creating the same tables at once.
MIGRATION_LOCK_KEY = 0x6275746C657274


# What `alembic_version` holds once a butler's branches are at their heads (core; core then
# switchboard). A database found there is not handed to alembic at all: a start of `butlers
# up` on existing databases imported alembic and SQLAlchemy and ran an upgrade per branch that
# had nothing to do (bench/startup.py, docs/benchmarks.md). tests/test_db.py checks these
# against the scripts: a new migration fails it until it is named here.
AT_HEADS: dict[tuple[str, ...], frozenset[str]] = {
    ("core",): frozenset({"core_0012"}),
    ("core", "switchboard"): frozenset({"core_0012", "switchboard_0014"}),
}


async def _at_heads(conn: asyncpg.Connection, branches: Sequence[str]) -> bool:
    """The database is exactly at the heads of `branches` (AT_HEADS): nothing to migrate."""
    expected = AT_HEADS.get(tuple(branches))
    if expected is None:
        return False
    try:
        rows = await conn.fetch("SELECT version_num FROM alembic_version")
    except asyncpg.UndefinedTableError:  # never migrated
        return False
    return frozenset(row[0] for row in rows) == expected


# alembic's words for a revision in the database that none of its scripts has.
_UNKNOWN_REVISION = re.compile(r"Can't locate revision identified by '([^']*)'")


async def migrate(server: PostgresServer, database: str, branches: Sequence[str]) -> bool:
    """Apply alembic branches in order (e.g. core, then switchboard) to one database; one
    process at a time. A database already at their heads is left as it is, without alembic
    (False: nothing was done)."""
    try:
        lock = await asyncpg.connect(server.dsn(database), timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise DatabaseError(f"cannot reach {database!r} to migrate it: {exc}") from exc
    try:
        if await _at_heads(lock, branches):
            return False  # a migration under way never moves it past the heads: no wait
        await lock.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        await asyncio.to_thread(_upgrade_blocking, server.dsn(database), tuple(branches))
        return True
    except DatabaseError:
        raise
    except Exception as exc:
        if unknown := _UNKNOWN_REVISION.search(str(exc)):
            # Run by a newer butlers (a rollback): alembic's words alone do not say so.
            raise SchemaTooNew(
                f"database {database!r} was migrated by a newer butlers (its schema revision "
                f"{unknown.group(1)!r} is unknown to this one): run that newer butlers, or "
                "restore a backup of the data made before it ran. (If this is the newest "
                "butlers, its installation lacks a migration: reinstall it before anything "
                "else.)"
            ) from exc
        raise DatabaseError(f"migrating {database!r} failed: {exc}") from exc
    finally:
        await lock.close()  # and the lock with it


async def revisions(server: PostgresServer, database: str) -> frozenset[str]:
    """The schema revisions `database` is at (none: not migrated yet, or not there)."""
    try:
        conn = await asyncpg.connect(server.dsn(database), timeout=10)
    except asyncpg.InvalidCatalogNameError:
        return frozenset()
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise DatabaseError(f"cannot reach {database!r}: {exc}") from exc
    try:
        rows = await conn.fetch("SELECT version_num FROM alembic_version")
    except asyncpg.UndefinedTableError:
        return frozenset()
    finally:
        await conn.close()
    return frozenset(row[0] for row in rows)


async def prepare_database(server: PostgresServer, database: str, branches: Sequence[str]) -> bool:
    """Create if missing, then migrate: what `butlers db upgrade` does for one butler.
    Whether anything was migrated."""
    await ensure_database(server, database)
    return await migrate(server, database, branches)
