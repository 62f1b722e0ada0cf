"""Whom a mail is from, and whether to believe it: exactly one well-formed From address (what
email.utils.parseaddr misreads, CVE-2023-27043, is refused), and with
`require_authentication_results` a DMARC pass from our own MTA's authserv-id."""

from __future__ import annotations

import email.utils
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from butlers.errors import MailUnreadable
from butlers.modules.mail_parse import parse_mail
from butlers.modules.mail_sender import dmarc_refusal, single_address
from butlers.modules.mail_webhook import parse_webhook
from tests.conftest import StartButler, log_records
from tests.fakes.mail import RecordingWorker, SmtpServer, imap_append, pymap_server
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_email import start_mail_fleet
from tests.test_email_tls import PASSWORD, USER, email_config, running, wait_until_seen
from tests.test_inbox import model

# Each is read by parseaddr as user@example.com, though a mail client shows (and a reply goes
# to) someone else, or nobody in particular.
MISREAD = [
    "user@example.com)<attacker@evil.example>",
    "<user@example.com>attacker@evil.example",
    "user@example.com <attacker@evil.example>",
]

MX = "mx.butler.example"  # our MTA's authserv-id
ALLOWED = ("user@example.com",)


def webhook(payload: dict[str, Any]) -> Any:
    return parse_webhook(json.dumps(payload).encode())


def raw_mail(sender: str, message_id: str, *headers: str, body: str = "Hello.") -> bytes:
    lines = [
        f"From: {sender}",
        "To: butler@example.com",
        "Subject: hi",
        f"Message-ID: {message_id}",
    ]
    return ("\r\n".join([*headers, *lines]) + f"\r\n\r\n{body}\r\n").encode()


# -- one From address ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", MISREAD)
def test_what_parseaddr_misreads_is_refused(value: str) -> None:
    # Unpatched Pythons (3.11.7 here) read these as user@example.com; Debian's 3.11.2 has the
    # CVE-2023-27043 fix backported and reads nothing. Ours refuses them either way.
    assert email.utils.parseaddr(value)[1] in ("user@example.com", "")
    with pytest.raises(ValueError, match="malformed"):
        single_address([value])
    parsed = parse_mail(raw_mail(value, "<m@x>"))
    assert parsed.sender == "" and parsed.refused and "malformed" in parsed.refused


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("a@example.com, b@example.com", "names 2 addresses"),
        ("friends: user@example.com;", "group syntax"),
        ("undisclosed-recipients:;", "names 0 addresses"),
        ("user@example.com, undisclosed-recipients:;", "group syntax"),
        ("", "names 0 addresses"),
        ("not an address", "malformed"),
        ("user", "malformed"),
        ("<>", "malformed"),
        ("Ada <user@example.com", "malformed"),
        ("user@example.com\x00", "malformed"),
        # (`"a:b"@x.com` and `"a:c"@y.com` were one person in conversation ids)
        ('"a:b"@example.com', "has a ':' in its address or a '/' in its domain"),
        ("user@example.com/notes", "has a ':' in its address or a '/' in its domain"),
    ],
)
def test_anything_but_one_well_formed_address_is_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        single_address([value])


def test_two_from_headers_are_refused() -> None:
    raw = raw_mail("user@example.com", "<m@x>", "From: attacker@evil.example")
    assert parse_mail(raw).refused == "2 From headers"
    assert parse_mail(raw_mail("user@example.com", "<m@x>")).refused is None
    assert parse_mail(b"Subject: no sender\r\n\r\nHi\r\n").refused == "no From header"


@pytest.mark.parametrize(
    ("value", "address", "name"),
    [
        ("user@example.com", "user@example.com", ""),
        ("Ada <User@Example.COM>", "user@example.com", "Ada"),
        ("=?utf-8?q?Ad=C3=A1?= <user@example.com>", "user@example.com", "Adá"),
        ('"user@example.com" <attacker@evil.example>', "attacker@evil.example", "user@example.com"),
        ("attacker@evil.example (user@example.com)", "attacker@evil.example", ""),
        # Obsolete syntax (RFC 5322 section 4) is unambiguous, and must be accepted.
        ("Dr. Ada <ada@example.com>", "ada@example.com", "Dr. Ada"),
    ],
)
def test_one_well_formed_address_is_read_as_what_it_says(value, address, name) -> None:
    assert single_address([value]) == (address, name)


# -- RFC 2047 inside an address ----------------------------------------------------------------

# Each decodes to user@example.com, the allowed sender, though what the sending provider's DMARC
# check saw was the undecoded domain (one with no DMARC policy: nothing failed).
ENCODED_ADDRESSES = [
    "user@=?utf-8?b?ZXhhbXBsZS5jb20=?=",
    "Ada <user@=?utf-8?b?ZXhhbXBsZS5jb20=?= >",
    # The display name holds the decoded address verbatim: only the encoded-word check sees it.
    '"user@example.com" <user@=?utf-8?q?example.com?= >',
    "=?utf-8?b?dXNlcg==?=@example.com",
    "<=?utf-8?q?user?=@example.com>",
    "=?utf-8?q?user=40example.com?=",
]


