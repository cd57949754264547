"""The broker's tracer: spans recorded as plain tuples, exported by a child process.

Measured in the broker process (2-core host, OpenTelemetry SDK 1.45): an SDK span costs
70-90 µs to start and end (attribute validation, sampler, span processor chain, a
``ReadableSpan`` copy), and its OTLP encoding 80-120 µs more, while planning a request costs
~170 µs and the whole ``GetTransferPlan`` call ~750 µs of broker CPU. So the broker records
spans itself: :class:`OffloadTracerProvider` hands out spans that keep their fields in slots
and, when they end, queue one tuple of plain values (a few µs in all). A daemon thread pickles
what has queued up (C code) and writes it to a child process (``python -m
broker.trace_export``, on idle CPU time only), which rebuilds SDK ``ReadableSpan`` objects
and hands them to the exporters ``OTEL_TRACES_EXPORTER`` names (OTLP gRPC/HTTP, console),
configured by the usual ``OTEL_*`` variables. Trace and span ids, W3C context and the sampler
(``OTEL_TRACES_SAMPLER``) are OpenTelemetry's; attribute values are checked in the child.

Frames on the child's stdin: a 4-byte little-endian length, then a pickled list of packed
spans. The child's command line carries the exporter names and the resource attributes.
"""

from __future__ import annotations

import atexit
import json
import logging
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
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)
_FRAME = struct.Struct("<I")
#: Spans per export call (OpenTelemetry's batch processor default).
EXPORT_BATCH = 512
#: Added to the exporter process's nice value where idle scheduling is not available.
NICENESS = 19

#: ``(trace_id, span_id, trace_flags, is_remote)`` of a span context.
PackedContext = tuple[int, int, int, bool]


def _pack_context(ctx: SpanContext) -> PackedContext:
    return (ctx.trace_id, ctx.span_id, int(ctx.trace_flags), ctx.is_remote)


def _unpack_context(packed: PackedContext) -> SpanContext:
    trace_id, span_id, flags, remote = packed
    return SpanContext(trace_id, span_id, remote, TraceFlags(flags))


class _Span(trace.Span):
    """A recording span that, when it ends, hands its fields to ``sink`` as one tuple
    (see :func:`unpack_span`). Not thread-safe (the broker's spans live on its loop)."""

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
        sink: Callable[[tuple], None],
    ) -> None:
        self._name, self._context, self._parent, self._kind = name, context, parent, kind
        self._start, self._end = start, 0
        self._attributes = attributes
        self._links = [(_pack_context(k.context), dict(k.attributes or {})) for k in links]
        self._events: list[tuple[str, int, dict[str, Any]]] = []
        self._status: tuple[int, str | None] = (StatusCode.UNSET.value, None)
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
        self._sink(
            (
                self._name,
                _pack_context(self._context),
                None if self._parent is None else _pack_context(self._parent),
                self._kind.value,
                self._start,
                self._end,
                self._attributes,
                self._links,
                self._events,
                *self._status,
                self._scope,
            )
        )


class _Tracer(trace.Tracer):
    def __init__(self, provider: OffloadTracerProvider, scope: tuple[str, str | None]) -> None:
        self._provider = provider
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
        parent = trace.get_current_span(context).get_span_context()
        trace_id = parent.trace_id if parent.is_valid else random.getrandbits(128) or 1
        sampled = self._provider.sampler.should_sample(
            context, trace_id, name, kind, attributes, links
        )
        flags = TraceFlags(TraceFlags.SAMPLED if sampled.decision.is_sampled() else 0)
        span_context = SpanContext(
            trace_id, random.getrandbits(64) or 1, False, flags, sampled.trace_state
        )
        if not sampled.decision.is_recording():
            return trace.NonRecordingSpan(span_context)
        return _Span(
            name,
            span_context,
            parent if parent.is_valid else None,
            kind,
            start_time or time.time_ns(),
            {**(attributes or {}), **(sampled.attributes or {})},
            links or (),
            self._scope,
            self._provider.sink,
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

    Ended spans queue up as tuples; every ``interval_s`` a daemon thread pickles them into one
    frame and writes what the pipe takes without blocking. Frames the child has not read yet
    wait as bytes (so a slow child costs no garbage-collector work), at most ``max_pending``
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
        self._queue: deque[tuple] = deque()
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

    def sink(self, packed: tuple) -> None:
        """Queue one ended span (the shipping thread takes it within ``interval_s``)."""
        self._queue.append(packed)

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


def unpack_span(packed: tuple, resource: Resource) -> ReadableSpan:
    """An SDK span, in ``resource``, from what :class:`_Span` queued."""
    name, ctx, parent, kind, start, end, attributes, links, events, code, text, scope = packed
    return ReadableSpan(
        name,
        _unpack_context(ctx),
        None if parent is None else _unpack_context(parent),
        resource,
        attributes,
        [Event(n, a, t) for n, t, a in events],
        [Link(_unpack_context(c), a) for c, a in links],
        SpanKind(kind),
        status=Status(StatusCode(code), text),
        start_time=start,
        end_time=end,
        instrumentation_scope=InstrumentationScope(*scope),
    )


def _read_frames(stream: BinaryIO) -> Iterator[list[tuple]]:
    """Frames until the stream ends; a frame cut short (the broker died writing it) ends it
    too."""
    while len(header := stream.read(_FRAME.size)) == _FRAME.size:
        (size,) = _FRAME.unpack(header)
        payload = stream.read(size)
        if len(payload) < size:
            log.warning("the broker went away in the middle of a frame")
            return
        yield pickle.loads(payload)


def _yield_the_cpu() -> None:
    """Run only on CPU time nothing else wants (Linux ``SCHED_IDLE``), else at the lowest
    nice priority: on a saturated host telemetry waits for serving, not the reverse (the
    broker's queue holds what waits; beyond it spans are dropped and counted)."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(NICENESS)


def main(exporter_names: str, resource_attributes: Mapping[str, Any]) -> int:
    """The child: export the spans of every frame on stdin until it closes."""
    from broker.tracing import named_exporter

    _yield_the_cpu()
    resource = Resource(resource_attributes)
    exporters = [named_exporter(n) for n in exporter_names.split(",") if n]  # '': record only
    for batch in _read_frames(sys.stdin.buffer):
        spans = [unpack_span(s, resource) for s in batch]
        for start in range(0, len(spans), EXPORT_BATCH):  # requests of bounded size
            for exporter in exporters:
                exporter.export(spans[start : start + EXPORT_BATCH])
    for exporter in exporters:
        exporter.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
