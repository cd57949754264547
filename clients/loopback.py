"""A loopback P/D fleet on one machine, driven request by request: what ``pdbroker demo`` and
the end-to-end tests run.

Processes: a broker (``pdbroker serve``, in-memory store), and per :class:`PairSpec` one prefill
and one decode engine process. An engine process hosts all ranks of its engine, each rank with
its own torch KV-cache tensors, NIXL agent (UCX, DRAM), registration and lease, and owns the
engine's block allocator, as a serving engine's scheduler does. The coordinator (the calling
process) only sends commands and collects measurements:

1. prefill allocates blocks, fills them with :mod:`clients.pattern` contents and publishes;
2. decode allocates blocks and fetches (plan → NIXL reads → report), then compares every byte
   of its memory with what its own layout says the request must have left there;
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
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import grpc

from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.layout import EngineLayout
from broker.models import ModelSpec, build_engine_layout, hma_block_size
from broker.tracing import configure_tracing
from clients.session import broker_addresses

if TYPE_CHECKING:
    from clients.decode import DecodeClient
    from clients.prefill import PrefillClient, Release

#: Seconds to wait for the broker and the engines to come up, and for them to close.
STARTUP_TIMEOUT_S = 120.0
#: Longest one request may take from publish to its last release.
REQUEST_TIMEOUT_S = 60.0


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
        return tuple(
            build_engine_layout(self.model, tp, num_blocks, block_size, self.kernel_block_size)
            for tp in (self.prefill_tp, self.decode_tp)
        )  # type: ignore[return-value]


def block_counts(layout: EngineLayout, num_tokens: int, mamba_blocks: int = 1) -> list[int]:
    """Blocks a request takes per group: its pages for attention, ``mamba_blocks`` state
    blocks for Mamba."""
    return [
        -(-num_tokens // g.block_size) if g.is_attention else mamba_blocks for g in layout.groups
    ]


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


# --------------------------------------------------------------------------- engine process


class BlockPool:
    """An engine's free block ids, handed out in a shuffled order (as a busy allocator does)."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        self._free = deque(free)
        self._cond = threading.Condition()

    def allocate(self, counts: Sequence[int], timeout_s: float) -> list[list[int]]:
        """Blocks per group; waits up to ``timeout_s`` for enough to be free."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= sum(counts), timeout_s):
                raise TimeoutError(f"no {sum(counts)} free blocks within {timeout_s} s")
            return [[self._free.popleft() for _ in range(n)] for n in counts]

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        with self._cond:
            for ids in block_ids:
                self._free.extend(ids)
            self._cond.notify_all()


def engine_main(
    role: str,
    engine_id: str,
    layout: EngineLayout,
    peer: EngineLayout,
    target: str,
    conn: Connection,
    seed: int,
    security: ChannelSecurity = PLAINTEXT,
    mamba_blocks: int = 1,
) -> None:
    """One engine process (``role`` ``prefill`` or ``decode``); ``peer`` is the other side's
    layout; ``security``: how its client reaches the broker; ``mamba_blocks``: state blocks a
    request takes per Mamba group. Answers the coordinator's commands on ``conn`` until
    ``close``; its spans (if tracing is on) are exported before it says ``closed``."""
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:  # release callbacks send from the client's loop thread
            conn.send(message)

    try:
        tracer_provider = configure_tracing(engine_id)
        engine = (_PrefillEngine if role == "prefill" else _DecodeEngine)(
            engine_id, layout, peer, seed, send, mamba_blocks
        )
        with engine.connect(target, security) as engine.client:
            send(("ready", engine_id))
            while (message := conn.recv())[0] != "close":
                getattr(engine, message[0])(*message[1:])
        if tracer_provider is not None:
            tracer_provider.shutdown()
        send(("closed", engine_id, engine.notifications))
    except BaseException:  # noqa: BLE001 - the coordinator reports it
        send(("error", engine_id, traceback.format_exc()))
        sys.exit(1)


class _Engine:
    """An engine process's state: per rank torch KV tensors (numpy views for the pattern),
    the block allocator, the pattern contents, and its client (set by :func:`engine_main`)."""

    def __init__(
        self,
        engine_id: str,
        layout: EngineLayout,
        peer: EngineLayout,
        seed: int,
        send: Callable[[tuple], None],
        mamba_blocks: int,
    ) -> None:
        import torch

        from clients.pattern import Contents

        self.engine_id, self.layout, self.peer, self.send = engine_id, layout, peer, send
        self.mamba_blocks = mamba_blocks
        self.memory = {
            rank.tp_rank: [
                torch.empty(rank.region_bytes, dtype=torch.uint8) for _ in range(rank.num_regions)
            ]
            for rank in layout.ranks
        }
        self.arrays = {r: [t.numpy() for t in tensors] for r, tensors in self.memory.items()}
        self.contents = Contents(layout)
        self.pool = BlockPool(layout.ranks[0].num_blocks, seed)
        self.notifications = 0
        self.client: Any = None

    def allocate(self, num_tokens: int) -> list[list[int]]:
        return self.pool.allocate(
            block_counts(self.layout, num_tokens, self.mamba_blocks), REQUEST_TIMEOUT_S
        )


class _PrefillEngine(_Engine):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.held: dict[str, tuple[list[list[int]], set[int]]] = {}  # blocks, ranks not released

    def connect(self, target: str, security: ChannelSecurity) -> PrefillClient:
        from clients.prefill import PrefillClient

        return PrefillClient(
            target,
            self.engine_id,
            self.layout,
            self.memory,
            on_release=self.on_release,
            on_notification=self.on_notification,
            security=security,
        )

    def on_release(self, release: Release) -> None:
        """Scrub the rank's pages (a late reader would copy POISON), free the blocks once every
        rank was released; tell the coordinator about each, and about a rank released twice."""
        from clients.pattern import scrub_pages

        held = self.held.get(release.transfer_id)
        if held is None or release.tp_rank not in held[1]:
            self.send(("released_twice", release.transfer_id, release.tp_rank))
            return
        blocks, waiting = held
        scrub_pages(self.layout.ranks[release.tp_rank], self.arrays[release.tp_rank], blocks)
        waiting.discard(release.tp_rank)
        if not waiting:
            del self.held[release.transfer_id]
            self.pool.free(blocks)
        self.send(
            (
                "released",
                release.transfer_id,
                release.tp_rank,
                release.reason.value,
                release.received_at,
            )
        )

    def on_notification(self, tp_rank: int, sender: str, message: bytes) -> None:
        self.notifications += 1

    def publish(self, transfer_id: str, num_tokens: int, salt: int) -> None:
        from clients.pattern import fill_prefill

        blocks = self.allocate(num_tokens)
        started = time.perf_counter()
        for r, regions in self.arrays.items():
            fill_prefill(self.contents, self.layout.ranks[r], regions, blocks, salt)
        self.held[transfer_id] = (blocks, set(self.arrays))
        published_at, filled = time.monotonic(), time.perf_counter()
        self.client.publish(transfer_id, blocks, num_tokens)
        self.send(
            (
                "published",
                transfer_id,
                published_at,
                filled - started,
                time.perf_counter() - filled,
                tuple(len(g) for g in blocks),
            )
        )


class _DecodeEngine(_Engine):
    def __init__(self, *args: Any) -> None:
        from clients.pattern import POISON

        super().__init__(*args)
        for regions in self.arrays.values():
            for region in regions:
                region.fill(POISON)

    def connect(self, target: str, security: ChannelSecurity) -> DecodeClient:
        from clients.decode import DecodeClient

        return DecodeClient(
            target,
            self.engine_id,
            self.layout,
            self.memory,
            read_timeout_s=REQUEST_TIMEOUT_S,
            security=security,
        )

    def fetch_and_hold(
        self, transfer_id: str, num_tokens: int, salt: int, prefill_pages: Sequence[int]
    ) -> None:
        """Fetch, but let every rank stop once its NIXL reads are posted, before it waits for
        them or reports: each rank tells the coordinator ``reads_posted`` and the process
        hangs there until it is killed (the fault tests' reader dying mid-read)."""
        import asyncio

        async def hold(transfers: Sequence[Any], spans: object, deadline: float) -> None:
            self.send(("reads_posted", transfer_id, sum(t.nbytes for t in transfers)))
            await asyncio.Event().wait()

        self.client._async._wait = hold  # the rank's wait for its posted reads
        self.fetch(transfer_id, num_tokens, salt, prefill_pages)

    def fetch(
        self, transfer_id: str, num_tokens: int, salt: int, prefill_pages: Sequence[int]
    ) -> None:
        """Fetch, then compare every byte of every hosted rank's memory with the layout."""
        from clients.pattern import POISON, check_decode, decode_limits

        blocks = self.allocate(num_tokens)
        try:
            fetch = self.client.fetch(transfer_id, blocks)
        except Exception as exc:  # noqa: BLE001 - a failed fetch is a result
            self.send(("fetch_failed", transfer_id, str(exc)))
            for regions in self.arrays.values():  # whatever arrived: POISON for the next request
                for region in regions:
                    region.fill(POISON)
            self.pool.free(blocks)
            return
        started = time.perf_counter()
        limits = decode_limits(self.peer, self.layout, num_tokens, prefill_pages)
        mismatches = expected = 0
        for r, regions in self.arrays.items():
            m, e = check_decode(self.contents, self.layout.ranks[r], regions, blocks, salt, limits)
            mismatches, expected = mismatches + m, expected + e
        self.pool.free(blocks)
        checked = sum(region.size for regions in self.arrays.values() for region in regions)
        self.send(
            (
                "fetched",
                transfer_id,
                [asdict(rank) for rank in fetch.ranks],
                mismatches,
                expected,
                checked,
                time.perf_counter() - started,
            )
        )


# --------------------------------------------------------------------------- coordinator


class BrokerProcess:
    """``pdbroker serve`` on an ephemeral loopback port; ``flags`` are more ``serve`` options
    (``--metrics-port 0`` sets :attr:`metrics_url`); without ``--tls-cert`` among them it
    serves plaintext (``--insecure``). ``security``: how :meth:`list_engines` connects (an
    operator's credentials when the broker authorizes callers). What it prints after starting
    goes to this process's stdout."""

    def __init__(self, *flags: str, security: ChannelSecurity = PLAINTEXT) -> None:
        self.security = security
        plaintext = () if "--tls-cert" in flags else ("--insecure",)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker.cli",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--log-level",
                "WARNING",
                *plaintext,
                *flags,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.address = self.metrics_url = ""
        while not self.address and (line := self.process.stdout.readline()):
            if "metrics on" in line:
                self.metrics_url = line.rsplit(" ", 1)[1].strip()
            elif "listening on" in line:
                self.address = line.rsplit(" ", 1)[1].strip()
        if not self.address:
            self.stop()
            raise RuntimeError(f"the broker did not start (exit code {self.process.poll()})")
        # Keep its stdout flowing (a console span exporter writes there).
        threading.Thread(
            target=shutil.copyfileobj, args=(self.process.stdout, sys.stdout), daemon=True
        ).start()

    def list_engines(self) -> tuple[str, ...]:
        from broker.v1 import broker_pb2 as pb
        from broker.v1 import broker_pb2_grpc as pb_grpc

        with self.security.channel(self.address) as channel:
            response = pb_grpc.BrokerStub(channel).ListEngines(pb.ListEnginesRequest(), timeout=10)
        return tuple(e.engine_id for e in response.engines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class RunningBrokers:
    """Brokers already running (replicas sharing a store), for :func:`run_fleet` in place of
    a :class:`BrokerProcess`: engines get every address and fail over between them."""

    def __init__(
        self, addresses: str | Sequence[str], security: ChannelSecurity = PLAINTEXT
    ) -> None:
        self.addresses = broker_addresses(addresses)
        self.address = ",".join(self.addresses)
        self.security = security

    def list_engines(self) -> tuple[str, ...]:
        """The engines registered, from the first replica that answers."""
        from broker.v1 import broker_pb2 as pb
        from broker.v1 import broker_pb2_grpc as pb_grpc

        error: grpc.RpcError | None = None
        for address in self.addresses:
            try:
                with self.security.channel(address) as channel:
                    response = pb_grpc.BrokerStub(channel).ListEngines(
                        pb.ListEnginesRequest(), timeout=10
                    )
                return tuple(e.engine_id for e in response.engines)
            except grpc.RpcError as exc:
                error = exc
        raise RuntimeError(f"no broker of {self.address} answered: {error}")

    def stop(self) -> None:
        """Nothing: they were running before and keep running."""


@dataclass
class _Engine:
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
    decode_busy: bool = False


def run_fleet(
    pairs: Sequence[PairSpec],
    requests: int,
    *,
    inflight: int = 2,
    seed: int = 0,
    on_progress: Callable[[FleetReport], None] | None = None,
    broker: BrokerProcess | RunningBrokers | None = None,
    credentials: Mapping[str, ChannelSecurity] | None = None,
) -> FleetReport:
    """Run ``requests`` requests (round-robin over ``pairs``) through real processes and
    return what happened; never raises for a failed transfer (see :meth:`FleetReport.problems`).
    ``broker``: a running broker (or replicas, :class:`RunningBrokers`) to use and leave
    running; by default one is started and stopped for the run. ``credentials``: each
    engine's (by engine id: ``prefill-0``, ``decode-0``, ... for pair 0, 1, ...); plaintext
    for engines not named."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # inherited by the engine processes
    rng = random.Random(seed)
    layouts = tuple(p.layouts(inflight) for p in pairs)
    outcomes = [
        RequestOutcome(
            i,
            i % len(pairs),
            f"req-{i:05d}-{rng.getrandbits(32):08x}",
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
    engines: list[_Engine] = []
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
                    ),
                )
                process.start()
                child.close()
                engines.append(_Engine(engine_id, i, process, parent))
        _drive(engines, report, inflight, on_progress)
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


def _receive(engines: Sequence[_Engine], timeout_s: float) -> list[tuple[_Engine, tuple]]:
    by_conn = {id(e.conn): e for e in engines}
    ready = wait([e.conn for e in engines], timeout_s)
    if not ready:
        raise _Abort(f"no engine answered within {timeout_s:g} s")
    out = []
    for conn in ready:
        engine = by_conn[id(conn)]
        try:
            message = conn.recv()  # type: ignore[union-attr]
        except EOFError:
            raise _Abort(
                f"engine {engine.engine_id} exited (code {engine.process.exitcode})"
            ) from None
        if message[0] == "error":
            raise _Abort(f"engine {message[1]} failed:\n{message[2]}")
        out.append((engine, message))
    return out


def _drive(
    engines: list[_Engine],
    report: FleetReport,
    inflight: int,
    on_progress: Callable[[FleetReport], None] | None,
) -> None:
    """Start, run every request, close the engines."""
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
        if not state.decode_busy and state.published:
            r = report.requests[state.published.popleft()]
            decode[i].conn.send(("fetch", r.transfer_id, r.num_tokens, r.salt, r.prefill_pages))
            state.decode_busy = True

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
                r.fetched, state.decode_busy = True, False
                settle(r)
            elif kind == "fetch_failed":
                r.error, state.decode_busy = rest[0], False
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
