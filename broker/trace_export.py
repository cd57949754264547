"""The broker's tracer: spans recorded as plain tuples, encoded and exported by a child process.

Measured in the broker process (2-core host, OpenTelemetry SDK 1.45): an SDK span costs
70-90 µs to start and end (attribute validation, sampler, span processor chain, a
``ReadableSpan`` copy), and its OTLP encoding by the SDK 35-60 µs more, while planning a
request costs ~170 µs and the whole ``GetTransferPlan`` call ~500-750 µs of broker CPU. So the
broker records spans itself: :class:`OffloadTracerProvider` hands out spans that keep their
fields in slots and, when they end, queue one flat tuple of plain values (:data:`PackedSpan`),
marshalled at once; under the default sampler (``parentbased_always_on``) the tracer takes
the parent's decision itself rather than calling the sampler. A daemon thread frames what has
queued up and writes it to a child process (``python -m broker.trace_export``, on idle CPU
time only). A ``broker.plan`` span costs the broker ~11 µs of CPU when spans come back to
back and ~24 µs at 1,000 plans a second, caches cooled by the plans between
(``benchmarks/span_cost.py``; 17 and 34 µs with SDK sampling and batch pickling).

The child writes the OTLP ``ExportTraceServiceRequest`` straight from those tuples in
protobuf's wire format (:func:`encode_request`, ~8 µs a span) and hands it to the SDK's own
OTLP exporter (gRPC or HTTP, :func:`_takes_encoded`), so endpoint, headers, TLS, compression,
timeout and retries follow the usual ``OTEL_EXPORTER_OTLP_*`` variables. In all the child
spends 15-22 µs of CPU a span, where rebuilding SDK ``ReadableSpan`` objects for the SDK's
encoder took 65-85 µs. Other exporters ``OTEL_TRACES_EXPORTER`` names (console) get SDK
``ReadableSpan`` objects (:func:`unpack_span`). Trace and span ids, W3C context and the
sampler (``OTEL_TRACES_SAMPLER``) are OpenTelemetry's; ``tracestate`` is not exported.
Attribute values OTLP cannot carry are left out by the child (logged once per key), as the
SDK's encoder leaves them out.

Frames on the child's stdin: a 4-byte little-endian length, then a pickled list of packed
spans, each marshalled (or pickled, where marshal does not take a value). The child's command
line carries the exporter names and the resource attributes.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import marshal
import os
import pickle
import random
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, ParentBased, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)
_FRAME = struct.Struct("<I")
_PICKLE_PROTO = pickle.PROTO[0]  # the first byte of a pickle; never of a marshalled tuple
#: Spans per export call (OpenTelemetry's batch processor default).
EXPORT_BATCH = 512
#: Added to the exporter process's nice value where idle scheduling is not available.
NICENESS = 19
#: The pipe to the child, where Linux lets a pipe be this large (default: 64 KiB). The
#: shipping thread writes what fits each ``interval_s``: 64 KiB would cap the export at
#: ~1,000 spans a second.
PIPE_BYTES = 1 << 20

#: What an ended span queues: ``(name, trace_id, span_id, parent_span_id (0: a root),
#: parent_is_remote, kind, start_ns, end_ns, attributes, events, links, status_code,
#: status_description, (scope_name, scope_version))``, with ``kind`` and ``status_code`` the
#: values of OpenTelemetry's enums, events ``(name, time_ns, attributes)`` and links
#: ``(trace_id, span_id, is_remote, attributes)``. Only sampled spans are queued.
PackedSpan = tuple

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = (StatusCode.UNSET.value, None)


def _follows_parent(sampler: Sampler) -> bool:
    """Whether ``sampler`` decides as OpenTelemetry's default, ``parentbased_always_on``
    (samples what its parent sampled, and every root): then the tracer decides without it."""
    return sampler is DEFAULT_ON or (
        type(sampler) is ParentBased and vars(sampler) == vars(DEFAULT_ON)
    )


def _discard(packed: PackedSpan) -> None:
    """Where spans recorded but not sampled end (as the SDK's span processors, the exporter
    skips them)."""


def _pack_links(links: Sequence[Link]) -> list[tuple[int, int, bool, dict[str, Any]]]:
    return [
        (k.context.trace_id, k.context.span_id, k.context.is_remote, dict(k.attributes or {}))
        for k in links
    ]


class _Span(trace.Span):
    """A recording span that, when it ends, hands its fields to ``sink`` as one
    :data:`PackedSpan`. Not thread-safe (the broker's spans live on its loop)."""

    __slots__ = (
        "_attributes",
        "_context",
        "_end",
        "_events",
        "_kind",
        "_links",
        "_name",
        "_parent",
        "_scope",
        "_sink",
        "_start",
        "_status",
    )

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        start: int,
        attributes: dict[str, Any],
        links: Sequence[Link],
        scope: tuple[str, str | None],
        sink: Callable[[PackedSpan], None],
    ) -> None:
        self._name, self._context, self._parent, self._kind = name, context, parent, kind
        self._start, self._end = start, 0
        self._attributes = attributes
        self._links = links
        self._events: list[tuple[str, int, dict[str, Any]]] = []
        self._status: tuple[int, str | None] = _UNSET
        self._scope, self._sink = scope, sink

    def get_span_context(self) -> SpanContext:
        return self._context

    def set_attribute(self, key: str, value: Any) -> None:
        self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        self._events.append((name, timestamp or time.time_ns(), dict(attributes or {})))

    def update_name(self, name: str) -> None:
        self._name = name

    def is_recording(self) -> bool:
        return not self._end

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if isinstance(status, Status):
            self._status = (status.status_code.value, status.description)
        else:
            self._status = (status.value, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.add_event(
            "exception",
            {
                "exception.type": type(exception).__name__,
                "exception.message": str(exception),
                "exception.escaped": escaped,
                **(attributes or {}),
            },
            timestamp,
        )

    def end(self, end_time: int | None = None) -> None:
        if self._end:
            return
        self._end = end_time or time.time_ns()
        context, parent = self._context, self._parent
        self._sink(
            (
                self._name,
                context.trace_id,
                context.span_id,
                0 if parent is None else parent.span_id,
                parent is not None and parent.is_remote,
                self._kind.value,
                self._start,
                self._end,
                self._attributes,
                self._events,
                _pack_links(self._links) if self._links else (),
                *self._status,
                self._scope,
            )
        )


class _Tracer(trace.Tracer):
    def __init__(self, provider: OffloadTracerProvider, scope: tuple[str, str | None]) -> None:
        self._sampler = provider.sampler
        self._follows_parent = _follows_parent(provider.sampler)
        self._sink = provider.sink
        self._scope = scope

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        span_id = random.getrandbits(64) or 1
        sink = self._sink
        if self._follows_parent:  # the default sampler's decision, without calling it
            if not parent.is_valid:
                parent = None
                span_context = SpanContext(random.getrandbits(128) or 1, span_id, False, _SAMPLED)
            elif parent.trace_flags.sampled:
                span_context = SpanContext(
                    parent.trace_id, span_id, False, _SAMPLED, parent.trace_state
                )
            else:
                return trace.NonRecordingSpan(
                    SpanContext(parent.trace_id, span_id, False, _NOT_SAMPLED, parent.trace_state)
                )
            attributes = dict(attributes) if attributes else {}
        else:
            trace_id = parent.trace_id if parent.is_valid else random.getrandbits(128) or 1
            sampled = self._sampler.should_sample(context, trace_id, name, kind, attributes, links)
            flags = _SAMPLED if sampled.decision.is_sampled() else _NOT_SAMPLED
            span_context = SpanContext(trace_id, span_id, False, flags, sampled.trace_state)
            if not sampled.decision.is_recording():
                return trace.NonRecordingSpan(span_context)
            if not flags.sampled:
                sink = _discard
            if not parent.is_valid:
                parent = None
            attributes = {**(attributes or {}), **(sampled.attributes or {})}
        return _Span(
            name,
            span_context,
            parent,
            kind,
            start_time or time.time_ns(),
            attributes,
            links or (),
            self._scope,
            sink,
        )

    def start_as_current_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> AbstractContextManager[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        return trace.use_span(  # type: ignore[return-value]
            span, end_on_exit, record_exception, set_status_on_exception
        )


class OffloadTracerProvider(trace.TracerProvider):
    """Tracers whose spans a ``python -m broker.trace_export`` child exports with the
    exporters ``exporter_names`` (comma-separated, see :data:`broker.tracing.EXPORTERS`).

    Ended spans queue up as bytes (:meth:`sink`); every ``interval_s`` a daemon thread frames
    them and writes what the pipe takes without blocking. Frames the child has not read yet
    wait too (bytes: a slow child costs no garbage-collector work), at most ``max_pending``
    spans' worth: beyond that the oldest whole frames are dropped and counted in
    :attr:`dropped`. :meth:`shutdown` writes the rest, closes the child's stdin and waits for
    it to export and exit.
    """

    def __init__(
        self,
        resource: Resource,
        exporter_names: str,
        sampler: Sampler,
        interval_s: float = 0.2,
        max_pending: int = 65536,
    ) -> None:
        self.resource = resource
        self.sampler = sampler
        self.max_pending = max_pending
        self.dropped = 0
        self._queue: deque[bytes] = deque()  # packed spans, serialized
        self._frames: deque[tuple[memoryview, int]] = deque()  # unwritten bytes, spans
        self._pending = 0  # spans in self._frames
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # one writer of the pipe at a time
        command = [sys.executable, "-m", "broker.trace_export", exporter_names]
        self._child = subprocess.Popen(
            [*command, json.dumps(dict(resource.attributes))], stdin=subprocess.PIPE
        )
        assert self._child.stdin is not None
        self._fd = self._child.stdin.fileno()
        os.set_blocking(self._fd, False)
        if hasattr(fcntl, "F_SETPIPE_SZ"):
            try:
                fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # beyond /proc/sys/fs/pipe-max-size: keep the default
                pass
        self._thread = threading.Thread(target=self._ship, name="pdbroker-spans", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> trace.Tracer:
        return _Tracer(self, (instrumenting_module_name, instrumenting_library_version))

    def sink(self, packed: PackedSpan) -> None:
        """Queue one ended span (the shipping thread takes it within ``interval_s``), as bytes
        at once: then its dicts and lists die now rather than wait in the queue, where the
        garbage collector would move them to older generations and run full collections
        more often (~20 µs a plan, measured)."""
        try:
            data = marshal.dumps(packed)  # ~1.5 µs
        except ValueError:  # a value marshal does not take (a subclass of str or int...)
            data = pickle.dumps(packed, pickle.HIGHEST_PROTOCOL)
        self._queue.append(data)

    def _ship(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self._send()

    def _send(self) -> None:
        """Frame what has queued up, drop the oldest frames beyond ``max_pending`` spans,
        write what the pipe takes now."""
        with self._lock:
            batch = [self._queue.popleft() for _ in range(len(self._queue))]
            if batch:
                payload = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
                self._frames.append((memoryview(_FRAME.pack(len(payload)) + payload), len(batch)))
                self._pending += len(batch)
            while self._pending > self.max_pending and len(self._frames) > 1:
                _, spans = self._frames.popleft()  # never the head: it may be half written
                self._pending -= spans
                self.dropped += spans
            self._write()

    def _write(self) -> None:
        while self._frames and self._fd >= 0:
            data, spans = self._frames[0]
            try:
                written = os.write(self._fd, data)
            except BlockingIOError:
                return
            except OSError:  # the child is gone
                self.dropped += self._pending
                self._frames.clear()
                self._pending = 0
                log.warning(
                    "span exporter process exited (code %s); spans are dropped",
                    self._child.poll(),
                )
                return
            if written < len(data):
                self._frames[0] = (data[written:], spans)
            else:
                self._frames.popleft()
                self._pending -= spans

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Hand the queued spans to the child as far as its pipe takes them now."""
        self._send()
        return not self._frames

    def shutdown(self) -> None:
        """Write the rest, let the child export it and exit (waits up to 30 s). Also runs at
        exit; later calls do nothing."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join()
        os.set_blocking(self._fd, True)
        self._send()
        if self._child.stdin is not None:
            self._child.stdin.close()
        self._fd = -1
        try:
            self._child.wait(30)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        if self.dropped:
            log.warning("%d spans were dropped", self.dropped)


# --------------------------------------------------------------------------- the child

# OTLP in protobuf's wire format (opentelemetry-proto: collector/trace/v1/trace_service.proto,
# trace/v1/trace.proto, common/v1/common.proto, resource/v1/resource.proto), written directly:
# each field is a key byte (field number << 3 | wire type), then a varint, 8 or 4
# little-endian bytes, or a varint length and that many bytes. The key bytes below name their
# message and field.
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
    scope. A span that cannot be encoded is left out (logged)."""
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
        scope = _field(b"\x0a", name.encode())
        if version:
            scope += _field(b"\x12", version.encode())
        scope_spans.append(_field(b"\x12", _field(b"\x0a", scope) + b"".join(encoded_spans)))
    # ExportTraceServiceRequest.resource_spans (1): ResourceSpans resource (1), scope_spans (2)
    return _field(b"\x0a", _field(b"\x0a", resource) + b"".join(scope_spans))


class EncodedSpans:
    """Spans encoded as one OTLP request by :func:`encode_request`, passed to an exporter
    that takes them (:func:`_takes_encoded`) where it expects a sequence of SDK spans."""

    __slots__ = ("_count", "request")

    def __init__(self, request: bytes, count: int) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.request = ExportTraceServiceRequest.FromString(request)  # C (upb): ~1 µs a span
        self._count = count

    def __len__(self) -> int:  # the exporters count what they export with len()
        return self._count


def _takes_encoded(exporter: SpanExporter) -> bool:
    """Let an SDK OTLP span exporter (gRPC or HTTP) take :class:`EncodedSpans`.

    Both build their request with the ``encode_spans`` their module imported from
    ``opentelemetry-exporter-otlp-proto-common``, then send it with their own channel or
    session, headers, compression and retries. In this process that name is rebound to a
    function that passes encoded requests through (and encodes SDK spans as before). False
    for other exporters, which get SDK spans."""
    module = sys.modules.get(type(exporter).__module__)
    sdk_encode = getattr(module, "encode_spans", None)
    if not type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.") or (
        not callable(sdk_encode)
    ):
        return False
    if getattr(sdk_encode, "__wrapped__", None) is None:

        def encode_spans(spans: Any) -> Any:
            return spans.request if isinstance(spans, EncodedSpans) else sdk_encode(spans)

        encode_spans.__wrapped__ = sdk_encode  # type: ignore[attr-defined]
        module.encode_spans = encode_spans  # type: ignore[union-attr]
    return True


def unpack_span(packed: PackedSpan, resource: Resource) -> ReadableSpan:
    """An SDK span, in ``resource``, from a :data:`PackedSpan` (for exporters other than
    OTLP's)."""
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


def _read_frames(stream: BinaryIO) -> Iterator[list[PackedSpan]]:
    """Frames until the stream ends; a frame cut short (the broker died writing it) ends it
    too."""
    while len(header := stream.read(_FRAME.size)) == _FRAME.size:
        (size,) = _FRAME.unpack(header)
        payload = stream.read(size)
        if len(payload) < size:
            log.warning("the broker went away in the middle of a frame")
            return
        yield [
            pickle.loads(s) if s[0] == _PICKLE_PROTO else marshal.loads(s)
            for s in pickle.loads(payload)
        ]


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
    """The child: export the spans of every frame on stdin until it closes."""
    from broker.tracing import named_exporter

    _yield_the_cpu()
    resource = Resource(resource_attributes)
    encoded_resource = encode_resource(resource.attributes)
    exporters = [named_exporter(n) for n in exporter_names.split(",") if n]  # '': record only
    otlp = [e for e in exporters if _takes_encoded(e)]
    others = [e for e in exporters if all(e is not o for o in otlp)]
    for batch in _read_frames(sys.stdin.buffer):
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
