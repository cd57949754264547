"""``pdbroker bench``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from broker.commands.bench_control_plane import add_control_plane, run_control_plane
from broker.commands.bench_scale import add_scale, run_scale_command
from broker.commands.options import non_negative_int, positive_int
from broker.console import Progress, quiet_libraries
from broker.planner import PairPlanner

if TYPE_CHECKING:
    from harness.scenarios import Scenario
    from harness.vllm.nixl_reference import VllmDecodeSide

#: (name, preset, prefill tp, decode tp, tokens, kernel block size; 0 = logical block size)
PLANNER_SCENARIOS = (
    ("nemotron-3-nano 32k tp2->tp2", "nemotron-3-nano-30b-a3b", 2, 2, 32768, 0),
    ("nemotron-3-nano 32k tp2->tp2 kbs16", "nemotron-3-nano-30b-a3b", 2, 2, 32768, 16),
    ("nemotron-3-nano 128k tp2->tp2", "nemotron-3-nano-30b-a3b", 2, 2, 131072, 0),
    ("qwen3.5-27b 32k tp1->tp8", "qwen3.5-27b", 1, 8, 32768, 0),
)


@dataclass
class PlannerResult:
    """One scenario of ``bench planner``; the ``vllm_*`` figures are None without vLLM."""

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
    vllm_measured_descriptors: int | None
    vllm_handshake_ms: float | None


class BytesPoint(TypedDict):
    """One input length of ``bench bytes``: the bytes a naive copy, the plan and the
    minimum move."""

    tokens: int
    naive_bytes: int
    plan_bytes: int
    optimal_bytes: int


class BytesSeries(TypedDict):
    """One model of ``bench bytes``, a point per input length."""

    name: str
    points: list[BytesPoint]


#: What ``vllm_warm_median_us`` times (the JSON's ``vllm_scope``).
VLLM_SCOPE = (
    "vLLM's NixlPullConnectorWorker, decode rank 0, on CPU, NIXL's C++ agent recorded: "
    "start_load_kv for one new request's metadata to its last make_prepped_xfer call"
)


#: (name, preset, tp, kv dtype) of the transfer-volume sweep (seed blog's volume vs ISL).
#: Attention kernel blocks of 16 tokens (FlashInfer-class backends): HMA inflates the logical
#: block to thousands of tokens, a naive copy moves whole logical pages, the plan only the
#: kernel blocks that hold tokens.
BYTES_MODELS = (
    ("nemotron-3-super tp4 bf16", "nemotron-3-super-120b-a12b", 4, None),
    ("nemotron-3-super tp4 fp8", "nemotron-3-super-120b-a12b", 4, "fp8"),
    ("qwen3.5-27b tp4", "qwen3.5-27b", 4, None),
)
BYTES_KERNEL_BLOCK = 16
INPUT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
#: (name, preset, prefill tp, decode tp) of the descriptor-count comparison.
DESCRIPTOR_PAIRS = (
    ("nemotron-3-nano tp2->tp2", "nemotron-3-nano-30b-a3b", 2, 2),
    ("nemotron-3-nano tp1->tp2", "nemotron-3-nano-30b-a3b", 1, 2),
    ("qwen3.5-27b tp1->tp8", "qwen3.5-27b", 1, 8),
    ("qwen3.5-27b tp4->tp4", "qwen3.5-27b", 4, 4),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    kinds = p.add_subparsers(dest="kind", required=True)
    planner = kinds.add_parser(
        "planner", help="per-plan latency of the in-process planner, and of vLLM's connector"
    )
    planner.add_argument("--iterations", type=positive_int, default=1000, help="calls per trial")
    planner.add_argument(
        "--trials", type=positive_int, default=5, help="trials; the lowest median counts"
    )
    planner.add_argument(
        "--scenario",
        action="append",
        choices=[s[0] for s in PLANNER_SCENARIOS],
        help="only this scenario (repeatable; default all)",
    )
    planner.add_argument(
        "--no-vllm", action="store_true", help="skip vLLM's side even if vLLM is installed"
    )
    planner.set_defaults(run=_on_console(run_planner))
    volume = kinds.add_parser("bytes", help="bytes per request vs input length: naive vs plan")
    volume.set_defaults(run=_on_console(run_bytes))
    descs = kinds.add_parser("descriptors", help="descriptors per request: plan vs vLLM")
    descs.add_argument(
        "--tokens", type=positive_int, default=32768, help="tokens of the request planned"
    )
    descs.set_defaults(run=_on_console(run_descriptors))
    transfer = kinds.add_parser(
        "transfer", help="NIXL throughput of real plans between two processes"
    )
    _pair_options(transfer, prefill_tp=1, decode_tp=1)
    transfer.add_argument(
        "--kernel-block-size",
        type=non_negative_int,
        default=0,
        help="tokens per attention kernel block; 0: the block size",
    )
    transfer.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the KV caches live"
    )
    transfer.add_argument(
        "--prefill-device", type=non_negative_int, default=0, help="GPU of the prefill process"
    )
    transfer.add_argument(
        "--decode-device", type=non_negative_int, default=0, help="GPU of the decode process"
    )
    transfer.add_argument(
        "--repeats", type=positive_int, default=5, help="times each plan's reads are timed"
    )
    transfer.set_defaults(run=_on_console(run_transfer))
    control = add_control_plane(kinds)
    control.set_defaults(run=_on_console(run_control_plane))
    scale = add_scale(kinds)
    scale.set_defaults(run=_on_console(run_scale_command))
    for kind in (planner, volume, descs, transfer, control, scale):
        kind.add_argument("--json", action="store_true", help="print one JSON object")
        kind.add_argument(
            "--out",
            type=Path,
            default=None,
            help="directory for the JSON result (and a PNG plot where useful)",
        )
        kind.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="show INFO logs, and the libraries' (vLLM, torch) logs and warnings",
        )


def _on_console(
    run: Callable[[argparse.Namespace, Progress], int],
) -> Callable[[argparse.Namespace], int]:
    """``run`` with its libraries quiet unless ``--verbose`` and its progress on stderr."""

    def on_console(args: argparse.Namespace) -> int:
        quiet_libraries(args.verbose)
        with Progress(f"pdbroker bench {args.kind}") as progress:
            return run(args, progress)

    return on_console


def _pair_options(p: argparse.ArgumentParser, prefill_tp: int, decode_tp: int) -> None:
    """The model, TP sizes and request length of a benchmark that plans one pair."""
    p.add_argument("--model", default="nemotron-3-nano-30b-a3b", help="a preset name")
    p.add_argument("--prefill-tp", type=positive_int, default=prefill_tp, help="prefill's TP size")
    p.add_argument("--decode-tp", type=positive_int, default=decode_tp, help="decode's TP size")
    p.add_argument(
        "--tokens", type=positive_int, default=32768, help="tokens of the request planned"
    )


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


def lowest_medians_us(
    samplers: list[Callable[[], int]], iterations: int, trials: int
) -> list[float]:
    """Per sampler (a call returning nanoseconds), the lowest of ``trials`` medians of
    ``iterations`` samples, in microseconds. Samples alternate between the samplers, so that
    whatever else the machine does falls on all alike; this VM's timings drift between two
    levels ~1.8x apart, the minimum of medians is the repeatable figure."""
    lowest = [math.inf] * len(samplers)
    for _ in range(trials):
        samples: list[list[int]] = [[] for _ in samplers]
        for _ in range(iterations):
            for sampler, found in zip(samplers, samples):
                found.append(sampler())
        lowest = [min(low, statistics.median(found)) for low, found in zip(lowest, samples)]
    return [low / 1e3 for low in lowest]


def run_planner(args: argparse.Namespace, progress: Progress) -> int:
    """Our planner's per-request time next to vLLM's connector for the same request."""
    from broker.presets import resolve_model
    from harness.scenarios import build_scenario

    vllm_side: type[VllmDecodeSide] | None = None
    if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        progress.phase("importing vLLM and torch for vLLM's side (--no-vllm skips it)")
        from harness.vllm import nixl_reference

        vllm_side = nixl_reference.VllmDecodeSide

    results = []
    scenarios = [s for s in PLANNER_SCENARIOS if not args.scenario or s[0] in args.scenario]
    for n, (name, preset, p_tp, d_tp, tokens, kbs) in enumerate(scenarios, 1):
        progress.phase(f"scenario {n}/{len(scenarios)}: {name}")
        sc = build_scenario(resolve_model(preset), p_tp, d_tp, tokens, kernel_block_size=kbs)
        start = time.perf_counter()
        pair = PairPlanner(sc.prefill, sc.decode)
        plan = pair.plan_rank(0, sc.request)
        cold_ms = (time.perf_counter() - start) * 1e3

        def ours(pair: PairPlanner = pair, sc: Scenario = sc) -> int:
            start = time.perf_counter_ns()
            pair.plan_rank(0, sc.request)
            return time.perf_counter_ns() - start

        side = vllm_side(preset, sc, kbs) if vllm_side else None
        try:
            samplers: list[Callable[[], int]] = [ours, side.sample] if side else [ours]
            medians = lowest_medians_us(samplers, args.iterations, args.trials)
        finally:
            if side:
                side.close()
        results.append(
            PlannerResult(
                name,
                tokens,
                round(medians[0], 1),
                round(medians[1], 1) if side else None,
                round(cold_ms, 2),
                plan.num_descriptors,
                plan.vllm_descriptors,
                plan.nbytes,
                optimal_bytes(sc, 0),
                plan.naive_bytes,
                side.descriptors if side else None,
                round(side.handshake_s * 1e3, 2) if side else None,
            )
        )
    result = {
        "planner": [asdict(r) for r in results],
        "vllm_version": importlib.metadata.version("vllm") if vllm_side else None,
        "vllm_scope": VLLM_SCOPE if vllm_side else None,
    }
    _emit(args, progress, "planner", result, _planner_table(results))
    return 0


def _planner_table(results: list[PlannerResult]) -> str:
    def num(value: float | None, width: int, spec: str = "") -> str:
        return f"{'-' if value is None else format(value, spec):>{width}}"

    lines = [
        (
            f"{'scenario (decode rank 0)':<36} {'warm us':>8} {'vLLM us':>8} {'ratio':>6} "
            f"{'cold ms':>8} {'descs':>6} {'vLLM descs':>10} {'posted':>7} {'bytes':>13} "
            f"{'naive bytes':>13}"
        )
    ]
    for r in results:
        ratio = r.vllm_warm_median_us / r.warm_median_us if r.vllm_warm_median_us else None
        lines.append(
            f"{r.name:<36} {r.warm_median_us:>8.1f} {num(r.vllm_warm_median_us, 8, '.1f')} "
            f"{num(ratio, 6, '.2f')} {r.cold_ms:>8.2f} {r.descriptors:>6} {r.vllm_descriptors:>10} "
            f"{num(r.vllm_measured_descriptors, 7)} {r.bytes:>13,} {r.naive_bytes:>13,}"
        )
    if any(r.vllm_warm_median_us for r in results):
        lines.append(f"vLLM us: {VLLM_SCOPE}; ratio: vLLM us / warm us; posted: its descriptors")
    return "\n".join(lines)


def _emit(
    args: argparse.Namespace, progress: Progress, name: str, result: dict, table: str
) -> None:
    """Print ``result`` as JSON or ``table`` once the progress line is gone; write
    ``<out>/<name>.json`` if asked."""
    progress.close()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else table)


def run_bytes(args: argparse.Namespace, progress: Progress) -> int:
    """All decode ranks of a homogeneous pair: naive whole padded pages vs the plan's bytes."""
    from broker.models import with_kv_dtype
    from broker.presets import resolve_model
    from harness.scenarios import build_scenario

    series: list[BytesSeries] = []
    for n, (name, preset, tp, kv_dtype) in enumerate(BYTES_MODELS, 1):
        progress.phase(f"model {n}/{len(BYTES_MODELS)}: {name}")
        model = with_kv_dtype(resolve_model(preset), kv_dtype)
        points: list[BytesPoint] = []
        for tokens in INPUT_LENGTHS:
            sc = build_scenario(model, tp, tp, tokens, kernel_block_size=BYTES_KERNEL_BLOCK)
            plan = PairPlanner(sc.prefill, sc.decode).plan(sc.request)
            points.append(
                {
                    "tokens": tokens,
                    "naive_bytes": plan.naive_bytes,
                    "plan_bytes": plan.nbytes,
                    "optimal_bytes": sum(optimal_bytes(sc, d) for d in range(tp)),
                }
            )
        series.append({"name": name, "points": points})
    result = {"bytes": series}
    lines = [f"{'model':<28} {'tokens':>7} {'naive MiB':>10} {'plan MiB':>10} {'saved':>7}"]
    for s in series:
        for pt in s["points"]:
            saved = 1 - pt["plan_bytes"] / pt["naive_bytes"]
            lines.append(
                f"{s['name']:<28} {pt['tokens']:>7} {pt['naive_bytes'] / 2**20:>10.1f} "
                f"{pt['plan_bytes'] / 2**20:>10.1f} {100 * saved:>6.1f}%"
            )
    _emit(args, progress, "bytes", result, "\n".join(lines))
    if args.out:
        _plot_bytes(series, args.out / "bytes.png")
    return 0


