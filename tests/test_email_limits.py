"""No mail can exhaust the memory, freeze the event loop or crash-loop the process: through a
real IMAP server (pymap), the email module handing mail to a RecordingWorker.

- a header the stdlib would parse in quadratic time and memory is refused unparsed;
- a mail over the size limit is recorded as failed from its header alone, never fetched whole;
- a big mail is parsed in a worker thread: the event loop keeps running meanwhile;
- a mail that was being read when the process died is recognised by its keyword at the next
  start and recorded as failed, not read (and crashed on) again; one that a clean stop
  interrupted is read normally;
- a mail that cannot be parsed is kept as a failed inbox row, not silently dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from email.headerregistry import HeaderRegistry
from typing import Any

import pytest

import butlers.modules.mail_imap as mail_imap
import butlers.modules.mail_parse as mail_parse
from butlers.errors import MailUnreadable
from butlers.modules.mail_imap import (
    OUR_KEYWORDS,
    TRIED_AGAIN_KEYWORD,
    TRIED_KEYWORD,
    Fetched,
    fetched,
    keywords_kept,
)
from butlers.modules.mail_limits import MAX_HEADER_BYTES, MAX_MAIL_BYTES, MAX_MIME_PARTS
from butlers.modules.mail_parse import ParsedMail, parse_header, parse_mail
from tests.conftest import log_records
from tests.fakes.mail import (
    RecordingWorker,
    imap_append,
    imap_flags,
    imap_store,
    pymap_server,
    record_threads,
)
from tests.fakes.tls_front import TcpFront
from tests.test_email_tls import PASSWORD, USER, email_config, running, wait_until_seen


def quadratic_subject(size: int) -> bytes:
    """A Subject of about `size` bytes of RFC 2047 encoded words, folded in lines under 80
    characters: policy.default took 2.1 GB and minutes to parse 256 KiB of it."""
    words = [b"=?utf-8?q?abc?="] * (size // 16)
    return b"\r\n ".join(b" ".join(words[i : i + 4]) for i in range(0, len(words), 4))


def raw_mail(
    message_id: str,
    *,
    subject: bytes = b"hi",
    body: bytes = b"Hello.",
    content_type: bytes = b"text/plain; charset=utf-8",
    sender: bytes = b"Ada <user@example.com>",
) -> bytes:
    return (
        b"From: " + sender + b"\r\nTo: butler@example.com\r\nSubject: " + subject
        + f"\r\nMessage-ID: {message_id}\r\nMIME-Version: 1.0\r\n".encode()
        + b"Content-Type: " + content_type + b"\r\n\r\n" + body + b"\r\n"
    )  # fmt: skip


def forwarding(own: bytes, inner: bytes, part_headers: bytes = b"") -> bytes:
    """A mail of the sender's own text and `inner` attached as written (message/rfc822, with
    `part_headers` more: an encoding, a file name), built byte by byte: the email package
    would parse `inner` (or refold it) on the way."""
    body = (
        b"--o\r\nContent-Type: text/plain\r\n\r\n" + own + b"\r\n--o\r\n"
        b"Content-Type: message/rfc822\r\n" + part_headers + b"\r\n" + inner + b"\r\n--o--\r\n"
    )
    return raw_mail("<fwd@x>", body=body, content_type=b'multipart/mixed; boundary="o"')


def many_parts(message_id: str, parts: int) -> bytes:
    """A multipart mail of `parts` tiny attachments after its text."""
    attachment = (
        b"--b\r\nContent-Type: application/octet-stream\r\nContent-Disposition: attachment; "
        b'filename="a.bin"\r\n\r\nxx\r\n'
    )
    body = b"--b\r\nContent-Type: text/plain\r\n\r\nHello.\r\n" + attachment * parts + b"--b--"
    return raw_mail(message_id, body=body, content_type=b'multipart/mixed; boundary="b"')


@pytest.fixture
def parsed_headers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Every header the stdlib's header parser is given: (name, length). One longer than
    MAX_HEADER_BYTES is not parsed but refused here (it could take gigabytes): a test fails,
    not the machine."""
    given: list[tuple[str, int]] = []
    parse = HeaderRegistry.__call__

    def guarded(self: HeaderRegistry, name: str, value: str) -> Any:
        given.append((name, len(value)))
        if len(value) > MAX_HEADER_BYTES:
            raise AssertionError(f"the {name} header of {len(value)} bytes was parsed")
        return parse(self, name, value)

    monkeypatch.setattr(HeaderRegistry, "__call__", guarded)
    yield given


