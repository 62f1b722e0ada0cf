"""Email over TLS against real servers with a private CA: IMAP with implicit TLS and STARTTLS
(pymap, behind a TcpFront that can drop connections), SMTP with implicit TLS, STARTTLS and a
relay without AUTH (aiosmtpd). The module under test trusts the CA only through
SSL_CERT_FILE, as an operator would; without it, the certificate is refused.

The email module runs on its own here, handing mail to a RecordingWorker: what is tested is
the connection, not the inbox (tests/test_email.py runs the whole switchboard).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

import butlers.modules.email as email_module
import butlers.modules.mail_imap as mail_imap
from butlers.backoff import Backoff
from butlers.config import EmailConfig
from butlers.context import ModuleStatus
from butlers.errors import MailRefused
from butlers.modules.email import EmailModule
from butlers.modules.mail_transport import MailServer, plaintext_login_refusal
from tests.fakes.mail import (
    MailCA,
    PymapTranscript,
    RecordingWorker,
    SmtpServer,
    imap_append,
    imap_unseen,
    pymap_server,
)
from tests.fakes.tls_front import TcpFront
from tests.test_email import mail

USER, PASSWORD = "butler", "imap-pw"
VARIANTS = ["none", "implicit", "starttls"]


@pytest.fixture
def ca(tmp_path: Path) -> MailCA:
    return MailCA(tmp_path / "ca")


@pytest.fixture
def trust(ca: MailCA, monkeypatch: pytest.MonkeyPatch) -> MailCA:
    """The module under test trusts our CA the way an operator would tell it to."""
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_file))
    return ca


@pytest.fixture
def distrust(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the system's trust store, which has never heard of our CA."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)


def email_config(
    *, imap_port: int = 1, imap: str = "none", smtp_port: int = 1, smtp: str = "none", **more
) -> EmailConfig:
    options = {
        "imap_host": "127.0.0.1",
        "imap_port": imap_port,
        "imap_ssl": imap == "implicit",
        "imap_starttls": imap == "starttls",
        "smtp_host": "127.0.0.1",
        "smtp_port": smtp_port,
        "smtp_ssl": smtp == "implicit",
        "smtp_starttls": smtp == "starttls",
        "address": "butler@example.com",
        "mode": "idle",
        "poll_interval_s": 0.2,
        "allowed_senders": ("user@example.com",),
    } | more
    return EmailConfig(**options)


@asynccontextmanager
async def running(
    config: EmailConfig, worker: RecordingWorker, password: str = PASSWORD
) -> AsyncIterator[EmailModule]:
    """The email module's IMAP intake, running until the block ends (the module as the
    leader of the switchboard processes, which is what reads the mailbox)."""
    module = EmailModule(config, USER, password, worker)  # type: ignore[arg-type]
    await module.open()
    await module.lead()
    try:
        yield module
    finally:
        await module.close()


async def wait_until_seen(port: int, password: str = PASSWORD) -> None:
    """Until every mail in pymap's INBOX is flagged \\Seen."""
    async with asyncio.timeout(30):
        while await imap_unseen(port, USER, password):  # noqa: ASYNC110 - polls a server
            await asyncio.sleep(0.02)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the module changes its status on its own
            await asyncio.sleep(0.02)


@asynccontextmanager
async def imap_stack(
    variant: str, ca: MailCA, password: str = PASSWORD, transcript: Path | None = None
) -> AsyncIterator[tuple[int, TcpFront]]:
    """pymap (port) and a front the module connects to: it terminates implicit TLS; for
    STARTTLS (pymap's own) and plaintext it only passes bytes through. pymap logs its
    sessions into `transcript` when given."""
    server_ca = ca if variant == "starttls" else None
    async with pymap_server(
        USER, password, ca=server_ca, transcript=transcript, fast_login=True
    ) as port:
        front = TcpFront(port, ssl=ca.server_context() if variant == "implicit" else None)
        await front.start()
        try:
            yield port, front
        finally:
            await front.stop()


