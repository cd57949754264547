"""What running store calls on the store thread costs: ``KeepAlive`` of one rank through
the service, on a private ``redis-server`` (started here), called on the event loop itself
(as for a store in memory) and through :meth:`BrokerServicer.stored` (as for Redis), trials
alternating; the in-memory store's call for scale. Printed: the lowest of ``--trials`` wall
and CPU times per call, and the ratios thread/inline.

    .venv/bin/python benchmarks/store_thread_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker import convert
from broker.presets import resolve_model
from broker.service import BrokerService
from broker.servicer import BrokerServicer
from broker.store.contract import StateStore
from broker.store.redis import RedisStateStore
from broker.wire import Role
from harness.bench_engines import PREFILL_ADDR, registrations
from harness.redis_server import start_redis
from harness.scenarios import build_scenario


def _lease(store: StateStore) -> tuple[BrokerService, str]:
    service = BrokerService(store)
    layout = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 1, 1, 64).prefill
    registration = registrations(layout, "P", Role.PREFILL, PREFILL_ADDR)[0]
    return service, service.register_rank(convert.registration_from_proto(registration)).lease_id


async def _per_call(
    calls: int, call: Callable[[], object], servicer: BrokerServicer | None
) -> tuple[float, float]:
    """Wall and CPU seconds per ``call()``: inline, or through ``servicer.stored``."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        if servicer is None:
            call()
        else:
            await servicer.stored(call)
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


async def measure(calls: int, trials: int, redis_url: str) -> dict[str, tuple[float, float]]:
    store = RedisStateStore.from_url(redis_url, "hop:")
    service, lease = _lease(store)
    threaded = BrokerServicer(service)
    memory_service, memory_lease = _lease(BrokerService().store)
    best: dict[str, tuple[float, float]] = {}
    ways: dict[str, tuple[Callable[[], object], BrokerServicer | None]] = {
        "redis, inline": (lambda: service.keep_alive(lease), None),
        "redis, store thread": (lambda: service.keep_alive(lease), threaded),
        "memory, inline": (lambda: memory_service.keep_alive(memory_lease), None),
    }
    for _ in range(trials):
        for name, (call, servicer) in ways.items():
            wall, cpu = await _per_call(calls, call, servicer)
            low = best.get(name, (wall, cpu))
            best[name] = (min(low[0], wall), min(low[1], cpu))
    threaded.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2_000)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        server = start_redis(Path(directory))
        try:
            best = asyncio.run(measure(args.calls, args.trials, server.url))
        finally:
            server.stop()
    for name, (wall, cpu) in best.items():
        print(f"KeepAlive, {name:<20} {wall * 1e6:7.1f} us wall  {cpu * 1e6:7.1f} us CPU per call")
    inline, thread = best["redis, inline"], best["redis, store thread"]
    print(
        f"store thread / inline (redis): wall {thread[0] / inline[0]:.2f}x, "
        f"CPU {thread[1] / inline[1]:.2f}x; hop {(thread[0] - inline[0]) * 1e6:.1f} us wall"
    )


if __name__ == "__main__":
    main()
