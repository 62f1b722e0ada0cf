"""IMAP intake for the email module: one connection at a time (IDLE, or polling), every unseen
mail taken in bounded steps and flagged \\Seen only once it is settled.

Taking one mail (`ImapIntake._take`), cheapest step first, so that no mail can exhaust the
memory, freeze the event loop (every butler of `butlers up` shares it) or crash-loop the
process:

1. FETCH its FLAGS, RFC822.SIZE and at most MAX_HEADER_BLOCK_BYTES of its header.
2. Read the envelope from that header alone, in a worker thread (`parse_header`: a header we
   read that is longer than MAX_HEADER_BYTES is refused unparsed). Strangers, bounces, our
   own mail and a failed DMARC check end here, flagged \\Seen and logged.
3. A mail over its size limit (`mail_limit`), with a header we will not read, or carrying
   both TRIED_KEYWORD and TRIED_AGAIN_KEYWORD (step 4) is not read: its envelope is kept as
   a failed inbox row, and it is flagged \\Seen.
4. Mark it with the keyword TRIED_KEYWORD, fetch it (at most that limit, whatever
   RFC822.SIZE said) and parse it in a worker thread. Should the process die meanwhile (the
   kernel's OOM killer, say), the mail carries the keyword at the next start: it is read
   once more, marked TRIED_AGAIN_KEYWORD too (the process may have died of something else:
   a switchboard replica's leader killed while it read a mail, whose successor then refused
   that mail, a walkthrough), and after a second death step 3 keeps it from being read
   again: without that, it would crash the process at every start. A clean stop removes
   the keywords; a server that keeps no keywords (PERMANENTFLAGS without \\*) is used
   without this protection, which is logged.
5. Store it, flag it \\Seen, remove the keyword. A mail that cannot be stored is tried
   MAX_MAIL_FAILURES times, then recorded as failed; one that cannot be parsed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from butlers.backoff import RECONNECT
from butlers.context import ModuleStatus
from butlers.errors import MailError, MailRefused
from butlers.media import human_size
from butlers.modules.mail_limits import MAX_HEADER_BLOCK_BYTES, mail_limit
from butlers.modules.mail_parse import ParsedMail, parse_header, parse_mail
from butlers.modules.mail_transport import (
    describe,
    imap_close,
    imap_connect,
    watch_arrivals,
)
from butlers.tasks import within

if TYPE_CHECKING:
    import aioimaplib

    from butlers.channels.base import ChannelState
    from butlers.modules.email import EmailModule

# The email module's logger: one place to listen for what happens to mail.
logger = logging.getLogger("butlers.modules.email")

# An IDLE is ended and begun again this often: servers may drop one after 29 minutes (RFC
# 2177), and a connection that went silent without closing (a proxy or NAT that stopped
# passing data) is noticed only when the renewal's DONE gets no answer: mail waited up to
# 25 minutes (a walkthrough). TCP keepalive (mail_transport.keep_alive) finds a dead peer.
IDLE_RENEW_S = 5 * 60
HEALTHY_CONNECTION_S = 60  # a connection that lasted this long was a working one
MAX_MAIL_FAILURES = 3  # a mail that cannot be stored this often is recorded as failed, skipped
RETRY_FAILED_S = 5.0  # how soon a mail that could not be stored is tried again (at most)
TRIED_KEYWORD = "$ButlersTried"  # set while a mail is read (step 4 above)
TRIED_AGAIN_KEYWORD = "$ButlersTriedAgain"  # ... and while it is read once more
OUR_KEYWORDS = frozenset({TRIED_KEYWORD, TRIED_AGAIN_KEYWORD})
UNMARK_TIMEOUT_S = 2.0  # removing the keyword when stopping: no longer than this
# Unread mail already in the mailbox at the first start is left alone, but for what came in
# this long before it (the owner's first mail, sent before `butlers up`; mail that came while
# a fleet was stopped to upgrade): pointed at a mailbox of years, the first start answered
# the owner's unread mails from 2023 as if just written (a walkthrough).
FIRST_START_LOOKBACK_S = 24 * 3600
FIRST_UID_KEY = "first_uid:"  # in the channel's state, by mailbox
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")

_UIDVALIDITY = re.compile(rb"\[UIDVALIDITY (\d+)\]")
_UIDNEXT = re.compile(rb"\[UIDNEXT (\d+)\]")
_FETCH_INTERNALDATE = re.compile(rb'\bINTERNALDATE "([^"]+)"')
_PERMANENTFLAGS = re.compile(rb"\[PERMANENTFLAGS \(([^)]*)\)\]")
_FETCH_START = re.compile(rb"\d+ FETCH \(")
_FETCH_UID = re.compile(rb"\bUID (\d+)")
_FETCH_FLAGS = re.compile(rb"\bFLAGS \(([^)]*)\)")
_FETCH_SIZE = re.compile(rb"\bRFC822\.SIZE (\d+)")


@dataclass(frozen=True)
class Fetched:
    """One message's data in a FETCH response."""

    flags: frozenset[str]
    size: int | None  # RFC822.SIZE, when asked for
    literal: bytes | None  # the body section asked for
    arrived: datetime | None = None  # INTERNALDATE, when asked for: when the server took it


