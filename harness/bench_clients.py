"""The timed decode clients of the control-plane benchmark
(:mod:`harness.control_plane_bench`): each an :class:`~clients.decode.AsyncDecodeClient` on
its own channel, spread over a few processes, asking for plans, checking them as ranks do
before posting their reads (a rank's plans of one call at once:
:func:`~clients.plan_check.check_each`), then reporting them.

At batch 1 each client asks one plan per call (``GetTransferPlan``) and hosts the ranks it
asks as (:func:`client_ranks`), as a decode engine's worker processes do; at batch *K* each
client is a decode engine of its own hosting every rank, as its scheduler does, and asks *K*
(transfer, rank) entries per ``GetTransferPlans`` call, every rank of a transfer in the same
call; reports go ``K`` a call alike (``ReportTransfer`` at batch 1, ``ReportTransfers``
beyond), as unary calls or as exchanges on each client's ``EngineSession`` stream. Latencies are single calls measured at the client; CPU time of the broker comes from
``/proc``, of the clients from their processes' CPU clocks.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import multiprocessing.synchronize
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.errors import UsageError
from broker.layout import EngineLayout
from broker.v1 import broker_pb2 as pb
from clients.decode import AsyncDecodeClient, PlanAsk, PlanReport
from clients.plan_check import PlanRejected, check_each
from clients.protocol import BrokerCallError, call
from clients.transport import NoMemoryTransport, fake_memory
from harness.bench_engines import (
    AGENT_METADATA_BYTES,
    CALL_TIMEOUT_S,
    DECODE_ADDR,
    DECODE_ADDRESS_SPAN,
    T,
    cpu_seconds,
)

#: A decode job: (transfer id, decode rank asking).
Job = tuple[str, int]


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
    phase: str,
    transfer_ids: Sequence[str],
    decode_tp: int,
    clients: int,
    warm: bool,
    batch: int = 1,
) -> list[ClientSpec]:
    """The decode clients of a phase (engines named after ``phase``), with their jobs over
    ``transfer_ids``; ``warm``: each engine plans its transfer ``<phase>-warm-<engine>``
    (:func:`warm_transfers`) once per rank first. At ``batch`` 1 clients host ranks as
    :func:`client_ranks` says; beyond, client *c* is decode engine *c* hosting every rank,
    with every rank of transfers ``c, c + clients, ...`` in turn."""
    if batch == 1:
        jobs = assign(transfer_ids, decode_tp, clients)
        engines = client_ranks(clients, decode_tp)
    else:
        ranks = tuple(range(decode_tp))
        jobs = [[(t, d) for t in transfer_ids[c::clients] for d in ranks] for c in range(clients)]
        engines = [(c, ranks) for c in range(clients)]
    if DECODE_ADDR - len(engines) * DECODE_ADDRESS_SPAN <= 0:
        most = DECODE_ADDR // DECODE_ADDRESS_SPAN - 1
        raise UsageError(
            "--clients", f"{len(engines)} decode engines: their fake memory fits {most} at most"
        )
    return [
        ClientSpec(
            f"{phase}-D{e}",
            DECODE_ADDR - (e + 1) * DECODE_ADDRESS_SPAN,
            ranks,
            f"{phase}-warm-{e}" if warm else "",
            jobs[c],
        )
        for c, (e, ranks) in enumerate(engines)
    ]


def warm_transfers(specs: Sequence[ClientSpec]) -> list[str]:
    """The transfers the clients of ``specs`` warm up with, each once."""
    return sorted({s.warm_transfer for s in specs if s.warm_transfer})


#: A rank's plan a client got: (decode rank, plan).
Held = tuple[int, pb.GetTransferPlanResponse]


async def _ask(
    client: AsyncDecodeClient, jobs: Sequence[Job], batch: int, decode_ids: list[list[int]]
) -> list[Held]:
    """The plans of ``jobs``, one ``GetTransferPlan`` (``batch`` 1) or one
    ``GetTransferPlans`` call; raises for a refused entry."""
    if batch == 1:
        ((transfer_id, rank),) = jobs
        return [(rank, await client.plan(rank, transfer_id, decode_ids))]
    answers = await client.plans([PlanAsk(rank, t, decode_ids) for t, rank in jobs])
    held = []
    for (_, rank), answer in zip(jobs, answers):
        if isinstance(answer, BrokerCallError):
            raise answer
        held.append((rank, answer))
    return held


async def _report(client: AsyncDecodeClient, held: Sequence[Held], batch: int) -> None:
    """Report ``held`` plans DONE, one ``ReportTransfer`` (``batch`` 1) or one
    ``ReportTransfers`` call; raises unless each was recorded intact."""
    if batch == 1:
        ((rank, plan),) = held
        outcomes: list[Any] = [await client.report(rank, plan.plan_id, nbytes=plan.total_bytes)]
    else:
        outcomes = await client.report_many(
            [PlanReport(rank, plan.plan_id, plan.total_bytes) for rank, plan in held]
        )
    for outcome in outcomes:
        if isinstance(outcome, BrokerCallError):
            raise outcome
        if not outcome.intact:
            raise RuntimeError(f"a report was not recorded intact: {outcome}")


@dataclass
class Timed:
    """What one client timed: each call's latency (ns), the entries its calls carried,
    whether its work ran out before the stage's end."""

    latencies: list[int]
    entries: int
    ran_out: bool


