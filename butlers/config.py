"""`config/butlers/<name>/butler.toml`: one pydantic model per table, and the loaded butler.

Every table of the file is a frozen pydantic dataclass below (`RuntimeConfig` is `[runtime]`,
and so on), validated once when the file is read and then read as plain attributes on every
message. `ButlerFile` is the whole file; `ButlerConfig` is a butler as the daemon runs it: the
file's tables plus what is not in the file (its directory, its CLAUDE.md, the bind address and
endpoint the environment's `Placement` fills in).

Errors name the file, the key and what was expected (butlers.config_errors); unknown keys are
errors, with the closest known key suggested. `load_config_dir` reports a broken butler and
skips it; the others still load. The switchboard is the butler whose file has a
`[switchboard]` table, whatever its name; docs/configuration.md documents every key, and
schemas/butler.schema.json (generated: `python -m butlers.schemas`) lets an editor check them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.config import JsonDict
from pydantic.dataclasses import dataclass

from butlers.channels import CHANNELS, channel_names
from butlers.channels.email import EmailConfig as EmailConfig
from butlers.channels.telegram import TelegramConfig as TelegramConfig
from butlers.config_errors import Expect, config_error
from butlers.config_types import MAX_ATTACHMENT_BYTES as MAX_ATTACHMENT_BYTES
from butlers.config_types import NAME_PATTERN as NAME_PATTERN
from butlers.config_types import TABLE, Bool, ChatId, Float, Int, Name, Port, Str
from butlers.errors import ButlersError, ConfigError, KeyProblem

CONFIG_FILENAME = "butler.toml"
INSTRUCTIONS_FILENAME = "CLAUDE.md"
# The tool by which the switchboard has a butler run a call the owner approved: never gated.
APPROVAL_EXECUTE_TOOL = "approval_execute"

# The channels' names as config values take them (a triage rule's `channel` also `mcp`).
if TYPE_CHECKING:
    ChannelName = str
    OwnerChannel = str
else:
    ChannelName = Literal[(*channel_names(), "mcp")]
    OwnerChannel = Literal[tuple(spec.name for spec in CHANNELS if spec.owner_key)]
HttpUrl = Annotated[str, Strict(), Field(pattern="^https?://"), Expect("an http(s) URL")]


def _regex(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regular expression: {exc}") from None
    return value


Regex = Annotated[re.Pattern[str], BeforeValidator(_regex)]


# Files of the zone database that are no place: the machine's own setting (sessions were told
# a zone named "localtime"), a template, and "Factory" (no offset, "-00").
_NOT_ZONES = frozenset({"localtime", "posixrules", "Factory"})


def _timezone(value: str) -> str:
    """An IANA zone the machine knows ("Europe/Berlin"), checked when the file is read rather
    than when the first reminder is due."""
    import zoneinfo

    try:
        if value in _NOT_ZONES:
            raise ValueError(value)
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        # Said right but for its case ("europe/berlin"): named, not only refused.
        known = {name.lower(): name for name in zoneinfo.available_timezones()}
        meant = known.get(value.strip().lower())
        hint = f"; did you mean {meant!r}?" if meant and meant not in _NOT_ZONES else ""
        raise ValueError(
            f"unknown time zone {value!r}: an IANA name such as 'Europe/Berlin' or 'UTC'{hint}"
        ) from None
    return value


TimeZone = Annotated[str, Strict(), AfterValidator(_timezone)]


def _none_if_empty(value: str | None) -> str | None:
    return value or None


@dataclass(frozen=True, config=TABLE)
class DbTable:
    """`[butler.db]`: the butler's own database (on the one PostgreSQL server)."""

    name: Name | None = Field(
        default=None, description="The butler's database; unset: `butler_<name>`."
    )


@dataclass(frozen=True, config=TABLE)
class ButlerTable:
    """`[butler]`: who the butler is and where it listens."""

    name: Name = Field(description="The butler's name; must equal its directory's name.")
    port: Port = Field(description="The TCP port it serves MCP and /health on.")
    description: Str = Field(
        default="", description="What it does; the classifier routes by this text."
    )
    host: Str | None = Field(
        default=None,
        description="Bind address; unset: `BUTLERS_HOST`, else `127.0.0.1`. Anything but "
        "loopback needs `BUTLERS_AUTH_TOKEN`.",
    )
    endpoint_url: HttpUrl | None = Field(
        default=None,
        description="What the registry stores as its MCP endpoint; unset: "
        "`BUTLERS_ENDPOINT_URL_TEMPLATE`, else `http://{host}:{port}/sse`.",
    )
    switchboard_url: HttpUrl | None = Field(
        default=None,
        description="Where this butler's `notify` reaches the switchboard; unset: "
        "`BUTLERS_SWITCHBOARD_URL`, else the switchboard of its config directory.",
    )
    db: DbTable = Field(default_factory=DbTable, description="`[butler.db]`.")
    timezone: TimeZone | None = Field(
        default=None,
        description="Its IANA time zone: cron schedules, one-shot `at` times without an "
        "offset and the local time a session is told are in it; unset: "
        "`[switchboard.owner] timezone` of its config directory, else UTC.",
    )


# ---- Tool servers ([[mcp_servers]]) and Claude Code's own tools ([runtime] builtin_tools) ----
# (butlers.tool_servers runs the servers; docs/tools.md says who can reach what.)

