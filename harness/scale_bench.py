"""``pdbroker bench scale``: what each call costs a broker as its cluster grows.

For each store (in memory; a private ``redis-server``) and each point of the sweep, a fresh
``pdbroker serve`` process gets a simulated cluster over real gRPC (fake addresses, no NIXL):
``engines`` engines, half prefill and half decode, of both model families in turn
(:data:`FAMILIES`) and TP sizes in turn (``tp``), kept alive by ``KeepAlive`` between phases,
and ``held`` transfers published by its prefill engines and left in flight. Then, one call
at a time, ``samples`` of each call of a probe pair (Nemotron-3-Nano TP2 → TP2, the same at
every point): ``RegisterRank`` and ``KeepAlive`` and ``Deregister`` of one-rank engines,
``PublishBlocks``, ``GetTransferPlan`` (the first ask claims a transfer and plans both ranks;
the later rank only hands its plan out) and ``ReportTransfer``; and ``expiries`` ranks left
to expire, each watched by a ``WatchReleases`` stream, which ends when the broker removed it.

Per call: p50/p99 latency as the caller sees it (for an expiry: from its lease deadline to
the stream's end, the reaper's period included) and the broker's CPU per call (/proc; for
expiries the CPU above the reaper's idle rate, over the window they expire in). Per point:
the event loop's longest stall over the phases (``pdbroker_event_loop_longest_stall_seconds``)
and the broker's memory per transfer held (RSS growth while the held transfers were
published, and the growth of the ``MEMORY USAGE`` of Redis's keys on Redis; on Redis, their
growth per rank registered too). The sweep runs the engine counts at the fewest held
transfers, then the held counts at the most engines, so its first point is the smallest and
its last the largest; with ``trials`` above 1 the whole sweep runs that many times and each
figure of a point is the lowest of its trials. The
ratios largest/smallest of every call's p99 and CPU are set against :data:`GOAL_RATIO`,
every point's longest stall against :data:`GOAL_STALL_MS`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from broker.console import Progress
from broker.errors import UsageError
from broker.presets import resolve_model
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import Role
from harness.bench_engines import DECODE_ADDR, PREFILL_ADDR, registrations, rss_bytes
from harness.brokers import BrokerProcess
from harness.redis_server import RedisServer, start_redis
from harness.scenarios import Scenario, build_scenario
from harness.workers_bench import cpu_model

#: The model families engines alternate between: a Mamba-2 hybrid and a gated-delta-net one.
FAMILIES = ("nemotron-3-nano-30b-a3b", "qwen3.5-27b")
#: The probe pair's model and TP sizes.
PROBE_MODEL, PROBE_TP = "nemotron-3-nano-30b-a3b", 2
#: Every call measured, in the order of the results.
CALLS = (
    "RegisterRank",
    "KeepAlive",
    "PublishBlocks",
    "GetTransferPlan (first ask)",
    "GetTransferPlan (later rank)",
    "ReportTransfer",
    "Deregister",
    "lease expiry",
)
#: Every call's p99 and CPU at the largest point within this factor of the smallest's.
GOAL_RATIO = 1.3
#: The event loop's longest stall at every point below this (ms).
GOAL_STALL_MS = 10.0
#: How often the broker reaps (ms): the granularity of expiry latency.
REAP_INTERVAL_MS = 20
#: Calls in flight while the cluster registers, is kept alive and publishes.
CONCURRENCY = 32
#: Address space of each engine's fake regions.
ENGINE_SPAN = 1 << 40


@dataclass(frozen=True)
class ScaleOptions:
    """The sweep (``engines`` and ``held`` counts, ``tp`` sizes in turn, ``stores``) and
    what each point measures."""

    engines: Sequence[int]
    held: Sequence[int]
    tp: Sequence[int]
    stores: Sequence[str]
    samples: int
    expiries: int
    tokens: int
    lease_ttl_ms: int
    trials: int = 1


def sweep(engines: Sequence[int], held: Sequence[int]) -> list[tuple[int, int]]:
    """(engines, held) of each point: the engine counts at the fewest held transfers, then
    the held counts at the most engines."""
    fewest, most = min(held), max(engines)
    return [(e, fewest) for e in sorted(engines)] + [(most, h) for h in sorted(held) if h > fewest]


def run_scale(options: ScaleOptions, progress: Progress) -> dict:
    """Every point of the sweep on every store, the ratios and whether the goals are met."""
    points = sweep(options.engines, options.held)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pdbroker-bench-scale-") as directory:
        server = None
        if "redis" in options.stores:
            binary = shutil.which("redis-server")
            if binary is None:
                raise UsageError("--store", "the redis store needs redis-server on PATH")
            server = start_redis(Path(directory), binary=binary)
        try:
            trials: list[list[dict]] = []
            for trial in range(1, options.trials + 1):
                trials.append([])
                for store in options.stores:
                    for n, (engines, held) in enumerate(points, 1):
                        progress.phase(
                            f"trial {trial}/{options.trials}, {store} store, point "
                            f"{n}/{len(points)}: {engines} engines, {held:,} transfers held"
                        )
                        redis = server if store == "redis" else None
                        trials[-1].append(_point(options, engines, held, redis))
            results = [lowest_of(runs) for runs in zip(*trials)]
        finally:
            if server is not None:
                server.stop()
    return {
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model()},
        "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "families": list(FAMILIES),
        "tp": list(options.tp),
        "probe": f"{PROBE_MODEL} TP{PROBE_TP} -> TP{PROBE_TP}, {options.tokens} tokens",
        "samples": options.samples,
        "expiries": options.expiries,
        "trials": options.trials,
        "points": results,
        "ratios": ratios(results),
        "goal": {"ratio": GOAL_RATIO, "longest_stall_ms": GOAL_STALL_MS},
    }


def lowest_of(runs: Sequence[Any]) -> Any:
    """The runs of one point, each figure the lowest of its trials (the host's noise only
    adds)."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: lowest_of([run[key] for run in runs]) for key in first}
    return min(runs) if isinstance(first, float | int) and not isinstance(first, bool) else first


