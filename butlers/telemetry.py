"""OpenTelemetry: the process entry point builds one `Telemetry`; each butler gets its tracer.

W3C trace context travels between butlers as `_trace_context`
(`{"traceparent": ..., "tracestate": ...}`), as FastMCP's `_meta.traceparent`, as an HTTP
`traceparent` header, and to Claude Code as the TRACEPARENT environment variable.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Status
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from butlers.errors import ButlersError

if TYPE_CHECKING:
    from butlers.settings import Settings

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
TRACER_NAME = "butlers"
GRPC_EXTRA = "otlp-grpc"  # pyproject.toml's extra holding the OTLP gRPC exporter


def let_butlers_own_mcp_spans() -> None:
    """FastMCP's own per-request spans duplicate ours (one per tool call, with the caller's
    context); keep its context propagation, drop its spans. Process-wide, like the provider."""
    import fastmcp

    fastmcp.settings.telemetry_mode = "propagation_only"


def service_name(butler: str, override: str | None = None) -> str:
    """`butler-<name>`, unless `override` (OTEL_SERVICE_NAME) says otherwise (then for every
    butler)."""
    return override or f"butler-{butler}"


@dataclass(frozen=True)
class ButlerTelemetry:
    """What one butler's parts need: its tracer, and the environment that makes its Claude
    Code sessions export their own spans to the same place (empty when not exporting)."""

    tracer: trace.Tracer
    cli_env: Mapping[str, str] = field(default_factory=dict)
    exporting: bool = False  # whether its spans go anywhere (a trace's link leads somewhere)


class Telemetry:
    """The process's spans: one tracer provider per butler, so each butler has its own
    `service.name` even when several share a process (`butlers up`), and one span processor
    shared by all of them (one export queue and thread, not one per butler).

    Without a processor spans still have real ids (which sessions and routing_log record, and
    which go on, sampled, to other processes and Claude Code), but nothing is recorded, queued
    or exported and no thread runs: see `UnrecordedTracer`.
    """

    def __init__(
        self,
        processor: SpanProcessor | None = None,
        *,
        cli_env: Mapping[str, str] | None = None,
        service_name: str | None = None,
        sampler_asked_for: bool = False,
    ) -> None:
        self.processor = processor
        self._sampler_asked_for = sampler_asked_for
        self._cli_env = dict(cli_env or {})
        self._service_name = service_name
        self._providers: dict[str, TracerProvider] = {}

    @classmethod
    def from_settings(
        cls, settings: Settings, redact: Callable[[str], str] | None = None
    ) -> Telemetry:
        """OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT is set (protocol per
        OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf, the default, or grpc with the `otlp-grpc`
        extra installed); otherwise none. `redact`: applied to every exported span's texts
        (configured secrets).

        The exporter reads the rest of its OTEL_EXPORTER_OTLP_* configuration (headers,
        certificates, timeouts) itself, as the OpenTelemetry SDK documents."""
        let_butlers_own_mcp_spans()
        endpoint = settings.otel_exporter_otlp_endpoint
        if not endpoint:
            # A sampler asked for (OTEL_TRACES_SAMPLER) decides what the ids propagate as:
            # the SDK's tracer then, recording to nobody, as before UnrecordedTracer.
            sampler = bool(settings.variable("OTEL_TRACES_SAMPLER"))
            return cls(service_name=settings.otel_service_name, sampler_asked_for=sampler)
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = settings.otel_exporter_otlp_protocol  # validated: grpc or http/...
        exporter = otlp_exporter(protocol)
        logger.info(
            "exporting spans over OTLP (%s) to %s", protocol, endpoint, extra={"action": "otlp"}
        )
        if redact is not None:
            exporter = RedactingSpanExporter(exporter, redact)
        return cls(
            BatchSpanProcessor(exporter),
            cli_env=claude_code_telemetry_env(endpoint, protocol),
            service_name=settings.otel_service_name,
        )

    @property
    def exporting(self) -> bool:
        return self.processor is not None

    def for_butler(self, butler: str) -> ButlerTelemetry:
        provider = self._providers.get(butler)
        if provider is None:
            provider = TracerProvider(
                resource=Resource.create(
                    {"service.name": service_name(butler, self._service_name), "butler": butler}
                )
            )
            if self.processor is not None:
                provider.add_span_processor(self.processor)
            self._providers[butler] = provider
        cli_env = dict(self._cli_env)
        if cli_env:
            cli_env["OTEL_RESOURCE_ATTRIBUTES"] = f"butler={butler}"
        sdk = self.exporting or self._sampler_asked_for
        tracer = provider.get_tracer(TRACER_NAME) if sdk else UnrecordedTracer()
        return ButlerTelemetry(tracer, cli_env, exporting=self.exporting)

    def resource(self, butler: str) -> Resource:
        """The resource `butler`'s exported spans carry (its `service.name`)."""
        self.for_butler(butler)
        return self._providers[butler].resource

    def shutdown(self) -> None:
        """Flush what is queued (the last spans of a run) and stop the export thread."""
        if self.processor is not None:
            self.processor.force_flush()
            self.processor.shutdown()


