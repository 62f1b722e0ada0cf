"""Approvals on the switchboard: the owner's yes before a butler runs a call they chose to
guard (`[approvals] tools`, a tool server's `approval` globs).

A butler's gate (butlers.approvals) does not run such a call: it hands it here
(`approval_request`), where it becomes an `approvals` row with its exact arguments, the
butler, the session and the conversation it served, and the owner is asked on their
preferred channel through the outbox (on Telegram with Approve / Deny buttons). The session
gets "waiting for the owner's approval (#12)" at once and ends.

A decision (a button, `butlers approvals approve|deny ID`) changes a `pending` row in one
conditional UPDATE, so of two presses, two replicas or a press and the CLI exactly one
decides. An approved call is then run by its butler (`approval_execute`), which takes the
stored call with `approval_claim`: that sets `claimed_at` once, so the call runs at most
once whoever asks, and a butler runs only what the owner approved, whatever a caller of
`approval_execute` says. The result is recorded (`done` / `failed`) and sent, in a few words,
to the conversation the request came from (else to the owner); a denial and an expiry are
told there too.

Buttons are trusted only when they are the owner's: a press counts only in the owner's chat
and by the owner (`owner_pressed`: a group's members share its chat), with callback data
signed by HMAC-SHA256 under a secret kept in this database (`approval_keys`) and bound to the
approval's id and the decision; anything else changes nothing and is answered as such.

The leader sweeps every `check_interval_s`: overdue pending rows become `expired`, and
approved calls nobody took (their butler was down when the owner pressed) are run again.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

import asyncpg
from fastmcp import FastMCP
from opentelemetry.trace import Tracer

from butlers.channels import spec_of
from butlers.config import APPROVAL_EXECUTE_TOOL, OwnerConfig
from butlers.core_store import storable, storable_json
from butlers.errors import NotifyRefused, RouteError, TargetDown
from butlers.mcp_middleware import classification_claim
from butlers.memory import person_of
from butlers.spawner import SESSION_HEADER
from butlers.switchboard import queries as sql
from butlers.switchboard.conversation import is_owners
from butlers.switchboard.deliver import NotificationDesk
from butlers.switchboard.handoff import MAX_SENDER_NAME_CHARS, MAX_WHO_CHARS
from butlers.switchboard.operator import (
    _check_before,
    _check_limit,
    _check_status,
    _refuse_classification_sessions,
)
from butlers.switchboard.outbox import OutboxSender, Outgoing

if TYPE_CHECKING:
    from butlers.modules.mail_parse import MailThread
from butlers.switchboard.route import Router, RouteSource, summarize
from butlers.switchboard.routing_store import RouteRecord, RoutingStore
from butlers.tasks import cancel_and_wait
from butlers.telemetry import context_from_carrier, current_carrier, current_trace_id
from butlers.text import answer_line, escaped_disguises, printable
from butlers.tool_errors import ToolRefusal

logger = logging.getLogger(__name__)


async def show_decided(
    outbox: OutboxSender,
    questions: Callable[[], Awaitable[list[dict[str, Any]]]],
    line: str,
    what: str,
) -> None:
    """The owner's Telegram questions about `what` (an approval, a pairing), once sent, say
    how it was decided and lose their buttons (best effort: the decision stands either way).
    `questions`: the outbox rows that asked, looked up only when Telegram can edit."""
    with_buttons = [
        module
        for name, module in outbox.channels.items()
        if (spec := spec_of(name)) and spec.buttons
    ]
    edit = getattr(with_buttons[0], "show_decided", None) if with_buttons else None
    if edit is None:
        return
    for asked in await questions():
        for message_id in asked["sent_ids"]:
            try:
                await edit(asked["recipient"], int(message_id), asked["text"], line)
            except Exception as exc:
                logger.warning("%s: the owner's question could not be marked: %s", what, exc)


async def tell_by_mail(
    outbox: OutboxSender,
    pool: Any,
    owner_email: str,
    answering: MailThread | None,
    text: str,
    *,
    kind: str,
) -> None:
    """Answer the owner's mail, in its thread: what their answer did, or why it did
    nothing. A late "approve" (the code expired), a second "deny", a "yes" to a call
    decided already were taken in silence, and an email-only owner believed a person let in
    or kept out (a walkthrough). Best effort: the decision stands either way."""
    channel = outbox.channels.get("email")
    if channel is None or not owner_email:
        return
    from butlers.modules.mail_parse import reply_subject

    try:
        [(body, meta)] = channel.prepare(text, reply_to=None, butler=None)
        if answering is not None:
            thread = answering.references.split()
            if answering.message_id and answering.message_id not in thread:
                thread.append(answering.message_id)
            references = " ".join(thread)
            meta = {
                **meta,
                "subject": reply_subject(answering.subject),
                "in_reply_to": answering.message_id or None,
                "references": references.strip() or None,
            }
        outgoing = Outgoing(kind=kind, channel="email", recipient=owner_email, text=body, meta=meta)
        async with pool.acquire() as conn:
            await outbox.store.add(conn, [outgoing], None)
        outbox.wake()
    except Exception as exc:
        logger.warning("the owner's mail could not be answered: %s", exc)


STATUSES = ("pending", "approved", "denied", "expired", "done", "failed")
DECISIONS = {"approve": "approved", "deny": "denied"}
# Telegram allows 64 bytes of callback data: a letter, the id, a dot and 16 bytes of MAC.
_LETTER = {"approved": "a", "denied": "d"}
_CALLBACK = re.compile(r"([ad])([1-9][0-9]{0,17})\.([A-Za-z0-9_-]{22})")
MAC_BYTES = 16
# The owner's answer by mail, on the first line (`answer_line`): "yes 12", "no #12"; or, in
# the question's own thread and alone, "yes" or "no": "Yes, please." "No!" (a reply that says
# more, "yes, but make it 50", is a message: the call shown is not that).
# "yes" and "no" in the owner's words: English, and the German, French, Spanish, Italian and
# Dutch ones (a German owner's "Ja, bitte." was routed as a message: a walkthrough).
YES_WORDS = ("yes", "ja", "oui", "sí", "si")
NO_WORDS = ("no", "nein", "non", "nee")
_MAIL_ANSWER = re.compile(r"(yes|no) #?([1-9][0-9]{0,17})(?![.,]?\d|\w)", re.IGNORECASE)
# The other languages' words with a number: nothing after it ("Si 10 minutos no bastan..."
# is Spanish for "if 10 minutes are not enough": it approved #10, a review).
_MAIL_ANSWER_ALONE = re.compile(
    rf"({'|'.join(YES_WORDS[1:] + NO_WORDS[1:])}) #?([1-9][0-9]{{0,17}})[.!]*", re.IGNORECASE
)
# Alone, with a word of thanks or please.
POLITELY = (
    r"(?:,? (?:please|thanks|thank you|go ahead|bitte|danke|merci|gracias|por favor|grazie|"
    r"graag|dank je))?[.!]*"
)
_MAIL_BARE_ANSWER = re.compile(rf"({'|'.join(YES_WORDS + NO_WORDS)}){POLITELY}", re.IGNORECASE)
# The owner's reply in a chat to a question: the mail's bare words, the buttons' own, and a
# chat's ("ok", a thumbs-up: the owner's everyday answers went to a butler, a walkthrough).
CHAT_YES = (*YES_WORDS, "approve", "approved", "ok", "okay", "\U0001f44d", "\u2705")
CHAT_NO = (*NO_WORDS, "deny", "denied", "\U0001f44e", "\u274c")
_CHAT_ANSWER = re.compile(
    rf"({'|'.join(map(re.escape, (*CHAT_YES, *CHAT_NO)))}){POLITELY}", re.IGNORECASE
)


def chat_decision(text: str) -> str | None:
    """ "approve" or "deny" when a chat message, whole, answers a question ("ok", a
    thumbs-up, "No, thanks."); None otherwise. The whole message, not a mail's first line:
    "ok" above "> no, not him" is no answer (a review)."""
    match = _CHAT_ANSWER.fullmatch(" ".join(text.split()))
    if match is None:
        return None
    return "approve" if match[1].casefold() in CHAT_YES else "deny"


RESULT_CHARS = 2000
SHOWN_ARGUMENTS_CHARS = 3000
# Pending approvals one person may have, in all their conversations (a mail's thread is its
# sender's to start; the owner's own sessions count as one): one message made a session ask
# fifteen times, fifteen questions with buttons (a red team).
MAX_PENDING_PER_CONVERSATION = 5
MAX_ARGUMENTS_BYTES = 256 * 1024
# An approved call its butler took but never answered for (it died mid-call) is `failed` after
# this: whether it ran is unknown, and it is never run twice.
CLAIM_LOST_S = 3600.0
PRUNE_EVERY_S = 3600.0
# The sweep runs an approved call nobody took only this long after its decision: until then
# it is the decider's (a second attempt would only be refused, and the CLI told "approved"
# instead of how it ended).
RETRY_AFTER_S = 10.0  # retention runs with the sweep, at most this often


def sign(secret: bytes, approval_id: int, status: str) -> str:
    """The callback data of the button that sets approval `approval_id` to `status`."""
    mac = hmac.new(secret, f"approval:{approval_id}:{status}".encode(), hashlib.sha256).digest()
    tag = base64.urlsafe_b64encode(mac[:MAC_BYTES]).rstrip(b"=").decode()
    return f"{_LETTER[status]}{approval_id}.{tag}"


def verify(secret: bytes, data: str) -> tuple[int, str] | None:
    """(approval id, status) a button's callback data was signed for; None when it was not
    signed by us (forged, altered, not ours)."""
    match = _CALLBACK.fullmatch(data)
    if match is None:
        return None
    status = "approved" if match[1] == "a" else "denied"
    approval_id = int(match[2])
    if not hmac.compare_digest(sign(secret, approval_id, status), data):
        return None
    return approval_id, status


@dataclass(frozen=True)
class RequestedCall:
    """A butler's call waiting for the owner, as its gate hands it over."""

    butler: str
    tool: str
    arguments: dict[str, Any]  # exactly as the session gave them
    conversation: str | None  # whom the session was answering (None: the owner is told)
    session_id: str | None  # the butler's sessions row
    timeout_hours: float  # the butler's [approvals] timeout_hours
    forwarded_from: str | None = None  # whose words the session acted on (a forward)


