"""Pairing: an unknown sender gets a one-time code, and the owner decides (`[switchboard.pairing]`).

With pairing enabled, a Telegram chat or mail sender that is neither in the TOML allowlist
(`allowed_chat_ids`, `allowed_senders`) nor paired is answered once with a short code and a
sentence saying the owner must approve it; nothing they write is stored or routed (the message
that asked need not be: once paired, their next one is). The owner is told on their preferred
channel (on Telegram with signed Approve / Deny buttons) and decides with a button,
`butlers pairing approve|deny CODE` or the dashboard; an approved sender is a `paired_senders`
row, and `butlers pairing revoke CHANNEL SENDER` makes them a stranger again.

A flood of strangers (senders and their names are theirs to choose) is bounded:

- a sender is answered at most once an hour (a denied one not for DENIED_QUIET_DAYS), whatever
  they send meanwhile; a redelivered update or mail changes nothing;
- each channel holds at most `max_pending_per_channel` pending codes: past it a stranger gets
  no code and no answer, and a pending code is never evicted for a newcomer (it expires after
  `code_ttl_minutes`, or the owner decides it); rows that can no longer matter are deleted as
  new ones come, so the table stays small;
- so the bot sends at most one message per stranger an hour, and the owner at most the cap of
  questions in flight per channel, and, while strangers find it full, one message an hour
  saying so (a flood that keeps the cap full is not silent).

Only a private Telegram chat gets a code: pairing a group would let in every member (and every
later one) while the owner is shown one member's name. A sender is shown to the owner first,
cleaned, and their self-chosen name after it, quoted ('calls themselves "..."'), so that a
name cannot pass for an address or chat id; a sender that cleaning would change (control,
invisible or direction characters) gets no code at all.

Codes come from `secrets` (8 characters of an alphabet without look-alikes: ~40 bits), are
looked up by their SHA-256 (no comparison of the code itself to leak timing), expire, and are
taken once (a conditional UPDATE). Wrong codes are limited across all switchboard processes:
after MAX_WRONG_CODES_PER_HOUR in an hour every code is refused until the oldest is an hour
old. Telegram buttons are HMAC-signed like the approvals' (the same key, another purpose
string) and count only when the owner presses them in their own chat (`owner_pressed`). The
operator's tools refuse classification sessions and every butler session (a stranger's text
must not approve itself).

Whether a sender is paired is asked of the database for each message from a sender the TOML
does not allow (one primary-key lookup, no cache): a decision on one switchboard process holds
on every other at once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from zoneinfo import ZoneInfo

import asyncpg
from fastmcp import FastMCP

from butlers.channels import channel_names, spec_of
from butlers.config import OwnerConfig, PairingConfig
from butlers.core_store import CoreStore, storable
from butlers.switchboard import queries as sql
from butlers.switchboard.approvals import (
    CHAT_NO,
    CHAT_YES,
    MAC_BYTES,
    NO_WORDS,
    POLITELY,
    YES_WORDS,
    PressAnswer,
    _refuse_sessions_and_classifiers,
    owner_pressed,
    show_decided,
    tell_by_mail,
)
from butlers.switchboard.inbox import InboxMessage
from butlers.switchboard.outbox import OutboxSender, Outgoing
from butlers.text import answer_line, printable

if TYPE_CHECKING:
    from butlers.modules.mail_parse import MailThread
from butlers.tool_errors import ToolRefusal

logger = logging.getLogger(__name__)

# The owner's answer by mail, alone on the first line (`answer_line`): "approve", "Deny.",
# "yes ABCD-2345" (a code given must be that question's).
# ("No, thanks." too, as an approval's: routed to a butler, it decided nothing, a review.)
_CODE_GIVEN = r"(?: ([A-Za-z0-9]{4}-?[A-Za-z0-9]{4}))?"
_MAIL_PAIRING_ANSWER = re.compile(
    rf"(approve|deny|{'|'.join(YES_WORDS + NO_WORDS)}){_CODE_GIVEN}{POLITELY}", re.IGNORECASE
)
# In a chat, its everyday words too ("ok", a thumbs-up), as an approval's.
_CHAT_PAIRING_ANSWER = re.compile(
    rf"({'|'.join(map(re.escape, (*CHAT_YES, *CHAT_NO)))}){_CODE_GIVEN}{POLITELY}", re.IGNORECASE
)


def _title(channel: str) -> str:
    spec = spec_of(channel)
    return spec.title if spec is not None else channel


def _has_buttons(channel: str) -> bool:
    spec = spec_of(channel)
    return spec is not None and spec.buttons


DECISIONS = {"approve": "approved", "deny": "denied"}
CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"  # no I, L, O, 0, 1: read aloud safely
CODE_LENGTH = 8
_CODE = re.compile(f"[{CODE_ALPHABET}]{{{CODE_LENGTH}}}")
_CODE_SEPARATORS = re.compile(r"[\s-]+")
ANSWER_EVERY_S = 3600  # a sender is answered at most this often
# The subject of the mail that tells a stranger they were let in (they wrote first).
APPROVED_SUBJECT = "Re: your message to a private butler: approved"
DENIED_QUIET_DAYS = 7  # a denied sender gets no new code (nor the owner a question) this long
MAX_WRONG_CODES_PER_HOUR = 10  # across the switchboard (every process), then all refused
NAME_CHARS = 64  # of a sender's name, as shown to the owner
SENDER_CHARS = 320  # an address's longest; a chat id is far shorter
MAX_PAIRED_LISTED = 500
# Telegram allows 64 bytes of callback data: "p", a letter, the id, a dot, 16 bytes of MAC.
_LETTER = {"approved": "a", "denied": "d"}
_CALLBACK = re.compile(r"p([ad])([1-9][0-9]{0,17})\.([A-Za-z0-9_-]{22})")


def new_code() -> str:
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def normal_code(typed: str) -> str:
    """A code as typed (any case, with spaces or dashes) as it is stored; ToolRefusal when it
    cannot be one."""
    code = _CODE_SEPARATORS.sub("", typed[: CODE_LENGTH * 4]).upper()
    if not _CODE.fullmatch(code):
        raise ToolRefusal(
            f"a pairing code is {CODE_LENGTH} letters and digits as sent to the sender, "
            f"never I, L, O, 0 or 1; got {clean_name(typed)!r}"
        )
    return code


def digest(code: str) -> bytes:
    return hashlib.sha256(f"pairing-code:{code}".encode()).digest()


def clean_name(name: str | None, limit: int = NAME_CHARS) -> str:
    """A name a stranger chose, safe to show (butlers.text.printable), cut to `limit`."""
    return printable(name, limit)


def sign(secret: bytes, pairing_id: int, status: str) -> str:
    """The callback data of the owner's button that sets pairing `pairing_id` to `status`."""
    message = f"pairing:{pairing_id}:{status}".encode()
    mac = hmac.new(secret, message, hashlib.sha256).digest()
    tag = base64.urlsafe_b64encode(mac[:MAC_BYTES]).rstrip(b"=").decode()
    return f"p{_LETTER[status]}{pairing_id}.{tag}"