# Claude Code built-ins a session may be given: none of them runs a program or touches a file.
SAFE_BUILTIN_TOOLS = ("WebSearch", "WebFetch", "TodoWrite")
# Those that would run or write anything without passing through the butler (so without the
# owner's approval), or read any file the butler's user can (its data, its secrets).
REFUSED_BUILTIN_TOOLS = {
    **dict.fromkeys(("Bash", "BashOutput", "KillShell", "KillBash"), "runs shell commands"),
    **dict.fromkeys(("Write", "Edit", "MultiEdit", "NotebookEdit"), "writes files"),
    **dict.fromkeys(("Read", "Glob", "Grep", "LS", "NotebookRead"), "reads any file"),
    **dict.fromkeys(("Task", "Agent"), "starts sub-agents"),
}


def _safe_builtin_tools(names: tuple[str, ...]) -> tuple[str, ...]:
    """Only built-ins that neither run, write nor read files on the butler's machine: every
    such action must pass through the butler's own MCP server, where the owner's approval,
    tracing and redaction are."""
    for name in names:
        why = REFUSED_BUILTIN_TOOLS.get(name)
        if why is not None:
            raise ValueError(
                f"{name!r} {why}: it would bypass the owner's approval, which only sees calls "
                "through the butler's MCP server; read files through an [[mcp_servers]] "
                "filesystem server with an explicit root (and `approval` on what writes)"
            )
        if name not in SAFE_BUILTIN_TOOLS:
            raise ValueError(
                f"{name!r} is not a Claude Code built-in known to be safe here; "
                f"expected some of {', '.join(SAFE_BUILTIN_TOOLS)}"
            )
    return names


# `<server>__<tool>`: the separator must not occur in a server's name.
PROXY_SEPARATOR = "__"


def _server_name(value: str) -> str:
    # Nor may it end in "_": `notes_`'s `write` would be offered as `notes___write`, read
    # back as server `notes`, tool `_write` (a red team: its approval globs not applied).
    if PROXY_SEPARATOR in value or value.endswith("_"):
        raise ValueError(
            f"{value!r} contains {PROXY_SEPARATOR!r} or ends in '_': {PROXY_SEPARATOR!r} "
            "separates a server's name from its tools' names (`files__read_text_file`)"
        )
    return value


ServerName = Annotated[Name, AfterValidator(_server_name)]
ToolGlob = Annotated[
    str, Strict(), Field(min_length=1), Expect("a glob on tool names such as 'read_*'")
]
EnvName = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$"),
    Expect("an environment variable's name"),
]


# For editors: what `McpServerConfig._one_kind` says.
_ONE_KIND_OF_SERVER: JsonDict = {"oneOf": [{"required": ["command"]}, {"required": ["url"]}]}


@dataclass(frozen=True, config=ConfigDict(extra="forbid", json_schema_extra=_ONE_KIND_OF_SERVER))
class McpServerConfig:
    """`[[mcp_servers]]`: an MCP server this butler's sessions may use, through the butler:
    its own MCP server offers each allowed tool as `<name>__<tool>`. A stdio server
    (`command`) or a remote one (`url`, streamable HTTP or SSE). In `args`, `env` and `cwd`,
    `{data_dir}` is the butler's own data directory and `{butler_dir}` its config directory."""

    name: Annotated[ServerName, Expect("a name such as 'files' ([a-z][a-z0-9_-]*, no '__')")] = (
        Field(description="The server's name; its tools are `<name>__<tool>`.")
    )
    command: Str | None = Field(
        default=None, description="stdio: the program (found on PATH, e.g. `npx`)."
    )
    args: tuple[Str, ...] = Field(default=(), description="stdio: its arguments.")
    env: dict[EnvName, Str] = Field(
        default_factory=dict,
        description="stdio: variables it gets besides PATH, HOME, locale and TZ (nothing "
        "else of the butler's). Not for secrets: see `pass_env`.",
    )
    pass_env: tuple[EnvName, ...] = Field(
        default=(),
        description="stdio: variables of the butler's environment it gets too (a token: "
        "the value stays out of the file, and out of logs and answers).",
    )
    cwd: Str | None = Field(
        default=None,
        description="stdio: its working directory; unset: the butler's data directory.",
    )
    url: HttpUrl | None = Field(
        default=None,
        description="remote: its endpoint; a path ending in `/sse` is MCP over SSE, anything "
        "else streamable HTTP.",
    )
    headers_env: dict[Str, EnvName] = Field(
        default_factory=dict,
        description="remote: headers sent with every request, each from an environment "
        'variable: `{ Authorization = "NOTES_AUTH" }` sends `Authorization: <$NOTES_AUTH>` '
        "(write the whole value, `Bearer ...`, into the variable).",
    )
    allow: tuple[ToolGlob, ...] = Field(
        default=("*",), description="Globs on the server's tool names: the tools offered."
    )
    deny: tuple[ToolGlob, ...] = Field(
        default=(), description="Globs of tools never offered nor callable; deny wins over allow."
    )
    approval: tuple[ToolGlob, ...] = Field(
        default=(),
        description="Globs of the offered tools whose calls wait for the owner's yes.",
    )
    people: Annotated[bool, Strict()] = Field(
        default=True,
        description="Whether a session answering someone other than the owner (a paired or "
        "allowed person, or words the owner forwarded) is offered its tools; false: the "
        "owner's sessions alone (your files are not your friends').",
    )
    timeout_s: Annotated[Float, Field(gt=0)] = Field(
        default=60.0, description="Seconds one call may take; then the session gets an error."
    )
    start_timeout_s: Annotated[Float, Field(gt=0)] = Field(
        default=30.0,
        description="Seconds it may take to start and answer the handshake (in the "
        "background: the butler does not wait).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise KeyProblem(
                "command",
                "give exactly one of command (a stdio server) and url (a remote one)",
            )
        if self.url is not None:
            for key in ("args", "env", "pass_env", "cwd"):
                if getattr(self, key):
                    raise KeyProblem(key, "is for a stdio server (command), not a url")
        elif self.headers_env:
            raise KeyProblem("headers_env", "is for a remote server (url), not a command")
        return self

    def offers(self, tool: str) -> bool:
        """Whether the server's tool `tool` is offered: allowed and not denied."""
        return _matches(tool, self.allow) and not _matches(tool, self.deny)

    def needs_approval(self, tool: str) -> bool:
        """Whether a call of the server's tool `tool` waits for the owner's yes."""
        return _matches(tool, self.approval)


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for glob in globs)


