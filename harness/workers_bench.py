"""``pdbroker bench control-plane --workers N,...``: ``GetTransferPlan`` throughput of a broker
run as N worker processes (``pdbroker serve --workers N``) on a private ``redis-server``, for
each N side by side, with what limits it.

For each N in turn: a fresh broker on the emptied Redis, ``P`` and ``D`` of
:class:`~harness.bench_engines.BenchEngines`, then per client count the decode clients of
:func:`~harness.bench_clients.run_clients` asking for plans one a call (``GetTransferPlan``),
each client on a connection of its own (the kernel spreads connections over the workers, not calls; engines
in processes of their own have a connection each too). Per phase: plans/s, latency, broker
CPU per plan (every worker's), and the scaling: plans/s over N times the one-worker plans/s
at the same client count, measured in the same run (N = 1 must be among the counts). Read
over the same window, the limits that stop the scaling: Redis, which runs commands on one
thread (its commands/s from ``INFO stats``, its CPU from /proc), the host's cores
(/proc/stat), and each worker's store threads, which run its calls taking turns at its
service code (how long they ran calls, their CPU and how long they held the turn, from every
worker's ``/metrics``, and how often the workers' threads switched, from /proc); with
``--store-threads`` several counts, every phase for each. After each phase, the host's own
parallel efficiency at as many busy
processes as the phase ran (workers, client processes and Redis;
:mod:`~harness.host_calibration`), and from it the host's scaling: that efficiency over the
one-worker phase's at the same client count, the scaling the host itself would allow the
workers. A phase names every limit it reached (:func:`limits`): Redis at
:data:`REDIS_SATURATED` of a core, the host at :data:`HOST_SATURATED` of all its cores, and the
host's cores where its efficiency is below :data:`TARGET_SCALING`, a worker's store threads
all busy, or its turn held, :data:`STORE_THREAD_SATURATED` of the time. Where Redis is not
reached (a host with fewer cores than Redis could serve), Redis's CPU per plan gives the
plans/s at which it would be: ``redis_saturated_per_s``, whatever the number of workers and
replicas.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from broker.console import Progress
from broker.errors import UsageError
from harness.bench_clients import client_ranks, client_specs, run_clients, warm_transfers
from harness.bench_engines import BenchEngines, context_switches, cpu_seconds
from harness.brokers import OWN_CONNECTIONS, BrokerProcess
from harness.delay_proxy import DelayProxy
from harness.host_calibration import PROBE_SECONDS, WORKS, alone_rate, host_efficiency
from harness.redis_server import RedisServer, start_redis
from harness.scenarios import Scenario

#: Plans a second no worker exceeds on the Redis store: sizes the transfers of a phase.
PLANS_PER_S_PER_WORKER = 1_500
#: Plans/s of N workers at least this share of N times one worker's, until a limit is named.
TARGET_SCALING = 0.8
#: Share of one core at which redis-server (one thread runs the commands) is saturated.
REDIS_SATURATED = 0.9
#: Share of all the host's cores at which the host is.
HOST_SATURATED = 0.9
#: Share of the wall time at which a worker's store threads (all of them busy), or its turn
#: at service code (held by one call at a time), are saturated: calls queue for them.
STORE_THREAD_SATURATED = 0.9
#: (name, what the bench prints of ``emit(args, progress, name, result, table)``).
Emit = Callable[[argparse.Namespace, Progress, str, dict, str], None]


def host_cpu_seconds() -> tuple[float, float]:
    """Busy and total CPU seconds of the host since it booted, all cores (/proc/stat)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    per_s = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / per_s, sum(ticks) / per_s


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def worker_scaling(
    sc: Scenario,
    progress: Progress,
    workers: list[int],
    clients: list[int],
    seconds: float,
    client_procs: int,
    store_threads: list[int],
    redis_delay_us: int = 0,
) -> dict:
    """Every (store threads, workers, clients) phase on one private redis-server, with the
    scaling."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise UsageError("--workers", "brokers of several workers need redis-server on PATH")
    for n in clients:
        client_ranks(n, sc.decode.tp_size)  # a count that maps onto no engine fails first
    progress.phase("the host alone: one probe process of each kind of work")
    alone_per_s = {work: alone_rate(work=work) for work in WORKS}
    with tempfile.TemporaryDirectory(prefix="pdbroker-bench-redis-") as directory:
        server = start_redis(Path(directory), binary=binary)
        proxy = DelayProxy.start(server.port, redis_delay_us) if redis_delay_us else None
        broker_url = server.url if proxy is None else proxy.url()
        try:
            store = redis.Redis.from_url(server.url)
            version = store.info("server")["redis_version"]
            phases = []
            for threads in store_threads:
                for n in workers:
                    store.flushall()
                    phases += _phases(
                        sc, progress, (server, broker_url), (n, threads), clients, seconds,
                        client_procs, alone_per_s,
                    )  # fmt: skip
        finally:
            if proxy is not None:
                proxy.stop()
            server.stop()
    one = {(p["store_threads"], p["clients"]): p for p in phases if p["workers"] == 1}
    cpus = os.cpu_count() or 1
    for p in phases:
        alone = one.get((p["store_threads"], p["clients"]))
        p["scaling"] = None
        for kind in ("", "work_"):
            p[f"host_{kind}scaling"] = p[f"scaling_of_host_{kind}".rstrip("_")] = None
        if alone:
            p["scaling"] = round(p["plan_per_s"] / (p["workers"] * alone["plan_per_s"]), 3)
            for kind in ("", "work_"):
                allowed = p[f"host_{kind}efficiency"] / alone[f"host_{kind}efficiency"]
                p[f"host_{kind}scaling"] = round(allowed, 3)
                p[f"scaling_of_host_{kind}".rstrip("_")] = round(p["scaling"] / allowed, 3)
        p["limit"] = limits(
            p["redis_cpu_of_core"],
            p["host_cpu_busy"],
            (p["host_efficiency"], p["host_work_efficiency"]),
            p["store_thread_busy"],
            p["store_turn"],
            cpus,
        )
    return {
        "model": sc.model.name,
        "prefill_tp": sc.prefill.tp_size,
        "decode_tp": sc.decode.tp_size,
        "tokens": sc.request.num_tokens,
        "seconds_per_phase": seconds,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "redis_version": version,
        "redis_delay_us": redis_delay_us,
        "target_scaling": TARGET_SCALING,
        "probe_seconds": PROBE_SECONDS,
        "probe_alone_per_s": round(alone_per_s["spin"]),
        "work_probe_alone_per_s": round(alone_per_s["broker"], 1),
        "phases": phases,
    }


def _phases(
    sc: Scenario,
    progress: Progress,
    redis_at: tuple[RedisServer, str],
    broker_shape: tuple[int, int],
    clients: list[int],
    seconds: float,
    client_procs: int,
    alone_per_s: dict[str, float],
) -> list[dict]:
    """The phases of one broker of ``(workers, store threads each)``, a client count each,
    each followed by the host's efficiency at as many busy processes (the broker and Redis
    idle), for each kind of probe work (``alone_per_s``: one probe's rate alone)."""
    import redis

    workers, threads = broker_shape
    server, broker_url = redis_at  # the brokers' URL: the server's, or a delaying proxy's
    d_tp = sc.decode.tp_size
    per_phase = math.ceil(seconds * PLANS_PER_S_PER_WORKER * workers / d_tp)  # transfers
    warmup = [f"warm-{i}" for i in range(20)]
    capacity = str(per_phase * len(clients) + sum(clients) + len(warmup) + 100)
    progress.phase(f"starting a broker of {workers} workers, {threads} store threads each")
    broker = BrokerProcess(
        *("--workers", str(workers), "--store", broker_url, "--log-level", "ERROR"),
        *("--store-threads", str(threads)),
        *("--metrics-port", "0"),
        *("--max-transfers", capacity, "--max-transfers-per-engine", capacity),
        *("--default-ttl-ms", "600000", "--lease-ttl-ms", "600000"),  # outlast the run
    )
    store = redis.Redis.from_url(server.url)
    decode_ids = [list(g) for g in sc.request.decode_block_ids]

    metrics_urls = [line.rsplit(" ", 1)[1] for line in broker.announced if "metrics on" in line]
    assert len(metrics_urls) == workers, broker.announced

    def meter() -> tuple[float, ...]:
        commands = store.info("stats")["total_commands_processed"]
        seconds = [store_thread_seconds(url) for url in metrics_urls]
        return (
            time.monotonic(),
            commands,
            cpu_seconds(server.process.pid),
            context_switches(broker.process.pid),
            *host_cpu_seconds(),
            *(busy for busy, _, _ in seconds),
            *(cpu for _, cpu, _ in seconds),
            *(turn for _, _, turn in seconds),
        )

    phases = []
    try:
        engines = BenchEngines(broker.address, sc)
        try:
            engines.publish(warmup)
            engines.plan(warmup)
            for k, n in enumerate(clients):
                progress.phase(f"{workers} workers x {threads} threads, {n} clients, {seconds:g} s")
                transfer_ids = [f"c{k}-{i}" for i in range(per_phase)]
                specs = client_specs(f"c{k}", transfer_ids, d_tp, n, warm=True)
                engines.publish(transfer_ids + warm_transfers(specs))
                procs = min(n, client_procs)
                run, _ = run_clients(
                    broker.process.pid,
                    broker.address,
                    specs,
                    sc.decode,
                    decode_ids,
                    procs,
                    1,
                    False,
                    seconds,
                    OWN_CONNECTIONS,
                    meter,
                )
                wall, commands, redis_cpu, switches, busy, total, *stores = run.metered
                store_busy, store_cpu = stores[:workers], stores[workers : 2 * workers]
                store_turn = stores[2 * workers :]
                redis_us = redis_cpu / run.entries * 1e6
                phase: dict[str, object] = {
                    "workers": workers,
                    "store_threads": threads,
                    "clients": n,
                    "client_procs": procs,
                    "ran_out": run.ran_out,
                    **run.summary("plan_"),
                    "broker_switches_per_plan": round(switches / run.entries, 2),
                    "redis_commands_per_s": round(commands / wall),
                    "redis_commands_per_plan": round(commands / run.entries, 2),
                    "redis_cpu_of_core": round(redis_cpu / wall, 3),
                    "redis_cpu_us_per_plan": round(redis_us, 1),
                    "redis_saturated_per_s": round(REDIS_SATURATED * 1e6 / redis_us),
                    "host_cpu_busy": round(busy / total, 3),
                    "store_thread_busy": round(max(store_busy) / threads / wall, 3),
                    "store_turn": round(max(store_turn) / wall, 3),
                    "store_thread_waiting": round(1 - sum(store_cpu) / sum(store_busy), 3),
                }
                busy_processes = workers + procs + 1  # Redis runs commands on one thread
                progress.phase(f"the host: {busy_processes} probe processes")
                spin, work = (
                    host_efficiency(busy_processes, alone_per_s[w], work=w) for w in WORKS
                )
                phase["host_processes"] = busy_processes
                phase["host_efficiency"] = round(spin, 3)
                phase["host_work_efficiency"] = round(work, 3)
                phases.append(phase)
        finally:
            engines.close()
    finally:
        broker.stop()
    return phases


def limits(
    redis_of_core: float,
    host_busy: float,
    host_efficiency: tuple[float, float],
    store_thread_busy: float,
    store_turn: float,
    cpus: int,
) -> str:
    """Every limit a phase reached, '; '-separated ('' for none): Redis with its one core at
    least :data:`REDIS_SATURATED` busy; the host's CPU with all of it at least
    :data:`HOST_SATURATED` busy; the host's cores where, at the phase's process count, each
    probe process (``host_efficiency``: spinning, and doing the broker's work) ran below
    :data:`TARGET_SCALING` of one alone; a worker's store threads
    all busy, or its turn held, at least :data:`STORE_THREAD_SATURATED` of the time (its
    calls queue for them)."""
    named = []
    if redis_of_core >= REDIS_SATURATED:
        named.append("Redis (one core)")
    if host_busy >= HOST_SATURATED:
        named.append(f"host CPU ({cpus} cores)")
    spin, work = host_efficiency
    if spin < TARGET_SCALING:
        named.append(f"host cores (efficiency {spin:.3f})")
    if work < TARGET_SCALING:
        named.append(f"host cores at the broker's work (efficiency {work:.3f})")
    if store_thread_busy >= STORE_THREAD_SATURATED:
        named.append("a worker's store threads")
    if store_turn >= STORE_THREAD_SATURATED:
        named.append("a worker's turn")
    return "; ".join(named)


def store_thread_seconds(metrics_url: str) -> tuple[float, float, float]:
    """A broker process's store threads: seconds they ran calls, their CPU seconds and the
    seconds those held the turn, from its ``/metrics``."""
    with urllib.request.urlopen(metrics_url, timeout=5) as page:
        text = page.read().decode()
    found = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return (
        found["pdbroker_store_thread_busy_seconds_total"],
        found["pdbroker_store_thread_cpu_seconds_total"],
        found["pdbroker_store_turn_seconds_total"],
    )


def table(r: dict) -> str:
    """The phases side by side, with the machine and the goal."""
    lines = [
        (
            f"{r['model']} {r['tokens']} tokens TP{r['prefill_tp']}->TP{r['decode_tp']}, "
            f"redis-server {r['redis_version']}"
            + (
                f" behind a proxy holding replies {r['redis_delay_us']} us"
                if r["redis_delay_us"]
                else ""
            )
            + f"; {r['cpus']} CPUs ({r['cpu_model']})"
        ),
        (
            f"{'workers':>7} {'threads':>7} {'clients':>7} {'plans/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'broker us':>9} {'sw/plan':>7} {'scaling':>7} {'redis cmd/s':>11} {'cmd/plan':>8} "
            f"{'redis cpu':>9} {'redis us':>8} {'redis full':>10} {'host cpu':>8} "
            f"{'procs':>5} {'host eff':>8} {'host scal':>9} {'of host':>7} {'work eff':>8} "
            f"{'work scal':>9} {'of work':>7} {'store':>5} "
            f"{'turn':>5} {'waits':>5}  limit"
        ),
    ]

    def figure(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for p in r["phases"]:
        lines.append(
            f"{p['workers']:>7} {p['store_threads']:>7} {p['clients']:>7} {p['plan_per_s']:>8,.0f} "
            f"{p['plan_p50_ms']:>7.2f} {p['plan_p99_ms']:>7.2f} {p['plan_broker_cpu_us']:>9.0f} "
            f"{p['broker_switches_per_plan']:>7.1f} {figure(p['scaling']):>7} {p['redis_commands_per_s']:>11,} "
            f"{p['redis_commands_per_plan']:>8.1f} {p['redis_cpu_of_core']:>9.0%} "
            f"{p['redis_cpu_us_per_plan']:>8.0f} {p['redis_saturated_per_s']:>10,} "
            f"{p['host_cpu_busy']:>8.0%} {p['host_processes']:>5} {p['host_efficiency']:>8.2f} "
            f"{figure(p['host_scaling']):>9} {figure(p['scaling_of_host']):>7} "
            f"{p['host_work_efficiency']:>8.2f} {figure(p['host_work_scaling']):>9} "
            f"{figure(p['scaling_of_host_work']):>7} "
            f"{p['store_thread_busy']:>5.0%} {p['store_turn']:>5.0%} "
            f"{p['store_thread_waiting']:>5.0%}  "
            f"{p['limit'] or '-'}" + (" (ran out of transfers)" if p["ran_out"] else "")
        )
    lines.append(
        f"goal: scaling >= {r['target_scaling']} until a limit is named; scaling: plans/s / "
        "(workers x the 1-worker plans/s, same threads and clients); broker us: CPU per plan of every "
        "worker; sw/plan: context switches per plan of every worker's threads; redis cpu: "
        "of one core; redis us: its CPU per plan; redis full: plans/s at "
        f"which that is {REDIS_SATURATED:.0%} of a core; host cpu: of all cores; host eff: "
        f"work rate of each of procs (workers + client processes + Redis) probe processes "
        f"run together, over one alone's ({r['probe_seconds']:g} s each); host scal: host eff "
        "over the 1-worker phase's (same clients), the scaling the host allows; of host: "
        "scaling / host scal; work eff, work scal, of work: the same with probes doing the "
        "broker's own work in process (transfers published, planned and reported, "
        f"{r['work_probe_alone_per_s']:g}/s alone) instead of spinning; store: the busiest worker's store threads, their share of the "
        "time running calls; turn: the busiest worker's turn at service code, its share of the "
        "time held; waits: the share of the store threads' busy time not on a CPU (waiting for "
        f"Redis or the turn). Limits: Redis at {REDIS_SATURATED:.0%} of its core, host CPU at "
        f"{HOST_SATURATED:.0%} of all cores, host cores at host eff or work eff < "
        f"{r['target_scaling']}, "
        f"a worker's store threads or turn at {STORE_THREAD_SATURATED:.0%}"
    )
    return "\n".join(lines)


def bench_workers(args: argparse.Namespace, progress: Progress, sc: Scenario, emit: Emit) -> int:
    """``bench control-plane --workers``: the phases, printed with ``emit``."""
    for flag, given in (("--baseline", args.baseline), ("--profile", args.profile)):
        if given:
            raise UsageError(flag, "not with --workers")
    r = worker_scaling(
        sc, progress, args.workers, args.clients, args.seconds, args.client_procs,
        args.store_threads, args.redis_delay_us,
    )  # fmt: skip
    emit(args, progress, "control_plane_workers", {"control_plane_workers": r}, table(r))
    return 0