def ratios(points: list[dict]) -> list[dict]:
    """Per store and call: p99 and CPU at its last (largest) point over its first."""
    rows = []
    for store in dict.fromkeys(p["store"] for p in points):
        mine = [p for p in points if p["store"] == store]
        small, large = mine[0], mine[-1]
        for call in CALLS:
            a, b = small["calls"][call], large["calls"][call]
            p99 = round(b["p99_ms"] / a["p99_ms"], 2)
            cpu = round(b["cpu_us"] / a["cpu_us"], 2) if a["cpu_us"] > 0 else None
            rows.append(
                {
                    "store": store,
                    "call": call,
                    "p99_ratio": p99,
                    "cpu_ratio": cpu,
                    "met": p99 <= GOAL_RATIO and cpu is not None and cpu <= GOAL_RATIO,
                }
            )
        stall = max(p["longest_stall_ms"] for p in mine)
        rows.append(
            {
                "store": store,
                "call": "longest event loop stall (ms)",
                "p99_ratio": None,
                "cpu_ratio": None,
                "longest_stall_ms": stall,
                "met": stall < GOAL_STALL_MS,
            }
        )
    return rows


def _point(options: ScaleOptions, engines: int, held: int, redis: RedisServer | None) -> dict:
    transfers = held + 2 * options.samples + 1_000
    flags = [
        "--lease-ttl-ms", str(options.lease_ttl_ms),
        "--reap-interval-ms", str(REAP_INTERVAL_MS),
        "--default-ttl-ms", "3600000",
        "--max-transfers", str(transfers),
        "--max-transfers-per-engine", str(transfers),
        "--max-block-ids-per-engine", str(1 << 40),
        "--max-ranks", str(engines * max(options.tp) + 2 * options.samples + 1_000),
        "--metrics-port", "0",
        "--log-level", "ERROR",
    ]  # fmt: skip
    if redis is not None:
        import redis as redis_py

        redis_py.Redis.from_url(redis.url).flushall()
        flags += ["--store", redis.url]
    broker = BrokerProcess(*flags)
    try:
        point = asyncio.run(_Point(broker, options, redis).run(engines, held))
    finally:
        broker.stop()
    return {"store": "memory" if redis is None else "redis", **point}


