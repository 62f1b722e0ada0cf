"""Alembic environment: run programmatically by butlers.db.migrate with `attributes["dsn"]`."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine


def _async_url(dsn: str) -> str:
    scheme, rest = dsn.split("://", 1)
    return f"postgresql+asyncpg://{rest}" if scheme in ("postgres", "postgresql") else dsn


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=None, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(dsn: str) -> None:
    engine = create_async_engine(_async_url(dsn), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    dsn = context.config.attributes.get("dsn")
    if not dsn:
        raise RuntimeError("butlers migrations are run by `butlers db upgrade`, not alembic's CLI")
    # Called from a worker thread (asyncio.to_thread), which has no running loop of its own.
    asyncio.run(_run_async(dsn))


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported")
run_migrations_online()
