"""The garbage collector's policy in a serving broker (:mod:`broker.collector`), by counts of
objects, not by time: once a cluster registered and the reaper ticked, what a collection
walks is bounded whatever the cluster's size (its records are frozen), and rounds of ranks
registering, watching releases and leaving over real gRPC, each round's objects in cycles
dying frozen, leave the heap bounded, frozen objects included."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import grpc
import pytest
from broker_helpers import FakeClock, hybrid, register_engine, register_request

from broker.collector import CollectorPolicy
from broker.config import ServiceConfig
from broker.server import BrokerServer
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import Role
from harness.scenarios import build_scenario

CONFIG = ServiceConfig(lease_ttl_ms=600_000, max_ranks=4_096)
REAP_MS = 5
#: Objects in cycles each round keeps while its ranks are registered (long-lived records
#: with a back reference, say): frozen with them, dead once they leave.
CYCLES = 20_000


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    """The process's collector as it was: thresholds set back, nothing left frozen."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


async def _ticked(server: BrokerServer) -> None:
    """Until the reaper ticked the collector twice after what ran before."""
    assert server.collector is not None
    tick, ticks = server.collector.tick, 0

    def counted() -> None:
        nonlocal ticks
        ticks += 1
        tick()

    server.collector.tick = counted  # type: ignore[method-assign]
    try:
        while ticks < 2:
            await asyncio.sleep(REAP_MS / 1000)
    finally:
        server.collector.tick = tick  # type: ignore[method-assign]


def test_a_registered_cluster_is_frozen_so_collections_walk_little() -> None:
    """Thresholds scaled down with the cluster (its ranks share their layout objects)."""
    policy = CollectorPolicy(young=1_000)
    service = BrokerService(clock=FakeClock(), config=CONFIG)
    sc = build_scenario(hybrid(), 8, 8, 100)

    async def scenario() -> tuple[int, int, int]:
        server = BrokerServer(service, "127.0.0.1:0", REAP_MS, collector=policy)
        await server.start()
        try:
            frozen_before = gc.get_freeze_count()
            for i in range(128):  # 1,024 ranks
                layout, role = (sc.prefill, Role.PREFILL) if i % 2 else (sc.decode, Role.DECODE)
                register_engine(service, layout, f"e{i}", role, i)
            await _ticked(server)
            return frozen_before, gc.get_freeze_count(), len(gc.get_objects())
        finally:
            await server.stop(None)

    frozen_before, frozen_after, walked = asyncio.run(scenario())
    assert service.store.count_ranks() == 1_024
    # A collection walks what is not frozen: the young generation and the survivors of the
    # young collections since the last tick, not the 1,024 ranks' records.
    assert walked < 2 * policy.young, (walked, frozen_after)
    assert frozen_after - frozen_before > 5 * 1_024, (frozen_before, frozen_after)


def test_rounds_of_ranks_coming_and_going_leave_the_heap_bounded() -> None:
    """Small thresholds, so that every round freezes: each round's ranks register over
    gRPC, watch their releases (streams open across the freezes) and deregister."""
    policy = CollectorPolicy(young=1_000, thaw_interval_s=0.0)
    service = BrokerService(clock=FakeClock(), config=CONFIG)
    sc = build_scenario(hybrid(), 2, 2, 100)

    async def round_(stub: pb_grpc.BrokerStub, server: BrokerServer, n: int) -> None:
        requests = [
            register_request(sc.prefill, f"r{n}e{i}", pb.ROLE_PREFILL, r, i)
            for i in range(16)
            for r in range(2)
        ]
        leases = [await stub.RegisterRank(request) for request in requests]
        streams = [
            stub.WatchReleases(pb.WatchReleasesRequest(engine_id=q.engine_id, tp_rank=q.tp_rank))
            for q in requests
        ]
        watching = [asyncio.create_task(_drained(stream)) for stream in streams]
        cycles = _cycles(CYCLES)  # alive while the round's ranks are, frozen with them
        await _ticked(server)
        for lease in leases:
            await stub.Deregister(pb.DeregisterRequest(lease_id=lease.lease_id))
        await asyncio.gather(*watching)
        del cycles
        await _ticked(server)

    async def scenario() -> list[int]:
        server = BrokerServer(service, "127.0.0.1:0", REAP_MS, collector=policy)
        await server.start()
        held = []
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.BrokerStub(channel)
                for n in range(16):
                    await round_(stub, server, n)
                    gc.collect()  # what is not frozen and garbage: gone, as it would be
                    held.append(len(gc.get_objects()) + gc.get_freeze_count())
        finally:
            await server.stop(None)
        return held

    held = asyncio.run(scenario())
    assert service.store.count_ranks() == 0
    # Each round leaves CYCLES dead objects frozen (16 rounds: 300,000 more, never thawed).
    # Thawed once the frozen heap doubled since the last thaw, which found at most the
    # heap of the start and a round's objects alive, they stay under twice that, plus the
    # round that tips it.
    assert max(held) <= 2 * (held[0] + CYCLES + policy.young) + CYCLES, held


def _cycles(n: int) -> list[dict[str, object]]:
    """``n`` objects each referring to itself: freed only by a collection."""
    made: list[dict[str, object]] = [{} for _ in range(n)]
    for d in made:
        d["self"] = d
    return made


def test_a_tick_while_the_collector_runs_freezes_nothing() -> None:
    """Another thread's collection, finalizing its garbage, may let the event loop tick:
    ``gc.collect()`` then does nothing, and freezing would keep what it did not collect."""
    policy = CollectorPolicy(young=1_000)
    policy.start()
    survivors = _cycles(5_000)
    gc.collect(1)  # they survive young collections
    frozen = gc.get_freeze_count()

    def tick_during(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            policy.tick()

    gc.callbacks.append(tick_during)
    try:
        gc.collect(0)
    finally:
        gc.callbacks.remove(tick_during)
    assert gc.get_freeze_count() == frozen
    policy.tick()  # a quiet point: the survivors are frozen now
    assert gc.get_freeze_count() >= frozen + len(survivors)


def test_the_whole_heap_is_collected_at_most_once_an_interval() -> None:
    """A heap that doubles again and again (a broker under load keeping its transfers) is
    frozen as it grows, but thawed and collected whole only once the interval passed."""
    now = [0.0]
    policy = CollectorPolicy(young=1_000, thaw_interval_s=60.0, clock=lambda: now[0])
    policy.start()
    kept = []
    for _ in range(6):  # the frozen heap doubles each time
        kept.append(_cycles(gc.get_freeze_count() + len(gc.get_objects())))
        gc.collect(1)  # they survive young collections
        policy.tick()
        now[0] += 5.0
    assert policy.thaws == 0 and gc.get_freeze_count() >= sum(map(len, kept))
    now[0] += 60.0
    kept.append(_cycles(gc.get_freeze_count()))
    gc.collect(1)
    policy.tick()
    assert policy.thaws == 1


async def _drained(stream: grpc.aio.UnaryStreamCall) -> None:
    """Read the stream to its end (its rank went away)."""
    try:
        async for _ in stream:
            pass
    except grpc.aio.AioRpcError:
        pass