def _plot_bytes(series: list[BytesSeries], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, saved) = plt.subplots(1, 2, figsize=(11, 4.5))
    for s in series:
        tokens = [p["tokens"] for p in s["points"]]
        (line,) = ax.plot(
            tokens,
            [p["plan_bytes"] / 2**30 for p in s["points"]],
            "-o",
            ms=3,
            label=f"{s['name']} plan",
        )
        ax.plot(
            tokens,
            [p["naive_bytes"] / 2**30 for p in s["points"]],
            "--",
            color=line.get_color(),
            label=f"{s['name']} naive",
        )
        saved.plot(
            tokens,
            [(p["naive_bytes"] - p["plan_bytes"]) / 2**20 for p in s["points"]],
            "-o",
            ms=3,
            color=line.get_color(),
            label=s["name"],
        )
    for axis in (ax, saved):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("input length (tokens)")
        axis.grid(alpha=0.3)
    ax.set_ylabel("bytes per request (GiB, all decode ranks)")
    ax.set_title("Transfer volume vs input length")
    ax.legend(fontsize=7)
    saved.set_ylabel("MiB not moved (naive - plan)")
    saved.set_title(f"Padding and empty kernel blocks skipped (kbs {BYTES_KERNEL_BLOCK})")
    saved.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_descriptors(args: argparse.Namespace, progress: Progress) -> int:
    """Descriptors per request (all decode ranks), contiguous and fragmented block ids."""
    from broker.presets import resolve_model
    from harness.scenarios import build_scenario

    rows = []
    for n, (name, preset, p_tp, d_tp) in enumerate(DESCRIPTOR_PAIRS, 1):
        progress.phase(f"pair {n}/{len(DESCRIPTOR_PAIRS)}: {name}")
        for allocation, stride in (("contiguous", 1), ("fragmented", 2)):
            sc = build_scenario(resolve_model(preset), p_tp, d_tp, args.tokens, stride=stride)
            plan = PairPlanner(sc.prefill, sc.decode).plan(sc.request)
            rows.append(
                {
                    "name": name,
                    "allocation": allocation,
                    "tokens": args.tokens,
                    "descriptors": plan.num_descriptors,
                    "vllm_descriptors": plan.vllm_descriptors,
                }
            )
    lines = [f"{'pair':<28} {'allocation':<11} {'descs':>7} {'vLLM':>7} {'ratio':>6}"]
    lines += [
        f"{r['name']:<28} {r['allocation']:<11} {r['descriptors']:>7} {r['vllm_descriptors']:>7} "
        f"{r['descriptors'] / r['vllm_descriptors']:>6.3f}"
        for r in rows
    ]
    _emit(args, progress, "descriptors", {"descriptors": rows}, "\n".join(lines))
    return 0