class ApprovalStore:
    """Approvals in the switchboard's database (its statements: butlers.switchboard.queries,
    APPROVAL_*)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._secret: bytes | None = None

    async def secret(self) -> bytes:
        """The buttons' signing key: made once per database, on first use."""
        if self._secret is None:
            await self.pool.execute(sql.APPROVAL_KEY_ADD, secrets.token_bytes(32))
            self._secret = bytes(await self.pool.fetchval(sql.APPROVAL_KEY))
        return self._secret

    async def create(
        self, call: RequestedCall, trace_context: dict[str, str] | None
    ) -> dict[str, Any] | None:
        """The new pending row; None when its conversation's person has
        MAX_PENDING_PER_CONVERSATION waiting already."""
        person = person_of(call.conversation).lower() if call.conversation else ""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql.APPROVAL_PERSON_LOCK, person)
            row = await conn.fetchrow(
                sql.APPROVAL_CREATE,
                storable(call.butler),
                storable(call.tool),
                storable_json(call.arguments),
                storable(call.conversation),
                storable(call.session_id),
                call.timeout_hours * 3600,
                trace_context,
                storable(call.forwarded_from[:200]) if call.forwarded_from else None,
                MAX_PENDING_PER_CONVERSATION,
                storable(person),
            )
        return dict(row) if row is not None else None

    async def get(self, approval_id: int) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(sql.APPROVAL_GET, approval_id)
        return dict(row) if row is not None else None

    async def asked_in_message(self, channel: str, chat: str, message_id: str) -> int | None:
        """The approval whose question was the message `message_id` sent to `chat`."""
        return await self.pool.fetchval(sql.APPROVAL_ASKED_IN_MESSAGE, channel, chat, message_id)

    async def asked_by_mail(self, thread: Sequence[str]) -> list[dict[str, Any]]:
        """The approvals whose question mail is one of `thread`'s Message-IDs."""
        rows = await self.pool.fetch(sql.APPROVAL_ASKED_BY_MAIL, list(thread))
        return [dict(r) for r in rows]

    async def newest(
        self, status: str | None, limit: int, before: int | None = None
    ) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(sql.APPROVAL_NEWEST, status, limit, before)
        return [dict(r) for r in rows]

    async def decide(self, approval_id: int, status: str, by: str) -> tuple[dict[str, Any], bool]:
        """Set a pending, unexpired row to `status`: (the row, whether this call decided it).
        One conditional UPDATE: of any number of concurrent decisions one wins.
        ToolRefusal when there is no such row."""
        row = await self.pool.fetchrow(
            sql.APPROVAL_DECIDE,
            approval_id,
            status,
            storable(by),
        )
        if row is not None:
            return dict(row), True
        current = await self.get(approval_id)
        if current is None:
            raise ToolRefusal(f"no approval #{approval_id}")
        return current, False

    async def claim(self, approval_id: int, butler: str) -> dict[str, Any] | None:
        """The approved call for `butler` to run, taken once (None: not approved, not this
        butler's, or taken already)."""
        row = await self.pool.fetchrow(sql.APPROVAL_CLAIM, approval_id, butler)
        return dict(row) if row is not None else None

    async def finish(self, approval_id: int, status: str, result: str) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(
            sql.APPROVAL_FINISH,
            approval_id,
            status,
            storable(result[:RESULT_CHARS]),
        )
        return dict(row) if row is not None else None

    async def fail_untaken(self, approval_id: int, result: str) -> dict[str, Any] | None:
        """`failed`, if no butler has taken it (one conditional UPDATE: never a running one)."""
        row = await self.pool.fetchrow(
            sql.APPROVAL_FAIL_UNTAKEN,
            approval_id,
            storable(result[:RESULT_CHARS]),
        )
        return dict(row) if row is not None else None

    async def expire_due(self) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(sql.APPROVAL_EXPIRE_DUE)
        return [dict(r) for r in rows]

    async def unclaimed(self, decided_before_s: float) -> list[int]:
        """Approved calls no butler has taken yet (it was down, or the switchboard stopped),
        decided at least `decided_before_s` ago: a fresh one is its decider's to run."""
        rows = await self.pool.fetch(sql.APPROVAL_UNCLAIMED, decided_before_s)
        return [r["id"] for r in rows]

    async def name_of(self, conversation: str) -> str | None:
        """The name of the person a conversation is with, to show the owner beside its id:
        the name the owner paired them under, else the name on their newest message there
        (not in a group chat, whose last writer need not be the one served)."""
        channel, _, sender = person_of(conversation).partition(":")
        alone = not (channel == "telegram" and sender.startswith("-"))
        name = await self.pool.fetchval(
            sql.APPROVAL_NAME_OF, channel, sender, storable(conversation), alone
        )
        return name or None

    async def telegram_questions(self, approval_id: int) -> list[dict[str, Any]]:
        """The owner's Telegram question(s) with buttons for this approval, as sent."""
        rows = await self.pool.fetch(sql.APPROVAL_TELEGRAM_QUESTIONS, approval_id)
        return [dict(r) for r in rows]

    async def prune(self, older_than_days: int) -> int:
        """Retention: decided approvals whose outcome is older than that (never a pending or
        approved one: those still have something to do)."""
        result = await self.pool.execute(sql.APPROVAL_PRUNE, older_than_days)
        return int(result.split()[-1])

    async def claims_lost(self, after_s: float) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(sql.APPROVAL_CLAIMS_LOST, after_s)
        return [dict(r) for r in rows]


