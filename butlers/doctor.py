"""`butlers doctor`: what would fail, said before a message fails.

Stub wired into the CLI; the checks are being written.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from butlers.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print {checks: [...]} as JSON")
    parser.add_argument(
        "--online", action="store_true", help="also ask Telegram, the mail servers, the APIs"
    )


async def run(args: argparse.Namespace, settings: Settings) -> int:
    raise NotImplementedError("butlers doctor")
