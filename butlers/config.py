"""Load and validate `config/butlers/<name>/butler.toml` into typed, frozen objects.

Every error names the file, the key and what was expected. A broken butler is reported and
skipped by `load_config_dir`; the others still load. Unknown keys are errors, never ignored.
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from butlers.errors import ButlersError, ConfigError

logger = logging.getLogger(__name__)

CONFIG_FILENAME = "butler.toml"
INSTRUCTIONS_FILENAME = "CLAUDE.md"
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_-]*")
CHANNELS = ("telegram", "email", "mcp")


@dataclass(frozen=True)
class RuntimeConfig:
    """How `trigger` runs Claude Code for this butler."""

    model: str | None = None
    max_turns: int = 20
    timeout_s: float = 300.0
    max_concurrent_sessions: int = 1
    # How often the daemon runs `tick()` by itself; 0 disables the background ticker.
    tick_interval_s: float = 60.0


@dataclass(frozen=True)
class TelegramConfig:
    mode: str = "polling"
    token_env: str = "TELEGRAM_BOT_TOKEN"
    allowed_chat_ids: tuple[str, ...] = ()
    api_base_url: str = ""
    webhook_secret_env: str = "TELEGRAM_WEBHOOK_SECRET"
    # Webhook mode: the public https URL Telegram posts to; registered with setWebhook at start.
    webhook_url: str = ""
    # Telegram's own flood limit for a bot; 0 = rely on 429 retries alone (local Bot API).
    max_messages_per_s: float = 30.0


@dataclass(frozen=True)
class EmailConfig:
    imap_host: str = ""
    imap_port: int = 993
    imap_ssl: bool = True  # implicit TLS (993)
    imap_starttls: bool = False  # STARTTLS on a plain port (143)
    smtp_host: str = ""
    smtp_port: int = 587
    smtp_starttls: bool = True
    smtp_ssl: bool = False
    username_env: str = "BUTLERS_EMAIL_USER"
    password_env: str = "BUTLERS_EMAIL_PASSWORD"
    address: str = ""
    mode: str = "idle"
    poll_interval_s: float = 60.0
    allowed_senders: tuple[str, ...] = ()
    # When set: accept only mail whose Authentication-Results from this authserv-id says
    # dmarc=pass (the From header alone is forgeable).
    require_authentication_results: str = ""


@dataclass(frozen=True)
class OwnerConfig:
    """`[switchboard.owner]`: where a butler's `notify` goes when no conversation is active."""

    telegram_chat_id: str = ""
    email: str = ""
    prefer: str = "telegram"  # telegram | email

    def channels(self) -> list[tuple[str, str]]:
        """(channel, recipient) the owner can be reached on, the preferred one first."""
        known = [("telegram", self.telegram_chat_id), ("email", self.email)]
        reachable = [(channel, who) for channel, who in known if who]
        return sorted(reachable, key=lambda c: c[0] != self.prefer)


@dataclass(frozen=True)
class SwitchboardConfig:
    """The `[switchboard]` table: limits of the front door, conversations and delivery."""

    default_butler: str = "general"  # where a message goes that was not routed
    max_routes_per_message: int = 3  # routes one classification session may make
    max_messages_per_sender_per_hour: int = 60  # 0 = no limit
    retention_days: int = 90  # done inbox rows, routing_log and sessions older are deleted
    max_request_bytes: int = 1024 * 1024  # bigger request bodies get 413
    context_messages: int = 6  # earlier exchanges of a conversation given to classifier and butler
    thread_affinity_days: int = 30  # a reply in a thread goes to the butler that answered it
    reply_retry_hours: float = 24.0  # how long the outbox keeps trying a channel that is down
    max_notifications_per_hour: int = 30  # per butler; 0 = no limit
    owner: OwnerConfig = field(default_factory=OwnerConfig)


@dataclass(frozen=True)
class TriageRule:
    """A deterministic routing rule tried before Claude Code; first match wins."""

    butler: str
    channel: str | None = None
    sender: str | None = None
    pattern: re.Pattern[str] | None = None


