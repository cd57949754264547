"""The collector policy of a broker process (``pdbroker serve``)."""

from __future__ import annotations

import gc

#: Net allocations between young-generation collections (CPython's default is 700). A
#: young collection walks about this many objects (mostly the reference cycles grpc.aio's
#: server leaves behind every call), so this bounds its pause (docs/BENCHMARKS.md §13).
GC_YOUNG_THRESHOLD = 5_000


def tune_collector() -> None:
    """The broker's collector policy, for tail latency: the heap so far (the imports) kept
    out of full collections, which then walk only the broker's own records; the young
    generation collected every :data:`GC_YOUNG_THRESHOLD` net allocations, not 700 (a plan's
    short-lived objects do not count; longer pauses would hold every call they land in)."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 100)