class _Point:
    """One broker process under one cluster (see the module docstring)."""

    def __init__(self, broker: BrokerProcess, options: ScaleOptions, redis: RedisServer | None):
        self.broker, self.options, self.redis = broker, options, redis
        self.pid = broker.process.pid
        self.leases: list[str] = []  # kept alive between phases
        self.renewed = 0.0
        self.probe = build_scenario(resolve_model(PROBE_MODEL), PROBE_TP, PROBE_TP, options.tokens)

    async def run(self, engines: int, held: int) -> dict:
        async with grpc.aio.insecure_channel(self.broker.address) as channel:
            self.stub = pb_grpc.BrokerStub(channel)
            empty = self._memory()
            prefill = await self._cluster(engines)
            ranks = len(self.leases)
            memory = self._memory()
            await self._hold(prefill, held)
            grown = self._memory()
            await self._register(self.probe, "probeP", Role.PREFILL, 0)
            await self._register(self.probe, "probeD", Role.DECODE, 1)
            self._longest_stall()  # starts afresh
            calls = await self._calls()
            calls["lease expiry"] = await self._expiries()
            stall = self._longest_stall()
        point = {
            "engines": engines,
            "ranks": ranks,
            "held": held,
            "calls": calls,
            "longest_stall_ms": round(stall * 1e3, 2),
            "broker_bytes_per_transfer_held": round((grown[0] - memory[0]) / held),
        }
        if self.redis is not None:
            point["redis_bytes_per_transfer_held"] = round((grown[1] - memory[1]) / held)
            point["redis_bytes_per_rank"] = round((memory[1] - empty[1]) / ranks)
        return point

    # ------------------------------------------------------------------ the cluster

    async def _cluster(self, engines: int) -> list[tuple[str, Scenario]]:
        """Register ``engines`` engines; returns the prefill ones, with their scenario."""
        prefill = []
        shapes = itertools.product(self.options.tp, FAMILIES)
        for i, (tp, family) in zip(range(0, engines, 2), itertools.cycle(shapes)):
            sc = build_scenario(resolve_model(family), tp, tp, self.options.tokens)
            await self._register(sc, f"p{i}", Role.PREFILL, i)
            prefill.append((f"p{i}", sc))
            if i + 1 < engines:
                await self._register(sc, f"d{i + 1}", Role.DECODE, i + 1)
            await self._renew()  # the first engines' leases outlast the last's registration
        return prefill

    async def _register(self, sc: Scenario, engine_id: str, role: Role, index: int) -> None:
        layout = sc.prefill if role is Role.PREFILL else sc.decode
        base = (PREFILL_ADDR if role is Role.PREFILL else DECODE_ADDR) + index * ENGINE_SPAN
        requests = registrations(layout, engine_id, role, base)
        answers = await _gathered(self.stub.RegisterRank, requests)
        self.leases += [a.lease_id for a in answers]

    def _renewal_due(self) -> bool:
        return time.monotonic() - self.renewed > self.options.lease_ttl_ms / 3000

    async def _renew(self, force: bool = False) -> None:
        """KeepAlive every lease kept, when a third of the lease TTL passed (or ``force``)."""
        if force or self._renewal_due():
            requests = [pb.KeepAliveRequest(lease_id=lease) for lease in self.leases]
            await _gathered(self.stub.KeepAlive, requests)
            self.renewed = time.monotonic()

    async def _hold(self, prefill: list[tuple[str, Scenario]], held: int) -> None:
        """Publish ``held`` transfers over the prefill engines, left in flight."""
        for start in range(0, held, CONCURRENCY):
            await self._renew()
            requests = [
                _publication(f"held{i}", *prefill[i % len(prefill)])
                for i in range(start, min(held, start + CONCURRENCY))
            ]
            await _gathered(self.stub.PublishBlocks, requests)

    def _memory(self) -> tuple[int, int]:
        """The broker's RSS and the bytes of Redis's keys (``MEMORY USAGE`` of each, every
        nested value counted; 0 without Redis): its buffers, which come and go, left out."""
        if self.redis is None:
            return rss_bytes(self.pid), 0
        import redis as redis_py

        client, used = redis_py.Redis.from_url(self.redis.url), 0
        keys = list(client.scan_iter(count=1_000))
        for start in range(0, len(keys), 1_000):
            with client.pipeline(transaction=False) as pipe:
                for key in keys[start : start + 1_000]:
                    pipe.memory_usage(key, samples=0)  # every value: sampling varies
                used += sum(n or 0 for n in pipe.execute())
        return rss_bytes(self.pid), used

    def _longest_stall(self) -> float:
        with urllib.request.urlopen(self.broker.metrics_url, timeout=10) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("pdbroker_event_loop_longest_stall_seconds "):
                    return float(line.split()[1])
        raise RuntimeError("the broker's metrics have no event loop stall")

    # ------------------------------------------------------------------ the calls

    async def _timed(
        self, method: Callable[[Any], Awaitable[Any]], requests: Sequence[Any]
    ) -> tuple[dict, list]:
        """``method`` on each of ``requests``, one at a time: the latency and the broker's
        CPU per call (renewals of the cluster's leases, when due, left out), and the
        answers."""
        await self._renew(force=True)
        latencies, answers, cpu = [], [], 0.0
        for request in requests:
            if self._renewal_due():
                await self._renew()
            before, started = _cpu_s(self.pid), time.perf_counter()
            answers.append(await method(request))
            latencies.append(time.perf_counter() - started)
            cpu += _cpu_s(self.pid) - before
        return _summary(latencies, cpu / len(requests)), answers

    async def _calls(self) -> dict[str, dict]:
        n, stub, sc = self.options.samples, self.stub, self.probe
        single = build_scenario(resolve_model(PROBE_MODEL), 1, 1, self.options.tokens).prefill
        first = registrations(single, "reg", Role.PREFILL, PREFILL_ADDR + (1 << 47))[0]
        regs = []
        for i in range(n):
            request = pb.RegisterRankRequest()
            request.CopyFrom(first)
            request.engine_id, request.agent_name = f"reg{i}", f"reg{i}-0"
            regs.append(request)
        calls: dict[str, dict] = {}
        calls["RegisterRank"], leases = await self._timed(stub.RegisterRank, regs)
        keep = [pb.KeepAliveRequest(lease_id=a.lease_id) for a in leases]
        calls["KeepAlive"], _ = await self._timed(stub.KeepAlive, keep)
        gone = [pb.DeregisterRequest(lease_id=a.lease_id) for a in leases]
        calls["Deregister"], _ = await self._timed(stub.Deregister, gone)  # before they expire
        pubs = [_publication(f"s{i}", "probeP", sc) for i in range(n)]
        calls["PublishBlocks"], _ = await self._timed(stub.PublishBlocks, pubs)
        plans = {}
        for d, name in enumerate(("GetTransferPlan (first ask)", "GetTransferPlan (later rank)")):
            asks = [_ask(f"s{i}", d, sc) for i in range(n)]
            calls[name], plans[d] = await self._timed(stub.GetTransferPlan, asks)
        reports = [
            pb.ReportTransferRequest(
                plan_id=plan.plan_id, engine_id="probeD", tp_rank=d, status=pb.REPORT_STATUS_DONE
            )
            for i in range(n)
            for d, plan in ((d, plans[d][i]) for d in (0, 1))
        ]
        calls["ReportTransfer"], _ = await self._timed(stub.ReportTransfer, reports)
        return {call: calls[call] for call in CALLS[:-1]}

    async def _expiries(self) -> dict:
        """Ranks registered and left to expire, each watched until the broker removed it:
        from each lease deadline to its stream's end, and the CPU above the idle rate."""
        await self._renew(force=True)
        single = build_scenario(resolve_model(PROBE_MODEL), 1, 1, self.options.tokens).prefill
        first = registrations(single, "x", Role.PREFILL, PREFILL_ADDR + (1 << 47))[0]
        deadlines, streams = [], []
        for i in range(self.options.expiries):
            request = pb.RegisterRankRequest()
            request.CopyFrom(first)
            request.engine_id, request.agent_name = f"x{i}", f"x{i}-0"
            sent = time.perf_counter()  # the broker's deadline is later: no latency < 0
            answer = await self.stub.RegisterRank(request)
            deadlines.append(sent + answer.ttl_ms / 1000)
            watch = pb.WatchReleasesRequest(engine_id=f"x{i}", lease_id=answer.lease_id)
            streams.append(self.stub.WatchReleases(watch))
        await asyncio.sleep(self.options.lease_ttl_ms / 2000)
        await self._renew(force=True)  # the cluster outlives the probes by half a TTL
        idle_from, idle_cpu = time.perf_counter(), _cpu_s(self.pid)
        await asyncio.sleep(max(0.0, min(deadlines) - time.perf_counter() - 0.05))
        window, cpu = time.perf_counter(), _cpu_s(self.pid)
        idle_rate = (cpu - idle_cpu) / (window - idle_from)
        ends = await asyncio.gather(*(_ended(s) for s in streams))
        spent = _cpu_s(self.pid) - cpu - idle_rate * (time.perf_counter() - window)
        latencies = [end - deadline for end, deadline in zip(ends, deadlines)]
        return _summary(latencies, max(spent, 0.0) / len(streams))


