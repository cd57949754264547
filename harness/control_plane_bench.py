"""The control plane under load: ``GetTransferPlan`` throughput and latency over gRPC, and what
a new prefill/decode pair costs before its first plan (``pdbroker bench control-plane``,
``benchmarks/plan_throughput.py``).

A broker runs as its own process (``pdbroker serve --insecure``, optionally under cProfile).
Every engine is the client library over :class:`~clients.transport.NoMemoryTransport`
(fake, disjoint regions: the broker never touches memory), so the broker sees the calls
engines make. This process hosts a prefill engine ``P`` and a decode engine ``D`` of a
scenario (:class:`BenchEngines`); ``P`` publishes the transfers, ``D`` warms the broker up.
Decode clients, each an :class:`~clients.decode.AsyncDecodeClient` on its own channel,
spread over a few processes, then ask for plans: every transfer once per decode rank, as in
serving, the first ask claiming it (which plans every decode rank). Client *c* hosts the
ranks it asks as (:func:`client_ranks`) of a decode engine of its phase, registered and
warmed up (one plan per hosted rank) before the timing starts. Latencies are single calls
measured at the client; CPU time per call of the broker comes from ``/proc``. A baseline
phase times ``ListEngines`` the same way, through the same client: what Python gRPC alone
costs on the machine at that moment.

First contact: a brand-new decode engine registers all its ranks (one client per rank, each
on its own new channel, concurrently, as separate worker processes would) and its rank 0
asks for the plan of a published transfer, timed until the plan, carrying the prefill
ranks' agent metadata, is in hand.
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

from broker.console import Progress
from broker.layout import EngineLayout
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import Role
from clients import protocol
from clients.decode import AsyncDecodeClient
from clients.prefill import AsyncPrefillClient
from clients.protocol import call
from clients.session import LoopThread
from clients.transport import NoMemoryTransport, fake_memory
from harness.scenarios import Scenario

TARGET_PLANS_PER_S = 2_000
TARGET_P99_MS = 5.0
#: Calls a second no phase exceeds on this class of machine (a no-op gRPC call peaks at
#: ~2,300/s on 2 cores): sizes the transfers published for a timed phase.
MAX_CALLS_PER_S = 4_000
PREFILL_ADDR, DECODE_ADDR = 0x7F00_0000_0000, 0x7E00_0000_0000
#: Address space of each decode engine's fake regions (below DECODE_ADDR's).
DECODE_ADDRESS_SPAN = 1 << 40
#: Size of each rank's agent metadata (bytes; NIXL's is a few KiB).
AGENT_METADATA_BYTES = 4096
#: Deadline of one RPC (seconds).
CALL_TIMEOUT_S = 30.0
#: How often ``P`` polls its agents (seconds): nobody reads, nothing needs the polls.
POLL_INTERVAL_S = 1.0
#: A decode job: (transfer id, decode rank asking).
Job = tuple[str, int]


def registrations(
    layout: EngineLayout, engine_id: str, role: Role, first_addr: int
) -> list[pb.RegisterRankRequest]:
    """Every rank's registration, with fake, disjoint regions of exactly the layout's size
    from ``first_addr`` on (:func:`~clients.transport.fake_memory`), as the clients build it."""
    return [
        protocol.registration(
            rank,
            regions,
            engine_id=engine_id,
            role=role,
            tp_size=layout.tp_size,
            agent_name=f"{engine_id}-{rank.tp_rank}",
            agent_metadata=b"m" * AGENT_METADATA_BYTES,
            model_fingerprint=layout.model,
        )
        for rank, regions in zip(layout.ranks, fake_memory(layout, first_addr).values())
    ]


def register(
    stub: pb_grpc.BrokerStub, layout: EngineLayout, engine_id: str, role: Role, first_addr: int
) -> None:
    """Register every rank of ``layout`` as ``engine_id`` (see :func:`registrations`) over a
    blocking stub, without lease renewals (the broker's leases must outlast the run)."""
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
        "--max-transfers-per-engine",
        str(max_transfers),
        "--default-ttl-ms",
        "600000",
        "--lease-ttl-ms",
        "600000",
        "--log-level",
        "ERROR",
    ]  # leases outlast the run; the engines leaving at its end fail what they held (warnings)
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


