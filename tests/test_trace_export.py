"""The broker's own tracer (``broker/trace_export.py``) without its child process: span
packing, the sampler shortcut, the direct OTLP encoding against the SDK's encoder, and the
SDK's OTLP exporters (gRPC and HTTP) sending what it encoded."""

from __future__ import annotations

import enum
import http.server
import io
import pickle
import struct
import threading
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    DEFAULT_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from broker import trace_export, tracing
from broker.trace_export import (
    EncodedSpans,
    OffloadTracerProvider,
    PackedSpan,
    encode_request,
    encode_resource,
    unpack_span,
)
from broker.tracing import context_from_traceparent
from harness.trace_receiver import TraceReceiver

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
RESOURCE = Resource({"service.name": "unit", "host.cores": 2})


class Color(enum.IntEnum):
    RED = 1


class Delegating(Sampler):
    """Decides as ``sampler`` but is not recognized as the default (the tracer calls it)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return self.sampler.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return f"Delegating({self.sampler.get_description()})"


class RecordOnly(Sampler):
    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        return SamplingResult(Decision.RECORD_ONLY)

    def get_description(self) -> str:
        return "RecordOnly"


def tracer(sampler: Sampler, sink: Any, scope: tuple[str, str | None] = ("pdbroker", None)):
    provider = SimpleNamespace(sampler=sampler, sink=sink)
    return trace_export._Tracer(provider, scope)  # type: ignore[arg-type]


def varied_spans() -> list[PackedSpan]:
    """Spans with every field the encoder writes: roots, local and remote parents, kinds,
    attributes of each type (and two OTLP cannot carry), events, links, statuses, two
    scopes, a name and a value longer than one length byte holds."""
    spans: list[PackedSpan] = []
    one, other = tracer(DEFAULT_ON, spans.append), tracer(DEFAULT_ON, spans.append, ("x", "1.2"))
    remote = context_from_traceparent(TRACEPARENT)
    attributes = {
        "s": "x",
        "unicode": "é✓",
        "i": -5,
        "int64": 2**63 - 1,
        "f": 1.5,
        "b": b"\x00\x01",
        "ints": [1, 2, 3],
        "strs": ("a", "b"),
        "bools": [True, False],
        "none_in": [None, "x"],
        "enum": Color.RED,
        "not_a_value": object(),
        "too_big": 2**64,
    }
    root = one.start_span("root", attributes=attributes, kind=SpanKind.SERVER)
    with trace.use_span(root, end_on_exit=True):
        link = Link(trace.get_current_span(remote).get_span_context(), {"k": 1})
        child = other.start_span("child", links=[link], kind=SpanKind.CLIENT)
        child.add_event("event", {"a": 1})
        child.record_exception(ValueError("boom"))
        child.set_status(StatusCode.ERROR, "read failed")
        child.end()
        ok = one.start_span("ok")
        ok.set_status(Status(StatusCode.OK))
        ok.end()
    one.start_span("remote child", remote, kind=SpanKind.PRODUCER).end()
    one.start_span("long" * 100, attributes={"k" * 300: "v" * 70_000}).end()
    return spans


def test_the_encoding_is_the_sdk_encoders() -> None:
    spans = varied_spans()
    ours = ExportTraceServiceRequest.FromString(
        encode_request(spans, encode_resource(RESOURCE.attributes))
    )
    assert ours == encode_spans([unpack_span(s, RESOURCE) for s in spans])
    scopes = ours.resource_spans[0].scope_spans
    assert [(s.scope.name, s.scope.version) for s in scopes] == [("x", "1.2"), ("pdbroker", "")]
    (root,) = [s for s in scopes[1].spans if s.name == "root"]
    attributes = root.attributes
    assert [a.key for a in attributes if a.key in ("enum", "not_a_value", "too_big")] == ["enum"]


@pytest.mark.parametrize("flags", ["01", "00"])
@pytest.mark.parametrize("parent", ["none", "remote", "local"])
def test_the_default_samplers_shortcut_decides_as_the_sampler(parent: str, flags: str) -> None:
    """``parentbased_always_on`` is decided without calling it, as calling it would."""
    spans: dict[str, list[PackedSpan]] = {"short": [], "called": []}
    made, recording = {}, {}
    for way, sampler in (("short", ParentBased(ALWAYS_ON)), ("called", Delegating(DEFAULT_ON))):
        assert trace_export._follows_parent(sampler) == (way == "short")
        t = tracer(sampler, spans[way].append)
        context = None
        if parent != "none":
            context = context_from_traceparent(TRACEPARENT[:-2] + flags)
        if parent == "local":  # a parent span of this process, sampled or not
            context = trace.set_span_in_context(t.start_span("outer", context))
        made[way] = t.start_span("span", context)
        recording[way] = made[way].is_recording()
        made[way].end()
    short, called = made["short"].get_span_context(), made["called"].get_span_context()
    assert recording["short"] == recording["called"] == (flags == "01" or parent == "none")
    assert short.trace_flags == called.trace_flags
    assert short.trace_state == called.trace_state
    assert (short.trace_id == called.trace_id) == (parent != "none")
    assert [s[4] for s in spans["short"]] == [s[4] for s in spans["called"]]  # parent remote
    assert len(spans["short"]) == recording["short"]  # ("outer" does not end)


def test_spans_recorded_but_not_sampled_are_not_exported() -> None:
    spans: list[PackedSpan] = []
    span = tracer(RecordOnly(), spans.append).start_span("kept here only")
    assert span.is_recording()
    span.end()
    assert not spans


def test_spans_cross_the_pipe_marshalled_or_pickled() -> None:
    """What :meth:`OffloadTracerProvider.sink` queues reads back as the packed spans, also
    with a value marshal does not take (then pickled)."""
    spans = varied_spans()
    spans = [s for s in spans if "not_a_value" not in s[8]]  # object() pickles by reference
    spans.append(spans[0][:8] + ({"enum": Color.RED},) + spans[0][9:])
    queue: list[bytes] = []
    fake = SimpleNamespace(_queue=queue)
    for s in spans:
        OffloadTracerProvider.sink(fake, s)  # type: ignore[arg-type]
    assert queue[-1][0] == pickle.PROTO[0] and queue[0][0] != pickle.PROTO[0]
    payload = pickle.dumps(queue, pickle.HIGHEST_PROTOCOL)
    stream = io.BytesIO(struct.pack("<I", len(payload)) + payload)
    (frame,) = trace_export._read_frames(stream)
    assert frame == spans
    assert type(frame[-1][8]["enum"]) is Color


def test_the_sdks_grpc_exporter_sends_encoded_spans() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    spans = varied_spans()
    with TraceReceiver() as receiver:
        exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
        assert trace_export._takes_encoded(exporter)
        request = encode_request(spans, encode_resource(RESOURCE.attributes))
        assert exporter.export(EncodedSpans(request, len(spans))).name == "SUCCESS"
        exporter.export([unpack_span(spans[0], RESOURCE)])  # SDK spans still go through
        exporter.shutdown()
        received = receiver.spans()
    assert [s.name for s in received] == [s[0] for s in spans] + [spans[0][0]]
    assert {s.service for s in received} == {"unit"}


@pytest.fixture
def http_collector() -> Iterator[tuple[str, list[bytes]]]:
    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies
    finally:
        server.shutdown()
        server.server_close()


def test_the_sdks_http_exporter_sends_encoded_spans(
    http_collector: tuple[str, list[bytes]],
) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint, bodies = http_collector
    spans = varied_spans()
    exporter = OTLPSpanExporter(endpoint=endpoint)
    assert trace_export._takes_encoded(exporter)
    request = encode_request(spans, encode_resource(RESOURCE.attributes))
    assert exporter.export(EncodedSpans(request, len(spans))).name == "SUCCESS"
    exporter.shutdown()
    (body,) = bodies
    assert ExportTraceServiceRequest.FromString(body) == ExportTraceServiceRequest.FromString(
        request
    )


def test_other_exporters_get_sdk_spans() -> None:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    assert not trace_export._takes_encoded(ConsoleSpanExporter())


@pytest.mark.parametrize(
    "traceparent",
    [
        TRACEPARENT,
        TRACEPARENT[:-2] + "00",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # invalid ids
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case: invalid
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-more",  # a later version
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "garbage",
    ],
)
def test_stored_traceparents_parse_as_the_propagator_parses_them(traceparent: str) -> None:
    ctx, span_context = tracing._parse_stored(traceparent)
    expected = context_from_traceparent(traceparent)
    assert span_context == trace.get_current_span(expected).get_span_context()
    assert trace.get_current_span(ctx).get_span_context() == span_context
    assert ctx.keys() == expected.keys()
