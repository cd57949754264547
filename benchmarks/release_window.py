"""What release events kept for resuming streams cost: an in-memory broker service with a
Nemotron-3-Nano TP2 prefill engine, ``--transfers`` transfers published and aborted (each
releasing both prefill ranks), then each rank's events read and delivered ``--per-call`` at a
time, as a watching stream marks them. Printed: the CPU per event delivered (the lowest of
``--trials``) and how many fewer objects the garbage collector tracks per event once
delivered (the in-memory store keeps a delivered event's block ids packed).

    .venv/bin/python benchmarks/release_window.py
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.presets import resolve_model
from harness.bench_engines import published_service
from harness.scenarios import build_scenario


def trial(transfers: int, per_call: int) -> tuple[float, float]:
    """Seconds of CPU per event delivered, and tracked objects fewer per event delivered."""
    sc = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 2, 2, 32768)
    service = published_service(sc, transfers)
    for i in range(transfers):
        service.abort(f"t{i}", "released", "P")
    gc.collect()
    objects, spent, events = len(gc.get_objects()), 0.0, 0
    for rank in range(sc.prefill.tp_size):
        key = ("P", rank)
        generation, cursor = service.feeds.start("P", rank, 0)
        sent = service.feeds.after(key, generation, cursor)
        started = time.process_time()
        for event in sent[per_call - 1 :: per_call]:
            service.feeds.delivered(key, event.sequence)
        service.feeds.delivered(key, sent[-1].sequence)
        spent += time.process_time() - started
        events += len(sent)
        del sent
    gc.collect()
    return spent / events, (objects - len(gc.get_objects())) / events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=1000)
    parser.add_argument("--per-call", type=int, default=10)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # each abort logs one
    runs = [trial(args.transfers, args.per_call) for _ in range(args.trials)]
    print(
        f"{args.transfers} transfers, 2 prefill ranks, delivered {args.per_call} at a time: "
        f"{min(r[0] for r in runs) * 1e6:.2f} us of CPU per event delivered (lowest of "
        f"{args.trials}); {runs[-1][1]:.1f} fewer tracked objects per event once delivered"
    )


if __name__ == "__main__":
    main()
