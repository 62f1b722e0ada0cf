"""A TCP front on 127.0.0.1 for a server on another local port.

With `ssl`, it terminates TLS: implicit TLS (IMAPS, port 993 style) in front of a server that
only speaks plaintext (pymap serves STARTTLS, not implicit TLS). Without, it is a plain pipe,
so STARTTLS passes through it. Either way it records what clients sent (decrypted, when it
terminates TLS: so a test can tell a login never went out in plaintext), and `drop()` cuts
every open connection while the server stays up: a network drop, not a restart. `hold()`
keeps new connections waiting (accepted, not yet passed on; `held` counts them) until
`release()`: a test can tell a client is reconnecting, and act before it gets through.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl as ssl_module


class TcpFront:
    def __init__(self, target_port: int, *, ssl: ssl_module.SSLContext | None = None) -> None:
        self.target_port = target_port
        self.ssl = ssl
        self.port = 0
        self.received = bytearray()  # every byte clients sent, as the front saw it
        self.connections = 0  # connections a client opened (and, with ssl, completed TLS on)
        self.held = 0  # connections that waited (or wait) at a hold() before being passed on
        self._gate = asyncio.Event()
        self._gate.set()
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        self.drop()
        self.release()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def drop(self) -> None:
        """Cut every open connection (both sides) without a goodbye."""
        for writer in list(self._open):
            writer.transport.abort()

    def hold(self) -> None:
        """From now on, new connections wait until release() (open ones carry on)."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if not self._gate.is_set():
            self.held += 1
            self._open.add(writer)  # drop() and stop() cut it too
            await self._gate.wait()
            self._open.discard(writer)
            if writer.transport.is_closing():
                return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open |= {writer, up_writer}
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, record=True),
                self._pipe(up_reader, writer, record=False),
            )
        finally:
            self._open -= {writer, up_writer}
            for w in (writer, up_writer):
                w.transport.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, record: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if record:
                    self.received += data
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side is gone: so is the other