@dataclass(frozen=True, config=TABLE)
class RuntimeConfig:
    """`[runtime]`: how `trigger` runs Claude Code for this butler."""

    model: Annotated[Str | None, AfterValidator(_none_if_empty)] = Field(
        default=None, description="The Claude model (`sonnet`, `opus`...); unset: Claude Code's."
    )
    max_turns: Annotated[Int, Field(gt=0)] = Field(
        default=20,
        description=(
            "Turns one session may take. One that takes them all fails: a routed message's "
            "sender is told it ran out of steps and that part of it may be done."
        ),
    )
    timeout_s: Annotated[Float, Field(gt=0)] = Field(
        default=300.0, description="Seconds one session may take."
    )
    max_concurrent_sessions: Annotated[Int, Field(gt=0)] = Field(
        default=1, description="Sessions of this butler at once; more wait their turn."
    )
    tick_interval_s: Annotated[Float, Field(ge=0)] = Field(
        default=60.0,
        description="How often the daemon runs due schedules by itself; 0: only when `tick` "
        "is called.",
    )
    min_schedule_interval_s: Annotated[Int, Field(ge=0)] = Field(
        default=300,
        description="`schedule_create` refuses a cron whose runs come closer together than "
        "this (the shortest gap between two runs); 0: no minimum.",
    )
    max_scheduled_runs_per_hour: Annotated[Int, Field(ge=0)] = Field(
        default=30,
        description="Scheduled runs past this many in the last hour are skipped and logged, "
        "and the owner is told once an hour; 0: no limit. Reminders people's messages planted "
        "take at most half of it, and the owner's run first.",
    )
    max_spend_usd_per_day: Annotated[Float, Field(ge=0)] = Field(
        default=0.0,
        description="Once the sessions of the last 24 hours cost this much (Claude Code's "
        "figures), new sessions are refused and the owner is told once a day; 0: no cap.",
    )
    catch_up_hours: Annotated[Float, Field(ge=0)] = Field(
        default=6.0,
        description="A recurring schedule whose run was missed while the butler was down runs "
        "once at start if that run was due this recently; older ones move on (logged).",
    )
    memory_context: Annotated[Int, Field(ge=0, le=50)] = Field(
        default=5, description="Memories matching a session's prompt given to it; 0: none."
    )
    memory_language: Str = Field(
        default="english",
        description="PostgreSQL text search configuration memories are stemmed with "
        "(`english`, `german`, ...); one the server does not know falls back to `simple`.",
    )
    max_memories: Annotated[Int, Field(ge=1)] = Field(
        default=10_000,
        description="Memories kept; past it the oldest unused one is evicted (logged).",
    )
    builtin_tools: Annotated[tuple[Str, ...], AfterValidator(_safe_builtin_tools)] = Field(
        default=(),
        description="Claude Code's own tools a session may use (`WebSearch`, `WebFetch`, "
        "`TodoWrite`); none by default. Shell, file reading, writing and editing tools are "
        "refused: they would bypass the owner's approval (read files through an "
        "`[[mcp_servers]]` filesystem server with an explicit root instead).",
    )


@dataclass(frozen=True, config=TABLE)
class ApprovalsConfig:
    """`[approvals]`: which of this butler's own tools wait for the owner's yes (a tool
    server's calls are named by its own `approval` list)."""

    tools: tuple[Str, ...] = Field(
        default=(),
        description="Globs on this butler's own tool names (e.g. `notify`): a session's call "
        "of one is not run but recorded, and the owner is asked; it runs once they approve.",
    )
    timeout_hours: Annotated[Float, Field(gt=0)] = Field(
        default=24.0,
        description="An approval not decided within this many hours is `expired`, and whoever "
        "the session was answering is told.",
    )
    check_interval_s: Annotated[Float, Field(gt=0)] = Field(
        default=60.0,
        description="On the switchboard: how often it expires overdue approvals and runs "
        "approved calls whose butler was down when they were approved.",
    )


def _email_address(value: str) -> str:
    value = value.strip().lower()  # as senders are compared
    if value and "@" not in value:
        raise ValueError(f"expected an email address, got {value!r}")
    return value