def owner_pressed(owner: OwnerConfig, chat_id: str, user_id: str) -> bool:
    """Whether a button press is the owner's: in the owner's chat and by the owner. A
    private chat's id is its person's user id, so both must be `telegram_chat_id`. Checking
    the chat alone would let every member of a group decide, were the owner's chat a group;
    with this, the buttons of a group count for nobody (the CLI still decides)."""
    owner_chat = owner.telegram_chat_id
    return bool(owner_chat) and chat_id == owner_chat and user_id == owner_chat


@dataclass(frozen=True)
class PressAnswer:
    """What a button press is answered with (answerCallbackQuery), and the line added to the
    request message (None: leave it as it is)."""

    answer: str
    decision_line: str | None


def describe(
    row: dict[str, Any],
    redact: Callable[[str], str],
    owner: OwnerConfig,
    name: str | None = None,
) -> str:
    """The owner's question: the butler, the tool, whom the session that asks was answering
    (by `name` too, when known: `ApprovalStore.name_of`), and the arguments, readable and
    without configured secrets; until when, in the owner's time zone, as a pairing request
    says it. Every argument is shown, each long text cut on its own (one long value once hid
    the others: `attachments` sorts before `text`), and characters that reorder or break
    lines are shown as escapes, not obeyed."""
    expires = row["expires_at"].astimezone(ZoneInfo(owner.timezone))
    whose = _whose(row.get("conversation"), owner, name, row.get("forwarded_from"))
    shown, whole = shown_arguments(row["arguments"])
    # Said before the arguments, not after them: a tail cut off is where a "to" or an amount
    # may hide, and the owner reads from the top.
    cut = (
        "" if whole else " (not all of it shown: see `butlers approvals --json` before you approve)"
    )
    return redact(
        f"{row['butler']} asks to run {row['tool']} (approval #{row['id']}) "
        f"{whose}, with{cut}:\n{shown}"
        f"\n\nApprove or deny it before {expires.strftime('%Y-%m-%d %H:%M %Z')}."
    )


