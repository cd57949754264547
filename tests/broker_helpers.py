"""Shared pieces of the broker tests: a hand-driven clock, small hybrid models, fake memory
regions and registrations built from :mod:`broker.models` layouts, and a TCP proxy that
delays replies."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np

from broker.api import Lease, PlanResult
from broker.layout import EngineLayout, GroupKind
from broker.models import AttentionParams, MambaParams, ModelSpec, build_engine_layout
from broker.records import MemoryRegion, RankRegistration, region_rows
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import ROLE, MemoryKind, Role
from clients import protocol
from clients.transport import Region

MAMBA2 = MambaParams(
    "mamba2",
    conv_kernel=4,
    intermediate_size=64,
    num_heads=16,
    head_dim=4,
    n_groups=2,
    state_size=8,
)

#: First fake address; engines and ranks get disjoint, page-aligned address ranges above it.
BASE_ADDR = 0x7F00_0000_0000
REGION_GAP = 1 << 20


class FakeClock:
    """Milliseconds that only move when a test says so."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


def hybrid(kv_heads: int = 4, mamba: MambaParams | None = MAMBA2, name: str = "tiny") -> ModelSpec:
    """Mamba2 + attention in three groups (Mamba, attention, Mamba) over two regions."""
    if mamba is None:
        return ModelSpec(
            name, ((GroupKind.ATTENTION, ("a0", "a1")),), AttentionParams(kv_heads, 8), None
        )
    return ModelSpec(
        name,
        (
            (GroupKind.MAMBA, ("m0", "m2")),
            (GroupKind.ATTENTION, ("a1", "a3")),
            (GroupKind.MAMBA, ("m4", "m5")),
        ),
        AttentionParams(kv_heads, 8),
        mamba,
    )


def fake_regions(
    layout: EngineLayout, engine_index: int, tp_rank: int, kind: MemoryKind = MemoryKind.DRAM
) -> tuple[MemoryRegion, ...]:
    """Disjoint fake regions of exactly ``num_blocks * page_bytes`` for one rank."""
    rank = layout.ranks[tp_rank]
    size = rank.region_bytes
    stride = size + REGION_GAP
    first = BASE_ADDR + (engine_index * 64 + tp_rank) * rank.num_regions * stride
    return tuple(
        MemoryRegion(first + i * stride, size, tp_rank, kind) for i in range(rank.num_regions)
    )


def registration(
    layout: EngineLayout, engine_id: str, role: Role, tp_rank: int, engine_index: int = 0
) -> RankRegistration:
    return RankRegistration(
        engine_id,
        role,
        layout.tp_size,
        tp_rank,
        f"{engine_id}-agent{tp_rank}",
        f"metadata of {engine_id} rank {tp_rank}".encode(),
        region_rows(fake_regions(layout, engine_index, tp_rank)),
        layout.ranks[tp_rank],
        layout.model,
    )


def register_engine(
    service: BrokerService, layout: EngineLayout, engine_id: str, role: Role, engine_index: int = 0
) -> list[Lease]:
    return [
        service.register_rank(registration(layout, engine_id, role, r, engine_index))
        for r in range(layout.tp_size)
    ]


def register_request(
    layout: EngineLayout, engine_id: str, role: int, tp_rank: int, engine_index: int = 0
) -> pb.RegisterRankRequest:
    """The protobuf form of :func:`registration`, built by the clients' builder."""
    return protocol.registration(
        layout.ranks[tp_rank],
        [
            Region(r.base_addr, r.length_bytes, r.device_id, r.memory_kind.name)
            for r in fake_regions(layout, engine_index, tp_rank)
        ],
        engine_id=engine_id,
        role=ROLE.from_proto(role, "role"),
        tp_size=layout.tp_size,
        agent_name=f"{engine_id}-agent{tp_rank}",
        agent_metadata=f"metadata of {engine_id} rank {tp_rank}".encode(),
        model_fingerprint=layout.model,
    )


def publish_many_blocks(
    stub: pb_grpc.BrokerStub,
    transfer_id: str,
    engines: tuple[str, str],
    blocks: int,
    engine_index: int,
    timeout: float,
) -> pb.GetTransferPlanRequest:
    """Registers a TP1 prefill and decode engine (``engines``) of one FA group, publishes
    ``blocks`` prefill blocks in interleaved order (no two neighbours adjacent) and returns
    the decode engine's ask for them in order."""
    prefill, decode = engines
    layout = build_engine_layout(hybrid(mamba=None), 1, blocks, 16)
    for engine_id, role, index in ((prefill, pb.ROLE_PREFILL, 0), (decode, pb.ROLE_DECODE, 1)):
        request = register_request(layout, engine_id, role, 0, engine_index + index)
        stub.RegisterRank(request, timeout=timeout)
    order = list(range(blocks))
    stub.PublishBlocks(
        pb.PublishBlocksRequest(
            transfer_id=transfer_id,
            engine_id=prefill,
            num_tokens=16 * blocks,
            block_ids=[pb.BlockIds(ids=order[1::2] + order[::2])],
        ),
        timeout=timeout,
    )
    return pb.GetTransferPlanRequest(
        transfer_id=transfer_id, engine_id=decode, block_ids=[pb.BlockIds(ids=order)]
    )


def assert_inside_regions(descriptors: np.ndarray, regions: tuple[MemoryRegion, ...]) -> None:
    """Every ``(addr, len, dev)`` row lies inside one region, on that region's device."""
    starts = np.array([r.base_addr for r in regions])
    ends = starts + np.array([r.length_bytes for r in regions])
    index = np.searchsorted(starts, descriptors[:, 0], side="right") - 1
    assert (index >= 0).all()
    assert (descriptors[:, 0] + descriptors[:, 1] <= ends[index]).all()
    assert (descriptors[:, 1] > 0).all()
    assert (descriptors[:, 2] == np.array([r.device_id for r in regions])[index]).all()


def plan_bytes(result: PlanResult) -> int:
    return sum(int(s.local[:, 1].sum()) for s in result.sources)


async def longest_loop_gap(stop: asyncio.Event, tick_s: float) -> float:
    """The longest the event loop left a ticker of ``tick_s`` waiting (seconds) until ``stop``."""
    longest, last = 0.0, time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(tick_s)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


class SlowProxy:
    """A TCP proxy to ``port`` on the loopback that holds every reply ``delay_s``;
    :attr:`most_held` is the most replies it held at once (on all its connections)."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.target, self.delay_s = port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.most_held = 0
        self._held = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the server stopped
                client.close()
                continue
            for source, sink, delay in ((client, upstream, 0.0), (upstream, client, self.delay_s)):
                threading.Thread(target=self._pipe, args=(source, sink, delay), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        try:
            while data := source.recv(1 << 16):
                if delay_s:
                    with self._lock:
                        self._held += 1
                        self.most_held = max(self.most_held, self._held)
                    time.sleep(delay_s)
                    with self._lock:
                        self._held -= 1
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    def close(self) -> None:
        self.listener.close()


def reap_all(service: BrokerService) -> None:
    """Reap until nothing due is left: what one reaper pass does when no slice ends it (a
    slow host can end a pass after 2 ms and leave the rest for the next)."""
    while service.reap():
        pass
