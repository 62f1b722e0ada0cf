"""The hosts connected to the gateway: who to tell when the tool list changes, and which host
request a child's progress or log message belongs to."""

from __future__ import annotations

import collections
import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any

from fastmcp import Context
from fastmcp.server.dependencies import get_context
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext


class HostTracker(Middleware):
    """Remembers every connected host, to tell them when the tool list changes.

    FastMCP's `ctx.session` is a new object for each request (on 2026-07-28 connections
    every request is its own); what they share is the connection they write to (the SDK's
    `ServerSession._connection`: stdio has one). So the newest session of each connection is
    kept, strongly (a weak reference died with its request, and a tool list change outside a
    request, a child's own, reached nobody: found by test_gateway_protocol), at most
    MAX_HOSTS of them, and a connection that fails a notification is forgotten.
    """

    MAX_HOSTS = 256

    def __init__(self) -> None:
        self._hosts: collections.OrderedDict[int, Any] = collections.OrderedDict()

    @property
    def hosts(self) -> list[Any]:
        return list(self._hosts.values())

    def forget(self, session: Any) -> None:
        self._hosts.pop(_connection_key(session), None)

    async def on_request(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        ctx = context.fastmcp_context
        if ctx is not None:
            with contextlib.suppress(Exception):
                session = ctx.session
                key = _connection_key(session)
                self._hosts[key] = session
                self._hosts.move_to_end(key)
                while len(self._hosts) > self.MAX_HOSTS:
                    self._hosts.popitem(last=False)
        return await call_next(context)


def _connection_key(session: Any) -> int:
    return id(getattr(session, "_connection", session))


@dataclass(frozen=True)
class HostCall:
    """A host's request being served: FastMCP's context of it, and the context variables it
    runs with (a notification from a child arrives in the child's reader task, outside them)."""

    context: Context
    variables: contextvars.Context


def current_host() -> HostCall | None:
    """The host request being served, if any."""
    try:
        context = get_context()
    except RuntimeError:
        return None
    return HostCall(context, contextvars.copy_context())
