"""The broker's span tracer (``broker/span_tracer.py``) without its exporter child: the
sampler shortcut and what it hands on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    DEFAULT_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes
from span_samples import TRACEPARENT, tracer

from broker import span_tracer
from broker.span_pipe import PackedSpan
from broker.tracing import context_from_traceparent


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


@pytest.mark.parametrize("flags", ["01", "00"])
@pytest.mark.parametrize("parent", ["none", "remote", "local"])
def test_the_default_samplers_shortcut_decides_as_the_sampler(parent: str, flags: str) -> None:
    """``parentbased_always_on`` is decided without calling it, as calling it would."""
    spans: dict[str, list[PackedSpan]] = {"short": [], "called": []}
    made, recording = {}, {}
    for way, sampler in (("short", ParentBased(ALWAYS_ON)), ("called", Delegating(DEFAULT_ON))):
        assert span_tracer._follows_parent(sampler) == (way == "short")
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
