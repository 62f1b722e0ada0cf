"""Telegram: intake (long polling or webhook) into the switchboard's inbox, and `send_message`.

Polling is our own loop over python-telegram-bot's `Bot.get_updates`, not PTB's Updater: the
Updater moves the offset on (acknowledging updates to Telegram) before handlers run, so a
crash could lose a message. Here an update is stored in the inbox first, and only the next
`get_updates` call, with the offset past it, acknowledges it.

Files (a voice note, an audio file, a photo, a document) from a chat that may write are
downloaded (getFile, then the file URL) and stored with the message, after
`butlers.media.checked` read their type from their bytes: the worker transcribes audio and
hands the rest to the routed butler. A file over `max_attachment_bytes` (by the size Telegram
states, before downloading; by the bytes that came, after) or of a type not read gets one
reply naming the limit, and nothing is stored: the update is settled. A download that fails
for now (the Bot API's 5xx, the network) is an update not stored: not acknowledged, it comes
again (polling), or the webhook answers 503 so that Telegram posts it again. Nothing is
downloaded for a chat that may not write. The photos and files of an album (sent together:
a message each, with one `media_group_id`) are stored as they come and answered as one
message (butlers.switchboard.inbox: the album's first message takes the others' files).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastmcp import FastMCP
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from butlers.backoff import RECONNECT, Backoff
from butlers.config import TelegramConfig
from butlers.context import ModuleStatus
from butlers.errors import AttachmentRefused, DeliveryError
from butlers.http import secret_matches
from butlers.media import (
    MAX_IMAGE_BYTES,
    Attachment,
    _sizes,
    check_count,
    checked,
    clock_length,
)
from butlers.switchboard.handoff import MAX_SENDER_NAME_CHARS
from butlers.switchboard.inbox import InboxMessage, IncomingMessage
from butlers.switchboard.outbox import Delivery
from butlers.tasks import cancel_and_wait
from butlers.text import printable
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from telegram import CallbackQuery, Message, PhotoSize, Update, User
    from telegram.ext import ExtBot

    from butlers.switchboard.approvals import ApprovalDesk
    from butlers.switchboard.pairing import PairingDesk
    from butlers.switchboard.worker import InboxWorker

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 4096
POLL_TIMEOUT_S = 25
# getUpdates answered 409 this many times in a row: another poller for more than a hand-over's
# moment (the module is `failed` on /health until a poll goes through again).
CONFLICTS_BEFORE_FAILED = 3
# How long a Bot API call (a reply's sendMessage) may take to answer. A request Telegram
# read but did not answer in time cannot be told from one it never got: the reply is sent
# again. At python-telegram-bot's 5 s, a Bot API slow for 7 s had a reply sent three times
# (a red team); Telegram answers in well under a second when it is well.
READ_TIMEOUT_S = 30.0
WEBHOOK_PATH = "/telegram/webhook"
TYPING_EVERY_S = 4.5
REFUSAL = "Sorry, this is a private butler: I only answer the people it was set up for."
TEXT_ONLY = (
    "I can read text, voice notes, photos and documents, but not this kind of message: please "
    "send it as one of those."
)
# A sendPhoto / sendDocument caption, in UTF-16 code units (as Telegram counts).
MAX_CAPTION_CHARS = 1024
# A group that writes with pairing on gets no code (one approval would let in every member,
# present and future, while the owner sees one name); it is logged at most this often.
GROUP_LOGGED_EVERY_S = 3600.0
MAX_GROUPS_REMEMBERED = 10_000  # past it, the groups logged over an hour ago are forgotten
# What Telegram accepts as a webhook's secret_token (Bot API, setWebhook).
WEBHOOK_SECRET = re.compile(r"[A-Za-z0-9_-]{1,256}")
# Telegram's descriptions of a token it refuses (python-telegram-bot raises InvalidToken for
# both): 401 for a well-formed token that is not valid (revoked, mistyped), 404 for a
# malformed one.
TOKEN_REFUSALS = {"Unauthorized": "401 Unauthorized", "Not Found": "404 Not Found"}
MAX_DOWNLOADS_AT_ONCE = 4  # a bot's files fetched at the same time (webhook updates)
# A file Telegram keeps failing to hand over (5xx) is given up after this, its sender asked to
# send it again: the messages behind it must not wait for ever.
GIVE_UP_ON_FILE_AFTER_S = 30 * 60.0
# A decided question whose edit met a Bot API that was down is tried again this often, for up
# to this long: its buttons would stay on the owner's screen for a call decided long ago.
EDIT_RETRY = Backoff((5, 15, 30, 60, 120, 300))
GIVE_UP_ON_EDIT_AFTER_S = 3600.0
# What getUpdates and a webhook ask Telegram for: messages, and the presses of our approval
# buttons (butlers.switchboard.approvals).
ALLOWED_UPDATES = ["message", "edited_message", "callback_query"]
# An edited message is not read again: said at most this often a chat.
EDIT_NOT_READ = (
    "I do not read edited messages: the first version is the one I had. Send the change as a "
    "new message."
)
EDIT_NOTICE_EVERY_S = 3600.0
# The owner's reply to an approval's or a pairing's question that does not answer it.
NOT_AN_ANSWER = (
    "That replies to a question of mine: press Approve or Deny on it, or reply with approve "
    "or deny (yes, no). To ask something else, send a new message."
)
REPLIED_TO_CHARS = 1000  # of the message a reply answers, given to the butler with it


def split_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> list[str]:
    """Telegram takes at most 4096 characters a message: cut at line, then word boundaries."""
    chunks: list[str] = []
    while len(text) > limit:
        cut = text.rfind("\n", 0, limit)
        if cut < limit // 2:
            cut = text.rfind(" ", 0, limit)
        if cut < limit // 2:
            cut = limit
        chunks.append(text[:cut])
        text = text[cut:].lstrip("\n ")
    if text or not chunks:
        chunks.append(text)
    return chunks


def _inline_keyboard(rows: list[list[dict[str, str]]]) -> Any:
    """Buttons as stored in an outbox row's meta: rows of {"text", "callback_data"}."""
    from telegram import InlineKeyboardButton, InlineKeyboardMarkup

    return InlineKeyboardMarkup(
        [
            [InlineKeyboardButton(b["text"], callback_data=b["callback_data"]) for b in row]
            for row in rows
        ]
    )


