"""Store calls off the event loop: a broker on a real ``redis-server`` paused with ``CLIENT
PAUSE`` (from a second connection) keeps its event loop, health checks, health stream and a
broker on the in-memory store in the same process answering, while its store call waits for
its deadline and fails UNAVAILABLE; once Redis answers again, so does the broker. And the
deadline is the call's, not each reply's: behind a proxy that delays every reply, a call of
several round trips fails once its deadline passed."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prerequisites import require_module

redis = require_module("redis", "dev")

from broker_helpers import SlowProxy, hybrid, longest_loop_gap, register_request
from conftest import RedisServer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.errors import StoreUnavailableError
from broker.server import BrokerServer
from broker.service import BrokerService
from broker.store.redis import RedisStateStore
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.scenarios import build_scenario

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: The store's deadline per call, and how long Redis stays paused.
TIMEOUT_MS = 300
PAUSE_MS = 1_500


def test_a_paused_redis_holds_only_the_calls_that_wait_for_it(redis_server: RedisServer) -> None:
    store = RedisStateStore.from_url(redis_server.url, "paused:", timeout_ms=TIMEOUT_MS)
    layout = build_scenario(hybrid(), 1, 1, 100).prefill

    async def scenario() -> dict[str, float]:
        slow = BrokerServer(BrokerService(store), reap_interval_ms=50)
        quick = BrokerServer(BrokerService())
        await slow.start()
        await quick.start()
        timings: dict[str, float] = {}
        try:
            async with (
                grpc.aio.insecure_channel(slow.address) as on_redis,
                grpc.aio.insecure_channel(quick.address) as in_memory,
            ):
                broker, local = pb_grpc.BrokerStub(on_redis), pb_grpc.BrokerStub(in_memory)
                health = health_pb2_grpc.HealthStub(on_redis)
                await broker.RegisterRank(register_request(layout, "P", pb.ROLE_PREFILL, 0))
                watch = health.Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == SERVING
                stop = asyncio.Event()
                ticker = asyncio.create_task(longest_loop_gap(stop, 0.002))
                await asyncio.sleep(0.05)
                pauser = redis.Redis.from_url(redis_server.url)
                pauser.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
                paused_at = time.monotonic()
                waiting = asyncio.ensure_future(broker.ListEngines(pb.ListEnginesRequest()))
                await asyncio.sleep(0.02)  # the store call is waiting for Redis

                started = time.monotonic()
                await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                timings["health check"] = time.monotonic() - started
                started = time.monotonic()
                await local.RegisterRank(
                    register_request(layout, "Q", pb.ROLE_PREFILL, 0), timeout=1.0
                )
                timings["in-memory RegisterRank"] = time.monotonic() - started
                assert not waiting.done()

                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await waiting
                timings["store call failed after"] = time.monotonic() - paused_at
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value
                assert refused.value.details().startswith("store: "), refused.value.details()
                assert (await watch.read()).status == NOT_SERVING  # the reaper's call failed too
                timings["NOT_SERVING streamed after"] = time.monotonic() - paused_at
                assert time.monotonic() - paused_at < PAUSE_MS / 1000, "Redis was not paused"

                assert (await watch.read()).status == SERVING  # Redis answers again
                timings["SERVING again after"] = time.monotonic() - paused_at
                stop.set()
                timings["longest loop stall"] = await ticker
                engines = await broker.ListEngines(pb.ListEnginesRequest(), timeout=5.0)
                assert [e.engine_id for e in engines.engines] == ["P"]
                watch.cancel()
        finally:
            await slow.stop(None)
            await quick.stop(None)
        return timings

    timings = asyncio.run(scenario())
    print("\n" + ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in timings.items()))
    assert timings["health check"] < 0.1, timings
    assert timings["in-memory RegisterRank"] < 0.2, timings
    # One deadline for the call, perhaps after another of the reaper's call ahead of it.
    assert timings["store call failed after"] < 3 * TIMEOUT_MS / 1000, timings
    assert timings["longest loop stall"] < 0.1, timings
    assert timings["SERVING again after"] >= PAUSE_MS / 1000 - 0.05, timings


def test_a_call_of_many_round_trips_fails_at_its_deadline(redis_server: RedisServer) -> None:
    """Six round trips of 150 ms each under a 300 ms deadline: UNAVAILABLE after about 300
    ms (each reply waiting for what is left of the call's deadline), not after 900 ms."""
    proxy = SlowProxy(redis_server.port, 0.15)
    url = f"redis://127.0.0.1:{proxy.port}/0"
    store = RedisStateStore.from_url(url, "slow:", timeout_ms=TIMEOUT_MS)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as refused:
            store.transact(lambda: [store.get_rank((f"E{i}", 0)) for i in range(3)])
        failed_after = time.monotonic() - started
    finally:
        proxy.close()
    assert refused.value.field == "store" and "Timeout" in str(refused.value), refused.value
    print(f"\nslow replies: UNAVAILABLE after {failed_after * 1e3:.0f} ms")
    assert TIMEOUT_MS / 1000 <= failed_after < 2 * TIMEOUT_MS / 1000, failed_after
