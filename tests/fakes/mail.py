"""Real mail servers on 127.0.0.1 for the email tests, with a private CA.

- `MailCA`: a CA of our own (trustme) and a certificate for 127.0.0.1 / localhost, as files
  (pymap reads them) and as a server SSLContext (aiosmtpd, TcpFront).
- `pymap_server()`: the pymap IMAP server in a subprocess; with a certificate it offers
  STARTTLS (pymap serves no implicit TLS: put a `TcpFront(ssl=...)` in front for that). It
  keeps keywords like Dovecot, Gmail or Fastmail do (PERMANENTFLAGS with `\\*`); pymap's
  in-memory backend alone keeps them for the session only (`keywords=False`). With a
  `transcript` file it logs every line of every connection there (`PymapTranscript` reads
  it): what the server got, decrypted, STARTTLS sessions included.
- `SmtpServer`: aiosmtpd on a free port (its Controller cannot take port 0), recording the
  mails it takes and the credentials it was given.
- `RecordingWorker`: what the email module hands mail to, for tests of the connection rather
  than of the inbox: it keeps what it is given.
- `record_threads()`: which thread each call of some functions ran on (the event loop's, or a
  worker thread).
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import logging
import re
import ssl
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import aioimaplib
import pytest
import trustme
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from butlers.switchboard.inbox import IncomingMessage
from tests.conftest import free_port
from tests.fakes import wait_listening


class MailCA:
    """A private CA and one server certificate for 127.0.0.1 and localhost."""

    def __init__(self, directory: Path) -> None:
        self.ca = trustme.CA(organization_name="Butlers test CA")
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_file = directory / "ca.pem"  # what SSL_CERT_FILE points at
        self.cert_file = directory / "server.pem"
        self.key_file = directory / "server.key"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        cert.private_key_pem.write_to_path(str(self.key_file))
        with self.cert_file.open("wb") as f:
            for pem in cert.cert_chain_pems:
                f.write(pem.bytes())
        self._cert = cert

    def server_context(self, *names: str) -> ssl.SSLContext:
        """A server's context: the certificate for 127.0.0.1 and localhost, or for `names`."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        (self.ca.issue_cert(*names) if names else self._cert).configure_cert(context)
        return context


# pymap's `dict` backend, with keywords kept as permanent flags (`\*` in PERMANENTFLAGS).
_PYMAP_KEEPING_KEYWORDS = """
import sys
from pymap.backend.dict.mailbox import MailboxData
from pymap.main import main
from pymap.parsing.specials.flag import Recent, Wildcard, get_system_flags

MailboxData.permanent_flags = property(lambda self: get_system_flags() - {Recent} | {Wildcard})
sys.argv[0] = "pymap"
sys.exit(main())
"""


@asynccontextmanager
async def pymap_server(
    user: str,
    password: str,
    *,
    ca: MailCA | None = None,
    keywords: bool = True,
    transcript: Path | None = None,
) -> AsyncIterator[int]:
    """pymap on a free port (yielded): STARTTLS offered when given a CA's certificate;
    keywords kept across sessions unless `keywords=False`; its sessions logged line by line
    into `transcript` when given (see PymapTranscript)."""
    port = free_port()
    tls = (
        ["--cert", str(ca.cert_file), "--key", str(ca.key_file)] if ca is not None else ["--no-tls"]
    )
    command = (
        [sys.executable, "-c", _PYMAP_KEEPING_KEYWORDS]
        if keywords
        else [str(Path(sys.executable).parent / "pymap")]
    )
    log = transcript.open("wb") if transcript is not None else subprocess.DEVNULL
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            *(["--debug"] if transcript is not None else []),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *tls,
            "dict",
            "--demo-user",
            user,
            "--demo-password",
            password,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            await wait_listening(port)
            yield port
        finally:
            if process.returncode is None:
                process.terminate()
                await asyncio.wait_for(process.wait(), 10)
    finally:
        if not isinstance(log, int):
            log.close()


