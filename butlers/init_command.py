"""`butlers init DIR`: a working config directory without hand-editing TOML.

It writes DIR/<butler>/butler.toml and CLAUDE.md for a switchboard (Telegram and/or email),
`general` and, if wanted, the shipped specialists, plus DIR/.env naming every secret the config
refers to (mode 0600 from the moment it exists): no secret ever goes into TOML. The butlers
other than the switchboard are the shipped ones (butlers/init_templates/ holds copies of
config/butlers, kept equal by tests/test_init.py); the switchboard's file is written from the
answers.

Interactive by default: the questions are read from stdin without blocking the event loop (and
without a thread that Ctrl-C would leave stuck in `input()`). The owner's Telegram chat id is
captured rather than typed: init shows a one-time code, and the first private message to the
bot that carries it names the owner's chat. A stranger who does not know the code cannot
become the owner. `--non-interactive` takes every answer from flags.

Safe: it refuses a directory that already holds a config, and writes into a scratch directory
next to DIR that is renamed into place only once everything is written and loads, so a failure
(or Ctrl-C) leaves nothing half-written.

Top-level imports are the standard library only (the CLI's import time is guarded).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import re
import secrets
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from butlers.claude_code import claude_binary
from butlers.errors import BotApiUnreachable, CommandError, TokenRejected

if TYPE_CHECKING:
    from telegram import Bot, Chat

    from butlers.modules.mail_transport import Security
    from butlers.settings import Settings

T = TypeVar("T")

CHANNELS = ("telegram", "email")
# The shipped specialists (besides `general`, which every config gets).
SPECIALISTS = ("health", "relationship")
TEMPLATES = Path(__file__).parent / "init_templates"
SWITCHBOARD_PORT = 8100  # the shipped config's; the other butlers keep their shipped ports

DEFAULT_TOKEN_ENV = "TELEGRAM_BOT_TOKEN"
DEFAULT_MAIL_USER_ENV = "BUTLERS_EMAIL_USER"  # EmailConfig.username_env's default
DEFAULT_MAIL_PASSWORD_ENV = "BUTLERS_EMAIL_PASSWORD"
AUTH_TOKEN_ENV = "BUTLERS_AUTH_TOKEN"
DATA_DIR_ENV = "BUTLERS_DATA_DIR"
# The C library's zone variable: the client commands print times in local time
# (butlers.cli.render.when), so a shell that loads .env reads them on the owner's clock,
# not a server's UTC (a walkthrough on a machine kept in UTC).
TIMEZONE_ENV = "TZ"
ANTHROPIC_KEY_ENV = "ANTHROPIC_API_KEY"

# The one-time code that pairs the owner's chat: no 0/O, 1/I to misread; 32**8 = 2**40.
CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
CODE_LENGTH = 8
OWNER_WAIT_S = 300  # how long init waits for the code to arrive
POLL_TIMEOUT_S = 25  # one getUpdates long poll
PAIRED_REPLY = (
    "Paired: this chat is now the owner's. Your butlers will answer here once they run "
    "(butlers up)."
)

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CHAT_ID = re.compile(r"-?[0-9]{1,20}")
EMAIL = re.compile(r"[^@\s\"'<>(),;:\\\[\]]+@[^@\s\"'<>(),;:\\\[\]]+")
HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
URL = re.compile(r"https?://[^\s\"'\\]+")


# ---- the command line ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="the config directory to write")
    parser.add_argument(
        "--non-interactive",
        action="store_true",
        help="ask nothing: every answer comes from the flags below (or their defaults)",
    )
    parser.add_argument(
        "--channels",
        metavar="LIST",
        help="the switchboard's channels: telegram, email or telegram,email (default telegram)",
    )
    parser.add_argument(
        "--specialists",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"also write the shipped specialists ({', '.join(SPECIALISTS)}); "
        "non-interactive default: no",
    )
    telegram = parser.add_argument_group("Telegram")
    telegram.add_argument(
        "--bot-token-env",
        metavar="NAME",
        help=f"the variable holding the bot token (default {DEFAULT_TOKEN_ENV}); the token "
        "itself goes only into DIR/.env",
    )
    telegram.add_argument(
        "--owner-chat-id",
        metavar="ID",
        help="the owner's chat id (interactive: captured with a one-time code instead)",
    )
    telegram.add_argument(
        "--telegram-api-base-url",
        metavar="URL",
        help="another Bot API server (self-hosted); written as [modules.telegram] api_base_url",
    )
    mail = parser.add_argument_group("email")
    mail.add_argument("--owner-email", metavar="ADDR", help="the owner's address (may write)")
    mail.add_argument("--imap-host", metavar="HOST", help="the IMAP server")
    mail.add_argument(
        "--imap-port",
        type=_port,
        metavar="PORT",
        help="its port (default 993, implicit TLS; 143: STARTTLS)",
    )
    mail.add_argument(
        "--imap-tls",
        choices=("implicit", "starttls"),
        help="how its TLS begins (default: asked of the server, else by the port)",
    )
    mail.add_argument("--smtp-host", metavar="HOST", help="the SMTP server")
    mail.add_argument(
        "--smtp-port",
        type=_port,
        metavar="PORT",
        help="its port (default 587, STARTTLS; 465: implicit TLS)",
    )
    mail.add_argument(
        "--smtp-tls",
        choices=("implicit", "starttls"),
        help="how its TLS begins (default: asked of the server, else by the port)",
    )
    mail.add_argument(
        "--mail-username",
        metavar="USER",
        help=f"the mailbox's user name (written into DIR/.env as {DEFAULT_MAIL_USER_ENV})",
    )
    mail.add_argument(
        "--mail-password-env",
        metavar="NAME",
        help=f"the variable holding its password (default {DEFAULT_MAIL_PASSWORD_ENV})",
    )
    mail.add_argument(
        "--mail-address",
        metavar="ADDR",
        help="the butler's own address, From of its replies (default: the user name)",
    )
    mail.add_argument(
        "--authserv-id",
        metavar="ID",
        help="your receiving server's authserv-id (the first word of its "
        "Authentication-Results headers): only mail it says passed DMARC counts; needed "
        "with --pairing (else codes go to forged senders)",
    )
    parser.add_argument(
        "--timezone",
        metavar="ZONE",
        help="the owner's IANA time zone (default: this machine's, else UTC)",
    )
    parser.add_argument(
        "--pairing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="answer unknown senders with a one-time code the owner approves "
        "([switchboard.pairing] enabled); non-interactive default: no",
    )


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port number between 1 and 65535, got {text!r}"
        )
    return port


# ---- answers and their checks --------------------------------------------------------------


@dataclasses.dataclass
class Answers:
    """What the written config says: from the flags, the questions, or the defaults."""

    channels: tuple[str, ...] = ("telegram",)
    specialists: bool = False
    bot_token_env: str = DEFAULT_TOKEN_ENV
    telegram_api_base_url: str = ""
    owner_chat_id: str = ""
    owner_email: str = ""
    imap_host: str = ""
    imap_port: int = 993
    imap_tls: str = ""  # implicit | starttls; "": settled by `settle_mail_tls`
    smtp_host: str = ""
    smtp_port: int = 587
    smtp_tls: str = ""
    mail_username: str = ""
    mail_password_env: str = DEFAULT_MAIL_PASSWORD_ENV
    mail_address: str = ""
    authserv_id: str = ""
    timezone: str = "UTC"
    pairing: bool = False
    # Secret values typed in answer to a question (variable -> value): written to .env only.
    typed_secrets: dict[str, str] = dataclasses.field(default_factory=dict)


def check_channels(text: str) -> tuple[str, ...]:
    chosen = [c.strip().lower() for c in text.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CHANNELS]
    if unknown or not chosen:
        raise ValueError(
            f"expected telegram, email or telegram,email, got {text!r}"
            + (f" ({', '.join(unknown)} is not a channel)" if unknown else "")
        )
    return tuple(dict.fromkeys(chosen))


def _whole(pattern: re.Pattern[str], text: str, expected: str) -> str:
    """`text` if all of it matches `pattern`; else a ValueError saying what was `expected`."""
    if not pattern.fullmatch(text):
        raise ValueError(f"expected {expected}, got {text!r}")
    return text


def check_env_name(text: str) -> str:
    return _whole(ENV_NAME, text, "an environment variable name such as MY_TOKEN")


def check_chat_id(text: str) -> str:
    return _whole(CHAT_ID, text, "a Telegram chat id (a number such as 123456789)")


def check_email(text: str) -> str:
    return _whole(EMAIL, text, "an email address such as me@example.com")


def not_the_butlers(owner_email: str, butler_address: str) -> str:
    """The owner's address, unless it is the butler's own: mail from that is never read (it
    is how the butler knows its own replies), so the owner could never write (a walkthrough
    of the first hour)."""
    if owner_email and owner_email.lower() == butler_address.lower():
        raise ValueError(
            f"{owner_email} is the butler's own address, whose mail it never reads (its own "
            "replies): give the address you write from"
        )
    return owner_email


def check_host(text: str) -> str:
    return _whole(HOST, text, "a host name such as imap.example.com")


def check_port(text: str) -> int:
    try:
        return _port(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


def check_url(text: str) -> str:
    return _whole(URL, text, "an http(s) URL such as http://127.0.0.1:8081").rstrip("/")


def check_timezone(text: str) -> str:
    """An IANA zone, checked as butler.toml's `timezone` keys are (butlers.config)."""
    from pydantic import TypeAdapter, ValidationError

    from butlers.config import TimeZone

    try:
        return TypeAdapter(TimeZone).validate_python(text)
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


