"""Email: intake from an IMAP mailbox (IDLE, polling: `mail_imap`) or a webhook into the
switchboard's inbox, and `send_email` over SMTP (connections, TLS and login:
`mail_transport`).

A mail is flagged \\Seen only once it is safely in the inbox (or deliberately refused).
Bounces, auto-replies and our own mail are never answered: no mail loops.

Safe to expose: a mail is accepted only from exactly one well-formed From address (what
`email.utils.parseaddr` misreads is refused, and so is an RFC 2047 encoded-word inside the
address, which the stdlib decodes though the sender's DMARC check saw it undecoded), optionally
only with a DMARC pass from our own MTA (`require_authentication_results`: the real defence; an
allowlist of From addresses is only as good as it); reading one costs bounded memory and
time, off the event loop (limits in `mail_limits`); no single mail can block the mailbox or
crash-loop the process (`mail_imap`); and nothing a sender writes reaches a header we write
with a line break in it.

Attachments: images, PDFs, audio and text files (their type read from their bytes) are stored
with the mail, at most the switchboard's `max_attachments_per_message`, each at most
`max_attachment_bytes`; the worker transcribes audio (the mail is marked `voice`) and hands
the rest to the routed butler. A file refused by those limits does not cost the mail: the mail
is stored with its text and the readable files, and its text says which file was not read
and which limit refused it, so the butler's answer can tell the sender. Replies and
notifications carry a butler's files as attachments (`send`).
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import hashlib
import logging
import secrets
import ssl
from dataclasses import replace
from email.message import EmailMessage
from typing import TYPE_CHECKING, Any

from fastmcp import FastMCP
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from butlers.config import EmailConfig
from butlers.context import ModuleStatus
from butlers.errors import (
    DeliveryError,
    MailError,
    MailRefused,
    MailUnreadable,
    RecipientDeferred,
)
from butlers.http import secret_matches
from butlers.media import Attachment
from butlers.modules.mail_imap import ImapIntake
from butlers.modules.mail_parse import (
    MailThread,
    ParsedMail,
    not_read_note,
    one_line,
    reply_subject,
    within_limits,
)
from butlers.modules.mail_quotes import forwarded_part
from butlers.modules.mail_sender import dmarc_refusal, sender_allowed, single_address
from butlers.modules.mail_transport import (
    MailServer,
    attach,
    describe,
    security,
    smtp_send,
    tls_context,
)
from butlers.modules.mail_webhook import parse_webhook
from butlers.switchboard.inbox import InboxMessage, IncomingMessage
from butlers.switchboard.outbox import Delivery
from butlers.tasks import cancel_and_wait
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from butlers.channels.base import ChannelState
    from butlers.switchboard.approvals import ApprovalDesk
    from butlers.switchboard.pairing import PairingDesk
    from butlers.switchboard.worker import InboxWorker

logger = logging.getLogger(__name__)

WEBHOOK_PATH = "/email/inbound"
WEBHOOK_TOKEN_ENV = "BUTLERS_EMAIL_WEBHOOK_TOKEN"  # the bearer token of POST /email/inbound
MAX_CONVERSATION_ID_CHARS = 256  # a thread root longer than this is keyed by its digest
# A Message-ID is our idempotency key, in a unique index: PostgreSQL's btree refuses entries
# past ~2.7 kB, so a longer one (a broken or hostile mailer) is replaced by a digest.
MAX_MESSAGE_ID_BYTES = 512
# The subject of a pairing code's mail: fixed, never the stranger's own Subject (a forged From
# would otherwise have us relay their words to a third party). "Re:" as it answers in the
# thread (reply_subject keeps it as it is).
PAIRING_SUBJECT = "Re: your message to a private butler: approval needed"
SENDER_NAME = "Butlers"  # the display name of our mail's From


class EmailModule:
    name = "email"

    def __init__(
        self,
        config: EmailConfig,
        username: str,
        password: str,
        worker: InboxWorker | None,
        *,
        webhook_token: str | None = None,
        state: ChannelState | None = None,
    ) -> None:
        self.config = config
        # What the IMAP intake keeps across starts (the first mail it reads; None: nothing).
        self.state = state
        self.username = username
        self.password = password
        self.worker = worker
        # Where the owner's answers to approval mails go (the switchboard's; None: none).
        self.approvals: ApprovalDesk | None = None
        # Strangers' codes and the paired senders (the switchboard's; None: only
        # allowed_senders).
        self.pairing: PairingDesk | None = None
        self.webhook_token = webhook_token
        self.address = (config.address or username).lower()
        self.status = ModuleStatus(self.name, "starting")
        self.imap_server = MailServer(
            "IMAP",
            config.imap_host,
            config.imap_port,
            security(config.imap_ssl, config.imap_starttls),
        )
        self.smtp_server = MailServer(
            "SMTP",
            config.smtp_host,
            config.smtp_port,
            security(config.smtp_ssl, config.smtp_starttls),
        )
        self._task: asyncio.Task[None] | None = None

    @functools.cached_property
    def tls_context(self) -> ssl.SSLContext:
        """One context for every IMAP and SMTP connection (loading a trust store is not free)."""
        return tls_context()

    def register(self, mcp: FastMCP) -> None:
        module = self

        @mcp.tool
        async def send_email(
            to: str, subject: str, body: str, in_reply_to: str | None = None
        ) -> dict[str, Any]:
            """Send a plain-text email from the butler's address."""
            try:
                single_address([to], "To")
            except ValueError as exc:
                raise ToolRefusal(f"'to' must be one email address: {exc}") from None
            try:
                message_id = await module.send(to, subject, body, in_reply_to=in_reply_to)
            except MailError as exc:
                raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
            return {"to": to, "message_id": message_id}

    # -- the webhook ----------------------------------------------------------------------------

    def webhook_routes(self) -> list[BaseRoute]:
        """POST /email/inbound in webhook mode. A webhook arrives through a reverse proxy that
        keeps the public Host, so it is served without the MCP endpoints' Host/Origin guard
        (butlers.http) and proves itself with BUTLERS_EMAIL_WEBHOOK_TOKEN instead."""
        if self.config.mode != "webhook" or self.worker is None:
            return []
        return [Route(WEBHOOK_PATH, self._webhook, methods=["POST"])]

    async def _webhook(self, request: Request) -> Response:
        expected = f"Bearer {self.webhook_token}" if self.webhook_token else None
        if not secret_matches(request.headers.get("authorization"), expected):
            return JSONResponse({"error": "missing or wrong bearer token"}, 401)
        body = await request.body()  # at most max_request_bytes: the HTTP layer says 413
        try:
            mail = await asyncio.to_thread(parse_webhook, body)
        except MailUnreadable as exc:
            logger.warning("email: webhook mail refused: %s", exc, extra={"action": "refused"})
            return JSONResponse({"error": f"bad inbound mail: {exc}"}, 400)
        try:
            await self.accept(mail)
        except Exception as exc:  # the database refused or is down: the provider must retry
            logger.error(
                "email: webhook mail %r from %s could not be stored (%s); answered 503 so that "
                "the provider sends it again",
                mail.message_id[:200],
                mail.sender,
                describe(exc),
                extra={"action": "mail_retry"},
            )
            return JSONResponse({"error": "the mail could not be stored; send it again later"}, 503)
        return JSONResponse({"ok": True})  # only now: the message is in the inbox

    # -- what comes in --------------------------------------------------------------------------

    async def may_write(self, sender: str) -> bool:
        sender = sender.lower()
        return sender_allowed(sender, self.config.allowed_senders) or (
            self.pairing is not None and await self.pairing.is_paired(self.name, sender)
        )

    async def wanted(self, mail: ParsedMail) -> bool:
        """Whether to store this mail: from an allowed sender that we can believe, and one we
        may answer. Why not is logged. Decided from the header alone (IMAP: the envelope)."""
        if mail.refused:
            logger.warning(
                "email: refusing message %r: %s",
                mail.message_id[:200],
                mail.refused,
                extra={"action": "refused"},
            )
            return False
        if mail.automated:
            logger.info("email: ignoring automated mail from %s (%s)", mail.sender, mail.automated)
            return False
        if mail.sender == self.address:
            logger.info("email: ignoring mail from our own address")
            return False
        if not sender_allowed(mail.sender, self.config.allowed_senders) and not (
            self.pairing is not None and await self.pairing.is_paired(self.name, mail.sender)
        ):
            if self.pairing is not None and self.pairing.enabled:
                await self._stranger(mail)
            else:
                logger.warning(
                    "email: sender %s is not allowed", mail.sender, extra={"action": "refused"}
                )
            return False
        return await self._authenticated(mail)

    async def _authenticated(self, mail: ParsedMail) -> bool:
        """Whether our own MTA vouches for the From domain, if `require_authentication_results`
        asks for that (else True)."""
        if authserv_id := self.config.require_authentication_results:
            domain = mail.sender.rsplit("@", 1)[-1]
            # In a worker thread: a sender may write 256 KiB of Authentication-Results.
            why = await asyncio.to_thread(
                dmarc_refusal, mail.authentication_results, authserv_id, domain
            )
            if why is not None:
                logger.warning(
                    "email: refusing mail from %s: %s",
                    mail.sender,
                    why,
                    extra={"action": "refused"},
                )
                return False
        return True

    async def _stranger(self, mail: ParsedMail) -> None:
        """Mail from a sender nobody allowed, with pairing on: a code once
        (butlers.switchboard.pairing); the mail itself is not stored. Answering a forged From
        is backscatter: with `require_authentication_results` only a sender our MTA vouches
        for is answered; without it, an address at most once an hour and within the cap, and
        what the code's mail says is ours alone (PAIRING_SUBJECT, not their Subject)."""
        from butlers.switchboard.pairing import Stranger

        assert self.pairing is not None
        if not await self._authenticated(mail):
            return
        answering = InboxMessage(
            id=0,
            channel=self.name,
            external_id=mail.message_id,
            source_id=mail.sender,
            sender_name=None,
            subject=PAIRING_SUBJECT,
            text="",
            meta={"message_id": mail.message_id, "references": mail.references},
            attempts=0,
            trace_context=None,
        )
        await self.pairing.stranger(
            Stranger(self.name, mail.sender, mail.sender_name, reply_to=answering)
        )

    async def accept(self, mail: ParsedMail) -> bool:
        """Store the mail if it is wanted. True when it is settled (stored, or deliberately
        ignored); False when there is no inbox here to store it in."""
        if not await self.wanted(mail):
            return True
        if self.worker is None:
            return False
        await self.store(mail)
        return True

    async def store(self, mail: ParsedMail) -> None:
        assert self.worker is not None
        thread = mail.references.split()
        earlier = thread[:-1] if thread and thread[-1] == mail.message_id else thread
        parent = earlier[-1] if earlier else None  # the mail it answers (In-Reply-To's)
        answering = MailThread(mail.subject or "", mail.message_id, mail.references)
        if self.pairing is not None and await self.pairing.mail_answer(
            mail.sender, parent, mail.text or "", answering=answering
        ):
            return  # the owner's "approve" in a pairing question's thread: decided
        if self.approvals is not None and await self.approvals.mail_answer(
            mail.sender, thread, mail.text or "", parent=parent, answering=answering
        ):
            return  # the owner's "yes 12" in an approval's thread: decided, not routed
        verified = bool(self.config.require_authentication_results)  # (`wanted` checked it)
        if mail.files and not await self.worker.files_welcome(
            "email", mail.sender or None, verified=verified
        ):
            # Over the hourly limit: the mail is kept and skipped; its files are not stored.
            names = [file.name for file in mail.files]
            note = not_read_note(names, "over the hourly limit of messages")
            mail = replace(
                mail, files=(), not_read=(*mail.not_read, *names), text=(mail.text or "") + note
            )
        if mail.files:
            # In a worker thread: reading a text file's type decodes all of it.
            mail = await asyncio.to_thread(
                within_limits,
                mail,
                max_bytes=self.config.max_attachment_bytes,
                max_count=self.worker.limits.max_attachments_per_message,
            )
        incoming = _incoming(mail)
        if verified:  # (DMARC passed for the From's domain)
            incoming = replace(incoming, meta={**incoming.meta, "sender_verified": True})
        await self.worker.accept(incoming)

    async def record_failed(self, mail: ParsedMail, error: str, *, unread: str = "") -> None:
        """Keep a mail we cannot take as a `failed` inbox row (its envelope and `error`), so
        that an operator sees it; `unread`: why it was not read, which its sender is told in
        a reply. MailError when even that cannot be written."""
        assert self.worker is not None
        reply = f"Sorry, your mail was not read: {unread}." if unread else None
        try:
            await self.worker.record_unread(_incoming(mail), error, reply)
        except Exception as exc:
            raise MailError(
                f"message {mail.message_id[:200]!r} from {mail.sender}: {error}, and it cannot "
                f"be recorded as failed either ({describe(exc)}); it stays unread"
            ) from exc
        logger.warning(
            "email: message %r from %s: %s; recorded as failed and marked seen",
            mail.message_id[:200],
            mail.sender,
            error,
            extra={"action": "mail_failed"},
        )

    async def open(self) -> None:
        """Reading the mailbox is the leader's (`lead`); sending, and the webhook, every
        switchboard process's."""
        if self.worker is not None and self.config.mode in ("idle", "poll"):
            self.status = ModuleStatus(self.name, "standby", "another process reads the mailbox")
        elif self.config.mode == "webhook" and self.worker is not None and not self.webhook_token:
            # The webhook would answer 401 to everything: say so where an operator looks.
            problem = f"webhook mode needs a token: set {WEBHOOK_TOKEN_ENV}"
            self.status = ModuleStatus(self.name, "failed", problem)
            logger.error("email: %s", problem, extra={"action": "email_webhook"})
        else:
            self.status = ModuleStatus(self.name, "running", f"{self.config.mode} mode")

    async def close(self) -> None:
        await self.step_down()

    async def lead(self) -> None:
        """The IMAP session (IDLE or polling), on one switchboard process only."""
        if self.worker is not None and self.config.mode in ("idle", "poll"):
            self.status = ModuleStatus(self.name, "starting")
            self._task = asyncio.create_task(ImapIntake(self).run(), name="email:intake")

    async def step_down(self) -> None:
        if self._task is None:
            return
        await cancel_and_wait(self._task)
        self._task = None
        self.status = ModuleStatus(self.name, "standby", "another process reads the mailbox")

    # -- what goes out --------------------------------------------------------------------------

    async def send(
        self,
        to: str,
        subject: str,
        body: str,
        *,
        in_reply_to: str | None = None,
        references: str | None = None,
        message_id: str | None = None,
        attachments: tuple[Attachment, ...] = (),
    ) -> str:
        """Send a plain-text mail, with `attachments` as its files; its Message-ID
        (`message_id`, else a new one)."""
        try:
            recipient, _ = single_address([to], "To")
        except ValueError as exc:
            raise MailError(f"cannot send to {to!r}: {exc}") from None
        message = EmailMessage()
        # Named (a bare address showed as the address, a cousin of spam, in mail programs);
        # the Date in GMT (formatdate's default "-0000" says "zone unknown").
        message["From"] = email.utils.formataddr(
            (SENDER_NAME, self.config.address or self.username)
        )
        message["To"] = recipient
        message["Subject"] = one_line(subject)
        message["Date"] = email.utils.formatdate(usegmt=True)
        message_id = message_id or self.new_message_id()
        message["Message-ID"] = message_id
        message["Auto-Submitted"] = "auto-replied" if in_reply_to else "auto-generated"
        if in_reply_to and one_line(in_reply_to):
            message["In-Reply-To"] = one_line(in_reply_to)
            message["References"] = one_line(references or in_reply_to)
        message.set_content(body)
        attach(message, attachments)
        try:
            await smtp_send(
                self.smtp_server, message, self.username, self.password, context=self.tls_context
            )
        except MailError as exc:
            raise type(exc)(f"{exc} (the mail to {recipient} was not sent)") from exc
        return message_id

    def new_message_id(self) -> str:
        """A Message-ID no one can guess (make_msgid draws on `random`, whose state 312 ids
        give away: a red team); without a DMARC check it is what ties an answer to its
        question."""
        domain = self.address.split("@")[-1] or "butlers.invalid"
        return f"<{secrets.token_hex(16)}@{domain}>"

    # -- the outbox's channel ------------------------------------------------------------

    def prepare(
        self,
        text: str,
        *,
        reply_to: InboxMessage | None,
        butler: str | None,
        subject: str | None = None,
    ) -> list[tuple[str, dict[str, Any]]]:
        """One row; its Message-ID is chosen now, so that a mail sent again after a crash is
        the same mail to the reader's client (which drops the copy)."""
        meta: dict[str, Any] = {"message_id": self.new_message_id()}
        if reply_to is not None:
            meta["subject"] = reply_subject(reply_to.subject)
            meta["in_reply_to"] = reply_to.meta.get("message_id") or None
            meta["references"] = reply_to.meta.get("references") or None
        elif subject is not None:
            meta["subject"] = subject
        else:
            meta["subject"] = f"From your {butler} butler" if butler else "From your butlers"
        return [(text, meta)]

    async def deliver(self, delivery: Delivery) -> list[str]:
        """Send one row. A recipient that is no address, or a server refusing the mail itself
        (5xx to the recipient or the data) is final; a server down, refusing the connection,
        STARTTLS or the login (a password that changed: every queued mail would be lost), or
        answering 4xx is tried again later. A 4xx to the recipient alone (a full mailbox,
        greylisting) holds back only that recipient's mail (RecipientDeferred): one bad
        address must not stop the replies to everyone else."""
        import aiosmtplib

        meta = delivery.meta
        try:
            single_address([delivery.recipient], "To")
        except ValueError as exc:
            raise DeliveryError(f"no address to send to: {exc}", permanent=True) from None
        try:
            message_id = await self.send(
                delivery.recipient,
                meta.get("subject") or "",
                delivery.text,
                in_reply_to=meta.get("in_reply_to"),
                references=meta.get("references"),
                message_id=meta.get("message_id"),
                attachments=delivery.attachments,
            )
        except MailError as exc:
            cause = exc.__cause__.__cause__ if exc.__cause__ is not None else None
            code = getattr(cause, "code", None)
            if isinstance(cause, aiosmtplib.SMTPRecipientsRefused):  # 450 greylisting: later
                code = min((r.code for r in cause.recipients), default=None)
            refused_mail = isinstance(
                cause,
                aiosmtplib.SMTPRecipientsRefused
                | aiosmtplib.SMTPSenderRefused
                | aiosmtplib.SMTPDataError,
            )
            permanent = (
                not isinstance(exc, MailRefused)
                and refused_mail
                and (not isinstance(code, int) or 500 <= code < 600)
            )
            if (
                isinstance(cause, aiosmtplib.SMTPRecipientsRefused)
                and isinstance(code, int)
                and 400 <= code < 500
                and code != 421  # the server is closing: the channel's trouble, not the address's
            ):
                raise RecipientDeferred(str(exc)) from exc
            raise DeliveryError(str(exc), permanent=permanent) from exc
        return [message_id]


