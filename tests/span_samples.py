"""Spans for the tests of the broker's tracer, its pipe, its OTLP encoder and its exporter
child: packed by the tracer itself, with every field the encoder writes."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Sampler
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from broker import span_tracer
from broker.span_pipe import PackedSpan
from broker.tracing import context_from_traceparent

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
RESOURCE = Resource({"service.name": "unit", "host.cores": 2})


class Color(enum.IntEnum):
    RED = 1


def tracer(
    sampler: Sampler, sink: Any, scope: tuple[str, str | None] = ("pdbroker", None)
) -> span_tracer._Tracer:
    """A tracer of the broker's, sampling with ``sampler``, whose ended spans go to ``sink``."""
    provider = SimpleNamespace(sampler=sampler, sink=sink)
    return span_tracer._Tracer(provider, scope)  # type: ignore[arg-type]


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