# pymap --debug: "DEBUG:pymap.imap:<connection> -->| <line>" (client to server), "<--|" (server
# to client), "+++|" (connected), "---|" (disconnected).
_TRANSCRIPT_LINE = re.compile(r"^DEBUG:pymap\.imap:(\w+) (-->|<--|\+\+\+|---)\| ?(.*)$")


class PymapTranscript:
    """What a `pymap_server(transcript=...)` logged, connection by connection: each line a
    client sent (`-->`) and got (`<--`), as the server saw them, decrypted."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def connections(self) -> dict[str, list[tuple[str, str]]]:
        """Each connection's lines, in order: (direction, text)."""
        sessions: dict[str, list[tuple[str, str]]] = {}
        if not self.path.exists():
            return sessions
        for line in self.path.read_text(errors="replace").splitlines():
            if found := _TRANSCRIPT_LINE.match(line):
                name, direction, text = found.groups()
                sessions.setdefault(name, []).append((direction, text))
        return sessions

    def idling(self) -> int:
        """How many open connections are in IDLE now: the last line their client sent is an
        IDLE command, and the server has answered it with its continuation ("+ ...")."""
        count = 0
        for lines in self.connections().values():
            if any(direction == "---" for direction, _ in lines):
                continue
            sent = [i for i, (direction, _) in enumerate(lines) if direction == "-->"]
            if not sent or not lines[sent[-1]][1].upper().endswith(" IDLE"):
                continue
            count += any(d == "<--" and t.startswith("+") for d, t in lines[sent[-1] + 1 :])
        return count


async def _test_client(port: int, user: str, password: str) -> aioimaplib.IMAP4:
    """A logged-in client for the test's own use. It logs in with aioimaplib's logger off:
    aioimaplib logs the password when it has a quote or backslash, and that would be the
    test's leak, not the module's (tests/test_email_secrets.py reads every log)."""
    client = aioimaplib.IMAP4(host="127.0.0.1", port=port)
    await client.wait_hello_from_server()
    logger = logging.getLogger("aioimaplib.aioimaplib")
    disabled, logger.disabled = logger.disabled, True
    try:
        response = await client.login(user, password)
    finally:
        logger.disabled = disabled
    assert response.result == "OK", response
    return client


async def imap_append(port: int, user: str, password: str, raw: bytes | EmailMessage) -> None:
    """APPEND a mail to INBOX (pymap lets a plaintext client log in)."""
    client = await _test_client(port, user, password)
    data = raw.as_bytes() if isinstance(raw, EmailMessage) else raw
    response = await client.append(data, mailbox="INBOX")
    assert response.result == "OK", response
    await client.logout()


async def imap_unseen(port: int, user: str, password: str) -> list[bytes]:
    client = await _test_client(port, user, password)
    await client.select("INBOX")
    response = await client.uid_search("UNSEEN")
    await client.logout()
    return response.lines[0].split()


async def imap_flags(port: int, user: str, password: str) -> dict[int, set[str]]:
    """Every mail's UID and flags, as another client (or the next start) would see them."""
    client = await _test_client(port, user, password)
    await client.select("INBOX")
    response = await client.fetch("1:*", "(UID FLAGS)")
    await client.logout()
    flags = {}
    for line in response.lines:
        uid = re.search(rb"\bUID (\d+)", bytes(line))
        found = re.search(rb"\bFLAGS \(([^)]*)\)", bytes(line))
        if uid is not None and found is not None:
            flags[int(uid.group(1))] = set(found.group(1).decode().split())
    return flags


async def imap_store(port: int, user: str, password: str, uid: int, flags: str) -> None:
    """UID STORE `flags` (e.g. "+FLAGS ($ButlersTried)") on one mail."""
    client = await _test_client(port, user, password)
    await client.select("INBOX")
    response = await client.uid("store", str(uid), flags)
    assert response.result == "OK", response
    await client.logout()


