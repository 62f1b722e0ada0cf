"""Real mail servers on 127.0.0.1 for the email tests, with a private CA.

- `MailCA`: a CA of our own (trustme) and a certificate for 127.0.0.1 / localhost, as files
  (pymap reads them) and as a server SSLContext (aiosmtpd, TcpFront).
- `pymap_server()`: the pymap IMAP server in a process of its own (forked off one that has
  pymap imported, one per test process: see _PYMAP_FORKER); with a certificate it offers
  STARTTLS (pymap serves no implicit TLS: put a `TcpFront(ssl=...)` in front for that). It
  keeps keywords like Dovecot, Gmail or Fastmail do (PERMANENTFLAGS with `\\*`); pymap's
  in-memory backend alone keeps them for the session only (`keywords=False`). With a
  `transcript` file it logs every line of every connection there (`PymapTranscript` reads
  it): what the server got, decrypted, STARTTLS sessions included.
- `SmtpServer`: aiosmtpd on a free port (its Controller cannot take port 0), recording the
  mails it takes and the credentials it was given; it answers RCPT TO of the addresses in its
  `refuse` with the reply given there (a 550, a 451), as a real server refuses a recipient.
- `RecordingWorker`: what the email module hands mail to, for tests of the connection rather
  than of the inbox: it keeps what it is given.
- `record_threads()`: which thread each call of some functions ran on (the event loop's, or a
  worker thread).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import email
import email.policy
import json
import logging
import os
import re
import signal
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

from butlers.config import SwitchboardConfig
from butlers.switchboard.inbox import IncomingMessage
from tests.conftest import free_port


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


# One process per test process that has imported pymap (0.13 s) and forks a server off itself
# for each pymap_server(): 0.01 s of CPU, not 0.16 s for a fresh interpreter; every test still
# gets a server (and a mailbox) of its own. It reads one JSON line per server from stdin (a
# name, pymap's arguments, whether it keeps keywords, whether it hashes the password, a file
# for its stderr) and says
# "<name> started <pid>", "<name> ready" (listening) and "<name> exited <status>" on stdout.
# When its stdin closes (the test process ended, however), it stops its servers and exits.
#
# Its servers are pymap's `dict` backend. They keep keywords as permanent flags (`\*` in
# PERMANENTFLAGS), like Dovecot, Gmail or Fastmail, unless told not to. With `cleartext` they
# keep the demo password as given rather than hashed: pymap's default hash (PBKDF2, 500,000
# rounds) takes 0.12 s of CPU at every login (and once at the start), and a test logs in a
# dozen times; a wrong password is refused all the same.
_PYMAP_FORKER = r"""
import ctypes
import json
import os
import signal
import sys
import time
import traceback

import pymap.main
from pymap.backend import backends
from pymap.backend.dict.mailbox import MailboxData
from pymap.config import IMAPConfig
from pymap.parsing.specials.flag import Recent, Wildcard, get_system_flags
from pymap.service import services
from pysasl.hashing import Cleartext

dict(backends.items()), dict(services.items())  # their entry points, found once
servers = {}  # pid: name


def say(line):
    os.write(1, (line + "\n").encode())


def reap(signum, frame):
    while servers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        say(f"{servers.pop(pid)} exited {os.waitstatus_to_exitcode(status)}")


def serve(name, argv, keywords, cleartext, log):
    code = 1
    try:
        if sys.platform == "linux":  # killed with the forker, however it ends
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        null = os.open(os.devnull, os.O_RDWR)
        ready = os.dup(1)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if log else null, 2)
        if cleartext:
            IMAPConfig._get_hash_context = classmethod(lambda cls, passlib_cfg: Cleartext())
        if keywords:
            MailboxData.permanent_flags = property(
                lambda self: get_system_flags() - {Recent} | {Wildcard}
            )
        pymap.main.notify_ready = lambda: os.write(ready, f"{name} ready\n".encode())
        sys.argv = ["pymap", *argv]
        pymap.main.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