@dataclass(frozen=True, config=TABLE)
class OwnerConfig:
    """`[switchboard.owner]`: where a butler's `notify` goes when no conversation is active."""

    telegram_chat_id: ChatId = Field(
        default="", description="The owner's chat with the bot (as in `allowed_chat_ids`)."
    )
    email: Annotated[Str, AfterValidator(_email_address)] = Field(
        default="", description="The owner's address."
    )
    prefer: OwnerChannel = Field(
        default="telegram", description="The channel `notify` uses when it names none."
    )
    timezone: TimeZone = Field(
        default="UTC",
        description="The owner's IANA time zone; a butler without `[butler] timezone` keeps "
        "this one.",
    )

    def channels(self) -> list[tuple[str, str]]:
        """(channel, recipient) the owner can be reached on, the preferred one first."""
        known = [(spec.name, getattr(self, spec.owner_key)) for spec in CHANNELS if spec.owner_key]
        reachable = [(channel, who) for channel, who in known if who]
        return sorted(reachable, key=lambda c: c[0] != self.prefer)


@dataclass(frozen=True, config=TABLE)
class PairingConfig:
    """`[switchboard.pairing]`: an unknown sender gets a one-time code the owner approves,
    instead of a polite refusal (butlers.switchboard.pairing)."""

    enabled: bool = Field(
        default=False,
        description="Answer an unknown private Telegram chat or mail sender once with a code; "
        "the owner approves it (`butlers pairing approve CODE`) and the sender is allowed. "
        "Turning it off stops new codes only: senders paired before stay allowed until "
        "`butlers pairing revoke CHANNEL SENDER`.",
    )
    code_ttl_minutes: Annotated[Int, Field(ge=1, le=7 * 24 * 60)] = Field(
        default=60, description="How long a code can be approved."
    )
    max_pending_per_channel: Annotated[Int, Field(ge=1, le=1000)] = Field(
        default=20,
        description="Pending codes kept per channel; strangers past it get no code (the "
        "pending ones are never evicted).",
    )