def verify(secret: bytes, data: str) -> tuple[int, str] | None:
    """(pairing id, status) a button's data was signed for; None when not signed by us."""
    match = _CALLBACK.fullmatch(data)
    if match is None:
        return None
    status = "approved" if match[1] == "a" else "denied"
    pairing_id = int(match[2])
    if not hmac.compare_digest(sign(secret, pairing_id, status), data):
        return None
    return pairing_id, status


def is_pairing_button(data: str) -> bool:
    """Whether a button press is for pairing (else it is an approval's)."""
    return data.startswith("p")


@dataclass(frozen=True)
class Stranger:
    """A sender neither the TOML nor the database allows, as their channel saw them."""

    channel: str  # telegram | email
    sender: str  # the chat id, the address (lower case)
    name: str  # what they call themselves: hostile, cleaned before it is shown
    reply_to: InboxMessage | None = None  # their message, for the channel to answer it


def minutes(count: int) -> str:
    return f"{count} minute" if count == 1 else f"{count} minutes"


def describe_sender(row: dict[str, Any]) -> str:
    """Who a pairing row is about, as the owner reads it: first the sender (the address or
    chat id), then what they call themselves, quoted. A name is the stranger's to choose and
    could otherwise pass for a sender ("Mom <mom@family.example>", "Anna (@anna)"); both are
    cleaned (`clean_name`), so neither brings line breaks or direction overrides."""
    sender = clean_name(row["sender"], SENDER_CHARS)
    spec = spec_of(row["channel"])
    who = spec.sender_label(sender) if spec is not None else sender
    name = clean_name(row.get("name")).replace('"', "'")  # it cannot close its own quotes
    return f'{who} (calls themselves "{name}")' if name else who