@dataclass(frozen=True)
class ButlerConfig:
    name: str
    port: int
    description: str = ""
    host: str = "127.0.0.1"
    endpoint_url_override: str | None = None
    # Where this butler's `notify` reaches the switchboard (None: the registry's, or
    # BUTLERS_SWITCHBOARD_URL).
    switchboard_url: str | None = None
    db_name: str = ""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    telegram: TelegramConfig | None = None
    email: EmailConfig | None = None
    triage: tuple[TriageRule, ...] = ()
    switchboard: SwitchboardConfig = field(default_factory=SwitchboardConfig)
    config_dir: Path | None = None
    instructions: str | None = None

    @property
    def endpoint_url(self) -> str:
        """What the registry stores: the butler's MCP-over-SSE endpoint."""
        if self.endpoint_url_override:
            return self.endpoint_url_override
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}/sse"

    @property
    def database(self) -> str:
        return self.db_name or f"butler_{self.name}"

    @property
    def modules(self) -> list[str]:
        """Names of the modules declared in butler.toml, in a stable order."""
        return [name for name in ("telegram", "email") if getattr(self, name) is not None]


@dataclass(frozen=True)
class FleetConfig:
    """What `load_config_dir` found: the butlers that loaded, and the errors of the rest."""

    butlers: tuple[ButlerConfig, ...]
    errors: tuple[ConfigError, ...]

    def get(self, name: str) -> ButlerConfig | None:
        return next((b for b in self.butlers if b.name == name), None)


class _Table:
    """A TOML table being read: takes typed keys, then complains about whatever is left."""

    def __init__(self, path: Path, prefix: str, data: Any) -> None:
        self.path = path
        self.prefix = prefix
        if not isinstance(data, dict):
            raise ConfigError(path, prefix, f"expected a table, got {type(data).__name__}")
        self.data = dict(data)

    def _key(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.path, self._key(key), problem)

    def take(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = ...,
        *,
        expected: str | None = None,
    ) -> Any:
        if key not in self.data:
            if default is ...:
                raise self.error(key, f"is required ({expected or _kind_name(kind)})")
            return default
        value = self.data.pop(key)
        # bool is an int in Python; a port of `true` is still wrong.
        wrong_bool = isinstance(value, bool) and bool not in _as_tuple(kind)
        if wrong_bool or not isinstance(value, kind):
            raise self.error(key, f"expected {expected or _kind_name(kind)}, got {value!r}")
        return value

    def take_str_list(self, key: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self.take(key, list, list(default), expected="a list of strings")
        items = []
        for item in value:
            # Telegram chat ids are numbers in the API; accept both spellings.
            if isinstance(item, int) and not isinstance(item, bool):
                item = str(item)
            if not isinstance(item, str):
                raise self.error(key, f"expected a list of strings, found {item!r}")
            items.append(item)
        return tuple(items)

    def table(self, key: str) -> _Table | None:
        if key not in self.data:
            return None
        return _Table(self.path, self._key(key), self.data.pop(key))

    def done(self) -> None:
        if self.data:
            unknown = ", ".join(sorted(self._key(k) for k in self.data))
            raise ConfigError(self.path, unknown, "unknown key (check the spelling; see DESIGN.md)")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true or false",
        list: "a list",
        dict: "a table",
    }
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


def _positive(table: _Table, key: str, value: float) -> float:
    if value <= 0:
        raise table.error(key, f"expected a positive number, got {value!r}")
    return value