@dataclass(frozen=True, config=TABLE)
class TranscriptionConfig:
    """`[switchboard.transcription]`: how voice notes become text
    (butlers.switchboard.transcription). Without `url` and `model_path`, a voice note gets a
    reply saying a transcription service is needed."""

    url: Str = Field(
        default="",
        description="An OpenAI-compatible `/v1/audio/transcriptions` endpoint (OpenAI, Groq, a "
        "local faster-whisper or whisper.cpp server); empty: none.",
    )
    model: Str = Field(default="whisper-1", description="The `model` sent with each file.")
    api_key_env: Str = Field(
        default="TRANSCRIPTION_API_KEY",
        description="The environment variable holding its key (sent as a bearer token); unset: "
        "no key (a local server).",
    )
    language: Str = Field(
        default="", description="An ISO-639-1 hint such as `de`; empty: detected."
    )
    model_path: Str = Field(
        default="",
        description="Local transcription instead of `url`: a directory of faster-whisper "
        "weights (the `faster-whisper` package must be installed; nothing is downloaded).",
    )
    timeout_s: Annotated[Float, Field(gt=0)] = Field(
        default=120.0, description="One transcription's time limit."
    )
    max_seconds: Annotated[Int, Field(gt=0)] = Field(
        default=900,
        description="The longest voice note or audio file transcribed, measured from its "
        "bytes (and by the length Telegram states, before downloading); a longer one gets a "
        "reply saying so.",
    )
    retry_hours: Annotated[Float, Field(gt=0)] = Field(
        default=6.0,
        description="How long a voice note is retried while the service fails (5xx, timeouts); "
        "then the sender is told it could not be transcribed.",
    )
    keep_audio: Bool = Field(
        default=False,
        description="Keep the audio with the message after it was transcribed (it is deleted "
        "by default; the transcript stays).",
    )

    @property
    def configured(self) -> bool:
        return bool(self.url or self.model_path)

    @model_validator(mode="after")
    def _one_way(self) -> TranscriptionConfig:
        if self.url and self.model_path:
            raise KeyProblem("model_path", "choose one of url (a service) and model_path (local)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise KeyProblem("url", f"expected an http(s) URL, got {self.url!r}")
        return self


@dataclass(frozen=True, config=TABLE)
class TriageRule:
    """`[[switchboard.triage]]`: a rule tried before Claude Code; the first match wins."""

    butler: Name = Field(description="Where a matching message goes.")
    channel: ChannelName | None = Field(
        default=None, description="Only messages from this channel."
    )
    sender: Str | None = Field(
        default=None, description="Only from this chat id, address, or `@domain`."
    )
    pattern: Regex | None = Field(
        default=None, description="Only messages this regular expression finds (subject + text)."
    )

    @model_validator(mode="after")
    def _says_something(self) -> TriageRule:
        if self.channel is None and self.sender is None and self.pattern is None:
            raise ValueError("a rule needs at least one of channel, sender, pattern")
        return self


DEFAULT_RETENTION_DAYS = 90  # [switchboard] retention_days


@dataclass(frozen=True, config=TABLE)
class SwitchboardConfig:
    """`[switchboard]`: its presence makes a butler the switchboard (the front door); its
    limits, conversations and delivery."""

    default_butler: Name = Field(
        default="general",
        description="Where a message goes that nothing routed; must be a butler of the same "
        "config directory.",
    )
    max_routes_per_message: Annotated[Int, Field(ge=1)] = Field(
        default=3, description="Routes one classification session may make."
    )
    max_messages_per_sender_per_hour: Annotated[Int, Field(ge=0)] = Field(
        default=60,
        description=(
            "Later messages are kept but not classified, and their files not fetched; the "
            "owner ([switchboard.owner]) may send ten times as many (by mail only with "
            "require_authentication_results: a From is anyone's to write); 0: no limit."
        ),
    )
    retention_days: Annotated[Int, Field(ge=1)] = Field(
        default=DEFAULT_RETENTION_DAYS,
        description="Finished inbox rows, routing_log, finished sessions (every butler's of "
        "this config directory) and sent or failed outbox rows older than this are deleted; "
        "queued messages, replies not sent yet and running sessions stay.",
    )
    max_request_bytes: Annotated[Int, Field(ge=1024)] = Field(
        default=1024 * 1024, description="Bigger request bodies get 413."
    )
    context_messages: Annotated[Int, Field(ge=0)] = Field(
        default=6, description="Earlier exchanges of a conversation given to classifier and butler."
    )
    thread_affinity_days: Annotated[Int, Field(ge=0)] = Field(
        default=30, description="A reply in a thread goes back to the butler that answered it."
    )
    reply_retry_hours: Annotated[Float, Field(gt=0)] = Field(
        default=24.0, description="How long the outbox keeps trying a channel that is down."
    )
    max_notifications_per_hour: Annotated[Int, Field(ge=0)] = Field(
        default=30, description="Per butler; 0: no limit."
    )
    max_concurrent_messages: Annotated[Int, Field(ge=1)] = Field(
        default=1,
        description="Messages processed at once (per switchboard process); 1: one at a time, "
        "in arrival order. Messages of one conversation are always one at a time, in order.",
    )
    message_lease_s: Annotated[Float, Field(ge=1)] = Field(
        default=30.0,
        description="How long a switchboard process's claim on a message lasts unless it "
        "renews it: the messages of a process that died are taken over after this.",
    )
    stop_drain_s: Annotated[Float, Field(ge=0, le=300)] = Field(
        default=10.0,
        description="At a clean stop (SIGTERM, Ctrl-C) how long the messages under way may "
        "finish before the rest go back to the queue: one already routed and handed back "
        "reaches its butler again. 0: hand them back at once (as a second Ctrl-C or "
        "SIGTERM does during the wait).",
    )
    owner: OwnerConfig = Field(default_factory=OwnerConfig, description="`[switchboard.owner]`.")
    pairing: PairingConfig = Field(
        default_factory=PairingConfig, description="`[switchboard.pairing]`."
    )
    triage: tuple[TriageRule, ...] = Field(
        default=(), description="`[[switchboard.triage]]` rules, tried in order."
    )
    transcription: TranscriptionConfig = Field(
        default_factory=TranscriptionConfig, description="`[switchboard.transcription]`."
    )
    max_attachments_per_message: Annotated[Int, Field(ge=0, le=20)] = Field(
        default=5,
        description="Photos, documents and files read from one message; past it a Telegram "
        "sender is told the limit, and the butler's text names the files not read. 0: "
        "attachments are not read (the message's words still go on).",
    )


# The channel modules: each sends to people on its channel (butlers.channels.CHANNELS).
CHANNEL_MODULES = channel_names()


def _modules_table() -> type:
    """`[modules]`: one optional key per registered channel, its table its config model."""
    namespace: dict[str, Any] = {
        "__doc__": "`[modules]`: the channel modules this butler runs. Only the switchboard "
        "(the butler\nwith a `[switchboard]` table) may have them: their tools send to "
        "anyone; any other\nbutler reaches people with `notify`.",
        "__module__": __name__,
        "__qualname__": "ModulesTable",
        "__annotations__": {spec.name: spec.config_model | None for spec in CHANNELS},
        "UNKNOWN_KEY_NOUN": "module",
    }
    for spec in CHANNELS:
        namespace[spec.name] = Field(default=None, description=f"`[modules.{spec.name}]`.")
    return dataclass(frozen=True, config=TABLE)(type("ModulesTable", (), namespace))


if TYPE_CHECKING:

    class ModulesTable:
        UNKNOWN_KEY_NOUN: ClassVar[str]

        def __getattr__(self, name: str) -> Any: ...

else:
    ModulesTable = _modules_table()


# What `ButlerFile._channels_on_the_switchboard` says, for editors: a channel module needs a
# [switchboard] table beside it.
_CHANNELS_NEED_SWITCHBOARD: JsonDict = {
    "if": {
        "required": ["modules"],
        "properties": {"modules": {"anyOf": [{"required": [name]} for name in CHANNEL_MODULES]}},
    },
    "then": {"required": ["switchboard"]},
}


def _cron(value: str) -> str:
    """Five fields (minute resolution) or a nickname such as @daily, as `schedule_create`."""
    from butlers.schedule_time import cron_problem

    if (problem := cron_problem(value)) is not None:
        raise ValueError(f"{value!r} is not a cron expression: {problem}")
    return value


@dataclass(frozen=True, config=TABLE)
class ScheduleConfig:
    """`[[schedules]]`: a schedule the butler has because its file says so: created or updated
    at start, removed when removed from the file (those its sessions made stay)."""

    name: Annotated[Str, Field(min_length=1, max_length=200)] = Field(
        description="Unique among the butler's schedules."
    )
    cron: Annotated[Str, AfterValidator(_cron)] = Field(
        description="When, in the butler's time zone (5 fields, or @daily ...)."
    )
    prompt: Annotated[Str, Field(min_length=1, max_length=32 * 1024)] = Field(
        description="What the session is asked."
    )


@dataclass(
    frozen=True, config=ConfigDict(extra="forbid", json_schema_extra=_CHANNELS_NEED_SWITCHBOARD)
)
class ButlerFile:
    """A whole butler.toml."""

    butler: Annotated[ButlerTable, Expect("a [butler] table with name and port")] = Field(
        description="`[butler]` (required)."
    )
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="`[runtime]`.")
    approvals: ApprovalsConfig = Field(
        default_factory=ApprovalsConfig, description="`[approvals]`."
    )
    modules: ModulesTable = Field(default_factory=ModulesTable, description="`[modules]`.")
    switchboard: SwitchboardConfig | None = Field(
        default=None, description="`[switchboard]`: only the switchboard has one."
    )
    mcp_servers: tuple[McpServerConfig, ...] = Field(
        default=(), description="`[[mcp_servers]]`: the tool servers its sessions may use."
    )
    schedules: tuple[ScheduleConfig, ...] = Field(
        default=(), description="`[[schedules]]`: schedules declared in the file."
    )

    @model_validator(mode="after")
    def _unique_schedules(self) -> ButlerFile:
        seen: set[str] = set()
        for index, schedule in enumerate(self.schedules):
            if schedule.name in seen:
                raise KeyProblem(
                    f"schedules[{index}].name",
                    f"a schedule named {schedule.name!r} is already declared: names must differ",
                )
            seen.add(schedule.name)
        return self

    @model_validator(mode="after")
    def _unique_servers(self) -> ButlerFile:
        seen: set[str] = set()
        for index, server in enumerate(self.mcp_servers):
            if server.name in seen:
                raise KeyProblem(
                    f"mcp_servers[{index}].name",
                    f"a server named {server.name!r} is already declared: names must differ "
                    "(they prefix the tools' names)",
                )
            seen.add(server.name)
        return self

    @model_validator(mode="after")
    def _channels_on_the_switchboard(self) -> ButlerFile:
        """A channel module's tools (`send_message`, `send_email`) send to anyone: only the
        switchboard, which owns the channels, their allowlists and the outbox, may have one."""
        if self.switchboard is None:
            for name in CHANNEL_MODULES:
                if getattr(self.modules, name, None) is not None:
                    raise KeyProblem(
                        f"modules.{name}",
                        f"a channel module runs only on the switchboard (the butler with a "
                        f"[switchboard] table): its tools send to anyone; move [modules.{name}] "
                        "to the switchboard's butler.toml (other butlers reach people with "
                        "`notify`)",
                    )
        return self