def fetched(lines: list[Any], uid: str) -> Fetched | None:
    """Message `uid`'s data in a FETCH response's lines (aioimaplib gives a literal as a
    bytearray between the text before and after it); None when the server has no such
    message any more. A server may add unsolicited FETCH data of other messages (flag
    changes), and may put UID and FLAGS before or after the literal."""
    for i, line in enumerate(lines):
        if isinstance(line, bytearray) or not isinstance(line, bytes):
            continue
        if not _FETCH_START.match(line):
            continue
        text, literal = line, None
        if i + 1 < len(lines) and isinstance(lines[i + 1], bytearray):
            literal = bytes(lines[i + 1])
            after = lines[i + 2] if i + 2 < len(lines) else b""
            if isinstance(after, bytes) and not _FETCH_START.match(after):
                text += b" " + after
        found = _FETCH_UID.search(text)
        if found is None or found.group(1).decode() != uid:
            continue
        flags = _FETCH_FLAGS.search(text)
        size = _FETCH_SIZE.search(text)
        arrived = _FETCH_INTERNALDATE.search(text)
        return Fetched(
            flags=frozenset(flags.group(1).decode(errors="replace").split() if flags else ()),
            size=int(size.group(1)) if size else None,
            literal=literal,
            arrived=internal_date(arrived.group(1).decode()) if arrived else None,
        )
    return None


def internal_date(text: str) -> datetime | None:
    """An IMAP date-time (`28-Nov-2026 05:41:01 +0000`, RFC 3501), or None."""
    try:
        day, month, rest = text.strip().split("-", 2)
        numbered = f"{int(day):02}-{_MONTHS.index(month.title()) + 1:02}-{rest}"
        return datetime.strptime(numbered, "%d-%m-%Y %H:%M:%S %z")
    except ValueError:
        return None


def search_date(moment: datetime) -> str:
    """A date as IMAP SEARCH takes it (`SINCE 27-Nov-2026`), the month's name not the
    locale's."""
    return f"{moment.day}-{_MONTHS[moment.month - 1]}-{moment.year}"


def keywords_kept(select_lines: list[Any]) -> frozenset[str]:
    """Which of TRIED_KEYWORD and TRIED_AGAIN_KEYWORD the selected mailbox keeps across
    connections: those PERMANENTFLAGS names, or both with \\* (any keyword may be created).
    Without PERMANENTFLAGS, RFC 3501 says to assume every flag is permanent.

    aioimaplib deletes every "* " from an untagged line, so a `\\*` followed by another flag
    (pymap sorts it first: `(\\* \\Answered ...)`) reaches us as `(\\\\Answered ...)`."""
    for line in select_lines:
        if isinstance(line, bytes | bytearray) and (found := _PERMANENTFLAGS.search(line)):
            flags = found.group(1).decode(errors="replace").split()
            wildcard = "\\*" in flags or any(flag.startswith("\\\\") for flag in flags)
            return OUR_KEYWORDS if wildcard else OUR_KEYWORDS & frozenset(flags)
    return OUR_KEYWORDS


