"""FastMCP middleware: every tool continues its caller's trace, without declaring it.

A caller may put `_trace_context` (a W3C carrier) into any tool's arguments; it is removed
before argument validation, so no tool has to declare it. Failing that, `_meta.traceparent`
(what FastMCP clients send), then an HTTP `traceparent` header (what Claude Code sends when
the spawner puts it in the MCP server's headers) name the parent.
"""

from __future__ import annotations

from typing import Any

from fastmcp.server.dependencies import fastmcp_request_ctx, get_http_headers
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from butlers.telemetry import context_from_carrier
from butlers.tool_errors import ToolRefusal

TRACE_CONTEXT_ARG = "_trace_context"
# In a call's `_meta`: the conversation a routed call serves (set by the switchboard), so that
# the session it starts can `notify` that conversation.
CONVERSATION_META = "butlers/conversation"


def request_conversation() -> str | None:
    """The conversation the current tool call serves, as its caller said in `_meta`."""
    meta = _meta_carrier() or {}
    value = meta.get(CONVERSATION_META)
    return value if isinstance(value, str) and value else None


def _meta_carrier() -> dict[str, Any] | None:
    request = fastmcp_request_ctx.get()
    return request.meta if request is not None else None


class TraceContextMiddleware(Middleware):
    def __init__(self, butler_name: str, tracer: Tracer) -> None:
        self.butler_name = butler_name
        self.tracer = tracer

    async def on_call_tool(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        params = context.message
        arguments = dict(params.arguments or {})
        carrier = arguments.pop(TRACE_CONTEXT_ARG, None)
        if carrier is not None and not isinstance(carrier, dict):
            raise ToolRefusal(
                f"{TRACE_CONTEXT_ARG} must be an object such as "
                '{"traceparent": "00-<trace id>-<span id>-01"}'
            )
        params = params.model_copy(update={"arguments": arguments})
        parent = (
            context_from_carrier(carrier)
            or context_from_carrier(_meta_carrier())
            or context_from_carrier(get_http_headers(include={"traceparent", "tracestate"}))
            or otel_context.get_current()
        )
        with self.tracer.start_as_current_span(
            f"{self.butler_name}/{params.name}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"butler": self.butler_name, "tool_name": params.name},
        ) as span:
            try:
                return await call_next(context.copy(message=params))
            except Exception as exc:
                span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
                raise