class UnrecordedTracer(trace.Tracer):
    """Spans with ids and nothing else, for a process that exports none.

    The SDK's tracer records every span (its attributes, events, status, times) for span
    processors; with none, that is work nobody reads: ~8% of the `butlers up` process's CPU
    a routed call, three spans (py-spy, 16 callers, 2026-11-27). The SDK's own way out, the
    `ALWAYS_OFF` sampler, also clears the sampled flag that every span then propagates, and a
    butler in another process that does export would drop its spans (its sampler follows the
    parent). So this tracer does what the SDK's default sampler (parent-based, always on)
    decides, without recording: a child keeps its parent's trace id, flags and trace state; a
    root gets a new random trace id and is sampled.
    """

    # What else the API passes (kind, attributes, links, times, exception handling) describes
    # a recording nobody makes: taken, not used.
    def start_span(
        self, name: str, context: otel_context.Context | None = None, *_: Any, **__: Any
    ) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        if parent.is_valid:
            trace_id, flags, state = parent.trace_id, parent.trace_flags, parent.trace_state
        else:
            trace_id = _random_id(128)
            flags = trace.TraceFlags(trace.TraceFlags.SAMPLED | trace.TraceFlags.RANDOM_TRACE_ID)
            state = None
        span_context = trace.SpanContext(
            trace_id, _random_id(64), is_remote=False, trace_flags=flags, trace_state=state
        )
        return trace.NonRecordingSpan(span_context)

    # The API types it with its private `_agnosticcontextmanager`; any context manager does.
    @contextmanager
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: otel_context.Context | None = None,
        *_: Any,
        end_on_exit: bool = True,
        **__: Any,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context)
        with trace.use_span(span, end_on_exit=end_on_exit) as current:
            yield current


def _random_id(bits: int) -> int:
    """A random trace (128) or span (64) id; zero is the invalid id, as in the SDK's
    `RandomIdGenerator`."""
    while not (value := random.getrandbits(bits)):
        pass
    return value


def otlp_exporter(protocol: str) -> SpanExporter:
    """The OTLP span exporter for OTEL_EXPORTER_OTLP_PROTOCOL. Over HTTP (protobuf; http/json
    is sent as protobuf too) by default: its exporter is a dependency. gRPC's exporter pulls
    grpcio, a large native wheel most installs never use, so it is the `otlp-grpc` extra;
    asked for without it, this says so instead of failing on an import deep in the SDK."""
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )
    except ImportError as exc:
        raise ButlersError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: the OTLP gRPC exporter is not installed "
            f"({exc}). Install it with `pip install 'butlers[{GRPC_EXTRA}]'`, or export over "
            "HTTP: OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (the default; a collector's OTLP "
            "HTTP port is usually 4318)"
        ) from exc
    return GrpcSpanExporter()


def claude_code_telemetry_env(endpoint: str, protocol: str) -> dict[str, str]:
    """Claude Code exports its own `claude_code.*` spans (parented by TRACEPARENT) only when
    told to; metrics and logs stay off, they are not ours to ship."""
    return {
        "CLAUDE_CODE_ENABLE_TELEMETRY": "1",
        "CLAUDE_CODE_ENHANCED_TELEMETRY_BETA": "1",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_SERVICE_NAME": "claude-code",
    }


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


class RedactingSpanExporter(SpanExporter):
    """Spans go out with every configured secret replaced in their names, attributes, event
    attributes (exception messages and stack traces) and status descriptions."""

    def __init__(self, exporter: SpanExporter, redact: Callable[[str], str]) -> None:
        self.exporter = exporter
        self.redact = redact

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.exporter.export([self._redacted(span) for span in spans])

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    def _redacted(self, span: ReadableSpan) -> ReadableSpan:
        status = span.status
        if status.description:
            status = Status(status.status_code, self.redact(status.description))
        return ReadableSpan(
            name=self.redact(span.name),
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=self._attributes(span.attributes),
            events=[
                Event(e.name, self._attributes(e.attributes), e.timestamp) for e in span.events
            ],
            links=span.links,
            kind=span.kind,
            status=status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )

    def _attributes(self, attributes: Mapping[str, Any] | None) -> dict[str, Any]:
        return {key: self._value(value) for key, value in (attributes or {}).items()}

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, tuple | list):
            return [self._value(v) for v in value]
        return value
