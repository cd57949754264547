"""``pdbroker serve --workers 2`` on a real Redis: both worker processes serve the one port
(and the health port), a release committed through one worker reaches the prefill rank
watching on the other, and the clients of a worker killed mid-run move on without losing or
repeating a transfer or a release while the supervisor starts the worker again. A start-up
failure of any worker is one line, as for one process.

Real processes throughout; the engines are the client library over
:class:`~clients.transport.NoMemoryTransport` (no bytes move), each client on a connection
of its own. Which worker serves a connection is read from the workers' own metrics: the one
whose ``ListEngines`` count rises when the connection calls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from broker_helpers import hybrid
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prerequisites import require_module
from prometheus_client.parser import text_string_to_metric_families

redis = require_module("redis", "dev")

from conftest import RedisServer

from broker.commands.serve_workers import MAX_RESTARTS
from broker.v1 import broker_pb2 as pb
from broker.wire import ReleaseReason
from clients.decode import AsyncDecodeClient
from clients.prefill import AsyncPrefillClient, Release
from clients.protocol import call
from clients.session import AsyncEngineClient
from clients.transport import NoMemoryTransport, fake_memory
from harness.brokers import OWN_CONNECTIONS, BrokerProcess, serve_command
from harness.scenarios import build_scenario

SC = build_scenario(hybrid(), 2, 2, 100)
#: Each engine's fake memory starts this far below the previous one's.
ENGINE_SPAN = 1 << 40
FIRST_ADDR = 0x7F00_0000_0000
#: Connections tried before concluding that they all reach one worker.
MAX_TRIES = 24
PAIRS = 4  # prefill/decode pairs moving transfers at once
TRANSFERS = 25  # per pair
KILL_AFTER = 30  # transfers fetched (of all pairs) before a worker dies


def start_workers(redis_server: RedisServer, db: int) -> BrokerProcess:
    url = redis_server.url.rsplit("/", 1)[0] + f"/{db}"  # a database of its own
    redis.Redis.from_url(url).flushdb()
    return BrokerProcess(
        *("--workers", "2", "--store", url, "--lease-ttl-ms", "5000"),
        *("--metrics-port", "0", "--health-port", "0"),
    )


@pytest.fixture
def release_broker(redis_server: RedisServer) -> Iterator[BrokerProcess]:
    broker = start_workers(redis_server, 8)
    yield broker
    broker.stop()


@pytest.fixture
def kill_broker(redis_server: RedisServer) -> Iterator[BrokerProcess]:
    broker = start_workers(redis_server, 9)
    yield broker
    broker.stop()


def workers_of(broker: BrokerProcess) -> dict[int, str]:
    """The workers the broker announced: their metrics URLs by pid."""
    found = [
        re.search(r"worker \d \(pid (\d+)\): metrics on (\S+)", line) for line in broker.announced
    ]
    return {int(m[1]): m[2] for m in found if m}


def children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def list_engines_served(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as page:
        text = page.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "grpc_server_handled_total"
        and sample.labels.get("grpc_method") == "ListEngines"
    )


async def worker_of(client: AsyncEngineClient, workers: dict[int, str]) -> int:
    """The pid of the worker serving ``client``'s connection."""
    before = {pid: list_engines_served(url) for pid, url in workers.items()}
    await call(client.stub, "ListEngines", pb.ListEnginesRequest(), 10)
    rose = [pid for pid, url in workers.items() if list_engines_served(url) > before[pid]]
    assert len(rose) == 1, rose
    return rose[0]


def prefill_client(
    broker: BrokerProcess, k: int, on_release: Callable[[Release], None]
) -> AsyncPrefillClient:
    return AsyncPrefillClient(
        broker.address,
        f"P{k}",
        SC.prefill,
        fake_memory(SC.prefill, FIRST_ADDR - 2 * k * ENGINE_SPAN),
        on_release=on_release,
        security=OWN_CONNECTIONS,
        transport=NoMemoryTransport(),
    )


