"""Store threads taking turns (:mod:`broker.store.turns`): a broker process on a real
``redis-server`` behind a proxy that holds every reply 20 ms serves concurrent calls on
several store threads whose round trips overlap (the proxy holds several replies at once),
and loses nothing to the interleaving: every decode rank's plan and report of 24 transfers
made at once, each transfer COMPLETED and each prefill rank released exactly once; the same
on one store thread, which never has two round trips out."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import grpc
import pytest
from prerequisites import require_module

require_module("redis", "dev")

from broker_helpers import SlowProxy, hybrid
from conftest import RedisServer

from broker.server import BrokerServer
from broker.service import BrokerService
from broker.store.redis import RedisStateStore
from broker.store.turns import Turns, waiting
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import ReleaseReason
from clients.decode import AsyncDecodeClient
from clients.prefill import AsyncPrefillClient, Release
from clients.transport import NoMemoryTransport, fake_memory
from harness.scenarios import build_scenario

DELAY_S = 0.02
TRANSFERS = 24


async def _pair_reads(address: str, threads: int) -> tuple[list[Release], list[int], int]:
    """Publish :data:`TRANSFERS` transfers TP2 -> TP2, then plan and report every decode rank
    of all of them at once; the releases, each transfer's state, and repeated releases."""
    sc = build_scenario(hybrid(), 2, 2, 64)
    transport = NoMemoryTransport(256)
    releases: list[Release] = []
    prefill = AsyncPrefillClient(
        address, f"P{threads}", sc.prefill, fake_memory(sc.prefill, 0x7F00_0000_0000),
        on_release=releases.append, transport=transport,
    )  # fmt: skip
    decode = AsyncDecodeClient(
        address, f"D{threads}", sc.decode, fake_memory(sc.decode, 0x7E00_0000_0000),
        transport=transport,
    )  # fmt: skip
    await prefill.start()
    await decode.start()
    ids = [f"t{i}" for i in range(TRANSFERS)]
    request = sc.request
    try:
        await asyncio.gather(
            *(prefill.publish(t, request.prefill_block_ids, request.num_tokens) for t in ids)
        )

        async def read(transfer_id: str, rank: int) -> None:
            plan = await decode.plan(rank, transfer_id, request.decode_block_ids)
            await decode.report(rank, plan.plan_id, nbytes=plan.total_bytes)

        await asyncio.gather(*(read(t, rank) for t in ids for rank in range(sc.decode.tp_size)))
        deadline = time.monotonic() + 30
        while len(releases) < TRANSFERS * sc.prefill.tp_size and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # a repeated release would come now
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            states = [
                (await stub.GetTransfer(pb.GetTransferRequest(transfer_id=t))).state for t in ids
            ]
        return releases, states, prefill.repeated_releases
    finally:
        await decode.close()
        await prefill.close()


@pytest.mark.parametrize("threads", [4, 1])
def test_store_threads_overlap_round_trips_and_lose_nothing(
    redis_server: RedisServer, threads: int
) -> None:
    proxy = SlowProxy(redis_server.port, DELAY_S)
    url = f"redis://127.0.0.1:{proxy.port}/0"
    store = RedisStateStore.from_url(url, f"turns{threads}:", timeout_ms=10_000)

    async def scenario() -> tuple[list[Release], list[int], int, int]:
        server = BrokerServer(BrokerService(store), store_threads=threads)
        await server.start()
        try:
            proxy.most_held = 0  # from here: the pair's calls (and the reaper's)
            releases, states, repeated = await _pair_reads(server.address, threads)
            return releases, states, repeated, proxy.most_held
        finally:
            await server.stop(None)

    try:
        started = time.monotonic()
        releases, states, repeated, most_held = asyncio.run(scenario())
        took = time.monotonic() - started
    finally:
        proxy.close()
    print(f"\n{threads} store threads: {took:.2f} s, at most {most_held} replies held at once")
    counts = Counter((r.transfer_id, r.tp_rank) for r in releases)
    assert counts == {(f"t{i}", rank): 1 for i in range(TRANSFERS) for rank in (0, 1)}, counts
    assert {r.reason for r in releases} == {ReleaseReason.COMPLETED}
    assert repeated == 0
    assert states == [pb.TRANSFER_STATE_COMPLETED] * TRANSFERS
    # One more reply may be held at any time: a release published to the broker's
    # subscription (its own connection, read on its own thread).
    if threads == 1:
        assert most_held <= 2, most_held
    else:
        assert most_held >= 3, f"the store threads never waited for Redis together ({most_held})"


def test_one_thread_runs_service_code_at_a_time_and_hands_the_turn_on_while_waiting() -> None:
    """Four threads each run a call that works, waits (:func:`waiting`), then works again:
    their waits overlap, their work never does, and each call's turn excludes its wait."""
    turns = Turns()
    working: list[int] = []
    most_working = [0]
    waits_overlapped = threading.Event()
    waiting_now = [0]
    lock = threading.Lock()

    def work() -> None:
        with lock:
            working.append(1)
            most_working[0] = max(most_working[0], len(working))
        time.sleep(0.005)
        with lock:
            working.pop()

    def wait_for_store() -> None:
        with lock:
            waiting_now[0] += 1
            if waiting_now[0] >= 2:
                waits_overlapped.set()
        waits_overlapped.wait(1.0)
        time.sleep(0.05)
        with lock:
            waiting_now[0] -= 1

    held: list[float] = []

    def call() -> None:
        from broker.store.turns import last_held

        def body() -> None:
            work()
            waiting(wait_for_store)
            work()

        turns.run(body)
        held.append(last_held())

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert waits_overlapped.is_set(), "no two calls waited at once"
    assert most_working[0] == 1, "two threads ran service code at once"
    assert len(held) == 4 and all(0.009 < h < 0.05 for h in held), held
    # Outside a turn, waiting() just calls.
    assert waiting(lambda x: x + 1, 1) == 2
