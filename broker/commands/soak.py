"""pdbroker soak: a bounded load run against a real pdbroker serve process.

Prefill and decode engines (the client library over a transport that moves no memory) spread
over worker processes push transfers through publish, plan, report and release for --seconds
(600 by default), mostly on the happy path, some failed, reported twice, aborted or left to
expire. Then the run drains and checks that every published transfer was released exactly
once by every prefill rank and that the broker holds no unfinished transfer. Broker RSS is
sampled every second; its growth is judged only after a warm-up that ends once RSS levels
off, and a run too short for that says memory was not judged. Progress goes to stderr, the
result to stdout. Exits 1 when a transfer leaked or was released twice, an RPC or release was
not what its path expects, or the RSS grew by 10% or more after the warm-up."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from broker.commands.options import positive_float, positive_int
from broker.console import Progress
from broker.errors import UsageError

if TYPE_CHECKING:
    from harness.brokers import BrokerProcess
    from harness.soak import Fleet, WorkerResult

#: Broker retention of finished transfers (ms): short, so its steady state comes in the warm-up.
RETENTION_MS = 5_000
#: Load duration (s) without ``--seconds``.
DEFAULT_SECONDS = 600
#: Offered load (transfers/s): 120k transfers in the default 10 minutes, with headroom for
#: the broker and the clients on a 2-core host (docs/BENCHMARKS.md has the CPU per transfer).
DEFAULT_RATE = 200.0
#: Seconds for the broker and workers to start, and for workers to drain after the load.
STARTUP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 60.0
#: How often the broker's RSS is sampled (s), and how many samples the result lists.
RSS_SAMPLE_S = 1.0
RSS_TIMELINE_POINTS = 10


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "soak",
        help="drive a real broker with P x D ranks for a while; check releases and memory",
        description=__doc__,
    )
    p.add_argument(
        "--seconds",
        type=positive_float,
        default=DEFAULT_SECONDS,
        help="seconds of load, before the drain (default: %(default)g)",
    )
    p.add_argument("--prefill-ranks", type=positive_int, default=8, help="prefill ranks in all")
    p.add_argument("--decode-ranks", type=positive_int, default=8, help="decode ranks in all")
    p.add_argument("--prefill-tp", type=positive_int, default=1, help="ranks per prefill engine")
    p.add_argument("--decode-tp", type=positive_int, default=1, help="ranks per decode engine")
    p.add_argument("--model", default="qwen3.5-0.8b", help="a preset name")
    p.add_argument(
        "--min-tokens", type=positive_int, default=256, help="fewest tokens of a transfer"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=8192, help="most tokens of a transfer"
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=2,
        help="client processes (at most one per prefill and per decode engine)",
    )
    p.add_argument("--lanes", type=positive_int, default=16, help="concurrent transfers per worker")
    p.add_argument(
        "--rate", type=float, default=DEFAULT_RATE, help="transfers started a second; 0: no limit"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the transfers' sizes and paths")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the broker's warnings too (its errors always show)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.brokers import BrokerProcess
    from harness.soak import Fleet

    if args.prefill_ranks % args.prefill_tp:
        raise UsageError("--prefill-ranks", "must be a multiple of --prefill-tp")
    if args.decode_ranks % args.decode_tp:
        raise UsageError("--decode-ranks", "must be a multiple of --decode-tp")
    if args.rate < 0:
        raise UsageError("--rate", "must not be negative")
    if args.max_tokens < args.min_tokens:
        raise UsageError("--max-tokens", "must not be below --min-tokens")
    prefill_engines = args.prefill_ranks // args.prefill_tp
    decode_engines = args.decode_ranks // args.decode_tp
    log_level = "WARNING" if args.verbose else "ERROR"
    with Progress("pdbroker soak") as progress:
        progress.phase(
            f"{args.seconds:g} s of load (--seconds; default {DEFAULT_SECONDS:g}), then the "
            "drain; starting the broker"
        )
        broker = BrokerProcess("--retention-ms", str(RETENTION_MS), "--log-level", log_level)
        try:
            fleet = Fleet(
                broker.address,
                args.model,
                prefill_engines,
                args.prefill_tp,
                decode_engines,
                args.decode_tp,
                args.min_tokens,
                max(args.min_tokens, args.max_tokens),
                min(args.workers, prefill_engines, decode_engines),
                args.lanes,
                args.rate,
            )
            summary = _soak(broker, fleet, args.seconds, args.seed, progress)
        finally:
            broker.stop()
    summary |= {
        "prefill_ranks": args.prefill_ranks,
        "decode_ranks": args.decode_ranks,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "model": args.model,
        "rate": args.rate,
    }
    failed = (
        summary["leaked"] or summary["double_released"] or summary["errors"] or summary["rss_grew"]
    )
    print(json.dumps(summary) if args.json else _table(summary))
    return 1 if failed else 0


def _soak(
    broker: BrokerProcess, fleet: Fleet, seconds: float, seed: int, progress: Progress
) -> dict:
    """Start the workers, run the load, sample the broker's RSS, collect and check."""
    from harness.soak import worker_main

    progress.phase(f"starting {fleet.workers} worker processes")
    ctx = mp.get_context("spawn")
    conns: list[Connection] = []
    procs = []
    try:
        for index in range(fleet.workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(fleet, index, seed, child),
                daemon=True,
                name=f"soak-worker-{index}",
            )
            proc.start()
            child.close()
            conns.append(parent)
            procs.append(proc)
        _gather(conns, "ready", STARTUP_TIMEOUT_S)
        progress.phase(f"load for {seconds:g} s")
        started = time.monotonic()
        deadline = started + seconds
        cpu_at_start = _cpu_seconds(broker.process.pid)
        for conn in conns:
            conn.send(("go", started, deadline))
        rss = _sample_rss(broker.process.pid, started, deadline, progress)
        broker_cpu_s = _cpu_seconds(broker.process.pid) - cpu_at_start
        progress.phase("draining: waiting for every transfer's releases")
        results: list[WorkerResult] = _gather(conns, "result", DRAIN_TIMEOUT_S)
        duration_s = time.monotonic() - started
        progress.phase("checking that the broker holds no transfer")
        in_flight = _unfinished_transfers(broker.address)
        for conn in conns:
            conn.send(("close",))
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    return _summary(results, in_flight, rss, duration_s, seconds, broker_cpu_s)


