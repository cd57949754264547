"""The control plane under load: ``GetTransferPlan`` and ``ReportTransfer`` throughput and
latency over gRPC, unary and batched (``GetTransferPlans``, ``ReportTransfers``), what a new
prefill/decode pair costs before its first plan, and the calls a transfer takes
(``pdbroker bench control-plane``, ``benchmarks/plan_throughput.py``).

A broker runs as its own process (``pdbroker serve --insecure``, optionally under cProfile).
Every engine is the client library over :class:`~clients.transport.NoMemoryTransport`
(fake, disjoint regions: the broker never touches memory), so the broker sees the calls
engines make. This process hosts a prefill engine ``P`` and a decode engine ``D`` of a
scenario (:class:`~harness.bench_engines.BenchEngines`); ``P`` publishes the transfers, ``D`` warms the broker up.
Decode clients, each an :class:`~clients.decode.AsyncDecodeClient` on its own channel,
spread over a few processes, then ask for plans: every transfer once per decode rank, as in
serving, the first ask claiming it (which plans every decode rank), and check each plan as a
rank does before posting its reads (:func:`~clients.plan_check.check_each`: a rank's plans of
a call at once). At batch 1 each
client asks one plan per call (``GetTransferPlan``) and hosts the ranks it asks as
(:func:`~harness.bench_clients.client_ranks`), as a decode engine's worker processes do; at batch *K* each client is
a decode engine of its own hosting every rank, as its scheduler does, and asks *K* (transfer,
rank) entries per ``GetTransferPlans`` call, every rank of a transfer in the same call,
once as unary calls and once as exchanges on each client's ``EngineSession`` stream, one
phase after the other (:data:`WAYS`; ``session_vs_calls`` sets the two side by side). Each
client's engine is registered and warmed up (one plan per hosted rank) before the timing
starts. Then the clients report every plan they got DONE, *K* per call (``ReportTransfer`` at
batch 1, ``ReportTransfers`` beyond), timed apart from the plans. Latencies are single calls
measured at the client; CPU time per plan or report of the broker comes from ``/proc``, of
the clients from their processes' CPU clocks. A baseline phase times ``ListEngines`` the same
way, through the same client: what Python gRPC alone costs on the machine at that moment.
The machinery: :mod:`harness.bench_engines` (the broker process, ``P`` and ``D``) and
:mod:`harness.bench_clients` (the timed clients).

First contact: a brand-new decode engine registers all its ranks and gets every rank's plan
of a published transfer, timed until they are in hand with the prefill ranks' agent
metadata: per rank (one client per rank, each on its own new channel, concurrently, as
separate worker processes would, each asking ``GetTransferPlan`` for its rank), and batched
(one client hosting every rank asks every rank's plan in one ``GetTransferPlans`` call), new
engines alternating between the two.

Calls per transfer (:func:`calls_per_transfer`): the unary calls a prefill and a decode
engine make to move one transfer, counted at the clients, fetching rank by rank
(:meth:`~clients.decode.AsyncDecodeClient.fetch`) and batched
(:meth:`~clients.decode.AsyncDecodeClient.fetch_many`).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from broker.console import Progress
from clients.decode import AsyncDecodeClient, Fetch, FetchAsk, FetchError, PlanAsk
from clients.protocol import BrokerCallError
from clients.transport import NoMemoryTransport, fake_memory
from harness.bench_clients import client_ranks, client_specs, run_clients, warm_transfers
from harness.bench_engines import (
    AGENT_METADATA_BYTES,
    CALL_TIMEOUT_S,
    DECODE_ADDR,
    BenchEngines,
    start_broker,
    stop_broker,
)
from harness.scenarios import Scenario

TARGET_PLANS_PER_S = 2_000
TARGET_P99_MS = 5.0
#: Batched targets: rank-plans a second at the realistic batch with p99 per call under
#: TARGET_P99_MS, at least TARGET_SPEEDUP times the unary path's.
TARGET_RANK_PLANS_PER_S = 10_000
TARGET_SPEEDUP = 5.0
#: Most a decode engine's CPU per request may be, as a share of vLLM's own decode-side work.
TARGET_ENGINE_CPU_SHARE = 0.5
#: Most calls one transfer may take at TP8 -> TP8 (publish, plans, reports).
TARGET_CALLS_PER_TRANSFER = 3
#: Transfers a decode engine's step starts loading at the realistic point: every rank of
#: each in one call (8 transfers x TP2 = a batch of 16).
REALISTIC_TRANSFERS = 8
#: Calls a second no phase exceeds on this class of machine (a no-op gRPC call peaks at
#: ~2,300/s on 2 cores), and rank-plans a second no batched phase exceeds: size the
#: transfers published for a timed phase.
MAX_CALLS_PER_S = 4_000
MAX_RANK_PLANS_PER_S = 15_000
#: How a batch larger than 1 reaches the broker: unary batched calls, or exchanges on each
#: client's EngineSession stream.
WAYS = ("calls", "session")
#: Figures of a session phase set against the calls phase of the same batch and clients.
SESSION_COMPARED = (
    "plan_per_s",
    "plan_p99_ms",
    "plan_broker_cpu_us",
    "plan_client_cpu_us",
    "report_per_s",
    "report_broker_cpu_us",
    "report_client_cpu_us",
    "engine_cpu_us_per_request",
)


async def _first_contact(
    address: str, sc: Scenario, engine_id: str, transfer_id: str, batched: bool
) -> tuple[float, float]:
    """Seconds from ``engine_id``'s first RegisterRank to all its ranks registered and to
    every rank's plan of ``transfer_id`` in hand, with every source's agent metadata: one
    client per rank, each asking ``GetTransferPlan`` for its rank at once, or one client
    hosting every rank asking one ``GetTransferPlans`` call (``batched``)."""
    transport = NoMemoryTransport(AGENT_METADATA_BYTES)
    memory = fake_memory(sc.decode, DECODE_ADDR)
    hosted = [memory] if batched else [{r: memory[r]} for r in range(sc.decode.tp_size)]
    clients = [
        AsyncDecodeClient(
            address,
            engine_id,
            sc.decode,
            ranks,
            call_timeout_s=CALL_TIMEOUT_S,
            transport=transport,
        )
        for ranks in hosted
    ]
    ids = sc.request.decode_block_ids
    start = time.perf_counter()
    try:
        await asyncio.gather(*(c.start() for c in clients))
        registered = time.perf_counter() - start
        if batched:
            asks = [PlanAsk(r, transfer_id, ids) for r in range(sc.decode.tp_size)]
            plans = await clients[0].plans(asks)
        else:
            plans = await asyncio.gather(
                *(c.plan(r, transfer_id, ids) for r, c in enumerate(clients))
            )
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    for plan in plans:
        if isinstance(plan, BrokerCallError):
            raise plan
        if not plan.sources or not all(s.remote_agent_metadata for s in plan.sources):
            raise RuntimeError("the first plan of a new decode engine lacks agent metadata")
    return registered, elapsed


def first_contact(
    address: str, engines: BenchEngines, sc: Scenario, pairs: int
) -> dict[str, list[tuple[float, float]]]:
    """Per each of ``pairs`` brand-new decode engines per way (``per_rank``, ``batched``,
    alternating), seconds from its first RegisterRank to all its ranks registered and to
    its first plan (one pair at a time, each with a transfer ``P`` published for it)."""
    transfer_ids = [f"first-contact-{i}" for i in range(2 * pairs)]
    engines.publish(transfer_ids)
    found: dict[str, list[tuple[float, float]]] = {"per_rank": [], "batched": []}
    for i, transfer_id in enumerate(transfer_ids):
        batched = i % 2 == 1
        found["batched" if batched else "per_rank"].append(
            asyncio.run(_first_contact(address, sc, f"D-new-{i}", transfer_id, batched))
        )
    return found


def first_contact_summary(samples: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Median, p90 and max (ms) of first contacts, and the median until registered."""
    total_ms = [s * 1e3 for _, s in samples]
    return {
        "pairs": len(samples),
        "median_ms": round(statistics.median(total_ms), 2),
        "p90_ms": round(float(np.percentile(total_ms, 90)), 2),
        "max_ms": round(max(total_ms), 2),
        "registered_median_ms": round(statistics.median(s * 1e3 for s, _ in samples), 2),
        "samples_ms": [round(x, 2) for x in total_ms],
    }


