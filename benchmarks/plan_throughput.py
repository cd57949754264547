"""GetTransferPlan throughput and latency on loopback.

Starts ``pdbroker serve`` as its own process, registers a prefill and a decode engine of a
Nemotron-3-Nano-like model (fake addresses: the broker never touches memory), publishes
``--plans / decode_tp`` transfers of ``--tokens`` tokens, then runs ``--clients`` concurrent
decode clients (asyncio gRPC stubs spread over ``--client-procs`` processes). Client *c* acts
as decode rank ``c % decode_tp`` and asks for its plan of its share of the transfers, so each
transfer is planned once per decode rank, as in serving. Prints plans/s, the latency
percentiles of single calls measured at the client, and CPU time per call of the broker and
of the clients. ``--baseline`` then times as many ``ListEngines`` calls the same way: what
Python gRPC alone costs on this machine at that moment, the ceiling for any RPC.

    .venv/bin/python benchmarks/plan_throughput.py --clients 4 --plans 20000 --baseline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.convert import rank_layout_to_proto
from broker.layout import EngineLayout
from broker.presets import resolve_model
from broker.scenarios import build_scenario
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc

TARGET_PLANS_PER_S = 2_000
TARGET_P99_MS = 5.0


def register(
    stub: pb_grpc.BrokerStub, layout: EngineLayout, engine_id: str, role: int, first_addr: int
) -> None:
    """Register every rank with fake, disjoint regions of exactly the layout's size."""
    for r, rank in enumerate(layout.ranks):
        stride = rank.region_bytes + (1 << 20)
        base = first_addr + r * rank.num_regions * stride
        stub.RegisterRank(
            pb.RegisterRankRequest(
                engine_id=engine_id,
                role=role,
                tp_size=layout.tp_size,
                tp_rank=r,
                agent_name=f"{engine_id}-{r}",
                agent_metadata=b"m" * 4096,
                regions=[
                    pb.Region(
                        base_addr=base + i * stride,
                        length_bytes=rank.region_bytes,
                        device_id=r,
                        memory_kind=pb.MEMORY_KIND_VRAM,
                    )
                    for i in range(rank.num_regions)
                ],
                layout=rank_layout_to_proto(rank),
                model_fingerprint=layout.model,
            )
        )


async def _client(
    address: str,
    rank: int,
    transfers: list[str],
    decode_ids: list[pb.BlockIds],
    start_at: float,
    baseline: bool,
) -> list[int]:
    """Ask for the plan of each transfer as decode rank ``rank`` (with ``baseline``, call
    ``ListEngines`` as often instead); returns each call's latency in ns."""
    latencies = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.BrokerStub(channel)
        await channel.channel_ready()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        for transfer_id in transfers:
            if baseline:
                call, request = stub.ListEngines, pb.ListEnginesRequest()
            else:
                call = stub.GetTransferPlan
                request = pb.GetTransferPlanRequest(
                    transfer_id=transfer_id, engine_id="D", tp_rank=rank, block_ids=decode_ids
                )
            t0 = time.perf_counter_ns()
            await call(request)
            latencies.append(time.perf_counter_ns() - t0)
    return latencies


def _client_process(
    address: str,
    jobs: list[tuple[int, list[str]]],
    decode_ids: list[list[int]],
    start_at: float,
    baseline: bool,
    out: mp.Queue,
) -> None:
    """One process running several concurrent clients; sends back latencies (ns), the
    instant its last call finished and its CPU seconds, or the error that stopped it."""
    ids = [pb.BlockIds(ids=g) for g in decode_ids]

    async def main() -> list[int]:
        results = await asyncio.gather(
            *(
                _client(address, rank, transfers, ids, start_at, baseline)
                for rank, transfers in jobs
            )
        )
        return [x for r in results for x in r]

    cpu = time.process_time()
    try:
        latencies = asyncio.run(main())
        out.put((latencies, time.time(), time.process_time() - cpu))
    except grpc.RpcError as exc:
        out.put((f"{exc.code()}: {exc.details()}", time.time(), 0.0))


@dataclass
class Run:
    """One timed phase: latencies (ms), wall time (s), CPU seconds of broker and clients."""

    latencies_ms: np.ndarray
    seconds: float
    broker_cpu_s: float
    client_cpu_s: float

    @property
    def per_s(self) -> float:
        return self.latencies_ms.size / self.seconds

    def summary(self, prefix: str) -> dict[str, float]:
        p50, p90, p99 = np.percentile(self.latencies_ms, [50, 90, 99])
        n = self.latencies_ms.size
        return {
            f"{prefix}calls": n,
            f"{prefix}seconds": round(self.seconds, 3),
            f"{prefix}per_s": round(self.per_s, 1),
            f"{prefix}p50_ms": round(p50, 3),
            f"{prefix}p90_ms": round(p90, 3),
            f"{prefix}p99_ms": round(p99, 3),
            f"{prefix}max_ms": round(float(self.latencies_ms.max()), 3),
            f"{prefix}broker_cpu_us": round(self.broker_cpu_s / n * 1e6, 1),
            f"{prefix}client_cpu_us": round(self.client_cpu_s / n * 1e6, 1),
        }


