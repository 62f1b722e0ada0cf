"""The scalar types and table settings every config model shares (butlers.config, and each
channel's own table in butlers.channels): kept apart so that a channel's config model does not
import the whole loader."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, Strict

from butlers.config_errors import Expect

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_-]*")

# Every table: unknown keys are errors; values are immutable once read.
TABLE = ConfigDict(extra="forbid")

# TOML has real types: "80" is not a port and `true` is not 1, so scalars are strict.
Str = Annotated[str, Strict()]
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict()]  # an integer is taken as a number
Name = Annotated[
    str,
    Strict(),
    Field(pattern=f"^{NAME_PATTERN.pattern}$"),
    Expect(f"a name such as 'health' ({NAME_PATTERN.pattern})"),
]
Port = Annotated[int, Strict(), Field(ge=1, le=65535), Expect("a port number between 1 and 65535")]
# The most a channel's file may weigh: the Bot API lets a bot download 20 MiB.
MAX_ATTACHMENT_BYTES = 20 * 1024 * 1024


def _chat_id(value: Any) -> Any:
    """Telegram chat ids are numbers in the Bot API; both spellings are taken (not `true`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


ChatId = Annotated[str, BeforeValidator(_chat_id), Strict(), Expect("a chat id (number or string)")]
