"""The broker's span tracer: spans recorded as plain tuples, exported by a child process.

An SDK span costs the broker more to start and end (attribute validation, sampler, span
processor chain, a ``ReadableSpan`` copy) and to encode for OTLP than planning a request
does (``docs/BENCHMARKS.md``). So the broker records spans itself:
:class:`OffloadTracerProvider` hands out spans that keep their fields in slots and, when they
end, hand one flat tuple of plain values (:data:`~broker.span_pipe.PackedSpan`) to a
:class:`~broker.span_pipe.SpanPipe`, which serializes it at once and ships it to an exporter
child (:mod:`broker.span_exporter`) that encodes and exports on idle CPU time. Under the
default sampler (``parentbased_always_on``) the tracer takes the parent's decision itself
rather than calling the sampler. Trace and span ids, W3C context and the sampler
(``OTEL_TRACES_SAMPLER``) are OpenTelemetry's.

:func:`install_broker_tracing` is the broker process's counterpart of
:func:`broker.tracing.configure_tracing`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, ParentBased, Sampler
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes

from broker import tracing
from broker.span_pipe import PackedEvent, PackedLink, PackedSpan, SpanPipe

if TYPE_CHECKING:  # the type of what trace.use_span returns
    from opentelemetry.util._decorator import _AgnosticContextManager

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = (StatusCode.UNSET.value, None)


def _follows_parent(sampler: Sampler) -> bool:
    """Whether ``sampler`` decides as OpenTelemetry's default, ``parentbased_always_on``
    (samples what its parent sampled, and every root): then the tracer decides without it.
    False for any other sampler, which the tracer then calls."""
    return sampler is DEFAULT_ON or (
        type(sampler) is ParentBased and vars(sampler) == vars(DEFAULT_ON)
    )


def _discard(packed: PackedSpan) -> None:
    """Where spans recorded but not sampled end (as the SDK's span processors, the exporter
    skips them)."""


def _pack_links(links: Sequence[Link]) -> list[PackedLink]:
    return [
        (k.context.trace_id, k.context.span_id, k.context.is_remote, dict(k.attributes or {}))
        for k in links
    ]


class _Span(trace.Span):
    """A recording span that, when it ends, hands its fields to ``sink`` as one
    :data:`~broker.span_pipe.PackedSpan`. Not thread-safe (the broker's spans live on its
    loop)."""

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
        self._events: list[PackedEvent] = []
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
        current = trace.get_current_span(context).get_span_context()
        parent = current if current.is_valid else None
        span_id = random.getrandbits(64) or 1
        sink = self._sink
        span_attributes: dict[str, Any]
        if self._follows_parent:  # the default sampler's decision, without calling it
            if parent is None:
                span_context = SpanContext(random.getrandbits(128) or 1, span_id, False, _SAMPLED)
            elif parent.trace_flags.sampled:
                span_context = SpanContext(
                    parent.trace_id, span_id, False, _SAMPLED, parent.trace_state
                )
            else:
                return trace.NonRecordingSpan(
                    SpanContext(parent.trace_id, span_id, False, _NOT_SAMPLED, parent.trace_state)
                )
            span_attributes = dict(attributes) if attributes else {}
        else:
            trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
            sampled = self._sampler.should_sample(context, trace_id, name, kind, attributes, links)
            flags = _SAMPLED if sampled.decision.is_sampled() else _NOT_SAMPLED
            span_context = SpanContext(trace_id, span_id, False, flags, sampled.trace_state)
            if not sampled.decision.is_recording():
                return trace.NonRecordingSpan(span_context)
            if not flags.sampled:
                sink = _discard
            span_attributes = dict(attributes or {})
            if sampled.attributes:
                span_attributes.update(sampled.attributes)
        return _Span(
            name,
            span_context,
            parent,
            kind,
            start_time or time.time_ns(),
            span_attributes,
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
    ) -> _AgnosticContextManager[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        return trace.use_span(span, end_on_exit, record_exception, set_status_on_exception)


class OffloadTracerProvider(trace.TracerProvider):
    """Tracers whose spans a ``python -m broker.span_exporter`` child exports with the
    exporters ``exporter_names`` (comma-separated, see :data:`broker.tracing.EXPORTERS`), in
    ``resource``, sampled by ``sampler``.

    Ended spans go to a :class:`~broker.span_pipe.SpanPipe` (``interval_s``,
    ``max_pending``: see there); those it had to drop are counted in :attr:`dropped`.
    :meth:`shutdown` writes the rest and waits for the child to export it and exit (it also
    runs at exit).
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
        self.pipe = SpanPipe(exporter_names, resource.attributes, interval_s, max_pending)
        #: Where an ended, sampled span goes (:meth:`SpanPipe.put`).
        self.sink: Callable[[PackedSpan], None] = self.pipe.put

    @property
    def dropped(self) -> int:
        """Spans dropped so far: the child fell ``max_pending`` spans behind, or exited."""
        return self.pipe.dropped

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> trace.Tracer:
        return _Tracer(self, (instrumenting_module_name, instrumenting_library_version))

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Hand the queued spans to the child as far as its pipe takes them now."""
        return self.pipe.flush()

    def shutdown(self) -> None:
        """Write the rest, let the child export it and exit (waits up to 30 s). Later calls
        do nothing."""
        self.pipe.close()


def install_broker_tracing(service_name: str) -> OffloadTracerProvider | None:
    """Install an :class:`OffloadTracerProvider` for the broker process when
    ``OTEL_TRACES_EXPORTER`` or an OTLP endpoint asks for traces, as
    :func:`broker.tracing.configure_tracing` installs an SDK one for other processes:
    exporters from ``OTEL_TRACES_EXPORTER`` (default ``otlp``), ``service_name`` as the
    resource's ``service.name`` with the rest of ``OTEL_RESOURCE_ATTRIBUTES``, the sampler
    from ``OTEL_TRACES_SAMPLER``. Returns the provider (``shutdown()`` flushes), or None when
    tracing stays off or a provider is installed already."""
    from opentelemetry.sdk.trace import TracerProvider

    if tracing.enabled() or not tracing.tracing_requested():
        return None
    names = tracing.exporter_names(None)
    # An SDK provider reads OTEL_TRACES_SAMPLER; the offloading one uses its sampler.
    sampler = TracerProvider(shutdown_on_exit=False).sampler
    resource = Resource.create({SERVICE_NAME: service_name})
    provider = OffloadTracerProvider(resource, ",".join(names), sampler)
    trace.set_tracer_provider(provider)
    return provider