@pytest.mark.parametrize("value", ENCODED_ADDRESSES)
def test_an_encoded_word_inside_the_address_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match=r"encoded-word|malformed"):
        single_address([value])
    parsed = parse_mail(raw_mail(value, "<m@x>"))
    assert parsed.sender == "" and parsed.refused
    with pytest.raises(MailUnreadable, match="'from': From"):
        webhook({"from": value, "text": "hi", "message_id": "<w@x>"})


def test_the_reported_spoof_says_what_is_wrong() -> None:
    """The case of the report: no defect was recorded, and user@example.com came out."""
    with pytest.raises(ValueError, match="encoded-word inside the address"):
        single_address(["user@=?utf-8?b?ZXhhbXBsZS5jb20=?="])


@pytest.mark.parametrize(
    "value",
    [
        "user @ example.com",  # read as user@example.com
        "user(a comment)@example.com",
        "a.(c)b@example.com",  # obsolete CFWS inside the local part: read as a.b@example.com
        '"user"@example.com',  # read as user@example.com: quoting it has no purpose
        # The address as it reads written elsewhere in the header (a comment, the display
        # name) must not vouch for the address itself:
        "x (user@example.com) <user@example.(evil.example)com>",
        '"x user@example.com" <user@example.(evil.example)com>',
        '"user@example.com" <"user"@example.com>',
    ],
)
def test_an_address_not_written_as_it_is_read_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="does not spell out its address"):
        single_address([value])


@pytest.mark.parametrize(
    ("value", "address", "name"),
    [
        ("=?utf-8?q?J=C3=B6rg?= <jorg@example.com>", "jorg@example.com", "Jörg"),
        ("=?utf-8?b?SsO2cmc=?= <Jorg@Example.com>", "jorg@example.com", "Jörg"),
        ("jorg@example.com (=?utf-8?q?J=C3=B6rg?=)", "jorg@example.com", ""),  # not decoded
        ('"J. R." <jorg@example.com>', "jorg@example.com", "J. R."),
        ("jorg@example.com (Jorg)", "jorg@example.com", ""),  # old style: a comment after it
        ("J <  jorg@example.com  >", "jorg@example.com", "J"),
    ],
)
def test_an_encoded_display_name_is_still_read(value: str, address: str, name: str) -> None:
    assert single_address([value]) == (address, name)


# -- Authentication-Results -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "refusal"),
    [
        ([f"{MX}; dmarc=pass (p=reject) header.from=example.com"], None),
        ([f"{MX.upper()}; DMARC=PASS header.from=Example.COM"], None),
        ([f"{MX} 1; spf=pass smtp.mailfrom=example.com; dmarc=pass"], None),
        # Split over two headers of ours (one per filter), the DMARC one lower down.
        ([f"{MX}; dkim=pass header.d=example.com", f"{MX}; dmarc=pass"], None),
        ([f"{MX}; dmarc=fail (p=reject) header.from=example.com"], "DMARC fail"),
        ([f"{MX}; dmarc=none header.from=example.com"], "DMARC none"),
        ([], "no DMARC result from mx.butler.example"),
        ([f"{MX}; spf=pass smtp.mailfrom=example.com"], "no DMARC result"),
        # Forged: another authserv-id (the sender's own, or anyone's) does not count.
        (["mx.evil.example; dmarc=pass header.from=example.com"], "no DMARC result"),
        # Ours (topmost) says fail; what the mail arrived with below says pass.
        (
            [f"{MX}; dmarc=fail header.from=example.com", f"{MX}; dmarc=pass"],
            "DMARC fail",
        ),
        # Passed, but for another domain than the From header's.
        ([f"{MX}; dmarc=pass header.from=evil.example"], "not for the From domain"),
        # Malformed: cannot be attributed to anyone.
        ([f"{MX}; dmarc=", f"{MX} (unterminated; dmarc=pass"], "no DMARC result"),
        (["", ";;;"], "no DMARC result"),
        # Comments nested a thousand deep made authres raise RecursionError (which ended the
        # IMAP connection, again at every reconnection: the mailbox was blocked).
        ([f"{MX}; dmarc=pass (" + "(" * 3000, f"{MX}; dmarc=fail"], "DMARC fail"),
    ],
)
def test_only_a_dmarc_pass_from_our_authserv_id_counts(headers, refusal) -> None:
    result = dmarc_refusal(headers, MX, "example.com")
    assert result is None if refusal is None else (result is not None and refusal in result)


# -- through IMAP ---------------------------------------------------------------------------------


