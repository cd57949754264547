"""How long one reaper pass holds the broker's event loop when many transfers fall due at
once (an engine's transfers left unread past their TTL): ``--transfers`` published by one
prefill engine, the clock moved past their deadline, then reaper passes (``reap()``, as the
broker's reaper task runs them) until none is left, in memory and on a private
``redis-server``, under ``pdbroker serve``'s collector policy. Printed per store: the
longest pass (wall ms, the loop held that long) and the garbage collection inside it, the
longest pass less its collections (the reaper's own hold), the passes, the total, the
transfers expired.

    .venv/bin/python benchmarks/due_burst.py --transfers 20000
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.commands.collector import tune_collector
from broker.presets import resolve_model
from broker.store.contract import StateStore
from broker.store.memory import InMemoryStateStore
from broker.wire import TransferState
from harness.bench_engines import published_service
from harness.redis_server import start_redis
from harness.scenarios import build_scenario

TTL_MS = 1_000


class SteppedClock:
    """Milliseconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def now_ms(self) -> int:
        return self.now


class CollectorClock:
    """Seconds the garbage collector ran since it was made (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds, self._started = 0.0, 0.0
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def close(self) -> None:
        gc.callbacks.remove(self._timed)


def burst(store: StateStore, transfers: int) -> dict[str, float]:
    """The longest pass and the collection in it (ms), the longest pass less its
    collections (ms), passes, total (ms) and transfers expired."""
    sc = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 1, 1, 4096)
    clock = SteppedClock()
    service = published_service(sc, transfers, store, clock, TTL_MS)
    clock.now += TTL_MS
    collector = CollectorClock()
    timed: list[tuple[float, float]] = []  # per pass: seconds, of them collecting
    started = time.perf_counter()
    more = True
    while more:
        begun, collecting = time.perf_counter(), collector.seconds
        more = service.reap()
        timed.append((time.perf_counter() - begun, collector.seconds - collecting))
    total = time.perf_counter() - started
    collector.close()
    longest = max(timed)
    return {
        "longest_ms": longest[0] * 1e3,
        "collecting_ms": longest[1] * 1e3,
        "longest_uncollected_ms": max(s - c for s, c in timed) * 1e3,
        "passes": len(timed),
        "total_ms": total * 1e3,
        "expired": service.list_transfers().counts.get(TransferState.EXPIRED, 0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=20_000)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # one line per expired transfer otherwise
    tune_collector()  # as pdbroker serve does
    with tempfile.TemporaryDirectory() as directory:
        redis = start_redis(Path(directory))
        try:
            for name, store in (("memory", InMemoryStateStore()), ("redis", redis.store())):
                r = burst(store, args.transfers)
                print(
                    f"{name:>6}: {args.transfers:,} due at once: longest pass "
                    f"{r['longest_ms']:.1f} ms ({r['collecting_ms']:.1f} collecting), less its "
                    f"collections {r['longest_uncollected_ms']:.1f} ms; {r['passes']:.0f} "
                    f"passes, {r['total_ms']:.0f} ms in all, {r['expired']:,.0f} expired"
                )
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
