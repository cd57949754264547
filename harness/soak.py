"""Soak load: prefill and decode engines on the client library driving a broker over gRPC,
what ``pdbroker soak`` runs in each of its worker processes.

No memory moves: the engines are :class:`~clients.prefill.AsyncPrefillClient` and
:class:`~clients.decode.AsyncDecodeClient` over :class:`~clients.transport.NoMemoryTransport`,
whose ranks register fake, disjoint regions (the broker never touches memory) and whose reads
complete at once, so a decode rank reports what its plan says it read. A worker hosts whole
engines of both roles (registrations, leases, prefill ranks' release streams) and starts its
share of ``rate`` transfers a second on ``lanes`` concurrent lanes (a lane that falls behind
starts its next one at once), each from one of its prefill engines to one of its decode
engines, so its transfers cover every pair of its engines. Each transfer takes one of
:data:`PATHS` (mostly the happy path, some unhappy ones that soak the release path) and waits
until every prefill rank was released; the worker counts each rank's releases, so a transfer
released twice or never is seen.
"""

from __future__ import annotations

import asyncio
import random
import time
import traceback
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import grpc

from broker.layout import EngineLayout
from broker.models import build_engine_layout, hma_block_size
from broker.presets import resolve_model
from broker.v1 import broker_pb2 as pb
from broker.wire import ReleaseReason, TransferState
from clients.decode import AsyncDecodeClient, FetchError
from clients.prefill import AsyncPrefillClient, Release
from clients.protocol import BrokerCallError
from clients.transport import NoMemoryTransport, fake_memory
from harness.scenarios import block_counts, fresh_block_ids

#: Transfer paths and their weights: the happy path, a decode rank reporting FAILED, every
#: report sent twice, an abort (before or after the plans) and a transfer nobody reads
#: before its short TTL. Each must end with every prefill rank released exactly once.
PATHS = {"completed": 84, "consumer_failed": 4, "duplicate_report": 4, "aborted": 4, "expired": 4}
#: Release reasons each path may end with (a rank whose readers all reported DONE before
#: another rank's reader failed is released COMPLETED).
EXPECTED_REASONS = {
    "completed": {ReleaseReason.COMPLETED},
    "duplicate_report": {ReleaseReason.COMPLETED},
    "consumer_failed": {ReleaseReason.CONSUMER_FAILED, ReleaseReason.COMPLETED},
    "aborted": {ReleaseReason.ABORTED},
    "expired": {ReleaseReason.EXPIRED},
}
#: TTL of the transfers left unread to expire (ms); the broker reaps every 100 ms.
EXPIRE_TTL_MS = 200
#: Longest wait for a transfer's releases once its last call returned (seconds).
RELEASE_TIMEOUT_S = 10.0
#: Deadline of one RPC (seconds).
CALL_TIMEOUT_S = 10.0
#: How often a prefill client polls its agents (seconds): no reader needs it to connect, it
#: only collects the notifications reads delivered in-process.
POLL_INTERVAL_S = 0.05
#: Size of each rank's agent metadata (bytes).
AGENT_METADATA_BYTES = 256
#: Error messages kept verbatim per worker (the rest are only counted).
ERROR_SAMPLES = 5
#: Address space given to each engine's fake regions.
ENGINE_ADDRESS_SPAN = 1 << 44


@dataclass(frozen=True)
class Fleet:
    """The soak's engines, the same in every worker: ``prefill_engines`` engines of
    ``prefill_tp`` ranks and ``decode_engines`` of ``decode_tp`` serving the preset
    ``model``; requests of ``min_tokens .. max_tokens``; ``workers`` processes (at most as
    many as engines of either role) of ``lanes`` concurrent transfers each, starting ``rate``
    transfers a second in all (0: as fast as the lanes go)."""

    target: str
    model: str
    prefill_engines: int
    prefill_tp: int
    decode_engines: int
    decode_tp: int
    min_tokens: int
    max_tokens: int
    workers: int
    lanes: int
    rate: float

    def engine_ids(self, role: str) -> list[str]:
        count = self.prefill_engines if role == "prefill" else self.decode_engines
        return [f"soak-{role}-{i}" for i in range(count)]

    def owned(self, role: str, index: int) -> list[str]:
        """The engines of ``role`` worker ``index`` hosts."""
        return self.engine_ids(role)[index :: self.workers]

    def first_addr(self, engine_id: str) -> int:
        """First fake address of an engine's regions: each engine of the fleet has its own
        span."""
        engines = self.engine_ids("prefill") + self.engine_ids("decode")
        return (engines.index(engine_id) + 1) * ENGINE_ADDRESS_SPAN

    def layouts(self) -> tuple[EngineLayout, EngineLayout]:
        """Prefill and decode layouts, each engine with blocks for every lane of its worker."""
        model = resolve_model(self.model)
        block_size = max(
            hma_block_size(model, self.prefill_tp), hma_block_size(model, self.decode_tp)
        )
        probe = build_engine_layout(model, self.prefill_tp, 1, block_size)
        blocks = self.lanes * sum(block_counts(probe, self.max_tokens))
        return (
            build_engine_layout(model, self.prefill_tp, blocks, block_size),
            build_engine_layout(model, self.decode_tp, blocks, block_size),
        )


