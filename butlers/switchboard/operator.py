"""Operator tools: what the switchboard did with each message, and a second chance for one.

An operator's questions are "what came in, where did it go, why did it fail, did the answer
go out?": `inbox_list`, `routing_log_list` and `outbox_list` answer them from the rows the
message path writes anyway, newest first, each with its trace (a Jaeger link) where it has
one. `inbox_retry` puts a failed message back in the queue once its cause is fixed (a butler
that was down is back): the worker then classifies, routes and answers it like a new one, in
the trace it was received in.

The `butlers inbox | log | retry | outbox` commands are thin clients of these tools. A
classification session (whose text a stranger wrote) may call none of them: they read every
person's messages and can make the fleet work again.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import asyncpg
from fastmcp import FastMCP
from fastmcp.server.dependencies import get_http_headers

from butlers.settings import DEFAULT_JAEGER_UI_URL
from butlers.switchboard import queries as sql
from butlers.switchboard.dispatch import CREDENTIAL_HEADER, LEGACY_INBOX_HEADER
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from butlers.switchboard.component import Switchboard

INBOX_STATUSES = ("queued", "processing", "done", "failed", "skipped")
OUTBOX_STATUSES = ("pending", "sending", "sent", "failed")
# What an operator has to look at: everything the channel has not taken yet, and what it
# never will.
OUTBOX_UNSENT = ("pending", "sending", "failed")
RETRYABLE = ("failed", "skipped")
MAX_LIMIT = 500
EXCERPT_CHARS = 120
# Enough of a text to fill an excerpt once its runs of whitespace are collapsed, without
# reading a 10 MiB mail to show 120 characters of it.
_HEAD_CHARS = EXCERPT_CHARS * 4
_WHITESPACE = re.compile(r"\s+")

logger = logging.getLogger(__name__)


def jaeger_url(trace_id: str, jaeger_ui_url: str = DEFAULT_JAEGER_UI_URL) -> str:
    """Where a trace is shown: `<jaeger_ui_url>/trace/<trace id>` (`Settings.jaeger_ui_url`,
    JAEGER_UI_URL)."""
    return f"{jaeger_ui_url.rstrip('/')}/trace/{trace_id}"


def excerpt(head: str | None, total_chars: int | None, limit: int = EXCERPT_CHARS) -> str:
    """One line of at most `limit` characters (whitespace collapsed, "…" when cut) from the
    first characters of a text (`head`) whose full length is `total_chars`."""
    if not head:
        return ""
    line = _WHITESPACE.sub(" ", head).strip()
    more = len(line) > limit or (total_chars or 0) > len(head)
    return line[: limit - 1].rstrip() + "…" if more else line


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise ToolRefusal(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")


MAX_ID = 2**63 - 1  # a bigint: past it PostgreSQL refused the statement (a review)


def _check_before(before: int | None) -> None:
    if before is not None and not 1 <= before <= MAX_ID:
        raise ToolRefusal(f"before must be a row's id (1..{MAX_ID}), got {before}")


def _check_status(status: str | None, allowed: Sequence[str], table: str) -> None:
    if status is not None and status not in allowed:
        raise ToolRefusal(
            f"status must be one of {', '.join(allowed)} (an {table} status), got {status!r}"
        )


def _refuse_classification_sessions() -> None:
    """The classifier's Claude Code is denied these tools; this holds even if it asked."""
    headers = get_http_headers()
    if CREDENTIAL_HEADER.lower() in headers or LEGACY_INBOX_HEADER.lower() in headers:
        raise ToolRefusal(
            "operator tools are not available to a classification session",
            log_level=logging.WARNING,
        )