class BenchEngines:
    """``P`` (every prefill rank of ``sc``) and ``D`` (every decode rank) in this process, on
    a loop thread: ``P`` publishes, ``D`` warms the broker up and samples a plan."""

    def __init__(self, address: str, sc: Scenario) -> None:
        self.sc = sc
        transport = NoMemoryTransport(AGENT_METADATA_BYTES)
        self.prefill = AsyncPrefillClient(
            address,
            "P",
            sc.prefill,
            fake_memory(sc.prefill, PREFILL_ADDR),
            progress_interval_s=POLL_INTERVAL_S,
            idle_interval_s=POLL_INTERVAL_S,
            call_timeout_s=CALL_TIMEOUT_S,
            transport=transport,
        )
        self.decode = AsyncDecodeClient(
            address,
            "D",
            sc.decode,
            fake_memory(sc.decode, DECODE_ADDR),
            call_timeout_s=CALL_TIMEOUT_S,
            transport=transport,
        )
        self._loop = LoopThread("bench-engines")
        try:
            self._loop.run(self.prefill.start())
            self._loop.run(self.decode.start())
        except BaseException:
            self.close()
            raise

    def publish(self, transfer_ids: Sequence[str], concurrency: int = 16) -> None:
        """``P`` publishes the scenario's request as each of ``transfer_ids``, ``concurrency``
        at once."""
        request = self.sc.request

        async def lane(lane_ids: Sequence[str]) -> None:
            for transfer_id in lane_ids:
                await self.prefill.publish(
                    transfer_id, request.prefill_block_ids, request.num_tokens
                )

        async def lanes() -> None:
            await asyncio.gather(*(lane(transfer_ids[k::concurrency]) for k in range(concurrency)))

        self._loop.run(lanes())

    def plan(self, transfer_ids: Sequence[str]) -> pb.GetTransferPlanResponse:
        """``D`` plans each transfer on every rank in turn; returns the last plan."""

        async def plans() -> pb.GetTransferPlanResponse:
            for transfer_id, rank in assign(transfer_ids, self.sc.decode.tp_size, 1)[0]:
                plan = await self.decode.plan(rank, transfer_id, self.sc.request.decode_block_ids)
            return plan

        return self._loop.run(plans())

    def close(self) -> None:
        """Deregister both engines (the broker must still run) and stop the loop thread."""
        try:
            self._loop.run(self.decode.close())
            self._loop.run(self.prefill.close())
        finally:
            self._loop.close()


def assign(transfer_ids: Sequence[str], decode_tp: int, clients: int) -> list[list[Job]]:
    """Every (transfer, decode rank) ask, dealt round-robin to ``clients`` clients: with a
    multiple of ``decode_tp`` clients, client *c* is decode rank ``c % decode_tp``."""
    jobs = [(t, d) for t in transfer_ids for d in range(decode_tp)]
    return [jobs[c::clients] for c in range(clients)]


