"""``pdbroker demo``: the main job. A broker, prefill and decode engines as separate processes
with real NIXL agents (UCX over loopback, DRAM) and real model layouts move N requests through
publish → plan → NIXL read → report → release; decode checks every byte of its memory against
what its own layout says it must hold. Exits 0 only if every byte matched and every release
arrived; the last line is ``demo: <N> transfers, <B> bytes verified, <M> mismatches``.
Decode asks for the plans of every rank of the requests waiting for it in one call and
reports them in one call; ``--per-rank`` makes one call per rank instead.

With ``--trace`` every process exports its spans over OTLP to a receiver inside the demo,
which then prints the span tree of the first transfer, one span per line:
``<indent><service.name> <span name> <duration ms>``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from harness.fleet import FleetReport
    from harness.trace_receiver import ReceivedSpan

#: (label, preset, prefill TP, decode TP, fewest tokens, most tokens) of the demo's engine pairs.
PAIRS = (
    ("Nemotron-3-Nano (FA+Mamba2) P TP2 -> D TP2", "nemotron-3-nano-30b-a3b", 2, 2, 256, 2048),
    ("Qwen3.5-0.8B (FA+GDN)      P TP1 -> D TP2", "qwen3.5-0.8b", 1, 2, 256, 1536),
)
_MB = 1e6


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run requests through a real broker, engines and NIXL; verify every byte",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--requests", type=int, default=8, help="transfers to run (round-robin over the pairs)"
    )
    p.add_argument(
        "--inflight",
        type=int,
        default=2,
        help="requests per engine pair between publish and release (sizes the KV caches)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds token counts, salts and block order")
    p.add_argument(
        "--broker",
        metavar="ADDR[,ADDR...]",
        help="run the engines against these running brokers (plaintext replicas sharing "
        "a store, e.g. `pdbroker serve --store redis://... --insecure`) instead of "
        "starting one; engines fail over between them",
    )
    p.add_argument(
        "--per-rank",
        action="store_true",
        help="decode fetches one request at a time, one GetTransferPlan and one "
        "ReportTransfer per rank (default: every waiting request's ranks in one "
        "GetTransferPlans and one ReportTransfers call)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace every process into a receiver in the demo and print the span tree "
        "of the first transfer (overrides OTEL_* trace exporter settings)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.requests <= 0 or args.inflight <= 0:
        raise SystemExit("pdbroker demo: error: --requests and --inflight must be positive")
    from broker.presets import resolve_model
    from harness.brokers import RunningBrokers
    from harness.fleet import PairSpec, run_fleet

    pairs = [
        PairSpec(label, resolve_model(name), p_tp, d_tp, lo, hi)
        for label, name, p_tp, d_tp, lo, hi in PAIRS
    ]
    brokers = RunningBrokers(args.broker) if args.broker else None
    spans: list[ReceivedSpan] = []
    if args.trace:
        from harness.trace_receiver import TraceReceiver

        with TraceReceiver() as receiver:
            os.environ.update(receiver.environment())  # inherited by every process of the fleet
            report = run_fleet(
                pairs,
                args.requests,
                inflight=args.inflight,
                seed=args.seed,
                on_progress=_progress_bar,
                broker=brokers,
                per_rank=args.per_rank,
            )
            spans = receiver.spans()  # complete: every process flushed its spans on exit
    else:
        report = run_fleet(
            pairs,
            args.requests,
            inflight=args.inflight,
            seed=args.seed,
            on_progress=_progress_bar,
            broker=brokers,
            per_rank=args.per_rank,
        )
    print(file=sys.stderr)
    print(format_report(report))
    if args.trace:
        print()
        print(format_trace(spans, report.requests[0].transfer_id))
    for problem in report.problems():
        print(f"pdbroker demo: {problem}", file=sys.stderr)
    fetched = [r for r in report.requests if r.fetched]
    print(
        f"demo: {len(fetched)} transfers, {sum(r.nbytes for r in fetched)} bytes verified, "
        f"{report.mismatches} mismatches"
    )
    return 0 if report.ok else 1


def format_trace(spans: list[ReceivedSpan], transfer_id: str) -> str:
    """A heading and the span tree of ``transfer_id``'s trace (found by its publish span)."""
    from harness.trace_receiver import span_tree

    roots = [
        s
        for s in spans
        if s.name == "prefill.publish" and s.attributes.get("pdbroker.transfer_id") == transfer_id
    ]
    if not roots:
        return f"trace of {transfer_id}: no spans received"
    trace_id = roots[0].trace_id
    lines = span_tree(spans, trace_id)
    services = {s.service for s in spans if s.trace_id == trace_id}
    heading = (
        f"trace {trace_id} of {transfer_id}: {len(lines)} spans from {len(services)} "
        f"processes (durations in ms)"
    )
    return "\n".join([heading, *lines])


def _progress_bar(report: FleetReport, width: int = 30) -> None:
    total = len(report.requests)
    filled = width * report.completed // total
    moved = sum(r.nbytes for r in report.requests if r.fetched)
    print(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {report.completed}/{total} transfers, "
        f"{moved / _MB:,.0f} MB",
        end="",
        file=sys.stderr,
        flush=True,
    )


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )


