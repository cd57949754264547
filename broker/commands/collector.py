"""The collector policy of a broker process (``pdbroker serve``)."""

from __future__ import annotations

import gc

#: Net allocations between young-generation collections (CPython's default is 700). A
#: young collection walks about this many objects (mostly the reference cycles grpc.aio's
#: server leaves behind every call), so this bounds its pause (docs/BENCHMARKS.md §13).
GC_YOUNG_THRESHOLD = 5_000
#: Young collections between collections of the middle generation (CPython's default is 10).
#: A middle collection walks what the young ones kept since the last, so this trades its
#: pause against how often one lands in a call: at 2,048 ranks 5 held the longest to 5–8 ms
#: where 20 let it reach 14–23 ms, but batched plans' p99 rose from 4.9–5.2 to 7.6–8.7 ms
#: (docs/BENCHMARKS.md §13).
GC_MIDDLE_THRESHOLD = 20


def tune_collector() -> None:
    """The broker's collector policy, for tail latency: the heap so far (the imports) kept
    out of full collections, which then walk only the broker's own records; the young
    generation collected every :data:`GC_YOUNG_THRESHOLD` net allocations, not 700 (a plan's
    short-lived objects do not count; longer pauses would hold every call they land in), the
    middle one every :data:`GC_MIDDLE_THRESHOLD` young collections."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, GC_MIDDLE_THRESHOLD, 100)