BUTLER_FILE = TypeAdapter(ButlerFile)


@dataclasses.dataclass(frozen=True)
class ButlerConfig:
    """A butler as the daemon runs it: the tables of its butler.toml, resolved against its
    directory and the environment's `Placement`.

    A plain dataclass, not a model: it is built from a validated `ButlerFile`, and tests build
    it directly (port 0 = any free port, which a file may not say)."""

    name: str
    port: int
    description: str = ""
    host: str = "127.0.0.1"
    endpoint_url_override: str | None = None
    # Where this butler's `notify` reaches the switchboard (None: BUTLERS_SWITCHBOARD_URL, or
    # the switchboard of its config directory).
    switchboard_url: str | None = None
    db_name: str = ""
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    # Its channels' tables by channel name (`[modules.telegram]` under "telegram"): only
    # the switchboard has any.
    channels: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The switchboard's [[switchboard.triage]] rules (as on `switchboard.triage`).
    triage: tuple[TriageRule, ...] = ()
    # Set on the switchboard only: its [switchboard] table is what makes it the switchboard.
    switchboard: SwitchboardConfig | None = None
    config_dir: Path | None = None
    instructions: str | None = None
    # [approvals]: which of its own tools wait for the owner's yes (butlers.approvals).
    approvals: ApprovalsConfig = dataclasses.field(default_factory=ApprovalsConfig)
    # [[mcp_servers]]: the tool servers the butler proxies (butlers.tool_servers).
    mcp_servers: tuple[McpServerConfig, ...] = ()
    # [butler] timezone, else (load_config_dir) the owner's; `zone` says which applies.
    timezone: str | None = None
    # [[schedules]]: declared schedules (created or updated at start).
    schedules: tuple[ScheduleConfig, ...] = ()
    # The owner's chat and address as conversations' persons (`telegram:<chat>`,
    # `email:<address>`), from [switchboard.owner] of its config directory: whose memories
    # are the owner's (butlers.memory).
    owner_persons: tuple[str, ...] = ()
    # [switchboard] retention_days of its config directory (load_config_dir): a butler's
    # finished sessions (their prompts hold people's words) go when the messages do. Each
    # kept its own 90 days whatever the owner had set (a year of data's walkthrough).
    fleet_retention_days: int | None = None

    @property
    def retention_days(self) -> int:
        """How many days its finished sessions (and, the switchboard's, messages) are kept."""
        if self.switchboard is not None:
            return self.switchboard.retention_days
        return self.fleet_retention_days or DEFAULT_RETENTION_DAYS

    @property
    def zone(self) -> str:
        """The IANA zone its schedules and sessions' local time are in."""
        return self.timezone or "UTC"

    def mcp_server_of(self, tool_name: str) -> tuple[McpServerConfig, str] | None:
        """The server a proxied tool name (`<server>__<tool>`) belongs to, and the server's
        own name for the tool; None for the butler's own tools."""
        server, separator, tool = tool_name.partition(PROXY_SEPARATOR)
        if not separator:
            return None
        found = next((s for s in self.mcp_servers if s.name == server), None)
        return (found, tool) if found is not None else None

    def needs_approval(self, tool_name: str) -> bool:
        """Whether a session's call of `tool_name` on this butler's MCP server waits for the
        owner's yes (butlers.approvals): a proxied tool (`files__write_file`) by its server's
        `approval` globs, one of the butler's own by `[approvals] tools`. The tool that runs
        an approved call is never gated (it runs only what the owner approved)."""
        if tool_name == APPROVAL_EXECUTE_TOOL:
            return False
        found = self.mcp_server_of(tool_name)
        if found is not None:
            return found[0].needs_approval(found[1])
        return _matches(tool_name, self.approvals.tools)

    @property
    def is_switchboard(self) -> bool:
        return self.switchboard is not None

    @property
    def endpoint_url(self) -> str:
        """What the registry stores: the butler's MCP-over-SSE endpoint."""
        return self.endpoint_url_override or loopback_sse_url(self.host, self.port)

    @property
    def database(self) -> str:
        return self.db_name or f"butler_{self.name}"

    @property
    def modules(self) -> list[str]:
        """Names of the modules declared in butler.toml, in a stable order."""
        return [name for name in CHANNEL_MODULES if self.channels.get(name) is not None]

    @property
    def telegram(self) -> TelegramConfig | None:
        return self.channels.get("telegram")

    @property
    def email(self) -> EmailConfig | None:
        return self.channels.get("email")