def spy_parse(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[bytes], None] = lambda raw: None
) -> list[bytes]:
    """Every mail the intake parses whole (its raw bytes); `before` runs first, in the
    worker thread the parse runs in."""
    parsed: list[bytes] = []

    def parse(raw: bytes, max_bytes: int = MAX_MAIL_BYTES) -> ParsedMail:
        parsed.append(raw)
        before(raw)
        return parse_mail(raw, max_bytes)

    monkeypatch.setattr(mail_imap, "parse_mail", parse)
    return parsed


# -- a header too long ------------------------------------------------------------------------


def test_a_quadratic_header_is_refused_without_being_parsed(parsed_headers) -> None:
    raw = raw_mail("<big@x>", subject=quadratic_subject(256 * 1024))
    envelope = parse_header(raw)
    assert (envelope.sender, envelope.message_id) == ("user@example.com", "<big@x>")
    assert envelope.unreadable and "the Subject header is" in envelope.unreadable
    assert f"over the limit of {MAX_HEADER_BYTES}" in envelope.unreadable
    assert envelope.subject.startswith("=?utf-8?q?abc?= ")  # its raw start, for the failed row
    with pytest.raises(MailUnreadable, match="the Subject header is"):
        parse_mail(raw)
    # The bound is in bytes given to the header parser (its time: bench/hostile_input.py).
    assert parsed_headers and max(size for _, size in parsed_headers) <= MAX_HEADER_BYTES


async def test_through_imap_a_quadratic_header_is_recorded_as_failed(parsed_headers) -> None:
    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        # 4 times the limit: pymap (which parses what it is given) takes 0.3 s over 128 KiB.
        big = raw_mail("<big@x>", subject=b"Lunch " + quadratic_subject(4 * MAX_HEADER_BYTES))
        await imap_append(port, USER, PASSWORD, big)
        await imap_append(port, USER, PASSWORD, raw_mail("<next@x>"))
        async with running(email_config(imap_port=port, mode="poll"), worker):
            await worker.wait_for("<next@x>")
            await wait_until_seen(port)
    assert worker.ids == ["<next@x>"]
    [(failed, error)] = worker.inbox.failed
    assert (failed.external_id, failed.source_id) == ("<big@x>", "user@example.com")
    assert failed.subject and failed.subject.startswith("Lunch =?utf-8?q?abc?=")
    assert "the Subject header is" in error and f"IMAP 127.0.0.1:{port} UID" in error
    assert max(size for _, size in parsed_headers) <= MAX_HEADER_BYTES


# -- a mail too big -----------------------------------------------------------------------------


