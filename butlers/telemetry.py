"""OpenTelemetry: the SDK is configured here, once, by the process entry point.

Library code only uses the API (`tracer()`), so tracing costs nothing until `setup_tracing`
installs a provider. W3C trace context travels between butlers as `_trace_context`
(`{"traceparent": ..., "tracestate": ...}`), as FastMCP's `_meta.traceparent`, as an HTTP
`traceparent` header, and to Claude Code as the TRACEPARENT environment variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
TRACER_NAME = "butlers"


_TRACER = trace.get_tracer(TRACER_NAME)  # a proxy: follows whatever provider is installed


def tracer() -> trace.Tracer:
    return _TRACER


def let_butlers_own_mcp_spans() -> None:
    """FastMCP's own per-request spans duplicate ours (one per tool call, with the caller's
    context); keep its context propagation, drop its spans. Process-wide, like the provider."""
    import fastmcp

    fastmcp.settings.telemetry_mode = "propagation_only"


def setup_tracing(service_name: str) -> Any:
    """Install the SDK provider; export over OTLP only when OTEL_EXPORTER_OTLP_ENDPOINT is set.

    The provider is installed either way so that sessions and routes carry real trace ids;
    without an endpoint it has no processor, so spans cost next to nothing and no exporter
    thread runs. Call `.shutdown()` on the result at exit so the last spans are flushed.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    let_butlers_own_mcp_spans()
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def context_from_carrier(carrier: Mapping[str, Any] | None) -> otel_context.Context | None:
    """A context continuing the trace in a W3C carrier; None when it holds no valid parent."""
    if not carrier:
        return None
    clean = {k.lower(): v for k, v in carrier.items() if isinstance(v, str)}
    if "traceparent" not in clean:
        return None
    ctx = _PROPAGATOR.extract(clean)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def current_carrier() -> dict[str, str]:
    """The current span's context as a W3C carrier (empty when there is no valid span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def current_trace_id() -> str | None:
    """The current trace id as 32 hex characters, or None outside a sampled/valid span."""
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return format(span_context.trace_id, "032x")