def _cpu_s(pid: int) -> float:
    """CPU time of process ``pid``, all its threads, to the nanosecond (/proc schedstat:
    /proc's tick counters move by 10 ms, more than a few calls take)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except OSError:  # a thread that just ended
            continue
    return total / 1e9


async def _ended(stream: Any) -> float:
    """When ``stream`` ended (it carries no events: its rank never publishes)."""
    async for _ in stream:
        pass
    return time.perf_counter()


async def _gathered(method: Callable[[Any], Awaitable[Any]], requests: Sequence[Any]) -> list[Any]:
    """``method``'s answer to each of ``requests``, :data:`CONCURRENCY` in flight at once."""
    answers: list[Any] = [None] * len(requests)
    order = iter(range(len(requests)))

    async def lane() -> None:
        for i in order:
            answers[i] = await method(requests[i])

    await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
    return answers


def _publication(transfer_id: str, engine_id: str, sc: Scenario) -> pb.PublishBlocksRequest:
    return pb.PublishBlocksRequest(
        transfer_id=transfer_id,
        engine_id=engine_id,
        block_ids=[pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids],
        num_tokens=sc.request.num_tokens,
    )


def _ask(transfer_id: str, rank: int, sc: Scenario) -> pb.GetTransferPlanRequest:
    return pb.GetTransferPlanRequest(
        transfer_id=transfer_id,
        engine_id="probeD",
        tp_rank=rank,
        block_ids=[pb.BlockIds(ids=g) for g in sc.request.decode_block_ids],
        prefill_engine_id="probeP",
    )