# -- IMAP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
async def test_imap_reads_mail_and_notices_a_dropped_connection(
    variant: str, trust: MailCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = []
    real_tls_context = email_module.tls_context

    def counting_tls_context():
        built.append(real_tls_context())
        return built[-1]

    monkeypatch.setattr(email_module, "tls_context", counting_tls_context)
    # Reconnect after 0.05 s rather than 1 s: the test is of noticing the drop, not of waiting.
    monkeypatch.setattr(mail_imap, "RECONNECT", Backoff((0.05,)))
    worker = RecordingWorker()
    transcript = PymapTranscript(tmp_path / "pymap.log")
    async with imap_stack(variant, trust, transcript=transcript.path) as (port, front):
        config = email_config(imap_port=front.port, imap=variant)
        where = f"127.0.0.1:{front.port}"
        async with running(config, worker) as module:
            await imap_append(port, USER, PASSWORD, mail(message_id="<before@example.com>"))
            await worker.wait_for("<before@example.com>")
            await wait_until_seen(port)
            # In IDLE again (pymap says so: the front sees only ciphertext under STARTTLS).
            await wait_until(lambda: transcript.idling() == 1)
            assert module.status == ModuleStatus("email", "running", f"IDLE on {where}")
            connections = front.connections

            front.hold()  # the reconnection waits at the front until the mail is in
            front.drop()  # mid-IDLE: aioimaplib alone would wait for the next push forever
            await wait_until(lambda: front.held > 0)  # noticed: it is reconnecting
            await imap_append(port, USER, PASSWORD, mail(message_id="<after@example.com>"))
            front.release()
            # Generous, yet far below the minutes until the IDLE would have been renewed.
            await worker.wait_for("<after@example.com>", timeout_s=30)
            assert front.connections > connections
    assert worker.ids == ["<before@example.com>", "<after@example.com>"]
    if variant == "starttls":  # the login went out encrypted
        assert b"STARTTLS" in front.received and b"LOGIN" not in front.received
    assert len(built) == 1  # one verified context, reused by the reconnection


@pytest.mark.parametrize("variant", ["implicit", "starttls"])
async def test_imap_refuses_an_untrusted_certificate(
    variant: str, ca: MailCA, distrust: None
) -> None:
    worker = RecordingWorker()
    async with imap_stack(variant, ca) as (port, front):
        await imap_append(port, USER, PASSWORD, mail())
        async with running(email_config(imap_port=front.port, imap=variant), worker) as module:
            await wait_until(lambda: module.status.status == "failed")
            detail = module.status.detail
    assert f"IMAP 127.0.0.1:{front.port}" in detail
    assert "certificate is not trusted" in detail and "SSL_CERT_FILE" in detail
    assert b"LOGIN" not in front.received
    assert worker.accepted == []


async def test_imap_refuses_a_certificate_for_another_host(trust: MailCA) -> None:
    """Signed by the trusted CA, but for mail.example.org: not the host we connect to."""
    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        front = TcpFront(port, ssl=trust.server_context("mail.example.org"))
        await front.start()
        try:
            config = email_config(imap_port=front.port, imap="implicit")
            async with running(config, worker) as module:
                await wait_until(lambda: module.status.status == "failed")
                detail = module.status.detail
        finally:
            await front.stop()
    assert (
        f"IMAP 127.0.0.1:{front.port}: the server's TLS certificate is for another host" in detail
    )
    assert "not valid for '127.0.0.1'" in detail
    assert front.connections == 0 and worker.accepted == []


async def test_imap_refuses_to_log_in_when_starttls_is_not_offered(trust: MailCA) -> None:
    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:  # plaintext only: no STARTTLS
        front = TcpFront(port)
        await front.start()
        try:
            config = email_config(imap_port=front.port, imap="starttls")
            async with running(config, worker) as module:
                await wait_until(lambda: module.status.status == "failed")
                detail = module.status.detail
        finally:
            await front.stop()
    assert f"IMAP 127.0.0.1:{front.port} does not offer STARTTLS" in detail
    assert front.received and b"LOGIN" not in front.received
    assert worker.accepted == []


# -- SMTP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["implicit", "starttls"])
async def test_smtp_sends_over_tls_with_the_credentials(variant: str, trust: MailCA) -> None:
    with SmtpServer(tls=variant, ca=trust, users={USER: PASSWORD}) as smtp:
        module = EmailModule(email_config(smtp_port=smtp.port, smtp=variant), USER, PASSWORD, None)
        await module.send("user@example.com", "Hello", "Over TLS.")
        async with asyncio.timeout(10):
            await smtp.arrived.wait()
    [message] = smtp.messages
    assert (message["To"], message["Subject"]) == ("user@example.com", "Hello")
    assert smtp.logins == [(USER, PASSWORD)]


async def test_smtp_relay_without_auth_is_used_without_logging_in() -> None:
    with SmtpServer(auth=False) as relay:  # a local relay on port 25 offers no AUTH
        module = EmailModule(email_config(smtp_port=relay.port), USER, PASSWORD, None)
        await module.send("user@example.com", "Hello", "Relayed.")
        async with asyncio.timeout(10):
            await relay.arrived.wait()
    assert [m["Subject"] for m in relay.messages] == ["Hello"]


async def test_smtp_refuses_plaintext_when_starttls_is_not_offered() -> None:
    with SmtpServer(auth=True, users={USER: PASSWORD}) as smtp:  # AUTH, but no STARTTLS
        module = EmailModule(
            email_config(smtp_port=smtp.port, smtp="starttls"), USER, PASSWORD, None
        )
        with pytest.raises(
            MailRefused, match=f"SMTP 127.0.0.1:{smtp.port} does not offer STARTTLS"
        ):
            await module.send("user@example.com", "Hello", "Not in plaintext.")
    assert smtp.logins == [] and smtp.messages == []


@pytest.mark.parametrize("variant", ["implicit", "starttls"])
async def test_smtp_refuses_an_untrusted_certificate(
    variant: str, ca: MailCA, distrust: None
) -> None:
    with SmtpServer(tls=variant, ca=ca, users={USER: PASSWORD}) as smtp:
        module = EmailModule(email_config(smtp_port=smtp.port, smtp=variant), USER, PASSWORD, None)
        with pytest.raises(MailRefused, match="certificate is not trusted") as refused:
            await module.send("user@example.com", "Hello", "Not to an impostor.")
    assert f"SMTP 127.0.0.1:{smtp.port}" in str(refused.value)
    assert smtp.logins == [] and smtp.messages == []


# -- no password in plaintext beyond this machine ----------------------------------------------

NOWHERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): beyond loopback, routed nowhere


