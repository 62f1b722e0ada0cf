"""Gateway configuration: `gateway.toml` (snake_case), or an existing `switchboard.config.json`
from the TypeScript Switchboard (camelCase) when there is no gateway.toml; and the `.mcp.json`
file that declares one child.

One pydantic model per table, frozen and read as plain attributes by the gateway. The two
files are the same model in two spellings: each field has its camelCase alias, and a file is
validated in its own spelling only (a camelCase key in gateway.toml is unknown there, and the
other way round). Errors name the file and the key as the file spells it (butlers.
config_errors). schemas/gateway.schema.json, schemas/switchboard.config.schema.json and
schemas/mcp.schema.json are generated from these models (`python -m butlers.schemas`).
"""

from __future__ import annotations

import json
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from butlers.config_errors import Expect, config_error
from butlers.errors import ConfigError

TOML_NAME = "gateway.toml"
JSON_NAME = "switchboard.config.json"
DEFAULT_GLOBS = (".switchboard/mcps/*/.mcp.json", "mcps/*/.mcp.json")
# An editor's key for the file's JSON Schema; taken (and ignored) at the top of either file.
SCHEMA_KEY = "$schema"
# The most a server file (.mcp.json, --config, what install moved, the approvals store) may
# hold: a declaration is a few hundred bytes; more is a mistake or a trap.
MAX_FILE_BYTES = 1024 * 1024
# The approvals store, which keeps each project's approved settings file (each at most 1 MiB).
MAX_STORE_BYTES = 16 * 1024 * 1024


class _Table(BaseModel):
    """A table of gateway.toml / switchboard.config.json: unknown keys are errors, and each
    key has its camelCase alias for the JSON file."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
    )


Text = Annotated[str, Strict(), Field(pattern=r"\S"), Expect("a non-empty string")]
Positive = Annotated[int, Strict(), Field(gt=0)]
Strings = tuple[Annotated[str, Strict()], ...]


# A variable of the gateway's environment a child may be given (`pass_env`). The gateway's own
# settings (BUTLERS_*: the auth token among them) are never a child's.
def _not_ours(name: str) -> str:
    if name.startswith("BUTLERS_"):
        raise ValueError(f"{name!r} is the gateway's own setting, never a child's")
    return name


EnvName = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$"),
    AfterValidator(_not_ours),
    Expect("an environment variable's name such as 'HTTPS_PROXY'"),
]


# A butler's tools that decide for the owner: whether an approved call runs, who may talk to
# the butlers. The gateway calls butlers with the fleet's token (the operator's), so its host's
# model would decide for the owner on whatever it read (a red team: an injected tool result
# could approve what the owner's veto holds). Offered only when a suite's `expose.allow`
# names them.
OWNER_DECISIONS = frozenset({"approval_decide", "pairing_decide", "pairing_revoke"})
# ... and those for the butlers' own daemons: `approval_claim` hands an approved call out once,
# so a host calling it first would take the owner's yes from the butler it was for (a
# walkthrough).
DAEMONS_ONLY = frozenset({"approval_request", "approval_claim", "approval_execute"})
NOT_FOR_HOSTS = OWNER_DECISIONS | DAEMONS_ONLY


class Expose(_Table):
    """`[suites.<child>.expose]`: which of a child's tools its suite offers."""

    allow: Strings | None = Field(default=None, description="Only these subtools; unset: all.")
    deny: Strings = Field(default=(), description="Never these subtools.")


class SuiteConfig(_Table):
    """`[suites.<child>]`: how one child (a butler or an .mcp.json server) is offered."""

    suite_name: Text | None = Field(
        default=None, description="The suite tool's name; unset: `<child>_suite`."
    )
    description: Text | None = Field(
        default=None, description="The suite tool's description; unset: the child's own."
    )
    expose: Expose = Field(default_factory=Expose, description="`[suites.<child>.expose]`.")
    summary_max_chars: Positive | None = Field(
        default=None,
        description="Summary length of this child's tools; unset: `[introspection]`'s.",
    )
    claude: Text | None = Field(
        default=None,
        description="Instructions for a Claude Code session that answers the suite's "
        "`natural_language` subtool with this child's tools; unset: the CLAUDE.md in the "
        "child's directory, else the `claude` key of `mcp-descriptions.json`, else none (no "
        "`natural_language`).",
    )
    redact: Strings = Field(
        default=(),
        description="Argument keys masked in the gateway's logs and spans (never in what is "
        'sent to the child), e.g. `["password", "token"]`.',
    )
    pass_env: Annotated[
        tuple[EnvName, ...], Expect("a list of variable names such as 'HTTPS_PROXY'")
    ] = Field(
        default=(),
        description="Variables of the gateway's environment this child gets too, and only "
        "these, besides PATH, HOME, locale, TZ and its own `env` (a stdio child; e.g. "
        '`["HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "DISPLAY"]`). '
        "One that is not set is left out.",
    )
    idle_timeout_s: Positive | None = Field(
        default=None,
        description="A stdio child without a request for this many seconds is stopped, and "
        "started again by its next request; unset: it runs until the gateway ends.",
    )

    @property
    def allow(self) -> tuple[str, ...] | None:
        return self.expose.allow

    @property
    def deny(self) -> tuple[str, ...]:
        return self.expose.deny

    def exposes(self, subtool: str) -> bool:
        """Whether the suite offers `subtool`: the owner's own decisions and the daemons'
        tools (NOT_FOR_HOSTS) only when `expose.allow` names them, whatever the child (a
        switchboard declared in .mcp.json with its token is a butler too: a review)."""
        if subtool in self.expose.deny:
            return False
        if subtool in NOT_FOR_HOSTS:
            return self.expose.allow is not None and subtool in self.expose.allow
        return self.expose.allow is None or subtool in self.expose.allow


