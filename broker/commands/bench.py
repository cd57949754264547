"""``pdbroker bench``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

from broker.planner import PairPlanner, RankPlan
from broker.scenarios import Scenario, build_scenario

#: (name, preset, prefill tp, decode tp, tokens, kernel block size; 0 = logical block size)
PLANNER_SCENARIOS = (
    ("nemotron-3-nano 32k tp2->tp2", "nemotron-3-nano-30b-a3b", 2, 2, 32768, 0),
    ("nemotron-3-nano 32k tp2->tp2 kbs16", "nemotron-3-nano-30b-a3b", 2, 2, 32768, 16),
    ("nemotron-3-nano 128k tp2->tp2", "nemotron-3-nano-30b-a3b", 2, 2, 131072, 0),
    ("qwen3.5-27b 32k tp1->tp8", "qwen3.5-27b", 1, 8, 32768, 0),
)


@dataclass
class PlannerResult:
    name: str
    tokens: int
    warm_median_us: float
    vllm_warm_median_us: float | None
    cold_ms: float
    descriptors: int
    vllm_descriptors: int
    bytes: int
    optimal_bytes: int
    naive_bytes: int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    kinds = p.add_subparsers(dest="kind", required=True)
    planner = kinds.add_parser("planner", help="per-plan latency of the in-process planner")
    planner.add_argument("--iterations", type=int, default=1000)
    planner.add_argument("--json", action="store_true", help="print one JSON object")
    planner.set_defaults(run=run_planner)


def optimal_bytes(sc: Scenario, decode_rank: int) -> int:
    """Unpadded state the decode rank needs, from its layout alone: every Mamba page of the
    request plus the request's tokens rounded up to whole decode kernel blocks."""
    total = 0
    rank = sc.decode.ranks[decode_rank]
    for g, group in enumerate(rank.groups):
        if group.is_attention:
            tokens = -(-sc.request.num_tokens // group.kernel_block_size) * group.kernel_block_size
            per_token = group.state_bytes // group.block_size
            total += tokens * per_token * len(group.layers)
        else:
            pairs = min(len(sc.request.decode_block_ids[g]), len(sc.request.prefill_block_ids[g]))
            total += group.state_bytes * pairs * len(group.layers)
    return total


def time_plans(pair: PairPlanner, sc: Scenario, iterations: int, trials: int = 5,
               ) -> tuple[float, RankPlan]:
    """Warm ``plan_rank`` time of decode rank 0 in microseconds: the lowest of ``trials``
    medians of ``iterations`` calls each (this VM's timings are bimodal; the minimum of
    medians is the repeatable figure)."""
    plan = pair.plan_rank(0, sc.request)
    medians = []
    for _ in range(trials):
        samples = []
        for _ in range(iterations):
            start = time.perf_counter_ns()
            pair.plan_rank(0, sc.request)
            samples.append(time.perf_counter_ns() - start)
        medians.append(statistics.median(samples))
    return min(medians) / 1e3, plan


def run_planner(args: argparse.Namespace) -> int:
    from broker.presets import resolve_model

    results = []
    for name, preset, p_tp, d_tp, tokens, kbs in PLANNER_SCENARIOS:
        sc = build_scenario(resolve_model(preset), p_tp, d_tp, tokens, kernel_block_size=kbs)
        start = time.perf_counter()
        pair = PairPlanner(sc.prefill, sc.decode)
        pair.plan_rank(0, sc.request)
        cold_ms = (time.perf_counter() - start) * 1e3
        warm_us, plan = time_plans(pair, sc, args.iterations)
        results.append(PlannerResult(name, tokens, round(warm_us, 1), None, round(cold_ms, 2),
                                     plan.num_descriptors, plan.vllm_descriptors, plan.nbytes,
                                     optimal_bytes(sc, 0), plan.naive_bytes))
    if args.json:
        print(json.dumps({"planner": [asdict(r) for r in results]}))
        return 0
    print(f"{'scenario (decode rank 0)':<36} {'warm us':>8} {'cold ms':>8} {'descs':>6} "
          f"{'vLLM descs':>10} {'ratio':>6} {'bytes':>13} {'naive bytes':>13}")
    for r in results:
        print(f"{r.name:<36} {r.warm_median_us:>8.1f} {r.cold_ms:>8.2f} {r.descriptors:>6} "
              f"{r.vllm_descriptors:>10} {r.descriptors / r.vllm_descriptors:>6.3f} "
              f"{r.bytes:>13,} {r.naive_bytes:>13,}")
    return 0
