"""Release events are bounded in bytes, and none is lost silently: with real broker replicas
on a real Redis and a real prefill client (NIXL agents), events queued while the client could
not watch are dropped beyond the backlog budget; the client, refused when it resumes before
them, asks the broker about each transfer it awaits and frees every one exactly once."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc
import numpy as np
from broker_helpers import hybrid
from conftest import RedisServer
from prerequisites import require_module

require_module("nixl", "engine")
redis = require_module("redis", "dev")

from broker.models import build_engine_layout
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import ReleaseReason
from clients.prefill import AsyncPrefillClient, Release
from harness.brokers import BrokerProcess

TRANSFERS = 40
BACKLOG_BYTES = 2048  # about 15 of the events below
WAIT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_client_behind_a_dropped_backlog_frees_every_transfer_once(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/6"
    redis.Redis.from_url(url).flushdb()
    flags = (
        "--store",
        url,
        "--lease-ttl-ms",
        "60000",
        "--release-backlog-bytes",
        str(BACKLOG_BYTES),
    )
    port = _free_port()
    a = BrokerProcess("--listen", f"127.0.0.1:{port}", *flags)
    b = BrokerProcess(*flags)
    layout = build_engine_layout(hybrid(mamba=None), 1, TRANSFERS + 4, 16)
    memory = {
        0: [
            np.zeros(layout.ranks[0].region_bytes, np.uint8)
            for _ in range(layout.ranks[0].num_regions)
        ]
    }
    releases: list[Release] = []

    async def scenario() -> None:
        nonlocal a
        async with AsyncPrefillClient(
            a.address, "P", layout, memory, on_release=releases.append
        ) as client:
            for i in range(TRANSFERS):
                await client.publish(f"t{i:02}", [[i]], 16)
            a.process.kill()  # the client's replica dies: nobody watches P's rank now
            a.process.wait()
            with grpc.insecure_channel(b.address) as channel:
                stub = pb_grpc.BrokerStub(channel)
                for i in range(TRANSFERS):
                    stub.AbortTransfer(
                        pb.AbortTransferRequest(transfer_id=f"t{i:02}"), timeout=WAIT_S
                    )
            backlog = redis.Redis.from_url(url)
            kept = backlog.xlen("pdbroker:releases:0:P")
            assert 0 < kept < TRANSFERS  # the oldest events were dropped
            assert int(backlog.hget("pdbroker:backlog:0:P", "bytes")) <= BACKLOG_BYTES
            a = BrokerProcess("--listen", f"127.0.0.1:{port}", *flags)  # back, same address
            deadline = time.monotonic() + WAIT_S
            while len(releases) < TRANSFERS:
                assert time.monotonic() < deadline, f"{len(releases)} of {TRANSFERS} freed"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a release handed over twice would arrive by now

    try:
        asyncio.run(scenario())
    finally:
        a.stop()
        b.stop()
    assert sorted(r.transfer_id for r in releases) == [f"t{i:02}" for i in range(TRANSFERS)]
    assert {r.reason for r in releases} == {ReleaseReason.ABORTED}
    # The client asked the broker about every transfer rather than miss the dropped events;
    # the kept events that followed were recognised as freed already.
    assert all(r.detail.startswith("reconciled") for r in releases), [r.detail for r in releases]
    assert all(r.block_ids == ((int(r.transfer_id[1:]),),) for r in releases)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_aborted_transfers_nobody_watches_leave_memory_flat() -> None:
    """1,500 transfers of 20,000 block ids published and aborted while nobody watches the
    prefill rank: the broker keeps at most the backlog budget of their events and no block
    ids of the finished transfers, so its RSS levels off."""
    from broker_helpers import register_request

    ids = 20_000
    budget_mib = 16
    layout = build_engine_layout(hybrid(mamba=None), 1, ids, 16)
    broker = BrokerProcess(
        "--lease-ttl-ms", "600000", "--release-backlog-bytes", str(budget_mib << 20)
    )
    publish = pb.PublishBlocksRequest(
        engine_id="P", num_tokens=16 * ids, block_ids=[pb.BlockIds(ids=range(ids))]
    )
    samples = {}
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            stub.RegisterRank(register_request(layout, "P", pb.ROLE_PREFILL, 0), timeout=WAIT_S)
            for i in range(1_500):
                publish.transfer_id = f"t{i}"
                stub.PublishBlocks(publish, timeout=WAIT_S)
                stub.AbortTransfer(pb.AbortTransferRequest(transfer_id=f"t{i}"), timeout=WAIT_S)
                if i + 1 in (100, 750, 1_500):
                    samples[i + 1] = _rss_mib(broker.process.pid)
            finished = [
                stub.GetTransfer(pb.GetTransferRequest(transfer_id=t), timeout=WAIT_S)
                for t in ("t0", "t1499")
            ]
    finally:
        broker.stop()
    assert [(t.state, len(t.block_ids)) for t in finished] == [(pb.TRANSFER_STATE_ABORTED, 0)] * 2
    print(
        f"\nbroker RSS after 100 / 750 / 1,500 transfers: {samples[100]:.0f} / "
        f"{samples[750]:.0f} / {samples[1_500]:.0f} MiB"
    )
    assert samples[1_500] - samples[100] < budget_mib + 32
    assert samples[1_500] - samples[750] < 16