class PairingStore:
    """Pairing in the switchboard's database (its statements: butlers.switchboard.queries,
    PAIRING_*)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        # "Told the owner this hour" (the core table limit_notices, in this database too).
        self.notices = CoreStore(pool)

    async def is_paired(self, channel: str, sender: str) -> bool:
        found = await self.pool.fetchval(sql.PAIRING_IS_PAIRED, channel, storable(sender))
        return found is not None

    async def expire(self, conn: Any, channel: str | None = None) -> None:
        await conn.execute(sql.PAIRING_EXPIRE, channel)

    async def prune(self, conn: Any, channel: str) -> None:
        """Rows that no longer decide anything: answered over an hour ago and not pending,
        except a denial, which keeps its sender quiet for DENIED_QUIET_DAYS."""
        await conn.execute(
            sql.PAIRING_PRUNE,
            channel,
            float(ANSWER_EVERY_S),
            DENIED_QUIET_DAYS,
        )

    async def answered_recently(self, conn: Any, channel: str, sender: str) -> bool:
        """Whether the sender holds a code still valid (`expire` ran first), got one within
        the hour, or was denied within DENIED_QUIET_DAYS."""
        return bool(
            await conn.fetchval(
                sql.PAIRING_ANSWERED_RECENTLY,
                channel,
                sender,
                float(ANSWER_EVERY_S),
                DENIED_QUIET_DAYS,
            )
        )

    async def pending_count(self, conn: Any, channel: str) -> int:
        return int(await conn.fetchval(sql.PAIRING_PENDING_COUNT, channel))

    async def create(self, conn: Any, stranger: Stranger, ttl_minutes: int) -> dict[str, Any]:
        """A new pending code for `stranger`. A code that collides with a kept one (one in
        ~10^12 per pair) is drawn again."""
        for attempt in range(3):
            code = new_code()
            try:
                async with conn.transaction():  # a savepoint: a collision undoes only this
                    row = await conn.fetchrow(
                        sql.PAIRING_CREATE,
                        stranger.channel,
                        stranger.sender,
                        stranger.name,
                        code,
                        digest(code),
                        ttl_minutes,
                    )
            except asyncpg.UniqueViolationError as exc:
                if exc.constraint_name != "pairing_requests_code" or attempt == 2:
                    raise
                continue
            assert row is not None
            return dict(row)
        raise AssertionError("unreachable")

    async def decide(
        self,
        conn: Any,
        key: Literal["code_digest", "id"],
        value: bytes | int,
        status: str,
        by: str,
    ) -> dict[str, Any] | None:
        """Decide the request whose `key` (its code's digest, typed; its id, from a button) is
        `value`, if it is still pending and valid: one conditional UPDATE, so a code is taken
        once, however the owner decides and however often."""
        row = await conn.fetchrow(
            sql.PAIRING_DECIDE_BY_ID if key == "id" else sql.PAIRING_DECIDE_BY_DIGEST,
            value,
            status,
            storable(by),
        )
        return dict(row) if row is not None else None

    async def by_digest(self, conn: Any, code_digest: bytes) -> dict[str, Any] | None:
        row = await conn.fetchrow(sql.PAIRING_BY_DIGEST, code_digest)
        return dict(row) if row is not None else None

    async def get(self, pairing_id: int) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(sql.PAIRING_GET, pairing_id)
        return dict(row) if row is not None else None

    async def pair(self, conn: Any, row: dict[str, Any], by: str) -> None:
        await conn.execute(
            sql.PAIRING_PAIR,
            row["channel"],
            row["sender"],
            row["name"],
            storable(by),
        )

    async def unpair(self, channel: str, sender: str) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(sql.PAIRING_UNPAIR, channel, storable(sender))
        return dict(row) if row is not None else None

    async def wrong_codes(self, conn: Any) -> tuple[int, Any]:
        """The wrong codes of the last hour, and when the oldest of them stops counting."""
        await conn.execute(sql.PAIRING_FORGET_WRONG_CODES)
        row = await conn.fetchrow(sql.PAIRING_WRONG_CODES)
        return int(row["n"]), row["until"]

    async def wrong_code(self, conn: Any, by: str) -> None:
        await conn.execute(sql.PAIRING_WRONG_CODE, storable(by))

    async def pending(self) -> list[dict[str, Any]]:
        async with self.pool.acquire() as conn:
            await self.expire(conn)
            rows = await conn.fetch(sql.PAIRING_PENDING)
        return [dict(r) for r in rows]

    async def paired(self) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(sql.PAIRING_PAIRED, MAX_PAIRED_LISTED)
        return [dict(r) for r in rows]

    async def asked_in(self, channel: str, owner: str, sent_ids: list[str]) -> int | None:
        """The pairing whose question to `owner` on `channel` was one of `sent_ids` (a mail's
        Message-IDs, a chat's message ids)."""
        found: int | None = await self.pool.fetchval(sql.PAIRING_ASKED_IN, sent_ids, owner, channel)
        return found

    async def owner_questions(self, pairing_id: int) -> list[dict[str, Any]]:
        """The owner's Telegram question(s) with buttons for this code, as sent."""
        rows = await self.pool.fetch(sql.PAIRING_OWNER_QUESTIONS, pairing_id)
        return [dict(r) for r in rows]


class PairingDesk:
    """Gives strangers codes, tells the owner, takes decisions; asked by the channel modules
    whether a sender is paired."""

    def __init__(
        self,
        store: PairingStore,
        *,
        config: PairingConfig,
        owner: OwnerConfig,
        outbox: OutboxSender,
        secret: Callable[[], Awaitable[bytes]],
    ) -> None:
        self.store = store
        self.config = config
        self.owner = owner
        self.outbox = outbox
        self.secret = secret  # the buttons' signing key (the approvals')

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    async def is_paired(self, channel: str, sender: str) -> bool:
        """Whether the owner paired this sender (the TOML allowlists are the channel's to
        check first). Asked of the database every time: every process sees a decision."""
        return await self.store.is_paired(channel, sender)

    # -- a stranger writes ------------------------------------------------------------------

    async def stranger(self, stranger: Stranger) -> bool:
        """A message from `stranger`: answered with a new code (and the owner asked) unless
        they were answered within the hour or the channel's pending codes are at the cap.
        True when a code was given. The answer and the question are queued in the transaction
        that records the code: a crash leaves neither or both."""
        if not self.enabled:
            return False
        sender = storable(stranger.sender[:SENDER_CHARS]) or ""
        if not sender or clean_name(sender, SENDER_CHARS) != sender:
            # Shown cleaned, it would not be the sender the owner approves; stored, it would
            # reach every place a sender is shown. No address of a person looks like this.
            logger.warning(
                "pairing: %s sender %a has control, invisible or direction characters: no code",
                stranger.channel,
                sender,
                extra={"action": "pairing_sender_refused"},
            )
            return False
        stranger = Stranger(stranger.channel, sender, clean_name(stranger.name), stranger.reply_to)
        full = False
        async with self.store.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.PAIRING_CHANNEL_LOCK, stranger.channel)
            await self.store.expire(conn, stranger.channel)
            await self.store.prune(conn, stranger.channel)
            if await self.store.answered_recently(conn, stranger.channel, stranger.sender):
                logger.info(
                    "pairing: %s %s was answered within the hour: not again",
                    stranger.channel,
                    stranger.sender,
                    extra={"action": "pairing_quiet"},
                )
                return False
            cap = self.config.max_pending_per_channel
            full = await self.store.pending_count(conn, stranger.channel) >= cap
            if full:
                logger.info(
                    "pairing: %d codes pending on %s (max_pending_per_channel): %s gets none",
                    cap,
                    stranger.channel,
                    stranger.sender,
                    extra={"action": "pairing_full"},
                )
            else:
                row = await self.store.create(conn, stranger, self.config.code_ttl_minutes)
                outgoing = self._code_for(stranger, row) + await self._owner_question(row)
                await self.outbox.store.add(conn, outgoing, None)
        if full:
            await self._tell_owner_full(stranger.channel, cap)
            return False
        self.outbox.wake()
        logger.info(
            "pairing: a code went to %s %s; the owner decides",
            stranger.channel,
            stranger.sender,
            extra={"action": "pairing_code"},
        )
        return True

    def _code_for(self, stranger: Stranger, row: dict[str, Any]) -> list[Outgoing]:
        channel = self.outbox.channels.get(stranger.channel)
        if channel is None:
            return []
        text = (
            "This is a private butler: it answers only people its owner approved. "
            f"Your pairing code is {row['code']}. The owner must approve it (within "
            f"{minutes(self.config.code_ttl_minutes)}); once they have, write again."
        )
        chunks = channel.prepare(text, reply_to=stranger.reply_to, butler=None)
        return [
            Outgoing(
                kind="pairing",
                channel=stranger.channel,
                recipient=stranger.sender,
                text=chunk,
                meta={**meta, "pairing_id": row["id"]},
            )
            for chunk, meta in chunks
        ]

    def _owner_channel(self, about: str) -> tuple[str, str] | None:
        """(channel, recipient): the owner's preferred channel that runs here; None, logged
        as what they were not told `about`, when none does (they use `butlers pairing`)."""
        reachable = [c for c in self.owner.channels() if c[0] in self.outbox.channels]
        if not reachable:
            logger.warning(
                "pairing: the owner cannot be told of %s (no [switchboard.owner] channel runs "
                "here); see `butlers pairing`",
                about,
                extra={"action": "pairing_owner_not_told"},
            )
            return None
        return reachable[0]

    async def _tell_owner_full(self, channel: str, cap: int) -> None:
        """A stranger got no code because `channel`'s pending codes are at the cap: the owner
        is told, at most once an hour (across processes: `limit_notices`), instead of a flood
        passing in silence while it keeps the cap full. Best effort: the cap holds anyway."""
        try:
            if not await self.store.notices.claim_notice(f"pairing_full:{channel}", "hour"):
                return
            owner = self._owner_channel(f"the full pairing cap on {channel}")
            if owner is None:
                return
            where = _title(channel)
            text = (
                f"More strangers wrote by {where} than pairing takes: {cap} codes are pending "
                f"(max_pending_per_channel), so newcomers get no code and you no question, "
                f"until you approve or deny the pending ones (`butlers pairing`) or they "
                "expire. You are told this at most once an hour."
            )
            chunks = self.outbox.channels[owner[0]].prepare(
                text, reply_to=None, butler=None, subject="Pairing: more strangers than codes"
            )
            outgoing = [
                Outgoing(kind="pairing", channel=owner[0], recipient=owner[1], text=t, meta=m)
                for t, m in chunks
            ]
            async with self.store.pool.acquire() as conn:
                await self.outbox.store.add(conn, outgoing, None)
        except Exception as exc:
            logger.warning(
                "pairing: the owner could not be told that %s is full: %s",
                channel,
                exc,
                extra={"action": "pairing_owner_not_told"},
            )
            return
        self.outbox.wake()

    async def _owner_question(self, row: dict[str, Any]) -> list[Outgoing]:
        """The owner's question on their preferred channel that runs here (none: they use
        `butlers pairing`)."""
        owner = self._owner_channel(f"{row['channel']} {row['sender']}")
        if owner is None:
            return []
        channel, recipient = owner
        code = row["code"]
        # In the owner's own time zone ([switchboard.owner] timezone, checked when read).
        expires = row["expires_at"].astimezone(ZoneInfo(self.owner.timezone))
        until = expires.strftime("%Y-%m-%d %H:%M %Z")
        where = _title(row["channel"])
        buttons = _has_buttons(channel)
        text = (
            f"{describe_sender(row)} wants to talk to your butlers by {where}. "
            f"Pairing code: {code} (valid until {until}).\n\n"
        )
        # Plain text: a chat shows no markup (backticks came out as they are).
        if buttons:
            text += (
                f"Approve or deny it here, or run: butlers pairing approve {code} (or deny {code})."
            )
        elif channel == "email":
            text += (
                'Reply to this mail with "approve" or "deny" on its first line, or run: '
                f"butlers pairing approve {code} (or deny {code})."
            )
        else:
            text += f"To let them in, run: butlers pairing approve {code} (or deny {code})."
        chunks = self.outbox.channels[channel].prepare(
            text, reply_to=None, butler=None, subject=f"Pairing code {code}: someone new wrote"
        )
        if buttons:
            secret = await self.secret()
            keyboard = [
                [
                    {"text": "Approve", "callback_data": sign(secret, row["id"], "approved")},
                    {"text": "Deny", "callback_data": sign(secret, row["id"], "denied")},
                ]
            ]
            last, meta = chunks[-1]
            chunks[-1] = (last, {**meta, "inline_keyboard": keyboard})
        return [
            Outgoing(
                kind="pairing",
                channel=channel,
                recipient=recipient,
                text=t,
                meta={**m, "pairing_id": row["id"]},
            )
            for t, m in chunks
        ]

    # -- the owner decides ------------------------------------------------------------------

    async def decide(self, typed_code: str, decision: str, *, by: str) -> dict[str, Any]:
        """Approve or deny the pending code `typed_code`, once. ToolRefusal for a code that is
        wrong (counted against MAX_WRONG_CODES_PER_HOUR), expired or used, and for any code
        while that many wrong ones were tried within the hour."""
        status = DECISIONS.get(decision)
        if status is None:
            raise ToolRefusal(f"decision must be approve or deny, got {clean_name(decision)!r}")
        code = normal_code(typed_code)
        code_digest = digest(code)
        refusal: str | None = None
        row: dict[str, Any] | None = None
        async with self.store.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.PAIRING_ATTEMPTS_LOCK)
            wrong, until = await self.store.wrong_codes(conn)
            if wrong >= MAX_WRONG_CODES_PER_HOUR:
                refusal = (
                    f"{wrong} wrong pairing codes were tried within the hour, the limit: no "
                    f"code is taken until {until:%Y-%m-%d %H:%M:%S} UTC"
                )
            else:
                row = await self.store.decide(conn, "code_digest", code_digest, status, by)
                if row is None:
                    known = await self.store.by_digest(conn, code_digest)
                    if known is None:  # a guess; a real code decided or expired is none (a
                        # second "approve" of it counted as a wrong code: a walkthrough)
                        await self.store.wrong_code(conn, by)
                        wrong += 1
                    refusal = _why_not(code, known, wrong)
                else:
                    await self._decided(conn, row, by)
        if refusal is not None or row is None:
            raise ToolRefusal(refusal or "not decided", log_level=logging.WARNING)
        return await self._after(row, f"{status.capitalize()} ({by}).")

    async def mail_answer(
        self, sender: str, parent: str | None, text: str, *, answering: MailThread | None = None
    ) -> bool:
        """The owner's answer by mail to a pairing question: "approve" or "deny" (or "yes",
        "no", with the code or not) alone on the first line, from the owner's address, in
        reply to that question's mail itself (`parent`, which names the pairing). True when
        it was one (not a message to route); anything else is an ordinary message. An
        email-only owner away from a shell could not let anyone in (a walkthrough)."""
        owner = self.owner.email.lower()
        if not owner or sender.lower() != owner:
            return False
        # The question mail itself, not one further up the thread (a red team: a "yes" to
        # the butler's "Should I block them?" below the question paired them).
        said = await self._answer("email", owner, [parent] if parent else [], text, sender)
        if said is None:
            return False
        await tell_by_mail(self.outbox, self.store.pool, owner, answering, said, kind="pairing")
        return True

    async def asked_in_chat(self, chat_id: str, message_id: int) -> bool:
        """Whether the message `message_id` in the owner's chat asked about a pairing."""
        if chat_id != self.owner.telegram_chat_id:
            return False
        return await self.store.asked_in("telegram", chat_id, [str(message_id)]) is not None

    async def chat_answer(
        self, chat_id: str, user_id: str, replied_to: int | None, text: str
    ) -> str | None:
        """The owner's words in their chat in reply to a pairing question ("approve",
        "deny", "yes", "no", with the code or not), decided as its buttons would be (as an
        approval's: a typed "approve" was routed to a butler). What to tell the owner, or
        None when it is no such answer (an ordinary message)."""
        if replied_to is None or not owner_pressed(self.owner, chat_id, user_id):
            return None
        return await self._answer("telegram", chat_id, [str(replied_to)], text, user_id)

    async def _answer(
        self, channel: str, owner: str, asked_in: list[str], text: str, sender: str
    ) -> str | None:
        """The owner's answer on `channel` to the question that was one of `asked_in`:
        decided, and what to tell them (what it did, or why it did nothing); None when
        `text` is no answer to a pairing question."""
        if channel == "email":  # its first line, above the quote and the signature
            line, alone = answer_line(text)
            match = _MAIL_PAIRING_ANSWER.fullmatch(line) if alone else None
        else:  # a chat's whole message ("ok\n> no, not him" is no answer: a review)
            match = _CHAT_PAIRING_ANSWER.fullmatch(" ".join(text.split()))
        if match is None:
            return None
        pairing_id = await self.store.asked_in(channel, owner, asked_in)
        if pairing_id is None:
            return None
        if match[2] is not None:  # a code given: that question's, or no answer ("no problem")
            asked = await self.store.get(pairing_id)
            if asked is None or _CODE_SEPARATORS.sub("", match[2]).upper() != asked["code"]:
                return None
        status = "approved" if match[1].casefold() in ("approve", *CHAT_YES) else "denied"
        by = f"{channel}:{sender}"
        async with self.store.pool.acquire() as conn, conn.transaction():
            row = await self.store.decide(conn, "id", pairing_id, status, by)
            if row is not None:
                await self._decided(conn, row, by)
        if row is None:
            logger.info(
                "pairing #%s: an answer to a code already decided or expired",
                pairing_id,
                extra={"action": "pairing_answer_late"},
            )
            current = await self.store.get(pairing_id)
            if current is None:
                return "That pairing code is gone: your answer changed nothing."
            if current["status"] in ("pending", "expired"):  # pending: past its time
                return (
                    f"The code of {describe_sender(current)} expired before your answer: it "
                    "changed nothing. They get a new one if they write again."
                )
            return (
                f"{describe_sender(current)} was {current['status']} already: your answer "
                "changed nothing (`butlers pairing` shows them; `butlers pairing revoke "
                "CHANNEL SENDER` takes an approval back)."
            )
        await self._after(row, f"{status.capitalize()} ({by}).")
        if status == "approved":
            return f"Approved: {describe_sender(row)} may write now (they were told)."
        return f"Denied: {describe_sender(row)} gets no answer and no new code."

    async def press(self, chat_id: str, user_id: str, data: str, *, by: str) -> PressAnswer:
        """A Telegram button press (in chat `chat_id`, by user `user_id`): counted only when
        the owner pressed it in their chat (`owner_pressed`), with data we signed."""
        if not owner_pressed(self.owner, chat_id, user_id):
            logger.warning(
                "pairing button pressed in chat %s by user %s, not the owner: ignored",
                chat_id,
                user_id,
                extra={"action": "pairing_press_refused"},
            )
            return PressAnswer("Only the owner can decide this.", None)
        signed = verify(await self.secret(), data)
        if signed is None:
            logger.warning(
                "pairing button with data we did not sign: ignored",
                extra={"action": "pairing_press_refused"},
            )
            return PressAnswer("This button is not valid.", None)
        pairing_id, status = signed
        async with self.store.pool.acquire() as conn, conn.transaction():
            row = await self.store.decide(conn, "id", pairing_id, status, by)
            if row is not None:
                await self._decided(conn, row, by)
        if row is None:
            current = await self.store.get(pairing_id)
            said = current["status"] if current is not None else "gone"
            if said == "pending":  # pending, but past its time: the sweep has not marked it
                said = "expired"
            return PressAnswer(f"Already {said}: nothing changed.", None)
        await self._after(row, None)
        verb = "Approved" if status == "approved" else "Denied"
        return PressAnswer(f"{verb}: {describe_sender(row)}.", f"{verb} by the owner.")

    async def _decided(self, conn: Any, row: dict[str, Any], by: str) -> None:
        """In the deciding transaction: an approved sender is paired and told so."""
        if row["status"] != "approved":
            return
        await self.store.pair(conn, row, by)
        channel = self.outbox.channels.get(row["channel"])
        if channel is None:
            return
        text = "The owner approved you: write again, and the butlers here will answer."
        chunks = channel.prepare(text, reply_to=None, butler=None, subject=APPROVED_SUBJECT)
        await self.outbox.store.add(
            conn,
            [
                Outgoing(
                    kind="pairing",
                    channel=row["channel"],
                    recipient=row["sender"],
                    text=chunk,
                    meta={**meta, "pairing_id": row["id"]},
                )
                for chunk, meta in chunks
            ],
            None,
        )

    async def _after(self, row: dict[str, Any], line: str | None) -> dict[str, Any]:
        """Once decided: the outbox woken, the owner's question marked (`line`; None: the
        press edits its own message), the decision logged; what a tool answers."""
        self.outbox.wake()
        if line is not None:
            await self._show_decision(row, line)
        logger.info(
            "pairing: %s %s %s by %s",
            row["channel"],
            row["sender"],
            row["status"],
            row["decided_by"],
            extra={"action": "pairing_decided"},
        )
        return {**public(row), "changed": True}

    async def _show_decision(self, row: dict[str, Any], line: str) -> None:
        await show_decided(
            self.outbox,
            lambda: self.store.owner_questions(row["id"]),
            line,
            f"pairing #{row['id']}",
        )

    async def revoke(self, channel: str, sender: str) -> dict[str, Any]:
        """Remove a paired sender: a stranger again (those in the TOML stay allowed)."""
        channel = channel.strip().lower()  # as `butlers pairing` lists it, whatever the case
        spec = spec_of(channel)
        if spec is None:
            raise ToolRefusal(
                f"channel must be one of {', '.join(channel_names())}, got {clean_name(channel)!r}"
            )
        sender = spec.same_sender(sender)
        removed = await self.store.unpair(channel, sender)
        if removed is None:
            raise ToolRefusal(
                f"{clean_name(sender, SENDER_CHARS)!r} is not a paired {channel} sender (see "
                "`butlers pairing`; the butler.toml's allowlists are changed there)"
            )
        logger.info("pairing: %s %s revoked", channel, sender, extra={"action": "pairing_revoked"})
        return {**removed, "revoked": True}

    async def listing(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "pending": [public(row) for row in await self.store.pending()],
            "paired": await self.store.paired(),
        }


