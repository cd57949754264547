"""State-store outages and hung replicas, with real processes: ``pdbroker serve --store
redis://`` replicas on a real ``redis-server`` that is stopped, stalled (``SIGSTOP``) and
brought back; a replica stalled the same way; an in-memory broker restarted under a prefill
engine (NIXL agents, real registrations) that publishes before its ranks registered again.

Every stall lasts a few seconds and is ended (``SIGCONT``) in a ``finally`` block, before the
processes are stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest
from prerequisites import require_module

redis = require_module("redis", "dev")

from broker_helpers import hybrid, register_request
from conftest import RedisServer, free_port, start_redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from clients.protocol import FailoverStub
from harness.brokers import BrokerProcess
from harness.scenarios import build_scenario

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PASSWORD = "not-for-logs-7f3a"
#: How long Redis or a replica stays stopped.
STALL_S = 4.0


def _health(address: str, timeout_s: float = 1.0) -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            .status
        )


def _wait_for(address: str, expected: int, within_s: float) -> float:
    """Seconds until health reports ``expected``; each check has a 1 s deadline."""
    started = time.monotonic()
    while True:
        try:
            if _health(address) == expected:
                return time.monotonic() - started
        except grpc.RpcError as exc:  # only while the store's first call waits for its deadline
            assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc
        assert time.monotonic() - started < within_s, f"health not {expected} in {within_s} s"
        time.sleep(0.05)


def _list_engines(address: str, timeout_s: float = 5.0) -> pb.ListEnginesResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.BrokerStub(channel).ListEngines(pb.ListEnginesRequest(), timeout=timeout_s)


def _protect(server: RedisServer) -> None:
    redis.Redis(port=server.port).config_set("requirepass", PASSWORD)


def _resume(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)


@pytest.fixture
def protected_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private ``redis-server`` that requires :data:`PASSWORD`, resumed and stopped at the
    end whatever the test did to it (tests may replace ``.process`` after a restart)."""
    server = start_redis(tmp_path_factory.mktemp("redis-outage"))
    _protect(server)
    try:
        yield server
    finally:
        _resume(server.process)
        server.stop()


def _store_url(server: RedisServer) -> str:
    return f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"


def test_redis_down_answers_unavailable_naming_the_store_and_health_follows(
    protected_redis: RedisServer,
) -> None:
    server = protected_redis
    broker = BrokerProcess("--store", _store_url(server))
    try:
        assert _health(broker.address) == SERVING
        assert _list_engines(broker.address).engines == []
        server.stop()
        with pytest.raises(grpc.RpcError) as refused:
            _list_engines(broker.address)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value
        details = refused.value.details()
        assert details.startswith("store: ") and f"127.0.0.1:{server.port}" in details, details
        assert PASSWORD not in details
        down = _wait_for(broker.address, NOT_SERVING, within_s=2.0)
        restarted = start_redis(server.directory, server.port)
        server.process = restarted.process
        _protect(server)
        up = _wait_for(broker.address, SERVING, within_s=3.0)
        assert _list_engines(broker.address).engines == []
        print(
            f"\nRedis stopped: UNAVAILABLE ({details!r}), NOT_SERVING after {down * 1e3:.0f} ms; "
            f"SERVING {up * 1e3:.0f} ms after it returned"
        )
    finally:
        broker.stop()


def test_a_stalled_redis_keeps_the_replica_answering_and_it_recovers(
    protected_redis: RedisServer,
) -> None:
    """While Redis is stopped, health calls with a 1 s deadline keep being answered and
    Broker calls fail fast with UNAVAILABLE: the event loop waits for Redis once, for at most
    the store timeout, not for the length of the stall."""
    server = protected_redis
    broker = BrokerProcess("--store", _store_url(server))
    try:
        assert _health(broker.address) == SERVING
        os.kill(server.process.pid, signal.SIGSTOP)
        stalled_at = time.monotonic()
        try:
            detected = _wait_for(broker.address, NOT_SERVING, within_s=2.5)
            answers, slowest = 0, 0.0
            while time.monotonic() - stalled_at < STALL_S:
                started = time.monotonic()
                assert _health(broker.address) == NOT_SERVING
                with pytest.raises(grpc.RpcError) as refused:
                    _list_engines(broker.address, timeout_s=1.0)
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value
                assert "store: " in refused.value.details()
                slowest = max(slowest, time.monotonic() - started)
                answers += 1
                time.sleep(0.1)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert answers >= 5
        up = _wait_for(broker.address, SERVING, within_s=3.0)
        assert _list_engines(broker.address).engines == []
        print(
            f"\nRedis stalled: NOT_SERVING after {detected * 1e3:.0f} ms, then {answers} health "
            f"+ UNAVAILABLE pairs within the stall (slowest {slowest * 1e3:.0f} ms); SERVING "
            f"{up * 1e3:.0f} ms after SIGCONT"
        )
    finally:
        broker.stop()


