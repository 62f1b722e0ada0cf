"""Email as a channel: its `[modules.email]` table and what the switchboard needs to know
of it. The module that runs it (IMAP in, SMTP out, the webhook) is butlers.modules.email,
imported only when a butler opens the channel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs

from butlers.channels.base import ChannelSpec
from butlers.config_types import (
    MAX_ATTACHMENT_BYTES,
    TABLE,
    Bool,
    Float,
    Int,
    Port,
    Str,
)
from butlers.errors import KeyProblem

# The email webhook's bearer token (butlers.settings: BUTLERS_EMAIL_WEBHOOK_TOKEN).
EMAIL_WEBHOOK_VARIABLE = "BUTLERS_EMAIL_WEBHOOK_TOKEN"

if TYPE_CHECKING:
    from butlers.channels.base import ChannelContext, ChannelModule


# (implicit TLS key, STARTTLS key, their defaults) of IMAP and SMTP.
_TLS_PAIRS = (
    ("imap_ssl", "imap_starttls", True, False),
    ("smtp_ssl", "smtp_starttls", False, True),
)


@dataclass(frozen=True, config=TABLE)
class EmailConfig:
    """`[modules.email]`: the email channel (IMAP in, SMTP out); only the switchboard may
    have one."""

    imap_host: Str = Field(default="", description="The IMAP server.")
    imap_port: Port = Field(default=993, description="Its port.")
    imap_ssl: Bool = Field(
        default=True, description="Implicit TLS (port 993); setting `imap_starttls` turns it off."
    )
    imap_starttls: Bool = Field(default=False, description="STARTTLS on a plain port (143).")
    smtp_host: Str = Field(default="", description="The SMTP server.")
    smtp_port: Port = Field(default=587, description="Its port.")
    smtp_starttls: Bool = Field(
        default=True, description="STARTTLS (port 587); setting `smtp_ssl` turns it off."
    )
    smtp_ssl: Bool = Field(default=False, description="Implicit TLS (port 465).")
    username_env: Str = Field(
        default="BUTLERS_EMAIL_USER",
        description="The environment variable holding the mailbox user name.",
    )
    password_env: Str = Field(
        default="BUTLERS_EMAIL_PASSWORD",
        description="The environment variable holding its password.",
    )
    address: Str = Field(default="", description="The butler's own address (From of replies).")
    mode: Literal["idle", "poll", "webhook"] = Field(
        default="idle",
        description="`idle` (IMAP IDLE), `poll` (every `poll_interval_s`), or `webhook` "
        "(`POST /email/inbound`, see *The email webhook*).",
    )
    poll_interval_s: Annotated[Float, Field(gt=0)] = Field(
        default=60.0, description="Poll mode: seconds between looks at the mailbox."
    )
    allowed_senders: tuple[Str, ...] = Field(
        default=(),
        description="Who may write: addresses or `@domain`; empty: nobody.",
    )
    require_authentication_results: Annotated[Str, AfterValidator(str.strip)] = Field(
        default="",
        description="When set: accept only mail whose Authentication-Results from this "
        "authserv-id says dmarc=pass (the From header alone is forgeable).",
    )
    max_attachment_bytes: Annotated[Int, Field(ge=1, le=MAX_ATTACHMENT_BYTES)] = Field(
        default=10 * 1024 * 1024,
        description="An image, PDF, text or audio attachment bigger than this is not read "
        "(the butler's text names it and the limit; the sender is not written to). A whole "
        "mail may be a third more than this and 2 MiB (never under 10 MiB).",
    )

    @model_validator(mode="before")
    @classmethod
    def _tls_choice(cls, data: Any) -> Any:
        """Choosing one of a pair (implicit TLS or STARTTLS) on purpose turns the other's
        default off; choosing both is an error: they are two ways to reach one port."""
        given = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not isinstance(given, dict):
            return data
        chosen = dict(given)
        for implicit, starttls, _, _ in _TLS_PAIRS:
            said_implicit, said_starttls = chosen.get(implicit), chosen.get(starttls)
            if said_implicit is True and said_starttls is True:
                raise KeyProblem(
                    starttls, f"choose one of {implicit} (implicit TLS) and {starttls}"
                )
            if said_implicit is True and starttls not in chosen:
                chosen[starttls] = False
            if said_starttls is True and implicit not in chosen:
                chosen[implicit] = False
        if isinstance(data, ArgsKwargs):
            return ArgsKwargs(data.args, chosen)
        return chosen


class EmailChannel(ChannelSpec):
    name = "email"
    title = "email"
    config_model = EmailConfig
    owner_key = "email"
    continues_thread = True
    carries = frozenset({"audio", "image", "pdf", "text"})

    def secret_variables(self, config: Any) -> list[str]:
        return [config.password_env]

    def required_variables(self, config: Any) -> list[str]:
        return [config.username_env, config.password_env]

    def needed_variables(self, config: Any) -> list[tuple[str, str]]:
        needed = [(config.username_env, "username_env"), (config.password_env, "password_env")]
        if config.mode == "webhook":
            needed.append((EMAIL_WEBHOOK_VARIABLE, "webhook mode"))
        return needed

    def open(self, config: Any, context: ChannelContext) -> ChannelModule:
        from butlers.modules.email import EmailModule
        from butlers.settings import reveal

        return EmailModule(
            config,
            context.variable(config.username_env) or "",
            context.variable(config.password_env) or "",
            context.worker,
            webhook_token=reveal(context.settings.email_webhook_token),
            state=context.state_of(self.name),
        )

    def same_sender(self, sender: str) -> str:
        return sender.strip().lower()

    def sender_label(self, sender: str) -> str:
        return sender  # an address says what it is

    def answered_ids(self, meta: dict[str, Any]) -> list[str]:
        """A mail's References: its client lists the thread, ours included."""
        return str(meta.get("references") or "").split()


EMAIL = EmailChannel()