def client_ranks(clients: int, decode_tp: int) -> list[tuple[int, tuple[int, ...]]]:
    """Per client, the decode engine (an index) and its ranks the client hosts: the ranks
    :func:`assign` deals it. With a multiple of ``decode_tp`` clients, client *c* hosts rank
    ``c % decode_tp`` of engine ``c // decode_tp`` (transfer *i* goes to engine
    ``i % (clients // decode_tp)``); with a divisor, every client hosts some ranks of one
    engine. ``ValueError`` for other counts."""
    if clients % decode_tp == 0:
        return [(c // decode_tp, (c % decode_tp,)) for c in range(clients)]
    if decode_tp % clients == 0:
        return [(0, tuple(range(c, decode_tp, clients))) for c in range(clients)]
    raise ValueError(
        f"clients: {clients} is neither a multiple nor a divisor of decode TP {decode_tp}"
    )


@dataclass(frozen=True)
class ClientSpec:
    """One decode client: engine ``engine_id`` (its fake memory from ``first_addr``), the
    ranks it hosts, the transfer each plans before the timing (none: no warm-up), its jobs."""

    engine_id: str
    first_addr: int
    ranks: tuple[int, ...]
    warm_transfer: str
    jobs: list[Job]


def client_specs(
    phase: str, transfer_ids: Sequence[str], decode_tp: int, clients: int, warm: bool
) -> list[ClientSpec]:
    """The decode clients of a phase (engines named after ``phase``), with their jobs over
    ``transfer_ids``; ``warm``: each engine plans its transfer ``<phase>-warm-<engine>``
    (:func:`warm_transfers`) once per rank first."""
    jobs = assign(transfer_ids, decode_tp, clients)
    return [
        ClientSpec(
            f"{phase}-D{e}",
            DECODE_ADDR - (e + 1) * DECODE_ADDRESS_SPAN,
            ranks,
            f"{phase}-warm-{e}" if warm else "",
            jobs[c],
        )
        for c, (e, ranks) in enumerate(client_ranks(clients, decode_tp))
    ]


def warm_transfers(specs: Sequence[ClientSpec]) -> list[str]:
    """The transfers the clients of ``specs`` warm up with, each once."""
    return sorted({s.warm_transfer for s in specs if s.warm_transfer})


async def _calls(
    client: AsyncDecodeClient,
    jobs: list[Job],
    decode_ids: list[list[int]],
    stop_at: float,
    baseline: bool,
) -> tuple[list[int], bool]:
    """Ask for each job's plan (``baseline``: call ``ListEngines`` as often instead) until
    ``stop_at`` (``perf_counter``); returns each call's latency in ns and whether the jobs
    ran out first."""
    latencies: list[int] = []
    list_engines = pb.ListEnginesRequest()
    for transfer_id, rank in jobs:
        if time.perf_counter() >= stop_at:
            return latencies, False
        t0 = time.perf_counter_ns()
        if baseline:
            await call(client.stub, "ListEngines", list_engines, CALL_TIMEOUT_S)
        else:
            await client.plan(rank, transfer_id, decode_ids)
        latencies.append(time.perf_counter_ns() - t0)
    return latencies, math.isfinite(stop_at)


def _client_process(
    address: str,
    specs: list[ClientSpec],
    layout: EngineLayout,
    decode_ids: list[list[int]],
    seconds: float,
    baseline: bool,
    ready: mp.Queue,
    warm: mp.synchronize.Event,
    go: mp.synchronize.Event,
    out: mp.Queue,
) -> None:
    """One process running one decode client (its own channel) per entry of ``specs``:
    registers them and says so on ``ready``, warms them up at ``warm`` (every process's
    ranks registered) and says so again, starts them at ``go``, stops them after
    ``seconds``; sends back (latencies in ns, the instant its last call finished, its CPU
    seconds from ``go``, whether a client ran out of jobs), or (the error that stopped it,
    ...). The engines stay registered when it exits (their leases outlast the run, as
    ``P``'s): deregistering would fail the transfers they claimed and stream those releases
    to ``P`` while the next phase runs."""
    transport = NoMemoryTransport(AGENT_METADATA_BYTES)
    said: list[int] = []  # what went on ``ready``

    def say() -> None:
        said.append(os.getpid())
        ready.put(os.getpid())

    async def main() -> tuple[list[int], float, float, bool]:
        clients = [
            AsyncDecodeClient(
                address,
                s.engine_id,
                layout,
                {r: fake_memory(layout, s.first_addr)[r] for r in s.ranks},
                call_timeout_s=CALL_TIMEOUT_S,
                transport=transport,
            )
            for s in specs
        ]
        await asyncio.gather(*(c.start() for c in clients))
        say()  # registered
        await asyncio.get_running_loop().run_in_executor(None, warm.wait)
        for client, spec in zip(clients, specs):
            if spec.warm_transfer:
                for rank in spec.ranks:
                    await client.plan(rank, spec.warm_transfer, decode_ids)
        say()  # warm
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        cpu, stop_at = time.process_time(), time.perf_counter() + seconds
        results = await asyncio.gather(
            *(_calls(c, s.jobs, decode_ids, stop_at, baseline) for c, s in zip(clients, specs))
        )
        end, cpu = time.time(), time.process_time() - cpu
        latencies = [x for r, _ in results for x in r]
        return latencies, end, cpu, any(ran_out for _, ran_out in results)

    try:
        out.put(asyncio.run(main()))
    except (grpc.RpcError, protocol.BrokerCallError) as exc:
        while len(said) < 2:  # the parent waits for both
            say()
        out.put((str(exc), time.time(), 0.0, False))


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
    specs: list[ClientSpec],
    layout: EngineLayout,
    decode_ids: list[list[int]],
    client_procs: int,
    baseline: bool,
    seconds: float = math.inf,
) -> Run:
    """One decode client per entry of ``specs`` (engines of ``layout``) over
    ``client_procs`` processes, started together once all are registered and warm and
    stopped after ``seconds`` (default: when their jobs are done); what they measured.
    Broker CPU counts from the start to the last result."""
    ctx = mp.get_context("spawn")
    ready: mp.Queue = ctx.Queue()
    out: mp.Queue = ctx.Queue()
    warm, go = ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(
            target=_client_process,
            args=(
                address,
                specs[k::client_procs],
                layout,
                decode_ids,
                seconds,
                baseline,
                ready,
                warm,
                go,
                out,
            ),
        )
        for k in range(client_procs)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()  # registered
    warm.set()
    for _ in procs:
        ready.get()  # warm
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
    transport = NoMemoryTransport(AGENT_METADATA_BYTES)
    memory = fake_memory(sc.decode, DECODE_ADDR)
    clients = [
        AsyncDecodeClient(
            address,
            engine_id,
            sc.decode,
            {r: memory[r]},
            call_timeout_s=CALL_TIMEOUT_S,
            transport=transport,
        )
        for r in range(sc.decode.tp_size)
    ]
    start = time.perf_counter()
    try:
        await asyncio.gather(*(c.start() for c in clients))
        registered = time.perf_counter() - start
        plan = await clients[0].plan(0, transfer_id, sc.request.decode_block_ids)
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    if not plan.sources or not all(s.remote_agent_metadata for s in plan.sources):
        raise RuntimeError("the first plan of a new decode engine lacks agent metadata")
    return registered, elapsed


def first_contact(
    address: str, engines: BenchEngines, sc: Scenario, pairs: int
) -> list[tuple[float, float]]:
    """Per each of ``pairs`` brand-new decode engines, seconds from its first RegisterRank to
    all its ranks registered and to its first plan (one pair at a time, each with a transfer
    ``P`` published for it)."""
    transfer_ids = [f"first-contact-{i}" for i in range(pairs)]
    engines.publish(transfer_ids)
    return [
        asyncio.run(_first_contact(address, sc, f"D-new-{i}", t))
        for i, t in enumerate(transfer_ids)
    ]


def control_plane(
    sc: Scenario,
    progress: Progress,
    clients: Sequence[int],
    seconds: float,
    client_procs: int,
    pairs: int,
    baseline: bool,
    profile: Path | None = None,
) -> dict:
    """Per client count, ``GetTransferPlan`` over ``seconds`` (and ``ListEngines`` alike with
    ``baseline``), then first contact of ``pairs`` new decode engines; one broker."""
    d_tp = sc.decode.tp_size
    for n in clients:
        client_ranks(n, d_tp)  # a count that maps onto no decode engine fails before the run
    load_before = os.getloadavg()[0]
    per_phase = math.ceil(seconds * MAX_CALLS_PER_S / d_tp)  # transfers
    warmup = [f"warm-{i}" for i in range(20)]
    warm_count = sum(len(client_ranks(n, d_tp)) for n in clients)  # at most one per engine
    progress.phase("starting the broker")
    proc, address = start_broker(
        per_phase * len(clients) + len(warmup) + warm_count + pairs + 100, profile
    )
    decode_ids = [list(g) for g in sc.request.decode_block_ids]
    try:
        engines = BenchEngines(address, sc)
        try:
            engines.publish(warmup)
            plan = engines.plan(warmup)  # the pair's planner warm
            phases = []
            for k, n in enumerate(clients):
                progress.phase(f"{n} clients ({k + 1}/{len(clients)}), {seconds:g} s")
                transfer_ids = [f"c{k}-{i}" for i in range(per_phase)]
                specs = client_specs(f"c{k}", transfer_ids, d_tp, n, warm=True)
                engines.publish(transfer_ids + warm_transfers(specs))
                procs = min(n, client_procs)
                plans = run_clients(
                    proc.pid, address, specs, sc.decode, decode_ids, procs, False, seconds
                )
                phase: dict[str, object] = {
                    "clients": n,
                    "client_procs": procs,
                    "ran_out": plans.ran_out,
                }
                phase |= plans.summary("plan_")
                if baseline:
                    progress.phase(f"{n} clients ({k + 1}/{len(clients)}), ListEngines floor")
                    specs = client_specs(f"c{k}-floor", transfer_ids, d_tp, n, warm=False)
                    floor = run_clients(
                        proc.pid, address, specs, sc.decode, decode_ids, procs, True, seconds
                    )
                    phase |= floor.summary("list_engines_")
                phases.append(phase)
            progress.phase(f"first contact of {pairs} new decode engines")
            contact = first_contact(address, engines, sc, pairs)
        finally:
            engines.close()
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
