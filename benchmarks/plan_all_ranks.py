"""Planning every decode rank of a transfer: one pass (``PairPlanner.plan``) against one call
per rank (``plan_rank`` for each), side by side.

The broker plans all decode ranks when a transfer is first claimed. Both ways run on the same
warm planner and produce the same plans; they alternate sample by sample (1,000 each per
trial) and the lowest of five trial medians is reported, with their ratio.

    .venv/bin/python benchmarks/plan_all_ranks.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.planner import PairPlanner
from broker.presets import resolve_model
from harness.scenarios import build_scenario

SCENARIOS = (
    ("nemotron-3-nano-30b-a3b", 1, 1, 32768),
    ("nemotron-3-nano-30b-a3b", 2, 2, 32768),
    ("nemotron-3-nano-30b-a3b", 4, 2, 131072),
    ("nemotron-3-nano-30b-a3b", 1, 4, 32768),
    ("qwen3.5-27b", 1, 8, 32768),
    ("qwen3.5-27b", 8, 2, 32768),
)


def time_both(pair: PairPlanner, request, samples: int = 1000, trials: int = 5):
    """Lowest trial median (µs) of one ``plan`` call and of ``plan_rank`` for every rank."""
    ranks = range(pair.decode.tp_size)

    def per_rank():
        return [pair.plan_rank(d, request) for d in ranks]

    together = pair.plan(request).ranks
    assert [r.nbytes for r in together] == [r.nbytes for r in per_rank()]
    best = [float("inf"), float("inf")]
    for _ in range(trials):
        times: tuple[list[int], list[int]] = ([], [])
        for _ in range(samples):
            for k, call in enumerate((lambda: pair.plan(request), per_rank)):
                t0 = time.perf_counter_ns()
                call()
                times[k].append(time.perf_counter_ns() - t0)
        best = [min(b, statistics.median(t) / 1e3) for b, t in zip(best, times)]
    return best


def main() -> int:
    print(f"{'scenario':<40} {'plan() us':>10} {'per rank us':>12} {'ratio':>6}")
    for model, p_tp, d_tp, tokens in SCENARIOS:
        sc = build_scenario(resolve_model(model), p_tp, d_tp, tokens)
        pair = PairPlanner(sc.prefill, sc.decode)
        together, per_rank = time_both(pair, sc.request)
        name = f"{model} {tokens // 1024}k P{p_tp}->D{d_tp}"
        print(f"{name:<40} {together:>10.1f} {per_rank:>12.1f} {per_rank / together:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