async def _timed_calls(
    chunks: Sequence[Sequence[Any]],
    one_call: Callable[[Sequence[Any]], Awaitable[T]],
    stop_at: float,
    then: Callable[[T], object] = lambda _: None,
) -> Timed:
    """``one_call`` on each of ``chunks`` in turn until ``stop_at`` (``perf_counter``), and
    ``then`` on what each returned, outside its latency."""
    latencies: list[int] = []
    entries = 0
    for chunk in chunks:
        if time.perf_counter() >= stop_at:
            return Timed(latencies, entries, False)
        t0 = time.perf_counter_ns()
        answer = await one_call(chunk)
        latencies.append(time.perf_counter_ns() - t0)
        then(answer)
        entries += len(chunk)
    return Timed(latencies, entries, math.isfinite(stop_at))


def _chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class _BenchClient:
    """One timed decode client: its plans, their checks and reports, or ``ListEngines``."""

    def __init__(
        self,
        client: AsyncDecodeClient,
        spec: ClientSpec,
        batch: int,
        decode_ids: list[list[int]],
    ) -> None:
        self.client, self.spec, self.batch, self.decode_ids = client, spec, batch, decode_ids
        self.held: list[Held] = []

    async def warm(self) -> None:
        if self.spec.warm_transfer:
            jobs = [(self.spec.warm_transfer, rank) for rank in self.spec.ranks]
            for chunk in _chunks(jobs, self.batch):
                await self._report(await _ask(self.client, chunk, self.batch, self.decode_ids))

    async def plans(self, stop_at: float) -> Timed:
        """Ask for the jobs' plans, checking each call's after it (as its ranks do before
        posting their reads, each rank's plans at once)."""

        def check(held: list[Held]) -> None:
            sessions = self.client.sessions
            for checked in check_each([(p, sessions[r].region_index, r) for r, p in held]):
                if isinstance(checked, PlanRejected):
                    raise checked
            self.held += held

        return await _timed_calls(
            _chunks(self.spec.jobs, self.batch),
            partial(_ask, self.client, batch=self.batch, decode_ids=self.decode_ids),
            stop_at,
            check,
        )

    async def reports(self, stop_at: float) -> Timed:
        return await _timed_calls(_chunks(self.held, self.batch), self._report, stop_at)

    async def _report(self, held: Sequence[Held]) -> None:
        await _report(self.client, held, self.batch)

    async def list_engines(self, stop_at: float) -> Timed:
        request = pb.ListEnginesRequest()

        async def one_call(jobs: Sequence[Job]) -> object:
            return await call(self.client.stub, "ListEngines", request, CALL_TIMEOUT_S)

        return await _timed_calls(_chunks(self.spec.jobs, 1), one_call, stop_at)