def reached_at(host: str) -> str:
    """Where a butler listening on `host` is reached from this machine: a wildcard bind on
    loopback, and `localhost` at the address it binds (IPv4: socket.create_server's
    family). A client may resolve `localhost` to ::1 first, where anyone could listen on the
    same port, prove itself through the butler's /health and be sent the token (a red
    team)."""
    return "127.0.0.1" if host.lower() in ("0.0.0.0", "::", "", "localhost") else host


def loopback_sse_url(host: str, port: int) -> str:
    """The SSE endpoint of a butler listening on `host` (see reached_at)."""
    return f"http://{reached_at(host)}:{port}/sse"


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """What `load_config_dir` found: the butlers that loaded, and the errors of the rest."""

    butlers: tuple[ButlerConfig, ...]
    errors: tuple[ConfigError, ...]

    def get(self, name: str) -> ButlerConfig | None:
        return next((b for b in self.butlers if b.name == name), None)

    @property
    def switchboard(self) -> ButlerConfig | None:
        """The butler with a [switchboard] table, if one loaded."""
        return next((b for b in self.butlers if b.is_switchboard), None)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where butlers listen and how the registry reaches them, for whatever a butler.toml
    leaves out. docker compose sets BUTLERS_HOST=0.0.0.0 and
    BUTLERS_ENDPOINT_URL_TEMPLATE=http://{name}:{port}/sse, so the same config directory
    serves `butlers up` on one machine and one container per butler."""

    host: str = "127.0.0.1"
    endpoint_url_template: str | None = None
    # `butlers up --port-offset K`: every butler listens K ports up, so the registry and
    # notify must reach them there (not at the butler.toml's port: another fleet may be).
    port_offset: int = 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Placement:
        """From BUTLERS_HOST and BUTLERS_ENDPOINT_URL_TEMPLATE in `environ` (the caller's
        environment: this module reads none)."""
        template = environ.get("BUTLERS_ENDPOINT_URL_TEMPLATE") or None
        if template is not None:
            problem = None
            if not template.startswith(("http://", "https://")):
                problem = "expected an http(s) URL"
            else:
                try:
                    template.format(name="x", port=1)
                except (KeyError, IndexError, ValueError) as exc:
                    problem = f"only {{name}} and {{port}} may be used ({exc})"
            if problem:
                raise ButlersError(f"BUTLERS_ENDPOINT_URL_TEMPLATE={template!r}: {problem}")
        return cls(host=environ.get("BUTLERS_HOST") or "127.0.0.1", endpoint_url_template=template)

    def endpoint_url(self, name: str, port: int) -> str | None:
        if self.endpoint_url_template is None:
            return None
        return self.endpoint_url_template.format(name=name, port=port)


def parse_butler_config(
    path: Path,
    data: dict[str, Any],
    *,
    dir_name: str | None = None,
    placement: Placement = Placement(),
) -> ButlerConfig:
    """Validate one parsed butler.toml. `dir_name`, when given, must equal `[butler] name`."""
    try:
        file = BUTLER_FILE.validate_python(data)
    except ValidationError as exc:
        raise config_error(path, exc, ButlerFile) from None
    butler = file.butler
    if dir_name is not None and dir_name != butler.name:
        raise ConfigError(
            path, "butler.name", f"must match its directory name {dir_name!r}, got {butler.name!r}"
        )
    instructions = None
    instructions_path = path.parent / INSTRUCTIONS_FILENAME
    if instructions_path.is_file():
        instructions = instructions_path.read_text(encoding="utf-8")
    return ButlerConfig(
        name=butler.name,
        port=butler.port,
        description=butler.description,
        host=butler.host if butler.host is not None else placement.host,
        endpoint_url_override=butler.endpoint_url
        or placement.endpoint_url(butler.name, butler.port + placement.port_offset)
        or (
            loopback_sse_url(butler.host or placement.host, butler.port + placement.port_offset)
            if placement.port_offset
            else None
        ),
        switchboard_url=butler.switchboard_url,
        db_name=butler.db.name or "",
        runtime=file.runtime,
        channels={
            name: table
            for name in CHANNEL_MODULES
            if (table := getattr(file.modules, name, None)) is not None
        },
        triage=file.switchboard.triage if file.switchboard else (),
        switchboard=file.switchboard,
        config_dir=path.parent,
        instructions=instructions,
        approvals=file.approvals,
        mcp_servers=file.mcp_servers,
        timezone=butler.timezone,
        schedules=file.schedules,
    )


def load_butler_config(path: Path, placement: Placement = Placement()) -> ButlerConfig:
    """Read and validate one butler.toml; raises ConfigError naming the file and key."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(path, None, f"cannot be read: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(path, None, f"is not UTF-8 text: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, None, f"is not valid TOML: {exc}") from exc
    return parse_butler_config(path, data, dir_name=path.parent.name, placement=placement)


def butler_dirs(config_dir: Path) -> list[Path]:
    """Every sub-directory of the config dir that holds a butler.toml, sorted by name."""
    if not config_dir.is_dir():
        return []
    return sorted(p for p in config_dir.iterdir() if (p / CONFIG_FILENAME).is_file())


def config_dir_problem(config_dir: Path) -> str | None:
    """Why `config_dir` cannot be a config directory at all (missing, not a directory, not
    ours to enter), with what to do; None when it is a directory. For `up`, `run` and
    `doctor`, which all start from one."""
    try:
        exists, is_dir = config_dir.exists(), config_dir.is_dir()
    except OSError as exc:  # a directory above it we may not enter
        return (
            f"cannot look at the config directory {config_dir}: {exc.strerror or exc}; fix "
            "the permissions of the directories above it"
        )
    if not exists:
        return (
            f"the config directory {config_dir} does not exist: create one with "
            f"`butlers init {config_dir}`, or name yours with --config-dir"
        )
    if not is_dir:
        return f"{config_dir} is not a directory: name a config directory with --config-dir"
    return None


def load_config_dir(config_dir: Path, placement: Placement = Placement()) -> FleetConfig:
    """Load every butler under `config_dir`; a broken one is skipped, never fatal, and its
    error returned (not logged: the caller reports it, once).

    Beyond each file on its own: two butlers asking for the same port, or a second
    switchboard, are errors of the later one by name; the switchboard's `default_butler`
    must be a butler of the directory (its butler.toml may be broken, or run elsewhere:
    `butlers run switchboard` starts the switchboard alone). `placement` says what the
    environment fills in (Placement.from_environment); the default, loopback.
    """
    butlers: list[ButlerConfig] = []
    errors: list[ConfigError] = []
    if not config_dir.is_dir():
        errors.append(ConfigError(config_dir, None, "config directory does not exist"))
    directories = butler_dirs(config_dir)
    names = [d.name for d in directories]
    ports: dict[int, str] = {}
    switchboard: str | None = None
    for directory in directories:
        path = directory / CONFIG_FILENAME
        try:
            config = load_butler_config(path, placement)
            _check_in_fleet(path, config, ports, switchboard, names, config_dir)
        except ConfigError as exc:
            errors.append(exc)
            continue
        ports[config.port] = config.name
        if config.is_switchboard:
            switchboard = config.name
        butlers.append(config)
    return FleetConfig(_fleet_defaults(butlers), tuple(errors))


def _fleet_defaults(butlers: list[ButlerConfig]) -> tuple[ButlerConfig, ...]:
    """What every butler takes from its switchboard's config: from `[switchboard.owner]` its
    time zone when it names none, and who the owner is; `retention_days`."""
    switchboard = next((b.switchboard for b in butlers if b.switchboard is not None), None)
    if switchboard is None:
        return tuple(butlers)
    owner = switchboard.owner
    persons = tuple(f"{channel}:{who}" for channel, who in owner.channels())
    return tuple(
        dataclasses.replace(
            b,
            timezone=b.timezone or owner.timezone,
            owner_persons=persons,
            fleet_retention_days=switchboard.retention_days,
        )
        for b in butlers
    )


def _check_in_fleet(
    path: Path,
    config: ButlerConfig,
    ports: Mapping[int, str],
    switchboard: str | None,
    names: list[str],
    config_dir: Path,
) -> None:
    owner = ports.get(config.port)
    if owner is not None:
        raise ConfigError(path, "butler.port", f"port {config.port} is already used by {owner!r}")
    if config.switchboard is None:
        return
    if switchboard is not None:
        raise ConfigError(
            path,
            "switchboard",
            f"{switchboard!r} is already the switchboard of {config_dir}: a config directory "
            "has one butler with a [switchboard] table",
        )
    default = config.switchboard.default_butler
    if default == config.name:
        raise ConfigError(
            path,
            "switchboard.default_butler",
            f"default_butler {default!r} is the switchboard itself: name a butler that "
            "answers messages",
        )
    if default not in names:
        others = ", ".join(n for n in names if n != config.name) or "none"
        raise ConfigError(
            path,
            "switchboard.default_butler",
            f"default_butler {default!r} is not a butler of {config_dir} (its butlers: "
            f"{others}); add {config_dir / default}/{CONFIG_FILENAME} or name another",
        )
