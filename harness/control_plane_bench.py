"""The control plane under load: ``GetTransferPlan`` throughput and latency over gRPC, and what
a new prefill/decode pair costs before its first plan (``pdbroker bench control-plane``,
``benchmarks/plan_throughput.py``).

A broker runs as its own process (``pdbroker serve --insecure``, optionally under cProfile).
A prefill engine ``P`` and a decode engine ``D`` of a scenario register every rank with fake,
disjoint regions (the broker never touches memory) and ``P`` publishes transfers. Decode
clients, each an asyncio gRPC stub on its own channel, spread over a few processes, then ask
for plans: every transfer once per decode rank, as in serving, the first ask claiming it
(which plans every decode rank). Latencies are single calls measured at the client; CPU time
per call of the broker comes from ``/proc``. A baseline phase times ``ListEngines`` the same
way: what Python gRPC alone costs on the machine at that moment.

First contact: a brand-new decode engine registers all its ranks (each on its own new
channel, concurrently, as separate worker processes would) and its rank 0 asks for the plan
of a published transfer, timed until the plan, carrying the prefill ranks' agent metadata,
is in hand.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import multiprocessing.synchronize
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from broker.layout import EngineLayout
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import rank_layout_to_proto
from harness.scenarios import Scenario

TARGET_PLANS_PER_S = 2_000
TARGET_P99_MS = 5.0
#: Calls a second no phase exceeds on this class of machine (a no-op gRPC call peaks at
#: ~2,300/s on 2 cores): sizes the transfers published for a timed phase.
MAX_CALLS_PER_S = 4_000
PREFILL_ADDR, DECODE_ADDR = 0x7F00_0000_0000, 0x7E00_0000_0000
#: A decode job: (transfer id, decode rank asking).
Job = tuple[str, int]


def registrations(
    layout: EngineLayout, engine_id: str, role: int, first_addr: int
) -> list[pb.RegisterRankRequest]:
    """Every rank's registration, with fake, disjoint regions of exactly the layout's size."""
    requests = []
    for r, rank in enumerate(layout.ranks):
        stride = rank.region_bytes + (1 << 20)
        base = first_addr + r * rank.num_regions * stride
        regions = [
            pb.Region(
                base_addr=base + i * stride,
                length_bytes=rank.region_bytes,
                device_id=r,
                memory_kind=pb.MEMORY_KIND_VRAM,
            )
            for i in range(rank.num_regions)
        ]
        requests.append(
            pb.RegisterRankRequest(
                engine_id=engine_id,
                role=role,
                tp_size=layout.tp_size,
                tp_rank=r,
                agent_name=f"{engine_id}-{r}",
                agent_metadata=b"m" * 4096,
                regions=regions,
                layout=rank_layout_to_proto(rank),
                model_fingerprint=layout.model,
            )
        )
    return requests


def register(
    stub: pb_grpc.BrokerStub, layout: EngineLayout, engine_id: str, role: int, first_addr: int
) -> None:
    """Register every rank of ``layout`` as ``engine_id`` (see :func:`registrations`)."""
    for request in registrations(layout, engine_id, role, first_addr):
        stub.RegisterRank(request)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_broker(max_transfers: int, profile: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``pdbroker serve --insecure`` on a free loopback port (under cProfile writing
    ``profile`` when it stops, if given); returns the process and its address."""
    python = [sys.executable]
    if profile:
        python += ["-m", "cProfile", "-o", str(profile)]
    cmd = [
        *python,
        "-m",
        "broker.cli",
        "serve",
        "--insecure",
        "--listen",
        "127.0.0.1:0",
        "--max-transfers",
        str(max_transfers),
        "--default-ttl-ms",
        "600000",
        "--lease-ttl-ms",
        "600000",
        "--log-level",
        "WARNING",
    ]  # leases outlast the run: no keep-alives needed
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"broker did not start: {line!r}")
    return proc, match.group(1)


def stop_broker(proc: subprocess.Popen) -> None:
    """SIGTERM (the broker stops cleanly, cProfile writes its file), then wait."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def publish(address: str, sc: Scenario, transfer_ids: Sequence[str], concurrency: int = 16) -> None:
    """``P`` publishes ``sc``'s request as each of ``transfer_ids``, ``concurrency`` at once."""
    ids = [pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids]

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.BrokerStub(channel)

            async def lane(lane_ids: Sequence[str]) -> None:
                for transfer_id in lane_ids:
                    await stub.PublishBlocks(
                        pb.PublishBlocksRequest(
                            transfer_id=transfer_id,
                            engine_id="P",
                            block_ids=ids,
                            num_tokens=sc.request.num_tokens,
                        )
                    )

            await asyncio.gather(*(lane(transfer_ids[k::concurrency]) for k in range(concurrency)))

    asyncio.run(main())


