"""The channels people reach the switchboard on, each one module plus its config model.

`CHANNELS` is the registry: adding a channel means writing its `ChannelSpec` (its own file
here, with its `[modules.<name>]` table) and its running module (butlers.modules), then
listing it below. docs/architecture.md has the walk-through.
"""

from __future__ import annotations

from butlers.channels.base import ChannelContext, ChannelModule, ChannelSpec
from butlers.channels.email import EMAIL
from butlers.channels.telegram import TELEGRAM

CHANNELS: tuple[ChannelSpec, ...] = (TELEGRAM, EMAIL)
# Messages that come in without a channel module: `ask` and `route` over MCP.
MCP_CHANNEL = "mcp"

__all__ = [
    "CHANNELS",
    "MCP_CHANNEL",
    "ChannelContext",
    "ChannelModule",
    "ChannelSpec",
    "channel_names",
    "spec_of",
]


def channel_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in CHANNELS)


def spec_of(name: str) -> ChannelSpec | None:
    """The channel called `name`; None for `mcp` and anything unknown."""
    return next((spec for spec in CHANNELS if spec.name == name), None)
