"""The `butlers` process: its standard streams, event loop and environment (Settings, read
once), one command parsed and run (`cli`), and the exit code.

Environment: DATABASE_URL (else embedded PostgreSQL), BUTLERS_DATA_DIR (default .butlers),
BUTLERS_AUTH_TOKEN (bearer token for every MCP endpoint), OTEL_EXPORTER_OTLP_ENDPOINT.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from butlers import logs
from butlers.cli.parser import build_parser
from butlers.cli.process import collector_paused
from butlers.errors import ButlersError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from butlers.redact import Redactor
    from butlers.settings import Settings

    # What runs a command (the parser sets it on each: butlers.cli.parser).
    Command = Callable[[argparse.Namespace, Settings, Redactor], Awaitable[int]]

logger = logging.getLogger("butlers")


def _parse(argv: Sequence[str], settings: Settings) -> argparse.Namespace:
    """argparse checks the choices of what is typed; the defaults from BUTLERS_LOG_LEVEL and
    BUTLERS_LOG_FORMAT were checked when `settings` were read."""
    return build_parser(settings).parse_args(argv)


def start_logging(args: argparse.Namespace, settings: Settings) -> Redactor:
    """The process's one log stream, redacting the secrets of the environment (and later
    those the loaded configs name: the returned redactor is told them)."""
    from butlers.redact import Redactor, install_log_redaction

    logs.configure_logging(args.log_level, args.log_format)
    redactor = Redactor()
    install_log_redaction(redactor)
    redactor.add(Redactor.from_environment(environ=settings.environ).secrets)
    return redactor


async def cli(argv: Sequence[str], settings: Settings) -> int:
    """Run one command. `settings`: the process's environment, read once by main(). The
    parser names the function that runs each command (butlers.cli.parser)."""
    args = _parse(argv, settings)
    redactor = start_logging(args, settings)
    run: Command = args.run
    return await run(args, settings, redactor)


def _install_fast_event_loop() -> None:
    """uvloop where it is installed: measured 216 vs 91 routed calls/s with 16 callers."""
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


def _standard_streams_open() -> None:
    """A command started with stdin, stdout or stderr closed (`butlers doctor <&-`, some
    service managers) would have the event loop's own pipes take those numbers, and uvloop
    aborts (`uv__close: Assertion 'fd > STDERR_FILENO'`, exit 134): each closed one is opened
    on /dev/null first."""
    import os

    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:  # the lowest free number: fd itself, unless a lower one is free
                os.dup2(opened, fd)
                os.close(opened)


def main(argv: Sequence[str] | None = None) -> None:
    _standard_streams_open()
    _install_fast_event_loop()
    try:
        with collector_paused():
            from butlers.settings import Settings

        # The one place the environment is read: a bad value ends here, named, exit 1.
        settings = Settings.from_environ()
        code = asyncio.run(cli(sys.argv[1:] if argv is None else argv, settings))
    except ButlersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:  # before the signal handlers were installed
        code = 130
    except BrokenPipeError:  # `butlers log | head`: the reader left; nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # as a shell reports a command ended by SIGPIPE
    # Nothing is left to free: the interpreter's last collections at exit, over everything the
    # libraries built, took 0.3 s of a gateway's life (measured), so they see none of it.
    gc.freeze()
    sys.exit(code)