class OperatorStore:
    """The operator tools' reads, and a retry (their statements: butlers.switchboard.queries,
    OPERATOR_*)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def inbox(
        self, status: str | None, limit: int, before: int | None = None
    ) -> list[dict[str, Any]]:
        """Newest first (older than message `before` when given). The trace id is the stored
        trace context's; a row without one (an envelope kept by `record_failed`, a row from
        before tracing) takes its first route's."""
        rows = await self.pool.fetch(sql.OPERATOR_INBOX, status, limit, _HEAD_CHARS, before)
        return [dict(r) for r in rows]

    async def approvals_by_trace(self, trace_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """The approvals the sessions of these traces asked for (a message's trace is its
        sessions'), by trace id, oldest first."""
        if not trace_ids:
            return {}
        rows = await self.pool.fetch(sql.OPERATOR_APPROVALS_BY_TRACE, list(trace_ids))
        found: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            found.setdefault(row["trace_id"], []).append(
                {"id": row["id"], "tool": row["tool"], "status": row["status"]}
            )
        return found

    async def routing_log(
        self, butler: str | None, limit: int, before: str | None = None
    ) -> list[dict[str, Any]]:
        """Newest first; older than the row `before` (its id) when given. ToolRefusal when
        that row is not there (a page cannot start after what retention deleted)."""
        created_at = after = None
        if before is not None:
            try:
                after = uuid.UUID(before)
            except ValueError:
                raise ToolRefusal(f"before: {before!r} is not a routing_log id") from None
            row = await self.pool.fetchrow(sql.OPERATOR_ROUTING_LOG_ROW, after)
            if row is None:
                raise ToolRefusal(f"before: no routing_log row {before}")
            created_at = row["created_at"]
        rows = await self.pool.fetch(sql.OPERATOR_ROUTING_LOG, butler, limit, created_at, after)
        return [dict(r) for r in rows]

    async def outbox(
        self, statuses: Sequence[str], limit: int, before: int | None = None
    ) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(
            sql.OPERATOR_OUTBOX, list(statuses), limit, _HEAD_CHARS, before
        )
        return [dict(r) for r in rows]

    async def requeue(self, inbox_id: int) -> dict[str, Any]:
        """Put a failed or skipped message back in the queue as if it had just come in
        (attempts 0, no outcome); its earlier outcome is appended to `meta.retries` for the
        record. ToolRefusal when there is no such message or it is not retryable."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(sql.OPERATOR_RETRY_LOCK, inbox_id)
            if row is None:
                raise ToolRefusal(f"no inbox message with id {inbox_id}")
            if row["status"] not in RETRYABLE:
                raise ToolRefusal(
                    f"inbox message {inbox_id} is {row['status']}: only a failed or skipped "
                    "message can be retried"
                )
            if row["status"] == "failed" and row["attempts"] == 0:
                # Never claimed by the worker: record_failed kept only the envelope of a mail
                # the channel could not hand over. There is no text to process again.
                raise ToolRefusal(
                    f"inbox message {inbox_id} is failed but was never stored in full (only "
                    f"its envelope was kept: {row['error']}); there is nothing to retry"
                )
            updated = await conn.fetchrow(
                sql.OPERATOR_REQUEUE,
                inbox_id,
            )
            assert updated is not None  # the row is locked FOR UPDATE above
            return dict(updated)

    async def requeue_reply(self, outbox_id: int) -> dict[str, Any]:
        """Send a failed outbox row again (due now, attempts 0); its earlier error appended
        to `meta.retries`. ToolRefusal when there is no such row or it did not fail."""
        row = await self.pool.fetchrow(sql.OPERATOR_OUTBOX_RETRY, outbox_id)
        if row is not None:
            return dict(row)
        status = await self.pool.fetchval(sql.OPERATOR_OUTBOX_STATUS, outbox_id)
        if status is None:
            raise ToolRefusal(f"no outbox row with id {outbox_id} (`butlers outbox` lists them)")
        raise ToolRefusal(f"outbox row {outbox_id} is {status}: only a failed one is sent again")


def _with_excerpt(row: dict[str, Any]) -> dict[str, Any]:
    head, total = row.pop("text_head"), row.pop("text_chars")
    row["excerpt"] = excerpt(head, total)
    row["text_chars"] = total
    return row


def register_operator_tools(
    mcp: FastMCP, switchboard: Switchboard, *, jaeger_ui_url: str | None
) -> None:
    """Register inbox_list, routing_log_list, inbox_retry, outbox_list and outbox_retry on
    the switchboard.

    Trace links point to `jaeger_ui_url` (the butler's Settings.jaeger_ui_url); None when
    spans are not exported: a trace is then an id with no link (a link to a Jaeger that never
    got it led nowhere: a walkthrough)."""
    store = OperatorStore(switchboard.routing_store.pool)

    def trace_url(trace_id: str | None) -> str | None:
        return jaeger_url(trace_id, jaeger_ui_url) if trace_id and jaeger_ui_url else None

    @mcp.tool
    async def inbox_list(
        status: str | None = None, limit: int = 20, before: int | None = None
    ) -> list[dict[str, Any]]:
        """The newest inbox messages (`status`: queued | processing | done | failed |
        skipped; `limit` 1..500; `before`: only those older than that message id, the next
        page): sender, conversation, what happened to it (status, routed_to, classified_via,
        error), a text excerpt, times, its trace id, and the approvals its sessions asked
        for (`approvals`: id, tool, status)."""
        _refuse_classification_sessions()
        _check_status(status, INBOX_STATUSES, "inbox")
        _check_limit(limit)
        _check_before(before)
        rows = await store.inbox(status, limit, before)
        asked = await store.approvals_by_trace([r["trace_id"] for r in rows if r["trace_id"]])
        for row in rows:
            _with_excerpt(row)
            row.pop("traced")
            row["trace_url"] = trace_url(row["trace_id"])
            row["approvals"] = asked.get(row["trace_id"], [])  # what its sessions asked for
        return rows

    @mcp.tool
    async def routing_log_list(
        butler: str | None = None, limit: int = 20, before: str | None = None
    ) -> list[dict[str, Any]]:
        """The newest routing_log rows (only the routes to `butler`, when given; `limit`
        1..500; `before`: only those older than that row's id, the next page), each with the
        Jaeger link of its trace (JAEGER_UI_URL)."""
        _refuse_classification_sessions()
        _check_limit(limit)
        rows = await store.routing_log(butler, limit, before)
        for row in rows:
            row["trace_url"] = trace_url(row["trace_id"])
        return rows

    @mcp.tool
    async def inbox_retry(id: int) -> dict[str, Any]:
        """Queue a failed (or skipped) message again, once what made it fail is fixed: it is
        classified, routed and answered like a new message. Its earlier outcome is kept in
        its meta (`retries`)."""
        _refuse_classification_sessions()
        requeued = await store.requeue(id)
        switchboard.worker.wake()
        logger.info(
            "inbox message %s queued again by an operator", id, extra={"action": "inbox_retry"}
        )
        return requeued

    @mcp.tool
    async def outbox_retry(id: int) -> dict[str, Any]:
        """Send a failed reply or notification again (`outbox_list` shows why it failed),
        once its cause is fixed: a mail server's daily quota, an address refused by mistake.
        The answer itself is not made again."""
        _refuse_classification_sessions()
        requeued = await store.requeue_reply(id)
        switchboard.outbox.wake()
        logger.info(
            "outbox row %s queued again by an operator", id, extra={"action": "outbox_retry"}
        )
        return requeued

    @mcp.tool
    async def outbox_list(
        status: str | None = None, limit: int = 20, before: int | None = None
    ) -> list[dict[str, Any]]:
        """The newest outbox rows (replies and notifications): by default those not sent
        yet and those that failed (pending, sending, failed); `status` (pending | sending |
        sent | failed) for one kind only; `limit` 1..500; `before`: only rows with a lower
        id (the next page)."""
        _refuse_classification_sessions()
        _check_status(status, OUTBOX_STATUSES, "outbox")
        _check_limit(limit)
        _check_before(before)
        unsent = OUTBOX_UNSENT if status is None else (status,)
        rows = await store.outbox(unsent, limit, before)
        return [_with_excerpt(row) for row in rows]
