"""Telegram as a channel: its `[modules.telegram]` table and what the switchboard needs to
know of it. The module that runs it (polling, webhook, sending) is butlers.modules.telegram,
imported only when a butler opens the channel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from butlers.channels.base import ChannelSpec
from butlers.config_types import (
    MAX_ATTACHMENT_BYTES,
    TABLE,
    ChatId,
    Float,
    Int,
    Str,
)
from butlers.errors import KeyProblem

if TYPE_CHECKING:
    from collections.abc import Sequence

    from butlers.channels.base import ChannelContext, ChannelModule
    from butlers.media import Attachment


@dataclass(frozen=True, config=TABLE)
class TelegramConfig:
    """`[modules.telegram]`: the Telegram channel; only the switchboard may have one."""

    mode: Literal["polling", "webhook"] = Field(
        default="polling",
        description="`polling` (long-poll getUpdates) or `webhook` (Telegram posts to "
        "`/telegram/webhook`).",
    )
    token_env: Str = Field(
        default="TELEGRAM_BOT_TOKEN",
        description="The environment variable holding the bot token (never the file).",
    )
    allowed_chat_ids: tuple[ChatId, ...] = Field(
        default=(),
        description='Who may talk to the bot; empty: nobody, `["*"]`: anyone.',
    )
    api_base_url: Str = Field(
        default="", description="Another Bot API server (a local one, tests); empty: Telegram's."
    )
    webhook_secret_env: Str = Field(
        default="TELEGRAM_WEBHOOK_SECRET",
        description="The environment variable holding the webhook's secret token.",
    )
    webhook_url: Str = Field(
        default="",
        description="Webhook mode: the public https URL registered with setWebhook at start.",
    )
    max_messages_per_s: Annotated[Float, Field(ge=0)] = Field(
        default=30.0,
        description="Telegram's flood limit for a bot; 0: no limit (a local Bot API).",
    )
    file_base_url: Str = Field(
        default="",
        description="Where files are downloaded from (`<this>/bot<token>/<file_path>`); empty: "
        "`api_base_url` with `/file/bot`.",
    )
    max_attachment_bytes: Annotated[Int, Field(ge=1, le=MAX_ATTACHMENT_BYTES)] = Field(
        default=MAX_ATTACHMENT_BYTES,
        description="A voice note, photo or document bigger than this is refused with a reply "
        "naming the limit (20 MiB is what the Bot API lets a bot download).",
    )

    @model_validator(mode="after")
    def _webhook(self) -> TelegramConfig:
        if self.webhook_url and not self.webhook_url.startswith("https://"):
            raise KeyProblem(
                "webhook_url",
                f"expected an https:// URL (Telegram requires it), got {self.webhook_url!r}",
            )
        if self.webhook_url and self.mode != "webhook":
            raise KeyProblem("webhook_url", 'is only used with mode = "webhook"')
        return self


class TelegramChannel(ChannelSpec):
    name = "telegram"
    title = "Telegram"
    buttons = True
    config_model = TelegramConfig
    owner_key = "telegram_chat_id"
    commands = ("/start", "/help")
    carries = frozenset({"audio", "image", "pdf", "text"})

    def secret_variables(self, config: Any) -> list[str]:
        return [config.token_env, config.webhook_secret_env]

    def required_variables(self, config: Any) -> list[str]:
        return [config.token_env]

    def needed_variables(self, config: Any) -> list[tuple[str, str]]:
        needed = [(config.token_env, "token_env")]
        if config.mode == "webhook":
            needed.append((config.webhook_secret_env, "webhook_secret_env (webhook mode)"))
        return needed

    def open(self, config: Any, context: ChannelContext) -> ChannelModule:
        from butlers.modules.telegram import TelegramModule

        return TelegramModule(
            config,
            context.variable(config.token_env) or "",
            context.worker,
            webhook_secret=context.variable(config.webhook_secret_env),
        )

    def answered_ids(self, meta: dict[str, Any]) -> list[str]:
        """A reply's `reply_to_message_id`: the message of ours it answers."""
        said = meta.get("reply_to_message_id")
        return [str(said)] if said else []

    def sender_label(self, sender: str) -> str:
        return f"Telegram chat {sender}"

    def with_files(
        self, rows: list[tuple[str, dict[str, Any]]], files: Sequence[Attachment]
    ) -> list[tuple[str, dict[str, Any], tuple[Attachment, ...]]]:
        """One Telegram message per row: each file a row of its own, the text the first
        one's caption when it is one short message, else its own rows before them."""
        from butlers.modules.telegram import caption_fits

        if not files:
            return [(text, meta, ()) for text, meta in rows]
        if len(rows) == 1 and caption_fits(rows[0][0]):
            text, meta = rows[0]
            return [(text, meta, (files[0],)), *(("", {}, (file,)) for file in files[1:])]
        return [
            *((text, meta, ()) for text, meta in rows),
            *(("", {}, (file,)) for file in files),
        ]

    def command_of(self, text: str) -> str | None:
        """A bot command answered without any butler (`/help@my_bot` included)."""
        first = (text.split() or [""])[0].split("@")[0].lower()
        return first if first in self.commands else None


TELEGRAM = TelegramChannel()