class Timeouts(_Table):
    """`[timeouts]`: how long the gateway waits for its children."""

    child_spawn_ms: Positive = Field(
        default=8000,
        description="Starting a stdio child's process, in ms (its `initialize` is a call: "
        "`rpc_ms`, so a cold `npx -y` download can finish); a remote child's connection and "
        "`initialize`.",
    )
    rpc_ms: Positive = Field(
        default=60000, description="Each call to a child, its `initialize` included, in ms."
    )


class Wrapper(_Table):
    """`[wrapper]`: the Claude Code sessions behind a suite's `natural_language` subtool."""

    max_turns: Positive = Field(default=10, description="Turns a session may take.")
    timeout_s: Positive = Field(
        default=120, description="Seconds a session may run before it is ended."
    )
    model: Text | None = Field(default=None, description="Claude model; unset: Claude Code's.")


class Introspection(_Table):
    """`[introspection]`: what `{"action": "introspect"}` shows of a child's tools."""

    mode: Literal["summary", "full", "redacted"] = Field(
        default="summary",
        description="`summary` (descriptions cut to `summary_max_chars`), `full`, or "
        "`redacted` (no descriptions).",
    )
    summary_max_chars: Positive = Field(default=160, description="Length of a tool's summary.")


class GatewayConfig(_Table):
    """A whole gateway.toml (or switchboard.config.json); the defaults when there is none."""

    mode: Literal["suite", "activate", "both", "search"] = Field(
        default="suite",
        description="What a host's tool list holds. `suite`: a suite tool per child plus the "
        "three `gateway_*` tools; activating a child adds its own tools next to its suite. "
        "`activate` (mcpflip's way): only the `gateway_*` tools until a child is activated, "
        "then its own tools; no suite tools. `both`: suite tools and `gateway_*` tools, and an "
        "activated child is listed by its own tools instead of its suite (one way at a time). "
        "`search`: only `gateway_search`, `gateway_describe`, `gateway_call` and "
        "`gateway_status`: tools are found across every child in plain words and called "
        "by name. `--mode` overrides it.",
    )
    discover_globs: Strings = Field(
        default=DEFAULT_GLOBS,
        description="Globs of `.mcp.json` files (one child each), relative to the gateway's "
        "directory.",
    )
    suites: dict[str, SuiteConfig] = Field(
        default_factory=dict, description="`[suites.<child>]`, keyed by the child's name."
    )
    timeouts: Timeouts = Field(default_factory=Timeouts, description="`[timeouts]`.")
    introspection: Introspection = Field(
        default_factory=Introspection, description="`[introspection]`."
    )
    wrapper: Wrapper = Field(default_factory=Wrapper, description="`[wrapper]`.")
    reload: Literal["approve", "apply", "off"] = Field(
        default="approve",
        description="What an edit of the servers' files does. `approve`: a removed server "
        "goes at once; a new or changed one (command, args, env, cwd, URL, headers) waits, "
        "listed as `pending` by `gateway_status`, until a person runs `butlers gateway "
        "approve` (at the next start too). `apply`: new and changed servers start at once "
        "(only if you trust every writer of those files, the host's model included; it counts "
        "once this file is approved). `off`: the files are not watched; what is approved "
        "counts at the next start.",
    )
    max_result_bytes: Positive = Field(
        default=4 * 1024 * 1024,
        description="The most a child's result may hold (its texts and data); a bigger one is "
        "refused with an error naming its size (Claude Code closed its connection to the "
        "gateway on a 16 MB result, and every child restarted with it).",
    )

    # Not in the file: where it was read from (None: the defaults) and what its globs are
    # relative to.
    _source: Path | None = PrivateAttr(default=None)
    _base_dir: Path = PrivateAttr(default=Path("."))

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @property
    def child_spawn_ms(self) -> int:
        return self.timeouts.child_spawn_ms

    @property
    def rpc_ms(self) -> int:
        return self.timeouts.rpc_ms

    @property
    def introspection_mode(self) -> str:
        return self.introspection.mode

    @property
    def summary_max_chars(self) -> int:
        return self.introspection.summary_max_chars

    def suite(self, child: str) -> SuiteConfig:
        return self.suites.get(child) or _NO_SUITE_CONFIG

    def _placed(self, source: Path | None, base_dir: Path) -> GatewayConfig:
        self._source, self._base_dir = source, base_dir
        return self


