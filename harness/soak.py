"""Soak load: fake prefill and decode engines driving a broker over gRPC, what ``pdbroker
soak`` runs in each of its worker processes.

No memory moves and NIXL is not used: every rank registers fake, disjoint regions (the broker
never touches memory) and a decode rank reports what its plan says it would have read. A
worker owns some prefill and decode engines (their registrations, leases and, for prefill
ranks, ``WatchReleases`` streams) and starts its share of ``rate`` transfers a second on
``lanes`` concurrent lanes (a lane that falls behind starts its next one at once), each from
one of its prefill engines to any decode engine, so the transfers of all workers cover every
engine pair. Each transfer takes one of :data:`PATHS` (mostly the happy path, some unhappy ones that
soak the release path) and waits until every prefill rank was released; the worker counts
each rank's releases, so a transfer released twice or never is seen.
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
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import rank_layout_to_proto
from clients.session import BrokerCallError, call, open_channel
from harness.scenarios import block_counts, fresh_block_ids

#: Transfer paths and their weights: the happy path, a decode rank reporting FAILED, every
#: report sent twice, an abort (before or after the plans) and a transfer nobody reads
#: before its short TTL. Each must end with every prefill rank released exactly once.
PATHS = {"completed": 84, "consumer_failed": 4, "duplicate_report": 4, "aborted": 4, "expired": 4}
#: Release reasons each path may end with (a rank whose readers all reported DONE before
#: another rank's reader failed is released COMPLETED).
EXPECTED_REASONS = {
    "completed": {pb.RELEASE_REASON_COMPLETED},
    "duplicate_report": {pb.RELEASE_REASON_COMPLETED},
    "consumer_failed": {pb.RELEASE_REASON_CONSUMER_FAILED, pb.RELEASE_REASON_COMPLETED},
    "aborted": {pb.RELEASE_REASON_ABORTED},
    "expired": {pb.RELEASE_REASON_EXPIRED},
}
#: TTL of the transfers left unread to expire (ms); the broker reaps every 100 ms.
EXPIRE_TTL_MS = 200
#: Longest wait for a transfer's releases once its last call returned (seconds).
RELEASE_TIMEOUT_S = 10.0
#: Deadline of one RPC (seconds).
CALL_TIMEOUT_S = 10.0
#: Error messages kept verbatim per worker (the rest are only counted).
ERROR_SAMPLES = 5
#: Address space given to each rank's fake regions.
RANK_ADDRESS_SPAN = 1 << 40


@dataclass(frozen=True)
class Fleet:
    """The soak's engines, the same in every worker: ``prefill_engines`` engines of
    ``prefill_tp`` ranks and ``decode_engines`` of ``decode_tp`` serving the preset
    ``model``; requests of ``min_tokens .. max_tokens``; ``workers`` processes of ``lanes``
    concurrent transfers each, starting ``rate`` transfers a second in all (0: as fast as
    the lanes go)."""

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

    def rank_base(self, engine_id: str, tp_rank: int) -> int:
        """First fake address of a rank's regions: each rank of the fleet has its own span."""
        engines = self.engine_ids("prefill") + self.engine_ids("decode")
        slot = engines.index(engine_id) * max(self.prefill_tp, self.decode_tp) + tp_rank
        return (slot + 1) * RANK_ADDRESS_SPAN

    def layouts(self) -> tuple[EngineLayout, EngineLayout, int]:
        """Prefill and decode layouts and the most blocks one request takes. A prefill engine
        holds blocks for every lane of its worker; a decode engine for every lane of every
        worker (each worker allocates from its own slice)."""
        model = resolve_model(self.model)
        block_size = max(
            hma_block_size(model, self.prefill_tp), hma_block_size(model, self.decode_tp)
        )
        probe = build_engine_layout(model, self.prefill_tp, 1, block_size)
        per_request = sum(block_counts(probe, self.max_tokens))
        prefill = build_engine_layout(model, self.prefill_tp, self.lanes * per_request, block_size)
        decode = build_engine_layout(
            model, self.decode_tp, self.workers * self.lanes * per_request, block_size
        )
        return prefill, decode, per_request


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
    """Free block ids of one engine (or of a worker's slice of one), in shuffled order."""

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
    """One worker process: registers its engines and says ``("ready",)``; on ``("go",
    start, deadline)`` (``time.monotonic()`` instants) runs transfers from ``start`` until
    ``deadline``, drains, sends ``("result", WorkerResult)``; on ``("close",)`` deregisters
    and exits."""
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
        self.prefill_layout, self.decode_layout, per_request = fleet.layouts()
        self.own_prefill = fleet.engine_ids("prefill")[index :: fleet.workers]
        self.own_decode = fleet.engine_ids("decode")[index :: fleet.workers]
        self.all_decode = fleet.engine_ids("decode")
        self.prefill_pools = {
            e: _BlockPool(range(self.prefill_layout.ranks[0].num_blocks), self.rng)
            for e in self.own_prefill
        }
        first = index * fleet.lanes * per_request
        slice_ = range(first, first + fleet.lanes * per_request)
        self.decode_pools = {e: _BlockPool(slice_, self.rng) for e in self.all_decode}
        self.transfers: dict[str, _Transfer] = {}
        self.result = WorkerResult()
        self.started = 0
        self.leases: list[str] = []
        self.stub: pb_grpc.BrokerStub

    async def run(self) -> None:
        async with open_channel(self.fleet.target) as channel:
            self.stub = pb_grpc.BrokerStub(channel)
            lease_ttl_ms = await self._register()
            watchers = [
                asyncio.create_task(self._watch(e, r))
                for e in self.own_prefill
                for r in range(self.fleet.prefill_tp)
            ]
            keep_alive = asyncio.create_task(self._keep_alive(lease_ttl_ms))
            loop = asyncio.get_running_loop()
            self.conn.send(("ready",))
            _, start, deadline = await loop.run_in_executor(None, self.conn.recv)
            lanes = (self._lane(start, deadline) for _ in range(self.fleet.lanes))
            await asyncio.gather(*lanes)
            self.result.unreleased = [t.transfer_id for t in self.transfers.values() if t.pending]
            self.result.double_released = sum(max(t.releases) > 1 for t in self.transfers.values())
            self.conn.send(("result", self.result))
            await loop.run_in_executor(None, self.conn.recv)  # ("close",)
            for task in (*watchers, keep_alive):
                task.cancel()
            for lease_id in self.leases:
                await call(
                    self.stub, "Deregister", pb.DeregisterRequest(lease_id=lease_id), CALL_TIMEOUT_S
                )

    # ------------------------------------------------------------------ engines

    async def _register(self) -> int:
        """Register every rank of the owned engines; returns the lease TTL (ms)."""
        ttl_ms = 0
        owned = [(e, pb.ROLE_PREFILL, self.prefill_layout) for e in self.own_prefill]
        owned += [(e, pb.ROLE_DECODE, self.decode_layout) for e in self.own_decode]
        for engine_id, role, layout in owned:
            for rank in layout.ranks:
                base = self.fleet.rank_base(engine_id, rank.tp_rank)
                stride = rank.region_bytes + (1 << 20)
                request = pb.RegisterRankRequest(
                    engine_id=engine_id,
                    role=role,
                    tp_size=layout.tp_size,
                    tp_rank=rank.tp_rank,
                    agent_name=f"{engine_id}-{rank.tp_rank}",
                    agent_metadata=b"m" * 256,
                    regions=[
                        pb.Region(
                            base_addr=base + i * stride,
                            length_bytes=rank.region_bytes,
                            device_id=rank.tp_rank,
                            memory_kind=pb.MEMORY_KIND_VRAM,
                        )
                        for i in range(rank.num_regions)
                    ],
                    layout=rank_layout_to_proto(rank),
                    model_fingerprint=layout.model,
                )
                lease = await call(self.stub, "RegisterRank", request, CALL_TIMEOUT_S)
                self.leases.append(lease.lease_id)
                ttl_ms = lease.ttl_ms
        return ttl_ms

    async def _keep_alive(self, ttl_ms: int) -> None:
        while True:
            await asyncio.sleep(ttl_ms / 3000)
            for lease_id in self.leases:
                try:
                    await call(
                        self.stub,
                        "KeepAlive",
                        pb.KeepAliveRequest(lease_id=lease_id),
                        CALL_TIMEOUT_S,
                    )
                except BrokerCallError as exc:
                    self._error(str(exc))

    async def _watch(self, engine_id: str, tp_rank: int) -> None:
        """Count prefill rank ``tp_rank``'s releases; free a transfer's blocks and wake its
        lane once every rank was released."""
        stream = self.stub.WatchReleases(
            pb.WatchReleasesRequest(engine_id=engine_id, tp_rank=tp_rank)
        )
        try:
            async for event in stream:
                self._on_release(tp_rank, event)
        except grpc.aio.AioRpcError as exc:
            self._error(f"WatchReleases {engine_id}/{tp_rank}: {exc.code().name}: {exc.details()}")
        else:
            self._error(f"WatchReleases {engine_id}/{tp_rank} ended")

    def _on_release(self, tp_rank: int, event: pb.ReleaseEvent) -> None:
        transfer = self.transfers.get(event.transfer_id)
        if transfer is None:
            self._error(f"release of unknown transfer {event.transfer_id}")
            return
        transfer.releases[tp_rank] += 1
        if transfer.releases[tp_rank] > 1:
            return
        if event.reason not in EXPECTED_REASONS[transfer.path]:
            reason = pb.ReleaseReason.Name(event.reason)
            self._error(f"{transfer.path} transfer released {reason}: {event.detail}")
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
            decode = self.all_decode[(n // len(self.own_prefill)) % len(self.all_decode)]
            path = self.rng.choices(list(PATHS), list(PATHS.values()))[0]
            try:
                await self._transfer(f"w{self.index}-{n:07d}", path, prefill, decode)
            except (BrokerCallError, BlockPoolExhausted) as exc:
                self._error(f"{path}: {exc}")

    async def _transfer(self, transfer_id: str, path: str, prefill: str, decode: str) -> None:
        """Publish, take ``path``, wait for every prefill rank's release."""
        tokens = self.rng.randint(self.fleet.min_tokens, self.fleet.max_tokens)
        pool = self.prefill_pools[prefill]
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
            await call(
                self.stub,
                "PublishBlocks",
                pb.PublishBlocksRequest(
                    transfer_id=transfer_id,
                    engine_id=prefill,
                    num_tokens=tokens,
                    block_ids=[pb.BlockIds(ids=g) for g in blocks],
                    ttl_ms=EXPIRE_TTL_MS if path == "expired" else 0,
                ),
                CALL_TIMEOUT_S,
            )
        except BrokerCallError:
            del self.transfers[transfer_id]
            pool.free(blocks)
            raise
        self.result.paths[path] += 1
        try:
            if path != "expired":
                await self._read(transfer, decode, tokens)
        finally:
            await self._await_release(transfer)
        if path in ("aborted", "expired"):
            await self._expect_no_plan(transfer_id, decode, tokens)

    async def _read(self, transfer: _Transfer, decode: str, tokens: int) -> None:
        """The decode engine's side of ``transfer``'s path: plans, then reports or abort."""
        path, transfer_id = transfer.path, transfer.transfer_id
        if path == "aborted" and self.rng.random() < 0.5:
            await self._abort(transfer_id)  # before any plan
            return
        pool = self.decode_pools[decode]
        blocks = pool.allocate(block_counts(self.decode_layout, tokens))
        try:
            ranks = range(self.fleet.decode_tp)
            plans = await asyncio.gather(
                *(self._plan(transfer_id, decode, r, blocks) for r in ranks)
            )
            if path in ("aborted", "consumer_failed"):
                # Aborted while every rank reads, or rank 0's reads fail: the transfer ends,
                # its prefill ranks stay held until the other ranks' reads report.
                if path == "aborted":
                    await self._abort(transfer_id)
                else:
                    await self._report(plans[0], decode, 0, failed=True)
                first = 0 if path == "aborted" else 1
                await asyncio.gather(
                    *(self._report_ended(transfer_id, plans[r], decode, r) for r in ranks[first:])
                )
                return
            outcomes = await asyncio.gather(
                *(self._report(plan, decode, r, False) for r, plan in zip(ranks, plans))
            )
            if not all(o.intact for o in outcomes):
                self._error(f"{path} transfer {transfer_id}: a DONE report was not intact")
            if path == "duplicate_report":
                again = await asyncio.gather(
                    *(self._report(plan, decode, r, False) for r, plan in zip(ranks, plans))
                )
                if not all(o.duplicate for o in again):
                    self._error(f"transfer {transfer_id}: a repeated report was not a duplicate")
        finally:
            pool.free(blocks)

    async def _plan(
        self, transfer_id: str, decode: str, tp_rank: int, blocks: list[list[int]]
    ) -> pb.GetTransferPlanResponse:
        request = pb.GetTransferPlanRequest(
            transfer_id=transfer_id,
            engine_id=decode,
            tp_rank=tp_rank,
            block_ids=[pb.BlockIds(ids=g) for g in blocks],
        )
        started = time.perf_counter()
        plan = await call(self.stub, "GetTransferPlan", request, CALL_TIMEOUT_S)
        self.result.plan_latencies_ms.append((time.perf_counter() - started) * 1e3)
        return plan

    async def _report(
        self, plan: pb.GetTransferPlanResponse, decode: str, tp_rank: int, failed: bool
    ) -> pb.ReportTransferResponse:
        status = pb.REPORT_STATUS_FAILED if failed else pb.REPORT_STATUS_DONE
        return await call(
            self.stub,
            "ReportTransfer",
            pb.ReportTransferRequest(
                plan_id=plan.plan_id,
                engine_id=decode,
                tp_rank=tp_rank,
                status=status,
                bytes_moved=0 if failed else plan.total_bytes,
                duration_us=1000,
                error="soak: injected read failure" if failed else "",
            ),
            CALL_TIMEOUT_S,
        )

    async def _report_ended(
        self, transfer_id: str, plan: pb.GetTransferPlanResponse, decode: str, tp_rank: int
    ) -> None:
        """Report DONE for a transfer that ended during the reads: must be refused ABORTED."""
        try:
            await self._report(plan, decode, tp_rank, False)
        except BrokerCallError as exc:
            if exc.code is not grpc.StatusCode.ABORTED:
                raise
        else:
            self._error(f"transfer {transfer_id}: a DONE report after its end was accepted")

    async def _abort(self, transfer_id: str) -> None:
        response = await call(
            self.stub,
            "AbortTransfer",
            pb.AbortTransferRequest(transfer_id=transfer_id, reason="soak"),
            CALL_TIMEOUT_S,
        )
        if response.state != pb.TRANSFER_STATE_ABORTED:
            state = pb.TransferState.Name(response.state)
            self._error(f"transfer {transfer_id}: aborted, but {state}")

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

    async def _expect_no_plan(self, transfer_id: str, decode: str, tokens: int) -> None:
        """A decode rank asking after the release must be refused, never given addresses."""
        ids = fresh_block_ids(self.decode_layout, tokens)
        try:
            await call(
                self.stub,
                "GetTransferPlan",
                pb.GetTransferPlanRequest(
                    transfer_id=transfer_id,
                    engine_id=decode,
                    tp_rank=0,
                    block_ids=[pb.BlockIds(ids=g) for g in ids],
                ),
                CALL_TIMEOUT_S,
            )
        except BrokerCallError as exc:
            if exc.code is not grpc.StatusCode.FAILED_PRECONDITION:
                self._error(f"late plan of {transfer_id}: {exc}")
        else:
            self._error(f"late plan of released transfer {transfer_id} was answered")
