"""When the broker's cyclic garbage collector runs (:class:`CollectorPolicy`), so that a
collection pauses the event loop for a few milliseconds whatever the cluster's size, but
for one collection of the whole heap each time the heap doubles.

A collection of a generation walks every object in it and in the younger ones. Two kinds of
objects fill a broker's heap: its long-lived records (a registered rank holds some eighty
tracked objects: its registration, layout, regions, their tuples), which only grow the
older generations, and the reference cycles gRPC leaves behind every call (five objects
each), which only the collector frees. Young collections come every
:data:`YOUNG_THRESHOLD` allocations; the objects that survive them are frozen
(:func:`gc.freeze`) at the first quiet point after each young collection — the reaper's
tick, between calls — right after a collection of what is not frozen yet (little: the
survivors of one young collection), so no later collection walks them again. (Counting
the survivors with :func:`gc.get_objects` instead is unsafe: the list it returns holds
objects other threads are still building, a tuple being resized among them.) Objects frozen are still freed by reference counting;
only frozen objects that later die in a cycle stay. To bound those, every object is
thawed and the whole heap collected once the frozen heap (the imports' included) has
doubled since that was last done, or since the start: frozen cyclic garbage stays under
what survived the last such collection (twice that if the heap shrank since); each such
collection walks the whole heap (40-75 ms among 2,048 ranks) only after as many objects
were frozen as the previous one left, so its cost per object frozen is constant (at most
one while a cluster grows to 2,048 ranks), and at most once per :data:`THAW_INTERVAL_S`:
a broker whose heap grows fast (the in-memory store's transfers under load) would
otherwise pause for it every second or two. Frozen cyclic garbage then also stays under
what a broker freezes in that interval."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

#: Net allocations of tracked objects between young collections (CPython's default is 700):
#: far fewer would catch a call's own short-lived objects, which reference counting frees
#: anyway; 10,000 doubled the p99 of batched plan calls under load (more collections inside
#: calls) against this.
YOUNG_THRESHOLD = 50_000
#: Least time between two whole-heap collections (seconds).
THAW_INTERVAL_S = 60.0


class CollectorPolicy:
    """The collector's thresholds (:meth:`start`) and freezes at quiet points (:meth:`tick`);
    see the module docstring. Process-wide: one per process."""

    def __init__(
        self,
        young: int = YOUNG_THRESHOLD,
        thaw_interval_s: float = THAW_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.young = young
        self.thaw_interval_s = thaw_interval_s
        self._clock = clock
        self._thawed_at = clock()
        #: Whole-heap collections made by :meth:`tick`.
        self.thaws = 0
        self._thawed = 0  # objects frozen after the last whole-heap collection
        self._young_collections = -1

    def start(self) -> None:
        """Freeze what the imports left (after collecting its garbage) and set thresholds."""
        gc.collect()
        gc.freeze()
        self._thawed, self._thawed_at = gc.get_freeze_count(), self._clock()
        gc.set_threshold(self.young, 20, 100)

    def tick(self) -> None:
        """At a quiet point: freeze the survivors of the young collections since the last
        tick, or thaw and collect everything (see the module docstring)."""
        collections = gc.get_stats()[0]["collections"]
        if collections == self._young_collections:
            return  # no young collection since: the older generations did not grow
        self._young_collections = collections
        now = self._clock()
        thaw = (
            gc.get_freeze_count() >= 2 * self._thawed
            and now - self._thawed_at >= self.thaw_interval_s
        )
        if thaw:
            gc.unfreeze()
        full = gc.get_stats()[2]["collections"]
        gc.collect()
        if gc.get_stats()[2]["collections"] == full:
            return  # another thread is collecting (and finalizing): freeze no garbage now
        gc.freeze()
        if thaw:
            self._thawed, self._thawed_at = gc.get_freeze_count(), now
            self.thaws += 1