def run_clients(
    broker_pid: int,
    address: str,
    jobs: list[tuple[int, list[str]]],
    decode_ids: list[list[int]],
    client_procs: int,
    baseline: bool,
) -> Run:
    """Start the client processes, let them begin together, collect what they measured."""
    start_at = time.time() + 1.0
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_process,
            args=(address, jobs[k::client_procs], decode_ids, start_at, baseline, out),
        )
        for k in range(client_procs)
    ]
    for p in procs:
        p.start()
    broker_cpu = cpu_seconds(broker_pid)  # clients wait for start_at: nothing timed yet
    results = [out.get() for _ in procs]
    broker_cpu = cpu_seconds(broker_pid) - broker_cpu
    for p in procs:
        p.join()
    errors = [r for r, _, _ in results if isinstance(r, str)]
    if errors:
        raise SystemExit(f"a client failed: {errors[0]}")
    latencies = np.array([x for r, _, _ in results for x in r], dtype=np.float64) / 1e6
    return Run(
        latencies,
        max(end for _, end, _ in results) - start_at,
        broker_cpu,
        sum(c for _, _, c in results),
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_broker(plans: int) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "broker.cli",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--max-transfers",
        str(plans + 1000),
        "--default-ttl-ms",
        "600000",
        "--lease-ttl-ms",
        "600000",
        "--log-level",
        "WARNING",
    ]  # no keep-alives needed
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"broker did not start: {line!r}")
    return proc, match.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--clients", type=int, default=4, help="concurrent decode clients")
    parser.add_argument("--client-procs", type=int, default=1, help="processes running them")
    parser.add_argument("--plans", type=int, default=20_000, help="GetTransferPlan calls timed")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls first")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="then time as many ListEngines calls: the cost of gRPC alone on this machine",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.clients % args.decode_tp:
        parser.error("--clients must be a multiple of --decode-tp")

    sc = build_scenario(resolve_model(args.model), args.prefill_tp, args.decode_tp, args.tokens)
    proc, address = start_broker(args.plans + args.warmup)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            register(stub, sc.prefill, "P", pb.ROLE_PREFILL, 0x7F00_0000_0000)
            register(stub, sc.decode, "D", pb.ROLE_DECODE, 0x7E00_0000_0000)
            per_rank = -(-args.plans // args.decode_tp)
            warm = -(-args.warmup // args.decode_tp)
            p_ids = [pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids]
            d_ids = [pb.BlockIds(ids=g) for g in sc.request.decode_block_ids]
            for i in range(warm + per_rank):
                stub.PublishBlocks(
                    pb.PublishBlocksRequest(
                        transfer_id=f"t{i}",
                        engine_id="P",
                        block_ids=p_ids,
                        num_tokens=sc.request.num_tokens,
                    )
                )
            sample = None
            for i in range(warm):
                for d in range(args.decode_tp):
                    sample = stub.GetTransferPlan(
                        pb.GetTransferPlanRequest(
                            transfer_id=f"t{i}", engine_id="D", tp_rank=d, block_ids=d_ids
                        )
                    )
        # Client c is decode rank c % decode_tp and takes every (clients/decode_tp)-th transfer.
        per_rank_clients = args.clients // args.decode_tp
        timed = [f"t{i}" for i in range(warm, warm + per_rank)]
        jobs = [
            (c % args.decode_tp, timed[c // args.decode_tp :: per_rank_clients])
            for c in range(args.clients)
        ]
        decode_ids = [list(g) for g in sc.request.decode_block_ids]
        plans = run_clients(proc.pid, address, jobs, decode_ids, args.client_procs, False)
        floor = None
        if args.baseline:
            floor = run_clients(proc.pid, address, jobs, decode_ids, args.client_procs, True)
    finally:
        proc.terminate()
        proc.wait(10)

    summary = {
        "model": args.model,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "tokens": args.tokens,
        "clients": args.clients,
        "client_procs": args.client_procs,
        "descriptors_per_plan": int(sample.num_descriptors) if sample else 0,
        "bytes_per_plan": int(sample.total_bytes) if sample else 0,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    } | plans.summary("plan_")
    if floor is not None:
        summary |= floor.summary("list_engines_")
    met = summary["plan_per_s"] >= TARGET_PLANS_PER_S and summary["plan_p99_ms"] < TARGET_P99_MS
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
        for name, run in (("GetTransferPlan", plans), ("ListEngines (gRPC floor)", floor)):
            if run is None:
                continue
            p50, p99 = np.percentile(run.latencies_ms, [50, 99])
            n = run.latencies_ms.size
            print(
                f"{name}: {n} calls in {run.seconds:.3f} s = {run.per_s:,.0f}/s; "
                f"p50 {p50:.3f} ms  p99 {p99:.3f} ms  max {run.latencies_ms.max():.3f} ms; "
                f"CPU per call: broker {run.broker_cpu_s / n * 1e6:.0f} us, "
                f"clients {run.client_cpu_s / n * 1e6:.0f} us"
            )
        print(
            f"target (>= {TARGET_PLANS_PER_S} plans/s, p99 < {TARGET_P99_MS} ms): "
            f"{'met' if met else 'NOT met'}"
        )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