signal.signal(signal.SIGCHLD, reap)
for line in sys.stdin:
    name, argv, keywords, cleartext, log = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # until servers has it
    pid = os.fork()
    if pid == 0:
        serve(name, argv, keywords, cleartext, log)
    servers[pid] = name
    say(f"{name} started {pid}")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
for pid in list(servers):
    os.kill(pid, signal.SIGTERM)
deadline = time.monotonic() + 5
while servers and time.monotonic() < deadline:
    time.sleep(0.01)
for pid in list(servers):
    os.kill(pid, signal.SIGKILL)
"""


class _PymapForker:
    """The test process's end of _PYMAP_FORKER: a thread reads what it says and hands each
    server's lines to the event loop waiting for them."""

    _instance: _PymapForker | None = None

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _PYMAP_FORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # not the capture of whichever test started it
        )
        self._lock = threading.Lock()
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[str]]] = {}
        self._count = 0
        threading.Thread(target=self._read, name="pymap forker", daemon=True).start()
        atexit.register(self.close)

    @classmethod
    def get(cls) -> _PymapForker:
        if cls._instance is None or cls._instance.process.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            name, _, said = line.decode().strip().partition(" ")
            self._tell(name, said)
        with self._lock:
            names = list(self._listeners)
        for name in names:  # the forker is gone: so are its servers
            self._tell(name, "exited (the forker ended)")

    def _tell(self, name: str, said: str) -> None:
        with self._lock:
            listener = self._listeners.get(name)
        if listener is not None:
            loop, queue = listener
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(queue.put_nowait, said)

    def start(
        self, argv: list[str], keywords: bool, cleartext: bool, log: Path | None
    ) -> tuple[str, asyncio.Queue[str]]:
        """Fork a server; its name, and a queue of what the forker says about it."""
        queue: asyncio.Queue[str] = asyncio.Queue()
        with self._lock:
            self._count += 1
            name = f"pymap{self._count}"
            self._listeners[name] = (asyncio.get_running_loop(), queue)
            log_file = str(log) if log else None
            command = json.dumps([name, argv, keywords, cleartext, log_file]) + "\n"
            assert self.process.stdin is not None
            self.process.stdin.write(command.encode())
            self.process.stdin.flush()
        return name, queue

    def forget(self, name: str) -> None:
        with self._lock:
            self._listeners.pop(name, None)

    def close(self) -> None:
        """Its stdin closed, it stops its servers and exits."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # type: ignore[union-attr]
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@asynccontextmanager
async def pymap_server(
    user: str,
    password: str,
    *,
    ca: MailCA | None = None,
    keywords: bool = True,
    transcript: Path | None = None,
    fast_login: bool = False,
) -> AsyncIterator[int]:
    """pymap on a free port (yielded): STARTTLS offered when given a CA's certificate;
    keywords kept across sessions unless `keywords=False`; its sessions logged line by line
    into `transcript` when given (see PymapTranscript). A process of its own, forked off
    _PYMAP_FORKER.

    `fast_login`: the password is kept unhashed, so a login takes 1 ms of the server's CPU
    rather than 120 (pymap's PBKDF2); a wrong one is refused all the same. Every email test
    uses it; the default stays pymap's own. (The whole-switchboard tests of
    tests/test_email_mailbox.py once passed only with slow logins: the test's second mail,
    appended while the module was busy with the first, was announced by an EXISTS the module
    lost, and waited for the IDLE renewal. tests/test_email_arrivals.py covers that.)"""
    port = free_port()
    tls = (
        ["--cert", str(ca.cert_file), "--key", str(ca.key_file)] if ca is not None else ["--no-tls"]
    )
    argv = [
        *(["--debug"] if transcript is not None else []),
        *("--host", "127.0.0.1", "--port", str(port), *tls),
        *("dict", "--demo-user", user, "--demo-password", password),
    ]
    forker = _PymapForker.get()
    name, said = forker.start(argv, keywords, fast_login, transcript)
    pid: int | None = None
    exited: str | None = None
    try:
        async with asyncio.timeout(30):
            while (line := await said.get()) != "ready":
                if line.startswith("started "):
                    pid = int(line.split()[1])
                elif line.startswith("exited"):
                    exited = line
                    raise RuntimeError(f"pymap did not start: {line}")
        yield port
    finally:
        if pid is not None and exited is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    while not (await said.get()).startswith("exited"):
                        pass
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise
        forker.forget(name)


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


async def imap_append(
    port: int, user: str, password: str, raw: bytes | EmailMessage, *, date: Any = None
) -> None:
    """APPEND a mail to INBOX (pymap lets a plaintext client log in); `date`: its
    INTERNALDATE (a datetime: when the server took it), else now."""
    client = await _test_client(port, user, password)
    data = raw.as_bytes() if isinstance(raw, EmailMessage) else raw
    response = await client.append(data, mailbox="INBOX", date=date)
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
    "none"; auth: whether AUTH is offered at all (a local relay offers none). `refuse`:
    address -> the reply to its RCPT TO (e.g. "550 5.1.1 No such user"); the test may change
    it while the server runs. `refusals` lists (address, reply) of each refused RCPT TO."""

    def __init__(
        self,
        *,
        tls: str = "none",
        auth: bool = True,
        ca: MailCA | None = None,
        users: dict[str, str] | None = None,
        refuse: dict[str, str] | None = None,
    ) -> None:
        self.messages: list[EmailMessage] = []
        self.refuse: dict[str, str] = dict(refuse or {})
        self.refusals: list[tuple[str, str]] = []
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

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options) -> str:
        if (reply := self.refuse.get(address.lower())) is not None:
            self.refusals.append((address, reply))
            self._loop.call_soon_threadsafe(self.arrived.set)
            return reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

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
    holds_mail: bool = False  # holds_channel's answer: mail was stored before (an upgrade)

    async def holds_channel(self, channel: str) -> bool:
        return self.holds_mail

    async def record_failed(
        self, message: IncomingMessage, error: str, *, conn: Any = None
    ) -> int | None:
        self.failed.append((message, error))
        return len(self.failed)


