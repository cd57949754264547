"""The broker's span exporter child: ``python -m broker.span_exporter NAMES RESOURCE_JSON``.

It reads the frames of packed spans the broker's tracer writes to its stdin
(:mod:`broker.span_pipe`) until the broker closes it, on CPU time nothing else wants, and
exports them with the exporters ``NAMES`` lists (comma-separated,
:data:`broker.tracing.EXPORTERS`; '' records only) in a resource of ``RESOURCE_JSON``'s
attributes. The SDK's OTLP exporters (gRPC or HTTP) get the request
:func:`broker.otlp_encoding.encode_request` wrote (:func:`accept_encoded_requests`), so
endpoint, headers, TLS, compression, timeout and retries follow the usual
``OTEL_EXPORTER_OTLP_*`` variables; other exporters (console) get SDK spans
(:func:`unpack_span`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from broker.otlp_encoding import encode_request, encode_resource
from broker.span_pipe import PackedSpan, read_frames
from broker.tracing import named_exporter

log = logging.getLogger(__name__)
#: Spans per export call (OpenTelemetry's batch processor default).
EXPORT_BATCH = 512
#: Added to the exporter process's nice value where idle scheduling is not available.
NICENESS = 19
#: The modules of the SDK's OTLP span exporters whose ``encode_spans``
#: :func:`accept_encoded_requests` rebinds.
OTLP_EXPORTER_MODULES = (
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class EncodedSpans:
    """Spans encoded as one OTLP request by :func:`~broker.otlp_encoding.encode_request`,
    passed to an SDK OTLP exporter (:func:`accept_encoded_requests`) where it expects a
    sequence of SDK spans."""

    __slots__ = ("_count", "request")

    def __init__(self, request: bytes, count: int) -> None:
        self.request = ExportTraceServiceRequest.FromString(request)  # C (upb)
        self._count = count

    def __len__(self) -> int:  # the exporters count what they export with len()
        return self._count


class _PassEncoded:
    """What :func:`accept_encoded_requests` binds to ``encode_spans`` in an SDK exporter
    module: an :class:`EncodedSpans`' request as it is, anything else through ``sdk_encode``
    (the SDK's encoder)."""

    __slots__ = ("sdk_encode",)

    def __init__(self, sdk_encode: Callable[[Sequence[ReadableSpan]], Any]) -> None:
        self.sdk_encode = sdk_encode

    def __call__(self, spans: Sequence[ReadableSpan] | EncodedSpans) -> Any:
        return spans.request if isinstance(spans, EncodedSpans) else self.sdk_encode(spans)


def accept_encoded_requests(exporter: SpanExporter) -> bool:
    """Let ``exporter``, if it is one of the SDK's OTLP span exporters (gRPC or HTTP), take
    :class:`EncodedSpans`; whether it does (other exporters get SDK spans).

    The one place pdbroker relies on an OpenTelemetry SDK internal: no public API sends an
    encoded request through the SDK's OTLP exporters, and those are what make the export
    follow ``OTEL_EXPORTER_OTLP_*``. What it relies on: each module of
    :data:`OTLP_EXPORTER_MODULES` imports ``encode_spans`` from
    ``opentelemetry.exporter.otlp.proto.common.trace_encoder`` as a module global, and its
    ``OTLPSpanExporter`` looks that global up at each export, calls it with what
    ``export()`` was given and sends the ``ExportTraceServiceRequest`` it returns (gRPC in
    ``_translate_data``; HTTP in ``export``, serialized). Here, in the exporter child, the
    global is rebound once to a function that returns an :class:`EncodedSpans`' request as
    it is and passes anything else to the SDK's encoder. Where a module lacks the global
    the exporter gets SDK spans (slower, same export). ``tests/test_span_exporter.py``
    fails on an SDK where any of this no longer holds; pyproject.toml pins the SDK to the
    versions tested.
    """
    module_name = type(exporter).__module__
    if module_name not in OTLP_EXPORTER_MODULES:
        return False
    module = sys.modules[module_name]
    sdk_encode = getattr(module, "encode_spans", None)
    if not callable(sdk_encode):
        log.warning("%s has no encode_spans: spans are exported as SDK spans", module_name)
        return False
    if not isinstance(sdk_encode, _PassEncoded):  # not rebound yet
        vars(module)["encode_spans"] = _PassEncoded(sdk_encode)
    return True


def unpack_span(packed: PackedSpan, resource: Resource) -> ReadableSpan:
    """An SDK span, in ``resource``, from a :data:`~broker.span_pipe.PackedSpan` (for
    exporters other than OTLP's)."""
    (name, trace_id, span_id, parent_id, parent_remote, kind, start, end, attributes, events,
     links, code, text, scope) = packed  # fmt: skip
    return ReadableSpan(
        name,
        SpanContext(trace_id, span_id, False, _SAMPLED),
        SpanContext(trace_id, parent_id, parent_remote, _SAMPLED) if parent_id else None,
        resource,
        attributes,
        [Event(n, a, t) for n, t, a in events],
        [Link(SpanContext(t, s, r, _SAMPLED), a) for t, s, r, a in links],
        SpanKind(kind),
        status=Status(StatusCode(code), text),
        start_time=start,
        end_time=end,
        instrumentation_scope=InstrumentationScope(*scope),
    )


def _yield_the_cpu() -> None:
    """Run only on CPU time nothing else wants (Linux ``SCHED_IDLE``), else at the lowest
    nice priority: on a saturated host telemetry waits for serving, not the reverse (the
    broker's queue holds what waits; beyond it spans are dropped and counted)."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(NICENESS)


def _export(exporters: Sequence[SpanExporter], spans: Any) -> None:
    for exporter in exporters:
        try:
            exporter.export(spans)
        except Exception:  # as the SDK's span processors: log it, go on
            log.exception("exporting spans with %s failed", type(exporter).__name__)


def main(exporter_names: str, resource_attributes: Mapping[str, Any]) -> int:
    """Export the spans of every frame on stdin until it closes."""
    _yield_the_cpu()
    resource = Resource(resource_attributes)
    encoded_resource = encode_resource(resource.attributes)
    exporters = [named_exporter(n) for n in exporter_names.split(",") if n]  # '': record only
    otlp = [e for e in exporters if accept_encoded_requests(e)]
    others = [e for e in exporters if all(e is not o for o in otlp)]
    for batch in read_frames(sys.stdin.buffer):
        for start in range(0, len(batch), EXPORT_BATCH):  # requests of bounded size
            spans = batch[start : start + EXPORT_BATCH]
            if otlp:
                _export(otlp, EncodedSpans(encode_request(spans, encoded_resource), len(spans)))
            if others:
                _export(others, [unpack_span(s, resource) for s in spans])
    for exporter in exporters:
        exporter.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
