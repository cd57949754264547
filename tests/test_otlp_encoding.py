"""The OTLP encoder of the broker's exporter child (``broker/otlp_encoding.py``) against the
SDK's encoder: the same request for the same spans."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from span_samples import RESOURCE, varied_spans

from broker.otlp_encoding import encode_request, encode_resource
from broker.span_exporter import unpack_span


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
