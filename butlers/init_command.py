"""`butlers init DIR`: a working config directory without hand-editing TOML.

Stub wired into the CLI; being written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from butlers.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="the config directory to write")
    parser.add_argument("--non-interactive", action="store_true", help="ask nothing")


async def run(args: argparse.Namespace, settings: Settings) -> int:
    raise NotImplementedError("butlers init")