@dataclass
class WorkerResult:
    """What one worker measured: paths taken, transfers fully released, GetTransferPlan
    latencies and publish-to-last-release times of completed transfers (ms), transfers not
    fully released or released more than once, unexpected outcomes."""

    paths: Counter[str] = field(default_factory=Counter)
    transfers: int = 0
    plan_latencies_ms: list[float] = field(default_factory=list)
    transfer_latencies_ms: list[float] = field(default_factory=list)
    unreleased: list[str] = field(default_factory=list)
    double_released: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Transfer:
    """One published transfer as its prefill engine sees it."""

    transfer_id: str
    path: str
    pool: _BlockPool
    blocks: list[list[int]]
    published_at: float
    pending: int  # prefill ranks not yet released
    releases: list[int]  # releases received per prefill rank
    done: asyncio.Future[None] | None  # set once every rank was released; then dropped


class BlockPoolExhausted(RuntimeError):
    """More blocks wanted than free: releases went missing."""


class _BlockPool:
    """Free block ids of one engine, in shuffled order."""

    def __init__(self, ids: Sequence[int], rng: random.Random) -> None:
        shuffled = list(ids)
        rng.shuffle(shuffled)
        self._free = deque(shuffled)

    def allocate(self, counts: Sequence[int]) -> list[list[int]]:
        if len(self._free) < sum(counts):
            raise BlockPoolExhausted(
                f"block pool exhausted: {sum(counts)} wanted, {len(self._free)} free"
            )
        return [[self._free.popleft() for _ in range(n)] for n in counts]

    def free(self, blocks: Sequence[Sequence[int]]) -> None:
        for ids in blocks:
            self._free.extend(ids)


def worker_main(fleet: Fleet, index: int, seed: int, conn: Connection) -> None:
    """One worker process: starts its engines (registered) and says ``("ready",)``; on
    ``("go", start, deadline)`` (``time.monotonic()`` instants) runs transfers from ``start``
    until ``deadline``, drains, sends ``("result", WorkerResult)``; on ``("close",)`` closes
    its engines (deregistered) and exits."""
    try:
        asyncio.run(_Worker(fleet, index, seed, conn).run())
    except BaseException:  # the parent reports it
        conn.send(("error", traceback.format_exc()))
        raise