def machine_timezone(environ: Mapping[str, str]) -> str:
    """This machine's IANA zone: TZ, /etc/timezone, or where /etc/localtime points; else UTC."""
    candidates = [environ.get("TZ", "").lstrip(":")]
    with contextlib.suppress(OSError, UnicodeDecodeError):
        candidates.append(Path("/etc/timezone").read_text(encoding="utf-8").strip())
    with contextlib.suppress(OSError):
        candidates.append(os.readlink("/etc/localtime"))
    for candidate in candidates:
        name = candidate.split("zoneinfo/", 1)[-1]
        if not name or name.startswith("/"):
            continue
        with contextlib.suppress(ValueError):
            return check_timezone(name)
    return "UTC"


def _flag(value: str | None, check: Callable[[str], T], flag: str) -> T | None:
    """A flag's value through its check; a bad one is an error naming the flag."""
    if value is None:
        return None
    try:
        return check(value.strip())
    except ValueError as exc:
        raise CommandError(f"{flag}: {exc}") from None


def answers_from_flags(args: argparse.Namespace, environ: Mapping[str, str]) -> Answers:
    """The flags' answers over the defaults (what --non-interactive writes, and what the
    questions start from: a question a flag answered is not asked)."""
    answers = Answers(timezone=machine_timezone(environ))
    given = {
        "channels": _flag(args.channels, check_channels, "--channels"),
        "bot_token_env": _flag(args.bot_token_env, check_env_name, "--bot-token-env"),
        "telegram_api_base_url": _flag(
            args.telegram_api_base_url, check_url, "--telegram-api-base-url"
        ),
        "owner_chat_id": _flag(args.owner_chat_id, check_chat_id, "--owner-chat-id"),
        "owner_email": _flag(args.owner_email, check_email, "--owner-email"),
        "imap_host": _flag(args.imap_host, check_host, "--imap-host"),
        "imap_port": args.imap_port,
        "imap_tls": args.imap_tls,
        "smtp_host": _flag(args.smtp_host, check_host, "--smtp-host"),
        "smtp_port": args.smtp_port,
        "smtp_tls": args.smtp_tls,
        "mail_username": _flag(args.mail_username, _check_username, "--mail-username"),
        "mail_password_env": _flag(args.mail_password_env, check_env_name, "--mail-password-env"),
        "mail_address": _flag(args.mail_address, check_email, "--mail-address"),
        "authserv_id": _flag(args.authserv_id, check_host, "--authserv-id"),
        "timezone": _flag(args.timezone, check_timezone, "--timezone"),
        "specialists": args.specialists,
        "pairing": args.pairing,
    }
    for key, value in given.items():
        if value is not None:
            setattr(answers, key, value)
    return answers


