"""A local OTLP trace receiver (what Jaeger's collector does with spans, minus the storage UI).

It speaks OTLP/HTTP (`POST /v1/traces`, protobuf) and OTLP/gRPC (TraceService/Export)
on 127.0.0.1, decodes with opentelemetry-proto, and keeps every span as a `ReceivedSpan`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from tests.fakes import serve_on_loopback


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str | None
    status: str  # "unset" | "ok" | "error"
    attributes: dict[str, Any] = field(default_factory=dict)
    protocol: str = ""  # "http" | "grpc": how it arrived
    start_ns: int = 0  # wall clock (ns since the epoch), as the span says
    end_ns: int = 0


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


_STATUS = {
    Status.STATUS_CODE_UNSET: "unset",
    Status.STATUS_CODE_OK: "ok",
    Status.STATUS_CODE_ERROR: "error",
}


def decode(
    request: trace_service_pb2.ExportTraceServiceRequest, protocol: str
) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        status=_STATUS.get(span.status.code, "unset"),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        protocol=protocol,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                )
    return spans


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    async def Export(self, request, context):  # the generated servicer names it so
        await self.receiver._add(decode(request, "grpc"), request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        # Every export request as it came (protobuf): events, status messages and resources
        # included, for checks that must see everything, e.g. that no secret was exported.
        self.exports: list[bytes] = []
        self.http_url = ""
        self.grpc_url = ""
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None

    def url(self, protocol: str) -> str:
        return self.grpc_url if protocol == "grpc" else self.http_url

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._http_export)
        self._runner, self.http_url = await serve_on_loopback(app)
        self._grpc = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        await self._grpc.start()
        self.grpc_url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=None)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _http_export(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":  # OTLP/JSON: not used by us
            return web.Response(status=415, text=f"unsupported {request.content_type}")
        body = await request.read()
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(body)
        await self._add(decode(message, "http"), body)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    async def _add(self, spans: list[ReceivedSpan], raw: bytes) -> None:
        async with self._changed:
            self.spans.extend(spans)
            self.exports.append(raw)
            self._changed.notify_all()

    async def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30
    ) -> list[ReceivedSpan]:
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: predicate(self.spans))
        except TimeoutError:
            names = sorted({(s.service, s.name) for s in self.spans})
            raise AssertionError(f"spans never matched; received: {names}") from None
        return self.spans
