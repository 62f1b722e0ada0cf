"""What a butler's own sessions may do, enforced by the butler, not by Claude Code.

A session started by a routed message runs on a stranger's text: told to, it would read other
people's sessions (`sessions_list(detail=True)`, `session_get`) and hand them back, or send to
anyone (`send_message`, `send_email`). The spawner keeps such tools out of that session's
allowlist; `SessionPolicy` (a guard of the butler's middleware) refuses them again on the
server, to whoever presents that session's credential (its `X-Butlers-Session` header), so a
widened allowlist or a session that reaches the server some other way gets nothing either. A
caller without the header (an operator's MCP client, the CLI through the switchboard) is not a
session and keeps them.

`OwnerNotices` tells the owner, once per hour or day, that a flood limit stopped something
(`[runtime] max_scheduled_runs_per_hour`, `max_spend_usd_per_day`): through the butler's
`notify` path to the switchboard's owner, deduplicated in the butler's database
(`limit_notices`), so restarts and concurrent ticks do not tell them twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from fastmcp.server.dependencies import get_http_headers

from butlers.errors import NotifyFailed
from butlers.spawner import ROUTED_SESSION_WITHHELD, SESSION_HEADER, SESSION_STARTING_TOOLS
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from butlers.core_store import CoreStore
    from butlers.spawner import Spawner
    from butlers.switchboard_link import SwitchboardLink

logger = logging.getLogger(__name__)


def session_token() -> str | None:
    """The session credential the current MCP request presents, if any."""
    name = SESSION_HEADER.lower()
    return get_http_headers(include={name}).get(name) or None


class SessionPolicy:
    """Refuses the tools a session may not use, by the credential it presents. (Hiding them
    is the allowlist's job: Claude Code is told they are disallowed.) A ToolGuard of the
    butler's middleware."""

    def __init__(self, spawner: Spawner) -> None:
        self.spawner = spawner

    def check_call(self, name: str) -> None:
        # Only these few are ever withheld: every other call (the hot path: state_get through
        # route) is passed on without reading the request's headers.
        if name in SESSION_STARTING_TOOLS and session_token() is not None:
            # No session is given trigger or tick (Claude Code is told so): a session that
            # reached them anyway would start one without its own restrictions (a routed
            # session's `trigger` names no conversation), laundering a stranger's text.
            raise ToolRefusal(
                f"{name} is not available to a session: a session never starts another",
                log_level=logging.WARNING,
            )
        if name in ROUTED_SESSION_WITHHELD and name in self.spawner.withheld_tools(session_token()):
            # A stranger's text asked for what such a session is never given: worth an
            # operator's attention.
            raise ToolRefusal(
                f"{name} is not available to a session started by a routed message: it would "
                "reach other people's messages or send to anyone",
                log_level=logging.WARNING,
            )


class OwnerNotices:
    """Tells the owner once per window (UTC hour or day) that a limit of this butler bit."""

    def __init__(self, butler: str, store: CoreStore, link: SwitchboardLink | None) -> None:
        self.butler = butler
        self.store = store
        self.link = link

    async def tell_once(self, kind: str, window: Literal["hour", "day"], text: str) -> bool:
        """Send `text` to the owner unless `kind` was told already this window; True when it
        was this call's to tell. A notification that cannot be sent is logged, not raised:
        the limit holds either way."""
        if not await self.store.claim_notice(kind, window):
            return False
        if self.link is None:
            logger.warning(
                "%s: the owner cannot be told (no switchboard): %s",
                self.butler,
                text,
                extra={"action": "owner_not_told"},
            )
            return True
        try:
            await self.link.deliver(text, channel=None, conversation=None)
        except NotifyFailed as exc:
            logger.warning(
                "%s: the owner could not be told (%s): %s",
                self.butler,
                exc,
                text,
                extra={"action": "owner_not_told"},
            )
        return True
