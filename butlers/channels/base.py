"""What a channel is: the one protocol every way people reach the switchboard implements.

A channel has two halves. Its `ChannelSpec` is light (pydantic only) and describes it: its
name, its `[modules.<name>]` table, the variables holding its secrets (redaction, `doctor`),
the one of them it cannot run without, how it recognises a reply to one of our messages
(thread affinity), its commands, what files it carries, and how to open it. Its
`ChannelModule` is what `open` returns inside a butler: it registers tools and webhook routes,
receives (polling or webhooks, into the switchboard's inbox), and sends (the outbox's rows).

Everything that used to name the channels one by one (the modules' builder, the config's
table and its channel names, redaction, conversations, notifications, the dashboard) reads
`butlers.channels.CHANNELS` instead; docs/architecture.md shows how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastmcp import FastMCP
    from starlette.routing import BaseRoute

    from butlers.context import ModuleStatus
    from butlers.core_store import CoreStore
    from butlers.media import Attachment
    from butlers.settings import Settings
    from butlers.switchboard.approvals import ApprovalDesk
    from butlers.switchboard.inbox import InboxMessage
    from butlers.switchboard.outbox import Delivery
    from butlers.switchboard.pairing import PairingDesk
    from butlers.switchboard.worker import InboxWorker


class ChannelModule(Protocol):
    """A channel running inside the switchboard (or, with no worker, a butler that only sends).

    Receiving: `open` connects; `lead` starts what only one switchboard process may do
    (Telegram's getUpdates, the IMAP watch) and `step_down` stops it; each message is handed
    to the worker's `accept` and acknowledged to its channel only once stored. Sending: the
    outbox turns a reply into rows with `prepare` and sends each with `deliver`."""

    name: str
    status: ModuleStatus
    # The switchboard's desks, set when it opens the channel (None: not asked).
    approvals: ApprovalDesk | None
    pairing: PairingDesk | None

    def register(self, mcp: FastMCP) -> None:
        """Add the channel's tools (`send_message`, `send_email`) to the butler's server."""
        ...

    def webhook_routes(self) -> list[BaseRoute]:
        """HTTP routes its messages may arrive on (they carry their own secrets)."""
        ...

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def lead(self) -> None: ...

    async def step_down(self) -> None: ...

    def prepare(
        self,
        text: str,
        *,
        reply_to: InboxMessage | None,
        butler: str | None,
        subject: str | None = None,
    ) -> list[tuple[str, dict[str, Any]]]:
        """The rows one message becomes (text over the channel's limit is split), each with
        what `deliver` will need (`reply_to`: the message this answers, if any; `butler`:
        who speaks, for a notification's subject; `subject`: what a message that answers
        nothing is about, where the channel has subjects: an approval's question, a pairing
        code, told apart in the owner's mailbox from the butlers' notes)."""
        ...

    async def deliver(self, delivery: Delivery) -> list[str]:
        """Send one row; the channel's own ids of what was sent. Raises DeliveryError."""
        ...

    async def may_write(self, sender: str) -> bool:
        """Whether `sender` (an inbox row's `source_id`) may write here now: allowlisted or
        paired. A notification to the conversation of one who may no longer (unpaired,
        taken off the allowlist) is refused: their reminders would go on reaching them."""
        ...


# The state keys channels keep theirs under: the state tools refuse them (a session told to
# set the email intake's first UID high would have it read no mail again: a review).
CHANNEL_STATE_PREFIX = "channel:"


@dataclass(frozen=True)
class ChannelState:
    """What a channel keeps across starts, in its butler's state table under keys of its own
    (`channel:<name>:<key>`): the email module's first mail to read, say."""

    store: CoreStore
    channel: str

    def _key(self, key: str) -> str:
        return f"{CHANNEL_STATE_PREFIX}{self.channel}:{key}"

    async def get(self, key: str) -> Any:
        """The value kept under `key`, or None."""
        row = await self.store.state_get(self._key(key))
        return None if row is None else row["value"]

    async def set(self, key: str, value: Any) -> None:
        await self.store.state_set(self._key(key), value)

    async def holds_any(self, prefix: str) -> bool:
        """Whether any key starting with `prefix` is kept."""
        return bool(await self.store.state_list(self._key(prefix), limit=1, values=False))


@dataclass(frozen=True)
class ChannelContext:
    """What opening a channel may use: the butler's settings (its variables are looked up
    there, never in os.environ), the switchboard's worker (None on a butler that is not
    the switchboard: a channel there could only send), and the butler's store, for what a
    channel keeps across starts (`state_of`; None: nothing is kept)."""

    settings: Settings
    worker: InboxWorker | None
    store: CoreStore | None = None

    def variable(self, name: str) -> str | None:
        return self.settings.variable(name)

    def state_of(self, channel: str) -> ChannelState | None:
        return None if self.store is None else ChannelState(self.store, channel)


class ChannelSpec:
    """One channel, described. Subclasses set the class attributes and implement `open`,
    `secret_variables` and `required_variables`; the rest have defaults for a channel with
    no threads and no commands."""

    name: ClassVar[str]
    title: ClassVar[str]  # as a sentence names it: "by Telegram", "by email"
    config_model: ClassVar[type]  # its `[modules.<name>]` table (a pydantic dataclass)
    # Its key under [switchboard.owner]: where the owner is reached on it ("" : not there).
    owner_key: ClassVar[str] = ""
    commands: ClassVar[tuple[str, ...]] = ()
    # What its people can send that is read (butlers.media kinds); the rest gets a reply
    # saying what is read.
    carries: ClassVar[frozenset[str]] = frozenset()
    # A notification to one of its conversations continues the conversation's thread (mail's
    # In-Reply-To); else it is sent on its own.
    continues_thread: ClassVar[bool] = False
    # It can show the owner buttons to press (approvals, pairing); else the owner answers by
    # the CLI, the dashboard or (mail) a reply.
    buttons: ClassVar[bool] = False

    def secret_variables(self, config: Any) -> list[str]:
        """Names of the variables holding its secrets: never logged (butlers.redact)."""
        raise NotImplementedError

    def required_variables(self, config: Any) -> list[str]:
        """The variables it cannot run without: one unset makes it `skipped`, saying which."""
        raise NotImplementedError

    def needed_variables(self, config: Any) -> list[tuple[str, str]]:
        """Every variable the channel needs set as configured, with the key that names it
        (`butlers doctor` reports the unset ones): by default the required ones."""
        return [(name, "") for name in self.required_variables(config)]

    def open(self, config: Any, context: ChannelContext) -> ChannelModule:
        """The running module (nothing connects before its `open`)."""
        raise NotImplementedError

    def answered_ids(self, meta: dict[str, Any]) -> list[str]:
        """The channel's own ids of our messages that a message (its inbox meta) answers."""
        return []

    def command_of(self, text: str) -> str | None:
        """The command `text` is, answered without any butler (/help), or None."""
        return None

    def with_files(
        self, rows: list[tuple[str, dict[str, Any]]], files: Sequence[Attachment]
    ) -> list[tuple[str, dict[str, Any], tuple[Attachment, ...]]]:
        """Where a message's files go among its rows (from the module's `prepare`). A row is
        what the outbox sends in one go, and sends again whole when it fails, so a channel
        that sends each file as a message of its own gives each file a row of its own (else a
        retry would send the parts before the one that failed again). By default every file
        goes with the last row (a mail: one message with its attachments)."""
        empty: tuple[Attachment, ...] = ()
        placed = [(text, meta, empty) for text, meta in rows]
        if files and placed:
            text, meta, _ = placed[-1]
            placed[-1] = (text, meta, tuple(files))
        return placed

    def same_sender(self, sender: str) -> str:
        """A sender as the channel compares them (an address's case does not matter)."""
        return sender.strip()

    def sender_label(self, sender: str) -> str:
        """A sender as a sentence to the owner names them."""
        return f"{self.title} sender {sender}"