def decode_client(broker: BrokerProcess, k: int) -> AsyncDecodeClient:
    return AsyncDecodeClient(
        broker.address,
        f"D{k}",
        SC.decode,
        fake_memory(SC.decode, FIRST_ADDR - (2 * k + 1) * ENGINE_SPAN),
        security=OWN_CONNECTIONS,
        transport=NoMemoryTransport(),
    )


def test_a_release_committed_on_one_worker_reaches_a_watcher_on_the_other(
    release_broker: BrokerProcess,
) -> None:
    """P registers and watches its releases through worker A; D plans and reports DONE
    through worker B (a new connection until one reaches B): P is released at once."""
    workers = workers_of(release_broker)
    assert len(workers) == 2 and set(workers) == children(release_broker.process.pid)
    health = next(
        line.rsplit(" ", 1)[1] for line in release_broker.announced if "health on" in line
    )
    with grpc.insecure_channel(health) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    released: asyncio.Queue[Release] = asyncio.Queue()

    async def run() -> tuple[int, int, list[Release]]:
        prefill = prefill_client(release_broker, 0, released.put_nowait)
        await prefill.start()
        try:
            watched_on = await worker_of(prefill, workers)
            for _ in range(MAX_TRIES):
                decode = decode_client(release_broker, 0)
                await decode.start()
                reported_on = await worker_of(decode, workers)
                if reported_on != watched_on:
                    break
                await decode.close()
            try:
                await prefill.publish("t1", SC.request.prefill_block_ids, SC.request.num_tokens)
                await decode.fetch("t1", SC.request.decode_block_ids)
                got = [await asyncio.wait_for(released.get(), 5) for _ in SC.prefill.ranks]
            finally:
                await decode.close()
        finally:
            await prefill.close()
        return watched_on, reported_on, got

    watched_on, reported_on, got = asyncio.run(run())
    assert watched_on != reported_on, f"{MAX_TRIES} connections all reached worker {watched_on}"
    assert sorted((r.transfer_id, r.tp_rank, r.reason) for r in got) == [
        ("t1", rank.tp_rank, ReleaseReason.COMPLETED) for rank in SC.prefill.ranks
    ]
    release_broker.process.terminate()
    assert release_broker.process.wait(10) == 0  # SIGTERM reached every worker
    assert not any(running(pid) for pid in workers)


