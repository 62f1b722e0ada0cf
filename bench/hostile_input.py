"""How long the hostile inputs that once took seconds to minutes take now. (Not a test: run
it by hand; the tests bound these by what is parsed, not by the clock.)

    .venv/bin/python bench/hostile_input.py [--rounds 3]

Each case is a mail or header text a stranger can send; "before" is what it cost before its
bound (tests/test_email_limits.py, tests/test_email_mailbox.py say which bound):

  quadratic header   256 KiB Subject of RFC 2047 words: refused unparsed (before: minutes, 2 GB)
  10,000 parts       refused past MAX_MIME_PARTS (before: 20 s)
  5,000 nested       refused past MAX_MIME_PARTS (before: RecursionError after 30 s)
  punycode 400 KB    read as latin-1 (before: minutes, the codec is quadratic)
  one_line 32 KiB    a run of 32 KiB spaces in a header (before: 5.8 s of regex backtracking)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from butlers.errors import MailUnreadable
from butlers.modules.mail_parse import one_line, parse_header, parse_mail


def _mail(subject: bytes = b"hi", body: bytes = b"Hello.", ctype: bytes = b"text/plain") -> bytes:
    return (
        b"From: Ada <user@example.com>\r\nTo: butler@example.com\r\nSubject: " + subject
        + b"\r\nMessage-ID: <b@x>\r\nMIME-Version: 1.0\r\nContent-Type: " + ctype
        + b"\r\n\r\n" + body + b"\r\n"
    )  # fmt: skip


def _quadratic_subject(size: int) -> bytes:
    words = [b"=?utf-8?q?abc?="] * (size // 16)
    return b"\r\n ".join(b" ".join(words[i : i + 4]) for i in range(0, len(words), 4))


def _many_parts(parts: int) -> bytes:
    attachment = (
        b"--b\r\nContent-Type: application/octet-stream\r\nContent-Disposition: attachment; "
        b'filename="a.bin"\r\n\r\nxx\r\n'
    )
    body = b"--b\r\nContent-Type: text/plain\r\n\r\nHello.\r\n" + attachment * parts + b"--b--"
    return _mail(body=body, ctype=b'multipart/mixed; boundary="b"')


def _nested(depth: int) -> bytes:
    nested = b"".join(
        f'Content-Type: multipart/mixed; boundary="b{i}"\r\n\r\n--b{i}\r\n'.encode()
        for i in range(depth)
    )
    return b"From: user@example.com\r\nMIME-Version: 1.0\r\n" + nested + b"\r\nHi."


def _refused(raw: bytes) -> None:
    try:
        parse_mail(raw)
    except MailUnreadable:
        return
    raise AssertionError("the mail was not refused")


def cases() -> dict[str, Callable[[], object]]:
    header = _mail(subject=_quadratic_subject(256 * 1024))
    parts, nested = _many_parts(10_000), _nested(5000)
    punycode = _mail(body=b"abc-" + b"a" * 400_000, ctype=b"text/plain; charset=punycode")
    spaces = "a" + " " * 32_768 + "b"
    return {
        "quadratic header": lambda: parse_header(header),
        "10,000 parts": lambda: _refused(parts),
        "5,000 nested": lambda: _refused(nested),
        "punycode 400 KB": lambda: parse_mail(punycode),
        "one_line 32 KiB": lambda: one_line(spaces),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    print(f"{'case':<20} {'best (ms)':>10}")
    for name, run in cases().items():
        best = float("inf")
        for _ in range(args.rounds):
            started = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - started)
        print(f"{name:<20} {best * 1000:>10.1f}")


if __name__ == "__main__":
    main()