def _whose(
    conversation: str | None,
    owner: OwnerConfig,
    name: str | None,
    forwarded_from: str | None = None,
) -> str:
    """Whom the asking session served. Another person's conversation id (a mail thread's
    root is the sender's to choose) and name (theirs to choose) are quoted and cut, as the
    switchboard's handoff shows them to a butler; so is the author of a forwarded message's
    words (a forward of a stranger's words is not the owner's own message)."""
    if conversation is None:
        return "for a session you started or a schedule"
    author = (
        json.dumps(printable(forwarded_from, MAX_SENDER_NAME_CHARS), ensure_ascii=False)
        if forwarded_from
        else None
    )
    if is_owners(conversation, owner):
        if author is not None:
            return f"answering a message you forwarded: {author}'s words, not yours"
        return "answering your own message"
    who = json.dumps(printable(conversation, MAX_WHO_CHARS), ensure_ascii=False)
    if name:
        who = f"{json.dumps(printable(name, MAX_SENDER_NAME_CHARS), ensure_ascii=False)} ({who})"
    if author is not None:
        return f"answering {who}, not you, who forwarded {author}'s words"
    return f"answering {who}, not you"


def shown_arguments(arguments: dict[str, Any]) -> tuple[str, bool]:
    """`arguments` as indented JSON within SHOWN_ARGUMENTS_CHARS, for the owner to judge: each
    long text, key or number cut on its own and each long list or object shortened (saying
    how much there was) until the whole fits, and the characters that could disguise it
    (bidi overrides, line and paragraph separators) shown as escapes. Whatever is left out
    is said to be ("… 12 more keys"): a question that hides much is one to deny. With it,
    whether all of it is shown."""
    for limit in SHOWN_VALUE_CHARS:
        kept = _cut(arguments, limit, 0)
        shown = escaped_disguises(json.dumps(kept, indent=2, ensure_ascii=False, sort_keys=True))
        if len(shown) <= SHOWN_ARGUMENTS_CHARS:
            return shown, kept == arguments
    # (only very deep or wide arguments get here: the rest is in `butlers approvals --json`)
    return shown[:SHOWN_ARGUMENTS_CHARS] + "\n… (cut: see `butlers approvals --json`)", False


SHOWN_VALUE_CHARS = (600, 200, 60)  # of one text, key or number, tried in turn until all fit
SHOWN_ITEMS = 20  # of one list or object (the arguments too: a tool server may take any)
SHOWN_DEPTH = 6  # lists and objects within one another
SHOWN_KEY_CHARS = 60


def _cut(value: Any, limit: int, depth: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}… ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(value)
        return value if len(digits) <= limit else f"{digits[:limit]}… ({len(digits)} digits)"
    if isinstance(value, dict | list) and depth >= SHOWN_DEPTH:
        return f"… ({len(value)} {'keys' if isinstance(value, dict) else 'items'} nested deeper)"
    if isinstance(value, dict):
        keys = sorted(value, key=str)
        kept = keys[:SHOWN_ITEMS]
        shown: dict[str, Any] = {}
        for key in kept:
            name = _cut(str(key), min(limit, SHOWN_KEY_CHARS), depth)
            while name in shown:  # two long keys cut alike: neither may hide the other
                name += " (another)"
            shown[name] = _cut(value[key], limit, depth + 1)
        if len(keys) > len(kept):
            shown["…"] = f"{len(keys) - len(kept)} more keys"
        return shown
    if isinstance(value, list):
        shown_items = [_cut(item, limit, depth + 1) for item in value[:SHOWN_ITEMS]]
        if len(value) > SHOWN_ITEMS:
            shown_items.append(f"… {len(value) - SHOWN_ITEMS} more items")
        return shown_items
    return value


