"""A mail that arrives while the email module is busy is taken before the module idles, not at
the next push or the IDLE renewal 25 minutes later.

A server announces a new mail once, with an untagged `* <n> EXISTS`: during an IDLE, or in
the answer to whichever command the module sends next (a FETCH, a STORE, the SEARCH itself).
pymap's SEARCH covers only the mails it has announced to the session, and its IDLE reports
only what changes once it idles. So a mail announced outside an IDLE, after the module's
UID SEARCH began, is taken only if the module searches again before it idles.

Real pymap, the email module handing mail to a RecordingWorker; each test notes what the
module had taken each time it was idling (the server had confirmed the IDLE), and appends
its second mail at a chosen point between a SEARCH and the IDLE after it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aioimaplib
import pytest

from butlers.modules import mail_imap
from butlers.modules.mail_transport import Arrivals
from butlers.switchboard.inbox import IncomingMessage
from tests.fakes.mail import RecordingWorker, imap_append, imap_unseen, pymap_server
from tests.test_email import mail
from tests.test_email_tls import PASSWORD, USER, email_config, running


def idling(monkeypatch: pytest.MonkeyPatch, worker: RecordingWorker) -> asyncio.Queue[list[str]]:
    """Each time the module waits in an IDLE the server confirmed: the ids it had taken."""
    taken: asyncio.Queue[list[str]] = asyncio.Queue()
    wait_server_push = aioimaplib.IMAP4.wait_server_push

    async def waiting(client: aioimaplib.IMAP4, *args: Any, **kwargs: Any) -> Any:
        taken.put_nowait(list(worker.ids))
        return await wait_server_push(client, *args, **kwargs)

    monkeypatch.setattr(aioimaplib.IMAP4, "wait_server_push", waiting)
    return taken


async def test_a_mail_that_arrives_while_the_one_before_is_taken_is_taken_before_idling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second mail is appended while the worker holds the first: after the module's SEARCH
    (which found the first only), before its IDLE. pymap announces it in its answer to the
    module's next command (the STORE that flags the first \\Seen)."""
    worker = RecordingWorker()
    accept = worker.accept
    holding, release = asyncio.Event(), asyncio.Event()

    async def held_accept(message: IncomingMessage) -> int | None:
        if message.external_id == "<first@x>":
            holding.set()
            await release.wait()
        return await accept(message)

    monkeypatch.setattr(worker, "accept", held_accept)
    taken = idling(monkeypatch, worker)
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        async with running(email_config(imap_port=port), worker), asyncio.timeout(30):
            assert await taken.get() == []  # idling on an empty INBOX
            await imap_append(port, USER, PASSWORD, mail(message_id="<first@x>"))
            await holding.wait()
            await imap_append(port, USER, PASSWORD, mail(message_id="<second@x>"))
            release.set()
            at_next_idle = await taken.get()
        unseen = await imap_unseen(port, USER, PASSWORD)
    assert at_next_idle == ["<first@x>", "<second@x>"]
    assert unseen == []


async def test_a_mail_announced_in_the_answer_to_the_search_is_searched_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mail is appended just before the module's first UID SEARCH goes out (after its
    SELECT found the INBOX empty): pymap's SEARCH does not see it yet and its answer carries
    the `* 1 EXISTS`, which aioimaplib files under no command. Searching again only after a
    search that found something would not take it either: this one found nothing."""
    worker = RecordingWorker()
    taken = idling(monkeypatch, worker)
    fetch_unseen = mail_imap.ImapIntake._fetch_unseen
    searches = 0

    async def appending_first(intake: mail_imap.ImapIntake, *args: Any) -> bool:
        nonlocal searches
        searches += 1
        if searches == 1:
            await imap_append(port, USER, PASSWORD, mail(message_id="<early@x>"))
        return await fetch_unseen(intake, *args)

    monkeypatch.setattr(mail_imap.ImapIntake, "_fetch_unseen", appending_first)
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        async with running(email_config(imap_port=port), worker), asyncio.timeout(30):
            at_first_idle = await taken.get()
        unseen = await imap_unseen(port, USER, PASSWORD)
    assert at_first_idle == ["<early@x>"]
    assert unseen == []


def test_arrivals_count_a_larger_mailbox_only() -> None:
    """EXISTS sets the size the server announced, EXPUNGE lowers it: a repeated EXISTS is no
    arrival (counting it would search forever on a server that repeats it), and a mail that
    takes an expunged one's place is one."""
    arrivals = Arrivals()
    for line, count in [
        (b"* 2 EXISTS", 1),  # SELECT
        (b"* 2 EXISTS", 1),
        (b"* 1 RECENT", 1),
        (b"* 3 exists", 2),
        (b"* 1 EXPUNGE", 2),
        (b"* 1 FETCH (FLAGS (\\Seen) UID 3)", 2),
        (b"* 3 EXISTS", 3),
        (b"* OK [UIDNEXT 12] 3 EXISTS", 3),
        (b"* 13 EXISTS", 4),
    ]:
        arrivals.saw(line)
        assert arrivals.count == count, line


async def test_one_mail_ends_one_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """pymap announces a mail in an IDLE with three lines (EXISTS, RECENT, FETCH), often in
    as many reads, and aioimaplib queues each read as a push: the first ends the IDLE, and
    left queued, the others would end the next IDLEs at once, each for a DONE and a SEARCH
    that find nothing. So after the first mail, the next time the module idles it has the
    second."""
    worker = RecordingWorker()
    taken = idling(monkeypatch, worker)
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        async with running(email_config(imap_port=port), worker), asyncio.timeout(30):
            assert await taken.get() == []
            await imap_append(port, USER, PASSWORD, mail(message_id="<first@x>"))
            assert await taken.get() == ["<first@x>"]
            await imap_append(port, USER, PASSWORD, mail(message_id="<second@x>"))
            at_next_idle = await taken.get()
    assert at_next_idle == ["<first@x>", "<second@x>"]
