"""The first start of the email intake against a mailbox that already holds mail: unread
mail from before it is left alone (but for the last day's), untouched, and stays so at every
later start; what comes after it is read. On a real pymap and a real PostgreSQL (where the
channel keeps its first UID)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from butlers.channels.base import ChannelState
from butlers.core_store import CoreStore
from butlers.db import create_pool
from butlers.modules import mail_imap
from butlers.modules.email import EmailModule
from tests.conftest import log_records
from tests.fakes.mail import RecordingWorker, imap_append, imap_flags, pymap_server
from tests.test_email import mail
from tests.test_email_tls import PASSWORD, USER, email_config


@contextlib.asynccontextmanager
async def reading(
    port: int, state: ChannelState, *, holds_mail: bool = False
) -> AsyncIterator[RecordingWorker]:
    """The email intake on `port`, leading, for the block's length; `holds_mail`: the inbox
    holds mail already (a fleet that ran before)."""
    worker = RecordingWorker()
    worker.inbox.holds_mail = holds_mail
    module = EmailModule(email_config(imap_port=port), USER, PASSWORD, worker, state=state)  # type: ignore[arg-type]
    await module.open()
    await module.lead()
    try:
        yield worker
    finally:
        await module.close()


@pytest.mark.parametrize(
    "internal_date", ["28-Nov-2026 05:41:01 +0000", " 1-Feb-2023 23:59:59 -0500"]
)
def test_an_imap_date_is_read_whatever_the_locale(internal_date: str) -> None:
    read = mail_imap.internal_date(internal_date)
    assert read is not None and read.tzinfo is not None
    assert mail_imap.search_date(datetime(2026, 3, 7, tzinfo=UTC)) == "7-Mar-2026"


@pytest.mark.proc  # pymap is a process of its own
async def test_the_first_start_leaves_old_unread_mail_alone(pg_server, make_database) -> None:
    """Pointed at a mailbox of years, the first start answered the owner's unread mails from
    2023 as if just written (a walkthrough). Now mail older than a day before the first start
    is left alone, unflagged, then and at every later start; the day's is read (the owner's
    first mail, sent before `butlers up`), and so is all that comes after."""
    pool = await create_pool(pg_server, await make_database(), max_size=2)
    state = ChannelState(CoreStore(pool), "email")
    now = datetime.now(UTC)
    try:
        async with pymap_server(USER, PASSWORD, fast_login=True) as port:
            for n, age in enumerate((timedelta(days=900), timedelta(days=2), timedelta(hours=3))):
                old = mail(subject=f"written {age} ago", message_id=f"<old{n}@example.com>")
                await imap_append(port, USER, PASSWORD, old, date=now - age)
            with log_records("butlers.modules.email") as records:
                async with reading(port, state) as worker:
                    await worker.wait_for("<old2@example.com>")
                    await imap_append(port, USER, PASSWORD, mail(message_id="<new1@example.com>"))
                    await worker.wait_for("<new1@example.com>")
            assert worker.ids == ["<old2@example.com>", "<new1@example.com>"]
            # When it was sent, as the butler is told: the server's arrival time (its Date,
            # its sender's program's, may say anything).
            arrived = datetime.fromisoformat(worker.accepted[0].meta["sent_at"])
            assert abs(arrived - (now - timedelta(hours=3))) < timedelta(seconds=2)
            said = [r.getMessage() for r in records if "left alone" in r.getMessage()]
            assert len(said) == 1 and said[0].startswith("email: 2 unread mails were in")
            flags = await imap_flags(port, USER, PASSWORD)
            assert [sorted(flags[uid]) for uid in sorted(flags)] == [[], [], ["\\Seen"], ["\\Seen"]]

            # Started again (a restart, a replica taking over): the same.
            await imap_append(port, USER, PASSWORD, mail(message_id="<new2@example.com>"))
            async with reading(port, state) as again:
                await again.wait_for("<new2@example.com>")
            assert again.ids == ["<new2@example.com>"]
            assert not (await imap_flags(port, USER, PASSWORD))[min(flags)]
            kept = await state.get(f"first_uid:{USER}@127.0.0.1:{port}/INBOX")
            assert kept["uid"] == sorted(flags)[2] and kept["uidvalidity"]
    finally:
        await pool.close()


@pytest.mark.proc  # pymap
async def test_a_fleet_that_read_mail_before_reads_all_unread_mail_at_its_upgrade(
    pg_server, make_database
) -> None:
    """A fleet upgraded to the release that keeps where it reads from: its inbox holds mail
    already, so its unread mail is what came while it was stopped, however long ago: all of
    it is read (left alone, a week's stop lost the week's mail)."""
    pool = await create_pool(pg_server, await make_database(), max_size=2)
    state = ChannelState(CoreStore(pool), "email")
    try:
        async with pymap_server(USER, PASSWORD, fast_login=True) as port:
            week_old = mail(subject="while you were away", message_id="<away@example.com>")
            await imap_append(
                port, USER, PASSWORD, week_old, date=datetime.now(UTC) - timedelta(days=7)
            )
            async with reading(port, state, holds_mail=True) as worker:
                await worker.wait_for("<away@example.com>")
            kept = await state.get(f"first_uid:{USER}@127.0.0.1:{port}/INBOX")
            assert kept["uid"] == 1  # and so at every later start

        # Then a mailbox of its own first start (another server or port): its old mail is
        # left alone, however much mail the inbox holds (it was answered, years of it).
        async with pymap_server(USER, PASSWORD, fast_login=True) as port:
            old = mail(subject="from 2024", message_id="<ancient@example.com>")
            await imap_append(
                port, USER, PASSWORD, old, date=datetime.now(UTC) - timedelta(days=900)
            )
            await imap_append(port, USER, PASSWORD, mail(message_id="<today@example.com>"))
            async with reading(port, state, holds_mail=True) as worker:
                await worker.wait_for("<today@example.com>")
            assert worker.ids == ["<today@example.com>"]
    finally:
        await pool.close()