async def test_refused_mail_is_logged_marked_seen_and_never_stored() -> None:
    """With require_authentication_results: mails whose From parseaddr misreads, or whose DMARC
    pass is forged or missing, are refused (a WARNING with the reason, not the body) and
    flagged seen; the genuine mail behind them is stored."""
    passing = f"Authentication-Results: {MX}; dmarc=pass header.from=example.com"
    forged = "Authentication-Results: mx.evil.example; dmarc=pass header.from=example.com"
    mails = [
        raw_mail(MISREAD[0], "<misread-1@x>", passing, body="SECRET-BODY-1"),
        raw_mail(MISREAD[1], "<misread-2@x>", passing, body="SECRET-BODY-2"),
        raw_mail("user@example.com", "<forged@x>", forged, body="SECRET-BODY-3"),
        raw_mail("user@example.com", "<no-dmarc@x>", body="SECRET-BODY-4"),
        raw_mail("user@example.com", "<genuine@x>", passing),
    ]
    worker = RecordingWorker()
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        for raw in mails:
            await imap_append(port, USER, PASSWORD, raw)
        config = email_config(imap_port=port, mode="poll", require_authentication_results=MX)
        with log_records("butlers.modules.email") as records:
            async with running(config, worker):
                await worker.wait_for("<genuine@x>")
                await wait_until_seen(port)
    assert worker.ids == ["<genuine@x>"]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 4, warnings
    assert "'<misread-1@x>'" in warnings[0] and "malformed" in warnings[0]
    assert "'<misread-2@x>'" in warnings[1] and "malformed" in warnings[1]
    assert "no DMARC result from mx.butler.example" in warnings[2]
    assert "no DMARC result from mx.butler.example" in warnings[3]
    assert not any("SECRET-BODY" in w for w in warnings)


async def test_an_encoded_from_through_imap_is_refused_never_routed_nor_answered(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole switchboard, user@example.com allowed: mails whose From decodes to that
    address only through an encoded-word are refused (a WARNING saying so), flagged seen,
    never stored, routed or answered; the genuine mail after them is answered."""
    scripted_api.respond_with(model("general", {"general": "Noted."}))
    spoofed = [
        raw_mail(value, f"<spoof-{n}@x>", body=f"SPOOFED-{n}")
        for n, value in enumerate(ENCODED_ADDRESSES[:3])
    ]
    async with pymap_server(USER, PASSWORD, fast_login=True) as port:
        with SmtpServer(users={USER: PASSWORD}) as smtp:
            # Polling: pymap may not report a mail appended the instant before an IDLE (see
            # ImapIntake._connection), and refusing is quick enough to hit that instant.
            switchboard = await start_mail_fleet(
                start_butler, tmp_path, port, smtp, monkeypatch, "poll", allowed_senders=ALLOWED
            )
            with log_records("butlers.modules.email") as records:
                for raw in spoofed:
                    await imap_append(port, USER, PASSWORD, raw)
                # The sentinel: mail is taken in order, so once this one is answered, the
                # spoofed ones before it were dealt with.
                await imap_append(port, USER, PASSWORD, raw_mail("user@example.com", "<ok@x>"))
                [reply] = await smtp.wait_for(1)
                await wait_until_seen(port)
    assert (reply["To"], reply["In-Reply-To"]) == ("user@example.com", "<ok@x>")
    assert smtp.recipients == [["user@example.com"]]
    conn = await db_conn(switchboard.config.database)
    assert await conn.fetchval("SELECT array_agg(external_id) FROM inbox") == ["<ok@x>"]
    assert await conn.fetchval("SELECT count(*) FROM routing_log") == 1
    refusals = [r.getMessage() for r in records if getattr(r, "action", None) == "refused"]
    assert len(refusals) == 3, refusals
    for n, refusal in enumerate(refusals):
        assert f"<spoof-{n}@x>" in refusal and "encoded-word inside the address" in refusal
    assert not any("SPOOFED" in r.getMessage() for r in records)


# -- the webhook ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [*MISREAD, "a@example.com, b@example.com", "g: a@example.com;"])
def test_the_webhook_applies_the_same_address_rules(value: str) -> None:
    with pytest.raises(MailUnreadable, match="'from': From"):
        parse_webhook(json.dumps({"from": value, "text": "hi", "message_id": "<w@x>"}).encode())


def test_the_webhook_carries_authentication_results() -> None:
    mail = webhook(
        {
            "from": "Ada <user@example.com>",
            "text": "hi",
            "message_id": "<w@x>",
            "headers": {"Authentication-Results": [f"{MX}; dmarc=pass", "x; dmarc=fail"]},
        }
    )
    assert (mail.sender, mail.sender_name) == ("user@example.com", "Ada")
    assert mail.authentication_results == (f"{MX}; dmarc=pass", "x; dmarc=fail")