def _check_username(text: str) -> str:
    if not text or any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(f"expected a user name without spaces, got {text!r}")
    return text


TELEGRAM_FLAGS = ("--bot-token-env", "--owner-chat-id", "--telegram-api-base-url")
EMAIL_FLAGS = (
    "--owner-email",
    "--imap-host",
    "--imap-port",
    "--imap-tls",
    "--smtp-host",
    "--smtp-port",
    "--smtp-tls",
    "--mail-username",
    "--mail-password-env",
    "--mail-address",
    "--authserv-id",
)


def check_flags_fit(args: argparse.Namespace, channels: tuple[str, ...]) -> None:
    """A flag of a channel that is not chosen would be silently dropped: say so instead."""
    for channel, flags in (("telegram", TELEGRAM_FLAGS), ("email", EMAIL_FLAGS)):
        if channel in channels:
            continue
        given = [f for f in flags if getattr(args, f[2:].replace("-", "_")) is not None]
        if given:
            raise CommandError(
                f"{', '.join(given)} given, but the channels are {','.join(channels)}: "
                f"add {channel} to --channels (e.g. --channels telegram,email)"
            )


def complete_mail(answers: Answers) -> None:
    """Defaults that follow from other answers, and what email cannot do without."""
    if "email" not in answers.channels:
        return
    missing = [
        flag
        for flag, value in (
            ("--imap-host", answers.imap_host),
            ("--smtp-host", answers.smtp_host),
            ("--mail-username", answers.mail_username),
        )
        if not value
    ]
    if missing:
        raise CommandError(f"the email channel needs {', '.join(missing)}")
    if not answers.mail_address:
        if not EMAIL.fullmatch(answers.mail_username):
            raise CommandError(
                f"the email channel needs --mail-address (the butler's own address): the user "
                f"name {answers.mail_username!r} is not one"
            )
        answers.mail_address = answers.mail_username
    try:
        not_the_butlers(answers.owner_email, answers.mail_address)
    except ValueError as exc:
        raise CommandError(f"--owner-email: {exc}") from None
    if answers.pairing and not answers.authserv_id:
        # Every mail from an unknown address would be answered with a code: without a
        # verified sender, forged Froms make the butler mail people who never wrote.
        raise CommandError(
            "pairing by email needs --authserv-id (your receiving server's authserv-id, as "
            "in its Authentication-Results headers): otherwise codes go to forged senders; "
            "or pair by Telegram only (--channels telegram)"
        )


# ---- what is written -----------------------------------------------------------------------


