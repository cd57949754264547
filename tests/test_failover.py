"""Two broker replicas on one real Redis: killing the one every engine talks to, in the middle
of a run, loses no registration, publication or release (issue: multi-node failover).

Real processes throughout: two ``pdbroker serve --store redis://`` replicas, a prefill and a
decode engine with NIXL agents moving and verifying real bytes, and SIGKILL for replica A.
The engines are given both addresses and start on A.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from prerequisites import require_module

require_module("nixl", "engine")
redis = require_module("redis", "dev")

from conftest import RedisServer
from test_e2e import MAMBA2, hybrid

from harness.brokers import BrokerProcess, RunningBrokers
from harness.fleet import FleetReport, PairSpec, run_fleet

REQUESTS = 40
KILL_AFTER = 10  # requests fully released before replica A dies


def _completed(report: FleetReport) -> int:
    tp = report.pairs[0].prefill_tp
    return sum(r.fetched and len(r.releases) == tp for r in report.requests)


def test_killing_the_active_replica_mid_load_loses_nothing(redis_server: RedisServer) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # a database of its own
    redis.Redis.from_url(url).flushdb()
    a = BrokerProcess("--store", url, "--lease-ttl-ms", "3000")
    b = BrokerProcess("--store", url, "--lease-ttl-ms", "3000")
    progress: list[tuple[float, int]] = []
    killed_at: list[float] = []

    def on_progress(report: FleetReport) -> None:
        done = _completed(report)
        progress.append((time.monotonic(), done))
        if done >= KILL_AFTER and not killed_at:
            killed_at.append(time.monotonic())
            a.process.kill()  # SIGKILL: no goodbye, in-flight calls are cut

    try:
        pair = PairSpec("FA+Mamba2 P2->D2", hybrid("m2", MAMBA2, 4), 2, 2, 40, 300)
        report = run_fleet(
            [pair],
            REQUESTS,
            inflight=4,
            on_progress=on_progress,
            broker=RunningBrokers([a.address, b.address]),
        )
    finally:
        a.stop()
        b.stop()
    assert killed_at, "replica A was never killed: the run ended too early"
    assert report.ok, report.problems()
    assert _completed(report) == REQUESTS
    assert a.process.returncode == -9
    # Nothing left behind in the shared store: every transfer finished, every rank left.
    store = redis.Redis.from_url(url)
    assert not [k for k in store.scan_iter("pdbroker:rank:*")]
    # Failover time: from the kill to the next request completed through replica B.
    after = [t for t, done in progress if t > killed_at[0] and done > KILL_AFTER]
    gap = after[0] - killed_at[0]
    print(
        f"\nfailover: first completion through replica B {gap * 1e3:.0f} ms after SIGKILL of A; "
        f"{REQUESTS} transfers, {report.mismatches} mismatches, 0 lost"
    )
    assert gap < 10.0


def test_a_replica_that_loses_redis_reports_not_serving_until_it_is_back(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Readiness follows the store: load balancers and Kubernetes stop sending engines to a
    replica whose Redis is gone, and take it back once Redis returns (same port, same data)."""
    from conftest import start_redis
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    directory = tmp_path_factory.mktemp("redis-down")
    server = start_redis(directory)
    broker = BrokerProcess("--store", server.url)

    def status() -> int:
        with grpc.insecure_channel(broker.address) as channel:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=5)
                .status
            )

    def wait_for(expected: int) -> float:
        started = time.monotonic()
        while status() != expected:
            assert time.monotonic() - started < 30, f"health never became {expected}"
            time.sleep(0.05)
        return time.monotonic() - started

    try:
        assert status() == health_pb2.HealthCheckResponse.SERVING
        server.stop()
        down = wait_for(health_pb2.HealthCheckResponse.NOT_SERVING)
        server = start_redis(directory, server.port)
        up = wait_for(health_pb2.HealthCheckResponse.SERVING)
        print(
            f"\nNOT_SERVING {down * 1e3:.0f} ms after Redis stopped; SERVING {up * 1e3:.0f} ms "
            "after it returned"
        )
    finally:
        broker.stop()
        server.stop()


def test_a_stopped_replica_is_left_for_the_other_mid_load(redis_server: RedisServer) -> None:
    """Replica A hangs (SIGSTOP) rather than dies: its connections stay open and nothing
    answers. Engines' calls to it run out of their share of the timeout (DEADLINE_EXCEEDED),
    move on to replica B, and the release streams reopen there; every transfer completes."""
    url = redis_server.url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(url).flushdb()
    # Leases outlive the 5 s an engine call waits for A (half its 10 s timeout).
    a = BrokerProcess("--store", url, "--lease-ttl-ms", "15000")
    b = BrokerProcess("--store", url, "--lease-ttl-ms", "15000")
    progress: list[tuple[float, int]] = []
    stopped_at: list[float] = []

    def on_progress(report: FleetReport) -> None:
        done = _completed(report)
        progress.append((time.monotonic(), done))
        if done >= KILL_AFTER and not stopped_at:
            stopped_at.append(time.monotonic())
            a.process.send_signal(signal.SIGSTOP)

    try:
        pair = PairSpec("FA+Mamba2 P2->D2", hybrid("m2", MAMBA2, 4), 2, 2, 40, 300)
        report = run_fleet(
            [pair],
            REQUESTS // 2,
            inflight=4,
            on_progress=on_progress,
            broker=RunningBrokers([a.address, b.address]),
        )
    finally:
        if a.process.poll() is None:
            a.process.send_signal(signal.SIGCONT)
        a.stop()
        b.stop()
    assert stopped_at, "replica A was never stopped: the run ended too early"
    assert report.ok, report.problems()
    assert _completed(report) == REQUESTS // 2
    after = [t for t, done in progress if t > stopped_at[0] and done > KILL_AFTER]
    gap = after[0] - stopped_at[0]
    print(
        f"\nfailover: first completion through replica B {gap * 1e3:.0f} ms after SIGSTOP of A; "
        f"{REQUESTS // 2} transfers, {report.mismatches} mismatches, 0 lost"
    )
    assert gap < 15.0
