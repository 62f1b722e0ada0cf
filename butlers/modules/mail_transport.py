"""IMAP and SMTP connections for the email module: verified TLS, and no secret in any log.

Why this is a module of its own: the client libraries leave gaps a mailbox exposed to the
internet cannot have, and they are closed here, where the third-party errors enter and become
`MailError`:

- aioimaplib 2.0 has no STARTTLS method, and its `IMAP4_SSL` takes no connection-lost
  callback (passing one is a TypeError). Every variant here is `aioimaplib.IMAP4`, with an
  `ssl_context` for implicit TLS, so that a dropped connection is noticed on every variant.
- aioimaplib logs each line it sends at DEBUG and scrubs the password only in its raw form,
  not as it is sent (quoted: `"` and `\\` escaped): we send LOGIN ourselves, scrubbing the
  exact bytes that go out.
- aioimaplib files an untagged response under the command it names, and drops the ones no
  pending command claims: the `* <n> EXISTS` that announces a new mail in the answer to a
  FETCH, STORE or SEARCH is lost. `watch_arrivals` reads every line as it comes in.
- aiosmtplib logs in whenever it is handed credentials; we read the server's EHLO first, so a
  relay that offers no AUTH (a local port 25) is used without logging in.

TLS: one context per module (`tls_context()`): the system's trust store, or the CA file named
by SSL_CERT_FILE (OpenSSL's default verify paths), with the host name checked. A configured
STARTTLS that the server does not offer is refused: we never log in over plaintext instead.
Without TLS configured, the password goes only to a loopback host (a local relay, a bridge
such as Proton Mail Bridge): `plaintext_login_refusal`.
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from email.message import EmailMessage
from typing import TYPE_CHECKING, Any, Literal

from butlers.errors import MailError, MailRefused
from butlers.http import is_loopback
from butlers.media import Attachment
from butlers.tasks import within

if TYPE_CHECKING:
    import aioimaplib
    import aiosmtplib

Security = Literal["implicit", "starttls", "none"]
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MailServer:
    """Where a mail server is and how to talk to it safely."""

    protocol: Literal["IMAP", "SMTP"]
    host: str
    port: int
    security: Security
    timeout_s: float = TIMEOUT_S

    @property
    def where(self) -> str:
        return f"{self.protocol} {self.host}:{self.port}"


def security(implicit: bool, starttls: bool) -> Security:
    return "implicit" if implicit else "starttls" if starttls else "none"


_TLS_KEYS = {
    "IMAP": "imap_ssl = true (implicit TLS, usually port 993) or imap_starttls = true (port 143)",
    "SMTP": "smtp_ssl = true (implicit TLS, usually port 465) or smtp_starttls = true (port 587)",
}


def plaintext_login_refusal(server: MailServer) -> str | None:
    """Why we must not log in to `server`, or None: without TLS the password (and the mail)
    would cross the network readable by anyone on the way, so only a loopback host
    (127.0.0.0/8, ::1, localhost) may be used without it."""
    if server.security != "none" or is_loopback(server.host.lower()):
        return None
    return (
        f"{server.where}: refusing to log in without TLS to a host beyond this machine (the "
        f"password would cross the network in plaintext); set {_TLS_KEYS[server.protocol]} "
        "under [modules.email]"
    )


# What a mail server says first: IMAP's "* OK" (or PREAUTH), SMTP's "220".
_GREETING = re.compile(rb"^(\* (OK|PREAUTH)|220)[ -]")
GREETING_WAIT_S = 1.5  # a server in plain text greets at once; one in TLS waits for us


async def tls_spoken(host: str, port: int, timeout_s: float = 5.0) -> Security | None:
    """How the mail server at host:port begins: "starttls" when it greets in plain text (its
    TLS, if any, comes after STARTTLS), "implicit" when it greets only inside TLS, None when
    it cannot be told (unreachable, or neither). For advice only (init's choice, doctor's
    hint): nothing is sent but a TLS handshake, nothing is verified or trusted."""
    import asyncio

    async def greeting(use_tls: bool) -> bytes:
        context = None
        if use_tls:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # only: is it TLS? (nothing is read or sent)
        reader, writer = await asyncio.open_connection(host, port, ssl=context)
        try:
            return await within(reader.read(64), GREETING_WAIT_S)
        except TimeoutError:
            return b""
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    try:
        async with asyncio.timeout(timeout_s):
            if _GREETING.match(await greeting(False)):
                return "starttls"
            if _GREETING.match(await greeting(True)):
                return "implicit"
    except (OSError, ssl.SSLError, TimeoutError):
        return None
    return None


def tls_keys(protocol: Literal["IMAP", "SMTP"], spoken: Security) -> str:
    """The butler.toml keys that say `spoken` for `protocol` (`imap_starttls = true`)."""
    prefix = protocol.lower()
    key = f"{prefix}_ssl" if spoken == "implicit" else f"{prefix}_starttls"
    other = f"{prefix}_starttls" if spoken == "implicit" else f"{prefix}_ssl"
    return f"{key} = true ({other} = false)"


def tls_context() -> ssl.SSLContext:
    """The one context a module verifies its servers with: system CAs, or SSL_CERT_FILE's
    (read now, by OpenSSL), certificate required, host name checked."""
    return ssl.create_default_context()


# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_EMAIL_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_NAME_MISMATCH = (62, 63, 64)


def describe(exc: BaseException) -> str:
    """An exception as one readable phrase; a refused certificate says so and how to fix it."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            if cause.verify_code in _NAME_MISMATCH:
                return f"the server's TLS certificate is for another host ({cause.verify_message})"
            return (
                f"the server's TLS certificate is not trusted ({cause.verify_message}); "
                "a private CA can be trusted with SSL_CERT_FILE"
            )
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _wrap(server: MailServer, exc: BaseException) -> MailError:
    if isinstance(exc, MailError):
        return exc
    refused = any(
        isinstance(e, ssl.SSLCertVerificationError) for e in (exc, exc.__cause__, exc.__context__)
    )
    return (MailRefused if refused else MailError)(f"{server.where}: {describe(exc)}")