class SmtpServer:
    """aiosmtpd in its own thread: `messages` it took, `logins` (user, password) it was given.

    tls: "starttls" (AUTH only after STARTTLS), "implicit" (TLS from the first byte), or
    "none"; auth: whether AUTH is offered at all (a local relay offers none)."""

    def __init__(
        self,
        *,
        tls: str = "none",
        auth: bool = True,
        ca: MailCA | None = None,
        users: dict[str, str] | None = None,
    ) -> None:
        self.messages: list[EmailMessage] = []
        self.recipients: list[list[str]] = []  # each mail's envelope (RCPT TO)
        self.logins: list[tuple[str, str]] = []
        self.arrived = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._users = users or {}
        self.port = free_port()
        options: dict[str, Any] = {}
        if auth:
            options["authenticator"] = self._authenticate
        if not auth:  # aiosmtpd offers AUTH only over TLS unless told otherwise: here, never
            assert tls == "none"
            options["auth_require_tls"] = True
        elif tls == "starttls":
            assert ca is not None
            options |= {
                "tls_context": ca.server_context(),
                "require_starttls": True,
                "auth_require_tls": True,
            }
        elif tls == "implicit":
            assert ca is not None
            options |= {"ssl_context": ca.server_context(), "auth_require_tls": False}
        else:
            options["auth_require_tls"] = False
        self.controller = Controller(self, hostname="127.0.0.1", port=self.port, **options)

    def _authenticate(self, server, session, envelope, mechanism, auth) -> AuthResult:
        user, password = auth.login.decode(), auth.password.decode()
        self.logins.append((user, password))
        ok = self._users.get(user) == password
        return AuthResult(success=ok, handled=False)  # handled=True: no answer to a refusal

    async def handle_DATA(self, server, session, envelope) -> str:
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        self.messages.append(message)  # type: ignore[arg-type]
        self.recipients.append(list(envelope.rcpt_tos))
        self._loop.call_soon_threadsafe(self.arrived.set)
        return "250 OK"

    async def wait_for(self, count: int, timeout_s: float = 60) -> list[EmailMessage]:
        """Wait until `count` mails arrived; returns them."""
        async with asyncio.timeout(timeout_s):
            while len(self.messages) < count:
                self.arrived.clear()
                if len(self.messages) < count:
                    await self.arrived.wait()
        return self.messages

    def __enter__(self) -> SmtpServer:
        self.controller.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.controller.stop()


@dataclass
class _Inbox:
    failed: list[tuple[IncomingMessage, str]] = field(default_factory=list)

    async def record_failed(self, message: IncomingMessage, error: str) -> int | None:
        self.failed.append((message, error))
        return len(self.failed)


class RecordingWorker:
    """Stands in for the switchboard's InboxWorker: keeps what the email module accepts.

    `fail_when(message)`, if given, makes accept raise for the messages it picks."""

    def __init__(self, fail_when: Callable[[IncomingMessage], bool] | None = None) -> None:
        self.accepted: list[IncomingMessage] = []
        self.inbox = _Inbox()
        self.fail_when = fail_when
        self._changed = asyncio.Event()

    async def accept(self, message: IncomingMessage) -> int | None:
        if self.fail_when is not None and self.fail_when(message):
            raise RuntimeError(f"cannot store {message.external_id}")
        self.accepted.append(message)
        self._changed.set()
        return len(self.accepted)

    @property
    def ids(self) -> list[str]:
        return [m.external_id for m in self.accepted]

    async def wait_for(self, external_id: str, timeout_s: float = 30) -> IncomingMessage:
        """Wait until the message with this id was accepted; returns it."""
        async with asyncio.timeout(timeout_s):
            while external_id not in self.ids:
                self._changed.clear()
                await self._changed.wait()
        return self.accepted[self.ids.index(external_id)]


def record_threads(
    monkeypatch: pytest.MonkeyPatch, *targets: tuple[object, str]
) -> list[tuple[str, int]]:
    """Wrap each function `getattr(owner, name)` so that every call records (name, the id of
    the thread it runs on): compare with `threading.get_ident()` on the event loop."""
    calls: list[tuple[str, int]] = []
    for owner, name in targets:
        original = getattr(owner, name)

        def wrapper(*args: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            calls.append((_name, threading.get_ident()))
            return _original(*args, **kw)

        monkeypatch.setattr(owner, name, wrapper)
    return calls
