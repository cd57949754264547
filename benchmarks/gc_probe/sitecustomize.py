"""Times every garbage collection of a ``pdbroker serve`` process: with this folder on
``PYTHONPATH`` and ``PDBROKER_GC_PROBE_DIR`` set, each broker process the command starts
writes ``<pid>.json`` there when it exits (seconds since start, generation, ms, objects
collected); ``benchmarks/gc_pauses.py DIR`` summarises them. On ``SIGUSR1`` it writes
``<pid>-garbage-<n>.json``: what a full collection frees then, counted by type
(``benchmarks/gc_garbage.py`` asks for it around a number of calls). With
``PDBROKER_GC_PROBE_TYPES=1`` it also counts, by type, what each collection of the middle
or oldest generation walks (``walked``; release events delivered apart from the others).
With ``PDBROKER_STALL_PROBE_MS=N`` it breaks down each event loop stall longer than N ms the
broker's own probe measures (``stalls``): over the probe's interval, the loop thread's time
running and waiting for a CPU, the other threads' time running and the collector's (Linux
``/proc/self/task/*/schedstat``).

    PDBROKER_GC_PROBE_DIR=/tmp/gc PYTHONPATH=.:benchmarks/gc_probe \\
        .venv/bin/python -m broker.cli bench scale --engines 256 --held 100 --tp 8 \\
        --samples 100 --lease-ttl-ms 20000
    .venv/bin/python benchmarks/gc_pauses.py /tmp/gc
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

_DIR = os.environ.get("PDBROKER_GC_PROBE_DIR")

if _DIR and "serve" in sys.argv:
    _started = time.monotonic()
    _records: list[tuple[float, int, float, int]] = []
    _collection_start = [0.0]
    #: With PDBROKER_GC_PROBE_TYPES set, what each collection of an older generation walks,
    #: counted by type before it starts (the count itself is not timed).
    _walked: list[tuple[float, int, int, list[tuple[str, int]]]] = []
    _census_types = bool(os.environ.get("PDBROKER_GC_PROBE_TYPES"))

    def _kind(o: object) -> str:
        """``o``'s type name; release events delivered (the in-memory store keeps them with
        their block ids packed into ``bytes``) apart from those not yet delivered."""
        name = type(o).__qualname__
        if name == "ReleaseEvent":
            groups = o.block_ids  # type: ignore[attr-defined]
            return f"{name} ({'delivered' if groups and type(groups[0]) is bytes else 'not yet'})"
        return name

    def _timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            generation = info["generation"]
            if _census_types and generation >= 1:
                walked = [o for g in range(generation + 1) for o in gc.get_objects(g)]
                kinds = Counter(map(_kind, walked))
                since = round(time.monotonic() - _started, 3)
                _walked.append((since, generation, len(walked), kinds.most_common(8)))
                del walked
            _collection_start[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - _collection_start[0]) * 1e3
        since = time.monotonic() - _started
        _records.append((round(since, 3), info["generation"], round(ms, 2), info["collected"]))
        _collecting_ms[0] += ms

    def _write() -> None:
        path = Path(_DIR) / f"{os.getpid()}.json"
        path.write_text(
            json.dumps(
                {"argv": sys.argv, "collections": _records, "walked": _walked, "stalls": _stalls}
            )
        )

    def _census(signum: int, frame: object) -> None:
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what a collection would free, to count it
        gc.collect()
        found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        done = len(list(Path(_DIR).glob(f"{os.getpid()}-garbage-*.json")))
        path = Path(_DIR) / f"{os.getpid()}-garbage-{done}.json"
        path.write_text(json.dumps(found.most_common()))

    #: (seconds since start, stall ms, then over the probe's interval: the loop thread's ms
    #: running, its ms waiting for a CPU, the other threads' ms running, ms collecting).
    _stalls: list[tuple[float, float, float, float, float, float]] = []
    _collecting_ms = [0.0]
    _stall_ms = float(os.environ.get("PDBROKER_STALL_PROBE_MS") or 0)

    def _threads() -> dict[int, tuple[int, int]]:
        """Each thread's nanoseconds running and waiting for a CPU."""
        times = {}
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    run, wait = f.read().split()[:2]
            except OSError:  # a thread that just ended
                continue
            times[int(task)] = (int(run), int(wait))
        return times

    def _probe_stalls() -> None:
        """Wrap the broker's stall probe: it calls ``loop_stalled`` on the loop's thread
        once every interval, so the times between two calls are the interval's."""
        from broker import metrics

        stalled = metrics.BrokerMetrics.loop_stalled
        last: list[tuple[dict[int, tuple[int, int]], float]] = []

        def loop_stalled(self: object, seconds: float) -> None:
            now, collected = _threads(), _collecting_ms[0]
            if last and seconds * 1e3 > _stall_ms:
                before, collected_before = last[0]
                loop = threading.get_native_id()
                ran, waited = (now[loop][i] - before.get(loop, (0, 0))[i] for i in (0, 1))
                others = sum(
                    t[0] - before.get(tid, (0, 0))[0] for tid, t in now.items() if tid != loop
                )
                since = round(time.monotonic() - _started, 3)
                _stalls.append(
                    (since, round(seconds * 1e3, 2), round(ran / 1e6, 2), round(waited / 1e6, 2),
                     round(others / 1e6, 2), round(collected - collected_before, 2))
                )  # fmt: skip
            last[:] = [(now, collected)]
            stalled(self, seconds)

        metrics.BrokerMetrics.loop_stalled = loop_stalled  # type: ignore[method-assign]

    if _stall_ms:
        _probe_stalls()

    gc.callbacks.append(_timed)
    atexit.register(_write)
    signal.signal(signal.SIGUSR1, _census)