def _why_not(code: str, known: dict[str, Any] | None, wrong: int) -> str:
    counted = f"({wrong} of {MAX_WRONG_CODES_PER_HOUR} wrong codes an hour)"
    if known is None:
        return f"no pairing code {code}: check it against `butlers pairing` {counted}"
    if known["status"] in ("pending", "expired"):  # pending: past its time, not yet marked
        return f"pairing code {code} expired: the sender gets a new one if they write again"
    return f"pairing code {code} was {known['status']} already: nothing changed"


def public(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "code_digest"}


def register_pairing_tools(mcp: FastMCP, desk: PairingDesk) -> None:
    """pairing_list, pairing_decide and pairing_revoke: the operator's (`butlers pairing`).
    Never a classification session's nor any butler session's."""

    @mcp.tool
    async def pairing_list() -> dict[str, Any]:
        """Pending pairing codes (channel, sender, name, code, expiry) and paired senders."""
        _refuse_sessions_and_classifiers("pairing_list")
        return await desk.listing()

    @mcp.tool
    async def pairing_decide(code: str, decision: str) -> dict[str, Any]:
        """Approve or deny (`decision`) the pending pairing `code`, as the owner; approve
        pairs its sender, whose next message is routed. Wrong codes are limited (10 an
        hour)."""
        _refuse_sessions_and_classifiers("pairing_decide")
        return await desk.decide(code, decision, by="operator")

    @mcp.tool
    async def pairing_revoke(channel: str, sender: str) -> dict[str, Any]:
        """Remove a paired sender (`channel`: telegram | email): unknown again."""
        _refuse_sessions_and_classifiers("pairing_revoke")
        return await desk.revoke(channel, sender)