def _gather(conns: list[Connection], kind: str, timeout_s: float) -> list:
    """The payload of message ``kind`` from every worker, in worker order."""
    got: dict[int, object] = {}
    until = time.monotonic() + timeout_s
    while len(got) < len(conns):
        pending = [c for i, c in enumerate(conns) if i not in got]
        # typeshed types wait() as returning any kind of waitable; it returns the ready
        # ones of the objects it was given.
        ready = cast("list[Connection]", wait(pending, max(0.0, until - time.monotonic())))
        if not ready:
            raise SystemExit(f"pdbroker soak: error: no {kind!r} from a worker in {timeout_s:g} s")
        for conn in ready:
            try:
                message = conn.recv()
            except EOFError:
                raise SystemExit("pdbroker soak: error: a worker exited") from None
            if message[0] == "error":
                raise SystemExit(f"pdbroker soak: error: a worker failed:\n{message[1]}")
            got[conns.index(conn)] = message[1] if len(message) > 1 else None
    return [got[i] for i in range(len(conns))]


def _sample_rss(
    pid: int, started: float, end_at: float, progress: Progress
) -> list[tuple[float, int]]:
    """Broker RSS (seconds since ``started``, bytes) every ``RSS_SAMPLE_S`` until ``end_at``."""
    from harness.bench_engines import rss_bytes

    samples = []
    while (now := time.monotonic()) < end_at:
        time.sleep(min(RSS_SAMPLE_S, end_at - now))
        samples.append((time.monotonic() - started, rss_bytes(pid)))
        progress.update(
            f"load {samples[-1][0]:.0f}/{end_at - started:.0f} s, "
            f"broker RSS {samples[-1][1] / 2**20:.1f} MiB"
        )
    return samples


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _unfinished_transfers(address: str) -> list[str]:
    """Transfers the broker still holds unfinished (``ListTransfers``)."""
    import grpc

    from broker.v1 import broker_pb2 as pb
    from broker.v1 import broker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        listing = pb_grpc.BrokerStub(channel).ListTransfers(pb.ListTransfersRequest(), timeout=30)
    return [t.transfer_id for t in listing.transfers]


