"""``pdbroker serve --store redis+sentinel://...`` against a real Redis Sentinel
(``redis-server --sentinel``) watching a real primary and its replica: the broker finds the
primary through the sentinel, keeps serving after the primary is killed and the sentinel
promotes the replica (what it wrote is there), and start-up refuses a malformed URL naming
``--store``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from prerequisites import require_binary, require_module

redis = require_module("redis", "dev")

from broker_helpers import hybrid, register_request

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.brokers import BrokerProcess
from harness.redis_server import RedisServer, start_redis, start_sentinel
from harness.scenarios import build_scenario

PRIMARY = "pdbroker"


@dataclass
class Watched:
    primary: RedisServer
    replica: RedisServer
    sentinel: RedisServer

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{PRIMARY}/0"

    def primary_port(self) -> int:
        client = redis.Redis(port=self.sentinel.port)
        return int(client.sentinel_get_master_addr_by_name(PRIMARY)[1])


@pytest.fixture
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    """A primary, its replica and one sentinel that knows both."""
    binary = require_binary("redis-server", "bash scripts/test.sh installs it with apt-get")
    primary = start_redis(tmp_path_factory.mktemp("primary"), binary=binary)
    servers = [primary]
    try:
        replica_of = ("--replicaof", "127.0.0.1", str(primary.port))
        servers.append(start_redis(tmp_path_factory.mktemp("replica"), None, binary, *replica_of))
        servers.append(start_sentinel(tmp_path_factory.mktemp("sentinel"), primary, PRIMARY))
        w = Watched(*servers)
        sentinel = redis.Redis(port=w.sentinel.port)
        deadline = time.monotonic() + 15
        while not sentinel.sentinel_slaves(PRIMARY):  # it learns of the replica from INFO
            assert time.monotonic() < deadline, "the sentinel never saw the replica"
            time.sleep(0.1)
        yield w
    finally:
        for server in servers:
            server.stop()


def _engines(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        answer = pb_grpc.BrokerStub(channel).ListEngines(pb.ListEnginesRequest(), timeout=5)
    return [e.engine_id for e in answer.engines]


def test_the_broker_follows_the_primary_sentinel_names(watched: Watched) -> None:
    broker = BrokerProcess("--store", watched.url, "--store-timeout-ms", "500")
    try:
        layout = build_scenario(hybrid(), 1, 1, 100).prefill
        with grpc.insecure_channel(broker.address) as channel:
            pb_grpc.BrokerStub(channel).RegisterRank(
                register_request(layout, "P", pb.ROLE_PREFILL, 0), timeout=5
            )
        primary = redis.Redis(port=watched.primary.port)
        assert primary.keys("pdbroker:rank:*") == [b"pdbroker:rank:0:P"]
        assert primary.wait(1, 5_000) == 1  # the replica has it too
        watched.primary.stop()
        killed = time.monotonic()
        deadline = killed + 20
        while True:
            try:
                engines = _engines(broker.address)
                break
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
                assert time.monotonic() < deadline, "the broker never reached the new primary"
                time.sleep(0.2)
        moved = time.monotonic() - killed
        assert engines == ["P"]
        assert watched.primary_port() == watched.replica.port
        print(f"\nprimary killed: served by the promoted replica {moved:.1f} s later")
    finally:
        broker.stop()


@pytest.mark.parametrize(
    "url,why",
    [
        ("redis+sentinel://127.0.0.1/pdbroker", "is not HOST:PORT"),
        ("redis+sentinel://127.0.0.1:26379", "expected redis+sentinel://"),
        ("redis+sentinel://127.0.0.1:26379/pdbroker/zero", "expected redis+sentinel://"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_naming_the_flag(url: str, why: str) -> None:
    refusal = _refusal(url)
    assert "--store" in refusal and why in refusal, refusal


def test_an_unreachable_sentinel_is_refused_naming_the_flag(watched: Watched) -> None:
    refusal = _refusal(f"redis+sentinel://127.0.0.1:{watched.sentinel.port}/unknown")
    assert "--store" in refusal and "cannot reach" in refusal, refusal


def _refusal(url: str) -> str:
    """What ``pdbroker serve --store URL`` says as it exits with an error."""
    serve = [sys.executable, "-m", "broker.cli", "serve", "--insecure", "--store", url]
    done = subprocess.run(serve, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout
    return done.stderr