def _summary(latencies: Sequence[float], cpu_s_per_call: float) -> dict:
    ms = np.asarray(latencies) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "cpu_us": round(cpu_s_per_call * 1e6, 1),
    }


def table(result: dict) -> str:
    """The sweep as text: per point and call, p50/p99 and CPU; then the ratios."""
    machine, load = result["machine"], result["load_average_1m"]
    about = (
        f"{machine['cpus']} CPUs ({machine['cpu_model']}), 1-min load average {load[0]} -> "
        f"{load[1]}; probe {result['probe']}, {result['samples']} calls each, "
        f"{result['expiries']} expiries, lowest of {result['trials']} trials"
    )
    header = "store  engines  ranks    held  call                           p50 ms  p99 ms  CPU us"
    lines = [about, header]
    for p in result["points"]:
        for call in CALLS:
            c = p["calls"][call]
            lines.append(
                f"{p['store']:<7}{p['engines']:>8}{p['ranks']:>7}{p['held']:>8}  {call:<29}"
                f"{c['p50_ms']:>8.2f}{c['p99_ms']:>8.2f}{c['cpu_us']:>8.0f}"
            )
        memory = f"broker {p['broker_bytes_per_transfer_held']:,} B"
        if "redis_bytes_per_transfer_held" in p:
            memory += (
                f", Redis {p['redis_bytes_per_transfer_held']:,} B "
                f"(and {p['redis_bytes_per_rank']:,} B per rank)"
            )
        lines.append(
            f"{'':<30}longest loop stall {p['longest_stall_ms']} ms; per transfer held: {memory}"
        )
    lines.append(f"largest point / smallest (goal <= {GOAL_RATIO}x; stall < {GOAL_STALL_MS} ms):")
    for r in result["ratios"]:
        verdict = "met" if r["met"] else "NOT met"
        if r["p99_ratio"] is None:
            lines.append(f"  {r['store']:<7}{r['call']:<37}{r['longest_stall_ms']:>8} {verdict}")
        else:
            lines.append(
                f"  {r['store']:<7}{r['call']:<37} p99 {r['p99_ratio']:>5}x  CPU "
                f"{r['cpu_ratio']}x  {verdict}"
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """p99 and CPU per call against the point (engines, held), one row per store."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stores = list(dict.fromkeys(p["store"] for p in result["points"]))
    fig, axes = plt.subplots(len(stores), 2, figsize=(13, 4.5 * len(stores)), squeeze=False)
    for row, store in zip(axes, stores):
        points = [p for p in result["points"] if p["store"] == store]
        labels = [f"{p['engines']} eng\n{p['ranks']} ranks\n{p['held']:,} held" for p in points]
        for ax, (key, unit) in zip(
            row, (("p99_ms", "p99 latency (ms)"), ("cpu_us", "broker CPU per call (us)"))
        ):
            for call in CALLS:
                ax.plot(labels, [p["calls"][call][key] for p in points], marker="o", label=call)
            ax.set_yscale("log")
            ax.set_ylabel(unit)
            ax.set_title(f"{store} store")
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