def _name_of(user: User | None) -> str:
    """What a Telegram user calls themselves (their choice: cleaned before it is shown)."""
    if user is None:
        return ""
    return f"{user.full_name} (@{user.username})" if user.username else user.full_name


@dataclass(frozen=True)
class _File:
    """A file a message carries, as Telegram describes it before we download it."""

    file_id: str
    name: str  # what the sender reads in a refusal: the file's name, else its kind
    size: int | None  # what Telegram says its size is, if it says
    limit: int  # the most bytes read of it


def _largest_photo(sizes: tuple[PhotoSize, ...], limit: int) -> PhotoSize | None:
    """Of a photo's sizes, the largest one within `limit` bytes (one whose size Telegram does
    not state counts as within: its bytes are checked once downloaded); None when none is."""
    within = [p for p in sizes if p.file_size is None or p.file_size <= limit]
    return max(within, key=lambda p: (p.width * p.height, p.file_size or 0), default=None)


def _too_big(name: str, size: int, limit: int) -> AttachmentRefused:
    """The refusal of a file Telegram says is bigger than we read, before downloading it: in
    the words `checked` uses for one that came bigger."""
    return AttachmentRefused(f"{name!r} is {_sizes(size, limit)}")


def _seconds(duration: object) -> int | None:
    """A length Telegram states, in seconds, or None. Read from the object's dict (an int,
    as the Bot API sends it): its `duration` attribute warns that it will become a
    timedelta (python-telegram-bot 22.2+)."""
    return duration if isinstance(duration, int) else None


def caption_fits(text: str) -> bool:
    """Whether `text` fits a photo's or document's caption (Telegram counts UTF-16 units)."""
    return len(text.encode("utf-16-le")) // 2 <= MAX_CAPTION_CHARS


def _answering(message: Message, chat_id: str) -> InboxMessage:
    """What an answer to `message` replies to, as the outbox's channel reads it."""
    return InboxMessage(
        id=0,
        channel="telegram",
        external_id="",
        source_id=chat_id,
        sender_name=None,
        subject=None,
        text="",
        meta={"message_id": message.message_id},
        attempts=0,
        trace_context=None,
    )