@dataclass(frozen=True)
class Stage:
    """What a client process sends back for one timed stage: latencies (ns), entries, the
    instant its last call ended, its CPU seconds, whether a client ran out of work; or the
    error that stopped it."""

    latencies: list[int]
    entries: int
    end: float
    cpu_s: float
    ran_out: bool
    error: str = ""


def _client_process(
    address: str,
    specs: list[ClientSpec],
    layout: EngineLayout,
    decode_ids: list[list[int]],
    seconds: float,
    batch: int,
    baseline: bool,
    security: ChannelSecurity,
    session_stream: bool,
    ready: mp.Queue,
    events: tuple[mp.synchronize.Event, ...],
    out: mp.Queue,
) -> None:
    """One process running one decode client (its own channel) per entry of ``specs``:
    registers them and says so on ``ready``, warms them up at ``events[0]`` (every
    process's ranks registered) and says so again; then runs each stage at its event
    (``events[1]``: plans, or ``ListEngines`` with ``baseline``; ``events[2]``, unless
    ``baseline``: reports of those plans), each for at most ``seconds``, sending a
    :class:`Stage` per stage on ``out`` (an error one for each stage left once one fails).
    The engines stay registered when it exits (their leases outlast the run, as ``P``'s):
    deregistering would fail the transfers they claimed and stream those releases to ``P``
    while the next phase runs."""
    transport = NoMemoryTransport(AGENT_METADATA_BYTES)
    said: list[int] = []  # what went on ``ready``
    sent: list[Stage] = []  # what went on ``out``
    stages = 1 if baseline else 2

    def say() -> None:
        said.append(os.getpid())
        ready.put(os.getpid())

    async def stage(go: mp.synchronize.Event, clients: list[_BenchClient], step: str) -> None:
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        cpu, stop_at = time.process_time(), time.perf_counter() + seconds
        timed = await asyncio.gather(*(getattr(c, step)(stop_at) for c in clients))
        end, cpu = time.time(), time.process_time() - cpu
        latencies = [x for t in timed for x in t.latencies]
        entries = sum(t.entries for t in timed)
        sent.append(Stage(latencies, entries, end, cpu, any(t.ran_out for t in timed)))
        out.put(sent[-1])

    async def main() -> None:
        clients = [
            _BenchClient(
                AsyncDecodeClient(
                    address,
                    s.engine_id,
                    layout,
                    {r: fake_memory(layout, s.first_addr)[r] for r in s.ranks},
                    call_timeout_s=CALL_TIMEOUT_S,
                    security=security,
                    transport=transport,
                    session_stream=session_stream,
                ),
                s,
                batch,
                decode_ids,
            )
            for s in specs
        ]
        await asyncio.gather(*(c.client.start() for c in clients))
        say()  # registered
        await asyncio.get_running_loop().run_in_executor(None, events[0].wait)
        for c in clients:
            await c.warm()
        say()  # warm
        if baseline:
            await stage(events[1], clients, "list_engines")
        else:
            await stage(events[1], clients, "plans")
            await stage(events[2], clients, "reports")

    try:
        asyncio.run(main())
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        while len(said) < 2:  # the parent waits for both
            say()
        while len(sent) < stages:
            events[1 + len(sent)].wait()  # in step with the other processes' stages
            sent.append(Stage([], 0, time.time(), 0.0, False, f"{type(exc).__name__}: {exc}"))
            out.put(sent[-1])


