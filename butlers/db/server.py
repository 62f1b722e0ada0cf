"""Which PostgreSQL server the butlers use, and the block it runs for.

`server_for` picks `DATABASE_URL` when it is set (`ExternalServer`: only its address is ours),
else the embedded server (`EmbeddedServer`, butlers.db.embedded). Both answer `PostgresServer`,
which is all that migrations and the pool need of a server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote, urlsplit, urlunsplit

from butlers.db.embedded import EmbeddedServer
from butlers.errors import DatabaseError
from butlers.tasks import cancel_and_wait

if TYPE_CHECKING:
    from butlers.settings import Settings


class PostgresServer(Protocol):
    """Anything that can name a connection string for one database on a server."""

    def dsn(self, database: str) -> str: ...

    @property
    def description(self) -> str: ...


class ExternalServer:
    """A server we do not own (DATABASE_URL, a test container): only its address is ours."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("postgres", "postgresql"):
            raise DatabaseError(
                f"DATABASE_URL must start with postgresql://, got scheme {parts.scheme!r}"
            )
        self._parts = parts

    def dsn(self, database: str) -> str:
        return urlunsplit(self._parts._replace(scheme="postgresql", path="/" + quote(database)))

    @property
    def description(self) -> str:
        host = self._parts.hostname or "local socket"
        return f"PostgreSQL at {host}:{self._parts.port or 5432}"


def server_for(settings: Settings) -> ExternalServer | EmbeddedServer:
    """DATABASE_URL when set, else the embedded server under $BUTLERS_DATA_DIR/pgdata."""
    if settings.database_url is not None:
        return ExternalServer(settings.database_url.get_secret_value())
    return EmbeddedServer(settings.data_dir / "pgdata", environ=settings.environ)


@contextlib.asynccontextmanager
async def running(server: ExternalServer | EmbeddedServer) -> AsyncIterator[PostgresServer]:
    """Start the embedded server for the duration of the block, started again should it stop
    meanwhile (`EmbeddedServer.keep_running`); an external one just is."""
    if isinstance(server, EmbeddedServer):
        await server.start()
        watcher = asyncio.create_task(server.keep_running(), name="postgres:keep-running")
        try:
            yield server
        finally:
            await cancel_and_wait(watcher)
            await server.stop()
    else:
        yield server
