"""The pipe from the broker's tracer to its exporter child (``broker/span_pipe.py``): what
one end writes, the other reads back."""

from __future__ import annotations

import io
import pickle
import struct
from types import SimpleNamespace

from span_samples import Color, varied_spans

from broker.span_pipe import SpanPipe, read_frames


def test_spans_cross_the_pipe_marshalled_or_pickled() -> None:
    """What :meth:`SpanPipe.put` queues reads back as the packed spans, also with a value
    marshal does not take (then pickled)."""
    spans = varied_spans()
    spans = [s for s in spans if "not_a_value" not in s[8]]  # object() pickles by reference
    spans.append(spans[0][:8] + ({"enum": Color.RED},) + spans[0][9:])
    queue: list[bytes] = []
    fake = SimpleNamespace(_queue=queue)
    for s in spans:
        SpanPipe.put(fake, s)  # type: ignore[arg-type]
    assert queue[-1][0] == pickle.PROTO[0] and queue[0][0] != pickle.PROTO[0]
    payload = pickle.dumps(queue, pickle.HIGHEST_PROTOCOL)
    stream = io.BytesIO(struct.pack("<I", len(payload)) + payload)
    (frame,) = read_frames(stream)
    assert frame == spans
    assert type(frame[-1][8]["enum"]) is Color