def run_transfer(args: argparse.Namespace, progress: Progress) -> int:
    """Real plans through NIXL vs per-block descriptors, one descriptor and memcpy."""
    from broker.presets import resolve_model
    from harness.scenarios import build_scenario
    from harness.transfer_bench import run_transfer_bench

    sc = build_scenario(
        resolve_model(args.model),
        args.prefill_tp,
        args.decode_tp,
        args.tokens,
        kernel_block_size=args.kernel_block_size,
    )
    figures = run_transfer_bench(
        sc, progress, args.device, args.prefill_device, args.decode_device, args.repeats
    )
    f = figures
    table = "\n".join(
        [
            (
                f"{args.model} {args.tokens} tokens tp{args.prefill_tp}->tp{args.decode_tp}, "
                f"decode rank 0, {f.device}: {f.bytes / 2**20:.1f} MiB"
            ),
            f"  coalesced plan   {f.coalesced_descriptors:>7} descriptors  {f.coalesced_gbps:>8.2f} GB/s",
            f"  per-block (vLLM) {f.per_block_descriptors:>7} descriptors  {f.per_block_gbps:>8.2f} GB/s",
            f"  one descriptor   {1:>7} descriptor   {f.single_desc_gbps:>8.2f} GB/s",
            f"  memcpy (1 proc)  {'':>7}              {f.memcpy_gbps:>8.2f} GB/s",
            (
                f"  coalesced / one descriptor = {f.coalesced_gbps / f.single_desc_gbps:.2f}, "
                f"coalesced / per-block = {f.coalesced_gbps / f.per_block_gbps:.2f}"
            ),
        ]
    )
    _emit(args, progress, "transfer", {"transfer": f.as_dict()}, table)
    return 0