def _choice(table: _Table, key: str, value: str, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise table.error(key, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _read_runtime(table: _Table | None) -> RuntimeConfig:
    if table is None:
        return RuntimeConfig()
    d = RuntimeConfig()
    model = table.take("model", str, None)
    max_turns = int(_positive(table, "max_turns", table.take("max_turns", int, d.max_turns)))
    timeout_s = float(
        _positive(table, "timeout_s", table.take("timeout_s", (int, float), d.timeout_s))
    )
    concurrency = int(
        _positive(
            table,
            "max_concurrent_sessions",
            table.take("max_concurrent_sessions", int, d.max_concurrent_sessions),
        )
    )
    tick_interval_s = float(table.take("tick_interval_s", (int, float), d.tick_interval_s))
    if tick_interval_s < 0:
        raise table.error("tick_interval_s", "expected 0 (off) or a positive number of seconds")
    table.done()
    return RuntimeConfig(model or None, max_turns, timeout_s, concurrency, tick_interval_s)


def _read_telegram(table: _Table) -> TelegramConfig:
    d = TelegramConfig()
    config = TelegramConfig(
        mode=_choice(table, "mode", table.take("mode", str, d.mode), ("polling", "webhook")),
        token_env=table.take("token_env", str, d.token_env),
        allowed_chat_ids=table.take_str_list("allowed_chat_ids"),
        api_base_url=table.take("api_base_url", str, d.api_base_url),
        webhook_secret_env=table.take("webhook_secret_env", str, d.webhook_secret_env),
        webhook_url=table.take("webhook_url", str, d.webhook_url),
        max_messages_per_s=float(
            table.take("max_messages_per_s", (int, float), d.max_messages_per_s)
        ),
    )
    if config.webhook_url and not config.webhook_url.startswith("https://"):
        raise table.error(
            "webhook_url",
            f"expected an https:// URL (Telegram requires it), got {config.webhook_url!r}",
        )
    if config.webhook_url and config.mode != "webhook":
        raise table.error("webhook_url", 'is only used with mode = "webhook"')
    table.done()
    return config


def _tls_pair(table: _Table, implicit: str, starttls: str, defaults: tuple[bool, bool]):
    """(implicit TLS, STARTTLS) for IMAP or SMTP. Setting one on purpose turns the other's
    default off; asking for both is an error (they are two ways to reach one port)."""
    given_implicit = table.take(implicit, bool, None)
    given_starttls = table.take(starttls, bool, None)
    if given_implicit and given_starttls:
        raise table.error(starttls, f"choose one of {implicit} (implicit TLS) and {starttls}")
    if given_implicit is not None and given_starttls is None:
        return given_implicit, False if given_implicit else defaults[1]
    if given_starttls is not None and given_implicit is None:
        return (False if given_starttls else defaults[0]), given_starttls
    if given_implicit is None:
        return defaults
    return given_implicit, given_starttls


def _read_email(table: _Table) -> EmailConfig:
    d = EmailConfig()
    imap_ssl, imap_starttls = _tls_pair(
        table, "imap_ssl", "imap_starttls", (d.imap_ssl, d.imap_starttls)
    )
    smtp_ssl, smtp_starttls = _tls_pair(
        table, "smtp_ssl", "smtp_starttls", (d.smtp_ssl, d.smtp_starttls)
    )
    config = EmailConfig(
        imap_host=table.take("imap_host", str, d.imap_host),
        imap_port=_port(table, "imap_port", table.take("imap_port", int, d.imap_port)),
        imap_ssl=imap_ssl,
        imap_starttls=imap_starttls,
        smtp_host=table.take("smtp_host", str, d.smtp_host),
        smtp_port=_port(table, "smtp_port", table.take("smtp_port", int, d.smtp_port)),
        smtp_starttls=smtp_starttls,
        smtp_ssl=smtp_ssl,
        username_env=table.take("username_env", str, d.username_env),
        password_env=table.take("password_env", str, d.password_env),
        address=table.take("address", str, d.address),
        mode=_choice(table, "mode", table.take("mode", str, d.mode), ("idle", "poll", "webhook")),
        poll_interval_s=float(
            _positive(
                table,
                "poll_interval_s",
                table.take("poll_interval_s", (int, float), d.poll_interval_s),
            )
        ),
        allowed_senders=table.take_str_list("allowed_senders"),
        require_authentication_results=table.take(
            "require_authentication_results", str, d.require_authentication_results
        ).strip(),
    )
    table.done()
    return config


def _read_triage(path: Path, items: Any) -> tuple[TriageRule, ...]:
    if not isinstance(items, list):
        raise ConfigError(path, "switchboard.triage", "expected [[switchboard.triage]] entries")
    rules = []
    for index, item in enumerate(items):
        table = _Table(path, f"switchboard.triage[{index}]", item)
        channel = table.take("channel", str, None)
        if channel is not None:
            _choice(table, "channel", channel, CHANNELS)
        sender = table.take("sender", str, None)
        raw_pattern = table.take("pattern", str, None)
        pattern = None
        if raw_pattern is not None:
            try:
                pattern = re.compile(raw_pattern)
            except re.error as exc:
                raise table.error("pattern", f"invalid regular expression: {exc}") from exc
        butler = table.take("butler", str, expected="the name of the butler a match goes to")
        table.done()
        if channel is None and sender is None and pattern is None:
            raise table.error("", "a rule needs at least one of channel, sender, pattern")
        rules.append(TriageRule(butler=butler, channel=channel, sender=sender, pattern=pattern))
    return tuple(rules)


def _read_switchboard(table: _Table) -> SwitchboardConfig:
    d = SwitchboardConfig()

    def count(key: str, default: int, minimum: int) -> int:
        value = table.take(key, int, default)
        if value < minimum:
            raise table.error(key, f"expected an integer >= {minimum}, got {value}")
        return value

    default_butler = table.take("default_butler", str, d.default_butler)
    if not NAME_PATTERN.fullmatch(default_butler):
        raise table.error("default_butler", f"expected a butler name, got {default_butler!r}")
    owner = _read_owner(table.table("owner"))
    reply_retry_hours = float(
        _positive(
            table,
            "reply_retry_hours",
            table.take("reply_retry_hours", (int, float), d.reply_retry_hours),
        )
    )
    config = SwitchboardConfig(
        default_butler=default_butler,
        max_routes_per_message=count("max_routes_per_message", d.max_routes_per_message, 1),
        max_messages_per_sender_per_hour=count(
            "max_messages_per_sender_per_hour", d.max_messages_per_sender_per_hour, 0
        ),
        retention_days=count("retention_days", d.retention_days, 1),
        max_request_bytes=count("max_request_bytes", d.max_request_bytes, 1024),
        context_messages=count("context_messages", d.context_messages, 0),
        thread_affinity_days=count("thread_affinity_days", d.thread_affinity_days, 0),
        reply_retry_hours=reply_retry_hours,
        max_notifications_per_hour=count(
            "max_notifications_per_hour", d.max_notifications_per_hour, 0
        ),
        owner=owner,
    )
    table.done()
    return config


def _read_owner(table: _Table | None) -> OwnerConfig:
    if table is None:
        return OwnerConfig()
    d = OwnerConfig()
    chat_id = table.take("telegram_chat_id", (str, int), d.telegram_chat_id)
    email = table.take("email", str, d.email).strip().lower()  # as senders are compared
    if email and "@" not in email:
        raise table.error("email", f"expected an email address, got {email!r}")
    prefer = _choice(table, "prefer", table.take("prefer", str, d.prefer), ("telegram", "email"))
    table.done()
    return OwnerConfig(telegram_chat_id=str(chat_id), email=email, prefer=prefer)


def _port(table: _Table, key: str, value: int) -> int:
    if not 1 <= value <= 65535:
        raise table.error(key, f"expected a port number between 1 and 65535, got {value}")
    return value


@dataclass(frozen=True)
class Placement:
    """Where butlers listen and how the registry reaches them, for whatever a butler.toml
    leaves out. docker compose sets BUTLERS_HOST=0.0.0.0 and
    BUTLERS_ENDPOINT_URL_TEMPLATE=http://{name}:{port}/sse, so the same config directory
    serves `butlers up` on one machine and one container per butler."""

    host: str = "127.0.0.1"
    endpoint_url_template: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Placement:
        env = os.environ if environ is None else environ
        template = env.get("BUTLERS_ENDPOINT_URL_TEMPLATE") or None
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
        return cls(host=env.get("BUTLERS_HOST") or "127.0.0.1", endpoint_url_template=template)

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
    root = _Table(path, "", data)
    butler = root.table("butler")
    if butler is None:
        raise ConfigError(path, "butler", "a [butler] table with name and port is required")
    name = butler.take("name", str, expected="a string such as 'health'")
    if not NAME_PATTERN.fullmatch(name):
        raise butler.error("name", f"expected [a-z][a-z0-9_-]*, got {name!r}")
    if dir_name is not None and dir_name != name:
        raise butler.error("name", f"must match its directory name {dir_name!r}, got {name!r}")
    port = _port(butler, "port", butler.take("port", int, expected="a port number"))
    description = butler.take("description", str, "")
    host = butler.take("host", str, placement.host)
    switchboard_url = butler.take("switchboard_url", str, None)
    if switchboard_url is not None and not switchboard_url.startswith(("http://", "https://")):
        raise butler.error("switchboard_url", f"expected an http(s) URL, got {switchboard_url!r}")
    endpoint_url = butler.take("endpoint_url", str, None)
    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        raise butler.error("endpoint_url", f"expected an http(s) URL, got {endpoint_url!r}")
    endpoint_url = endpoint_url or placement.endpoint_url(name, port)
    db_name = ""
    db = butler.table("db")
    if db is not None:
        db_name = db.take("name", str, "")
        if db_name and not NAME_PATTERN.fullmatch(db_name):
            raise db.error("name", f"expected [a-z][a-z0-9_-]*, got {db_name!r}")
        db.done()
    butler.done()

    runtime = _read_runtime(root.table("runtime"))
    telegram = email = None
    modules = root.table("modules")
    if modules is not None:
        known = {"telegram", "email"}
        for module_name in list(modules.data):
            if module_name not in known:
                raise modules.error(
                    module_name, f"unknown module (known: {', '.join(sorted(known))})"
                )
        if (table := modules.table("telegram")) is not None:
            telegram = _read_telegram(table)
        if (table := modules.table("email")) is not None:
            email = _read_email(table)
        modules.done()

    triage: tuple[TriageRule, ...] = ()
    limits = SwitchboardConfig()
    switchboard = root.table("switchboard")
    if switchboard is not None:
        triage = _read_triage(path, switchboard.data.pop("triage", []))
        limits = _read_switchboard(switchboard)
    root.done()

    instructions = None
    config_dir = path.parent
    instructions_path = config_dir / INSTRUCTIONS_FILENAME
    if instructions_path.is_file():
        instructions = instructions_path.read_text(encoding="utf-8")
    return ButlerConfig(
        name=name,
        port=port,
        description=description,
        host=host,
        endpoint_url_override=endpoint_url,
        switchboard_url=switchboard_url,
        db_name=db_name,
        runtime=runtime,
        telegram=telegram,
        email=email,
        triage=triage,
        switchboard=limits,
        config_dir=config_dir,
        instructions=instructions,
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


def load_config_dir(config_dir: Path, placement: Placement | None = None) -> FleetConfig:
    """Load every butler under `config_dir`; a broken one is logged and skipped, never fatal.

    Two butlers asking for the same port: the first by name keeps it, the other is skipped.
    `placement` defaults to the environment's (BUTLERS_HOST, BUTLERS_ENDPOINT_URL_TEMPLATE).
    """
    placement = placement or Placement.from_environment()
    butlers: list[ButlerConfig] = []
    errors: list[ConfigError] = []
    if not config_dir.is_dir():
        errors.append(ConfigError(config_dir, None, "config directory does not exist"))
    ports: dict[int, str] = {}
    for directory in butler_dirs(config_dir):
        path = directory / CONFIG_FILENAME
        try:
            config = load_butler_config(path, placement)
            owner = ports.get(config.port)
            if owner is not None:
                raise ConfigError(
                    path, "butler.port", f"port {config.port} is already used by {owner!r}"
                )
        except ConfigError as exc:
            logger.error("skipping butler: %s", exc, extra={"action": "config_error"})
            errors.append(exc)
            continue
        ports[config.port] = config.name
        butlers.append(config)
    return FleetConfig(tuple(butlers), tuple(errors))
