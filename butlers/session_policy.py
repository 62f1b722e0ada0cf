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
from contextvars import ContextVar
from typing import TYPE_CHECKING, Literal

from fastmcp.server.dependencies import get_http_request

from butlers.errors import NotifyFailed
from butlers.spawner import (
    ACTING_SESSION,
    NOT_FOR_SESSIONS,
    ROUTED_SESSION_WITHHELD,
    SESSION_HEADER,
    SESSION_STARTING_TOOLS,
)
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from butlers.core_store import CoreStore
    from butlers.spawner import Spawner
    from butlers.switchboard_link import SwitchboardLink

logger = logging.getLogger(__name__)


def session_token() -> str | None:
    """The session credential the current MCP request presents (or the call runs for: an
    approved call, Spawner.acting_for), if any."""
    if (acting := ACTING_SESSION.get()) is not None:
        return acting
    # The one header looked up in the request's own (FastMCP's get_http_headers copies them
    # all first: 3 us against 0.8 a call, measured; every state_* call asks, for its scope).
    try:
        request = get_http_request()
    except RuntimeError:  # no HTTP request: a call within the process
        return None
    return request.headers.get(_SESSION_HEADER) or None


_SESSION_HEADER = SESSION_HEADER.lower()


# The approval whose call `approval_execute` is running (butlers.approvals): the owner's yes,
# run as the session that asked (Spawner.acting_for); nothing asks about it again.
APPROVED_CALL: ContextVar[int | None] = ContextVar("butlers_approved_call", default=None)


def waits_for_approval() -> bool:
    """Whether a call of a tool under approval must wait for the owner now: a session's call,
    not the approved one `approval_execute` runs for it."""
    return APPROVED_CALL.get() is None and session_token() is not None


# `route` refuses a session itself: a classification session (which presents a session's
# credential too) may route its message, and `route` reads the caller's headers once anyway
# (its hot path: no second read here).
_REFUSED_HERE = NOT_FOR_SESSIONS - {"route"}


class SessionPolicy:
    """Refuses the tools a session may not use, by the credential it presents. (Hiding them
    is the allowlist's job: Claude Code is told they are disallowed.) A ToolGuard of the
    butler's middleware."""

    def __init__(self, spawner: Spawner) -> None:
        self.spawner = spawner

    def check_call(self, name: str) -> None:
        # Only these few are ever withheld: every other call (the hot path: state_get through
        # route) is passed on without reading the request's headers.
        if name in _REFUSED_HERE and session_token() is not None:
            # No session is given these (Claude Code is told so). trigger or tick would start
            # a session without its own restrictions (a routed session's `trigger` names no
            # conversation), laundering a stranger's text; the operator's would act with the
            # owner's authority on what the session read (butlers.spawner.OPERATOR_TOOLS).
            why = (
                "a session never starts another"
                if name in SESSION_STARTING_TOOLS
                else "it is the operator's (the owner's own hand), never a session's"
            )
            raise ToolRefusal(
                f"{name} is not available to a session: {why}", log_level=logging.WARNING
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
