"""OpenTelemetry tracing: one trace per transfer id, across prefill, broker and decode.

Context crosses processes as W3C trace context: in gRPC metadata on every call
(:func:`grpc_metadata` / :func:`context_from_metadata`), and as a stored ``traceparent`` string
where a later, unrelated RPC chain must join the trace: the broker keeps the publisher's
``traceparent`` with the transfer and hands one of the transfer's trace to decode ranks (with
their plans) and to prefill ranks (with their releases). ``tracestate`` travels in metadata
only, not in stored strings.

Spans are made through the global OpenTelemetry API, so a host application that installed
its own SDK tracer provider (vLLM) records pdbroker's spans too. :func:`configure_tracing`
installs one for pdbroker's own engine processes when ``OTEL_TRACES_EXPORTER`` or
``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT`` asks for it (or a caller passes an exporter); the
broker installs its own lean tracer (``broker.span_tracer``), which this module does not
import. Without a provider tracing is off: every helper here returns at its first check and
no span object is made.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

if TYPE_CHECKING:  # the SDK is imported only to configure tracing
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

T = TypeVar("T")
TRACER_NAME = "pdbroker"
#: Exporter names ``OTEL_TRACES_EXPORTER`` may list (comma-separated).
EXPORTERS = ("otlp", "console", "none")
_PROPAGATOR = TraceContextTextMapPropagator()
_CARRIER_KEYS = ("traceparent", "tracestate")
_NO_PROVIDERS = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
_TRACER = trace.get_tracer(TRACER_NAME)  # a proxy: follows whichever provider is installed
_NO_SPAN: AbstractContextManager[None] = nullcontext()
#: The gRPC service of pdbroker's RPCs (``rpc.service``).
RPC_SERVICE = "pdbroker.v1.Broker"
#: The attribute of an RPC span that holds the call's gRPC status code (an int).
_STATUS_CODE = "rpc.grpc.status_code"
#: Context key of the client span of a call in flight: (its method, the span).
_CLIENT_CALL = otel_context.create_key("pdbroker-client-call")


def enabled() -> bool:
    """Whether spans are recorded: a real tracer provider is installed (pdbroker's or the
    host application's)."""
    return not isinstance(trace.get_tracer_provider(), _NO_PROVIDERS)


def tracing_requested() -> bool:
    """Whether the standard ``OTEL_*`` environment asks for traces."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return any(
        os.environ.get(k)
        for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def exporter_names(names: str | None) -> list[str]:
    """The exporters ``names`` lists (comma-separated, from :data:`EXPORTERS`), or
    ``OTEL_TRACES_EXPORTER`` for None (default ``otlp``); without ``none``. Raises ValueError
    for a name not in :data:`EXPORTERS`."""
    raw = names if names is not None else os.environ.get("OTEL_TRACES_EXPORTER", "otlp")
    listed = [n for n in (x.strip().lower() for x in raw.split(",")) if n not in ("", "none")]
    for name in listed:
        if name not in EXPORTERS:
            raise ValueError(f"trace exporter {name!r} is not one of {EXPORTERS}")
    return listed


def named_exporter(name: str) -> SpanExporter:
    """The exporter ``OTEL_TRACES_EXPORTER`` calls ``name``, configured by ``OTEL_*``."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"trace exporter {name!r} is not one of {EXPORTERS}")
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    # endpoint, headers, timeout from OTEL_EXPORTER_OTLP_* variables
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        return HTTPSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def configure_tracing(
    service_name: str, exporter: SpanExporter | str | None = None
) -> TracerProvider | None:
    """Install a recording SDK tracer provider for this process, or leave tracing off.

    ``exporter``: a span exporter (exported synchronously, for tests), names from
    :data:`EXPORTERS` (comma-separated; batched), or None to follow ``OTEL_TRACES_EXPORTER``
    (default ``otlp`` when an OTLP endpoint is set). ``service_name`` becomes the resource's
    ``service.name``; other ``OTEL_RESOURCE_ATTRIBUTES`` and the sampler
    (``OTEL_TRACES_SAMPLER``) come from the environment. Returns the provider (``shutdown()``
    flushes; it also flushes at exit), or None when tracing stays off or the host
    application already installed one. (The broker process installs its own tracer
    instead: ``broker.span_tracer.install_broker_tracing``.)
    """
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if enabled() or (exporter is None and not tracing_requested()):
        return None
    resource = Resource.create({SERVICE_NAME: service_name})
    if exporter is not None and not isinstance(exporter, str):
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        names = exporter_names(exporter)
        provider = TracerProvider(resource=resource)
        for name in names:
            provider.add_span_processor(BatchSpanProcessor(named_exporter(name)))
    trace.set_tracer_provider(provider)
    return provider


# --------------------------------------------------------------------------- carriers


def context_from_traceparent(traceparent: str) -> Context:
    """A context whose (remote) parent is ``traceparent``; empty for '' or a malformed value."""
    return _PROPAGATOR.extract({"traceparent": traceparent} if traceparent else {})


def trace_id_of(traceparent: str) -> str:
    """The 32 hex digits of a ``traceparent``'s trace id; '' for ''."""
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 else ""


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata for an outgoing call, so the server joins the current trace (empty when
    tracing is off or no span is current)."""
    if not enabled():
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def traceparent_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The ``traceparent`` a caller sent in gRPC metadata, validated; '' when none."""
    return _traceparent_of(context_from_metadata(metadata))


def context_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The trace context a caller sent in gRPC metadata; None when it sent none."""
    carrier: Mapping[str, Any] = {k: v for k, v in (metadata or ()) if k in _CARRIER_KEYS}
    return _PROPAGATOR.extract(carrier) if "traceparent" in carrier else None


def _traceparent_of(ctx: Context | None) -> str:
    if ctx is None:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def call_in_context(
    metadata: Iterable[tuple[str, Any]] | None, function: Callable[..., T], *args: Any
) -> T:
    """``function(*args)`` inside the trace context a caller sent in gRPC ``metadata``
    (directly when it sent none)."""
    ctx = context_from_metadata(metadata)
    if ctx is None:
        return function(*args)
    token = otel_context.attach(ctx)
    try:
        return function(*args)
    finally:
        otel_context.detach(token)


@contextmanager
def attached(ctx: Context) -> Iterator[None]:
    """Make ``ctx`` current for the block."""
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


# --------------------------------------------------------------------------- spans


#: A stored ``traceparent`` as pdbroker keeps them (version 00, lower-case hex): parsed here,
#: at a third of the propagator's cost (a plan's span parses one when the cache missed;
#: ``docs/BENCHMARKS.md``); other forms go through the propagator.
_STORED_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
#: Parsed stored traceparents, as a context and its span's context (a transfer's is used by
#: several spans); cleared when full.
_PARSED: dict[str, tuple[Context, SpanContext]] = {}
_PARSED_MAX = 4096


def _parse_stored(traceparent: str) -> tuple[Context, SpanContext]:
    """What :func:`context_from_traceparent` makes of ``traceparent``, and its span context."""
    match = _STORED_TRACEPARENT.fullmatch(traceparent)
    if match is None:
        ctx = context_from_traceparent(traceparent)
        return ctx, trace.get_current_span(ctx).get_span_context()
    trace_id, span_id, flags = int(match[1], 16), int(match[2], 16), int(match[3], 16)
    span_context = SpanContext(trace_id, span_id, True, TraceFlags(flags))
    if not span_context.is_valid:  # all-zero ids: the propagator extracts nothing
        return Context(), trace.INVALID_SPAN_CONTEXT
    return trace.set_span_in_context(NonRecordingSpan(span_context)), span_context


def _stored_context(traceparent: str) -> tuple[Context, SpanContext]:
    parsed = _PARSED.get(traceparent)
    if parsed is None:
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        parsed = _PARSED[traceparent] = _parse_stored(traceparent)
    return parsed


def _parent(traceparent: str) -> tuple[Context | None, list[Link] | None]:
    """Parent context and links of a span that must lie in the trace of ``traceparent``.

    The current span is the parent when it already lies in that trace (a call chain that
    carried the context); otherwise ``traceparent`` is, and the current span (another
    trace: the caller's own request, a lease renewal) is linked. Without ``traceparent`` the
    current context is the parent.
    """
    if not traceparent:
        return None, None
    stored, stored_span = _stored_context(traceparent)
    if not stored_span.is_valid:
        return None, None
    current = trace.get_current_span().get_span_context()
    if not current.is_valid:
        return stored, None
    if current.trace_id == stored_span.trace_id:
        return None, None
    return stored, [Link(current)]


@cache
def rpc_attributes(method: str) -> Mapping[str, str]:
    """The ``rpc.*`` attributes of a span of a call of ``method`` (one mapping per method:
    copy it to change it)."""
    return {"rpc.system": "grpc", "rpc.service": RPC_SERVICE, "rpc.method": method}


class ServedCall:
    """A call this process serves while it traces (:func:`serving`). The spans its handler
    opens at the edge of the process (no parent, or the caller's context or a stored
    ``traceparent`` as parent; not those descending from one of this process's spans) are
    its SERVER spans, with its ``rpc.*`` attributes; they end when the call does
    (:meth:`end`), carrying its status code."""

    __slots__ = ("attributes", "spans")

    def __init__(self, method: str) -> None:
        self.attributes = rpc_attributes(method)
        self.spans: list[Span] = []

    def end(self, code: int) -> None:
        """The call ended with gRPC status ``code``: end its spans."""
        _SERVED.set(None)
        for span in self.spans:
            span.set_attribute(_STATUS_CODE, code)
            span.end()


_SERVED: ContextVar[ServedCall | None] = ContextVar("pdbroker_served_call", default=None)


def serving(method: str) -> ServedCall:
    """Start serving a call of ``method`` in the current context (a server handler's task);
    end it with :meth:`ServedCall.end`."""
    served = ServedCall(method)
    _SERVED.set(served)
    return served


def _at_edge(parent: Context | None) -> bool:
    """Whether a span with parent context ``parent`` (None: the current one) has no parent
    span in this process."""
    if parent is not None:
        return True
    current = trace.get_current_span().get_span_context()
    return not current.is_valid or current.is_remote


def client_call_ended(method: str, code: int) -> None:
    """A call of ``method`` ended with gRPC status ``code``: recorded on the client span
    around it (:func:`span` with ``rpc=method``), if any."""
    call = cast("tuple[str, Span] | None", otel_context.get_value(_CLIENT_CALL))
    if call is not None and call[0] == method:
        call[1].set_attribute(_STATUS_CODE, code)


class _Current:
    """Makes a started span current for a ``with`` block and ends it after; an exception
    leaving the block is recorded and sets status ERROR. (``start_as_current_span`` without
    its layers of generator context managers: the broker makes spans on its hot path.)
    A client span (``call``: its method) is found by :func:`client_call_ended`; a server
    span (``served``) ends with its call."""

    __slots__ = ("_call", "_served", "_span", "_token")

    def __init__(self, span: Span, call: str = "", served: ServedCall | None = None) -> None:
        self._span, self._call, self._served = span, call, served

    def __enter__(self) -> Span:
        ctx = trace.set_span_in_context(self._span)
        if self._call:
            ctx = otel_context.set_value(_CLIENT_CALL, (self._call, self._span), ctx)
        self._token = otel_context.attach(ctx)
        return self._span

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        otel_context.detach(self._token)
        if exc is not None:
            self._span.record_exception(exc)
            set_error(self._span, f"{type(exc).__name__}: {exc}")
        if self._served is not None:
            self._served.spans.append(self._span)
        else:
            self._span.end()


def _kind_of(rpc: str, attributes: Attributes) -> tuple[SpanKind, Attributes]:
    """Kind and attributes of a span, a client span of method ``rpc`` unless it is ''."""
    if not rpc:
        return SpanKind.INTERNAL, attributes
    return SpanKind.CLIENT, {**(attributes or {}), **rpc_attributes(rpc)}


def span(
    name: str, traceparent: str = "", attributes: Attributes = None, rpc: str = ""
) -> AbstractContextManager[Span | None]:
    """A span made current for a ``with`` block, in the trace of ``traceparent`` (see
    :func:`_parent`); yields None when tracing is off. An exception leaving the block is
    recorded and sets the span's status to ERROR. ``rpc``: the broker method the block calls
    (a CLIENT span). In a call this process serves, a span at the edge of the process is a
    SERVER span of that call (:class:`ServedCall`)."""
    if not enabled():
        return _NO_SPAN
    parent, links = _parent(traceparent)
    served = _SERVED.get()
    if served is not None and not rpc and _at_edge(parent):
        merged = {**(attributes or {}), **served.attributes}
        started = _TRACER.start_span(name, parent, SpanKind.SERVER, merged, links)
        return _Current(started, served=served)
    kind, attributes = _kind_of(rpc, attributes)
    return _Current(_TRACER.start_span(name, parent, kind, attributes, links), rpc)


def root_span(
    name: str, attributes: Attributes = None, rpc: str = ""
) -> AbstractContextManager[Span | None]:
    """Like :func:`span`, but the first span of a new trace (a transfer's trace starts at its
    publication); the current span, if any, is linked."""
    if not enabled():
        return _NO_SPAN
    current = trace.get_current_span().get_span_context()
    links = [Link(current)] if current.is_valid else None
    kind, attributes = _kind_of(rpc, attributes)
    return _Current(_TRACER.start_span(name, Context(), kind, attributes, links), rpc)


def start_span(
    name: str, traceparent: str = "", attributes: Attributes = None, rpc: str = ""
) -> Span | None:
    """Like :func:`span` for spans that overlap (concurrent reads, the entries of a batched
    call): not made current; end it with :func:`end_span` (a client span of ``rpc`` after
    :func:`set_rpc_status`). None when tracing is off."""
    if not enabled():
        return None
    parent, links = _parent(traceparent)
    kind, attributes = _kind_of(rpc, attributes)
    return _TRACER.start_span(name, parent, kind=kind, links=links, attributes=attributes)


def set_rpc_status(span: Span | None, code: int) -> None:
    """Record the gRPC status ``code`` a client span's call (or its entry) ended with."""
    if span is not None:
        span.set_attribute(_STATUS_CODE, code)


def end_span(span: Span | None, error: str = "") -> None:
    """End a span from :func:`start_span`; a non-empty ``error`` sets status ERROR."""
    if span is None:
        return
    if error:
        set_error(span, error)
    span.end()


def set_error(span: Span | None, error: str) -> None:
    """Set ``span``'s status to ERROR, described by ``error`` (nothing for None)."""
    if span is not None:
        span.set_status(Status(StatusCode.ERROR, error))


def span_traceparent(span: Span | None) -> str:
    """W3C ``traceparent`` naming ``span`` as the parent; '' for None or an invalid span."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