async def test_a_mail_over_the_size_limit_is_recorded_as_failed_unread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The limit is lowered to 32 KiB here (over 15 MiB in earnest): RFC822.SIZE says the
    mail is over it, so its body is never fetched, let alone parsed."""
    monkeypatch.setattr(mail_imap, "mail_limit", lambda _attachment_bytes: 32 * 1024)
    parsed = spy_parse(monkeypatch)
    worker = RecordingWorker()
    big = raw_mail("<big@x>", subject=b"photos", body=b"x" * 64 * 1024)
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, big)
        await imap_append(port, USER, PASSWORD, raw_mail("<next@x>"))
        with log_records("butlers.modules.email") as records:
            async with running(email_config(imap_port=port, mode="poll"), worker):
                await worker.wait_for("<next@x>")
                await wait_until_seen(port)
    assert worker.ids == ["<next@x>"] and len(parsed) == 1 and b"<next@x>" in parsed[0]
    [(failed, error)] = worker.inbox.failed
    assert (failed.external_id, failed.source_id, failed.subject) == (
        "<big@x>",
        "user@example.com",
        "photos",
    )
    assert "it is 64 KB, over the limit of 32 KB for a mail (room for one attachment" in error
    assert re.search(rf"\(IMAP 127.0.0.1:{port} UID \d+, {len(big)} bytes\)$", error), error
    [warning] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert "from user@example.com" in warning and f"{len(big)} bytes" in warning
    # Its sender is told, in a reply (they heard nothing: a walkthrough), without the
    # server's address.
    [(told, reply)] = worker.told
    assert told.external_id == "<big@x>"
    assert reply.startswith("Sorry, your mail was not read: it is 64 KB, over the limit of 32 KB")
    assert "127.0.0.1" not in reply and "UID" not in reply


def test_a_mail_carrying_the_largest_attachment_read_is_read() -> None:
    """An attachment of max_attachment_bytes travels as base64, a third larger: the mail's
    limit leaves room for it (a fixed 10 MiB refused a mail with an 8 MiB PDF whole)."""
    from email.message import EmailMessage

    from butlers.modules.mail_limits import mail_limit
    from butlers.modules.mail_parse import within_limits

    for attachment_bytes in (8 * 1024 * 1024, 10 * 1024 * 1024, 20 * 1024 * 1024):
        pdf = b"%PDF-1.7\n" + os.urandom(attachment_bytes - 20) + b"\n%%EOF\n"
        message = EmailMessage()
        message["From"], message["To"] = "user@example.com", "butler@example.com"
        message["Subject"], message["Message-ID"] = "scan", "<scan@x>"
        message.set_content("Please read this scan.")
        message.add_attachment(pdf, maintype="application", subtype="pdf", filename="scan.pdf")
        raw = message.as_bytes()
        assert len(raw) > MAX_MAIL_BYTES * (attachment_bytes > 7 * 1024 * 1024)
        parsed = within_limits(
            parse_mail(raw, mail_limit(attachment_bytes)), max_bytes=attachment_bytes, max_count=5
        )
        assert [f.data for f in parsed.files] == [pdf], attachment_bytes
        assert parsed.text.startswith("Please read this scan.")
    assert mail_limit(1000) == MAX_MAIL_BYTES  # never under the limit a mail always had


def test_a_mail_whose_size_was_misreported_is_not_parsed() -> None:
    """What the fetch returns is checked too: RFC822.SIZE is the server's word."""
    with pytest.raises(MailUnreadable, match="over the limit of 10485760"):
        parse_mail(raw_mail("<big@x>", body=b"x" * (10 * 1024 * 1024)))


# -- not on the event loop ----------------------------------------------------------------------


async def test_a_big_mail_is_parsed_without_blocking_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """350 KB of HTML markup (no text: its conversion cannot stop early) takes the parser
    0.15 s, a mail at the size limit seconds: its header, the mail and the HTML in it are
    parsed in worker threads, never on the event loop's thread (which every butler of
    `butlers up` shares). Which thread each ran on does not depend on the size."""
    calls = record_threads(
        monkeypatch,
        (mail_imap, "parse_header"),
        (mail_imap, "parse_mail"),
        (mail_parse, "html_to_text"),
    )
    worker = RecordingWorker()
    html = raw_mail(
        "<big@x>", body=b"<p>Soup.</p>" + b"<i></i>" * 50_000, content_type=b"text/html"
    )
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, html)
        async with running(email_config(imap_port=port, mode="poll"), worker):
            mail = await worker.wait_for("<big@x>", timeout_s=60)
    assert mail.text == "Soup."
    assert {name for name, _ in calls} == {"parse_header", "parse_mail", "html_to_text"}
    on_the_loop = [name for name, thread in calls if thread == threading.get_ident()]
    assert on_the_loop == []


# -- a mail that crashed the process ------------------------------------------------------------


