"""``pdbroker demo``: the main job. A broker, prefill and decode engines as separate processes
with real NIXL agents (UCX over loopback, DRAM) and real model layouts move N requests through
publish → plan → NIXL read → report → release; decode checks every byte of its memory against
what its own layout says it must hold. Exits 0 only if every byte matched and every release
arrived; the last line is ``demo: <N> transfers, <B> bytes verified, <M> mismatches``, or with
``--json`` the run's figures are one JSON object on stdout. Decode asks for the plans of every
rank of the requests waiting for it in one call and reports them in one call; ``--per-rank``
makes one call per rank instead.

Each run has its own run id, part of every transfer id, so runs against the same brokers
(``--broker``) never collide; ``--seed`` makes the token counts and byte patterns repeatable.

With ``--trace`` every process exports its spans over OTLP to a receiver inside the demo,
which then prints the span tree of the first transfer, one span per line:
``<indent><service.name> <span name> <duration ms>``; running brokers (``--broker``) export
their spans elsewhere, if at all, and a last line says so when none of theirs arrived.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
from typing import TYPE_CHECKING

import numpy as np

from broker.commands.options import broker_addresses, positive_int

if TYPE_CHECKING:
    from harness.brokers import RunningBrokers
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
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=8,
        help="transfers to run (round-robin over the pairs)",
    )
    p.add_argument(
        "--inflight",
        type=positive_int,
        default=2,
        help="requests per engine pair between publish and release (sizes the KV caches)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds token counts, byte patterns and block order (not the run id)",
    )
    p.add_argument(
        "--broker",
        type=broker_addresses,
        metavar="ADDR[,ADDR...]",
        help="run the engines against these running brokers (plaintext replicas sharing "
        "a store, started with 'pdbroker serve --store redis://... --insecure') instead of "
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
    p.add_argument(
        "--json",
        action="store_true",
        help="print the run's figures as one JSON object instead of the report",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from broker.presets import resolve_model
    from harness.fleet import PairSpec, run_fleet

    pairs = [
        PairSpec(label, resolve_model(name), p_tp, d_tp, lo, hi)
        for label, name, p_tp, d_tp, lo, hi in PAIRS
    ]
    brokers = _running_brokers(args.broker) if args.broker else None
    run_id = secrets.token_hex(4)
    receiver = None
    if args.trace:
        from harness.trace_receiver import TraceReceiver

        receiver = TraceReceiver()
    spans: list[ReceivedSpan] = []
    with receiver or contextlib.nullcontext():
        if receiver is not None:
            os.environ.update(receiver.environment())  # inherited by every process of the fleet
        report = run_fleet(
            pairs,
            args.requests,
            inflight=args.inflight,
            seed=args.seed,
            on_progress=_progress_bar,
            broker=brokers,
            run_id=run_id,
            per_rank=args.per_rank,
        )
        if receiver is not None:
            spans = receiver.spans()  # complete: every process flushed its spans on exit
    print(file=sys.stderr)
    summary = demo_summary(report, run_id, args.seed)
    running = ",".join(args.broker) if args.broker else None
    trace = format_trace(spans, report.requests[0].transfer_id, running) if args.trace else ""
    if args.json:
        if args.trace:
            summary["trace"] = trace.splitlines()
        print(json.dumps(summary))
    else:
        print(format_report(summary))
        if args.trace:
            print()
            print(trace)
    for problem in report.problems():
        print(f"pdbroker demo: {problem}", file=sys.stderr)
    if not args.json:
        print(
            f"demo: {summary['transfers']} transfers, {summary['bytes_verified']:,} bytes "
            f"verified, {summary['mismatches']} mismatches"
        )
    return 0 if report.ok else 1


def _running_brokers(addresses: list[str]) -> RunningBrokers:
    """The brokers of ``--broker``, once one of them answered the plaintext engines."""
    from broker.client_security import speaks_tls
    from broker.errors import UsageError
    from harness.brokers import RunningBrokers

    brokers = RunningBrokers(addresses)
    try:
        brokers.list_engines()
    except RuntimeError as exc:
        tls = [a for a in addresses if speaks_tls(a)]
        if tls:
            raise UsageError(
                "--broker",
                f"{', '.join(tls)} serve TLS; the demo's engines connect in plaintext, to "
                "brokers started with --insecure",
            ) from None
        raise SystemExit(f"pdbroker demo: error: --broker: {exc}") from None
    return brokers


def format_trace(spans: list[ReceivedSpan], transfer_id: str, broker: str | None = None) -> str:
    """A heading and the span tree of ``transfer_id``'s trace (found by its publish span);
    a last line when none of its spans came from ``broker`` (the running brokers' addresses,
    or None for the demo's own)."""
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
    if broker and not any(s.kind == "SERVER" for s in spans if s.trace_id == trace_id):
        lines.append(
            f"no spans from the broker at {broker}: it exports spans only when started with "
            "OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER) set, to that collector"
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


#: (key in the JSON's ``stages``, row of the report) of each stage timed.
STAGES = (
    ("fill", "prefill: fill pages with the pattern"),
    ("publish", "publish (PublishBlocks)"),
    ("plan", "plan (GetTransferPlan, per decode rank)"),
    ("read", "NIXL read (post + poll, per decode rank)"),
    ("report", "report (ReportTransfer, per decode rank)"),
    ("release", "release (report -> prefill rank notified)"),
    ("verify", "decode: verify every byte"),
    ("end_to_end", "end to end (publish -> last release)"),
)
_PAIR_SUMS = (
    ("bytes", "nbytes"),
    ("naive_bytes", "naive_bytes"),
    ("descriptors", "num_descriptors"),
    ("vllm_descriptors", "vllm_descriptors"),
)


def demo_summary(report: FleetReport, run_id: str, seed: int) -> dict:
    """The run's figures, JSON-ready: sizes in bytes, stage latencies in ms."""
    fetched = [r for r in report.requests if r.fetched]
    pairs = []
    for i, pair in enumerate(report.pairs):
        ranks = [rank for r in fetched if r.pair == i for rank in r.ranks]
        pairs.append(
            {
                "label": " ".join(pair.label.split()),
                "model": pair.model.name,
                "prefill_tp": pair.prefill_tp,
                "decode_tp": pair.decode_tp,
                "min_tokens": pair.min_tokens,
                "max_tokens": pair.max_tokens,
                "transfers": sum(r.pair == i for r in fetched),
                **{key: sum(rank[name] for rank in ranks) for key, name in _PAIR_SUMS},
            }
        )
    stages = {}
    for key, values in _stages(report).items():
        points = np.percentile(values, [50, 90, 99, 100]) if values else [None] * 4
        stages[key] = {"n": len(values)} | {
            name: None if v is None else round(float(v), 3)
            for name, v in zip(("p50_ms", "p90_ms", "p99_ms", "max_ms"), points)
        }
    read_s = sum(rank["read_s"] for r in report.requests for rank in r.ranks)
    return {
        "run_id": run_id,
        "seed": seed,
        "ok": report.ok,
        "requests": len(report.requests),
        "transfers": len(fetched),
        "bytes_verified": sum(r.nbytes for r in fetched),
        "mismatches": report.mismatches,
        "wall_s": round(report.wall_s, 3),
        "engine_processes": 2 * len(report.pairs),
        "nixl_agents": sum(p.prefill_tp + p.decode_tp for p in report.pairs),
        "pairs": pairs,
        "stages": stages,
        "read_bytes_per_s": round(report.nbytes / read_s) if read_s else None,
        "registered_bytes": sum(
            rank.region_bytes * rank.num_regions
            for pair_layouts in report.layouts
            for layout in pair_layouts
            for rank in layout.ranks
        ),
        "checked_bytes": sum(r.checked_bytes for r in report.requests),
        "expected_bytes": sum(r.expected_bytes for r in report.requests),
        "releases": sum(len(r.releases) for r in report.requests),
        "releases_completed": sum(
            why == "completed" for r in report.requests for why, _ in r.releases.values()
        ),
        "notifications": report.notifications,
        "expected_notifications": report.expected_notifications,
        "leftover_engines": list(report.leftover_engines),
        "problems": report.problems(),
    }


def format_report(s: dict) -> str:
    """Pairs, volumes and savings, per-stage latency percentiles, and the checks made."""
    lines = [
        (
            f"pdbroker demo (run {s['run_id']}): {s['requests']} requests, {len(s['pairs'])} "
            f"P/D pairs, broker + {s['engine_processes']} engine processes, {s['nixl_agents']} "
            f"NIXL agents (UCX, DRAM), {s['wall_s']:.1f} s"
        ),
        "",
    ]
    widths = [44, 8, 12, 10, 18, 12, 20]
    header = ["pair", "requests", "tokens", "moved MB", "naive MB", "descriptors"]
    lines.append(_row([*header, "vLLM descriptors"], widths))
    for pair in s["pairs"]:
        tokens = f"{pair['min_tokens']:,}-{pair['max_tokens']:,}"
        lines.append(_row([pair["label"], str(pair["transfers"]), tokens, *_volumes(pair)], widths))
    totals = {key: sum(p[key] for p in s["pairs"]) for key, _ in _PAIR_SUMS}
    lines.append(_row(["total", str(s["transfers"]), "", *_volumes(totals)], widths))
    lines += ["", _row(["stage latency (ms)", "n", "p50", "p90", "p99", "max"], _STAGE_WIDTHS)]
    for key, label in STAGES:
        stage = s["stages"][key]
        cells = [
            "-" if stage[name] is None else f"{stage[name]:,.2f}"
            for name in ("p50_ms", "p90_ms", "p99_ms", "max_ms")
        ]
        lines.append(_row([label, str(stage["n"]), *cells], _STAGE_WIDTHS))
    rate = s["read_bytes_per_s"]
    lines += [
        "",
        "NIXL read throughput: " + (f"{rate / 1e9:,.2f} GB/s summed over reads" if rate else "-"),
        (
            f"KV memory registered: {s['registered_bytes'] / _MB:,.0f} MB; decode memory "
            f"compared byte by byte: {s['checked_bytes'] / _MB:,.0f} MB "
            f"({s['expected_bytes']:,} state bytes expected, {s['mismatches']:,} mismatches)"
        ),
        (
            f"releases: {s['releases_completed']:,}/{s['releases']:,} completed; NIXL "
            f"completion notifications at prefill: {s['notifications']:,}/"
            f"{s['expected_notifications']:,}; engines registered after close: "
            f"{len(s['leftover_engines'])}"
        ),
    ]
    return "\n".join(lines)


_STAGE_WIDTHS = [44, 6, 9, 9, 9, 9]


def _volumes(sums: dict) -> list[str]:
    moved, naive = sums["bytes"], sums["naive_bytes"]
    descriptors, vllm = sums["descriptors"], sums["vllm_descriptors"]
    saved = f" (-{100 * (1 - moved / naive):.1f}%)" if naive else ""
    fewer = f" ({vllm / descriptors:.1f}x)" if descriptors else ""
    return [
        f"{moved / _MB:,.1f}",
        f"{naive / _MB:,.1f}{saved}",
        f"{descriptors:,}",
        f"{vllm:,}{fewer}",
    ]


def _stages(report: FleetReport) -> dict[str, list[float]]:
    """Per-stage latencies in ms, by :data:`STAGES` key. Release: from the last report of a
    prefill rank's readers to that rank receiving its release (both on the host's monotonic
    clock)."""
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
    return {
        "fill": [r.fill_s * 1e3 for r in done],
        "publish": [r.publish_s * 1e3 for r in done],
        "plan": [x["plan_s"] * 1e3 for x in ranks],
        "read": [x["read_s"] * 1e3 for x in ranks],
        "report": [x["report_s"] * 1e3 for x in ranks],
        "release": release,
        "verify": [r.verify_s * 1e3 for r in done],
        "end_to_end": end_to_end,
    }