class CountingStub:
    """A client's stub that counts the unary calls made through it, by method."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.calls: Counter[str] = Counter()

    def __getattr__(self, method: str) -> Any:
        target = getattr(self._stub, method)
        if not method[:1].isupper() or method == "WatchReleases":
            return target

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[method] += 1
            return await target(*args, **kwargs)

        return counted


def calls_per_transfer(address: str, sc: Scenario, batch_transfers: int) -> dict[str, Any]:
    """The unary calls a prefill and a decode engine of ``sc`` (``P``, ``D`` of their own)
    make per transfer, counted at their clients: publish, then ``fetch`` (rank by rank),
    ``fetch_many`` of one transfer, and of ``batch_transfers`` at once; every fetch must
    move every rank's plan."""
    engines = BenchEngines(address, sc, prefix="count-")
    counters = []
    for client in (engines.prefill, engines.decode):
        counters.append(CountingStub(client.stub))
        client._stub = counters[-1]  # type: ignore[assignment]  # its calls from now on
    ids = sc.request.decode_block_ids

    async def per_rank(transfer_ids: list[str]) -> list[Fetch | FetchError]:
        return [await engines.decode.fetch(t, ids) for t in transfer_ids]

    async def batched(transfer_ids: list[str]) -> list[Fetch | FetchError]:
        return await engines.decode.fetch_many([FetchAsk(t, ids) for t in transfer_ids])

    found: dict[str, Any] = {"prefill_tp": sc.prefill.tp_size, "decode_tp": sc.decode.tp_size}
    try:
        for way, n, fetch in (
            ("per_rank", 1, per_rank),
            ("batched", 1, batched),
            (f"batched_{batch_transfers}", batch_transfers, batched),
        ):
            transfer_ids = [f"count-{way}-{i}" for i in range(n)]
            for counter in counters:
                counter.calls.clear()
            engines.publish(transfer_ids, concurrency=1)
            for outcome in engines.run(fetch(transfer_ids)):
                if isinstance(outcome, FetchError):
                    raise outcome
            calls = sum((counter.calls for counter in counters), Counter[str]())
            found[way] = {
                "transfers": n,
                "calls": dict(sorted(calls.items())),
                "per_transfer": round(sum(calls.values()) / n, 3),
            }
    finally:
        engines.close()
    return found


