"""Conversations: what a message follows, so that a follow-up makes sense.

A message's conversation key (set at intake: a Telegram chat and topic, a mail thread's root)
gathers its earlier exchanges; the last `context_messages` of them go into the classifier's
prompt and the routed prompt, each bounded. Thread affinity (a reply to one of our messages
goes back to the butler that sent it) is looked up in the outbox, which knows what it sent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from butlers.channels import spec_of
from butlers.memory import person_of

if TYPE_CHECKING:
    from butlers.config import OwnerConfig
    from butlers.switchboard.inbox import InboxMessage

HISTORY_CHARS_PER_TEXT = 500  # each earlier message and answer, in prompts
HISTORY_INTRO = "Earlier in this conversation, oldest first"


def history_text(history: Sequence[dict[str, Any]]) -> str:
    """Earlier exchanges as lines: who said what, and which butler answered what."""

    def bounded(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= HISTORY_CHARS_PER_TEXT else text[:HISTORY_CHARS_PER_TEXT] + "…"

    lines = []
    for row in history:
        said = f"Subject: {row['subject']}. {row['text']}" if row.get("subject") else row["text"]
        who = bounded(row.get("sender_name") or "They")[:60]  # a display name is theirs too
        if (author := row.get("forwarded_from")) is not None:  # someone else's words
            quoted = json.dumps(bounded(author)[:60], ensure_ascii=False)
            lines.append(f"{who} forwarded what {quoted} wrote: {bounded(said)}")
        else:
            lines.append(f"{who} said: {bounded(said)}")
        if row.get("reply"):
            lines.append(f"{row.get('routed_to') or 'A butler'} answered: {bounded(row['reply'])}")
    return "\n".join(lines)


def is_owners(conversation: str | None, owner: OwnerConfig) -> bool:
    """Whether `conversation` is with the owner ([switchboard.owner]), on any of their
    channels (a chat's topic, a mail's thread: the same person)."""
    if not conversation:
        return False
    mine = {person_of(f"{channel}:{who}") for channel, who in owner.channels()}
    return person_of(conversation) in mine


def answered_ids(channel: str, meta: dict[str, Any]) -> list[str]:
    """The channel's own ids of the messages of ours that this message answers (a Telegram
    reply's message, a mail's References): each channel knows its own (butlers.channels)."""
    spec = spec_of(channel)
    return spec.answered_ids(meta) if spec is not None else []


def command_of(channel: str, text: str) -> str | None:
    """A channel's command answered without any butler (Telegram's /help)."""
    spec = spec_of(channel)
    return spec.command_of(text) if spec is not None else None


def help_text(butlers: Sequence[dict[str, Any]], *, switchboard: str) -> str:
    """/help's answer: the registry's butlers but the switchboard (`switchboard`: its name),
    and but those no message can reach: stale rows (the last discover did not find them) and
    rows that were a switchboard."""
    listed = "\n".join(
        f"• {b['name']}: {b.get('description') or ''}".rstrip(": ")
        for b in butlers
        if b["name"] != switchboard and not b.get("stale") and not b.get("is_switchboard")
    )
    return (
        "Hello! Write to me in plain words and I pass your message to the butler it is for:\n"
        f"{listed}\n\nReply to one of my answers to carry on with the butler that gave it."
    )


def forwarded_at(message: InboxMessage) -> int:
    """Where in a message's text a forwarded part begins after the sender's own lines (a
    mail's `forwarded_at`); 0: all of it is forwarded, or it is not a forward."""
    at = message.meta.get("forwarded_at")
    if not isinstance(at, int) or isinstance(at, bool):
        return 0
    # A voice note's transcript comes after the words typed with it, which the index counts:
    # it still holds (treated as 0, the owner's own typed lines were taken for the author's).
    return at if 0 < at < len(message.text) else 0