def format_report(report: FleetReport) -> str:
    """Pairs, volumes and savings, per-stage latency percentiles, and the checks made."""
    engines = 2 * len(report.pairs)
    agents = sum(p.prefill_tp + p.decode_tp for p in report.pairs)
    memory = sum(
        rank.region_bytes * rank.num_regions
        for pair in report.layouts
        for layout in pair
        for rank in layout.ranks
    )
    lines = [
        (
            f"pdbroker demo: {len(report.requests)} requests, {len(report.pairs)} P/D pairs, broker + "
            f"{engines} engine processes, {agents} NIXL agents (UCX, DRAM), {report.wall_s:.1f} s"
        ),
        "",
    ]
    widths = [44, 8, 10, 10, 16, 12, 20]
    lines.append(
        _row(
            [
                "pair",
                "requests",
                "tokens",
                "moved MB",
                "naive MB",
                "descriptors",
                "vLLM descriptors",
            ],
            widths,
        )
    )
    totals = np.zeros(4, dtype=np.int64)
    for i, pair in enumerate(report.pairs):
        done = [r for r in report.requests if r.pair == i and r.fetched]
        sums = np.array(
            [
                sum(rank[k] for r in done for rank in r.ranks)
                for k in ("nbytes", "naive_bytes", "num_descriptors", "vllm_descriptors")
            ],
            dtype=np.int64,
        )
        totals += sums
        lines.append(
            _row(
                [
                    pair.label,
                    str(len(done)),
                    f"{pair.min_tokens}-{pair.max_tokens}",
                    *_volumes(sums),
                ],
                widths,
            )
        )
    lines.append(
        _row(["total", str(sum(r.fetched for r in report.requests)), "", *_volumes(totals)], widths)
    )
    lines += [
        "",
        _row(["stage latency (ms)", "n", "p50", "p90", "p99", "max"], [44, 6, 9, 9, 9, 9]),
    ]
    for name, values in _stages(report):
        cells = (
            [f"{v:.2f}" for v in np.percentile(values, [50, 90, 99, 100])] if values else ["-"] * 4
        )
        lines.append(_row([name, str(len(values)), *cells], [44, 6, 9, 9, 9, 9]))
    releases = sum(len(r.releases) for r in report.requests)
    completed = sum(why == "completed" for r in report.requests for why, _ in r.releases.values())
    read_s = sum(rank["read_s"] for r in report.requests for rank in r.ranks)
    lines += [
        "",
        f"NIXL read throughput: {report.nbytes / read_s / 1e9:.2f} GB/s summed over reads"
        if read_s
        else "NIXL read throughput: -",
        (
            f"KV memory registered: {memory / _MB:,.0f} MB; decode memory compared byte by byte: "
            f"{sum(r.checked_bytes for r in report.requests) / _MB:,.0f} MB "
            f"({sum(r.expected_bytes for r in report.requests):,} state bytes expected, "
            f"{report.mismatches} mismatches)"
        ),
        (
            f"releases: {completed}/{releases} completed; NIXL completion notifications at prefill: "
            f"{report.notifications}/{report.expected_notifications}; engines registered after "
            f"close: {len(report.leftover_engines)}"
        ),
    ]
    return "\n".join(lines)


def _volumes(sums: np.ndarray) -> list[str]:
    moved, naive, descriptors, vllm = (int(x) for x in sums)
    saved = f" (-{100 * (1 - moved / naive):.1f}%)" if naive else ""
    fewer = f" ({vllm / descriptors:.1f}x)" if descriptors else ""
    return [
        f"{moved / _MB:,.1f}",
        f"{naive / _MB:,.1f}{saved}",
        f"{descriptors:,}",
        f"{vllm:,}{fewer}",
    ]


def _stages(report: FleetReport) -> list[tuple[str, list[float]]]:
    """Per-stage latencies in ms. Release: from the last report of a prefill rank's readers to
    that rank receiving its release (both on the host's monotonic clock)."""
    done = [r for r in report.requests if r.fetched]
    ranks = [rank for r in done for rank in r.ranks]
    release, end_to_end = [], []
    for r in done:
        for p, (_, at) in r.releases.items():
            reports = [rank["reported_at"] for rank in r.ranks if p in rank["prefill_ranks"]]
            if reports:
                release.append((at - max(reports)) * 1e3)
        if r.releases:
            end_to_end.append((max(at for _, at in r.releases.values()) - r.published_at) * 1e3)
    return [
        ("prefill: fill pages with the pattern", [r.fill_s * 1e3 for r in done]),
        ("publish (PublishBlocks)", [r.publish_s * 1e3 for r in done]),
        ("plan (GetTransferPlan, per decode rank)", [x["plan_s"] * 1e3 for x in ranks]),
        ("NIXL read (post + poll, per decode rank)", [x["read_s"] * 1e3 for x in ranks]),
        ("report (ReportTransfer, per decode rank)", [x["report_s"] * 1e3 for x in ranks]),
        ("release (report -> prefill rank notified)", release),
        ("decode: verify every byte", [r.verify_s * 1e3 for r in done]),
        ("end to end (publish -> last release)", end_to_end),
    ]
