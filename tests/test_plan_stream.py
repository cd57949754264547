"""Plans too large for one answer: GetTransferPlan refuses them before handing them out,
StreamTransferPlan sends them in messages a client joins back into the same answer, and the
decode client falls back to the stream by itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from broker_helpers import hybrid, publish_many_blocks

from broker import convert
from broker.api import PlanResult, SourceDescriptors
from broker.limits import LIMITS
from broker.models import build_engine_layout
from broker.planner import PairPlanner, TransferRequest
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import DESCRIPTOR_BYTES, MemoryKind, join_plan_chunks
from clients.decode import AsyncDecodeClient
from clients.prefill import AsyncPrefillClient
from clients.transport import NoMemoryTransport, fake_memory
from harness.brokers import BrokerProcess

WAIT_S = 60.0
#: Fragmented block ids of one request whose plan (two regions, 48 bytes a descriptor on the
#: wire) passes the unary limit: 2 * BLOCKS descriptors.
BLOCKS = LIMITS.max_unary_plan_bytes // (2 * 2 * DESCRIPTOR_BYTES) + 1000


def test_chunks_join_into_the_one_answer() -> None:
    rng = np.random.default_rng(7)
    sources = tuple(
        SourceDescriptors(
            rank,
            f"agent{rank}",
            b"metadata" * rank,
            rng.integers(0, 1 << 40, (n, 3)),
            rng.integers(0, 1 << 40, (n, 3)),
            10 * n,
            b"note",
            MemoryKind.VRAM,
            MemoryKind.DRAM,
        )
        for rank, n in ((0, 1000), (3, 2500), (200, 1), (5, 0))
    )
    plan = PlanResult("plan-1", sources, 5, 6, 7, "00-trace")
    chunk_bytes = 2 * DESCRIPTOR_BYTES * 300
    chunks = list(convert.plan_chunks(plan, chunk_bytes))
    assert len(chunks) == 1 + 3 + 8  # the first, then 1000 and 2500 rows after their first 300
    assert all(len(c) <= chunk_bytes + 64 for c in chunks[1:])
    joined = join_plan_chunks(pb.GetTransferPlanResponse.FromString(c) for c in chunks)
    assert joined == convert.plan_to_proto(plan)
    with pytest.raises(ValueError, match="prefill rank 9"):
        join_plan_chunks(
            [
                convert.plan_to_proto(plan),
                pb.GetTransferPlanResponse(sources=[pb.SourcePlan(prefill_rank=9)]),
            ]
        )


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    process = BrokerProcess("--lease-ttl-ms", "600000")
    try:
        yield process
    finally:
        process.stop()


def test_a_plan_too_large_for_one_answer_is_refused_unhanded_then_streamed(
    broker: BrokerProcess,
) -> None:
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(broker.address, options) as channel:
        stub = pb_grpc.BrokerStub(channel)
        ask = publish_many_blocks(stub, "big", ("SP", "SD"), BLOCKS, 40, WAIT_S)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetTransferPlan(ask, timeout=WAIT_S)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("plan: ")
        assert "StreamTransferPlan" in refused.value.details()
        info = stub.GetTransfer(pb.GetTransferRequest(transfer_id="big"), timeout=WAIT_S)
        assert not any(p.handed_out for p in info.plans)  # claimed, nothing handed out

        chunks = list(stub.StreamTransferPlan(ask, timeout=WAIT_S))
        plan = join_plan_chunks(chunks)
        (source,) = plan.sources
        assert len(chunks) > 1 and source.num_descriptors == plan.num_descriptors > BLOCKS
        rows = np.frombuffer(source.local_descriptors, dtype="<i8").reshape(-1, 3)
        assert len(rows) == source.num_descriptors
        assert int(rows[:, 1].sum()) == source.total_bytes == plan.total_bytes
        assert source.remote_agent_metadata  # first contact
        again = join_plan_chunks(stub.StreamTransferPlan(ask, timeout=WAIT_S))
        assert again.plan_id == plan.plan_id and not again.sources[0].remote_agent_metadata
        assert again.sources[0].local_descriptors == source.local_descriptors


def test_the_decode_client_reads_a_plan_too_large_for_one_answer(broker: BrokerProcess) -> None:
    """Over the no-memory transport: the client's unary ask is refused, it streams the plan,
    checks and reads every descriptor, and reports; the prefill engine is released."""
    layout = build_engine_layout(hybrid(mamba=None), 1, BLOCKS, 16)
    order = list(range(BLOCKS))
    released: list[str] = []

    async def scenario() -> int:
        transport = NoMemoryTransport()
        async with (
            AsyncPrefillClient(
                broker.address,
                "CP",
                layout,
                fake_memory(layout, 1 << 44),
                transport=transport,
                on_release=lambda release: released.append(release.transfer_id),
            ) as prefill,
            AsyncDecodeClient(
                broker.address, "CD", layout, fake_memory(layout, 1 << 45), transport=transport
            ) as decode,
        ):
            await prefill.publish("streamed", [order[1::2] + order[::2]], 16 * BLOCKS)
            fetch = await decode.fetch("streamed", [order], WAIT_S, prefill_engine_id="CP")
            for _ in range(200):
                if released:
                    break
                await asyncio.sleep(0.05)
            return fetch.nbytes

    nbytes = asyncio.run(scenario())
    request = TransferRequest.of(16 * BLOCKS, [order[1::2] + order[::2]], [order])
    assert nbytes == PairPlanner(layout, layout).plan(request).nbytes > 0
    assert released == ["streamed"]
