"""Email: intake from an IMAP mailbox (IDLE, polling) or a webhook into the switchboard's
inbox, and `send_email` over SMTP (connections, TLS and login: `mail_transport`).

A mail is fetched with BODY.PEEK[] (which leaves it unread) and flagged \\Seen only once it is
safely in the inbox. Bounces, auto-replies and our own mail are never answered: no mail loops.

Safe to expose: a mail is accepted only from exactly one well-formed From address (what
`email.utils.parseaddr` misreads is refused), optionally only with a DMARC pass from our own
MTA (`require_authentication_results`); no single mail can block the mailbox (one that cannot
be stored is tried MAX_MAIL_FAILURES times, then recorded as failed and flagged \\Seen); and
nothing a sender writes reaches a header we write with a line break in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import hashlib
import hmac
import logging
import re
import ssl
import time
from email.message import EmailMessage
from typing import TYPE_CHECKING, Any

from fastmcp import FastMCP
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from butlers.config import EmailConfig
from butlers.context import ModuleStatus
from butlers.errors import ToolRefusal
from butlers.modules.mail_parse import (
    MAX_TEXT_CHARS,
    ParsedMail,
    automated_reason,
    dmarc_refusal,
    html_to_text,
    one_line,
    parse_mail,
    reply_subject,
    sender_allowed,
    single_address,
    trim_quoted,
)
from butlers.modules.mail_transport import (
    MailError,
    MailRefused,
    MailServer,
    describe,
    imap_close,
    imap_connect,
    security,
    smtp_send,
    tls_context,
)
from butlers.switchboard.inbox import InboxMessage, IncomingMessage
from butlers.tasks import cancel_and_wait

if TYPE_CHECKING:
    import aioimaplib

    from butlers.switchboard.worker import InboxWorker

logger = logging.getLogger(__name__)

IDLE_RENEW_S = 25 * 60  # servers may drop an IDLE after 29 minutes (RFC 2177)
BACKOFF_S = (1, 2, 5, 10, 30, 60)
HEALTHY_SESSION_S = 60  # a session that lasted this long was a working one
WEBHOOK_PATH = "/email/inbound"
MAX_MAIL_FAILURES = 3  # a mail that cannot be stored this often is recorded as failed, skipped
RETRY_FAILED_S = 5.0  # how soon a mail that could not be stored is tried again (at most)
# A Message-ID is our idempotency key, in a unique index: PostgreSQL's btree refuses entries
# past ~2.7 kB, so a longer one (a broken or hostile mailer) is replaced by a digest.
MAX_MESSAGE_ID_BYTES = 512


# -- the module ---------------------------------------------------------------------------------


class EmailModule:
    name = "email"

    def __init__(
        self, config: EmailConfig, username: str, password: str, worker: InboxWorker | None
    ) -> None:
        self.config = config
        self.username = username
        self.password = password
        self.worker = worker
        self.address = (config.address or username).lower()
        self.status = ModuleStatus(self.name, "starting")
        self._task: asyncio.Task[None] | None = None
        self._imap = MailServer(
            "IMAP",
            config.imap_host,
            config.imap_port,
            security(config.imap_ssl, config.imap_starttls),
        )
        self._smtp = MailServer(
            "SMTP",
            config.smtp_host,
            config.smtp_port,
            security(config.smtp_ssl, config.smtp_starttls),
        )
        # Failed attempts to store a mail, per "<UIDVALIDITY>:<UID>" (see _settle).
        self._failures: dict[str, int] = {}
        self._lost = asyncio.Event()  # the current IMAP connection dropped

    @functools.cached_property
    def tls_context(self) -> ssl.SSLContext:
        """One context for every IMAP and SMTP connection (loading a trust store is not free)."""
        return tls_context()

    def register(self, mcp: FastMCP, webhook_token: str | None) -> None:
        module = self

        @mcp.tool
        async def send_email(
            to: str, subject: str, body: str, in_reply_to: str | None = None
        ) -> dict[str, Any]:
            """Send a plain-text email from the butler's address."""
            try:
                single_address([to])
            except ValueError as exc:
                raise ToolRefusal(f"'to' must be one email address: {exc}") from None
            try:
                message_id = await module.send(to, subject, body, in_reply_to=in_reply_to)
            except MailError as exc:
                raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
            return {"to": to, "message_id": message_id}

        if self.config.mode == "webhook" and self.worker is not None:
            # Compared as bytes: hmac.compare_digest raises TypeError on a non-ASCII str (a
            # 500); starlette hands us header bytes decoded as latin-1, so this is lossless.
            expected = f"Bearer {webhook_token}".encode() if webhook_token else None

            @mcp.custom_route(WEBHOOK_PATH, methods=["POST"])
            async def email_inbound(request: Request) -> Response:
                supplied = request.headers.get("authorization", "").encode("latin-1")
                if expected is None or not hmac.compare_digest(supplied, expected):
                    return JSONResponse({"error": "missing or wrong bearer token"}, 401)
                try:
                    data = await request.json()
                    mail = _mail_from_json(data)
                except (ValueError, KeyError, TypeError) as exc:
                    logger.warning(
                        "email: webhook mail refused: %s", exc, extra={"action": "refused"}
                    )
                    return JSONResponse({"error": f"bad inbound mail: {exc}"}, 400)
                await module.accept(mail)
                return JSONResponse({"ok": True})  # only now: the message is in the inbox

    async def send(
        self,
        to: str,
        subject: str,
        body: str,
        *,
        in_reply_to: str | None = None,
        references: str | None = None,
    ) -> str:
        try:
            recipient, _ = single_address([to])
        except ValueError as exc:
            raise MailError(f"cannot send to {to!r}: {exc}") from None
        message = EmailMessage()
        message["From"] = self.config.address or self.username
        message["To"] = recipient
        message["Subject"] = one_line(subject)
        message["Date"] = email.utils.formatdate(localtime=False)
        message_id = email.utils.make_msgid(domain=self.address.split("@")[-1] or None)
        message["Message-ID"] = message_id
        message["Auto-Submitted"] = "auto-replied" if in_reply_to else "auto-generated"
        if in_reply_to and one_line(in_reply_to):
            message["In-Reply-To"] = one_line(in_reply_to)
            message["References"] = one_line(references or in_reply_to)
        message.set_content(body)
        try:
            await smtp_send(
                self._smtp, message, self.username, self.password, context=self.tls_context
            )
        except MailError as exc:
            raise type(exc)(f"{exc} (the mail to {recipient} was not sent)") from exc
        return message_id

    async def reply(self, message: InboxMessage, text: str) -> None:
        assert message.source_id is not None
        await self.send(
            message.source_id,
            reply_subject(message.subject),
            text,
            in_reply_to=message.meta.get("message_id") or None,
            references=message.meta.get("references") or None,
        )

    async def accept(self, mail: ParsedMail) -> bool:
        """True when the mail is settled (stored, or deliberately ignored): it may be marked
        seen. Mail we must not answer is ignored, never routed."""
        if mail.refused:
            logger.warning(
                "email: refusing message %r: %s",
                mail.message_id[:200],
                mail.refused,
                extra={"action": "refused"},
            )
            return True
        if mail.automated:
            logger.info("email: ignoring automated mail from %s (%s)", mail.sender, mail.automated)
            return True
        if mail.sender == self.address:
            logger.info("email: ignoring mail from our own address")
            return True
        if not sender_allowed(mail.sender, self.config.allowed_senders):
            logger.warning(
                "email: sender %s is not allowed", mail.sender, extra={"action": "refused"}
            )
            return True
        if authserv_id := self.config.require_authentication_results:
            domain = mail.sender.rsplit("@", 1)[-1]
            why = dmarc_refusal(mail.authentication_results, authserv_id, domain)
            if why is not None:
                logger.warning(
                    "email: refusing mail from %s: %s",
                    mail.sender,
                    why,
                    extra={"action": "refused"},
                )
                return True
        if self.worker is None:
            return False
        await self.worker.accept(_incoming(mail))
        return True

    # -- IMAP intake ------------------------------------------------------------------------

    async def start(self) -> None:
        if self.worker is not None and self.config.mode in ("idle", "poll"):
            self._task = asyncio.create_task(self._run(), name="email:intake")
        else:
            self.status = ModuleStatus(self.name, "running", f"{self.config.mode} mode")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A session that worked for a while: reconnect quickly. One that ends as soon
                # as it starts (the database refusing even to record a failed mail, say) backs
                # off, or it would reconnect every second for as long as that lasts.
                if time.monotonic() - started >= HEALTHY_SESSION_S:
                    failures = 0
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                why = (
                    str(exc)
                    if isinstance(exc, MailError)
                    else f"{self._imap.where}: {describe(exc)}"
                )
                # A refusal (untrusted certificate, no STARTTLS, login refused) needs someone
                # to act: "failed", though we keep trying in case they did.
                state = "failed" if isinstance(exc, MailRefused) else "starting"
                self.status = ModuleStatus(self.name, state, f"{why}; retrying in {delay}s")
                logger.warning("email: IMAP session ended (%s); reconnecting in %ss", why, delay)
                await asyncio.sleep(delay)

    async def _session(self) -> None:
        # Set when the connection drops: aioimaplib wakes neither an IDLE wait nor a pending
        # command by itself (a command would wait for its timeout).
        lost = self._lost = asyncio.Event()

        def on_lost(_exc: Exception | None) -> None:
            lost.set()

        client = await imap_connect(
            self._imap, self.username, self.password, context=self.tls_context, on_lost=on_lost
        )
        try:
            selected = await self._ok(client.select("INBOX"), "SELECT INBOX")
            uidvalidity = next(
                (
                    m.group(1).decode()
                    for line in selected.lines
                    if (m := _UIDVALIDITY.search(line))
                ),
                "",
            )
            use_idle = self.config.mode == "idle" and client.has_capability("IDLE")
            self.status = ModuleStatus(
                self.name,
                "running",
                f"{'IDLE' if use_idle else 'polling'} on {self._imap.host}:{self._imap.port}",
            )
            while True:
                retry = await self._fetch_unseen(client, uidvalidity)
                if retry:  # a mail could not be stored: try it again soon, not in 25 minutes
                    await self._wait(min(RETRY_FAILED_S, self.config.poll_interval_s))
                elif use_idle:
                    await self._idle(client)
                else:
                    await self._wait(self.config.poll_interval_s)
        finally:
            await imap_close(client)

    async def _until_lost(self, awaitable: Any) -> Any:
        """Await an IMAP step, or raise as soon as the connection is lost."""
        step = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            unfinished = not step.done()
            if unfinished:
                step.cancel()
        if unfinished:
            raise MailError(f"{self._imap.where}: the connection was lost")
        return step.result()

    async def _wait(self, seconds: float) -> None:
        await self._until_lost(asyncio.sleep(seconds))

    async def _idle(self, client: aioimaplib.IMAP4) -> None:
        """IDLE until the server pushes something, the connection drops, or it is time to renew."""
        idle = await self._until_lost(client.idle_start(timeout=IDLE_RENEW_S))
        with contextlib.suppress(TimeoutError):  # a timeout: renew the IDLE before it is dropped
            await self._until_lost(client.wait_server_push(timeout=IDLE_RENEW_S))
        client.idle_done()
        await self._until_lost(asyncio.wait_for(idle, 30))

    async def _fetch_unseen(self, client: aioimaplib.IMAP4, uidvalidity: str) -> bool:
        """Store and flag every unseen mail; True when one could not be stored (try again)."""
        response = await self._ok(client.uid_search("UNSEEN"), "UID SEARCH UNSEEN")
        uids = [uid.decode() for uid in response.lines[0].split()] if response.lines else []
        retry = False
        for uid in uids:
            fetched = await self._ok(client.uid("fetch", uid, "(BODY.PEEK[])"), f"FETCH {uid}")
            raw = next((bytes(line) for line in fetched.lines if isinstance(line, bytearray)), None)
            if raw is None:
                continue
            if await self._settle(f"{uidvalidity}:{uid}", raw):
                await self._ok(client.uid("store", uid, "+FLAGS (\\Seen)"), f"STORE {uid}")
            else:
                retry = True
        return retry

    async def _settle(self, key: str, raw: bytes) -> bool:
        """Parse and accept one mail; True when it may be flagged seen.

        A mail that cannot be stored is left unread and tried again; after MAX_MAIL_FAILURES
        attempts its envelope is recorded as a failed inbox row and it is let go, so one mail
        can never block the mailbox. If even that record fails (the database is down, not
        the mail at fault) it stays unread, and the next attempt tries to store it again.
        """
        try:
            mail = parse_mail(raw)
        except Exception:
            logger.exception("email: cannot parse message %s; marking it seen", key)
            return True
        try:
            settled = await self.accept(mail)
        except Exception as exc:
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            if failures < MAX_MAIL_FAILURES:
                logger.warning(
                    "email: message %r from %s could not be stored (attempt %d of %d): %s",
                    mail.message_id[:200],
                    mail.sender,
                    failures,
                    MAX_MAIL_FAILURES,
                    describe(exc),
                    extra={"action": "mail_retry"},
                )
                return False
            await self._give_up(mail, f"could not be stored {failures} times: {describe(exc)}")
            settled = True
        self._failures.pop(key, None)
        return settled

    async def _give_up(self, mail: ParsedMail, error: str) -> None:
        assert self.worker is not None
        try:
            await self.worker.inbox.record_failed(_incoming(mail), error)
        except Exception as exc:
            raise MailError(
                f"message {mail.message_id[:200]!r} {error}, and cannot be recorded as failed "
                f"either ({describe(exc)}); it stays unread"
            ) from exc
        logger.warning(
            "email: message %r from %s %s; recorded as failed and marked seen",
            mail.message_id[:200],
            mail.sender,
            error,
            extra={"action": "mail_failed"},
        )

    async def _ok(self, awaitable: Any, what: str) -> Any:
        response = await self._until_lost(awaitable)
        if response.result != "OK":
            raise MailError(f"{self._imap.where}: {what} failed: {response.lines[-1:]!r}")
        return response