def assign(transfer_ids: Sequence[str], decode_tp: int, clients: int) -> list[list[Job]]:
    """Every (transfer, decode rank) ask, dealt round-robin to ``clients`` clients: with a
    multiple of ``decode_tp`` clients, client *c* is decode rank ``c % decode_tp``."""
    jobs = [(t, d) for t in transfer_ids for d in range(decode_tp)]
    return [jobs[c::clients] for c in range(clients)]


async def _calls(
    stub: pb_grpc.BrokerStub,
    jobs: list[Job],
    decode_ids: list[pb.BlockIds],
    stop_at: float,
    baseline: bool,
) -> tuple[list[int], bool]:
    """Ask for each job's plan (``baseline``: call ``ListEngines`` as often instead) until
    ``stop_at`` (``perf_counter``); returns each call's latency in ns and whether the jobs
    ran out first."""
    latencies = []
    for transfer_id, rank in jobs:
        if time.perf_counter() >= stop_at:
            return latencies, False
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
    return latencies, math.isfinite(stop_at)


def _client_process(
    address: str,
    jobs: list[list[Job]],
    decode_ids: list[list[int]],
    seconds: float,
    baseline: bool,
    ready: mp.Queue,
    go: mp.synchronize.Event,
    out: mp.Queue,
) -> None:
    """One process running one client (its own channel) per entry of ``jobs``: connects
    them, says it is ready, starts them at ``go``, stops them after ``seconds``; sends back
    (latencies in ns, the instant its last call finished, its CPU seconds from ``go``,
    whether a client ran out of jobs), or (the error that stopped it, ...)."""
    ids = [pb.BlockIds(ids=g) for g in decode_ids]

    async def main() -> tuple[list[int], float, float, bool]:
        channels = [grpc.aio.insecure_channel(address) for _ in jobs]
        try:
            stubs = [pb_grpc.BrokerStub(c) for c in channels]
            await asyncio.gather(*(s.ListEngines(pb.ListEnginesRequest()) for s in stubs))
            ready.put(os.getpid())  # connected and warm
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            cpu, stop_at = time.process_time(), time.perf_counter() + seconds
            results = await asyncio.gather(
                *(_calls(s, j, ids, stop_at, baseline) for s, j in zip(stubs, jobs))
            )
            end, cpu = time.time(), time.process_time() - cpu
        finally:
            await asyncio.gather(*(c.close() for c in channels))
        latencies = [x for r, _ in results for x in r]
        return latencies, end, cpu, any(ran_out for _, ran_out in results)

    try:
        out.put(asyncio.run(main()))
    except grpc.RpcError as exc:
        ready.put(os.getpid())
        out.put((f"{exc.code()}: {exc.details()}", time.time(), 0.0, False))


@dataclass
class Run:
    """One timed phase: latencies (ms), wall time (s), CPU seconds of broker and clients,
    whether a client ran out of jobs before the phase's end."""

    latencies_ms: np.ndarray
    seconds: float
    broker_cpu_s: float
    client_cpu_s: float
    ran_out: bool

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
    jobs: list[list[Job]],
    decode_ids: list[list[int]],
    client_procs: int,
    baseline: bool,
    seconds: float = math.inf,
) -> Run:
    """One client per entry of ``jobs`` over ``client_procs`` processes, started together
    once all are connected and stopped after ``seconds`` (default: when their jobs are
    done); what they measured. Broker CPU counts from the start to the last result."""
    ctx = mp.get_context("spawn")
    ready: mp.Queue = ctx.Queue()
    out: mp.Queue = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(
            target=_client_process,
            args=(address, jobs[k::client_procs], decode_ids, seconds, baseline, ready, go, out),
        )
        for k in range(client_procs)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    broker_cpu, start = cpu_seconds(broker_pid), time.time()
    go.set()
    results = [out.get() for _ in procs]
    broker_cpu = cpu_seconds(broker_pid) - broker_cpu
    for p in procs:
        p.join()
    errors = [r for r, *_ in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]}")
    latencies = np.array([x for r, *_ in results for x in r], dtype=np.float64) / 1e6
    return Run(
        latencies,
        max(end for _, end, _, _ in results) - start,
        broker_cpu,
        sum(cpu for _, _, cpu, _ in results),
        any(ran_out for *_, ran_out in results),
    )