def _summary(
    results: list[WorkerResult],
    in_flight: list[str],
    rss: list[tuple[float, int]],
    duration_s: float,
    seconds: float,
    broker_cpu_s: float,
) -> dict:
    from harness.soak_memory import judge_memory

    plans = np.array([x for r in results for x in r.plan_latencies_ms])
    transfer_ms = np.array([x for r in results for x in r.transfer_latencies_ms])
    leaked = set(in_flight).union(*(r.unreleased for r in results))
    transfers = sum(r.transfers for r in results)
    memory = judge_memory(rss)
    measured = [b for t, b in rss if memory.warmup_s is None or t >= memory.warmup_s]
    rss_end = rss[-1][1]
    timeline = [rss[len(rss) * k // RSS_TIMELINE_POINTS][1] for k in range(RSS_TIMELINE_POINTS)]
    paths: dict[str, int] = {}
    for r in results:
        for path, count in r.paths.items():
            paths[path] = paths.get(path, 0) + count
    return {
        "transfers": transfers,
        "leaked": len(leaked),
        "double_released": sum(r.double_released for r in results),
        "rss_growth_pct": memory.growth_pct,
        "rss_grew": memory.grew,
        "memory": memory.describe(),
        "p99_ms": round(float(np.percentile(plans, 99)), 3) if plans.size else None,
        "transfers_per_s": round(transfers / duration_s, 1),
        "plans": int(plans.size),
        "plans_per_s": round(plans.size / duration_s, 1),
        "p50_ms": round(float(np.percentile(plans, 50)), 3) if plans.size else None,
        "transfer_p99_ms": (
            round(float(np.percentile(transfer_ms, 99)), 3) if transfer_ms.size else None
        ),
        "errors": sum(r.errors for r in results),
        "error_samples": [e for r in results for e in r.error_samples],
        "leaked_sample": sorted(leaked)[:10],
        "paths": paths,
        "rss_warm_mib": round(measured[0] / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_peak_mib": round(max(measured) / 2**20, 1),
        "rss_timeline_mib": [round(b / 2**20, 1) for b in timeline + [rss_end]],
        "broker_cpu_pct": round(100 * broker_cpu_s / seconds, 1),
        "seconds": seconds,
        "warmup_s": None if memory.warmup_s is None else round(memory.warmup_s, 1),
        "duration_s": round(duration_s, 1),
        "workers": len(results),
        "cpus": os.cpu_count(),
    }


def _table(s: dict) -> str:
    paths = ", ".join(f"{k} {v}" for k, v in sorted(s["paths"].items()))
    lines = [
        (
            f"soak: {s['prefill_ranks']} prefill x {s['decode_ranks']} decode ranks "
            f"(TP{s['prefill_tp']} -> TP{s['decode_tp']}, {s['model']}), {s['seconds']:g} s "
            f"offering {f'{rate:g}' if (rate := s['rate']) else 'unlimited'} transfers/s, "
            f"{s['duration_s']:g} s with the drain"
        ),
        f"  transfers        {s['transfers']:>10,}  ({s['transfers_per_s']:,.1f}/s; {paths})",
        (
            f"  plans            {s['plans']:>10,}  ({s['plans_per_s']:,.1f}/s; "
            f"p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms)"
        ),
        f"  leaked           {s['leaked']:>10}",
        f"  double released  {s['double_released']:>10}",
        f"  errors           {s['errors']:>10}",
        f"  memory           {s['memory']}",
        (
            f"  broker RSS       {s['rss_warm_mib']} MiB "
            f"{'after the warm-up' if s['warmup_s'] is not None else 'at the start'} -> "
            f"{s['rss_end_mib']} MiB at the end, peak {s['rss_peak_mib']} MiB"
        ),
        f"  broker CPU       {s['broker_cpu_pct']:>9.1f}%",
    ]
    lines += [f"  error: {e}" for e in s["error_samples"]]
    return "\n".join(lines)