class RecordingWorker:
    """Stands in for the switchboard's InboxWorker: keeps what the email module accepts.

    `fail_when(message)`, if given, makes accept raise for the messages it picks. `limits`:
    the switchboard's config the channels read theirs from (files a message)."""

    def __init__(
        self,
        fail_when: Callable[[IncomingMessage], bool] | None = None,
        limits: SwitchboardConfig | None = None,
    ) -> None:
        self.limits = limits or SwitchboardConfig()
        self.accepted: list[IncomingMessage] = []
        self.dropped: list[IncomingMessage] = []  # album parts refused once downloaded
        self.inbox = _Inbox()
        self.fail_when = fail_when
        self.over_limit = False  # files_welcome's answer: the sender is over the hourly limit
        self.told: list[tuple[IncomingMessage, str]] = []  # record_unread's replies
        self._changed = asyncio.Event()

    async def record_unread(
        self, message: IncomingMessage, error: str, reply: str | None = None
    ) -> int | None:
        """As the switchboard's: the failed row (`inbox.failed`), and what its sender is told
        (`told`)."""
        inbox_id = await self.inbox.record_failed(message, error)
        if reply is not None:
            self.told.append((message, reply))
        return inbox_id

    async def accept(self, message: IncomingMessage) -> int | None:
        if self.fail_when is not None and self.fail_when(message):
            raise RuntimeError(f"cannot store {message.external_id}")
        self.accepted.append(message)
        self._changed.set()
        return len(self.accepted)

    async def files_welcome(
        self,
        channel: str,
        source_id: str | None,
        album: str | None = None,
        *,
        verified: bool = False,
    ) -> bool:
        """As the switchboard's: False while the sender is over the hourly limit (`over`)."""
        return not self.over_limit

    async def album_part_dropped(self, message: IncomingMessage) -> None:
        self.dropped.append(message)
        self._changed.set()

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