async def test_a_mail_being_read_when_the_process_died_twice_is_not_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first run dies while parsing <poison@x> (its connection cut, no goodbye: as the
    OOM killer would leave it). The mail carries the keyword; the next start reads it once
    more (the process may have died of something else: a replica's leader killed), and dies
    again; the third records it as failed without parsing it, and reads the next mail."""
    entered, release = threading.Event(), threading.Event()

    def hang_on_poison(raw: bytes) -> None:
        if b"<poison@x>" in raw:
            entered.set()
            release.wait(30)

    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, raw_mail("<poison@x>", subject=b"poison"))
        for death, keywords in enumerate(
            ({TRIED_KEYWORD}, {TRIED_KEYWORD, TRIED_AGAIN_KEYWORD}), start=1
        ):
            front = TcpFront(port)
            await front.start()
            entered.clear()
            release.clear()
            try:
                config = email_config(imap_port=front.port, mode="poll")
                spy_parse(monkeypatch, before=hang_on_poison)
                async with running(config, worker):
                    assert await asyncio.to_thread(entered.wait, 30), death
                    front.drop()  # the process dies: nothing more goes to the server
                release.set()
            finally:
                release.set()
                await front.stop()
            [flags] = (await imap_flags(port, USER, PASSWORD)).values()
            assert keywords <= flags and "\\Seen" not in flags, (death, flags)

        await imap_append(port, USER, PASSWORD, raw_mail("<next@x>"))
        parsed = spy_parse(monkeypatch)
        async with running(email_config(imap_port=port, mode="poll"), worker):
            await worker.wait_for("<next@x>")
            await wait_until_seen(port)
        flags_after = await imap_flags(port, USER, PASSWORD)
    assert worker.ids == ["<next@x>"]
    assert len(parsed) == 1 and b"<next@x>" in parsed[0]  # <poison@x> was not parsed again
    [(failed, error)] = worker.inbox.failed
    assert (failed.external_id, failed.source_id, failed.subject) == (
        "<poison@x>",
        "user@example.com",
        "poison",
    )
    assert "two attempts to read it never finished" in error
    assert all(
        not {TRIED_KEYWORD, TRIED_AGAIN_KEYWORD} & f and "\\Seen" in f for f in flags_after.values()
    )


async def test_a_mail_whose_reading_a_clean_stop_interrupted_is_read_at_the_next_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered, release = threading.Event(), threading.Event()

    def hang(raw: bytes) -> None:
        entered.set()
        release.wait(30)

    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, raw_mail("<m@x>"))
        config = email_config(imap_port=port, mode="poll")
        spy_parse(monkeypatch, before=hang)
        try:
            async with running(config, worker):
                assert await asyncio.to_thread(entered.wait, 30)
        finally:
            release.set()
        [flags] = (await imap_flags(port, USER, PASSWORD)).values()
        assert TRIED_KEYWORD not in flags and "\\Seen" not in flags

        parsed = spy_parse(monkeypatch)
        async with running(config, worker):
            await worker.wait_for("<m@x>")
            await wait_until_seen(port)
    assert len(parsed) == 1 and worker.inbox.failed == []


async def test_a_mail_left_marked_once_is_read_once_more_and_twice_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mail another process was reading when it died (a replica's leader killed, say) is
    read by the next one: it was refused as "never finished" and its sender told so (a
    walkthrough). Marked by two attempts, it is not parsed."""
    worker = RecordingWorker()
    parsed = spy_parse(monkeypatch)
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, raw_mail("<interrupted@x>"))
        await imap_append(port, USER, PASSWORD, raw_mail("<poison@x>"))
        interrupted, poison = await imap_flags(port, USER, PASSWORD)
        await imap_store(port, USER, PASSWORD, interrupted, f"+FLAGS ({TRIED_KEYWORD})")
        both = f"+FLAGS ({TRIED_KEYWORD} {TRIED_AGAIN_KEYWORD})"
        await imap_store(port, USER, PASSWORD, poison, both)
        await imap_append(port, USER, PASSWORD, raw_mail("<next@x>"))
        with log_records("butlers.modules.email") as records:
            async with running(email_config(imap_port=port, mode="poll"), worker):
                await worker.wait_for("<next@x>")
                await wait_until_seen(port)
        flags_after = await imap_flags(port, USER, PASSWORD)
    assert [b"<poison@x>" in raw for raw in parsed] == [False, False]
    assert worker.ids == ["<interrupted@x>", "<next@x>"]
    assert [m.external_id for m, _ in worker.inbox.failed] == ["<poison@x>"]
    assert any("reading it once more" in r.getMessage() for r in records)
    assert all(not {TRIED_KEYWORD, TRIED_AGAIN_KEYWORD} & f for f in flags_after.values())


async def test_a_server_that_keeps_no_keywords_is_used_and_said_so() -> None:
    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, keywords=False, fast_login=True) as port:
        await imap_append(port, USER, PASSWORD, raw_mail("<m@x>"))
        with log_records("butlers.modules.email") as records:
            async with running(email_config(imap_port=port, mode="poll"), worker):
                await worker.wait_for("<m@x>")
                await wait_until_seen(port)
    [warning] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert f"keeps no {TRIED_KEYWORD} keyword" in warning


# -- a mail that cannot be parsed ---------------------------------------------------------------


