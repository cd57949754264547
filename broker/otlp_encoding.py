"""OTLP trace export requests written straight from packed spans, in protobuf's wire format.

The exporter child encodes what the broker's tracer packed (:data:`~broker.span_pipe.
PackedSpan`) without building SDK spans or protobuf objects first: :func:`encode_request`
gives the bytes of the ``ExportTraceServiceRequest`` the SDK's encoder
(``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans``) would give for the
same spans (``tests/test_otlp_encoding.py`` holds them equal), at a fraction of the CPU
(``docs/BENCHMARKS.md``). Attribute values OTLP cannot carry are left out (logged once per
key), as the SDK's encoder leaves them out; ``tracestate`` is not exported.

The messages (opentelemetry-proto: collector/trace/v1/trace_service.proto, trace/v1/
trace.proto, common/v1/common.proto, resource/v1/resource.proto) are written field by field:
each field is a key byte (field number << 3 | wire type), then a varint, 8 or 4 little-endian
bytes, or a varint length and that many bytes. The key bytes below name their message and
field.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode

from broker.span_pipe import PackedSpan

log = logging.getLogger(__name__)
_SMALL = [bytes((n,)) for n in range(0x80)]
_INT64 = 1 << 64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_DOUBLE = struct.Struct("<Bd")  # AnyValue.double_value (4)
_TIMES = struct.Struct("<BQBQ")  # Span.start_time_unix_nano (7), end_time_unix_nano (8)
_EVENT_TIME = struct.Struct("<BQ")  # Span.Event.time_unix_nano (1)
#: Span.kind (6): SPAN_KIND_INTERNAL (1) ... SPAN_KIND_CONSUMER (5), by SpanKind value.
_KINDS = {k.value: b"\x30" + _SMALL[k.value + 1] for k in SpanKind}
#: Span.flags (16) and Span.Link.flags (6), fixed32: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK,
#: with SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK for a remote parent (or linked) context.
_SPAN_FLAGS = (b"\x85\x01\x00\x01\x00\x00", b"\x85\x01\x00\x03\x00\x00")
_LINK_FLAGS = (b"\x35\x00\x01\x00\x00", b"\x35\x00\x03\x00\x00")
_ERROR = StatusCode.ERROR.value
_ENCODING_ERRORS = (
    AttributeError,
    TypeError,
    ValueError,
    OverflowError,
    RecursionError,
    struct.error,
)
#: KeyValue.key (1) of the attribute keys seen (bounded).
_KEYS: dict[str, bytes] = {}
_KEYS_MAX = 4096
_DROPPED_KEYS: set[str] = set()


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(key: bytes, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a message)."""
    n = len(payload)
    return key + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` message; the types in the order of the SDK's encoder."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"  # bool_value (2)
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())  # string_value (1)
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise OverflowError(f"{value} is outside int64")
        return b"\x18" + _varint(value % _INT64)  # int_value (3), two's complement
    if isinstance(value, float):
        return _DOUBLE.pack(0x21, value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)  # bytes_value (7)
    if isinstance(value, Sequence):  # array_value (5): ArrayValue.values (1)
        return _field(b"\x2a", b"".join([_field(b"\x0a", _any_value(v)) for v in value]))
    if isinstance(value, Mapping):  # kvlist_value (6): KeyValueList.values (1)
        items = [_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items()]
        return _field(b"\x32", b"".join(items))
    raise TypeError(f"{type(value).__name__} is not an attribute type")


def _key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue`` message: key (1), value (2)."""
    encoded_key = _KEYS.get(key)
    if encoded_key is None:
        encoded_key = _field(b"\x0a", key.encode())
        if len(_KEYS) < _KEYS_MAX:
            _KEYS[key] = encoded_key
    return encoded_key + _field(b"\x12", _any_value(value))


def _attributes(key: bytes, attributes: Mapping[str, Any]) -> bytes:
    """Each of ``attributes`` as a ``KeyValue`` field ``key``; a value OTLP cannot carry is
    left out (as the SDK's encoder does), logged once per attribute key."""
    out = []
    for k, v in attributes.items():
        try:
            out.append(_field(key, _key_value(k, v)))
        except _ENCODING_ERRORS as exc:
            if k not in _DROPPED_KEYS:
                _DROPPED_KEYS.add(k)
                log.warning("span attribute %r is not exported: %s", k, exc)
    return b"".join(out)


def _ids(trace_id: int, span_id: int) -> bytes:
    """trace_id (1) and span_id (2) of a ``Span`` or a ``Span.Link``."""
    return b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08" + span_id.to_bytes(8, "big")


def _span(packed: PackedSpan) -> bytes:
    """A ``Span`` message from a :data:`PackedSpan`."""
    (name, trace_id, span_id, parent_id, parent_remote, kind, start, end, attributes, events,
     links, code, text, _) = packed  # fmt: skip
    parts = [_ids(trace_id, span_id)]
    if parent_id:  # parent_span_id (4)
        parts += (b"\x22\x08", parent_id.to_bytes(8, "big"))
    parts += (
        _field(b"\x2a", name.encode()),  # name (5)
        _KINDS[kind],
        _TIMES.pack(0x39, start, 0x41, end),
        _attributes(b"\x4a", attributes),  # attributes (9)
    )
    for event_name, at, event_attributes in events:  # events (11): time, name, attributes
        event = _EVENT_TIME.pack(0x09, at) + _field(b"\x12", event_name.encode())
        parts.append(_field(b"\x5a", event + _attributes(b"\x1a", event_attributes)))
    for link_trace, link_span, remote, link_attributes in links:  # links (13)
        link = _ids(link_trace, link_span) + _attributes(b"\x22", link_attributes)
        parts.append(_field(b"\x6a", link + _LINK_FLAGS[remote]))
    # status (15): message (2, kept for ERROR only, as the SDK's Status), code (3)
    status = _field(b"\x12", text.encode()) if text and code == _ERROR else b""
    if code:
        status += b"\x18" + _SMALL[code]
    parts += (_field(b"\x7a", status), _SPAN_FLAGS[parent_remote])  # flags (16)
    return b"".join(parts)


def encode_resource(attributes: Mapping[str, Any]) -> bytes:
    """A ``Resource`` message: its attributes (1)."""
    return _attributes(b"\x0a", attributes)


def encode_request(spans: Sequence[PackedSpan], resource: bytes) -> bytes:
    """An ``ExportTraceServiceRequest`` of ``spans`` in the ``Resource`` message ``resource``
    (:func:`encode_resource`): one ``ResourceSpans``, one ``ScopeSpans`` per instrumentation
    scope, in the order of each scope's first span. A span that cannot be encoded is left out
    (logged)."""
    by_scope: dict[tuple[str, str | None], list[bytes]] = {}
    for packed in spans:
        try:
            encoded = _field(b"\x12", _span(packed))  # ScopeSpans.spans (2)
        except _ENCODING_ERRORS as exc:
            log.warning("span %r is not exported: %s", packed[0], exc)
            continue
        scope = packed[-1]
        if scope in by_scope:
            by_scope[scope].append(encoded)
        else:
            by_scope[scope] = [encoded]
    scope_spans = []
    for (name, version), encoded_spans in by_scope.items():
        # InstrumentationScope: name (1), version (2); ScopeSpans: scope (1), spans (2)
        encoded_scope = _field(b"\x0a", name.encode())
        if version:
            encoded_scope += _field(b"\x12", version.encode())
        scope_spans.append(
            _field(b"\x12", _field(b"\x0a", encoded_scope) + b"".join(encoded_spans))
        )
    # ExportTraceServiceRequest.resource_spans (1): ResourceSpans resource (1), scope_spans (2)
    return _field(b"\x0a", _field(b"\x0a", resource) + b"".join(scope_spans))
