"""notify: a butler's sessions reach their person, through the switchboard's `deliver`.

A butler does not talk to Telegram or mail itself: the switchboard owns the channels, the
owner's addresses, the outbox and the limits. The butler finds it through `[butler]
switchboard_url`, else BUTLERS_SWITCHBOARD_URL, else the switchboard of its own config
directory, and calls it over MCP (with the auth token when one is set), in the session's
trace. The call carries the identity of whoever called `notify`: a classification session
(on the switchboard, whose own `notify` reaches its own `deliver`) stays one, and `deliver`
refuses it as it would refuse the session calling it directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers.config import ButlerConfig, Placement, load_config_dir
from butlers.errors import CallTimedOut, NotifyFailed, RemoteError, TargetUnreachable
from butlers.mcp_connection.core import unwrap
from butlers.mcp_connection.pool import McpConnections
from butlers.mcp_middleware import CLASSIFICATION_META, classification_claim
from butlers.telemetry import current_carrier

if TYPE_CHECKING:
    from butlers.media import Attachment

SWITCHBOARD_URL_ENV = "BUTLERS_SWITCHBOARD_URL"
DELIVER_TIMEOUT_S = 30.0


def switchboard_url(
    config: ButlerConfig,
    config_dir: Path | None,
    own_url: str,
    from_environment: str | None,
    placement: Placement,
) -> str | None:
    """Where this butler's notifications go (None: nowhere known); `from_environment` is
    `Settings.switchboard_url` (BUTLERS_SWITCHBOARD_URL), `placement` what the environment
    says of endpoints a butler.toml leaves out (the switchboard's, found in `config_dir`)."""
    if config.switchboard_url:
        return config.switchboard_url
    if from_environment:
        return from_environment
    if config.is_switchboard:
        return own_url
    if config_dir is not None:
        # The butler with a [switchboard] table, whatever its name (the others' errors are
        # the CLI's to report).
        switchboard = load_config_dir(config_dir, placement).switchboard
        return switchboard.endpoint_url if switchboard is not None else None
    return None


class SwitchboardLink:
    """One butler's kept-open way to the switchboard: `deliver`, and the approvals' request
    and claim (butlers.approvals); closed with the daemon."""

    def __init__(self, butler: str, url: str | None, *, auth_token: str | None) -> None:
        self.butler = butler
        self.url = url
        self._connections = McpConnections(auth_token=auth_token)

    async def deliver(
        self,
        text: str,
        *,
        channel: str | None,
        conversation: str | None,
        attachments: Sequence[Attachment] = (),
    ) -> dict[str, Any]:
        """The switchboard's `deliver`: `text` (and files, in their wire form) to the
        conversation, or to the owner on `channel`."""
        arguments: dict[str, Any] = {
            "text": text,
            "butler": self.butler,
            "channel": channel,
            "conversation": conversation,
        }
        if attachments:
            # Only when there are any: a switchboard whose `deliver` takes no files yet
            # (an older one) still takes every notification without.
            # (Off the event loop: base64 of megabytes.)
            arguments["attachments"] = await asyncio.to_thread(
                lambda: [attachment.to_wire() for attachment in attachments]
            )
        return await self._call("deliver", arguments, refused="the switchboard refused")

    async def request_approval(
        self,
        tool: str,
        arguments: dict[str, Any],
        *,
        conversation: str | None,
        session_id: str | None,
        timeout_hours: float,
        forwarded_from: str | None = None,
    ) -> dict[str, Any]:
        """Record a call that waits for the owner's yes (the switchboard asks them); its id.
        `forwarded_from`: the session acts on a forwarded message, this author's words."""
        asked: dict[str, Any] = {
            "butler": self.butler,
            "tool": tool,
            "arguments": arguments,
            "conversation": conversation,
            "session_id": session_id,
            "timeout_hours": timeout_hours,
        }
        if forwarded_from is not None:  # (sent only then: a switchboard of before takes the rest)
            asked["forwarded_from"] = forwarded_from
        return await self._call(
            "approval_request", asked, refused="the switchboard did not record it"
        )

    async def claim_approval(self, approval_id: int) -> dict[str, Any]:
        """The call the owner approved as `approval_id` (tool, arguments, conversation),
        handed to this butler once; NotifyFailed when it is not one to run."""
        return await self._call(
            "approval_claim",
            {"id": approval_id, "butler": self.butler},
            refused="the switchboard did not hand it over",
        )

    async def _call(self, tool: str, arguments: dict[str, Any], *, refused: str) -> dict[str, Any]:
        """One of the switchboard's tools, in the current trace, as whoever called us: the
        switchboard's failures and refusals are NotifyFailed."""
        if self.url is None:
            raise NotifyFailed(
                f"{self.butler} does not know where the switchboard is: set [butler] "
                f"switchboard_url or {SWITCHBOARD_URL_ENV}"
            )
        carrier = current_carrier()
        meta = dict(carrier)
        # Called from a tool call that claims a classification session: the claim goes on,
        # or the session would reach `deliver` through `notify` as an ordinary butler.
        claim = classification_claim()
        if claim is not None:
            meta[CLASSIFICATION_META] = claim.credential or ""
        try:
            result = await self._connections.call(
                self.url,
                tool,
                {**arguments, "_trace_context": carrier},
                meta=meta,
                timeout_s=DELIVER_TIMEOUT_S,
            )
        except (TargetUnreachable, CallTimedOut) as exc:
            raise NotifyFailed(f"the switchboard at {self.url} did not answer: {exc}") from exc
        except RemoteError as exc:
            raise NotifyFailed(f"{refused}: {exc.message}") from exc
        if result.get("isError"):
            if tool == "deliver":
                raise NotifyFailed(f"not sent: {unwrap(result)}", refused=True)
            raise NotifyFailed(f"{refused}: {unwrap(result)}", refused=True)
        return unwrap(result)

    async def may_write(self, conversation: str) -> bool | None:
        """Whether `conversation`'s person may still write (paired, allowlisted, the owner);
        None when the switchboard cannot tell (the channel is not running there);
        NotifyFailed when it did not answer."""
        answer = await self._call(
            "may_write", {"conversation": conversation}, refused="the switchboard did not say"
        )
        writes = answer.get("may_write")
        return writes if isinstance(writes, bool) else None

    async def close(self) -> None:
        await self._connections.close()