_UIDVALIDITY = re.compile(rb"\[UIDVALIDITY (\d+)\]")


def _incoming(mail: ParsedMail) -> IncomingMessage:
    return IncomingMessage(
        channel="email",
        external_id=_external_id(mail),
        text=mail.text or "(empty message)",
        source_id=mail.sender,
        sender_name=mail.sender_name or None,
        subject=mail.subject or None,
        meta={
            "message_id": mail.message_id,
            "references": mail.references,
            "attachments": mail.attachments,
        },
    )


def _external_id(mail: ParsedMail) -> str:
    """The inbox's idempotency key: the Message-ID, or a digest where there is none (so that a
    re-fetch is still a duplicate) or it is too long for the index."""
    if mail.message_id and len(mail.message_id.encode()) <= MAX_MESSAGE_ID_BYTES:
        return mail.message_id
    parts = [mail.sender, mail.subject, mail.text]
    if mail.message_id:
        digest = hashlib.sha256("\0".join([mail.message_id, *parts]).encode()).hexdigest()
        return f"message-id-sha256:{digest[:32]}"
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return f"no-message-id:{digest[:32]}"


def _mail_from_json(data: dict[str, Any]) -> ParsedMail:
    """The webhook body: {from, subject, text | html, message_id, headers?}. The same sender
    rules as IMAP: one well-formed From address (ValueError otherwise: a 400)."""
    if not isinstance(data, dict):
        raise TypeError("expected a JSON object")
    if not isinstance(data["from"], str):
        raise TypeError("'from' must be a string")
    address, name = single_address([data["from"]])
    text = data.get("text")
    if not text and data.get("html"):
        text = html_to_text(str(data["html"]))
    given = data.get("headers") or {}
    if not isinstance(given, dict):
        raise TypeError("'headers' must be an object")
    headers = {str(k).lower(): v for k, v in given.items()}
    fake = EmailMessage()
    for key, value in headers.items():
        if key != "authentication-results":
            fake[key] = str(value)
    results = headers.get("authentication-results") or []
    message_id = str(data.get("message_id") or headers.get("message-id") or "")
    if not message_id:
        raise ValueError("'message_id' is required (it makes redelivery harmless)")
    return ParsedMail(
        message_id=message_id,
        sender=address,
        sender_name=name,
        subject=str(data.get("subject") or ""),
        text=trim_quoted(str(text or ""))[:MAX_TEXT_CHARS],
        references=message_id,
        automated=automated_reason(fake, address),
        authentication_results=tuple(
            str(v) for v in (results if isinstance(results, list) else [results])
        ),
    )
