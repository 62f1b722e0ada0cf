"""The process's environment, read once: `Settings`, built in `butlers.cli.main()`, passed down.

Every variable the code reads is a typed, documented field here (BUTLERS_*, plus the standard
names we honour: DATABASE_URL, OTEL_*, JAEGER_UI_URL), checked when the process starts, so a
bad value is one clear error naming the variable instead of a traceback halfway through a
start. Variables a butler.toml names (`token_env = "TELEGRAM_BOT_TOKEN"`, `password_env`...) are
looked up by name with `variable()`; what a child process may see is chosen from `environ` by
`butlers.environment`. No other module of the package reads `os.environ` (a test checks it).

Tests build their own: `Settings.from_environ({...})`, or `Settings.from_environ()` after
`monkeypatch.setenv`, since the process's environment is read when the object is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from butlers.errors import ButlersError

ENV_PREFIX = "BUTLERS_"
DEFAULT_DATA_DIR = Path(".butlers")
DEFAULT_LOG_LEVEL = "WARNING"
DEFAULT_JAEGER_UI_URL = "http://localhost:16686"
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


class Settings(BaseSettings):
    """The environment settings of one `butlers` process. Immutable; secrets are `SecretStr`
    (shown as `**********` in repr, str and logs; `.get_secret_value()` where one is sent)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,  # VAR= means unset, as `os.environ.get(VAR) or default` did
        extra="ignore",
        frozen=True,
        validate_default=True,
    )

    auth_token: SecretStr | None = Field(
        default=None,
        description="Bearer token every MCP endpoint requires (`Authorization: Bearer ...`; "
        "/health stays open) and that clients and the switchboard send. Required for a butler "
        "listening beyond 127.0.0.1.",
    )
    data_dir: Path = Field(
        default=DEFAULT_DATA_DIR,
        description="Where the embedded PostgreSQL keeps its data (`pgdata/`) and sessions "
        "their private files.",
    )
    switchboard_url: str | None = Field(
        default=None,
        description="The switchboard's MCP endpoint: the default `--url` of the client "
        "commands (else http://127.0.0.1:8100/sse) and where a butler's `notify` goes when "
        "its butler.toml sets no `switchboard_url`.",
    )
    log_level: str = Field(
        default=DEFAULT_LOG_LEVEL,
        description="Default of `--log-level`: CRITICAL, ERROR, WARNING, INFO or DEBUG.",
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Default of `--log-format`: text lines, or one JSON object per line.",
    )
    email_webhook_token: SecretStr | None = Field(
        default=None,
        description='Bearer token `POST /email/inbound` requires (email `mode = "webhook"`).',
    )
    host: str | None = Field(
        default=None,
        description="Bind address of every butler whose butler.toml sets no `host` (docker "
        "compose: 0.0.0.0); default 127.0.0.1.",
    )
    endpoint_url_template: str | None = Field(
        default=None,
        description="Registry URL of every butler whose butler.toml sets no `endpoint_url`, "
        "with `{name}` and `{port}` (docker compose: http://{name}:{port}/sse).",
    )
    database_url: SecretStr | None = Field(
        default=None,
        validation_alias="DATABASE_URL",
        description="A PostgreSQL server (postgresql://user:pass@host:port/any) to use instead "
        "of the embedded one.",
    )
    otel_exporter_otlp_endpoint: str | None = Field(
        default=None,
        validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT",
        description="Export traces over OTLP to this collector (and have Claude Code sessions "
        "export theirs there too); unset: no export.",
    )
    otel_exporter_otlp_protocol: Literal["grpc", "http/protobuf", "http/json"] = Field(
        default="http/protobuf",
        validation_alias="OTEL_EXPORTER_OTLP_PROTOCOL",
        description="OTLP protocol: http/protobuf or grpc (http/json is sent as protobuf). "
        "grpc needs the `otlp-grpc` extra (`pip install 'butlers[otlp-grpc]'`).",
    )
    otel_service_name: str | None = Field(
        default=None,
        validation_alias="OTEL_SERVICE_NAME",
        description="`service.name` of every butler's spans; default butler-<name>.",
    )
    jaeger_ui_url: str = Field(
        default=DEFAULT_JAEGER_UI_URL,
        validation_alias="JAEGER_UI_URL",
        description="The Jaeger UI that trace links (`butlers trace`, `inbox`, `log`) point to.",
    )

    _environ: Mapping[str, str] = PrivateAttr(default_factory=lambda: MappingProxyType({}))

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value.strip().upper() not in LOG_LEVELS:
                raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
            return value.strip().upper()
        return value

    @field_validator("switchboard_url", "jaeger_ui_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("expected an http(s) URL")
        return value

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of `environ` (default: this process's environment, as it is now).

        Raises ButlersError naming each variable whose value is wrong (a secret's value is
        never shown)."""
        snapshot = dict(os.environ if environ is None else environ)
        try:
            settings = cls(_build_sources=((_MappingSource(cls, snapshot),), {}))
        except ValidationError as exc:
            raise ButlersError(describe_errors(exc)) from None
        settings._environ = MappingProxyType(snapshot)
        return settings

    @property
    def environ(self) -> Mapping[str, str]:
        """The whole environment these settings were read from (read-only): where child
        environments are chosen from (butlers.environment) and secrets are found to redact."""
        return self._environ

    def variable(self, name: str) -> str | None:
        """The variable `name`, one a butler.toml names (`token_env`, `password_env`...);
        None when it is unset or empty."""
        return self._environ.get(name) or None

    @staticmethod
    def inherited_environ() -> Mapping[str, str]:
        """What a child process a library starts inherits: this process's environment now.

        claude-agent-sdk passes `os.environ` to Claude Code whatever we built; the spawner's
        allowlist must be applied to that, not to the snapshot these settings were read from.
        """
        return os.environ

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Each variable's name -> its field: what docs/configuration.md documents."""
        return {env_name(cls, name): name for name in cls.model_fields}


def env_name(settings_cls: type[BaseSettings], field: str) -> str:
    """The environment variable a field is read from."""
    alias = settings_cls.model_fields[field].validation_alias
    if isinstance(alias, str):
        return alias
    return f"{settings_cls.model_config.get('env_prefix', '')}{field}".upper()


def describe_errors(exc: ValidationError) -> str:
    """One line per bad variable: its name, its value (unless it holds a secret), and what
    was expected."""
    fields = Settings.model_fields
    by_key = {**{name: name for name in fields}, **Settings.variables()}
    lines = []
    for error in exc.errors():
        key = str(error["loc"][0]) if error["loc"] else ""
        field = by_key.get(key) or by_key.get(key.upper())
        name = env_name(Settings, field) if field else key
        annotation = fields[field].annotation if field else None
        secret = annotation is SecretStr or SecretStr in get_args(annotation)
        value = "" if secret else f"={error.get('input')!r}"
        problem = error["msg"].removeprefix("Value error, ")
        if error["type"] == "literal_error":
            problem = problem.replace("Input should be", "expected")
        lines.append(f"environment variable {name}{value}: {problem}")
    return "\n".join(lines)


class _MappingSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading a given mapping instead of os.environ:
    one snapshot serves the fields and the by-name lookups alike."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._mapping = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            self._mapping, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )


def reveal(secret: SecretStr | None) -> str | None:
    """A secret's value, for the one place that sends or checks it (`settings.auth_token`)."""
    return secret.get_secret_value() if secret is not None else None