@pytest.fixture
async def beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Connections opened to NOWHERE reach 127.0.0.1 (same port) instead: a test server stands
    in for a mail server elsewhere on the network. Yields the hosts connections were asked for."""
    loop = asyncio.get_running_loop()
    connect = loop.create_connection
    asked: list[str] = []

    async def create_connection(factory, host=None, port=None, **options):  # type: ignore[no-untyped-def]
        asked.append(host)
        return await connect(factory, "127.0.0.1" if host == NOWHERE else host, port, **options)

    monkeypatch.setattr(loop, "create_connection", create_connection)
    return asked


@pytest.mark.parametrize(
    ("protocol", "host", "security", "refused"),
    [
        ("IMAP", "127.0.0.1", "none", False),
        ("IMAP", "127.8.9.10", "none", False),
        ("IMAP", "::1", "none", False),
        ("SMTP", "[::1]", "none", False),
        ("SMTP", "localhost", "none", False),
        ("SMTP", "LocalHost", "none", False),
        ("IMAP", NOWHERE, "none", True),
        ("IMAP", "mail.example.com", "none", True),
        ("SMTP", "10.0.0.25", "none", True),
        ("SMTP", "localhost.example.com", "none", True),
        ("IMAP", "mail.example.com", "starttls", False),
        ("SMTP", "mail.example.com", "implicit", False),
    ],
)
def test_plaintext_logins_go_to_loopback_only(protocol, host, security, refused) -> None:
    why = plaintext_login_refusal(MailServer(protocol, host, 25, security))
    assert (why is not None) == refused
    if why is not None:
        keys = protocol.lower()
        assert f"{protocol} {host}:25: refusing to log in without TLS" in why
        assert f"{keys}_ssl = true" in why and f"{keys}_starttls = true" in why


async def test_imap_refuses_a_plaintext_login_beyond_loopback(beyond_loopback) -> None:
    """Refused before connecting: LOGIN is the first thing an IMAP connection does."""
    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, mail())
        front = TcpFront(port)
        await front.start()
        try:
            config = email_config(imap_host=NOWHERE, imap_port=front.port)
            async with running(config, worker) as module:
                await wait_until(lambda: module.status.status == "failed", timeout_s=10)
                detail = module.status.detail
        finally:
            await front.stop()
    assert f"IMAP {NOWHERE}:{front.port}: refusing to log in without TLS" in detail
    assert "imap_ssl = true" in detail and "imap_starttls = true" in detail
    assert NOWHERE not in beyond_loopback and front.connections == 0
    assert worker.accepted == []


async def test_smtp_refuses_a_plaintext_login_beyond_loopback(beyond_loopback) -> None:
    """Refused once the server offers AUTH, before logging in: nothing is sent."""
    with SmtpServer(users={USER: PASSWORD}) as smtp:  # AUTH offered, no TLS
        config = email_config(smtp_host=NOWHERE, smtp_port=smtp.port)
        module = EmailModule(config, USER, PASSWORD, None)
        with pytest.raises(MailRefused) as refused:
            await module.send("user@example.com", "Hello", "Not in plaintext.")
    assert f"SMTP {NOWHERE}:{smtp.port}: refusing to log in without TLS" in str(refused.value)
    assert "smtp_ssl = true" in str(refused.value) and "smtp_starttls" in str(refused.value)
    assert beyond_loopback == [NOWHERE] and smtp.logins == [] and smtp.messages == []


async def test_a_relay_beyond_loopback_without_auth_is_used_in_plaintext(beyond_loopback) -> None:
    """No AUTH offered (a relay on the local network): there is no password to protect."""
    with SmtpServer(auth=False) as relay:
        module = EmailModule(
            email_config(smtp_host=NOWHERE, smtp_port=relay.port), USER, "pw", None
        )
        await module.send("user@example.com", "Hello", "Relayed.")
        await relay.wait_for(1)
    assert beyond_loopback == [NOWHERE]


@pytest.mark.proc  # pymap
async def test_the_imap_connection_keeps_tcp_keepalive_on() -> None:
    """A NAT or firewall that forgot an idle connection left it open and silent until the
    IDLE was renewed, mail waiting meanwhile (a walkthrough): the kernel's keepalive probes
    now end such a connection within about two minutes."""
    import socket
    import ssl

    from butlers.modules import mail_transport
    from butlers.modules.mail_transport import imap_close, imap_connect

    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        server = MailServer("IMAP", "127.0.0.1", port, "none")
        client = await imap_connect(
            server, USER, PASSWORD, context=ssl.create_default_context(), on_lost=lambda _: None
        )
        try:
            sock = client.protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            assert idle == mail_transport.KEEPALIVE_IDLE_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        finally:
            await imap_close(client)
