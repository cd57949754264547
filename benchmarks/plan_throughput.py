"""GetTransferPlan (or, with ``--batch``, GetTransferPlans) throughput and latency on loopback.

Starts ``pdbroker serve`` as its own process, registers a prefill and a decode engine of a
Nemotron-3-Nano-like model (fake addresses: the broker never touches memory), publishes
``--plans / decode_tp`` transfers of ``--tokens`` tokens, then runs ``--clients`` concurrent
decode clients (each on its own channel, spread over ``--client-procs`` processes), which ask
for every transfer's plan once per decode rank, as in serving (with a multiple of
``decode_tp`` clients, client *c* is rank ``c % decode_tp`` of its own decode engine). Prints plans/s, the latency
percentiles of single calls measured at the client, and CPU time per call of the broker and
of the clients. ``--baseline`` then times as many ``ListEngines`` calls the same way: what
Python gRPC alone costs on this machine at that moment, the ceiling for any RPC. Every
engine and client is the client library over a transport that moves no memory; the
machinery is :mod:`harness.bench_clients`; ``pdbroker bench control-plane`` sweeps
client counts with it.

    .venv/bin/python benchmarks/plan_throughput.py --clients 4 --plans 20000 --baseline
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.presets import resolve_model
from harness.bench_clients import client_specs, run_clients, warm_transfers
from harness.bench_engines import BenchEngines, start_broker, stop_broker
from harness.control_plane_bench import TARGET_P99_MS, TARGET_PLANS_PER_S, TARGET_RANK_PLANS_PER_S
from harness.scenarios import build_scenario


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--clients", type=int, default=4, help="concurrent decode clients")
    parser.add_argument("--client-procs", type=int, default=1, help="processes running them")
    parser.add_argument("--plans", type=int, default=20_000, help="rank-plans timed")
    parser.add_argument("--batch", type=int, default=1, help="rank-plans per call (1: unary)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls first")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="then time as many ListEngines calls: the cost of gRPC alone on this machine",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    sc = build_scenario(resolve_model(args.model), args.prefill_tp, args.decode_tp, args.tokens)
    per_rank = -(-args.plans // args.decode_tp)
    warm = -(-args.warmup // args.decode_tp)
    transfer_ids = [f"t{i}" for i in range(per_rank)]
    specs = client_specs("timed", transfer_ids, args.decode_tp, args.clients, True, args.batch)
    decode_ids = [list(g) for g in sc.request.decode_block_ids]
    proc, address = start_broker(per_rank + warm + len(specs) + 1000)
    try:
        engines = BenchEngines(address, sc)
        try:
            warmup = [f"warm-{i}" for i in range(warm)]
            engines.publish(warmup + transfer_ids + warm_transfers(specs))
            sample = engines.plan(warmup) if warmup else None
            plans, _ = run_clients(
                proc.pid,
                address,
                specs,
                sc.decode,
                decode_ids,
                args.client_procs,
                args.batch,
                False,
            )
            floor = None
            if args.baseline:
                specs = client_specs("floor", transfer_ids, args.decode_tp, args.clients, False)
                floor, _ = run_clients(
                    proc.pid, address, specs, sc.decode, decode_ids, args.client_procs, 1, True
                )
        finally:
            engines.close()
    finally:
        stop_broker(proc)

    summary = {
        "model": args.model,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "tokens": args.tokens,
        "clients": args.clients,
        "batch": args.batch,
        "client_procs": args.client_procs,
        "descriptors_per_plan": int(sample.num_descriptors) if sample else 0,
        "bytes_per_plan": int(sample.total_bytes) if sample else 0,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    } | plans.summary("plan_")
    if floor is not None:
        summary |= floor.summary("list_engines_")
    target = TARGET_PLANS_PER_S if args.batch == 1 else TARGET_RANK_PLANS_PER_S
    met = summary["plan_per_s"] >= target and summary["plan_p99_ms"] < TARGET_P99_MS
    if args.json:
        print(json.dumps(summary | {"target_met": met}))
    else:
        print(
            f"{args.model} {args.tokens} tokens, P TP{args.prefill_tp} -> D TP{args.decode_tp}: "
            f"{summary['descriptors_per_plan']} descriptors, {summary['bytes_per_plan']:,} bytes "
            f"per plan"
        )
        print(
            f"{args.clients} clients in {args.client_procs} process(es) on {summary['cpus']} "
            f"CPUs (1-min load average at the end: {summary['load_average_1m']:.2f})"
        )
        method = "GetTransferPlan" if args.batch == 1 else f"GetTransferPlans x {args.batch}"
        for name, run in ((method, plans), ("ListEngines (gRPC floor)", floor)):
            if run is None:
                continue
            p50, p99 = np.percentile(run.latencies_ms, [50, 99])
            n = run.entries
            print(
                f"{name}: {run.latencies_ms.size} calls, {n} entries in {run.seconds:.3f} s = "
                f"{run.per_s:,.0f}/s; per call p50 {p50:.3f} ms  p99 {p99:.3f} ms  max "
                f"{run.latencies_ms.max():.3f} ms; CPU per entry: broker "
                f"{run.broker_cpu_s / n * 1e6:.0f} us, clients {run.client_cpu_s / n * 1e6:.0f} us"
            )
        print(
            f"target (>= {target:,} rank-plans/s, p99 < {TARGET_P99_MS} ms): "
            f"{'met' if met else 'NOT met'}"
        )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
