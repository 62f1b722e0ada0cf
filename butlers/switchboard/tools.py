"""The switchboard's own MCP tools (route, deliver, list_butlers, routing_log_entry, discover,
ask; the operator's come from butlers.switchboard.operator, the approvals' and pairing's from
theirs), registered on the butler's FastMCP server over the parts the Switchboard component
(butlers.switchboard.component) built.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from fastmcp import FastMCP
from fastmcp.server.dependencies import get_http_headers
from pydantic import JsonValue

from butlers.errors import LeaseLost, NotifyRefused, RouteError, RoutePolicyError, RouteRefused
from butlers.mcp_middleware import classification_claim
from butlers.spawner import SESSION_HEADER
from butlers.switchboard.approvals import register_approval_tools
from butlers.switchboard.component import Switchboard
from butlers.switchboard.dispatch import Dispatch, Dispatcher
from butlers.switchboard.operator import register_operator_tools
from butlers.switchboard.pairing import register_pairing_tools
from butlers.tool_errors import ToolRefusal


def _classification_of_caller(
    dispatcher: Dispatcher, headers: Mapping[str, str] | None = None
) -> Dispatch | None:
    """The message whose classification session is calling, or None for any other caller.
    `headers`: the request's, when read already.

    A session proves it is one by this message's credential; a claim to be one without the
    right credential (or naming an inbox id, as sessions once did) is refused rather than
    treated as an ordinary caller.
    """
    claim = classification_claim(headers)
    if claim is None:
        return None
    if claim.credential is None:
        raise ToolRefusal(f"{claim.where} is not accepted: it proves nothing")
    dispatch = dispatcher.find(claim.credential)
    if dispatch is None:
        raise ToolRefusal(f"{claim.where} names no message being classified")
    return dispatch


def register_switchboard_tools(
    mcp: FastMCP, switchboard: Switchboard, *, jaeger_ui_url: str | None
) -> None:
    """Register the switchboard's tools on its butler's server: route, deliver, list_butlers,
    routing_log_entry, discover, ask, the operator's inbox_list, inbox_retry,
    routing_log_list and outbox_list, the approvals' (butlers.switchboard.approvals) and
    pairing's (butlers.switchboard.pairing)."""
    router, worker, notifier = switchboard.router, switchboard.worker, switchboard.notifier
    routing_store = switchboard.routing_store

    @mcp.tool
    async def route(
        butler_name: str, tool_name: str, args: dict[str, Any] | None = None
    ) -> JsonValue:
        """Call `tool_name` with `args` on the butler `butler_name`; returns its answer.

        From a classification session: only `trigger` with `{"prompt": ...}`, answered with
        "accepted" at once; the switchboard delivers it and replies to the sender."""
        headers = get_http_headers()  # (once: the hot path)
        classification = _classification_of_caller(worker.dispatcher, headers)
        if classification is not None:
            try:
                return await classification.accept(butler_name, tool_name, args)
            except RoutePolicyError as exc:
                # What a message talked its classifier into: an operator wants to see that.
                raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
            except LeaseLost as exc:  # the worker stops this session; logged there
                raise ToolRefusal(
                    "not routed: another switchboard process has taken this message over"
                ) from exc
        if SESSION_HEADER.lower() in headers:
            # Any other session of the switchboard (a trigger, a schedule): its call would
            # reach the butler without a session's credential, past its approval gate
            # (butlers.spawner.OPERATOR_TOOLS). It is not shown this tool either.
            raise ToolRefusal(
                "route is not available to a session: it is the operator's (the owner's own "
                "hand), never a session's",
                log_level=logging.WARNING,
            )
        try:
            return await router.route(butler_name, tool_name, args)
        except RouteError as exc:  # a target that failed is worth a warning; a typo is not
            level = logging.INFO if isinstance(exc, RouteRefused) else logging.WARNING
            raise ToolRefusal(str(exc), log_level=level) from exc

    @mcp.tool
    async def deliver(
        text: str,
        butler: str,
        channel: str | None = None,
        conversation: str | None = None,
        attachments: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Send a butler's notification to its person: to `conversation` (a routed message's,
        e.g. "telegram:12345"), else to the owner ([switchboard.owner]) on `channel`
        (telegram | email) or the owner's preferred one (`channel` with a conversation counts
        only for the owner's own); with `attachments` (images, PDFs,
        text files: [{name, mime_type, data (base64)}]) as photos, documents or mail
        attachments. Through the outbox: it waits out a channel that is down."""
        if _classification_of_caller(worker.dispatcher) is not None:
            # A message's classifier may only route it (it is not shown this tool either).
            raise ToolRefusal(
                "deliver is not for classification sessions", log_level=logging.WARNING
            )
        try:
            return await notifier.deliver(text, butler, channel, conversation, attachments)
        except NotifyRefused as exc:
            raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc

    @mcp.tool
    async def may_write(conversation: str) -> dict[str, Any]:
        """Whether the person of `conversation` may still write to the switchboard (the owner,
        or allowlisted or paired on its channel). For butlers' daemons: a reminder someone's
        message planted is not run once they may not."""
        if _classification_of_caller(worker.dispatcher) is not None:
            raise ToolRefusal("may_write is not for classification sessions")
        return {"conversation": conversation, "may_write": await notifier.may_write(conversation)}

    @mcp.tool
    async def list_butlers() -> list[dict[str, Any]]:
        """Every registered butler: name, endpoint_url, description, modules, last_seen_at,
        registered_at; `stale` when the last discover did not find it (not routed to until
        one does) and `is_switchboard` when it had a [switchboard] table."""
        return await routing_store.registry()

    @mcp.tool
    async def routing_log_entry(id: str) -> dict[str, Any]:
        """One routing_log row by its id: where the call went, whether it worked, and the
        trace_id to look it up in Jaeger."""
        try:
            entry_id = uuid.UUID(id)
        except ValueError:
            raise ToolRefusal(f"id must be a routing_log id (a UUID), got {id!r}") from None
        row = await routing_store.routing_entry(entry_id)
        if row is None:
            raise ToolRefusal(f"no routing_log row with id {id}")
        return row

    @mcp.tool(name="discover")
    async def discover_tool() -> dict[str, Any]:
        """Re-scan the butler config directory: add new butlers, update changed ones, report
        stale ones (never deleted) and broken configs."""
        return await switchboard.discover()

    @mcp.tool
    async def ask(text: str) -> dict[str, Any]:
        """Send `text` through the whole inbox -> classify -> route path, as a message from
        this MCP client, and return the reply (what Telegram or email would have sent)."""
        return await switchboard.ask(text)

    register_operator_tools(mcp, switchboard, jaeger_ui_url=jaeger_ui_url)
    register_approval_tools(mcp, switchboard.approvals)
    register_pairing_tools(mcp, switchboard.pairing)