# -- IMAP -----------------------------------------------------------------------------------


async def imap_connect(
    server: MailServer,
    username: str,
    password: str,
    *,
    context: ssl.SSLContext,
    on_lost: Callable[[Exception | None], None],
) -> aioimaplib.IMAP4:
    """A logged-in IMAP client. `on_lost` is called when the connection drops (aioimaplib does
    not wake an IDLE wait by itself), on plain, implicit TLS and STARTTLS connections alike:
    STARTTLS keeps the same protocol object, whose connection_lost calls it."""
    import aioimaplib

    if why := plaintext_login_refusal(server):  # before connecting: IMAP always logs in
        raise MailRefused(why)
    client = aioimaplib.IMAP4(
        host=server.host,
        port=server.port,
        timeout=server.timeout_s,
        conn_lost_cb=on_lost,
        ssl_context=context if server.security == "implicit" else None,
    )
    try:
        await client.wait_hello_from_server()
        keep_alive(client.protocol.transport)
        if server.security == "starttls":
            await _starttls(client, server, context)
        response = await _login(client, username, password)
        if response.result != "OK":
            raise MailRefused(f"{server.where} refused the login of {username!r}")
        # What a server offers may change once we are logged in (IDLE often appears only now).
        await within(client.protocol.capability(), server.timeout_s)
    except BaseException as exc:
        imap_abort(client)
        if isinstance(exc, Exception):
            raise _wrap(server, exc) from exc
        raise
    return client


# TCP keepalive on the IMAP connection: probes after a minute of silence, every 15 s, four
# unanswered ones end it. A NAT or firewall that forgot the connection left it open and
# silent until the IDLE was renewed, mail waiting meanwhile (a walkthrough).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 15, 4