class ApprovalDesk:
    """Records requests, asks the owner, takes decisions and has approved calls run; a
    LeaderDuty for the sweep (expiry, and calls whose butler was down)."""

    name = "approvals"

    def __init__(
        self,
        store: ApprovalStore,
        *,
        router: Router,
        routing_store: RoutingStore,
        notifier: NotificationDesk,
        outbox: OutboxSender,
        owner: OwnerConfig,
        tracer: Tracer,
        redact: Callable[[str], str],
        check_interval_s: float,
        retention_days: int,
    ) -> None:
        self.store = store
        self.router = router
        self.routing_store = routing_store
        self.notifier = notifier
        self.outbox = outbox
        self.owner = owner
        self.tracer = tracer
        self.redact = redact
        self.check_interval_s = check_interval_s
        self.retention_days = retention_days  # [switchboard] retention_days
        self._pruned_at: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    # -- requests ---------------------------------------------------------------------------

    async def request(self, call: RequestedCall) -> dict[str, Any]:
        """Record a call waiting for the owner and ask them; its id and expiry."""
        if len(json.dumps(call.arguments)) > MAX_ARGUMENTS_BYTES:
            raise ToolRefusal(f"the arguments are over {MAX_ARGUMENTS_BYTES} bytes of JSON")
        started = time.monotonic()
        with self.tracer.start_as_current_span(
            "approval.request", attributes={"butler": call.butler, "tool_name": call.tool}
        ) as span:
            row = await self.store.create(call, current_carrier() or None)
            if row is None:
                raise ToolRefusal(
                    f"{MAX_PENDING_PER_CONVERSATION} calls for this person already wait for "
                    "the owner's approval: not asked again until they decide",
                    log_level=logging.WARNING,
                )
            span.set_attribute("approval_id", row["id"])
            asked = await self._ask_owner(row)
            # Not asking is no failure: the request stands and waits for `butlers approvals`.
            what = "requested" if asked else "requested; owner not asked, decide with the CLI"
            await self._record(row, what, started, error=None)
        return {
            "id": row["id"],
            "status": row["status"],
            "expires_at": row["expires_at"].isoformat(),
            "owner_asked": asked,
        }

    async def name_served(self, row: dict[str, Any]) -> str | None:
        """The name of the person whose conversation the asking session served (None: the
        owner's own, or a session nobody's message started)."""
        conversation = row.get("conversation")
        if conversation and not is_owners(conversation, self.owner):
            return await self.store.name_of(conversation)
        return None

    async def whose(self, row: dict[str, Any]) -> str:
        """Whom the call serves, in the owner's question's words (the dashboard says it too:
        it showed the call without them, a red team)."""
        return _whose(
            row.get("conversation"),
            self.owner,
            await self.name_served(row),
            row.get("forwarded_from"),
        )

    async def _ask_owner(self, row: dict[str, Any]) -> bool:
        """Queue the question to the owner on their preferred channel that runs here."""
        reachable = [c for c in self.owner.channels() if c[0] in self.outbox.channels]
        if not reachable:
            logger.warning(
                "approval #%s: the owner cannot be asked (no [switchboard.owner] channel runs "
                "here); decide it with `butlers approvals`",
                row["id"],
                extra={"action": "approval_not_asked"},
            )
            return False
        channel, recipient = reachable[0]
        spec = spec_of(channel)
        buttons = spec is not None and spec.buttons
        by_reply = spec is not None and spec.continues_thread  # a mail's answer in its thread
        text = describe(row, self.redact, self.owner, await self.name_served(row))
        if by_reply:
            text += (
                '\n\nReply to this mail with "yes" or "no" on its first line (or "yes '
                f'{row["id"]}", "no {row["id"]}"), or run `butlers approvals approve|deny '
                f"{row['id']}`."
            )
        chunks = self.outbox.channels[channel].prepare(
            text,
            reply_to=None,
            butler=row["butler"],
            subject=f"Approval #{row['id']}: {row['butler']} asks to run {row['tool']}",
        )
        if buttons:
            secret = await self.store.secret()
            keyboard = [
                [
                    {"text": "Approve", "callback_data": sign(secret, row["id"], "approved")},
                    {"text": "Deny", "callback_data": sign(secret, row["id"], "denied")},
                ]
            ]
            last, meta = chunks[-1]
            chunks[-1] = (last, {**meta, "inline_keyboard": keyboard, "approval_id": row["id"]})
        # Each chunk says which approval it asks about: the owner's reply in words to any of
        # them decides it (chat_answer).
        outgoing = [
            Outgoing(
                kind="approval",
                channel=channel,
                recipient=recipient,
                text=t,
                meta={**m, "asks_approval": row["id"]},
            )
            for t, m in chunks
        ]
        # The request mail's Message-ID: an answer by mail counts only in its thread.
        asked = {channel: chunks[0][1].get("message_id")} if by_reply else {}
        async with self.routing_store.pool.acquire() as conn, conn.transaction():
            await self.outbox.store.add(conn, outgoing, current_carrier() or None)
            await conn.execute(sql.APPROVAL_ASKED, row["id"], asked)
        self.outbox.wake()
        return True

    # -- decisions --------------------------------------------------------------------------

    async def decide(
        self, approval_id: int, decision: str, *, by: str, wait: bool, shown: bool = False
    ) -> dict[str, Any]:
        """Approve or deny (`decision`: approve | deny) a pending approval, once. On approve
        its butler runs the call (awaited when `wait`). The owner's Telegram question shows
        the decision (unless `shown`: a press edits the message it was pressed on). What the
        row says afterwards, and `changed`: whether this call decided it."""
        status = DECISIONS.get(decision)
        if status is None:
            raise ToolRefusal(f"decision must be approve or deny, got {decision!r}")
        started = time.monotonic()
        row, changed = await self.store.decide(approval_id, status, by)
        with self.tracer.start_as_current_span(
            "approval.decide",
            context=context_from_carrier(row["trace_context"]),
            attributes={"approval_id": approval_id, "decision": status, "changed": changed},
        ):
            if not changed:
                return self._public(row, changed=False)
            await self._record(row, status, started, error=None)
            if not shown:
                await self._show_decision(row, f"{status.capitalize()} ({by}).")
            if status == "denied":
                conversation = row.get("conversation")
                # The owner's own request (their chat, a schedule of theirs) is theirs to
                # have declined: "the owner declined" read as someone else's doing.
                who = (
                    "You declined"
                    if conversation is None or is_owners(conversation, self.owner)
                    else "The owner declined"
                )
                await self._tell(
                    row, f"{who}: {row['butler']} did not run {row['tool']} (#{approval_id})."
                )
                return self._public(row, changed=True)
            task = self._spawn(self.execute(approval_id))
        if wait:
            await asyncio.shield(task)
            row = await self.store.get(approval_id) or row
        return self._public(row, changed=True)

    async def press(self, chat_id: str, user_id: str, data: str, *, by: str) -> PressAnswer:
        """A Telegram button press (in chat `chat_id`, by user `user_id`): counted only when
        the owner pressed it in their chat (`owner_pressed`), with data we signed."""
        if not owner_pressed(self.owner, chat_id, user_id):
            logger.warning(
                "approval button pressed in chat %s by user %s, not the owner: ignored",
                chat_id,
                user_id,
                extra={"action": "approval_press_refused"},
            )
            return PressAnswer("Only the owner can decide this.", None)
        signed = verify(await self.store.secret(), data)
        if signed is None:
            logger.warning(
                "approval button with data we did not sign: ignored",
                extra={"action": "approval_press_refused"},
            )
            return PressAnswer("This button is not valid.", None)
        approval_id, status = signed
        decided = await self.decide(
            approval_id,
            "approve" if status == "approved" else "deny",
            by=by,
            wait=False,
            shown=True,
        )
        if decided["changed"]:
            return PressAnswer(
                f"{status.capitalize()} (#{approval_id}).", f"{status.capitalize()} by the owner."
            )
        current = decided["status"]
        return PressAnswer(f"Already {current} (#{approval_id}): nothing changed.", None)

    async def asked_in_chat(self, chat_id: str, message_id: int) -> bool:
        """Whether the message `message_id` in the owner's chat asked about an approval."""
        if chat_id != self.owner.telegram_chat_id:
            return False
        return await self.store.asked_in_message("telegram", chat_id, str(message_id)) is not None

    async def chat_answer(
        self, chat_id: str, user_id: str, replied_to: int | None, text: str
    ) -> str | None:
        """The owner's words in reply to a question of theirs in a chat ("yes", "no",
        "approve", "deny", alone or with a please): decided as a press of its button would be
        (a typed "yes" was routed to a butler, which answered "Done." while the call stayed
        pending: a walkthrough). What to tell the owner, or None when it is no such answer
        (an ordinary message: routed)."""
        if replied_to is None or not owner_pressed(self.owner, chat_id, user_id):
            return None
        decision = chat_decision(text)
        if decision is None:
            return None
        approval_id = await self.store.asked_in_message("telegram", chat_id, str(replied_to))
        if approval_id is None:
            return None  # a reply to something else: a message like any other
        try:
            decided = await self.decide(approval_id, decision, by=f"telegram:{user_id}", wait=False)
        except ToolRefusal:  # its row gone (retention) while its question was not
            return f"Approval #{approval_id} is gone: nothing changed."
        if decided["changed"]:
            return f"{decided['status'].capitalize()} (#{approval_id})."
        return f"Approval #{approval_id} was {decided['status']} already: nothing changed."

    async def mail_answer(
        self,
        sender: str,
        thread: Sequence[str],
        text: str,
        *,
        parent: str | None = None,
        answering: MailThread | None = None,
    ) -> bool:
        """An allowed mail that may be the owner's answer ("yes 12" / "no 12" first, or a
        first line of "yes" or "no" alone in reply to a question mail, `parent`, which
        names its approval): True when it decided (or tried to decide) an approval, so it
        is not a message to route. Taken only from the owner's address and in the thread of
        that approval's request mail; anything else is an ordinary message."""
        owner = self.owner.email.lower()
        if not owner or sender.lower() != owner:
            return False
        line, alone = answer_line(text)
        match = (
            _MAIL_ANSWER.match(line)
            or _MAIL_ANSWER_ALONE.fullmatch(line)
            or (_MAIL_BARE_ANSWER.fullmatch(line) if alone else None)
        )
        if match is None:
            return False
        if match.re is _MAIL_BARE_ANSWER:  # the approval whose question this mail answers
            # The question itself, not one further up its thread: "Should I block them?"
            # answered "yes" approved the call asked about above it (a red team).
            asked_here = await self.store.asked_by_mail([parent] if parent else [])
            if len(asked_here) != 1:
                return False  # a "yes" to something else: a message like any other
            approval_id = int(asked_here[0]["id"])
        else:
            approval_id = int(match[2])
        row = await self.store.get(approval_id)
        asked = (row or {}).get("asked") or {}
        if row is None or not asked.get("email") or asked["email"] not in thread:
            logger.warning(
                "an answer by mail to approval #%s outside its request's thread: not taken",
                approval_id,
                extra={"action": "approval_answer_refused"},
            )
            return False
        decision = "approve" if match[1].casefold() in YES_WORDS else "deny"
        decided = await self.decide(approval_id, decision, by=f"email:{sender}", wait=False)
        if not decided["changed"]:  # (answering: where to say so; its thread)
            await tell_by_mail(
                self.outbox,
                self.routing_store.pool,
                owner,
                answering,
                f"Approval #{approval_id} was {decided['status']} already: your answer "
                "changed nothing (`butlers approvals` lists them).",
                kind="approval",
            )
        return True

    # -- running an approved call -----------------------------------------------------------

    async def execute(self, approval_id: int) -> None:
        """Have its butler run an approved call, and record and tell how it ended. A butler
        that cannot be reached leaves the call approved and untaken: the sweep tries again."""
        row = await self.store.get(approval_id)
        if row is None or row["status"] != "approved" or row["claimed_at"] is not None:
            return
        with self.tracer.start_as_current_span(
            "approval.execute",
            context=context_from_carrier(row["trace_context"]),
            attributes={"approval_id": approval_id, "butler": row["butler"]},
        ):
            try:
                answer = await self.router.route(
                    row["butler"],
                    APPROVAL_EXECUTE_TOOL,
                    {"id": approval_id},
                    source=RouteSource(channel="approval", source_id=str(approval_id)),
                )
            except TargetDown as exc:
                logger.warning(
                    "approval #%s: %s; tried again when it is back",
                    approval_id,
                    exc,
                    extra={"action": "approval_deferred"},
                )
                return
            except RouteError as exc:
                # Refused before anyone took it (the butler has no such tool, is no longer
                # routable): it fails now, retrying would not help. Taken (by another run, or
                # this one's answer was lost): left to its taker, or to CLAIM_LOST_S.
                logger.warning(
                    "approval #%s not run: %s",
                    approval_id,
                    exc,
                    extra={"action": "approval_execute_failed"},
                )
                failed = await self.store.fail_untaken(approval_id, self.redact(str(exc)))
                if failed is not None:
                    await self._tell(
                        failed,
                        f"Approved, but {row['butler']} could not run {row['tool']} "
                        f"(#{approval_id}).",
                    )
                return
            ok = isinstance(answer, dict) and answer.get("status") == "done"
            result = self.redact(str(answer.get("result", "")) if isinstance(answer, dict) else "")
            finished = await self.store.finish(approval_id, "done" if ok else "failed", result)
            if finished is None:
                return
            if ok:
                said = f"Approved and done: {row['butler']} ran {row['tool']} (#{approval_id})."
            else:
                said = (
                    f"Approved, but {row['tool']} failed (#{approval_id}): "
                    f"{result[:200] or 'no reason given'}"
                )
            await self._tell(finished, said)

    async def claim(self, approval_id: int, butler: str) -> dict[str, Any]:
        claimed = await self.store.claim(approval_id, butler)
        if claimed is None:
            raise ToolRefusal(
                f"approval #{approval_id} is not an approved call of {butler} waiting to run",
                log_level=logging.WARNING,
            )
        return claimed

    # -- the sweep (leader) -----------------------------------------------------------------

    async def sweep(self) -> None:
        """Expire overdue requests, run approved calls nobody took, and fail calls taken long
        ago and never answered for."""
        await self.expire()
        for approval_id in await self.store.unclaimed(RETRY_AFTER_S):
            await self.execute(approval_id)
        for row in await self.store.claims_lost(CLAIM_LOST_S):
            await self._tell(row, f"{row['tool']} (#{row['id']}): its butler never answered.")
        if self._pruned_at is None or time.monotonic() - self._pruned_at >= PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            if deleted := await self.store.prune(self.retention_days):
                logger.info(
                    "retention (%d days): deleted %d approvals",
                    self.retention_days,
                    deleted,
                    extra={"action": "retention"},
                )

    async def expire(self) -> None:
        """Mark overdue pending requests `expired`, and tell each one's sender."""
        for row in await self.store.expire_due():
            with self.tracer.start_as_current_span(
                "approval.expired",
                context=context_from_carrier(row["trace_context"]),
                attributes={"approval_id": row["id"]},
            ):
                await self._record(row, "expired", time.monotonic(), error=None)
                await self._show_decision(row, "Expired: nobody decided in time.")
                await self._tell(
                    row,
                    f"No answer from the owner in time: {row['butler']} did not run "
                    f"{row['tool']} (#{row['id']}).",
                )

    async def lead(self) -> None:
        self._pruned_at = None  # a new leader applies retention at once
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="approvals:sweep")

    async def step_down(self) -> None:
        await cancel_and_wait(self._sweeper)
        self._sweeper = None

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                # Keep sweeping: the next round may find the database back.
                logger.exception("approvals sweep failed", extra={"action": "approvals_sweep"})
            await asyncio.sleep(self.check_interval_s)

    async def close(self) -> None:
        await self.step_down()
        for task in list(self._tasks):
            await cancel_and_wait(task)

    async def _show_decision(self, row: dict[str, Any], line: str) -> None:
        await show_decided(
            self.outbox,
            lambda: self.store.telegram_questions(row["id"]),
            line,
            f"approval #{row['id']}",
        )

    # -- helpers ----------------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coroutine, name="approvals:execute")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _tell(self, row: dict[str, Any], text: str) -> None:
        """A few words to whoever the session was answering (else the owner)."""
        try:
            await self.notifier.deliver(text, row["butler"], None, row["conversation"])
        except NotifyRefused as exc:
            logger.warning(
                "approval #%s: could not tell (%s): %s",
                row["id"],
                exc,
                text,
                extra={"action": "approval_not_told"},
            )

    async def _record(
        self, row: dict[str, Any], what: str, started: float, *, error: str | None
    ) -> None:
        """A routing_log row for a request or a decision, in the asking session's trace."""
        await self.routing_store.record_route(
            RouteRecord(
                source_channel="approval",
                source_id=str(row["id"]),
                routed_to=row["butler"],
                tool_name=f"{row['tool']} ({what})",
                prompt_summary=summarize(row["arguments"], self.redact),
                trace_id=current_trace_id(),
                success=error is None,
                error=error,
                duration_ms=int((time.monotonic() - started) * 1000),
            )
        )

    @staticmethod
    def _public(row: dict[str, Any], *, changed: bool) -> dict[str, Any]:
        return {**public(row), "changed": changed}