async def test_a_mail_that_cannot_be_parsed_is_kept_as_a_failed_row() -> None:
    """It used to be flagged seen with no trace but a log line."""
    part_header = b"text/plain; name=" + b"x" * (MAX_HEADER_BYTES + 1)
    mails = [
        many_parts("<parts@x>", MAX_MIME_PARTS),  # the text part makes one too many
        raw_mail(
            "<ctype@x>",
            subject=b"part",
            body=b"--b\r\nContent-Type: " + part_header + b"\r\n\r\nHi.\r\n--b--",
            content_type=b'multipart/mixed; boundary="b"',
        ),
        raw_mail("<next@x>"),
    ]
    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        for raw in mails:
            await imap_append(port, USER, PASSWORD, raw)
        async with running(email_config(imap_port=port, mode="poll"), worker):
            await worker.wait_for("<next@x>")
            await wait_until_seen(port)
    assert worker.ids == ["<next@x>"]
    errors = {m.external_id: (m.source_id, error) for m, error in worker.inbox.failed}
    assert errors.keys() == {"<parts@x>", "<ctype@x>"}
    sender, error = errors["<parts@x>"]
    assert sender == "user@example.com"
    assert f"it cannot be read: it has more than {MAX_MIME_PARTS} MIME parts" in error
    assert "the Content-Type header is" in errors["<ctype@x>"][1]


def test_parsing_costs_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found while bounding the parse: each of these took seconds to minutes (or raised).
    Bounded in parts made and codecs used; their times: bench/hostile_input.py."""
    made: list[int] = []  # MIME parts the parser made, per mail
    count = mail_parse._PartCounter.__call__

    def counted(self: Any, policy: Any = None) -> Any:
        made[-1] += 1
        return count(self, policy)

    monkeypatch.setattr(mail_parse._PartCounter, "__call__", counted)
    made.append(0)
    with pytest.raises(MailUnreadable, match="more than 200 MIME parts"):
        parse_mail(many_parts("<m@x>", 10_000))  # 20 s before
    nested = b"".join(
        f'Content-Type: multipart/mixed; boundary="b{i}"\r\n\r\n--b{i}\r\n'.encode()
        for i in range(5000)
    )
    made.append(0)
    with pytest.raises(MailUnreadable, match="MIME parts"):  # RecursionError after 30 s before
        parse_mail(b"From: user@example.com\r\nMIME-Version: 1.0\r\n" + nested + b"\r\nHi.")
    # The factory's probe, the message, MAX_MIME_PARTS parts and the one refused.
    assert made == [MAX_MIME_PARTS + 3] * 2
    # punycode's decoder is quadratic (minutes for this); idna raised UnicodeError. Neither
    # codec is used: read as latin-1 ("abc-aaa..." decoded as punycode is something else).
    punycode = parse_mail(
        raw_mail(
            "<p@x>", body=b"abc-" + b"a" * 400_000, content_type=b"text/plain; charset=punycode"
        )
    )
    assert punycode.text.startswith("abc-aaa")
    assert parse_mail(raw_mail("<i@x>", content_type=b"text/plain; charset=idna")).text == "Hello."
    listed = parse_mail(many_parts("<m@x>", 150)).text
    assert listed.endswith("a.bin and 130 more]")


# -- reading the server's answers ---------------------------------------------------------------


def test_fetch_data_is_found_by_uid_wherever_the_server_puts_it() -> None:
    lines = [
        b"3 FETCH (FLAGS (\\Seen) UID 7)",  # unsolicited: another mail's flags changed
        b"4 FETCH (UID 9 FLAGS (\\Recent $ButlersTried) RFC822.SIZE 120 BODY[HEADER]<0> {5}",
        bytearray(b"From:"),
        b")",
        b"UID FETCH completed.",
    ]
    assert fetched(lines, "9") == Fetched(frozenset({"\\Recent", TRIED_KEYWORD}), 120, b"From:")
    assert fetched(lines, "8") is None  # expunged meanwhile
    after = [b"4 FETCH (BODY[]<0> {2}", bytearray(b"hi"), b" UID 9 FLAGS ($ButlersTried))"]
    assert fetched(after, "9") == Fetched(frozenset({TRIED_KEYWORD}), None, b"hi")


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        (b"OK [PERMANENTFLAGS (\\Answered \\Deleted \\Seen \\*)] Flags permitted.", OUR_KEYWORDS),
        # pymap's `(\* \Answered ...)`, after aioimaplib deleted every "* " from the line
        (b"OK [PERMANENTFLAGS (\\\\Answered \\Deleted \\Seen)] Flags permitted.", OUR_KEYWORDS),
        (
            b"OK [PERMANENTFLAGS ($ButlersTried $ButlersTriedAgain \\Seen)] Flags here.",
            OUR_KEYWORDS,
        ),
        (
            b"OK [PERMANENTFLAGS ($ButlersTried \\Seen)] Flags permitted.",
            frozenset({TRIED_KEYWORD}),
        ),
        (b"OK [PERMANENTFLAGS (\\Answered \\Deleted \\Seen)] Flags permitted.", frozenset()),
        (b"OK [UIDVALIDITY 3] UIDs valid.", OUR_KEYWORDS),  # none said: every flag is (RFC 3501)
    ],
)
def test_whether_the_server_keeps_our_keyword(line: bytes, kept: frozenset[str]) -> None:
    """Both, none, or (a server listing its flags) the first alone: then a mail whose reading
    never finished is not read again, as before the second."""
    assert keywords_kept([b"FLAGS (\\Seen)", line]) == kept


@pytest.fixture
def converted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How much HTML each conversion was given, with the cap lowered to 256 KiB (2 MiB in
    earnest, 1 s to convert)."""
    assert mail_parse.MAX_HTML_CHARS < 8 * 1024 * 1024  # in earnest, as an 8 MiB body showed
    monkeypatch.setattr(mail_parse, "MAX_HTML_CHARS", 256 * 1024)
    sizes: list[int] = []
    convert = mail_parse.html_to_text

    def measured(html: str, **options: Any) -> str:
        sizes.append(len(html))
        return convert(html, **options)

    monkeypatch.setattr(mail_parse, "html_to_text", measured)
    return sizes