class _Worker:
    """One worker's engines, block pools, tracked transfers and measurements."""

    def __init__(self, fleet: Fleet, index: int, seed: int, conn: Connection) -> None:
        self.fleet, self.index, self.conn = fleet, index, conn
        self.rng = random.Random(seed * 1000 + index)
        self.prefill_layout, self.decode_layout = fleet.layouts()
        transport = NoMemoryTransport(AGENT_METADATA_BYTES)
        self.prefill = {
            e: AsyncPrefillClient(
                fleet.target,
                e,
                self.prefill_layout,
                fake_memory(self.prefill_layout, fleet.first_addr(e)),
                on_release=self._on_release,
                progress_interval_s=POLL_INTERVAL_S,
                idle_interval_s=POLL_INTERVAL_S,
                call_timeout_s=CALL_TIMEOUT_S,
                transport=transport,
            )
            for e in fleet.owned("prefill", index)
        }
        self.decode = {
            e: AsyncDecodeClient(
                fleet.target,
                e,
                self.decode_layout,
                fake_memory(self.decode_layout, fleet.first_addr(e)),
                read_timeout_s=CALL_TIMEOUT_S,
                call_timeout_s=CALL_TIMEOUT_S,
                transport=transport,
            )
            for e in fleet.owned("decode", index)
        }
        self.own_prefill, self.own_decode = list(self.prefill), list(self.decode)
        blocks = {
            **{e: self.prefill_layout.ranks[0].num_blocks for e in self.prefill},
            **{e: self.decode_layout.ranks[0].num_blocks for e in self.decode},
        }
        self.pools = {e: _BlockPool(range(n), self.rng) for e, n in blocks.items()}
        self.transfers: dict[str, _Transfer] = {}
        self.result = WorkerResult()
        self.started = 0

    async def run(self) -> None:
        clients = [*self.prefill.values(), *self.decode.values()]
        try:
            await asyncio.gather(*(c.start() for c in clients))
            loop = asyncio.get_running_loop()
            self.conn.send(("ready",))
            _, start, deadline = await loop.run_in_executor(None, self.conn.recv)
            lanes = (self._lane(start, deadline) for _ in range(self.fleet.lanes))
            await asyncio.gather(*lanes)
            self.result.unreleased = [t.transfer_id for t in self.transfers.values() if t.pending]
            self.result.double_released = sum(
                max(t.releases) > 1 for t in self.transfers.values()
            ) + sum(c.repeated_releases for c in self.prefill.values())
            self.conn.send(("result", self.result))
            await loop.run_in_executor(None, self.conn.recv)  # ("close",)
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    def _on_release(self, release: Release) -> None:
        """Count prefill rank ``release.tp_rank``'s releases; free a transfer's blocks and
        wake its lane once every rank was released."""
        transfer = self.transfers.get(release.transfer_id)
        if transfer is None:
            self._error(f"release of unknown transfer {release.transfer_id}")
            return
        transfer.releases[release.tp_rank] += 1
        if transfer.releases[release.tp_rank] > 1:
            return
        if release.reason not in EXPECTED_REASONS[transfer.path]:
            reason = release.reason.name
            self._error(f"{transfer.path} transfer released {reason}: {release.detail}")
        transfer.pending -= 1
        if not transfer.pending:
            transfer.pool.free(transfer.blocks)
            self.result.transfers += 1
            if transfer.done is not None and not transfer.done.done():
                transfer.done.set_result(None)
            transfer.done = None

    def _error(self, message: str) -> None:
        self.result.errors += 1
        if len(self.result.error_samples) < ERROR_SAMPLES:
            self.result.error_samples.append(message)

    # ------------------------------------------------------------------ transfers

    async def _lane(self, start: float, deadline: float) -> None:
        while time.monotonic() < deadline:
            n = self.started
            self.started += 1
            if self.fleet.rate:
                await asyncio.sleep(
                    start + n * self.fleet.workers / self.fleet.rate - time.monotonic()
                )
                if time.monotonic() >= deadline:
                    return
            prefill = self.own_prefill[n % len(self.own_prefill)]
            decode = self.own_decode[(n // len(self.own_prefill)) % len(self.own_decode)]
            path = self.rng.choices(list(PATHS), list(PATHS.values()))[0]
            try:
                await self._transfer(f"w{self.index}-{n:07d}", path, prefill, decode)
            except (BrokerCallError, FetchError, BlockPoolExhausted) as exc:
                self._error(f"{path}: {exc}")

    async def _transfer(self, transfer_id: str, path: str, prefill: str, decode: str) -> None:
        """Publish, take ``path``, wait for every prefill rank's release."""
        tokens = self.rng.randint(self.fleet.min_tokens, self.fleet.max_tokens)
        pool = self.pools[prefill]
        blocks = pool.allocate(block_counts(self.prefill_layout, tokens))
        done = asyncio.get_running_loop().create_future()
        transfer = _Transfer(
            transfer_id,
            path,
            pool,
            blocks,
            time.perf_counter(),
            self.fleet.prefill_tp,
            [0] * self.fleet.prefill_tp,
            done,
        )
        self.transfers[transfer_id] = transfer
        try:
            await self.prefill[prefill].publish(
                transfer_id, blocks, tokens, ttl_ms=EXPIRE_TTL_MS if path == "expired" else 0
            )
        except BrokerCallError:
            del self.transfers[transfer_id]
            pool.free(blocks)
            raise
        self.result.paths[path] += 1
        client = self.decode[decode]
        try:
            if path != "expired":
                await self._read(transfer, client, tokens)
        finally:
            await self._await_release(transfer)
        if path in ("aborted", "expired"):
            await self._expect_no_plan(transfer_id, client, tokens)

    async def _read(self, transfer: _Transfer, client: AsyncDecodeClient, tokens: int) -> None:
        """The decode engine's side of ``transfer``'s path: a fetch (plan, read, report per
        rank), or plans followed by a failed report or an abort."""
        path, transfer_id = transfer.path, transfer.transfer_id
        if path == "aborted" and self.rng.random() < 0.5:
            await self._abort(client, transfer_id)  # before any plan
            return
        pool = self.pools[client.engine_id]
        blocks = pool.allocate(block_counts(self.decode_layout, tokens))
        try:
            if path in ("completed", "duplicate_report"):
                fetch = await client.fetch(transfer_id, blocks)
                self.result.plan_latencies_ms += [r.plan_s * 1e3 for r in fetch.ranks]
                if path == "duplicate_report":
                    again = await asyncio.gather(
                        *(client.report(r.tp_rank, r.plan_id, nbytes=r.nbytes) for r in fetch.ranks)
                    )
                    if not all(o.duplicate for o in again):
                        self._error(
                            f"transfer {transfer_id}: a repeated report was not a duplicate"
                        )
                return
            ranks = client.ranks
            plans = await asyncio.gather(
                *(self._plan(client, transfer_id, r, blocks) for r in ranks)
            )
            # Aborted while every rank reads, or rank 0's reads fail: the transfer ends, its
            # prefill ranks stay held until the other ranks' reads report.
            if path == "aborted":
                await self._abort(client, transfer_id)
            else:
                await client.report(ranks[0], plans[0].plan_id, error="soak: injected read failure")
            first = 0 if path == "aborted" else 1
            await asyncio.gather(
                *(
                    self._report_ended(client, transfer_id, r, plan)
                    for r, plan in zip(ranks[first:], plans[first:])
                )
            )
        finally:
            pool.free(blocks)

    async def _plan(
        self, client: AsyncDecodeClient, transfer_id: str, tp_rank: int, blocks: list[list[int]]
    ) -> pb.GetTransferPlanResponse:
        started = time.perf_counter()
        plan = await client.plan(tp_rank, transfer_id, blocks)
        self.result.plan_latencies_ms.append((time.perf_counter() - started) * 1e3)
        return plan

    async def _report_ended(
        self,
        client: AsyncDecodeClient,
        transfer_id: str,
        tp_rank: int,
        plan: pb.GetTransferPlanResponse,
    ) -> None:
        """Report DONE for a transfer that ended during the reads: must be refused ABORTED."""
        try:
            await client.report(tp_rank, plan.plan_id, nbytes=plan.total_bytes)
        except BrokerCallError as exc:
            if exc.code is not grpc.StatusCode.ABORTED:
                raise
        else:
            self._error(f"transfer {transfer_id}: a DONE report after its end was accepted")

    async def _abort(self, client: AsyncDecodeClient, transfer_id: str) -> None:
        state = await client.abort(transfer_id, "soak")
        if state is not TransferState.ABORTED:
            self._error(f"transfer {transfer_id}: aborted, but {state.name}")

    async def _await_release(self, transfer: _Transfer) -> None:
        if transfer.done is not None:
            try:
                await asyncio.wait_for(transfer.done, RELEASE_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._error(
                    f"{transfer.path} transfer {transfer.transfer_id}: no release "
                    f"within {RELEASE_TIMEOUT_S:g} s"
                )
                return
        if transfer.path == "completed":
            self.result.transfer_latencies_ms.append(
                (time.perf_counter() - transfer.published_at) * 1e3
            )

    async def _expect_no_plan(
        self, transfer_id: str, client: AsyncDecodeClient, tokens: int
    ) -> None:
        """A decode rank asking after the release must be refused, never given addresses."""
        ids = fresh_block_ids(self.decode_layout, tokens)
        try:
            await client.plan(client.ranks[0], transfer_id, ids)
        except BrokerCallError as exc:
            if exc.code is not grpc.StatusCode.FAILED_PRECONDITION:
                self._error(f"late plan of {transfer_id}: {exc}")
        else:
            self._error(f"late plan of released transfer {transfer_id} was answered")