class TelegramModule:
    name = "telegram"

    def __init__(
        self,
        config: TelegramConfig,
        token: str,
        worker: InboxWorker | None,
        *,
        webhook_secret: str | None = None,
    ) -> None:
        from telegram.ext import AIORateLimiter, ExtBot
        from telegram.request import HTTPXRequest

        self.config = config
        self.worker = worker
        self.webhook_secret = webhook_secret
        # Where the owner's presses of approval buttons go (the switchboard's; None: ignored).
        self.approvals: ApprovalDesk | None = None
        # Strangers' codes, the owner's pairing buttons, and the paired chats (the
        # switchboard's; None: only allowed_chat_ids).
        self.pairing: PairingDesk | None = None
        self._edits_told: dict[str, float] = {}  # chat -> when it was told edits are not read
        base = (config.api_base_url or "https://api.telegram.org").rstrip("/")
        # Files come from <file base>/bot<token>/<file_path> (`file_base_url` names what comes
        # before /bot; a value that already ends in it is taken as it is).
        file_base = config.file_base_url.rstrip("/").removesuffix("/bot") or f"{base}/file"
        # A 429 would lose the reply without the rate limiter's retries.
        self.bot: ExtBot = ExtBot(
            token,
            base_url=f"{base}/bot",
            base_file_url=f"{file_base}/bot",
            rate_limiter=AIORateLimiter(overall_max_rate=config.max_messages_per_s, max_retries=3),
            request=HTTPXRequest(read_timeout=READ_TIMEOUT_S),
        )
        self.status = ModuleStatus(self.name, "starting")
        self._task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._refused: set[str] = set()
        # Group chats refused a pairing code: chat id -> when it was last logged (monotonic).
        self._groups_logged: dict[str, float] = {}
        # Files whose download keeps failing: file_id -> when it first failed (monotonic).
        self._failing_files: dict[str, float] = {}
        # Files fetched at once: webhook updates are handled concurrently (Telegram keeps up
        # to 40 connections), and each download is held in memory whole (20 concurrent
        # 19 MiB documents raised the process's peak by 800 MB, measured by a red team).
        self._downloads = asyncio.Semaphore(MAX_DOWNLOADS_AT_ONCE)
        self.give_up_on_file_after_s = GIVE_UP_ON_FILE_AFTER_S
        self.edit_retry = EDIT_RETRY
        self.give_up_on_edit_after_s = GIVE_UP_ON_EDIT_AFTER_S
        self._edits: set[asyncio.Task[None]] = set()  # decided questions tried again

    # -- tools and routes -------------------------------------------------------------------

    def register(self, mcp: FastMCP) -> None:
        module = self

        @mcp.tool
        async def send_message(chat_id: str, text: str) -> dict[str, Any]:
            """Send `text` to a Telegram chat (split into several messages past 4096 chars)."""
            if not text.strip():
                raise ToolRefusal("text must not be empty")
            try:
                ids = await module.send(chat_id, text)
            except Exception as exc:
                raise ToolRefusal(
                    f"Telegram did not take the message for chat {chat_id}: {exc}",
                    log_level=logging.WARNING,
                ) from exc
            return {"chat_id": chat_id, "message_ids": ids}

    def webhook_routes(self) -> list[BaseRoute]:
        """POST /telegram/webhook in webhook mode: Telegram (or a reverse proxy in front of
        us) posts updates there with our secret in X-Telegram-Bot-Api-Secret-Token."""
        if self.config.mode != "webhook" or self.worker is None:
            return []
        return [Route(WEBHOOK_PATH, self._webhook, methods=["POST"])]

    async def _webhook(self, request: Request) -> Response:
        supplied = request.headers.get("x-telegram-bot-api-secret-token")
        if not secret_matches(supplied, self.webhook_secret):
            return JSONResponse({"error": "missing or wrong secret token"}, status_code=401)
        try:
            data = await request.json()
        except ValueError:
            return JSONResponse({"error": "body is not JSON"}, status_code=400)
        if not isinstance(data, dict) or not isinstance(data.get("update_id"), int):
            return JSONResponse({"error": "body is not a Telegram update"}, status_code=400)
        try:
            await self.handle_update_json(data)
        except Exception:  # logged (handle_update): not stored, so Telegram must post it again
            return JSONResponse(
                {"error": "the update could not be taken; send it again later"}, status_code=503
            )
        return JSONResponse({"ok": True})  # only now: the message is in the inbox

    def webhook_secret_problem(self) -> str | None:
        """Why webhook mode cannot be trusted with the configured secret, if it cannot."""
        name = self.config.webhook_secret_env
        if not self.webhook_secret:
            return f"webhook mode needs a secret: set {name}"
        if not WEBHOOK_SECRET.fullmatch(self.webhook_secret):
            return f"{name} must be 1-256 characters of A-Z, a-z, 0-9, _ and - (Telegram's rule)"
        return None

    async def send(self, chat_id: str | int, text: str) -> list[int]:
        ids = []
        for chunk in split_text(text):
            message = await self.bot.send_message(chat_id=chat_id, text=chunk)
            ids.append(message.message_id)
        return ids

    # -- the outbox's channel ------------------------------------------------------------

    def prepare(
        self,
        text: str,
        *,
        reply_to: InboxMessage | None,
        butler: str | None,
        subject: str | None = None,
    ) -> list[tuple[str, dict[str, Any]]]:
        """One outbox row per 4096-character chunk; the first answers the person's message."""
        chunks = split_text(text)
        first: dict[str, Any] = {}
        if reply_to is not None and reply_to.meta.get("message_id"):
            first["reply_to_message_id"] = reply_to.meta["message_id"]
        return [(chunk, first if index == 0 else {}) for index, chunk in enumerate(chunks)]

    @contextlib.asynccontextmanager
    async def working(self, chat_id: str) -> AsyncIterator[None]:
        """ "typing..." in the chat while its message is processed (Telegram shows it for 5 s
        a time, so it is sent again every TYPING_EVERY_S); best effort."""
        task = asyncio.create_task(self._typing(chat_id), name=f"telegram:typing:{chat_id}")
        try:
            yield
        finally:
            await cancel_and_wait(task)

    async def _typing(self, chat_id: str) -> None:
        from telegram.constants import ChatAction

        while True:
            with contextlib.suppress(Exception):
                await self.bot.send_chat_action(chat_id=chat_id, action=ChatAction.TYPING)
            await asyncio.sleep(TYPING_EVERY_S)

    async def deliver(self, delivery: Delivery) -> list[str]:
        """Send one row. Telegram refusing the chat or the message (400, 403: no such chat,
        the bot blocked) is final; the Bot API down or slow (5xx, network, 429 past the rate
        limiter's retries) is tried again later."""
        from telegram import ReplyParameters
        from telegram.error import BadRequest, ChatMigrated, Forbidden, TelegramError

        reply_to = delivery.meta.get("reply_to_message_id")
        keyboard = delivery.meta.get("inline_keyboard")  # an approval's Approve / Deny
        first: dict[str, Any] = {
            "reply_markup": _inline_keyboard(keyboard) if keyboard else None,
            "reply_parameters": (
                ReplyParameters(int(reply_to), allow_sending_without_reply=True)
                if reply_to
                else None
            ),
        }
        try:
            if delivery.attachments:
                return await self._deliver_files(delivery, first)
            message = await self.bot.send_message(
                chat_id=delivery.recipient, text=delivery.text, **first
            )
        except (BadRequest, Forbidden, ChatMigrated) as exc:
            raise DeliveryError(f"Telegram refused it: {exc}", permanent=True) from exc
        except (TelegramError, OSError) as exc:
            raise DeliveryError(f"the Bot API did not take it: {exc}") from exc
        return [str(message.message_id)]

    async def _deliver_files(self, delivery: Delivery, first: dict[str, Any]) -> list[str]:
        """A row with files: each image with sendPhoto, anything else with sendDocument; the
        text is the first file's caption when it fits one, else a message of its own before
        them. `first` (the reply and the buttons) goes with the first message sent. Every
        message's id comes back (a person may answer any of them: thread affinity)."""
        from telegram import InputFile
        from telegram.error import BadRequest

        ids: list[str] = []
        chat = delivery.recipient
        caption: str | None = None
        if caption_fits(delivery.text):
            caption = delivery.text or None
        else:
            for chunk in split_text(delivery.text):
                sent = await self.bot.send_message(chat_id=chat, text=chunk, **first)
                ids.append(str(sent.message_id))
                first = {}
        for index, attachment in enumerate(delivery.attachments):
            upload = InputFile(attachment.data, filename=attachment.name)
            options = {**first, "caption": caption if index == 0 else None}
            if attachment.kind == "image":
                try:
                    sent = await self.bot.send_photo(chat_id=chat, photo=upload, **options)
                except BadRequest as exc:  # a picture Telegram will not show as a photo
                    logger.info(
                        "telegram: sendPhoto refused %r (%s); as a document", attachment.name, exc
                    )
                    upload = InputFile(attachment.data, filename=attachment.name)
                    sent = await self.bot.send_document(chat_id=chat, document=upload, **options)
            else:
                sent = await self.bot.send_document(chat_id=chat, document=upload, **options)
            ids.append(str(sent.message_id))
            first = {}
        return ids

    # -- intake -----------------------------------------------------------------------------

    def allowed(self, chat_id: str) -> bool:
        """Listed in `allowed_chat_ids`, or the owner's chat ([switchboard.owner]: reminders
        and questions go there; left off the list, the owner's answers got a pairing code
        about themselves, a walkthrough)."""
        allowed = self.config.allowed_chat_ids
        desk = self.approvals or self.pairing
        owner = desk.owner.telegram_chat_id if desk is not None else ""
        # A private chat only (a user's id): a group named as the owner's would let every
        # member write as the owner (a review).
        return "*" in allowed or chat_id in allowed or (owner.isdigit() and chat_id == owner)

    async def handle_update_json(self, data: dict[str, Any]) -> None:
        from telegram import Update

        await self.handle_update(Update.de_json(data, self.bot))

    async def handle_update(self, update: Update, *, album_more: bool = False) -> None:
        """Store a message (its text, caption and file) in the inbox; answer what will not be
        routed. Raises when it could not be stored (or its file not downloaded, for now): the
        update is then not acknowledged, and comes again. `album_more`: more photos of its
        album are on their way (later in the same getUpdates answer)."""
        try:
            await self._handle_update(update, album_more)
        except Exception as exc:
            if _transient(exc):  # a download from a Bot API that is down: it comes again
                logger.warning(
                    "telegram update %s not handled yet (%s); it is taken again",
                    update.update_id,
                    exc,
                    extra={"action": "telegram_update_deferred"},
                )
            else:
                logger.exception(
                    "telegram update %s not handled",
                    update.update_id,
                    extra={"action": "telegram_update_failed"},
                )
            raise

    async def _handle_update(self, update: Update, album_more: bool) -> None:
        if update.callback_query is not None:
            await self._press(update.callback_query)
            return
        if update.edited_message is not None and self.worker is not None:
            await self._edited(update.edited_message)
            return
        message = update.message  # channel posts etc. are ignored on purpose
        if message is None or self.worker is None:
            return
        chat_id = str(message.chat_id)
        user = message.from_user
        replied = message.reply_to_message
        if replied is not None and message.text:
            # The owner's "yes" in reply to an approval's or a pairing's question decides
            # it, as its button does (the desks check it is the owner's, in their chat, as
            # for a press: the allowlist is not asked, as it is not for a press).
            for desk in (self.approvals, self.pairing):
                told = desk and await desk.chat_answer(
                    chat_id, str(user.id) if user else "", replied.message_id, message.text
                )
                if told:
                    await self._best_effort(chat_id, told)
                    return
        question = replied is not None and await self._a_question(chat_id, replied.message_id)
        if question:
            # Any other reply to a question ("ok", a thumbs-up, a voice note "yes, approve")
            # is no message for a butler: routed, it was answered "Done." while the code or
            # the call waited (a walkthrough).
            await self._best_effort(chat_id, NOT_AN_ANSWER)
            return
        if not self.allowed(chat_id) and not await self._paired(chat_id):
            await self._stranger(message, chat_id)
            return
        meta: dict[str, Any] = {"message_id": message.message_id}
        if message.date is not None:  # (Telegram keeps a day's updates while we are down)
            meta["sent_at"] = message.date.isoformat()
        if replied is not None:  # a reply to one of ours: thread affinity
            meta["reply_to_message_id"] = replied.message_id
            # And what it answers, for the butler ("move it to 16:00" said nothing of the
            # dentist it replied to, once the answer was older than the history shown); not
            # an approval's or a pairing's question, which quotes a stranger's words.
            quoted = (replied.text or replied.caption or "")[:REPLIED_TO_CHARS]
            if quoted:
                meta["reply_to_text"] = quoted
                by = replied.from_user
                mine = by is not None and self._ours(by)
                name = by.full_name if by is not None else ""
                meta["reply_to_from"] = "" if mine else printable(name, MAX_SENDER_NAME_CHARS)
        if (author := _forwarded_from(message)) is not None:
            meta["forwarded_from"] = author  # someone else's words (message_body says so)
        # A forum group's topics are separate conversations.
        topic = message.message_thread_id if message.is_topic_message else None
        incoming = IncomingMessage(
            channel="telegram",
            external_id=str(update.update_id),
            text=message.text or message.caption or "",
            source_id=chat_id,
            sender_name=user.full_name if user else None,
            meta=meta,
            conversation=f"telegram:{chat_id}" + (f":{topic}" if topic else ""),
            album_more=album_more,
        )
        if message.text:
            await self.worker.accept(incoming)
            return
        incoming = replace(incoming, album=message.media_group_id)
        if not await self.worker.files_welcome("telegram", chat_id, message.media_group_id):
            # Over the hourly limit: the message is kept and skipped; nothing is fetched.
            await self.worker.accept(_noting(incoming, OVER_LIMIT))
            return
        # A file not read still leaves its caption: the words go on, saying what was not read.
        with_note = incoming if incoming.text else None
        try:
            file = self._file_of(message)
        except AttachmentRefused as exc:  # by its stated type or size: nothing fetched
            await self._say_not_read(chat_id, exc)
            if with_note is not None:
                await self.worker.accept(_noting(with_note, str(exc)))
            return
        if file is None:
            await self._best_effort(chat_id, TEXT_ONLY)
            if with_note is not None:
                await self.worker.accept(_noting(with_note, _kind_of(message)))
            return
        try:
            attachment = await self._download(file)
        except AttachmentRefused as exc:  # by the bytes that came
            await self._say_not_read(chat_id, exc)
            if with_note is not None:
                await self.worker.accept(_noting(with_note, str(exc)))
            elif message.media_group_id:
                # Its album counted it as coming (`_album_goes_on`): it need not wait for it.
                await self.worker.album_part_dropped(incoming)
            return
        if not await self.worker.files_welcome("telegram", chat_id, message.media_group_id):
            # Others of the sender's came meanwhile (webhook updates arrive together):
            # fetched, but not stored.
            await self.worker.accept(_noting(incoming, OVER_LIMIT))
            return
        if attachment.kind == "audio":  # the worker transcribes it: the transcript is the message
            incoming = replace(incoming, meta={**meta, "voice": True})
        # An album's photos come as a message each: the inbox answers them as one.
        await self.worker.accept(replace(incoming, attachments=(attachment,)))

    def _ours(self, user: User) -> bool:
        """Whether `user` is this bot: its id is the token's first part (no getMe needed: a
        webhook's update may come first, when any bot passed for ours, a review)."""
        return str(user.id) == self.bot.token.split(":", 1)[0]

    async def _a_question(self, chat_id: str, message_id: int) -> bool:
        """Whether our message `message_id` in `chat_id` asked the owner about an approval
        or a pairing."""
        for desk in (self.approvals, self.pairing):
            if desk is not None and await desk.asked_in_chat(chat_id, message_id):
                return True
        return False

    async def _edited(self, message: Message) -> None:
        """An edit of a message already taken: not read (the first version may have been
        answered, acted on, a reminder set). Said once an hour a chat, instead of silence:
        the owner who corrected "at 9" to "at 10" believed the butler knew (a walkthrough)."""
        chat_id = str(message.chat_id)
        if not self.allowed(chat_id) and not await self._paired(chat_id):
            return
        now = time.monotonic()
        if now - self._edits_told.get(chat_id, -EDIT_NOTICE_EVERY_S) < EDIT_NOTICE_EVERY_S:
            return
        self._edits_told[chat_id] = now
        await self._best_effort(chat_id, EDIT_NOT_READ)

    async def _say_not_read(self, chat_id: str, refusal: AttachmentRefused) -> None:
        """A file not read: logged, and the sender told why."""
        logger.info(
            "telegram: chat %s: a file was not read: %s",
            chat_id,
            refusal,
            extra={"action": "attachment_refused"},
        )
        await self._best_effort(chat_id, str(refusal))

    def _album_goes_on(self, update: Update, later: Sequence[Update]) -> bool:
        """Whether `update` is a photo of an album with more in `later` that will be stored:
        a file that is read (not a video, not one too big by its stated size). Its first
        message then waits for them."""
        album = update.message.media_group_id if update.message is not None else None
        return album is not None and any(
            u.message is not None
            and u.message.media_group_id == album
            and self._read_later(u.message)
            for u in later
        )

    def _read_later(self, message: Message) -> bool:
        try:
            return self._file_of(message) is not None
        except AttachmentRefused:
            return False

    def _check_length(self, what: str, duration: object) -> None:
        """AttachmentRefused for audio longer than `[switchboard.transcription] max_seconds`,
        by the length Telegram states: a 20 MiB note of Opus at 6 kbit/s lasts some 7 hours,
        billed by the minute where a service transcribes it, and hours of a local model."""
        assert self.worker is not None
        most = self.worker.limits.transcription.max_seconds
        seconds = _seconds(duration)
        if seconds is not None and seconds > most:
            raise AttachmentRefused(
                f"{what} is {clock_length(seconds)} long; the most I transcribe is "
                f"{clock_length(most)}: send a shorter one, or write it out"
            )

    def _file_of(self, message: Message) -> _File | None:
        """The file a message carries that we read (a voice note, an audio file, a photo: its
        largest size within the limits, a document), or None (a sticker, a video, a
        location...). AttachmentRefused when files are not read at all, or no photo size is
        small enough."""
        assert self.worker is not None
        limit = self.config.max_attachment_bytes
        file: _File | None = None
        if message.voice is not None:
            voice = message.voice
            self._check_length("the voice note", voice.to_dict().get("duration"))
            file = _File(voice.file_id, "voice note", voice.file_size, limit)
        elif message.audio is not None:
            audio = message.audio
            self._check_length(repr(audio.file_name or "audio"), audio.to_dict().get("duration"))
            file = _File(audio.file_id, audio.file_name or "audio", audio.file_size, limit)
        elif message.photo:
            # What the Messages API takes of an image, if that is less.
            limit = min(limit, MAX_IMAGE_BYTES)
            photo = _largest_photo(message.photo, limit)
            if photo is None:
                smallest = min(p.file_size or 0 for p in message.photo)
                raise _too_big("photo", smallest, limit)
            file = _File(photo.file_id, "photo", photo.file_size, limit)
        elif message.document is not None:
            document = message.document
            name = document.file_name or "document"
            file = _File(document.file_id, name, document.file_size, limit)
        if file is not None:
            check_count(1, self.worker.limits.max_attachments_per_message)
        return file

    async def _download(self, file: _File) -> Attachment:
        """The file's bytes, checked (butlers.media.checked: its type read from them, its
        size). AttachmentRefused when it is too big (by what Telegram states, before anything
        is downloaded) or not read, or Telegram refuses it for good (a 400: an unknown or
        too-big file); any other failure (5xx, network) raises as it is: tried again."""
        from telegram.error import BadRequest, Forbidden, InvalidToken

        if file.size is not None and file.size > file.limit:
            raise _too_big(file.name, file.size, file.limit)
        try:
            remote = await self.bot.get_file(file.file_id)
        except (BadRequest, Forbidden) as exc:
            raise AttachmentRefused(
                f"Telegram did not give me {file.name!r} ({exc.message}), so I cannot read it"
            ) from exc
        except Exception:
            self._still_failing(file)
            raise
        if remote.file_size is not None and remote.file_size > file.limit:
            raise _too_big(file.name, remote.file_size, file.limit)
        # python-telegram-bot reads a file_path that names a file on this machine from the
        # disk (a Bot API server in --local mode): never ours to hand to a butler.
        if not str(remote.file_path or "").startswith(self.bot.base_file_url + "/"):
            logger.warning(
                "telegram: getFile for %r answered no downloadable path (a Bot API server in "
                "--local mode is not supported); refused",
                file.name,
                extra={"action": "attachment_refused"},
            )
            raise AttachmentRefused(f"Telegram did not give me {file.name!r} to download")
        try:
            async with self._downloads:
                data = bytes(await remote.download_as_bytearray())
        except (BadRequest, Forbidden, InvalidToken) as exc:  # 4xx: the file is gone
            raise AttachmentRefused(
                f"Telegram did not give me {file.name!r} ({exc.message}), so I cannot read it"
            ) from exc
        except Exception:
            self._still_failing(file)
            raise
        self._failing_files.pop(file.file_id, None)
        # Reading the type may decode megabytes of text: off the event loop.
        return await asyncio.to_thread(checked, data, file.name, max_bytes=file.limit)

    def _still_failing(self, file: _File) -> None:
        """A file Telegram has not handed over for `give_up_on_file_after_s` is refused (its
        sender asked to send it again), so that the update is acknowledged: until then every
        later message, of every chat, waits behind it (Telegram hands updates over in order).
        Before that the update is tried again, with a growing delay (`_poll`)."""
        now = time.monotonic()
        if len(self._failing_files) >= MAX_GROUPS_REMEMBERED:
            self._failing_files.clear()
        first = self._failing_files.setdefault(file.file_id, now)
        if now - first >= self.give_up_on_file_after_s:
            self._failing_files.pop(file.file_id, None)
            logger.warning(
                "telegram: %r could not be downloaded for %.0f s; the sender is asked again",
                file.name,
                now - first,
                extra={"action": "attachment_given_up"},
            )
            raise AttachmentRefused(
                f"I could not fetch {file.name!r} from Telegram for a while: please send it again"
            )

    async def may_write(self, sender: str) -> bool:
        return self.allowed(sender) or await self._paired(sender)

    async def _paired(self, chat_id: str) -> bool:
        """Whether the owner paired this chat (asked of the database each time)."""
        return self.pairing is not None and await self.pairing.is_paired(self.name, chat_id)

    async def _stranger(self, message: Message, chat_id: str) -> None:
        """A chat nobody allowed: with pairing, a private chat gets a code once
        (butlers.switchboard.pairing) and a group nothing; without pairing, one polite refusal
        per chat and process. Nothing of theirs is stored."""
        if self.pairing is not None and self.pairing.enabled:
            from butlers.switchboard.pairing import Stranger

            if message.chat.type != "private":
                self._group_refused(chat_id, message.chat.type)
                return
            await self.pairing.stranger(
                Stranger(
                    self.name,
                    chat_id,
                    _name_of(message.from_user) or message.chat.title or "",
                    reply_to=_answering(message, chat_id),
                )
            )
            return
        logger.warning("telegram: refused chat %s", chat_id, extra={"action": "refused"})
        if chat_id not in self._refused:
            self._refused.add(chat_id)
            await self._best_effort(chat_id, REFUSAL)

    def _group_refused(self, chat_id: str, chat_type: str) -> None:
        """A group (or supergroup) chat wrote with pairing on: pairing it would let in every
        member while the owner is shown one member's name, so it gets no code and no answer.
        Logged at most once an hour per chat (a busy group must not flood the log)."""
        now = time.monotonic()
        last = self._groups_logged.get(chat_id)
        if last is not None and now - last < GROUP_LOGGED_EVERY_S:
            return
        if len(self._groups_logged) >= MAX_GROUPS_REMEMBERED:
            self._groups_logged = {
                chat: at
                for chat, at in self._groups_logged.items()
                if now - at < GROUP_LOGGED_EVERY_S
            }
        self._groups_logged[chat_id] = now
        logger.warning(
            "telegram: %s chat %s is not allowed and gets no pairing code (only a private "
            "chat can be paired; add a group to allowed_chat_ids to let it in); said at most "
            "once an hour",
            chat_type,
            chat_id,
            extra={"action": "pairing_group_refused"},
        )

    async def _press(self, query: CallbackQuery) -> None:
        """A press of an approval's or a pairing's button: decided by the switchboard's
        approvals or pairing (only the owner, in their chat; only data we signed; once), always
        answered, and the request message shows the decision."""
        from butlers.switchboard.pairing import is_pairing_button

        message = query.message
        chat_id = str(message.chat.id) if message is not None else ""
        data = query.data or ""
        desk = self.pairing if is_pairing_button(data) else self.approvals
        if desk is None:
            answer, line = "Nothing to decide here.", None
        else:
            presser = str(query.from_user.id)
            decided = await desk.press(chat_id, presser, data, by=f"telegram:{presser}")
            answer, line = decided.answer, decided.decision_line
        await self.bot.answer_callback_query(query.id, text=answer)
        text = getattr(message, "text", None)
        if line is not None and message is not None and text:
            try:  # the decision stands either way
                await self.show_decided(message.chat.id, message.message_id, text, line)
            except Exception as exc:
                logger.warning("telegram: could not mark the request decided: %s", exc)

    async def show_decided(self, chat_id: str | int, message_id: int, text: str, line: str) -> None:
        """An approval's or a pairing's question says how it was decided; its buttons go.

        A Bot API that is down (no connection, a 5xx, a 429 past the rate limiter's retries)
        does not leave the buttons for good: the edit is tried again in the background, for up
        to `give_up_on_edit_after_s` (a press meanwhile is answered "Already ..."; nothing runs
        twice). Telegram refusing the edit (400: the message is gone or already says so) raises.
        """
        try:
            await self._edit(chat_id, message_id, f"{text}\n\n{line}")
        except Exception as exc:
            if not _transient(exc):
                raise
            logger.warning(
                "telegram: could not mark message %s decided (%s); trying again",
                message_id,
                exc,
                extra={"action": "telegram_edit_retry"},
            )
            task = asyncio.create_task(
                self._edit_later(chat_id, message_id, f"{text}\n\n{line}"),
                name=f"telegram:edit:{message_id}",
            )
            self._edits.add(task)
            task.add_done_callback(self._edits.discard)

    async def _edit(self, chat_id: str | int, message_id: int, text: str) -> None:
        await self.bot.edit_message_text(text, chat_id=chat_id, message_id=message_id)

    async def _edit_later(self, chat_id: str | int, message_id: int, text: str) -> None:
        until = time.monotonic() + self.give_up_on_edit_after_s
        failures = 0
        while True:
            await asyncio.sleep(self.edit_retry.delay(failures))
            try:
                await self._edit(chat_id, message_id, text)
                return
            except Exception as exc:
                failures += 1
                if _transient(exc) and time.monotonic() < until:
                    continue
                logger.warning(
                    "telegram: gave up marking message %s decided after %d tries: %s",
                    message_id,
                    failures + 1,
                    exc,
                    extra={"action": "telegram_edit_given_up"},
                )
                return

    async def _best_effort(self, chat_id: str, text: str) -> None:
        try:
            await self.send(chat_id, text)
        except Exception as exc:
            logger.warning("telegram: could not answer chat %s: %s", chat_id, exc)

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect (getMe, the webhook set or deleted): every switchboard process sends, and
        takes webhooks. Polling is the leader's (`lead`)."""
        self._task = asyncio.create_task(self._connect(), name="telegram:connect")

    async def close(self) -> None:
        await self.step_down()
        await cancel_and_wait(self._task)
        self._task = None
        for task in list(self._edits):
            await cancel_and_wait(task)
        with contextlib.suppress(Exception):
            await self.bot.shutdown()

    async def lead(self) -> None:
        """getUpdates, on one switchboard process only: Telegram allows one poller a token."""
        if self.config.mode == "polling" and self.worker is not None:
            self._poll_task = asyncio.create_task(self._poll_when_connected(), name="telegram:poll")

    async def step_down(self) -> None:
        await cancel_and_wait(self._poll_task)
        self._poll_task = None

    async def _poll_when_connected(self) -> None:
        await self._connected.wait()
        await self._poll()

    async def _connect(self) -> None:
        """initialize() calls getMe once, with no retry: retry it ourselves with backoff."""
        from telegram.error import InvalidToken

        for attempt in range(10**6):
            try:
                await self.bot.initialize()
                if self.config.mode == "polling":
                    await self.bot.delete_webhook()  # getUpdates is refused while one is set
                elif problem := self.webhook_secret_problem():
                    self.status = ModuleStatus(self.name, "failed", problem)
                    logger.error("telegram: %s", problem, extra={"action": "telegram_webhook"})
                    return
                elif self.config.webhook_url:
                    await self.bot.set_webhook(
                        url=self.config.webhook_url,
                        secret_token=self.webhook_secret,
                        allowed_updates=ALLOWED_UPDATES,
                    )
                self.status = ModuleStatus(self.name, "running", f"@{self.bot.username}")
                self._connected.set()
                return
            except InvalidToken as exc:
                # Retrying cannot help: the token is read once, at start.
                self._token_rejected(exc)
                return
            except Exception as exc:
                delay = RECONNECT.delay(attempt)
                self.status = ModuleStatus(
                    self.name, "starting", f"Bot API unreachable ({exc}); retrying"
                )
                logger.warning("telegram: Bot API unreachable (%s); retry in %ss", exc, delay)
                await asyncio.sleep(delay)

    def _token_rejected(self, exc: Exception) -> None:
        """The module is `failed`, saying so in /health and the log. Never with the
        exception's own text: python-telegram-bot's names the token."""
        described = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        said = TOKEN_REFUSALS.get(getattr(described, "message", ""), "refused")
        why = (
            f"Telegram rejected the bot token ({said}): check {self.config.token_env}, then restart"
        )
        self.status = ModuleStatus(self.name, "failed", why)
        logger.error("telegram: %s", why, extra={"action": "telegram_token_rejected"})

    async def _poll(self) -> None:
        from telegram.error import Conflict, InvalidToken

        offset: int | None = None
        failures = 0
        conflicts = 0  # 409s in a row: another process polled with this token
        retried: dict[int, int] = {}  # the update that failed to be stored: its tries
        while True:
            try:
                updates = await self.bot.get_updates(
                    offset=offset,
                    timeout=POLL_TIMEOUT_S,
                    allowed_updates=ALLOWED_UPDATES,
                )
                failures = 0
                if conflicts:
                    conflicts = 0
                    self.status = ModuleStatus(self.name, "running", f"@{self.bot.username}")
                    logger.info("telegram: polling again, no other poller now")
            except InvalidToken as exc:  # revoked while running: polling cannot go on
                self._token_rejected(exc)
                return
            except Conflict as exc:
                # Another process polls with this token (Telegram allows one poller per token,
                # and answers the other 409): for a moment while switchboard replicas hand
                # over, for good while a second fleet or a script uses the token. Tried again
                # soon: a 60 s wait after one 409 left no replica polling for a minute, and
                # the module `failed` for good (a walkthrough). `failed` once it lasts.
                delay = RECONNECT.delay(conflicts)
                conflicts += 1
                if conflicts == CONFLICTS_BEFORE_FAILED:
                    self.status = ModuleStatus(
                        self.name, "failed", f"another poller is running: {exc}"
                    )
                    logger.error(
                        "telegram: %s (another process uses this bot's token); still trying",
                        self.status.detail,
                        extra={"action": "telegram_conflict"},
                    )
                elif conflicts == 1:
                    logger.warning(
                        "telegram: another poller took getUpdates (%s); retry in %ss",
                        exc,
                        delay,
                        extra={"action": "telegram_conflict"},
                    )
                await asyncio.sleep(delay)
                continue
            except Exception as exc:
                delay = RECONNECT.delay(failures)
                failures += 1
                logger.warning("telegram: getUpdates failed (%s); retry in %ss", exc, delay)
                await asyncio.sleep(delay)
                continue
            for index, update in enumerate(updates):
                try:
                    await self.handle_update(
                        update, album_more=self._album_goes_on(update, updates[index + 1 :])
                    )
                except Exception:
                    # Not stored: do not acknowledge it; the next poll fetches it again, after
                    # a delay that grows while the same update keeps failing.
                    tries = retried.get(update.update_id, 0)
                    retried = {update.update_id: tries + 1}
                    await asyncio.sleep(RECONNECT.delay(tries))
                    break
                offset = update.update_id + 1