_NO_SUITE_CONFIG = SuiteConfig()


@dataclass(frozen=True)
class SettingsText:
    """A gateway's settings file as it is now or as a person approved it
    (butlers.gateway.approvals): its name (gateway.toml or switchboard.config.json; None:
    there is none, the defaults) and its text."""

    name: str | None = None
    text: str | None = None

    @classmethod
    def of(cls, directory: Path) -> SettingsText:
        """gateway.toml in `directory`, else switchboard.config.json, else none (blocking)."""
        for name in (TOML_NAME, JSON_NAME):
            path = directory / name
            if path.is_file():
                return cls(name, read_server_file(path))
        return cls()

    @property
    def shown_name(self) -> str:
        return self.name or TOML_NAME

    def config(self, directory: Path) -> GatewayConfig:
        """These settings for the gateway of `directory`, parsed; ConfigError naming the file
        and the key when they are not valid."""
        if self.name is None or self.text is None:
            return GatewayConfig()._placed(None, directory)
        path = directory / self.name
        language = _language(path)
        camel = language == "JSON"
        try:
            data = json.loads(self.text) if camel else tomllib.loads(self.text)
        except ValueError as exc:  # TOML and JSON decode errors
            raise ConfigError(path, None, f"is not valid {language}: {exc}") from exc
        if isinstance(data, dict):
            data.pop(SCHEMA_KEY, None)
        try:
            config = GatewayConfig.model_validate(data, by_alias=camel, by_name=not camel)
        except ValidationError as exc:
            raise config_error(path, exc, GatewayConfig, by_alias=camel) from None
        return config._placed(path, directory)


def load_gateway_config(directory: Path) -> GatewayConfig:
    """gateway.toml in `directory`, else switchboard.config.json, else the defaults: as the
    file is now (the gateway itself runs what was approved: butlers.gateway.approvals)."""
    return SettingsText.of(directory).config(directory)


def _language(path: Path) -> str:
    return "JSON" if path.name == JSON_NAME else "TOML"


# -- .mcp.json ---------------------------------------------------------------------------------


class McpCommand(_Table):
    """`"command"`: how a stdio child is started."""

    cmd: Annotated[str, Strict()] = Field(description="The program, found on PATH or by path.")
    args: Strings = Field(default=(), description="Its arguments.")
    env: dict[str, Annotated[str, Strict()]] = Field(
        default_factory=dict,
        description="Variables added to PATH, HOME, USER, LOGNAME, SHELL, TMPDIR, TERM, "
        "locale and TZ (nothing else of ours).",
    )


class McpJson(_Table):
    """One `.mcp.json`: a child behind the gateway, stdio (`command`) or remote (`url`), in
    the TypeScript Switchboard's camelCase spelling."""

    name: Annotated[
        str,
        Strict(),
        Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"),
        Expect("a name like 'docs' ([A-Za-z0-9_.-])"),
    ] = Field(description="The child's name; its suite is `<name>_suite`.")
    description: Annotated[str, Strict()] | None = Field(
        default=None, description="What it does (the suite tool's description)."
    )
    switchboard_description: Annotated[str, Strict()] | None = Field(
        default=None, description="A description for the gateway only; wins over `description`."
    )
    command: McpCommand | None = Field(
        default=None, description="A stdio child: run in the file's directory."
    )
    url: Annotated[str, Strict(), Field(pattern="^https?://"), Expect("an http(s) URL")] | None = (
        Field(default=None, description="A remote child's MCP endpoint (SSE or streamable HTTP).")
    )

    @model_validator(mode="after")
    def _one_kind(self) -> McpJson:
        if (self.command is None) == (self.url is None):
            raise ValueError('expected exactly one of "command" (stdio) or "url" (remote)')
        return self


def read_server_file(path: Path, *, limit: int = MAX_FILE_BYTES) -> str:
    """The text of a file that declares servers, read without ever blocking: anything but a
    regular file (a FIFO would stall the reader, and the gateway's exit with it; a device such
    as /dev/zero never ends) and anything over MAX_FILE_BYTES is refused with a ConfigError
    naming the file, before a byte is read. Symbolic links are followed: it is what they lead
    to that is checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(path, None, f"not readable: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(path, None, f"is {_kind(mode)}, not a regular file: not read")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        mib = limit // 1024 // 1024
        raise ConfigError(path, None, f"larger than {limit} bytes ({mib} MiB), the limit: not read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(path, None, f"not UTF-8 text: {exc}") from exc


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket" if stat.S_ISSOCK(mode) else "a special file"


def load_mcp_json(path: Path) -> McpJson:
    """One `.mcp.json`; ConfigError naming the file and the key when it is not usable (not a
    regular file, too big: read_server_file)."""
    text = read_server_file(path)
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(path, None, f"not readable JSON: {exc}") from exc
    if isinstance(data, dict):
        data.pop(SCHEMA_KEY, None)
    try:
        return McpJson.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise config_error(path, exc, McpJson, by_alias=True) from None
