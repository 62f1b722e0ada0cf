"""store: what the worker side asks of its stores, call by call, and nothing more.

The inbox worker (butlers.switchboard.worker), its attachment step, the outbox sender
(.outbox) and the notification desk (.deliver) depend on these protocols, not on the
PostgreSQL classes: InboxStore (.inbox), OutboxStore (.outbox) and RoutingStore
(.routing_store) implement them, and so do the in-memory stores of
butlers.switchboard.memory_store, which test the worker's logic with no database and no
process. tests/test_store_contract.py runs one set of tests against both, so that the double
keeps the PostgreSQL stores' promises; each method's docstring here is that promise.

Time: the PostgreSQL stores read the database's clock (`now()`); the in-memory ones a clock
they are given. A lease, a deferral or a retry is due when that clock has passed it.

Transactions: `pool.acquire()` gives a connection (`conn`) whose `transaction()` makes the
writes of the stores' calls that take it (`InboxQueue.finish`, `OutboxQueue.add`) one: all of
them or, when the block raises, none. The worker finishes a message and queues its reply
that way, so a crash leaves the message either to be processed again or answered, never both.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from butlers.media import Attachment
    from butlers.switchboard.inbox import InboxMessage, IncomingMessage
    from butlers.switchboard.outbox import Delivery, Outgoing
    from butlers.switchboard.routing_store import RouteRecord

# The statuses of an inbox row once it is finished: it is neither claimed nor claimable again.
FINISHED = ("done", "failed", "skipped")


class Connection(Protocol):
    """A connection from `Pool.acquire()` (asyncpg's, or an in-memory one)."""

    def transaction(self) -> AbstractAsyncContextManager[object]:
        """Until the block ends, the writes made through this connection are one: committed
        together, or none of them when the block raises."""
        ...


class Pool(Protocol):
    """Where a store's connections come from (asyncpg.Pool, or an in-memory database)."""

    def acquire(self) -> AbstractAsyncContextManager[Connection]: ...


class InboxQueue(Protocol):
    """The inbox, as the worker, its attachment step and the notification desk use it.

    A row is `queued`, then `processing` for the replica that claimed it (until its lease
    ends), then finished (FINISHED). Rows are taken in arrival order (their id); the rows of
    one conversation one at a time and in order."""

    @property
    def pool(self) -> Pool:
        """The pool whose transactions `finish(conn=...)` joins."""
        ...

    async def accept(
        self,
        message: IncomingMessage,
        trace_context: dict[str, str] | None,
        *,
        album_wait_s: float = 0.0,
        max_files: int | None = None,
    ) -> int | None:
        """Store `message` as a queued row, with its files; its new id, or None when a row of
        the same (channel, external_id) exists (a duplicate: nothing is stored). The row's
        meta lists the files ("attachments": name, mime_type, size, kind), and the files are
        read back by `attachments` in the sender's order.

        A part of an album (`message.album`, with a conversation) joins the album's first
        message (same channel, conversation and album; meta "album") while that one is still
        queued and has room for its files (`max_files`; None: no limit): the files go after
        the first message's, its text on a line after the first message's text, and its row
        is kept, finished at once (`done`, classified_via "album", meta "album_of": the
        first message's id; its channel id taken as any row's). The first message is not
        claimed before `album_wait_s` after the latest part (itself included) came, so that
        the rest of the album can: the latest part says how long. A first message whose voice
        notes were already heard (meta "transcribed") takes no part. A part that finds no such
        message is stored as the first of its album."""
        ...

    async def album_part_dropped(
        self, message: IncomingMessage, wait_s: float, *, max_files: int | None = None
    ) -> bool:
        """A part of an album (`message.album`, with a conversation) that will not be stored:
        its file was refused once downloaded (a type not read, a size not told). The album's
        first message, if one still waits queued to take parts (as `accept` finds it), is not
        claimed before `wait_s` from now, as if the part had come with nothing: its text,
        files and voice flag unchanged, a wait put back for its voice service kept; one that
        is full (`max_files`) waits for no part, as `accept` has it. True when there was
        one. Without this, a first message told that more would come waited the longer wait
        for a part that never did."""
        ...

    async def record_failed(
        self, message: IncomingMessage, error: str, *, conn: Any = None
    ) -> int | None:
        """Keep a message its channel cannot hand over (a mail that failed to store) as a
        `failed` row, finished now, with its envelope only (channel, external_id, source_id,
        subject; the text empty) and `error`; its id, or None when the (channel,
        external_id) row exists. `conn`: in that connection's transaction. The email intake
        calls it through the worker (`InboxWorker.record_unread`)."""
        ...

    async def get(self, inbox_id: int) -> dict[str, Any] | None:
        """The row as a dict of its columns (status, routed_to, reply, error, attempts,
        classified_via...), or None when there is no such row."""
        ...

    async def claim_next(
        self, replica: str, lease_s: float, exclude: Sequence[int] = ()
    ) -> InboxMessage | None:
        """The oldest row that may start now, made `processing` for `replica` with a lease of
        `lease_s` seconds from now and its attempts counted one more; None when none may.
        Not one of `exclude`: the messages `replica` is still at work on, whose leases may
        have run out while the database could not renew them (claimed again, a second task
        asked its butler twice, and each claim counted an attempt: reviews).

        A row may start when it is queued and its `not_before` (a deferral) has passed, or
        it is `processing` and its lease ran out (its replica died). It may not while another
        row of its conversation is older and still queued or processing (deferred or not),
        or holds a lease that has not run out. The message carries how many messages its
        sender (channel, source_id) sent in the hour before it (`earlier_from_sender`, older
        rows only, an album's joined parts not counted) and whether one of them was
        `skipped` (`sender_told`)."""
        ...

    async def renew(self, replica: str, inbox_ids: Sequence[int], lease_s: float) -> set[int]:
        """Extend to `lease_s` from now the leases `replica` holds among `inbox_ids`; the ids
        it still holds: those `processing` for it, and those it finished itself. An id
        missing was taken over by another replica (or released)."""
        ...

    async def release(self, replica: str, inbox_ids: Sequence[int]) -> int:
        """`replica` stops on purpose: the rows of `inbox_ids` it holds go back to `queued`
        in their place, their attempt not counted; how many went back."""
        ...

    async def claimants_under_way(self, name: str) -> list[str]:
        """The distinct claimants of the rows `processing` among the processes named `name`
        (`name` itself, or `name/<anything>`)."""
        ...

    async def requeue_interrupted(self, claimants: Sequence[str]) -> int:
        """At start-up: the rows `processing` for `claimants` (processes gone: a crash
        interrupted them) or for nobody go back to `queued`, their attempts kept (counted
        towards MAX_ATTEMPTS); others' stay theirs. How many went back."""
        ...

    async def finish(
        self,
        inbox_id: int,
        *,
        replica: str,
        status: str,
        routed_to: str | None,
        reply: str | None,
        error: str | None,
        classified_via: str | None = None,
        conn: Any = None,
    ) -> bool:
        """Record the outcome (`status` one of FINISHED, `reply`, `error`; `routed_to` and
        `classified_via` unless None) and end the lease, if `replica` holds the row
        `processing`; False, changing nothing, when it does not (another replica took it
        over). `conn`: a connection of `pool`, to write in its transaction."""
        ...

    async def defer(
        self, inbox_id: int, *, replica: str, delay_s: float, error: str, timed_out: bool = False
    ) -> bool:
        """Put a row `replica` holds back to `queued`, not to be claimed before `delay_s` from
        now (its conversation's later rows waiting behind it), its attempt not counted and
        `error` saying why. Its meta keeps "deferred_since" (the first deferral's time, ISO
        8601) and counts in "timeouts" the deferrals in a row that `timed_out` (0 after one
        that did not). False, changing nothing, when `replica` does not hold it."""
        ...

    async def attachments(self, inbox_id: int) -> list[Attachment]:
        """The row's files as `accept` stored them, in the sender's order."""
        ...

    async def transcribed(
        self, inbox_id: int, *, replica: str, text: str, keep_audio: bool, transcript_at: int = 0
    ) -> bool:
        """A voice note heard: `text` becomes the row's text, its meta gains "voice" and
        "transcribed" (true) and "transcript_at" (where the transcript begins in `text`), and
        unless `keep_audio` its audio files go, from `attachments` and from meta's listing.
        Only while `replica` holds it `processing`; else False."""
        ...

    async def holds_channel(self, channel: str) -> bool:
        """Whether any message of `channel` is stored: a channel's first start on a fleet
        that ran before is no first start (the email intake reads all unread mail then)."""
        ...

    async def sent_last_hour(
        self, channel: str, source_id: str, *, besides_album: str | None = None
    ) -> int:
        """How many rows the sender `source_id` of `channel` has from the last hour, album
        parts not counted: the count a message claimed now would be limited by; with
        `besides_album`, that album's rows (its first message's `album` meta) left out."""
        ...

    async def history(self, message: InboxMessage, exchanges: int) -> list[dict[str, Any]]:
        """The last `exchanges` `done` rows of the message's conversation before it (an
        album's joined parts left out: their words are the first message's), oldest first:
        sender_name, source_id, subject, text, routed_to, reply. Empty without a
        conversation."""
        ...

    async def last_of_conversation(self, conversation: str) -> InboxMessage | None:
        """The newest row of the conversation, whatever its status (whom a notification to
        it goes to); None when there is none."""
        ...

    async def prune(self, older_than_days: int) -> int:
        """Delete the finished rows (and their files) finished more than `older_than_days`
        ago; queued and processing rows stay. How many went."""
        ...


class OutboxQueue(Protocol):
    """The outbox, as the outbox sender, the worker and the notification desk use it.

    A row is `pending`, then `sending` while a sender has it, then `sent` or `failed`; a row
    not taken goes back to `pending` with a time for its next attempt."""

    @property
    def pool(self) -> Pool:
        """The pool whose transactions `add` joins."""
        ...

    async def add(self, conn: Any, messages: Sequence[Outgoing], trace_context: Any) -> None:
        """Queue `messages` as `pending` rows due now, in order (row order is delivery
        order), each with its files, in `conn`'s transaction (a connection of `pool`)."""
        ...

    async def claim(self, channel: str, sender: str, lease_s: float) -> Delivery | None:
        """The channel's next row, made `sending` by `sender` (a process) and its attempts
        counted one more, if it is due; None otherwise. A row is due at its next attempt; one
        `sending` once its lease (`lease_s` after it was taken, or last renewed) is up,
        whoever its sender (another may still be sending it; a send cut short may have
        reached the channel). Rows go
        strictly in order: only each recipient's oldest unsent (pending or sending) row may
        go, and none after the channel's oldest such row that is not held for its recipient
        only (`later(held_for_recipient=True)`). The delivery carries the row's files."""
        ...

    async def head_due_in_s(self, channel: str) -> float | None:
        """Seconds (0 when already due) until a row `claim` may take is due; None when the
        channel has none."""
        ...

    async def sent(self, delivery_id: int, sent_ids: Sequence[str]) -> None:
        """The channel took the row: `sent`, with the channel's own ids of what it sent."""
        ...

    async def later(
        self,
        delivery_id: int,
        error: str,
        delay_s: float,
        *,
        held_for_recipient: bool = False,
        sender: str | None = None,
    ) -> None:
        """The channel did not take the row: `pending` again, due `delay_s` from now, with
        `error`; `held_for_recipient`: it holds back only its recipient's later rows.
        `sender`: only if the row is still `sending` by it (one whose lease ran out may have
        been sent by another since); None: whatever its state."""
        ...

    async def failed(self, delivery_id: int, error: str, *, sender: str | None = None) -> None:
        """The row is given up: `failed`, with `error` (`sender`: as for `later`)."""
        ...

    async def renew(self, delivery_id: int, sender: str, lease_s: float) -> bool:
        """`sender` is still sending the row: due to others `lease_s` from now. False when
        the row is not `sending` by it any more."""
        ...

    async def butler_answering(
        self, channel: str, recipient: str, sent_ids: Sequence[str], within_days: int
    ) -> str | None:
        """The butler of the newest `sent` row to `recipient` on `channel` whose sent ids
        include one of `sent_ids`, created within `within_days`; None when none."""
        ...

    async def notifications_last_hour(self, butler: str) -> int:
        """How many notifications `butler` queued in the last hour (the rows of one are
        counted once: same conversation, same time)."""
        ...

    async def prune(self, older_than_days: int) -> int:
        """Delete the `sent` and `failed` rows (and their files) created more than
        `older_than_days` ago; what is still to send stays. How many went."""
        ...


class RoutingLog(Protocol):
    """The registry and the routing log, as the worker and the notification desk use them."""

    async def registry(self) -> list[dict[str, Any]]:
        """Every butler of the registry (name, endpoint_url, description, modules, stale,
        is_switchboard...), by name."""
        ...

    async def record_route(self, record: RouteRecord) -> object:
        """Log one route or notification. The row is taken before the first await: a caller
        cancelled while it waits for the write still has its row written (route relies on
        it)."""
        ...

    async def handed_before(self, inbox_id: int, since: datetime | None) -> list[tuple[str, bool]]:
        """The butlers whose `trigger` inbox message `inbox_id` was handed to (since `since`:
        its requeue by the operator), in the order it first was, each with whether one of
        those routes answered."""
        ...

    async def prune(self, older_than_days: int) -> int:
        """Delete the log's rows older than `older_than_days`; how many went."""
        ...


if TYPE_CHECKING:
    # The PostgreSQL stores implement the protocols (mypy checks these lines); the in-memory
    # ones are checked the same way in butlers.switchboard.memory_store.
    from butlers.switchboard.inbox import InboxStore
    from butlers.switchboard.outbox import OutboxStore
    from butlers.switchboard.routing_store import RoutingStore

    def _implements(
        inbox: InboxStore, outbox: OutboxStore, routing: RoutingStore
    ) -> tuple[InboxQueue, OutboxQueue, RoutingLog]:
        return inbox, outbox, routing
