"""A loopback P/D fleet on one machine, driven request by request: what ``pdbroker demo`` and
the end-to-end tests run.

Processes: a broker (``pdbroker serve``, in-memory store), and per :class:`PairSpec` one prefill
and one decode engine process. An engine process hosts all ranks of its engine, each rank with
its own KV-cache regions (numpy arrays in DRAM), NIXL agent (UCX), registration and lease, and
owns the engine's block allocator, as a serving engine's scheduler does. The coordinator (the
calling process) only sends commands and collects measurements:

1. prefill allocates blocks, fills them with :mod:`harness.pattern` contents and publishes;
2. decode allocates blocks and fetches (plan → NIXL reads → report), then compares every byte
   of its memory with what its own layout says the request must have left there; it fetches
   ``inflight`` published requests at a time (fewer at the end) batched, every rank of each in
   one ``GetTransferPlans`` and one ``ReportTransfers`` call, as a decode engine's step does,
   or, ``per_rank``, one request at a time rank by rank (``GetTransferPlan`` and
   ``ReportTransfer`` per rank);
3. prefill frees the blocks when each rank's release arrives and tells the coordinator.

Requests go round-robin over the pairs; each pair keeps up to ``inflight`` requests between
publish and their last release, so prefill of one request overlaps decode of the previous.

Every process traces when the ``OTEL_*`` environment asks for it (:mod:`broker.tracing`): the
broker as ``pdbroker``, each engine process under its engine id (``prefill-0``, ...).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import cast

from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.layout import EngineLayout
from broker.models import ModelSpec, build_engine_layout, hma_block_size
from harness.brokers import BrokerProcess, RunningBrokers
from harness.engines import REQUEST_TIMEOUT_S, engine_main
from harness.scenarios import block_counts

#: Seconds to wait for the broker and the engines to come up, and for them to close.
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PairSpec:
    """A prefill engine at ``prefill_tp`` and a decode engine at ``decode_tp`` serving
    ``model``; requests carry ``min_tokens .. max_tokens`` tokens. Block sizes are the larger
    of the two engines' HMA choices, as operators set one ``--block-size`` on both. Each
    request takes ``prefill_mamba_blocks`` state blocks per Mamba group on prefill (more than
    one: prefill kept older states too, as prefix caching does; the newest is the last) and
    ``decode_mamba_blocks`` on decode."""

    label: str
    model: ModelSpec
    prefill_tp: int
    decode_tp: int
    min_tokens: int
    max_tokens: int
    kernel_block_size: int = 0
    prefill_mamba_blocks: int = 1
    decode_mamba_blocks: int = 1

    def layouts(self, inflight: int) -> tuple[EngineLayout, EngineLayout]:
        """Both engines, each with blocks for ``inflight`` requests of ``max_tokens``."""
        block_size = max(
            hma_block_size(self.model, self.prefill_tp), hma_block_size(self.model, self.decode_tp)
        )
        probe = build_engine_layout(
            self.model, self.prefill_tp, 1, block_size, self.kernel_block_size
        )
        mamba_blocks = max(self.prefill_mamba_blocks, self.decode_mamba_blocks)
        num_blocks = inflight * sum(block_counts(probe, self.max_tokens, mamba_blocks))
        prefill, decode = (
            build_engine_layout(self.model, tp, num_blocks, block_size, self.kernel_block_size)
            for tp in (self.prefill_tp, self.decode_tp)
        )
        return prefill, decode


@dataclass
class RequestOutcome:
    """What the coordinator learnt about one request. Times are ``time.monotonic()`` values
    of the engine processes (one clock per host) or durations in seconds."""

    index: int
    pair: int
    transfer_id: str
    num_tokens: int
    salt: int
    published_at: float = 0.0
    fill_s: float = 0.0
    publish_s: float = 0.0
    prefill_pages: tuple[int, ...] = ()
    ranks: list[dict] = field(default_factory=list)  # per decode rank, see engine_main
    mismatches: int = 0
    expected_bytes: int = 0
    checked_bytes: int = 0
    verify_s: float = 0.0
    fetched: bool = False
    releases: dict[int, tuple[str, float]] = field(default_factory=dict)  # p rank -> reason, when
    error: str = ""

    @property
    def nbytes(self) -> int:
        return sum(r["nbytes"] for r in self.ranks)


@dataclass
class FleetReport:
    """Everything a run produced; :attr:`ok` when every byte matched and every release arrived."""

    pairs: tuple[PairSpec, ...]
    layouts: tuple[tuple[EngineLayout, EngineLayout], ...]
    requests: list[RequestOutcome]
    wall_s: float = 0.0
    completed: int = 0
    notifications: int = 0
    leftover_engines: tuple[str, ...] = ()
    errors: list[str] = field(default_factory=list)

    @property
    def mismatches(self) -> int:
        return sum(r.mismatches for r in self.requests)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.requests)

    @property
    def expected_notifications(self) -> int:
        """One per (decode rank, source prefill rank) read."""
        return sum(len(rank["prefill_ranks"]) for r in self.requests for rank in r.ranks)

    def problems(self) -> list[str]:
        """Why the run is not :attr:`ok` (empty when it is)."""
        out = list(self.errors)
        for r in self.requests:
            tp = self.pairs[r.pair].prefill_tp
            if r.error:
                out.append(f"{r.transfer_id}: {r.error}")
            elif not r.fetched:
                out.append(f"{r.transfer_id}: never fetched")
            elif r.nbytes != r.expected_bytes:
                out.append(
                    f"{r.transfer_id}: moved {r.nbytes} bytes, the layouts need {r.expected_bytes}"
                )
            missing = sorted(set(range(tp)) - set(r.releases))
            if missing:
                out.append(f"{r.transfer_id}: no release for prefill ranks {missing}")
            wrong = {p: why for p, (why, _) in r.releases.items() if why != "completed"}
            if wrong:
                out.append(f"{r.transfer_id}: releases {wrong}")
        if self.mismatches:
            out.append(f"{self.mismatches} decode bytes differ from the expected layout")
        if self.leftover_engines:
            out.append(f"engines still registered after close: {list(self.leftover_engines)}")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems()


@dataclass
class _EngineProcess:
    engine_id: str
    pair: int
    process: mp.process.BaseProcess
    conn: Connection


@dataclass
class _PairState:
    pending: deque[int]
    published: deque[int] = field(default_factory=deque)
    inflight: int = 0
    prefill_busy: bool = False
    decoding: int = 0  # fetches sent to decode and not answered yet


def run_fleet(
    pairs: Sequence[PairSpec],
    requests: int,
    *,
    inflight: int = 2,
    seed: int = 0,
    on_progress: Callable[[FleetReport], None] | None = None,
    broker: BrokerProcess | RunningBrokers | None = None,
    credentials: Mapping[str, ChannelSecurity] | None = None,
    run_id: str = "",
    per_rank: bool = False,
) -> FleetReport:
    """Run ``requests`` requests (round-robin over ``pairs``) through real processes and
    return what happened; never raises for a failed transfer (see :meth:`FleetReport.problems`).
    ``broker``: a running broker (or replicas, :class:`RunningBrokers`) to use and leave
    running; by default one is started and stopped for the run. ``credentials``: each
    engine's (by engine id: ``prefill-0``, ``decode-0``, ... for pair 0, 1, ...); plaintext
    for engines not named. Transfer ids are ``req-<index>-<run_id>`` (a fresh random run id
    by default), so runs against the same broker never collide; ``seed`` sets the requests'
    token counts and byte patterns. ``per_rank``: decode fetches one request at a time rank by
    rank instead of ``inflight`` published requests at a time, batched."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # inherited by the engine processes
    rng = random.Random(seed)
    run_id = run_id or secrets.token_hex(4)
    layouts = tuple(p.layouts(inflight) for p in pairs)
    outcomes = [
        RequestOutcome(
            i,
            i % len(pairs),
            f"req-{i:05d}-{run_id}",
            rng.randint(pairs[i % len(pairs)].min_tokens, pairs[i % len(pairs)].max_tokens),
            1 + rng.randrange(255),
        )
        for i in range(requests)
    ]
    report = FleetReport(tuple(pairs), layouts, outcomes)
    started = time.monotonic()
    own_broker = broker is None
    if broker is None:
        broker = BrokerProcess()
    engines: list[_EngineProcess] = []
    try:
        ctx = mp.get_context("spawn")
        for i, (p_layout, d_layout) in enumerate(layouts):
            sides = (
                ("prefill", p_layout, d_layout, pairs[i].prefill_mamba_blocks),
                ("decode", d_layout, p_layout, pairs[i].decode_mamba_blocks),
            )
            for role, layout, peer, mamba_blocks in sides:
                parent, child = ctx.Pipe()
                engine_id = f"{role}-{i}"
                process = ctx.Process(
                    target=engine_main,
                    name=engine_id,
                    daemon=True,
                    args=(
                        role,
                        engine_id,
                        layout,
                        peer,
                        broker.address,
                        child,
                        seed + i,
                        (credentials or {}).get(engine_id, PLAINTEXT),
                        mamba_blocks,
                        per_rank,
                    ),
                )
                process.start()
                child.close()
                engines.append(_EngineProcess(engine_id, i, process, parent))
        _drive(engines, report, inflight, on_progress, per_rank)
        report.leftover_engines = broker.list_engines()
    except _Abort as exc:
        report.errors.append(str(exc))
    finally:
        for engine in engines:
            engine.process.join(5)
            if engine.process.is_alive():
                engine.process.terminate()
                engine.process.join(5)
        if own_broker:
            broker.stop()
    report.wall_s = time.monotonic() - started
    return report