def test_a_killed_workers_clients_move_on_without_loss(kill_broker: BrokerProcess) -> None:
    """PAIRS prefill/decode pairs move TRANSFERS transfers each; the worker serving most of
    their connections is SIGKILLed after KILL_AFTER: every transfer is fetched once and
    releases every prefill rank exactly once, and the supervisor starts a worker again."""
    workers = workers_of(kill_broker)
    releases: Counter[tuple[str, str, int, ReleaseReason]] = Counter()
    fetched: list[tuple[str, str]] = []
    killed: list[int] = []

    async def pair(prefill: AsyncPrefillClient, decode: AsyncDecodeClient) -> None:
        for i in range(TRANSFERS):
            transfer_id = f"t{i}"
            await prefill.publish(transfer_id, SC.request.prefill_block_ids, SC.request.num_tokens)
            await decode.fetch(
                transfer_id, SC.request.decode_block_ids, prefill_engine_id=prefill.engine_id
            )
            fetched.append((prefill.engine_id, transfer_id))
            if len(fetched) >= KILL_AFTER and not killed:
                killed.append(busiest)
                os.kill(busiest, signal.SIGKILL)

    async def run() -> tuple[list[AsyncEngineClient], int]:
        nonlocal busiest
        clients: list[AsyncEngineClient] = []
        for k in range(PAIRS):

            def on_release(r: Release, engine: str = f"P{k}") -> None:
                releases[engine, r.transfer_id, r.tp_rank, r.reason] += 1

            clients += [prefill_client(kill_broker, k, on_release), decode_client(kill_broker, k)]
        await asyncio.gather(*(c.start() for c in clients))
        try:
            served = Counter([await worker_of(c, workers) for c in clients])
            busiest = served.most_common(1)[0][0]
            await asyncio.gather(*(pair(clients[2 * k], clients[2 * k + 1]) for k in range(PAIRS)))
            deadline = time.monotonic() + 10
            while sum(releases.values()) < PAIRS * TRANSFERS * SC.prefill.tp_size:
                assert time.monotonic() < deadline, "releases missing"
                await asyncio.sleep(0.05)
        finally:
            failovers = sum(c.stub.failovers for c in clients)
            await asyncio.gather(*(c.close() for c in clients))
        return clients, failovers

    busiest = 0
    clients, failovers = asyncio.run(run())
    assert killed, "the run ended before a worker was killed"
    assert failovers > 0  # some clients were cut off
    assert sorted(fetched) == sorted(
        (f"P{k}", f"t{i}") for k in range(PAIRS) for i in range(TRANSFERS)
    )
    assert releases == Counter(
        {
            (f"P{k}", f"t{i}", rank.tp_rank, ReleaseReason.COMPLETED): 1
            for k in range(PAIRS)
            for i in range(TRANSFERS)
            for rank in SC.prefill.ranks
        }
    )
    assert not any(isinstance(c, AsyncPrefillClient) and c.repeated_releases for c in clients)
    now = children(kill_broker.process.pid)
    assert len(now) == 2 and killed[0] not in now  # started again
    # Workers follow their supervisor when it dies without a word.
    kill_broker.process.kill()
    kill_broker.process.wait(10)
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in now):
        assert time.monotonic() < deadline, "workers outlived their supervisor"
        time.sleep(0.05)


def test_a_worker_that_keeps_dying_stops_the_broker(redis_server: RedisServer) -> None:
    """Every worker started in one slot is killed at once: after MAX_RESTARTS the supervisor
    stops the other worker and exits 1, for its own supervisor to see."""
    broker = start_workers(redis_server, 10)
    try:
        pid = broker.process.pid
        survivor = min(children(pid))
        killed: set[int] = set()
        deadline = time.monotonic() + 20
        while broker.process.poll() is None:
            assert time.monotonic() < deadline, "the supervisor never gave up"
            with contextlib.suppress(FileNotFoundError):  # it just exited
                for child in children(pid) - {survivor} - killed:
                    os.kill(child, signal.SIGKILL)
                    killed.add(child)
            time.sleep(0.02)
    finally:
        broker.stop()
    assert broker.process.returncode == 1
    assert len(killed) == MAX_RESTARTS + 1
    assert not running(survivor)


def serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        serve_command(*flags),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess, flag: str) -> str:
    """Asserts exit status 2, nothing on stdout and one stderr line naming ``flag``."""
    assert (done.returncode, done.stdout) == (2, ""), (done.returncode, done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"pdbroker serve: error: {flag}: "), done.stderr
    return done.stderr.strip()


def test_workers_need_the_redis_store() -> None:
    line = one_line_error(serve("--workers", "2", "--store", "memory"), "--workers")
    assert line.endswith(
        "2 workers need a shared store (--store redis://...); the in-memory store serves one process"
    )


def test_one_worker_failing_to_bind_fails_the_start_in_one_line(redis_server: RedisServer) -> None:
    """Worker 2's metrics port is taken: worker 1 has bound everything, yet nothing is
    announced and the error is the one line naming the flag."""
    with socket.socket() as first, socket.socket() as taken:
        first.bind(("127.0.0.1", 0))
        port = first.getsockname()[1]
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        first.close()  # free for worker 1
        url = redis_server.url.rsplit("/", 1)[0] + "/11"  # a database of its own
        done = serve("--workers", "2", "--store", url, "--metrics-port", str(port))
    line = one_line_error(done, "--metrics-port")
    assert line.endswith(f"cannot listen on 127.0.0.1:{port + 1}: Address already in use")