#: A phase's numbers that name it rather than measure it.
_NOT_MEDIANS = ("clients", "batch", "client_procs", "run")


def median_phases(phases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One phase per client count, batch and way, in first-run order: each figure the
    median of its runs' (``ran_out`` if any run ran out), the runs under ``runs``."""
    by_key: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for p in phases:
        by_key.setdefault((p["clients"], p["batch"], p["way"]), []).append(p)
    merged = []
    for runs in by_key.values():
        if len(runs) == 1:
            merged.append(runs[0])
            continue
        phase = dict(runs[0])
        for key, value in runs[0].items():
            if isinstance(value, bool):
                phase[key] = any(r[key] for r in runs)
            elif isinstance(value, (int, float)) and key not in _NOT_MEDIANS:
                phase[key] = round(statistics.median(r[key] for r in runs), 3)
        phase["runs"] = runs
        merged.append(phase)
    return merged


def realistic_batch(decode_tp: int) -> int:
    """Entries of a decode engine's plan call at the realistic point: every rank of
    :data:`REALISTIC_TRANSFERS` transfers."""
    return REALISTIC_TRANSFERS * decode_tp


def phase_transfers(seconds: float, batch: int, decode_tp: int) -> int:
    """Transfers to publish for a phase of ``seconds`` at ``batch`` entries a call: more
    than its clients can ask for in that time."""
    rank_plans_per_s = min(batch * MAX_CALLS_PER_S, MAX_RANK_PLANS_PER_S)
    return math.ceil(seconds * rank_plans_per_s / decode_tp)


def control_plane(
    sc: Scenario,
    progress: Progress,
    clients: Sequence[int],
    seconds: float,
    client_procs: int,
    pairs: int,
    baseline: bool,
    profile: Path | None = None,
    batches: Sequence[int] = (1,),
    count_sc: Scenario | None = None,
    ways: Sequence[str] = WAYS,
    rounds: int = 1,
) -> dict:
    """Per client count and batch size, plans over ``seconds`` and reports of them, a
    batch larger than 1 in each of ``ways`` (:data:`WAYS`) one after the other, ``rounds``
    times with the ways' order reversed every other round, each figure the median of the
    rounds' (and ``ListEngines`` alike per client count with ``baseline``), then first
    contact of ``pairs`` new decode engines per way, then the calls per transfer of
    ``count_sc``'s engines (if given); one broker."""
    d_tp = sc.decode.tp_size
    for n in clients:
        client_ranks(n, d_tp)  # a count that maps onto no decode engine fails before the run
    load_before = os.getloadavg()[0]
    warmup = [f"warm-{i}" for i in range(20)]
    runs = [
        (b, way)
        for r in range(rounds)
        for b in batches
        for way in (("calls",) if b == 1 else ways[:: -1 if r % 2 else 1])
    ]
    phase_sizes = {b: phase_transfers(seconds, b, d_tp) for b in batches}
    warm_count = len(clients) * len(runs) * max(clients)  # at most one per engine
    proc, address = start_broker(
        len(clients) * sum(phase_sizes[b] for b, _ in runs)
        + len(warmup)
        + warm_count
        + 2 * pairs
        + 2 * REALISTIC_TRANSFERS
        + 100,
        profile,
    )
    progress.phase("starting the broker")
    decode_ids = [list(g) for g in sc.request.decode_block_ids]
    floors, phases = [], []
    try:
        engines = BenchEngines(address, sc)
        try:
            engines.publish(warmup)
            plan = engines.plan(warmup)  # the pair's planner warm
            for k, n in enumerate(clients):
                procs = min(n, client_procs)
                for run, (batch, way) in enumerate(runs):
                    progress.phase(
                        f"{n} clients ({k + 1}/{len(clients)}), batch {batch} ({way}), "
                        f"{seconds:g} s" + (f", run {run + 1}/{len(runs)}" if rounds > 1 else "")
                    )
                    name = f"c{k}r{run}b{batch}{way}"
                    transfer_ids = [f"{name}-{i}" for i in range(phase_sizes[batch])]
                    specs = client_specs(name, transfer_ids, d_tp, n, True, batch)
                    engines.publish(transfer_ids + warm_transfers(specs))
                    plans, reports = run_clients(
                        proc.pid,
                        address,
                        specs,
                        sc.decode,
                        decode_ids,
                        procs,
                        batch,
                        False,
                        seconds,
                        session_stream=way == "session",
                    )
                    assert reports is not None
                    phase: dict[str, Any] = {
                        "clients": n,
                        "batch": batch,
                        "way": way,
                        "run": run,
                        "client_procs": procs,
                        "ran_out": plans.ran_out,
                    }
                    phase |= plans.summary("plan_") | reports.summary("report_")
                    phase["engine_cpu_us_per_request"] = round(
                        d_tp * (phase["plan_client_cpu_us"] + phase["report_client_cpu_us"]), 1
                    )
                    phases.append(phase)
                if baseline:
                    progress.phase(f"{n} clients ({k + 1}/{len(clients)}), ListEngines floor")
                    transfer_ids = [f"c{k}-floor-{i}" for i in range(phase_sizes[1])]
                    specs = client_specs(f"c{k}-floor", transfer_ids, d_tp, n, False)
                    floor, _ = run_clients(
                        proc.pid, address, specs, sc.decode, decode_ids, procs, 1, True, seconds
                    )
                    floors.append({"clients": n, "client_procs": procs} | floor.summary(""))
            progress.phase(f"first contact of {pairs} new decode engines")
            contact = first_contact(address, engines, sc, pairs)
            progress.phase("calls per transfer")
            counted = (
                calls_per_transfer(address, count_sc, REALISTIC_TRANSFERS) if count_sc else None
            )
        finally:
            engines.close()
    finally:
        stop_broker(proc)
    phases = median_phases(phases)
    unary = {p["clients"]: p for p in phases if p["batch"] == 1}
    calls = {(p["clients"], p["batch"]): p for p in phases if p["way"] == "calls"}
    for p in phases:
        if p["clients"] in unary:
            for stage in ("plan", "report"):
                base = unary[p["clients"]][f"{stage}_per_s"]
                p[f"{stage}_speedup"] = round(p[f"{stage}_per_s"] / base, 2)
        same = calls.get((p["clients"], p["batch"]))
        if p["way"] == "session" and same is not None:
            p["session_vs_calls"] = {k: round(p[k] / same[k], 2) for k in SESSION_COMPARED}
    return {
        "model": sc.model.name,
        "prefill_tp": sc.prefill.tp_size,
        "decode_tp": d_tp,
        "tokens": sc.request.num_tokens,
        "descriptors_per_plan": int(plan.num_descriptors),
        "bytes_per_plan": int(plan.total_bytes),
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "realistic_batch": realistic_batch(d_tp),
        "cpus": os.cpu_count(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "phases": phases,
        "floors": floors,
        "first_contact": {way: first_contact_summary(found) for way, found in contact.items()},
        "calls_per_transfer": counted,
    }
