"""What a cluster's registered ranks leave for the garbage collector: ``--engines`` engines
at TP 8 (both model families of ``pdbroker bench scale``, prefill and decode in turn)
register in one in-process broker service (in memory, no gRPC), each rank's request
converted as the server converts it. Printed: the objects the collector tracks per rank
once the registration's garbage is gone, the bytes allocated per rank (tracemalloc), and
how long one collection of the middle generation takes when it walks what the
registration left there, as one does after a cluster registers (the lowest of
``--trials``; a fresh service each trial).

    .venv/bin/python benchmarks/rank_footprint.py --engines 256
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker import convert
from broker.config import ServiceConfig
from broker.presets import resolve_model
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.wire import Role
from harness.bench_engines import DECODE_ADDR, PREFILL_ADDR, registrations
from harness.scale_bench import ENGINE_SPAN, FAMILIES
from harness.scenarios import build_scenario


def requests(engines: int) -> list[pb.RegisterRankRequest]:
    """Every rank's registration of ``engines`` TP8 engines, as ``bench scale`` builds them."""
    built = []
    for i, family in zip(range(engines), itertools.cycle(FAMILIES)):
        sc = build_scenario(resolve_model(family), 8, 8, 32768)
        role, layout, addr = (
            (Role.PREFILL, sc.prefill, PREFILL_ADDR)
            if i % 2 == 0
            else (Role.DECODE, sc.decode, DECODE_ADDR)
        )
        built += registrations(layout, f"e{i}", role, addr + i * ENGINE_SPAN)
    return built


def trial(asks: list[pb.RegisterRankRequest], traced: bool) -> tuple[int, int, float]:
    """Tracked objects and allocated bytes the registration left, and the middle
    collection's seconds."""
    service = BrokerService(config=ServiceConfig(lease_ttl_ms=3_600_000))
    gc.collect()
    gc.disable()
    objects = len(gc.get_objects())
    if traced:
        tracemalloc.start()
    allocated = tracemalloc.get_traced_memory()[0]
    for ask in asks:
        service.register_rank(convert.registration_from_proto(ask))
    gc.collect(0)  # the registration's garbage gone, its survivors in the middle generation
    allocated = tracemalloc.get_traced_memory()[0] - allocated
    tracemalloc.stop()
    kept = len(gc.get_objects()) - objects
    started = time.perf_counter()
    gc.collect(1)
    seconds = time.perf_counter() - started
    gc.enable()
    return kept, allocated, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=256)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    asks = requests(args.engines)
    kept, allocated, _ = trial(asks, traced=True)
    middle = min(trial(asks, traced=False)[2] for _ in range(args.trials))
    print(
        f"{args.engines} engines at TP 8, {len(asks)} ranks: {kept / len(asks):.1f} tracked "
        f"objects and {allocated / len(asks) / 1024:.1f} KiB per rank; a middle collection "
        f"after they registered {middle * 1e3:.2f} ms (lowest of {args.trials})"
    )


if __name__ == "__main__":
    main()