def _transient(exc: Exception) -> bool:
    """A Bot API that is down or busy (worth trying again), not one refusing the request."""
    from telegram.error import BadRequest, NetworkError, RetryAfter

    return isinstance(exc, RetryAfter) or (
        isinstance(exc, NetworkError) and not isinstance(exc, BadRequest)
    )


def _forwarded_from(message: Message) -> str | None:
    """Who wrote a forwarded message (as Telegram names them: their name, a hidden user's
    name, a chat's or channel's title), or None for one the sender wrote. Forwarded, a
    stranger's words reached a butler as the owner's own."""
    from telegram import (
        MessageOriginChannel,
        MessageOriginChat,
        MessageOriginHiddenUser,
        MessageOriginUser,
    )

    origin = message.forward_origin
    if origin is None:
        return None
    if isinstance(origin, MessageOriginUser):
        name = origin.sender_user.full_name
    elif isinstance(origin, MessageOriginHiddenUser):
        name = origin.sender_user_name
    elif isinstance(origin, MessageOriginChat):
        name = origin.sender_chat.effective_name or ""
    elif isinstance(origin, MessageOriginChannel):
        name = origin.chat.effective_name or ""
    else:
        name = ""
    return printable(name, 80) or "someone"


# Why a file of a sender over max_messages_per_sender_per_hour was not fetched.
OVER_LIMIT = "a file: over the hourly limit of messages, so it was not fetched"


def _noting(incoming: IncomingMessage, why: str) -> IncomingMessage:
    """A message whose file was not read: its caption, and a line saying which and why."""
    return replace(incoming, text=f"{incoming.text}\n\n[not read: {why}]".strip())


def _kind_of(message: Message) -> str:
    """What a message carries that is not read, in a few words."""
    for attribute, kind in (
        ("video", "a video"),
        ("video_note", "a video note"),
        ("animation", "an animation"),
        ("sticker", "a sticker"),
        ("location", "a location"),
        ("contact", "a contact"),
        ("poll", "a poll"),
    ):
        if getattr(message, attribute, None):
            return kind
    return "a file"
