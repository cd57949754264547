"""The client-safe tracing facade (``broker/tracing.py``): stored ``traceparent`` strings
and exporter names."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from broker import tracing
from broker.tracing import context_from_traceparent

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


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


def test_exporter_names_follow_the_environment_and_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracing.exporter_names(None) == ["otlp"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", " OTLP, console ,none,")
    assert tracing.exporter_names(None) == ["otlp", "console"]
    assert tracing.exporter_names("none") == []
    with pytest.raises(ValueError, match="'zipkin' is not one of"):
        tracing.exporter_names("otlp,zipkin")