def test_a_stopped_replica_is_left_for_the_other_on_deadline(redis_server: RedisServer) -> None:
    """Replica A hangs (SIGSTOP): idempotent calls of a client that knows both replicas get
    DEADLINE_EXCEEDED from A within their share of the timeout and are answered by B."""
    url = redis_server.url.rsplit("/", 1)[0] + "/6"
    redis.Redis.from_url(url).flushdb()
    a = BrokerProcess("--store", url, "--lease-ttl-ms", "30000")
    b = BrokerProcess("--store", url, "--lease-ttl-ms", "30000")
    sc = build_scenario(hybrid(), 1, 1, 100)

    async def scenario() -> tuple[float, float]:
        stub = FailoverStub([a.address, b.address])
        try:
            lease = await stub.RegisterRank(
                register_request(sc.prefill, "P", pb.ROLE_PREFILL, 0, 0), timeout=5
            )
            assert stub.address == a.address
            os.kill(a.process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                renewed = await stub.KeepAlive(
                    pb.KeepAliveRequest(lease_id=lease.lease_id), timeout=4
                )
                moved = time.monotonic() - started
                assert renewed.ttl_ms == 30000
                assert stub.address == b.address and stub.failovers == 1
                started = time.monotonic()
                listing = await stub.ListEngines(pb.ListEnginesRequest(), timeout=4)
                direct = time.monotonic() - started
                assert [e.engine_id for e in listing.engines] == ["P"]
            finally:
                os.kill(a.process.pid, signal.SIGCONT)
            return moved, direct
        finally:
            await stub.close()

    try:
        moved, direct = asyncio.run(scenario())
    finally:
        _resume(a.process)
        a.stop()
        b.stop()
    assert 1.5 < moved < 3.5  # A's share of the 4 s, then B
    assert direct < 1.0  # later calls go straight to B
    print(
        f"\nKeepAlive answered by B {moved * 1e3:.0f} ms after A was stopped; "
        f"the next call {direct * 1e3:.0f} ms"
    )


def test_a_publish_racing_reregistration_after_a_restart_succeeds() -> None:
    """An in-memory broker restarts on the same port; the prefill engine publishes before its
    keep-alives noticed (lease TTL 30 s). The broker answers NOT_FOUND for the engine, the
    client registers its ranks again and publishes once more: the transfer is the new broker's
    and it is released once per rank, by the broker, not freed locally as lost."""
    np = require_module("numpy", "engine")
    require_module("nixl", "engine")
    from clients.prefill import AsyncPrefillClient, Release

    sc = build_scenario(hybrid(), 2, 1, 100)
    prefill = sc.prefill
    p_mem = {
        r.tp_rank: [np.zeros(r.region_bytes, np.uint8) for _ in range(r.num_regions)]
        for r in prefill.ranks
    }
    blocks = [list(ids) for ids in sc.request.prefill_block_ids]
    releases: list[Release] = []
    port = free_port()
    flags = ("--listen", f"127.0.0.1:{port}", "--lease-ttl-ms", "30000")
    broker = BrokerProcess(*flags)

    async def scenario() -> tuple[tuple[str, ...], tuple[str, ...]]:
        nonlocal broker
        async with AsyncPrefillClient(
            broker.address, "p", prefill, p_mem, on_release=releases.append
        ) as p:
            before = tuple(s.lease_id for s in p.sessions.values())
            broker.process.kill()
            broker.process.wait()
            broker = BrokerProcess(*flags)  # same address, nothing registered
            await p.publish("after-restart", blocks, sc.request.num_tokens)
            after = tuple(s.lease_id for s in p.sessions.values())
            with grpc.insecure_channel(broker.address) as channel:
                stub = pb_grpc.BrokerStub(channel)
                info = stub.GetTransfer(
                    pb.GetTransferRequest(transfer_id="after-restart"), timeout=5
                )
                assert info.prefill_engine_id == "p"
                stub.AbortTransfer(
                    pb.AbortTransferRequest(transfer_id="after-restart", reason="test"), timeout=5
                )
            deadline = time.monotonic() + 10
            while len(releases) < 2:
                assert time.monotonic() < deadline, releases
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # a second release of a rank would arrive by now
            return before, after

    try:
        before, after = asyncio.run(scenario())
    finally:
        broker.stop()
    assert all(b != a for b, a in zip(before, after))  # every rank registered again
    assert sorted((r.transfer_id, r.tp_rank, r.reason.value) for r in releases) == [
        ("after-restart", 0, "aborted"),
        ("after-restart", 1, "aborted"),
    ]
    assert all(r.sequence > 0 for r in releases), releases  # from the broker, not local