def keep_alive(transport: Any) -> None:
    """Turn TCP keepalive on for `transport`'s socket (where the platform has the options)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


async def _starttls(client: aioimaplib.IMAP4, server: MailServer, context: ssl.SSLContext) -> None:
    """STARTTLS by hand (aioimaplib has the command but no method), RFC 3501 6.2.1."""
    from aioimaplib.aioimaplib import Command

    protocol = client.protocol
    if "STARTTLS" not in protocol.capabilities:
        raise MailRefused(
            f"{server.where} does not offer STARTTLS; refusing to log in over plaintext"
        )
    response = await within(
        protocol.execute(Command("STARTTLS", protocol.new_tag(), loop=protocol.loop)),
        server.timeout_s,
    )
    if response.result != "OK":
        raise MailRefused(f"{server.where} refused STARTTLS: {response.lines[-1:]!r}")
    if protocol.incomplete_line:  # plaintext after the OK would be read as if it were secured
        raise MailRefused(f"{server.where} sent plaintext after STARTTLS (injected?)")
    protocol.transport = await protocol.loop.start_tls(
        protocol.transport,
        protocol,
        context,
        server_hostname=server.host,
        ssl_handshake_timeout=server.timeout_s,
    )
    # RFC 3501: what the server said before TLS may have been forged; ask again.
    await within(protocol.capability(), server.timeout_s)


async def _login(client: aioimaplib.IMAP4, username: str, password: str) -> aioimaplib.Response:
    """LOGIN with the password scrubbed from aioimaplib's DEBUG log as it is sent: quoted and
    escaped (its own login() scrubs the raw password, which misses `"` and `\\`)."""
    from aioimaplib.aioimaplib import AUTH, Command, quoted

    protocol = client.protocol
    wire = quoted(password)
    try:
        command = Command("LOGIN", protocol.new_tag(), quoted(username), wire, loop=protocol.loop)
    except ValueError as exc:  # says which command, never the value
        raise MailRefused(f"the IMAP user name or password cannot be sent: {exc}") from None
    async with protocol.state_condition:
        response = await within(protocol.execute(command, scrub=wire), client.timeout)
        if response.result == "OK":
            protocol.state = AUTH
        protocol.state_condition.notify_all()
    return response


_SIZE_LINE = re.compile(rb"\* (\d+) (EXISTS|EXPUNGE)\Z", re.IGNORECASE)


class Arrivals:
    """How often the server announced new mail on one connection: an untagged `<n> EXISTS`
    larger than the mailbox it had announced before (EXISTS sets that size, each `<n> EXPUNGE`
    lowers it by one: RFC 3501 7.3.1, 7.4.1). An EXISTS that repeats the size is no arrival;
    the first one (SELECT's) counts as one."""

    def __init__(self) -> None:
        self.count = 0
        self._size: int | None = None

    def saw(self, line: bytes) -> None:
        found = _SIZE_LINE.match(line)
        if found is None:
            return
        number = int(found.group(1))
        if found.group(2).upper() == b"EXPUNGE":
            if self._size:
                self._size -= 1
            return
        if self._size is None or number > self._size:
            self.count += 1
        self._size = number


def watch_arrivals(client: aioimaplib.IMAP4) -> Arrivals:
    """Count the server's announcements of new mail on `client` from now on, whatever command
    they come with: aioimaplib hands those of an IDLE to `wait_server_push` but drops those
    that come with a FETCH, STORE or SEARCH ("ignored untagged response"). Every line the
    server sends passes through its protocol's `_handle_line` (a literal's bytes do not:
    a mail's text is never taken for a response)."""
    arrivals = Arrivals()
    protocol = client.protocol
    handle_line = protocol._handle_line

    def watching(line: bytes, current_cmd: Any) -> Any:
        arrivals.saw(line)
        return handle_line(line, current_cmd)

    protocol._handle_line = watching
    return arrivals


def imap_abort(client: aioimaplib.IMAP4) -> None:
    """Close the connection now, whatever state it is in, and end what still waits on it (an
    IDLE whose connection dropped would wait forever)."""
    transport = client.protocol.transport if client.protocol is not None else None
    if transport is not None:
        transport.close()
    for task in [*client.tasks, *client.protocol.tasks]:
        task.cancel()


async def imap_close(client: aioimaplib.IMAP4) -> None:
    """LOGOUT politely (bounded, and not on a connection already gone), then close."""
    transport = client.protocol.transport
    if transport is not None and not transport.is_closing():
        with contextlib.suppress(Exception):
            if client.has_pending_idle():  # else LOGOUT waits behind the IDLE until timeout
                client.idle_done()
            await within(client.logout(), 5)
    imap_abort(client)


# -- SMTP -----------------------------------------------------------------------------------


def attach(message: EmailMessage, attachments: Sequence[Attachment]) -> None:
    """Add the files to a mail whose text is set: multipart/mixed, each file base64 with its
    type and a Content-Disposition whose filename is encoded as RFC 2231 says when it is not
    ASCII (the email package does that, and refuses a line break in it)."""
    for attachment in attachments:
        maintype, _, subtype = attachment.mime_type.partition("/")
        message.add_attachment(
            attachment.data,
            maintype=maintype,
            subtype=subtype or "octet-stream",
            filename=attachment.name,
        )


async def smtp_send(
    server: MailServer,
    message: EmailMessage,
    username: str,
    password: str,
    *,
    context: ssl.SSLContext,
) -> None:
    """Send one message over a new `smtp_session`."""
    async with smtp_session(server, username, password, context=context) as smtp:
        await smtp.send_message(message)


@contextlib.asynccontextmanager
async def smtp_session(
    server: MailServer, username: str, password: str, *, context: ssl.SSLContext
) -> AsyncIterator[aiosmtplib.SMTP]:
    """A connection to `server`, EHLO read, TLS as configured, logged in only when the
    server offers AUTH (the credentials are the IMAP ones; a local relay has no use for
    them). What the block raises is wrapped as the session's own errors are (MailError);
    QUIT follows a block that ended well. (`butlers doctor --online` opens one to check the
    login without sending.)"""
    import aiosmtplib

    tls = server.security != "none"
    smtp = aiosmtplib.SMTP(
        hostname=server.host,
        port=server.port,
        use_tls=server.security == "implicit",
        start_tls=False,  # done below, after reading EHLO, or refused
        tls_context=context if tls else None,
        timeout=server.timeout_s,
    )
    try:
        await smtp.connect()
        await smtp.ehlo()
        if server.security == "starttls":
            if not smtp.supports_extension("starttls"):
                raise MailRefused(
                    f"{server.where} does not offer STARTTLS; refusing to send over plaintext"
                )
            await smtp.starttls()
            await smtp.ehlo()  # RFC 3207: forget what the server said before TLS
        if smtp.supports_extension("auth"):
            if why := plaintext_login_refusal(server):  # a relay without AUTH is used as is
                raise MailRefused(why)
            try:
                await smtp.login(username, password)
            except aiosmtplib.SMTPAuthenticationError as exc:
                raise MailRefused(
                    f"{server.where} refused the login of {username!r}: {exc.message}"
                ) from exc
        yield smtp
        with contextlib.suppress(aiosmtplib.SMTPException, OSError, TimeoutError):
            await smtp.quit()  # the mail is taken; a failed goodbye changes nothing
    except aiosmtplib.SMTPRecipientsRefused as exc:
        refused = "; ".join(f"{r.recipient}: {r.code} {r.message}" for r in exc.recipients)
        raise MailError(f"{server.where} refused the recipient ({refused})") from exc
    except aiosmtplib.SMTPResponseException as exc:  # the server's own reply, as it said it
        raise MailError(f"{server.where} answered {exc.code} {exc.message}") from exc
    except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
        raise _wrap(server, exc) from exc
    finally:
        smtp.close()