def public(row: dict[str, Any]) -> dict[str, Any]:
    """An approvals row as the operator's tools show it (its trace carrier left out)."""
    return {k: v for k, v in row.items() if k != "trace_context"}


def _refuse_sessions_and_classifiers(tool: str) -> None:
    """What butlers' daemons call: never a Claude Code session of any butler (they present
    their session header) nor a classification session."""
    from fastmcp.server.dependencies import get_http_headers

    if classification_claim() is not None or SESSION_HEADER.lower() in get_http_headers(
        include={SESSION_HEADER.lower()}
    ):
        raise ToolRefusal(f"{tool} is not available to sessions", log_level=logging.WARNING)


def register_approval_tools(mcp: FastMCP, desk: ApprovalDesk) -> None:
    """approval_request and approval_claim (for the butlers' daemons), approvals_list and
    approval_decide (the operator's: `butlers approvals`)."""

    @mcp.tool
    async def approval_request(
        butler: str,
        tool: str,
        arguments: dict[str, Any],
        conversation: str | None = None,
        session_id: str | None = None,
        timeout_hours: float = 24.0,
        forwarded_from: str | None = None,
    ) -> dict[str, Any]:
        """A butler's call that waits for the owner's approval: recorded, and the owner asked
        on their preferred channel. For butlers' daemons (their approval gate).
        `forwarded_from`: the session acted on a forwarded message, this author's words."""
        _refuse_sessions_and_classifiers("approval_request")
        if not timeout_hours > 0:
            raise ToolRefusal("timeout_hours must be positive")
        return await desk.request(
            RequestedCall(
                butler, tool, arguments, conversation, session_id, timeout_hours, forwarded_from
            )
        )

    @mcp.tool
    async def approval_claim(id: int, butler: str) -> dict[str, Any]:
        """The approved call `id` for `butler` to run, handed out once. For butlers' daemons
        (their `approval_execute`)."""
        _refuse_sessions_and_classifiers("approval_claim")
        return await desk.claim(id, butler)

    @mcp.tool
    async def approvals_list(
        status: str | None = None, limit: int = 20, before: int | None = None
    ) -> list[dict[str, Any]]:
        """The newest approvals (`status`: pending | approved | denied | expired | done |
        failed; `limit` 1..500; `before`: only those with a lower id, the next page):
        butler, tool, exact arguments, who decided and when, result."""
        _refuse_classification_sessions()
        _check_status(status, STATUSES, "approvals")
        _check_limit(limit)
        _check_before(before)
        await desk.expire()  # what is overdue says so even between two sweeps
        return [public(row) for row in await desk.store.newest(status, limit, before)]

    @mcp.tool
    async def approval_decide(id: int, decision: str) -> dict[str, Any]:
        """Approve or deny (`decision`) the pending approval `id`, as the owner; on approve
        its butler runs the call and this answers with how it ended."""
        _refuse_classification_sessions()
        return await desk.decide(id, decision, by="operator", wait=True)
