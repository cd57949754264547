"""An OTLP/gRPC trace endpoint inside this process, and the span tree of one trace.

``pdbroker demo --trace`` and the tests point the OTLP exporters of the broker and engine
processes at it (:meth:`TraceReceiver.environment`) to see one transfer's spans from every
process; it implements the collector's ``TraceService`` from ``opentelemetry-proto``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span. Ids are hex strings (``parent_id`` '' for a root); times are
    nanoseconds since the epoch; ``links`` are ``(trace id, span id)`` pairs; ``kind`` is
    ``INTERNAL``, ``SERVER``, ``CLIENT``, ``PRODUCER`` or ``CONSUMER``."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]
    error: bool
    kind: str

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _span(service: str, span: trace_pb2.Span) -> ReceivedSpan:
    return ReceivedSpan(
        service,
        span.name,
        span.trace_id.hex(),
        span.span_id.hex(),
        span.parent_span_id.hex(),
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        {a.key: _value(a.value) for a in span.attributes},
        tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
        span.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
        trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
    )


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it over OTLP/gRPC. Use as ``with TraceReceiver() as r``
    (or :meth:`start` / :meth:`stop`); :attr:`endpoint` is its ``http://HOST:PORT``."""

    def __init__(self) -> None:
        self._requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.endpoint = ""

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            self._requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> Self:
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server, self.endpoint = server, f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None)
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def environment(self) -> dict[str, str]:
        """``OTEL_*`` variables that make a process export its traces here."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        }

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            requests = list(self._requests)
        out: list[ReceivedSpan] = []
        for request in requests:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    out.extend(_span(service, s) for s in scope_spans.spans)
        return out


def span_tree(spans: Iterable[ReceivedSpan], trace_id: str) -> list[str]:
    """The spans of one trace, one per line: ``<indent><service> <name> <duration ms>``,
    children below their parent (two spaces deeper) by start time; a span whose parent is
    not among them starts at the left."""
    members = [s for s in spans if s.trace_id == trace_id]
    ids = {s.span_id for s in members}
    children: dict[str, list[ReceivedSpan]] = {}
    for s in members:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, ()), key=lambda s: (s.start_ns, s.name)):
            lines.append(f"{'  ' * depth}{s.service} {s.name} {s.duration_ms:.3f}")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return lines