@dataclass
class Run:
    """One timed stage: latencies per call (ms), entries (rank-plans or reports; calls for
    ``ListEngines``), wall time (s), CPU seconds of broker and clients, whether a client ran
    out of work before the stage's end, how far each reading of the ``meter`` moved."""

    latencies_ms: np.ndarray
    entries: int
    seconds: float
    broker_cpu_s: float
    client_cpu_s: float
    ran_out: bool
    metered: tuple[float, ...] = ()

    @property
    def per_s(self) -> float:
        """Entries a second."""
        return self.entries / self.seconds

    def summary(self, prefix: str) -> dict[str, float]:
        """Calls and entries, entries a second, latency per call, CPU per entry."""
        p50, p90, p99 = np.percentile(self.latencies_ms, [50, 90, 99]).tolist()
        n, calls = self.entries, self.latencies_ms.size
        return {
            f"{prefix}calls": calls,
            f"{prefix}entries": n,
            f"{prefix}seconds": round(self.seconds, 3),
            f"{prefix}per_s": round(self.per_s, 1),
            f"{prefix}calls_per_s": round(calls / self.seconds, 1),
            f"{prefix}p50_ms": round(p50, 3),
            f"{prefix}p90_ms": round(p90, 3),
            f"{prefix}p99_ms": round(p99, 3),
            f"{prefix}max_ms": round(float(self.latencies_ms.max()), 3),
            f"{prefix}broker_cpu_us": round(self.broker_cpu_s / n * 1e6, 1),
            f"{prefix}client_cpu_us": round(self.client_cpu_s / n * 1e6, 1),
        }


def _collect(
    out: mp.Queue,
    procs: int,
    broker_pid: int,
    go: mp.synchronize.Event,
    meter: Callable[[], Sequence[float]],
) -> tuple[Run | None, str]:
    """Start a stage at ``go`` and collect it from ``procs`` processes: what they measured
    (None when one failed) and the first error. Broker CPU and ``meter``'s readings count
    from the start to the last result."""
    readings, broker_cpu, start = meter(), cpu_seconds(broker_pid), time.time()
    go.set()
    stages: list[Stage] = [out.get() for _ in range(procs)]
    broker_cpu = cpu_seconds(broker_pid) - broker_cpu
    metered = tuple(b - a for a, b in zip(readings, meter()))
    errors = [s.error for s in stages if s.error]
    if errors:
        return None, errors[0]
    return (
        Run(
            np.array([x for s in stages for x in s.latencies], dtype=np.float64) / 1e6,
            sum(s.entries for s in stages),
            max(s.end for s in stages) - start,
            broker_cpu,
            sum(s.cpu_s for s in stages),
            any(s.ran_out for s in stages),
            metered,
        ),
        "",
    )


def run_clients(
    broker_pid: int,
    address: str,
    specs: list[ClientSpec],
    layout: EngineLayout,
    decode_ids: list[list[int]],
    client_procs: int,
    batch: int,
    baseline: bool,
    seconds: float = math.inf,
    security: ChannelSecurity = PLAINTEXT,
    meter: Callable[[], Sequence[float]] = tuple,
    session_stream: bool = True,
) -> tuple[Run, Run | None]:
    """One decode client per entry of ``specs`` (engines of ``layout``; channels of
    ``security``) over ``client_procs`` processes, started together once all are registered
    and warm; each stage stops after ``seconds`` (default: when the clients' work is done).
    What they measured asking for plans ``batch`` entries a call (``baseline``:
    ``ListEngines`` instead), and reporting those plans (None with ``baseline``); each
    stage's :attr:`Run.metered` holds how far ``meter``'s readings moved over it.
    ``session_stream``: batched calls go over each client's ``EngineSession`` stream
    (False: unary calls)."""
    ctx = mp.get_context("spawn")
    ready: mp.Queue = ctx.Queue()
    out: mp.Queue = ctx.Queue()
    events = tuple(ctx.Event() for _ in range(3))
    procs = [
        ctx.Process(
            target=_client_process,
            args=(
                address,
                specs[k::client_procs],
                layout,
                decode_ids,
                seconds,
                batch,
                baseline,
                security,
                session_stream,
                ready,
                events,
                out,
            ),
        )
        for k in range(client_procs)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()  # registered
    events[0].set()
    for _ in procs:
        ready.get()  # warm
    runs: list[Run | None] = []
    error = ""
    for go in events[1 : 2 if baseline else 3]:
        run, failed = _collect(out, len(procs), broker_pid, go, meter)
        runs.append(run)
        error = error or failed
    for p in procs:
        p.join()
    if error:
        raise RuntimeError(f"a client failed: {error}")
    assert runs[0] is not None
    return runs[0], None if baseline else runs[1]
