"""The mail password appears in no log, at any level: an IMAP connection (LOGIN over plaintext,
STARTTLS and implicit TLS) and an SMTP send with AUTH, every logger at DEBUG.

aioimaplib logs each line it sends at DEBUG and scrubbed only the raw password, which is not
what goes out when the password has a `"` or a `\\` in it (IMAP quoting escapes them).
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.fakes.mail import MailCA, RecordingWorker, SmtpServer, imap_append
from tests.test_email import mail
from tests.test_email_tls import USER, email_config, imap_stack, running, wait_until_seen

# A quote, a backslash and a space: each is sent (and logged) differently from how it is typed.
PASSWORD = 'Zx9qWv"k\\Lm7Rt2 pw'


def leaked_forms(password: str) -> list[str]:
    """The password as it may show up in a log line: raw, any long enough piece of it (escaped
    or repr'd forms keep those), and base64 as in SASL PLAIN and LOGIN."""
    pieces = re.findall(r"[A-Za-z0-9]{5,}", password)
    sasl = [f"\0{USER}\0{password}", f"{USER}\0{USER}\0{password}", password]
    return [password, *pieces, *(base64.b64encode(s.encode()).decode() for s in sasl)]


@pytest.fixture
def ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MailCA:
    """A private CA, trusted through SSL_CERT_FILE."""
    ca = MailCA(tmp_path / "ca")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_file))
    return ca


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def every_log_at_debug() -> Iterator[_Collect]:
    """Every logger at DEBUG, into one handler: on the root logger, and on each logger that
    does not propagate to it (caplog would miss those)."""
    handler = _Collect()
    root = logging.getLogger()
    loggers = [
        logger
        for logger in logging.root.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    saved = [(logger, logger.level, logger.disabled) for logger in [root, *loggers]]
    root.addHandler(handler)
    detached = [logger for logger in loggers if not logger.propagate]
    for logger in detached:
        logger.addHandler(handler)
    for logger, _, _ in saved:
        logger.setLevel(logging.DEBUG)
        logger.disabled = False
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        for logger in detached:
            logger.removeHandler(handler)
        for logger, level, disabled in saved:
            logger.setLevel(level)
            logger.disabled = disabled


@pytest.mark.parametrize("variant", ["none", "starttls", "implicit"])
async def test_the_password_is_in_no_log(variant: str, ca: MailCA) -> None:
    worker = RecordingWorker()
    with every_log_at_debug() as logs:
        async with imap_stack(variant, ca, password=PASSWORD) as (port, front):
            await imap_append(port, USER, PASSWORD, mail())
            with SmtpServer(tls="starttls", ca=ca, users={USER: PASSWORD}) as smtp:
                config = email_config(
                    imap_port=front.port, imap=variant, smtp_port=smtp.port, smtp="starttls"
                )
                async with running(config, worker, password=PASSWORD) as module:
                    await worker.wait_for("<m1@example.com>")  # logged in, fetched
                    await wait_until_seen(port, password=PASSWORD)  # flagged
                    await module.send("user@example.com", "Re: hi", "Logged nowhere.")
                    await smtp.wait_for(1)
    assert smtp.logins == [(USER, PASSWORD)]
    # The test SMTP server (aiosmtpd, logger mail.log) logs what it receives: that is the
    # server's log, not ours.
    ours = [r for r in logs.records if not r.name.startswith("mail.log")]
    text = "\n".join(logs.format(r) for r in ours)
    assert "LOGIN" in text and "aioimaplib" in text  # DEBUG lines were seen at all
    for form in leaked_forms(PASSWORD):
        assert form not in text, f"{form!r} is in the logs"