class _Abort(Exception):
    """An engine process failed or stopped answering: the run ends."""


def _receive(
    engines: Sequence[_EngineProcess], timeout_s: float
) -> list[tuple[_EngineProcess, tuple]]:
    by_conn = {id(e.conn): e for e in engines}
    # typeshed types wait() as returning any kind of waitable; it returns the ready ones of
    # the objects it was given.
    ready = cast("list[Connection]", wait([e.conn for e in engines], timeout_s))
    if not ready:
        raise _Abort(f"no engine answered within {timeout_s:g} s")
    out = []
    for conn in ready:
        engine = by_conn[id(conn)]
        try:
            message = conn.recv()
        except EOFError:
            raise _Abort(
                f"engine {engine.engine_id} exited (code {engine.process.exitcode})"
            ) from None
        if message[0] == "error":
            raise _Abort(f"engine {message[1]} failed:\n{message[2]}")
        out.append((engine, message))
    return out


def _drive(
    engines: list[_EngineProcess],
    report: FleetReport,
    inflight: int,
    on_progress: Callable[[FleetReport], None] | None,
    per_rank: bool,
) -> None:
    """Start, run every request (decode given ``inflight`` published requests at once, or
    one at a time ``per_rank``), close the engines."""
    ready: set[str] = set()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(ready) < len(engines):
        for engine, message in _receive(engines, max(0.1, deadline - time.monotonic())):
            if message[0] == "ready":
                ready.add(engine.engine_id)
    prefill = {e.pair: e for e in engines if e.engine_id.startswith("prefill")}
    decode = {e.pair: e for e in engines if e.engine_id.startswith("decode")}
    states = {
        i: _PairState(deque(r.index for r in report.requests if r.pair == i))
        for i in range(len(report.pairs))
    }
    by_id = {r.transfer_id: r for r in report.requests}
    settled: set[int] = set()

    def pump(i: int) -> None:
        state = states[i]
        if not state.prefill_busy and state.pending and state.inflight < inflight:
            r = report.requests[state.pending.popleft()]
            prefill[i].conn.send(("publish", r.transfer_id, r.num_tokens, r.salt))
            state.prefill_busy, state.inflight = True, state.inflight + 1
        # Batched, a decode step takes ``inflight`` published requests (fewer at the end).
        step = 1 if per_rank else min(inflight, len(state.published) + len(state.pending))
        if not state.decoding and state.published and len(state.published) >= step:
            batch = [report.requests[state.published.popleft()] for _ in range(step)]
            asks = [(r.transfer_id, r.num_tokens, r.salt, r.prefill_pages) for r in batch]
            decode[i].conn.send(("fetch_many", asks))
            state.decoding = len(batch)

    def settle(r: RequestOutcome) -> None:
        """Count ``r`` done once fetched (or failed) and released by every prefill rank."""
        if r.index in settled or not (r.fetched or r.error):
            return
        if len(r.releases) == report.pairs[r.pair].prefill_tp:
            settled.add(r.index)
            report.completed += 1
            states[r.pair].inflight -= 1
            if on_progress is not None:
                on_progress(report)

    for i in states:
        pump(i)
    while len(settled) < len(report.requests):
        for engine, message in _receive(engines, REQUEST_TIMEOUT_S):
            kind, transfer_id, *rest = message
            r = by_id[transfer_id]
            state = states[engine.pair]
            if kind == "published":
                r.published_at, r.fill_s, r.publish_s, r.prefill_pages = rest
                state.prefill_busy = False
                state.published.append(r.index)
            elif kind == "fetched":
                r.ranks, r.mismatches, r.expected_bytes, r.checked_bytes, r.verify_s = rest
                r.fetched, state.decoding = True, state.decoding - 1
                settle(r)
            elif kind == "fetch_failed":
                r.error, state.decoding = rest[0], state.decoding - 1
                settle(r)
            elif kind == "released":
                p_rank, reason, at = rest
                r.releases[p_rank] = (reason, at)
                settle(r)
            elif kind == "released_twice":
                report.errors.append(f"{transfer_id}: prefill rank {rest[0]} released twice")
            pump(engine.pair)
    for engine in engines:
        engine.conn.send(("close",))
    closed: set[str] = set()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(closed) < len(engines):
        for engine, message in _receive(
            [e for e in engines if e.engine_id not in closed], max(0.1, deadline - time.monotonic())
        ):
            if message[0] == "closed":
                closed.add(engine.engine_id)
                report.notifications += message[2]
