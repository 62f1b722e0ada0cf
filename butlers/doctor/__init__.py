"""`butlers doctor`: what would fail, said before a message fails.

A new owner finds a wrong bot token, a missing API key or a butler exposed without a token only
when a message fails, hours later, in a log line. Doctor looks at everything a fleet needs and
says, one line per check (`ok`, `warn` or `fail`), what is wrong and what to do about it. It
exits 0 only when nothing fails; `--json` prints `{"checks": [{"name", "status", "detail"}]}`.

Offline (the default), nothing outside this machine is asked: the configs, the variables they
name, ports, the database, Claude Code and its credentials, exposure, allowlists, mail TLS.
`--online` also asks Telegram, the mail servers, the Messages API and the running butlers, all
at once, each bounded by `--timeout`.

Variables come from the environment and from `<config dir>/.env` when there is one (the
environment wins): `butlers init` writes its secrets there. Nothing doctor prints or logs holds
a secret, not even a wrong one: details are written from variables' names, and every line (and
every log record while doctor runs) also passes through the redactor of every secret the
environment, the .env file and the configs name.

The checks live in `butlers.doctor.offline` (what the files say), `.local` (this machine:
ports, database, Claude Code) and `.online`; this module gathers them and prints.

Where this package sits among the others, and a message's path through them:
docs/architecture.md.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from butlers.settings import Settings

DEFAULT_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help='print {"checks": [{name, status, detail}]}'
    )
    parser.add_argument(
        "--online",
        action="store_true",
        help="also ask Telegram (getMe, getWebhookInfo), the mail servers, the Messages API "
        "and each butler's /health",
    )
    parser.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="K",
        help="check the ports `butlers up --port-offset K` listens on (each butler.toml's + K)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds each online check may take (default {DEFAULT_TIMEOUT_S:g})",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


async def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run every check on `args.config_dir`, print them, and return the exit code: 1 when one
    failed, else 0."""
    from butlers.doctor.report import examine, print_report

    checks = await examine(
        args.config_dir,
        settings,
        online=args.online,
        timeout_s=args.timeout,
        port_offset=args.port_offset,
    )
    print_report(checks.checks, checks.redactor, as_json=args.json)
    return 1 if any(check.status == "fail" for check in checks.checks) else 0