def toml_string(value: str) -> str:
    """A TOML basic string: every character that TOML requires escaped is escaped."""
    escapes = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n"}
    escapes |= {"\f": "\\f", "\r": "\\r"}
    out = []
    for char in value:
        if char in escapes:
            out.append(escapes[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def switchboard_toml(answers: Answers) -> str:
    """The switchboard's butler.toml: the shipped one's shape, with the answers."""
    q = toml_string
    channels = " and ".join({"telegram": "Telegram", "email": "email"}[c] for c in answers.channels)
    lines = [
        "[butler]",
        'name = "switchboard"',
        f'description = "Front door: takes messages from {channels}, decides which '
        'butler should handle each one, routes it there and replies on the same channel."',
        f"port = {SWITCHBOARD_PORT}",
        "",
        "[runtime]",
        "max_turns = 6",
        "timeout_s = 120",
    ]
    if "telegram" in answers.channels:
        chats = f"[{q(answers.owner_chat_id)}]" if answers.owner_chat_id else "[]"
        lines += [
            "",
            "[modules.telegram]",
            'mode = "polling"',
            f"token_env = {q(answers.bot_token_env)}    # the token itself: in .env",
            f"allowed_chat_ids = {chats}    # who may talk to the bot; empty = nobody",
        ]
        if answers.telegram_api_base_url:
            lines.append(f"api_base_url = {q(answers.telegram_api_base_url)}")
    if "email" in answers.channels:
        imap_tls = "imap_starttls" if answers.imap_tls == "starttls" else "imap_ssl"
        smtp_tls = "smtp_ssl" if answers.smtp_tls == "implicit" else "smtp_starttls"
        senders = f"[{q(answers.owner_email)}]" if answers.owner_email else "[]"
        lines += [
            "",
            "[modules.email]",
            f"imap_host = {q(answers.imap_host)}",
            f"imap_port = {answers.imap_port}",
            f"{imap_tls} = true",
            f"smtp_host = {q(answers.smtp_host)}",
            f"smtp_port = {answers.smtp_port}",
            f"{smtp_tls} = true",
            f"username_env = {q(DEFAULT_MAIL_USER_ENV)}    # user name and password: in .env",
            f"password_env = {q(answers.mail_password_env)}",
            f"address = {q(answers.mail_address)}",
            'mode = "idle"',
            f'allowed_senders = {senders}    # addresses or "@domain"; empty = nobody',
            *(
                [f"require_authentication_results = {q(answers.authserv_id)}"]
                if answers.authserv_id
                else [
                    "# To accept only mail your server verified (DMARC pass), name its "
                    "authserv-id:",
                    '# require_authentication_results = "mx.example.com"',
                ]
            ),
        ]
    prefer = "email" if answers.owner_email and not answers.owner_chat_id else "telegram"
    lines += [
        "",
        "[switchboard]                  # this table makes this butler the switchboard",
        'default_butler = "general"     # where a message goes that no butler was picked for',
        "",
        "[switchboard.owner]            # where notifications (reminders) go",
        f"telegram_chat_id = {q(answers.owner_chat_id)}",
        f"email = {q(answers.owner_email)}",
        f'prefer = "{prefer}"',
        f"timezone = {q(answers.timezone)}",
        "",
        "[switchboard.pairing]          # unknown senders get a one-time code you approve",
        f"enabled = {'true' if answers.pairing else 'false'}",
        "",
        "# Voice notes need a speech-to-text service (docs/voice-and-files.md), e.g.:",
        "# [switchboard.transcription]",
        '# url = "https://api.openai.com/v1/audio/transcriptions"',
        '# model = "whisper-1"',
        '# api_key_env = "TRANSCRIPTION_API_KEY"   # set it in .env',
    ]
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class EnvEntry:
    """One variable of .env: its value (None: unknown, written commented out) and why."""

    name: str
    value: str | None
    comment: str


def env_entries(answers: Answers, environ: Mapping[str, str], target: Path) -> list[EnvEntry]:
    """Every variable the written config refers to, with the value typed, else the one this
    environment has, else none. BUTLERS_AUTH_TOKEN is generated when there is none.

    BUTLERS_DATA_DIR too, DIR/.butlers unless the environment names one: its default
    (.butlers) is relative to the directory `butlers up` starts in, so a config started from
    the checkout would otherwise share the databases of the example fleet there (a
    newcomer's `general` answering with the example's state, its registry listing the
    example's butlers as stale)."""

    def value(name: str) -> str | None:
        typed = answers.typed_secrets.get(name)  # "" when one was rejected and none typed
        return (typed if typed is not None else environ.get(name)) or None

    entries = []
    if "telegram" in answers.channels:
        entries.append(
            EnvEntry(
                answers.bot_token_env,
                value(answers.bot_token_env),
                "The Telegram bot token from @BotFather ([modules.telegram] token_env).",
            )
        )
    if "email" in answers.channels:
        entries += [
            EnvEntry(
                DEFAULT_MAIL_USER_ENV,
                answers.mail_username,
                "The mailbox's user name ([modules.email] username_env).",
            ),
            EnvEntry(
                answers.mail_password_env,
                value(answers.mail_password_env),
                "Its password ([modules.email] password_env).",
            ),
        ]
    entries += [
        EnvEntry(
            AUTH_TOKEN_ENV,
            value(AUTH_TOKEN_ENV) or secrets.token_urlsafe(32),
            "The bearer token every butler's MCP endpoint requires; the butlers commands "
            "(ask, inbox...) send it.",
        ),
        EnvEntry(
            ANTHROPIC_KEY_ENV,
            value(ANTHROPIC_KEY_ENV),
            "Claude Code's credentials: an Anthropic API key, or leave it out and log in once "
            f"with {claude_binary()} (/login).",
        ),
        EnvEntry(
            DATA_DIR_ENV,
            _writable(environ.get(DATA_DIR_ENV) or str(target / ".butlers")),
            "Where this config's PostgreSQL data and sessions' files live (not a secret: its "
            "own, whatever directory `butlers up` starts in).",
        ),
        EnvEntry(
            TIMEZONE_ENV,
            answers.timezone,
            "Your time zone ([switchboard.owner] timezone), for the butlers commands: their "
            "tables show times on your clock, as Telegram and the dashboard do.",
        ),
    ]
    return entries


UNWRITABLE = "'\n\r"  # what no .env reader takes back as it is, in single quotes or bare


def _writable(value: str) -> str | None:
    """`value`, unless .env cannot carry it as it is (see env_text): then None, a line for
    the owner to fill in, rather than refusing the whole config for a directory's name."""
    return None if any(c in value for c in UNWRITABLE) else value


def env_text(target: Path, entries: list[EnvEntry]) -> str:
    """.env as a shell (`set -a; . .env`), docker compose (`env_file`) and python-dotenv
    all read it: a value is bare or in single quotes, where none of them interprets anything.
    A value none of them would read back as it is (a quote, a line break) is refused."""
    lines = [
        "# Secrets of the butlers in this directory, where their data lives and your time",
        "# zone, written by `butlers init` (mode 0600: keep it so, and out of version",
        "# control). `butlers up` reads them from the environment only: load this file into",
        "# the shell that runs butlers commands:",
        f"#   set -a; . {shlex.quote(str(target / '.env'))}; set +a",
        '# A line starting with "#NAME=" is not set yet: fill in its value and remove the "#".',
    ]
    for entry in entries:
        if entry.value is not None and any(c in entry.value for c in UNWRITABLE):
            raise CommandError(
                f"the value of {entry.name} holds a quote or a line break, which .env cannot "
                "carry as it is for every reader: set it in the environment instead (nothing "
                "was written)"
            )
        lines += ["", f"# {entry.comment}"]
        if entry.value is None:
            lines.append(f"#{entry.name}=")
        else:
            lines.append(f"{entry.name}={shlex.quote(entry.value)}")
    return "\n".join(lines) + "\n"


def config_files(answers: Answers) -> dict[str, str]:
    """Relative path -> text of every file but .env."""
    butlers = ["general", *(SPECIALISTS if answers.specialists else ())]
    files = {"switchboard/butler.toml": switchboard_toml(answers)}
    files["switchboard/CLAUDE.md"] = (TEMPLATES / "switchboard" / "CLAUDE.md").read_text("utf-8")
    for name in butlers:
        for filename in ("butler.toml", "CLAUDE.md"):
            path = TEMPLATES / name / filename
            try:
                files[f"{name}/{filename}"] = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise CommandError(
                    f"this butlers installation lacks its init templates ({path}: "
                    f"{exc.strerror}); reinstall it"
                ) from None
    return files


def existing_config(target: Path, names: list[str]) -> str | None:
    """Why `target` may not be written (it holds a config, or something in the way)."""
    if target.exists() and not target.is_dir():
        return f"{target} exists and is not a directory"
    if not target.is_dir():
        return None
    for root, dirs, files in os.walk(target):
        dirs.sort()
        if "butler.toml" in files:
            return f"{target} already holds a config ({Path(root) / 'butler.toml'})"
    env = target / ".env"
    if env.exists() and (not env.is_file() or env.stat().st_size > 0):
        return f"{target} already holds a config ({env} is not empty)"
    in_the_way = [target / n for n in names if (target / n).exists() and n != ".env"]
    if in_the_way:
        return f"{in_the_way[0]} already exists"
    return None


def refuse_existing(target: Path, names: list[str]) -> None:
    problem = existing_config(target, names)
    if problem:
        raise CommandError(
            f"{problem}: butlers init writes a new config and never changes one; choose "
            "another DIR (nothing was written)"
        )


def write_config(target: Path, files: dict[str, str], env: str) -> None:
    """Write everything into a scratch directory beside `target`, check that it loads, then
    rename it into place (into an existing empty-of-config `target` entry by entry, undone if
    one fails): a failure leaves nothing half-written. .env is 0600 from its creation."""
    from butlers.config import load_config_dir

    names = sorted({p.split("/")[0] for p in files} | {".env"})
    refuse_existing(target, names)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.init-{secrets.token_hex(4)}"
    os.mkdir(scratch)
    try:
        for relative, text in files.items():
            path = scratch / relative
            path.parent.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
        descriptor = os.open(scratch / ".env", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(env)
        fleet = load_config_dir(scratch)
        if fleet.errors:  # a bug of ours: say it rather than write a config `up` skips
            raise CommandError(
                "the config init wrote does not load (nothing was written):\n"
                + "\n".join(str(e) for e in fleet.errors)
            )
        refuse_existing(target, names)  # again: something may have appeared meanwhile
        if not target.exists():
            os.rename(scratch, target)
            return
        moved: list[str] = []
        try:
            for name in names:
                os.replace(scratch / name, target / name)
                moved.append(name)
        except OSError:
            for name in reversed(moved):
                with contextlib.suppress(OSError):
                    os.replace(target / name, scratch / name)
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def next_steps(target: Path, answers: Answers, entries: list[EnvEntry]) -> str:
    d = shlex.quote(str(target))
    butlers = ["switchboard", "general", *(SPECIALISTS if answers.specialists else ())]
    unset = [e.name for e in entries if e.value is None]
    lines = [
        f"Wrote {target}: {', '.join(butlers)} "
        f"(the switchboard on {' and '.join(answers.channels)}); secrets in "
        f"{target / '.env'} (mode 0600), none in the TOML files.",
    ]
    data = next((e.value for e in entries if e.name == DATA_DIR_ENV), None)
    if data is not None and Path(data) != target / ".butlers":
        # Taken from this shell (say, another config's .env loaded earlier): said, so that
        # two configs sharing one data directory is a choice, not an accident.
        lines.append(
            f"Its data: {data}, from this shell's {DATA_DIR_ENV} (to keep it apart, set "
            f"{DATA_DIR_ENV}={target / '.butlers'} in {target / '.env'})."
        )
    lines += ["", "Next:"]
    step = 1
    if unset:
        lines.append(
            f"  {step}. Fill in {target / '.env'}: {', '.join(unset)} (remove the # before each)."
            + (
                f" Or leave {ANTHROPIC_KEY_ENV} out and log in once: {claude_binary()} /login"
                if ANTHROPIC_KEY_ENV in unset
                else ""
            )
        )
        step += 1
    if not answers.owner_chat_id and not answers.owner_email:
        lines.append(
            f"  {step}. Nobody may write to the butlers yet: set [switchboard.owner] and the "
            f"allowlists in {target / 'switchboard' / 'butler.toml'} (or remove {target} and "
            "run init again, giving the owner)."
        )
        step += 1
    command = _this_command()
    lines += [
        f"  {step}. Load the secrets into your shell (`butlers up` reads them from the "
        "environment only, not from .env):",
        f"       set -a; . {shlex.quote(str(target / '.env'))}; set +a",
        f"  {step + 1}. {command} doctor --config-dir {d}",
        f"  {step + 2}. {command} up --config-dir {d}",
    ]
    if "telegram" in answers.channels:
        lines.append(f"  {step + 3}. Write to your bot on Telegram.")
    return "\n".join(lines)


# ---- questions -----------------------------------------------------------------------------


class Console:
    """Questions on stdout, answers from stdin, awaited without blocking the loop.

    stdin is watched with the loop's add_reader and read only once it is readable: no thread
    sits in input() (a Ctrl-C would leave it there, and the interpreter would wait for it).
    A regular file as stdin never makes anyone wait, so it is read in a worker thread."""

    def __init__(self) -> None:
        try:
            self._fd = sys.stdin.fileno()
        except (AttributeError, OSError, ValueError):  # no stdin at all: every answer is EOF
            self._fd = -1
        self._buffer = bytearray()
        self._eof = self._fd < 0

    def say(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, flush=True)

    async def _read(self) -> bytes:
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        try:
            loop.add_reader(self._fd, ready)
        except (OSError, ValueError, NotImplementedError):  # a regular file: epoll refuses it
            return await asyncio.to_thread(os.read, self._fd, 65536)
        try:
            await readable
        finally:
            loop.remove_reader(self._fd)
        return os.read(self._fd, 65536)

    async def line(self, prompt: str, *, hidden: bool = False) -> str:
        # Echo off before the prompt shows: an answer typed (pasted) at once is not shown.
        with self._echo_off() if hidden else contextlib.nullcontext():
            self.say(prompt, end="")
            while b"\n" not in self._buffer and not self._eof:
                chunk = await self._read()
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True
        if hidden:
            self.say()
        if not self._buffer and self._eof:
            raise CommandError(
                f"no answer to {prompt.strip()!r}: stdin is closed (to answer without a "
                "terminal, use --non-interactive and its flags)"
            )
        line, _, rest = self._buffer.partition(b"\n")
        self._buffer = bytearray(rest)
        return line.decode("utf-8", errors="replace").strip()

    @contextlib.contextmanager
    def _echo_off(self) -> Iterator[None]:
        """What is typed is not shown (a token, a password), when stdin is a terminal."""
        if self._fd < 0 or not os.isatty(self._fd):
            yield
            return
        import termios

        before = termios.tcgetattr(self._fd)
        quiet = list(before)
        quiet[3] &= ~termios.ECHO
        termios.tcsetattr(self._fd, termios.TCSADRAIN, quiet)
        try:
            yield
        finally:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, before)

    async def ask(self, question: str, check: Callable[[str], T], default: str = "") -> T:
        """Until the answer passes `check` (its complaint shown); empty means `default`."""
        shown = f" [{default}]" if default else ""
        while True:
            answer = await self.line(f"{question}{shown}: ") or default
            try:
                return check(answer)
            except ValueError as exc:
                self.say(f"  {exc}")

    async def yes(self, question: str, default: bool) -> bool:
        def check(text: str) -> bool:
            if text.lower() in ("y", "yes"):
                return True
            if text.lower() in ("n", "no"):
                return False
            raise ValueError("answer y or n")

        return await self.ask(f"{question} (y/n)", check, "y" if default else "n")

    async def secret(self, question: str) -> str:
        """A secret typed without echo; empty: none."""
        return await self.line(f"{question}: ", hidden=True)


def _optional(check: Callable[[str], T]) -> Callable[[str], T | str]:
    def optional(text: str) -> T | str:
        return check(text) if text else ""

    return optional


async def ask_questions(
    args: argparse.Namespace, answers: Answers, settings: Settings, console: Console
) -> None:
    """Ask what the flags did not answer, in the order an owner thinks of it."""
    console.say(f"Writing a new config directory: {args.dir}")
    if args.channels is None:
        answers.channels = await console.ask(
            "Channels (telegram, email, or telegram,email)", check_channels, "telegram"
        )
    check_flags_fit(args, answers.channels)
    if args.specialists is None:
        answers.specialists = await console.yes(
            f"Also the shipped specialists ({', '.join(SPECIALISTS)})?", True
        )
    if "telegram" in answers.channels:
        await ask_telegram(args, answers, settings, console)
    if "email" in answers.channels:
        await ask_mail(args, answers, settings, console)
    if args.pairing is None:
        answers.pairing = await console.yes(
            "Let unknown senders ask for access with a one-time code you approve (pairing)?",
            False,
        )
        if answers.pairing and "email" in answers.channels and not answers.authserv_id:
            # Asked now, not refused at the end with every answer lost (a walkthrough).
            answers.authserv_id = await console.ask(
                "Pairing by email needs your mail server's authserv-id (a stranger's From "
                "proves nothing without it; Enter: no pairing at all, by Telegram either)",
                _optional(check_host),
            )
            answers.pairing = bool(answers.authserv_id)
    if args.timezone is None:
        answers.timezone = await console.ask("Your time zone", check_timezone, answers.timezone)


async def ask_telegram(
    args: argparse.Namespace, answers: Answers, settings: Settings, console: Console
) -> None:
    if args.bot_token_env is None:
        answers.bot_token_env = await console.ask(
            "The environment variable for the bot token", check_env_name, DEFAULT_TOKEN_ENV
        )
    if args.owner_chat_id is not None:
        return
    name = answers.bot_token_env
    token = settings.variable(name)
    which = f"the bot token in ${name}"
    if token:
        console.say(f"Using the bot token in ${name} (it goes into .env, not the TOML).")
    else:
        token = await console.secret(
            f"The bot token from @BotFather (not shown; kept only in .env as {name}; "
            "Enter: none yet)"
        )
        if token:
            answers.typed_secrets[name] = token
            which = "that bot token"
    while token:
        try:
            answers.owner_chat_id = await capture_owner_chat(
                token, answers.telegram_api_base_url, name, console
            )
            return
        except BotApiUnreachable as exc:
            # Offline, a proxy, a firewall: the answers so far are kept (they were all lost,
            # "nothing was written": a walkthrough), and the chat id can be typed instead.
            console.say(
                f"{exc}: check this machine's connection to Telegram. The token is kept; "
                "type your chat id below instead, or press Enter and set it later."
            )
            break
        except TokenRejected:
            # A token copied short is the commonest slip: ask again instead of starting over.
            console.say(
                f"Telegram rejected {which}: copy it again from @BotFather (/mybots, your "
                "bot, API Token)."
            )
            token = await console.secret(
                f"The bot token (not shown; kept only in .env as {name}; Enter: none yet)"
            )
            answers.typed_secrets[name] = token  # "": none yet, not the rejected one
            which = "that bot token"
    answers.owner_chat_id = await console.ask(
        "Your Telegram chat id, a number (Telegram's @userinfobot tells you yours; Enter: none "
        "yet)",
        _optional(check_chat_id),
    )


async def ask_mail(
    args: argparse.Namespace, answers: Answers, settings: Settings, console: Console
) -> None:
    if args.imap_host is None:
        answers.imap_host = await console.ask("IMAP server", check_host)
    if args.imap_port is None:
        answers.imap_port = await console.ask(
            "IMAP port (993: TLS, 143: STARTTLS)", check_port, "993"
        )
    if args.smtp_host is None:
        answers.smtp_host = await console.ask("SMTP server", check_host)
    if args.smtp_port is None:
        answers.smtp_port = await console.ask(
            "SMTP port (587: STARTTLS, 465: TLS)", check_port, "587"
        )
    if args.mail_username is None:
        answers.mail_username = await console.ask("The mailbox's user name", _check_username)
    if args.mail_password_env is None:
        answers.mail_password_env = await console.ask(
            "The environment variable for its password", check_env_name, DEFAULT_MAIL_PASSWORD_ENV
        )
    name = answers.mail_password_env
    if settings.variable(name):
        console.say(f"Using the password in ${name} (it goes into .env, not the TOML).")
    else:
        password = await console.secret(
            f"Its password (not shown; kept only in .env as {name}; Enter: none yet)"
        )
        if password:
            answers.typed_secrets[name] = password
    if args.authserv_id is None:
        answers.authserv_id = await console.ask(
            "Your mail server's authserv-id, the first word of its Authentication-Results "
            "headers (only mail it says passed DMARC counts; Enter: none)",
            _optional(check_host),
        )
    if args.mail_address is None:
        default = answers.mail_username if EMAIL.fullmatch(answers.mail_username) else ""
        answers.mail_address = await console.ask(
            "The butler's own address (From of its replies)", check_email, default
        )
    if args.owner_email is None:
        answers.owner_email = await console.ask(
            "Your own address (may write to the butlers)",
            lambda text: not_the_butlers(check_email(text), answers.mail_address),
        )


async def settle_mail_tls(answers: Answers) -> list[str]:
    """How each mail server's TLS begins, where no flag said: asked of the server itself
    (it greets in plain text: STARTTLS; only inside TLS: implicit), else guessed from the
    port (143 and 587: STARTTLS). The port alone once wrote implicit TLS for a STARTTLS
    server on 1143 (Proton Bridge's), and doctor's advice pointed at the password (a
    walkthrough). What was chosen and why, a line each."""
    from butlers.modules.mail_transport import tls_keys, tls_spoken

    said = []
    # By the port alone: the well-known ones (IMAP 143, SMTP 587 and 25: STARTTLS; IMAP 993,
    # SMTP 465: implicit), and for any other what most such servers do.
    servers: list[tuple[Literal["IMAP", "SMTP"], str, int, str, Security]] = [
        (
            "IMAP",
            answers.imap_host,
            answers.imap_port,
            "imap_tls",
            "starttls" if answers.imap_port == 143 else "implicit",
        ),
        (
            "SMTP",
            answers.smtp_host,
            answers.smtp_port,
            "smtp_tls",
            "implicit" if answers.smtp_port == 465 else "starttls",
        ),
    ]
    for protocol, host, port, field, by_port in servers:
        if getattr(answers, field):
            continue
        spoken = await tls_spoken(host, port, timeout_s=3.0) if host else None
        if spoken in ("implicit", "starttls"):
            how = "greets in plain text: STARTTLS" if spoken == "starttls" else "speaks TLS at once"
            said.append(f"{protocol} {host}:{port} {how} (asked it): {tls_keys(protocol, spoken)}")
        else:
            spoken = by_port
            said.append(
                f"{protocol} {host}:{port} could not be asked; by its port: "
                f"{tls_keys(protocol, spoken)} (wrong? change it under [modules.email])"
            )
        setattr(answers, field, spoken)
    return said


# ---- the owner's chat ----------------------------------------------------------------------


def new_code() -> str:
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def carries_code(text: str, code: str) -> bool:
    """Whether a message's text holds the code, however it was spaced or cased."""
    return code in re.sub(r"[\s-]+", "", text).upper()


async def capture_owner_chat(
    token: str, api_base_url: str, token_env: str, console: Console
) -> str:
    """The chat id of the first private message to the bot that carries a fresh one-time
    code: only someone who saw this terminal can send it. The updates read up to it are
    acknowledged (`butlers up` will not see them; those of others are named, so that the
    owner can ask them to write again: a walkthrough's partner was never answered); later ones
    are left for it."""
    from telegram import Bot
    from telegram.error import Conflict, InvalidToken, NetworkError, TelegramError

    from butlers.redact import Redactor, install_log_redaction

    redactor = Redactor([token])
    # A typed token is in no variable the CLI's redactor knows; httpx logs URLs (with it).
    install_log_redaction(redactor)
    base = (api_base_url or "https://api.telegram.org").rstrip("/")
    bot = Bot(token, base_url=f"{base}/bot", base_file_url=f"{base}/file/bot")

    def failed(what: str, exc: Exception) -> CommandError:
        return CommandError(redactor(f"{what} ({type(exc).__name__}: {exc}); nothing was written"))

    try:
        await bot.initialize()  # getMe
    except InvalidToken:
        raise TokenRejected(f"Telegram rejected the bot token for ${token_env}") from None
    except TelegramError as exc:
        raise BotApiUnreachable(
            redactor(f"cannot reach the Telegram Bot API at {base} ({type(exc).__name__}: {exc})")
        ) from None
    try:
        code = new_code()
        console.say(
            f"\nTo make your Telegram chat the owner's, send this code to @{bot.username} "
            "from your own account, in a private chat with the bot:\n"
        )
        console.say(f"    {code}\n")
        console.say(
            f"Waiting up to {OWNER_WAIT_S // 60} minutes (Ctrl-C: stop, nothing written)..."
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + OWNER_WAIT_S
        offset: int | None = None
        others: dict[int, str] = {}  # chat id -> its name: messages not the code, forgotten
        while (left := deadline - loop.time()) > 0:
            try:
                updates = await bot.get_updates(
                    offset=offset,
                    timeout=max(1, min(POLL_TIMEOUT_S, int(left))),
                    allowed_updates=["message"],
                )
            except Conflict as exc:
                raise failed(
                    "another program reads this bot's updates (a running `butlers up`? a "
                    "webhook?): stop it, then run init again",
                    exc,
                ) from None
            except InvalidToken:
                raise CommandError("Telegram rejected the bot token while waiting") from None
            except NetworkError:
                await asyncio.sleep(1)  # a dropped long poll: ask again
                continue
            for update in updates:
                offset = update.update_id + 1
                message = update.message
                if message is None:
                    continue
                if message.chat.type != "private" or not carries_code(message.text or "", code):
                    # Not the owner: a stranger, a group, another text. Acknowledged with the
                    # code (Telegram forgets every update below an offset): named below.
                    others[message.chat.id] = _shown_name(message.chat, "someone")
                    continue
                await _acknowledge(bot, offset)
                with contextlib.suppress(TelegramError):
                    await bot.send_message(message.chat.id, PAIRED_REPLY)
                console.say(f"Paired: {_shown_name(message.chat, 'you')}, chat {message.chat.id}.")
                others.pop(message.chat.id, None)  # (the owner's own other texts)
                if others:
                    named = ", ".join(f"{who} (chat {chat})" for chat, who in others.items())
                    console.say(
                        f"Read while waiting, and not to be answered: messages from {named}. "
                        "Ask them to write again once `butlers up` runs."
                    )
                return str(message.chat.id)
        raise CommandError(
            f"the code did not arrive in {OWNER_WAIT_S // 60} minutes: run init again (or give "
            "--owner-chat-id); nothing was written"
        )
    finally:
        with contextlib.suppress(Exception):
            await bot.shutdown()


def _shown_name(chat: Chat, otherwise: str) -> str:
    """A chat's name for the terminal (the sender's text: no control characters)."""
    name = chat.full_name or chat.username or chat.title or otherwise
    return "".join(c for c in name if c.isprintable())[:80]


async def _acknowledge(bot: Bot, offset: int) -> None:
    """getUpdates with the offset past what was read tells Telegram to forget it."""
    from telegram.error import TelegramError

    with contextlib.suppress(TelegramError):
        await bot.get_updates(offset=offset, timeout=0, allowed_updates=["message"])


# ---- the command ---------------------------------------------------------------------------


def _folded(path: Path) -> Path:
    """`path` absolute, its `..` folded (links kept): as printed ("Next: ..." read
    `/tmp/x/butlers/../my-butlers/.env`)."""
    return Path(os.path.normpath(path.expanduser().absolute()))


async def run(args: argparse.Namespace, settings: Settings) -> int:
    target = _folded(args.dir)
    answers = answers_from_flags(args, settings.environ)
    # Refused before any question: nobody answers five of them to be told no.
    layout = ["switchboard", "general", *SPECIALISTS, ".env"]
    await asyncio.to_thread(refuse_existing, target, layout)
    try:
        if args.non_interactive:
            check_flags_fit(args, answers.channels)
        else:
            await ask_questions(args, answers, settings, Console())
    except asyncio.CancelledError:
        print("\nStopped: nothing was written.", file=sys.stderr, flush=True)
        raise
    complete_mail(answers)
    if "email" in answers.channels:
        for line in await settle_mail_tls(answers):
            print(line, file=sys.stderr)
    entries = env_entries(answers, settings.environ, target)
    files = await asyncio.to_thread(config_files, answers)
    await asyncio.to_thread(write_config, target, files, env_text(target, entries))
    print(next_steps(target, answers, entries))
    return 0


def _this_command() -> str:
    """How to run this `butlers` again from here: `.venv/bin/butlers` in a checkout is not on
    PATH, and the next steps must work as printed."""
    me = Path(sys.argv[0])
    if me.name != "butlers" or shutil.which("butlers") == str(me.resolve()):
        return "butlers"
    try:
        here = me.resolve().relative_to(Path.cwd())
    except (ValueError, OSError):  # elsewhere, or the working directory is gone
        return shlex.quote(str(me.resolve()))
    return shlex.quote(str(here) if "/" in str(here) else f"./{here}")