def _incoming(mail: ParsedMail) -> IncomingMessage:
    """The mail as the inbox stores it, with its files (`within_limits` applied)."""
    meta: dict[str, Any] = {"message_id": mail.message_id, "references": mail.references}
    if mail.sent_at:
        meta["sent_at"] = mail.sent_at  # the handoff says so when it is long before now
    if mail.not_read:
        meta["attachments_not_read"] = list(mail.not_read)
    if any(file.kind == "audio" for file in mail.files):
        # The worker transcribes it; the mail's own text stays beside the transcript.
        meta["voice"] = True
    forwarded = mail.forwarded or forwarded_part(mail.subject, mail.text)
    if forwarded is not None:
        meta["forwarded_from"] = forwarded[0]  # someone else's words (the handoff says so)
        if forwarded[1]:  # the sender's own lines come first
            meta["forwarded_at"] = forwarded[1]
    return IncomingMessage(
        channel="email",
        external_id=_external_id(mail),
        text=mail.text or ("" if mail.files else "(empty message)"),
        source_id=mail.sender or None,
        sender_name=mail.sender_name or None,
        subject=mail.subject or None,
        meta=meta,
        conversation=conversation_of(mail),
        attachments=mail.files,
    )


def conversation_of(mail: ParsedMail) -> str:
    """A mail thread's key, per sender: the thread's root (the first of References: our reply
    keeps the thread's References and adds to it; else the mail's own Message-ID) and who
    writes. References are the sender's to choose: someone CC'd on another person's thread,
    or claiming its root, must not get that person's history in their prompts, nor their
    notifications."""
    ids = mail.references.split()
    root = ids[0] if ids else _external_id(mail)
    if len(root) > MAX_CONVERSATION_ID_CHARS:  # the key is indexed: a hostile id may be huge
        root = "sha256:" + hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()
    return f"email:{mail.sender}:{root}"


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
