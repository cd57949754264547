"""The clients' protocol module without a broker: the registration builder, and a publish
whose reply was lost with its replica (ALREADY_EXISTS after a failover) reconciled."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from broker_helpers import hybrid

from broker.layout import GroupKind, GroupLayout, RankLayout, Segment
from broker.models import build_engine_layout
from broker.v1 import broker_pb2 as pb
from broker.wire import Role, rank_layout_from_proto, rank_layout_to_proto
from clients import protocol
from clients.protocol import BrokerCallError
from clients.transport import DRAM, VRAM, Region


def test_registration_carries_what_the_rank_declares() -> None:
    layout = build_engine_layout(hybrid(), 2, 8, 64)
    rank = layout.ranks[1]
    regions = [Region((i + 1) << 32, rank.region_bytes, 1, VRAM) for i in range(rank.num_regions)]
    request = protocol.registration(
        rank,
        regions,
        engine_id="P",
        role=Role.PREFILL,
        tp_size=2,
        agent_name="P.rank1",
        agent_metadata=b"nixl",
        model_fingerprint=layout.model,
    )
    assert (request.engine_id, request.role, request.tp_size, request.tp_rank) == (
        "P",
        pb.ROLE_PREFILL,
        2,
        1,
    )
    assert (request.agent_name, request.agent_metadata) == ("P.rank1", b"nixl")
    assert [(r.base_addr, r.length_bytes, r.device_id, r.memory_kind) for r in request.regions] == [
        (r.base_addr, r.length_bytes, 1, pb.MEMORY_KIND_VRAM) for r in regions
    ]
    assert rank_layout_from_proto(request.layout, 1) == rank
    assert request.model_fingerprint == layout.model
    dram = protocol.registration(
        rank,
        [Region(4096, 64, 0, DRAM)],
        engine_id="D",
        role=Role.DECODE,
        tp_size=2,
        agent_name="D",
        agent_metadata=b"",
        model_fingerprint="",
    )
    assert (dram.role, dram.regions[0].memory_kind) == (pb.ROLE_DECODE, pb.MEMORY_KIND_DRAM)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Replicas:
    """Stands in for a FailoverStub whose first replica committed a publish and lost its
    reply: PublishBlocks moves on (``failovers`` grows) and finds the transfer there."""

    def __init__(self, stored: pb.GetTransferResponse, failover: bool) -> None:
        self.stored, self.failover, self.failovers = stored, failover, 0

    async def PublishBlocks(self, request: Any, **kwargs: Any) -> Any:
        if self.failover:
            self.failovers += 1
        raise _error(grpc.StatusCode.ALREADY_EXISTS, "transfer_id: already published")

    async def GetTransfer(self, request: pb.GetTransferRequest, **kwargs: Any) -> Any:
        """As the broker: ids are scoped by their publisher."""
        assert request.transfer_id == self.stored.transfer_id
        if request.prefill_engine_id != self.stored.prefill_engine_id:
            raise _error(grpc.StatusCode.NOT_FOUND, "transfer_id: no transfer 't1'")
        return self.stored


def _publish(replicas: _Replicas, engine_id: str = "P", num_tokens: int = 100) -> int:
    request = protocol.publication("t1", engine_id, [[1, 2], [3]], num_tokens, ttl_ms=500)
    return asyncio.run(protocol.publish(replicas, request, 1.0))  # type: ignore[arg-type]


def test_a_publish_found_on_the_next_replica_is_ours_when_engine_and_size_match() -> None:
    stored = pb.GetTransferResponse(
        transfer_id="t1", prefill_engine_id="P", num_tokens=100, expires_at_ms=1234
    )
    assert _publish(_Replicas(stored, failover=True)) == 1234
    for replicas, engine_id, tokens in (
        (_Replicas(stored, failover=False), "P", 100),  # no failover: a real duplicate
        (_Replicas(stored, failover=True), "Q", 100),  # another engine's transfer
        (_Replicas(stored, failover=True), "P", 99),  # another request under this id
    ):
        with pytest.raises(BrokerCallError) as raised:
            _publish(replicas, engine_id, tokens)
        assert raised.value.code is grpc.StatusCode.ALREADY_EXISTS
        assert raised.value.field == "transfer_id"


def test_publication_carries_the_request() -> None:
    request = protocol.publication(
        "t1", "P", ((1, 2), (3,)), 100, ttl_ms=500, allowed_decode_engines=("D",)
    )
    assert [list(g.ids) for g in request.block_ids] == [[1, 2], [3]]
    assert (request.transfer_id, request.engine_id, request.num_tokens, request.ttl_ms) == (
        "t1",
        "P",
        100,
        500,
    )
    assert list(request.allowed_decode_engines) == ["D"]


def test_a_compressed_segment_keeps_its_entry_size_on_the_wire() -> None:
    """A segment of one entry per 4 tokens arrives as one, not as one entry per token."""
    latent = Segment("c4", 0, (4, 8), (16, 2), "bfloat16", token_axis=0, tokens_per_entry=4)
    group = GroupLayout(GroupKind.ATTENTION, ("l0",), (latent,), 16, 16, 64)
    rank = RankLayout(0, 1, 4, 64, (group,))
    assert rank_layout_from_proto(rank_layout_to_proto(rank), 0) == rank