async def _first_contact(
    address: str, sc: Scenario, engine_id: str, transfer_id: str
) -> tuple[float, float]:
    """Seconds from ``engine_id``'s first RegisterRank to all its ranks registered and to its
    rank 0's plan of ``transfer_id`` in hand, with every source's agent metadata."""
    requests = registrations(sc.decode, engine_id, pb.ROLE_DECODE, DECODE_ADDR)
    decode_ids = [pb.BlockIds(ids=g) for g in sc.request.decode_block_ids]
    start = time.perf_counter()
    channels = [grpc.aio.insecure_channel(address) for _ in requests]
    try:
        stubs = [pb_grpc.BrokerStub(c) for c in channels]
        await asyncio.gather(*(s.RegisterRank(r) for s, r in zip(stubs, requests)))
        registered = time.perf_counter() - start
        plan = await stubs[0].GetTransferPlan(
            pb.GetTransferPlanRequest(
                transfer_id=transfer_id, engine_id=engine_id, tp_rank=0, block_ids=decode_ids
            )
        )
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    if not plan.sources or not all(s.remote_agent_metadata for s in plan.sources):
        raise RuntimeError("the first plan of a new decode engine lacks agent metadata")
    return registered, elapsed


def first_contact(address: str, sc: Scenario, pairs: int) -> list[tuple[float, float]]:
    """Per each of ``pairs`` brand-new decode engines, seconds from its first RegisterRank to
    all its ranks registered and to its first plan (one pair at a time, each with a transfer
    ``P`` published for it)."""
    transfer_ids = [f"first-contact-{i}" for i in range(pairs)]
    publish(address, sc, transfer_ids)
    return [
        asyncio.run(_first_contact(address, sc, f"D-new-{i}", t))
        for i, t in enumerate(transfer_ids)
    ]


def control_plane(
    sc: Scenario,
    clients: Sequence[int],
    seconds: float,
    client_procs: int,
    pairs: int,
    baseline: bool,
    profile: Path | None = None,
) -> dict:
    """Per client count, ``GetTransferPlan`` over ``seconds`` (and ``ListEngines`` alike with
    ``baseline``), then first contact of ``pairs`` new decode engines; one broker."""
    load_before = os.getloadavg()[0]
    d_tp = sc.decode.tp_size
    per_phase = math.ceil(seconds * MAX_CALLS_PER_S / d_tp)  # transfers
    warmup = [f"warm-{i}" for i in range(20)]
    proc, address = start_broker(per_phase * len(clients) + len(warmup) + pairs + 100, profile)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            register(stub, sc.prefill, "P", pb.ROLE_PREFILL, PREFILL_ADDR)
            register(stub, sc.decode, "D", pb.ROLE_DECODE, DECODE_ADDR)
            publish(address, sc, warmup)
            decode_ids = [list(g) for g in sc.request.decode_block_ids]
            for transfer_id, rank in assign(warmup, d_tp, 1)[0]:  # the pair's planner warm
                plan = stub.GetTransferPlan(
                    pb.GetTransferPlanRequest(
                        transfer_id=transfer_id,
                        engine_id="D",
                        tp_rank=rank,
                        block_ids=[pb.BlockIds(ids=g) for g in decode_ids],
                    )
                )
        phases = []
        for k, n in enumerate(clients):
            transfer_ids = [f"c{k}-{i}" for i in range(per_phase)]
            publish(address, sc, transfer_ids)
            procs = min(n, client_procs)
            jobs = assign(transfer_ids, d_tp, n)
            plans = run_clients(proc.pid, address, jobs, decode_ids, procs, False, seconds)
            phase = {"clients": n, "client_procs": procs, "ran_out": plans.ran_out}
            phase |= plans.summary("plan_")
            if baseline:
                floor = run_clients(proc.pid, address, jobs, decode_ids, procs, True, seconds)
                phase |= floor.summary("list_engines_")
            phases.append(phase)
        contact = first_contact(address, sc, pairs)
    finally:
        stop_broker(proc)
    total_ms = [s * 1e3 for _, s in contact]
    return {
        "model": sc.model.name,
        "prefill_tp": sc.prefill.tp_size,
        "decode_tp": d_tp,
        "tokens": sc.request.num_tokens,
        "descriptors_per_plan": int(plan.num_descriptors),
        "bytes_per_plan": int(plan.total_bytes),
        "seconds_per_phase": seconds,
        "cpus": os.cpu_count(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "phases": phases,
        "first_contact": {
            "pairs": pairs,
            "median_ms": round(statistics.median(total_ms), 2),
            "p90_ms": round(float(np.percentile(total_ms, 90)), 2),
            "max_ms": round(max(total_ms), 2),
            "registered_median_ms": round(statistics.median(s * 1e3 for s, _ in contact), 2),
            "samples_ms": [round(x, 2) for x in total_ms],
        },
    }
