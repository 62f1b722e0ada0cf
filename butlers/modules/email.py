"""Email: intake from an IMAP mailbox (IDLE, polling) or a webhook into the switchboard's
inbox, and `send_email` over SMTP.

A mail is fetched with BODY.PEEK[] (which leaves it unread) and flagged \\Seen only once it is
safely in the inbox. Bounces, auto-replies and our own mail are never answered: no mail loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import email
import email.policy
import email.utils
import logging
import re
from dataclasses import dataclass, field
from email.message import EmailMessage
from html.parser import HTMLParser
from typing import TYPE_CHECKING, Any

from fastmcp import FastMCP
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from butlers.config import EmailConfig
from butlers.context import ModuleStatus
from butlers.errors import ButlersError, ToolRefusal
from butlers.switchboard.inbox import InboxMessage, IncomingMessage
from butlers.tasks import cancel_and_wait

if TYPE_CHECKING:
    from butlers.switchboard.worker import InboxWorker

logger = logging.getLogger(__name__)

IDLE_RENEW_S = 25 * 60  # servers may drop an IDLE after 29 minutes (RFC 2177)
BACKOFF_S = (1, 2, 5, 10, 30, 60)
WEBHOOK_PATH = "/email/inbound"
MAX_TEXT_CHARS = 100_000


class MailError(ButlersError):
    """Sending or fetching mail failed; the message says what and where."""


# -- parsing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedMail:
    message_id: str
    sender: str  # the address, lower-cased
    sender_name: str
    subject: str
    text: str
    attachments: list[str] = field(default_factory=list)
    references: str = ""
    automated: str | None = None  # why this mail must not be answered, if it must not


class _HTMLText(HTMLParser):
    """HTML-only mail as readable text: block elements become line breaks."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "table", "blockquote"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _HTMLText()
    parser.feed(html)
    text = "".join(parser.parts)
    lines = [re.sub(r"[ \t\xa0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


_QUOTE_HEADER = re.compile(r"^(On .+ wrote:|-----Original Message-----|Le .+ a écrit :)\s*$")


def trim_quoted(text: str) -> str:
    """Drop the quoted history of a reply: '>' lines and everything after 'On ... wrote:'."""
    kept = []
    for line in text.splitlines():
        if _QUOTE_HEADER.match(line.strip()):
            break
        if line.lstrip().startswith(">"):
            continue
        kept.append(line)
    return "\n".join(kept).strip()


def _automated(message: EmailMessage, sender: str) -> str | None:
    auto = str(message.get("Auto-Submitted", "no")).strip().lower()
    if auto and auto != "no":
        return f"Auto-Submitted: {auto}"
    precedence = str(message.get("Precedence", "")).strip().lower()
    if precedence in ("bulk", "junk", "list", "auto_reply"):
        return f"Precedence: {precedence}"
    if message.get("X-Autoreply") or message.get("X-Autorespond"):
        return "auto-reply header"
    if str(message.get("Return-Path", "")).strip() == "<>":
        return "bounce (empty Return-Path)"
    local = sender.split("@")[0]
    if local in ("mailer-daemon", "postmaster", "noreply", "no-reply"):
        return f"sent by {local}"
    if message.get_content_type() == "multipart/report":
        return "delivery report"
    return None


def parse_mail(raw: bytes) -> ParsedMail:
    """Parse with the stdlib (policy.default): text/plain preferred, HTML converted, any
    charset, attachments listed by name, quoted history trimmed."""
    message = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    name, address = email.utils.parseaddr(str(message.get("From", "")))
    address = address.lower()
    body = message.get_body(preferencelist=("plain", "html"))
    text = ""
    if body is not None:
        try:
            content = body.get_content()
        except (LookupError, UnicodeDecodeError):  # an unknown or lying charset
            content = (body.get_payload(decode=True) or b"").decode("latin-1")
        text = html_to_text(content) if body.get_content_type() == "text/html" else content
    attachments = [part.get_filename() or "(unnamed)" for part in message.iter_attachments()]
    text = trim_quoted(text)[:MAX_TEXT_CHARS]
    if attachments:
        text += f"\n\n[attachments not read: {', '.join(attachments)}]"
    message_id = str(message.get("Message-ID", "")).strip()
    references = " ".join(filter(None, [str(message.get("References", "")).strip(), message_id]))
    return ParsedMail(
        message_id=message_id,
        sender=address,
        sender_name=name,
        subject=str(message.get("Subject", "")).strip(),
        text=text,
        attachments=attachments,
        references=references,
        automated=_automated(message, address),
    )


def sender_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or address == entry or (entry.startswith("@") and address.endswith(entry)):
            return True
    return False


def reply_subject(subject: str | None) -> str:
    subject = (subject or "").strip()
    return subject if subject.lower().startswith("re:") else f"Re: {subject}".strip()


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

    def register(self, mcp: FastMCP, webhook_token: str | None) -> None:
        module = self

        @mcp.tool
        async def send_email(
            to: str, subject: str, body: str, in_reply_to: str | None = None
        ) -> dict[str, Any]:
            """Send a plain-text email from the butler's address."""
            if "@" not in to:
                raise ToolRefusal(f"'to' must be an email address, got {to!r}")
            try:
                message_id = await module.send(to, subject, body, in_reply_to=in_reply_to)
            except MailError as exc:
                raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
            return {"to": to, "message_id": message_id}

        if self.config.mode == "webhook" and self.worker is not None:

            @mcp.custom_route(WEBHOOK_PATH, methods=["POST"])
            async def email_inbound(request: Request) -> Response:
                import hmac

                supplied = request.headers.get("authorization", "")
                expected = f"Bearer {webhook_token}" if webhook_token else None
                if expected is None or not hmac.compare_digest(supplied, expected):
                    return JSONResponse({"error": "missing or wrong bearer token"}, 401)
                try:
                    data = await request.json()
                    mail = _mail_from_json(data)
                except (ValueError, KeyError, TypeError) as exc:
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
        import aiosmtplib

        message = EmailMessage()
        message["From"] = self.config.address or self.username
        message["To"] = to
        message["Subject"] = subject
        message["Date"] = email.utils.formatdate(localtime=False)
        message_id = email.utils.make_msgid(domain=self.address.split("@")[-1] or None)
        message["Message-ID"] = message_id
        message["Auto-Submitted"] = "auto-replied" if in_reply_to else "auto-generated"
        if in_reply_to:
            message["In-Reply-To"] = in_reply_to
            message["References"] = references or in_reply_to
        message.set_content(body)
        try:
            await aiosmtplib.send(
                message,
                hostname=self.config.smtp_host,
                port=self.config.smtp_port,
                username=self.username,
                password=self.password,
                use_tls=self.config.smtp_ssl,
                start_tls=self.config.smtp_starttls if not self.config.smtp_ssl else False,
                timeout=30,
            )
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise MailError(
                f"SMTP {self.config.smtp_host}:{self.config.smtp_port} did not "
                f"take the mail to {to}: {exc}"
            ) from exc
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
        if self.worker is None:
            return False
        await self.worker.accept(
            IncomingMessage(
                channel="email",
                external_id=mail.message_id or _fingerprint(mail),
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
        )
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
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.status.status == "running":
                    failures = 0  # it was a working session: reconnect quickly
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                self.status = ModuleStatus(
                    self.name, "starting", f"IMAP {self.config.imap_host}: {exc}; retrying"
                )
                logger.warning("email: IMAP session ended (%s); reconnecting in %ss", exc, delay)
                await asyncio.sleep(delay)

    async def _session(self) -> None:
        import aioimaplib

        lost = asyncio.Event()  # aioimaplib does not wake an IDLE wait when the server goes

        def on_lost(_exc: Exception | None) -> None:
            lost.set()

        if self.config.imap_ssl:
            client = aioimaplib.IMAP4_SSL(
                host=self.config.imap_host, port=self.config.imap_port, conn_lost_cb=on_lost
            )
        else:
            client = aioimaplib.IMAP4(
                host=self.config.imap_host, port=self.config.imap_port, conn_lost_cb=on_lost
            )
        await client.wait_hello_from_server()
        response = await client.login(self.username, self.password)
        if response.result != "OK":
            raise MailError(f"IMAP login refused for {self.username}")
        try:
            await _ok(client.select("INBOX"), "SELECT INBOX")
            use_idle = self.config.mode == "idle" and client.has_capability("IDLE")
            self.status = ModuleStatus(
                self.name,
                "running",
                f"{'IDLE' if use_idle else 'polling'} on {self.config.imap_host}",
            )
            while True:
                await self._fetch_unseen(client)
                if use_idle:
                    idle = await client.idle_start(timeout=IDLE_RENEW_S)
                    push = asyncio.ensure_future(client.wait_server_push(timeout=IDLE_RENEW_S))
                    gone = asyncio.ensure_future(lost.wait())
                    await asyncio.wait({push, gone}, return_when=asyncio.FIRST_COMPLETED)
                    gone.cancel()
                    if lost.is_set():
                        push.cancel()
                        raise MailError(f"IMAP connection to {self.config.imap_host} was lost")
                    with contextlib.suppress(TimeoutError):
                        push.result()  # a timeout: renew the IDLE before the server drops it
                    client.idle_done()
                    await asyncio.wait_for(idle, 30)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), self.config.poll_interval_s)
                    if lost.is_set():
                        raise MailError(f"IMAP connection to {self.config.imap_host} was lost")
        finally:
            try:
                await asyncio.wait_for(client.logout(), 5)
            except Exception:
                pass

    async def _fetch_unseen(self, client: Any) -> None:
        response = await _ok(client.uid_search("UNSEEN"), "UID SEARCH UNSEEN")
        uids = [uid.decode() for uid in response.lines[0].split()] if response.lines else []
        for uid in uids:
            fetched = await _ok(client.uid("fetch", uid, "(BODY.PEEK[])"), f"FETCH {uid}")
            raw = next((bytes(line) for line in fetched.lines if isinstance(line, bytearray)), None)
            if raw is None:
                continue
            try:
                mail = parse_mail(raw)
            except Exception:
                logger.exception("email: cannot parse message uid %s; marking it seen", uid)
                settled = True
            else:
                settled = await self.accept(mail)
            if settled:
                await _ok(client.uid("store", uid, "+FLAGS (\\Seen)"), f"STORE {uid}")


def _fingerprint(mail: ParsedMail) -> str:
    """A stable id for mail without a Message-ID, so a re-fetch is still a duplicate."""
    import hashlib

    digest = hashlib.sha256(f"{mail.sender}\0{mail.subject}\0{mail.text}".encode()).hexdigest()
    return f"no-message-id:{digest[:32]}"


async def _ok(awaitable: Any, what: str) -> Any:
    response = await awaitable
    if response.result != "OK":
        raise MailError(f"IMAP {what} failed: {response.lines[-1:]!r}")
    return response


def _mail_from_json(data: dict[str, Any]) -> ParsedMail:
    """The webhook body: {from, subject, text | html, message_id, headers?}."""
    if not isinstance(data, dict):
        raise TypeError("expected a JSON object")
    name, address = email.utils.parseaddr(str(data["from"]))
    if "@" not in address:
        raise ValueError(f"'from' is not an address: {data['from']!r}")
    text = data.get("text")
    if not text and data.get("html"):
        text = html_to_text(str(data["html"]))
    headers = {str(k).lower(): str(v) for k, v in (data.get("headers") or {}).items()}
    fake = EmailMessage()
    for key, value in headers.items():
        fake[key] = value
    message_id = str(data.get("message_id") or headers.get("message-id") or "")
    if not message_id:
        raise ValueError("'message_id' is required (it makes redelivery harmless)")
    return ParsedMail(
        message_id=message_id,
        sender=address.lower(),
        sender_name=name,
        subject=str(data.get("subject") or ""),
        text=trim_quoted(str(text or ""))[:MAX_TEXT_CHARS],
        references=message_id,
        automated=_automated(fake, address.lower()),
    )