class ImapIntake:
    """The IMAP side of an EmailModule: its connections, and each mail's way into the inbox."""

    def __init__(self, module: EmailModule) -> None:
        self.module = module
        self.server = module.imap_server
        self._mail_limit = mail_limit(module.config.max_attachment_bytes)
        # Failed attempts to store a mail, per "<UIDVALIDITY>:<UID>" (see _store).
        self._failures: dict[str, int] = {}
        # Mails this process marked with TRIED_KEYWORD: a retry of ours, not a crash's remains.
        self._marked: set[str] = set()
        self._keywords = True
        # The mailbox keeps TRIED_AGAIN_KEYWORD too: a mail whose reading never finished once
        # is read once more (without it, not: as before that keyword, rather than no guard).
        self._again = True
        self._told_no_keywords = False
        self._first_uid = 1  # the first UID of the mailbox it reads (_first_to_read)
        self._lost = asyncio.Event()  # the current connection dropped

    # -- connections ----------------------------------------------------------------------------

    async def run(self) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                await self._connection()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A connection that worked for a while: reconnect quickly. One that ends as soon
                # as it starts (the database refusing even to record a failed mail, say) backs
                # off, or it would reconnect every second for as long as that lasts.
                if time.monotonic() - started >= HEALTHY_CONNECTION_S:
                    failures = 0
                delay = RECONNECT.delay(failures)
                failures += 1
                why = (
                    str(exc)
                    if isinstance(exc, MailError)
                    else f"{self.server.where}: {describe(exc)}"
                )
                # A refusal (untrusted certificate, no STARTTLS, login refused) needs someone
                # to act: "failed", though we keep trying in case they did.
                refused = isinstance(exc, MailRefused)
                self.module.status = ModuleStatus(
                    self.module.name,
                    "failed" if refused else "starting",
                    f"{why}; retrying in {delay}s",
                )
                if refused:
                    logger.error(
                        "email: IMAP refused: %s; trying again in %ss",
                        why,
                        delay,
                        extra={"action": "mail_refused"},
                    )
                else:
                    logger.warning(
                        "email: IMAP connection ended (%s); reconnecting in %ss", why, delay
                    )
                await asyncio.sleep(delay)

    async def _connection(self) -> None:
        # Set when the connection drops: aioimaplib wakes neither an IDLE wait nor a pending
        # command by itself (a command would wait for its timeout).
        lost = self._lost = asyncio.Event()

        def on_lost(_exc: Exception | None) -> None:
            lost.set()

        module = self.module
        client = await imap_connect(
            self.server,
            module.username,
            module.password,
            context=module.tls_context,
            on_lost=on_lost,
        )
        try:
            arrivals = watch_arrivals(client)
            selected = await self._ok(client.select("INBOX"), "SELECT INBOX")
            uidvalidity = next(
                (
                    m.group(1).decode()
                    for line in selected.lines
                    if isinstance(line, bytes | bytearray) and (m := _UIDVALIDITY.search(line))
                ),
                "",
            )
            kept = keywords_kept(selected.lines)
            self._keywords, self._again = TRIED_KEYWORD in kept, TRIED_AGAIN_KEYWORD in kept
            if not self._keywords:
                self._no_keywords("its PERMANENTFLAGS allow no keywords")
            self._first_uid = await self._first_to_read(client, uidvalidity, selected.lines)
            use_idle = module.config.mode == "idle" and client.has_capability("IDLE")
            module.status = ModuleStatus(
                module.name,
                "running",
                f"{'IDLE' if use_idle else 'polling'} on {self.server.host}:{self.server.port}",
            )
            while True:
                announced = arrivals.count
                retry = await self._fetch_unseen(client, uidvalidity)
                if retry:  # a mail could not be stored: try it again soon, not at the IDLE renewal
                    await self._wait(min(RETRY_FAILED_S, module.config.poll_interval_s))
                elif arrivals.count != announced:
                    # A mail was announced (EXISTS) after the UID SEARCH began, in the answer
                    # to it or to a FETCH or STORE since (aioimaplib drops those: see
                    # watch_arrivals). The search may not have had it (pymap searches only the
                    # mails it had announced), and a server announces a mail once: the IDLE
                    # would not report it, and it would wait for the next mail or the renewal
                    # minutes later. So search again: IDLE only after a search with no
                    # announcement since it began. Costs one SEARCH after a batch in which mail
                    # arrived. What arrives later is the IDLE's to report (pymap's only once
                    # something else changes, should it come in the instant before the IDLE).
                    continue
                elif use_idle:
                    await self._idle(client)
                else:
                    await self._wait(module.config.poll_interval_s)
        finally:
            await imap_close(client)

    def _no_keywords(self, why: str) -> None:
        self._keywords = False
        if not self._told_no_keywords:
            self._told_no_keywords = True
            logger.warning(
                "email: %s keeps no %s keyword (%s): a mail that crashes the process while it "
                "is read would be read again at every start",
                self.server.where,
                TRIED_KEYWORD,
                why,
            )

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
            raise MailError(f"{self.server.where}: the connection was lost")
        return step.result()

    async def _wait(self, seconds: float) -> None:
        await self._until_lost(asyncio.sleep(seconds))

    async def _idle(self, client: aioimaplib.IMAP4) -> None:
        """IDLE until the server pushes something, the connection drops, or it is time to renew."""
        # aioimaplib queues every read of an IDLE's lines as one push: pymap's EXISTS, RECENT
        # and FETCH for one mail are often three. The first ended the last IDLE; the others
        # (and lines that came after our DONE) came before the SEARCH that followed it, which
        # covered them. Left queued, each would end this IDLE at once, for a DONE and a
        # SEARCH that find nothing.
        pushes = client.protocol.idle_queue
        while not pushes.empty():
            pushes.get_nowait()
        idle = await self._until_lost(client.idle_start(timeout=IDLE_RENEW_S))
        with contextlib.suppress(TimeoutError):  # a timeout: renew the IDLE before it is dropped
            await self._until_lost(client.wait_server_push(timeout=IDLE_RENEW_S))
        client.idle_done()
        await self._until_lost(within(idle, 30))

    async def _ok(self, awaitable: Any, what: str) -> Any:
        response = await self._until_lost(awaitable)
        if response.result != "OK":
            raise MailError(f"{self.server.where}: {what} failed: {response.lines[-1:]!r}")
        return response

    # -- one mail at a time ---------------------------------------------------------------------

    async def _first_to_read(
        self, client: aioimaplib.IMAP4, uidvalidity: str, select_lines: list[Any]
    ) -> int:
        """The first UID of the mailbox this intake reads (1: every unread mail), chosen at
        its first start (`_first_start_uid`) and kept in the channel's state by mailbox. A
        mailbox made anew (another UIDVALIDITY: its UIDs start again) has every unread mail
        read, as before (one answered already is known by its Message-ID)."""
        state = self.module.state
        if state is None:
            return 1
        key = f"{FIRST_UID_KEY}{self.module.username}@{self.server.host}:{self.server.port}/INBOX"
        kept = await state.get(key)
        if isinstance(kept, dict) and kept.get("uidvalidity") == uidvalidity:
            uid = kept.get("uid")
            if isinstance(uid, int) and uid >= 1:
                return uid
        if kept is None and await self._upgraded(state):
            # A fleet that read this channel before this was kept (an upgrade): its unread
            # mail is what came while it was stopped, all of it to read.
            first = 1
        elif kept is None:
            first = await self._first_start_uid(client, select_lines)
        else:
            first = 1
            logger.warning(
                "email: %s INBOX was made anew (UIDVALIDITY %s): its unread mail is read",
                self.server.where,
                uidvalidity,
            )
        await state.set(key, {"uidvalidity": uidvalidity, "uid": first})
        return first

    async def _upgraded(self, state: ChannelState) -> bool:
        """Whether this is a fleet that read mail before it kept where it reads from (an
        upgrade): no mailbox's first UID is kept, yet its inbox holds mail. Once one is
        kept, a mailbox without one is a new one (another server or port: its old mail was
        answered, years of it, as an upgrade's: a walkthrough)."""
        if await state.holds_any(FIRST_UID_KEY):
            return False
        worker = self.module.worker
        return worker is not None and await worker.inbox.holds_channel("email")

    async def _first_start_uid(self, client: aioimaplib.IMAP4, select_lines: list[Any]) -> int:
        """At the first start: the first UID past what the mailbox held then, but for unread
        mail that came in the FIRST_START_LOOKBACK_S before (by its INTERNALDATE, the
        server's arrival time: SEARCH SINCE takes whole days, in the server's zone). What
        stays unread before it is left alone, untouched, and said once."""
        found = next(
            (
                int(m.group(1))
                for line in select_lines
                if isinstance(line, bytes | bytearray) and (m := _UIDNEXT.search(line))
            ),
            None,
        )
        if found is None:  # (RFC 3501 requires it; a server that leaves it out: the highest)
            every = await self._ok(client.uid_search("ALL"), "UID SEARCH ALL")
            found = max(
                (int(u) for u in (every.lines[0].split() if every.lines else [])), default=0
            )
            found += 1
        first = found
        since = datetime.now(UTC) - timedelta(seconds=FIRST_START_LOOKBACK_S)
        day = search_date(since - timedelta(days=1))
        recent = await self._ok(client.uid_search("UNSEEN", f"SINCE {day}"), "UID SEARCH SINCE")
        candidates = recent.lines[0].split() if recent.lines else []
        if candidates:
            # As a range: thousands of UIDs listed one by one outgrew a server's command line.
            numbers, unseen = [int(u) for u in candidates], set(candidates)
            uids = f"{min(numbers)}:{max(numbers)}"
            dates = await self._ok(client.uid("fetch", uids, "(UID INTERNALDATE)"), "UID FETCH")
            for line in dates.lines:
                if not isinstance(line, bytes | bytearray):
                    continue
                uid, at = _FETCH_UID.search(line), _FETCH_INTERNALDATE.search(line)
                if uid is None or at is None or uid.group(1) not in unseen:
                    continue  # (the range holds read mail too)
                arrived = internal_date(at.group(1).decode())
                if arrived is not None and arrived >= since:
                    first = min(first, int(uid.group(1)))
        if first > 1:
            older = await self._ok(
                client.uid_search("UNSEEN", f"UID 1:{first - 1}"), "UID SEARCH UNSEEN"
            )
            left = [u for u in (older.lines[0].split() if older.lines else []) if int(u) < first]
            if left:
                logger.warning(
                    "email: %d unread mails were in %s INBOX for more than a day before its "
                    "first start: left alone, not read (move one out of INBOX and back to have "
                    "it read)",
                    len(left),
                    self.server.where,
                    extra={"action": "mail_left_alone"},
                )
        return first

    async def _fetch_unseen(self, client: aioimaplib.IMAP4, uidvalidity: str) -> bool:
        """Take every unseen mail from the first UID it reads; True when one could not be
        stored (try again soon)."""
        criteria = ("UNSEEN",) if self._first_uid <= 1 else ("UNSEEN", f"UID {self._first_uid}:*")
        response = await self._ok(client.uid_search(*criteria), "UID SEARCH UNSEEN")
        uids = [uid.decode() for uid in response.lines[0].split()] if response.lines else []
        # (`N:*` holds the highest UID even when it is below N.)
        uids = [uid for uid in uids if int(uid) >= self._first_uid]
        retry = False
        for uid in uids:
            if not await self._take(client, uidvalidity, uid):
                retry = True
        return retry

    async def _take(self, client: aioimaplib.IMAP4, uidvalidity: str, uid: str) -> bool:
        """Steps 1-3 of the module docstring; False when the mail is to be tried again."""
        key = f"{uidvalidity}:{uid}"
        items = (
            "(UID FLAGS RFC822.SIZE INTERNALDATE "
            f"BODY.PEEK[HEADER]<0.{MAX_HEADER_BLOCK_BYTES + 1}>)"
        )
        head = await self._fetch(client, uid, items)
        if head is None:
            return True  # expunged meanwhile
        header = head.literal or b""
        complete = len(header) <= MAX_HEADER_BLOCK_BYTES
        envelope = await asyncio.to_thread(
            parse_header, header[:MAX_HEADER_BLOCK_BYTES], complete=complete
        )
        if head.arrived is not None:
            # When it was sent, as the handoff tells a butler: the server's arrival time, not
            # the Date its sender's program wrote (a review: it may say 1970).
            envelope = replace(envelope, sent_at=head.arrived.isoformat())
        left_marked = TRIED_KEYWORD in head.flags
        # Marked by an attempt that never finished (not a retry of ours): read once more.
        again = left_marked and key not in self._marked
        if not await self.module.wanted(envelope):
            await self._settle(client, key, uid, marked=left_marked)
            return True
        problem = envelope.unreadable
        limit = self._mail_limit
        if problem is None and head.size is not None and head.size > limit:
            problem = (
                f"it is {human_size(head.size)}, over the limit of {human_size(limit)} for a "
                "mail (room for one attachment of [modules.email] max_attachment_bytes)"
            )
        if problem is None and again and (TRIED_AGAIN_KEYWORD in head.flags or not self._again):
            times = "two attempts" if self._again else "an earlier attempt"
            problem = (
                f"{times} to read it never finished (the process stopped or died meanwhile), "
                "so it is not read again"
            )
        if problem is not None:
            await self._give_up(envelope, uid, head.size, problem)
            await self._settle(client, key, uid, marked=left_marked)
            return True
        if again:
            logger.warning(
                "email: an earlier attempt to read mail uid %s (%r) never finished (a "
                "process stopped or died meanwhile); reading it once more",
                uid,
                envelope.message_id[:200],
                extra={"action": "email_read_again"},
            )
        return await self._read(client, key, uid, envelope, head.size, again=again)

    async def _read(
        self,
        client: aioimaplib.IMAP4,
        key: str,
        uid: str,
        envelope: ParsedMail,
        size: int | None,
        *,
        again: bool = False,
    ) -> bool:
        """Steps 4-5 of the module docstring; False when the mail is to be tried again."""
        marked = await self._mark(client, key, uid, again=again)
        try:
            limit = self._mail_limit
            body = await self._fetch(client, uid, f"(UID BODY.PEEK[]<0.{limit + 1}>)")
            if body is None:
                self._marked.discard(key)
                return True  # expunged meanwhile
            raw = body.literal or b""
            try:
                mail = await asyncio.to_thread(parse_mail, raw, limit)
            except Exception as exc:  # MailUnreadable, or the stdlib failing on hostile input
                await self._give_up(envelope, uid, size, f"it cannot be read: {describe(exc)}")
                await self._settle(client, key, uid, marked=marked)
                return True
            mail = replace(mail, sent_at=envelope.sent_at)  # the server's time (_take)
            if await self._store(key, mail):
                await self._settle(client, key, uid, marked=marked)
                return True
            if marked:  # it was read without harm: a retry may read it, even after a restart
                await self._unmark(client, uid)
            return False
        except asyncio.CancelledError:
            if marked:  # stopping, not crashing: the next start may read it
                with contextlib.suppress(Exception):
                    await within(self._unmark(client, uid), UNMARK_TIMEOUT_S)
            raise
        except Exception:
            # Not the mail's doing (the database is down, the connection went): the mark
            # must not outlive this, or the next start takes it for a crash and drops the
            # mail. Best effort: a connection that is gone cannot remove it.
            if marked:
                with contextlib.suppress(Exception):
                    await within(self._unmark(client, uid), UNMARK_TIMEOUT_S)
            raise

    async def _fetch(self, client: aioimaplib.IMAP4, uid: str, items: str) -> Fetched | None:
        response = await self._ok(client.uid("fetch", uid, items), f"UID FETCH {uid}")
        return fetched(response.lines, uid)

    async def _mark(self, client: aioimaplib.IMAP4, key: str, uid: str, *, again: bool) -> bool:
        if not self._keywords:
            return False
        keywords = f"{TRIED_KEYWORD} {TRIED_AGAIN_KEYWORD}" if again else TRIED_KEYWORD
        store = client.uid("store", uid, f"+FLAGS ({keywords})")
        response = await self._until_lost(store)
        if response.result != "OK":
            self._no_keywords(f"STORE {TRIED_KEYWORD} answered {response.lines[-1:]!r}")
            return False
        self._marked.add(key)
        return True

    async def _unmark(self, client: aioimaplib.IMAP4, uid: str) -> None:
        """Remove our keywords (a NO changes nothing that matters: they are only left
        behind)."""
        keywords = f"{TRIED_KEYWORD} {TRIED_AGAIN_KEYWORD}"
        await self._until_lost(client.uid("store", uid, f"-FLAGS ({keywords})"))

    async def _settle(self, client: aioimaplib.IMAP4, key: str, uid: str, *, marked: bool) -> None:
        await self._ok(client.uid("store", uid, "+FLAGS (\\Seen)"), f"STORE {uid} \\Seen")
        if marked:
            await self._unmark(client, uid)
        self._marked.discard(key)

    async def _store(self, key: str, mail: ParsedMail) -> bool:
        """Store one mail; True when it may be flagged seen.

        A mail that cannot be stored is left unread and tried again; after MAX_MAIL_FAILURES
        attempts its envelope is recorded as a failed inbox row and it is let go, so one mail
        can never block the mailbox. If even that record fails (the database is down, not
        the mail at fault) it stays unread, and the next attempt tries to store it again.
        """
        try:
            await self.module.store(mail)
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
            await self.module.record_failed(
                mail, f"could not be stored {failures} times: {describe(exc)}"
            )
        self._failures.pop(key, None)
        return True

    async def _give_up(
        self, envelope: ParsedMail, uid: str, size: int | None, problem: str
    ) -> None:
        """Keep a mail we will not read as a failed inbox row (what its header said, and why),
        its sender told why (they are one who may write: `wanted` said so)."""
        where = f"{self.server.where} UID {uid}" + (f", {size} bytes" if size is not None else "")
        await self.module.record_failed(envelope, f"{problem} ({where})", unread=problem)