def test_only_the_start_of_a_huge_html_body_is_converted(converted: list[int]) -> None:
    """Converting HTML takes ~0.6 s a MiB (5 s for a mail at the size limit): the 2 MiB body
    is 8 times over the cap."""
    html = b"<p>Soup.</p>" + b"<i></i>" * (2 * 1024 * 1024 // 7)
    assert parse_mail(raw_mail("<h@x>", body=html, content_type=b"text/html")).text == "Soup."
    assert converted == [256 * 1024]


def test_mails_attached_to_a_mail_share_one_more_html_limit(converted: list[int]) -> None:
    """Each attached mail read as a forward converts its HTML too: five attached newsletters
    would have been five times the cost of one mail. Together they convert at most one more
    MAX_HTML_CHARS."""
    html = b"<p>Soup.</p>" + b"<i></i>" * (1024 * 1024 // 7)
    inner = raw_mail("<in@x>", body=html, content_type=b"text/html")
    part = b"--b\r\nContent-Type: message/rfc822\r\n\r\n" + inner + b"\r\n"
    body = b"--b\r\nContent-Type: text/plain\r\n\r\nSee these.\r\n" + part * 5 + b"--b--"
    raw = raw_mail("<out@x>", body=body, content_type=b'multipart/mixed; boundary="b"')
    text = parse_mail(raw).text
    assert text.startswith("See these.") and text.count("Soup.") == 5
    assert converted == [256 * 1024 // mail_parse.MAX_ATTACHED_MAILS] * 5


def test_an_attached_mail_sent_quoted_printable_is_written_back_without_refolding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decoding a quoted-printable attached mail writes it back first: with compat32 every
    header was folded anew, in time quadratic in a line's words (a 50 KB line of words took
    9.5 s, a 9 MB one would take days, the intake waiting: a review). Now nothing is folded:
    the folding machinery is never asked, and the mail reads the same."""
    import email.header

    def folded(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a header of the attached mail was folded anew")

    monkeypatch.setattr(email.header.Header, "encode", folded)
    inner = b"X-A: " + b"a " * 25_000 + b"\r\nFrom: Eve <x@y.example>\r\n\r\nPay me=\r\n now."
    encoded = b"Content-Transfer-Encoding: quoted-printable\r\n"
    parsed = parse_mail(forwarding(b"Is this real?", inner, encoded))
    assert parsed.text.endswith("From: Eve <x@y.example>\n\nPay me now.")
    assert parsed.forwarded == ("Eve <x@y.example>", len("Is this real?") + 2)
