"""The broker over real gRPC on 127.0.0.1: status codes and field names for bad input, the
full publish → plan → report → release flow, expiry, leases, health and reflection."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from broker_helpers import FakeClock, assert_inside_regions, fake_regions, hybrid, register_request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from broker.config import ServiceConfig
from broker.layout import EngineLayout
from broker.planner import PairPlanner, TransferRequest
from broker.server import BrokerServer
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import unpack
from harness.cases import load_case, merge_runs
from harness.scenarios import build_scenario

#: Every test runs against the in-memory store and against Redis (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_store")
CASES = Path(__file__).parent / "data" / "testvectors" / "cases"
TTL_MS = 5_000
LEASE_MS = 60_000
REAP_MS = 10
WAIT_S = 5.0


@dataclass
class Broker:
    stub: pb_grpc.BrokerStub
    channel: grpc.Channel
    clock: FakeClock
    address: str


@pytest.fixture
def broker() -> Iterator[Broker]:
    """A real ``grpc.aio`` broker on an ephemeral port, its event loop in a thread."""
    clock = FakeClock()
    service = BrokerService(
        clock=clock,
        config=ServiceConfig(
            default_ttl_ms=TTL_MS,
            lease_ttl_ms=LEASE_MS,
            retention_ms=60_000,
            max_transfers=50,
            max_read_ms=10 * LEASE_MS,
        ),
    )
    server = BrokerServer(service, "127.0.0.1:0", reap_interval_ms=REAP_MS)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(WAIT_S)
    channel = grpc.insecure_channel(server.address)
    try:
        yield Broker(pb_grpc.BrokerStub(channel), channel, clock, server.address)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


def register(
    stub: pb_grpc.BrokerStub, layout: EngineLayout, engine_id: str, role: int, engine_index: int
) -> list[pb.RegisterRankResponse]:
    return [
        stub.RegisterRank(register_request(layout, engine_id, role, r, engine_index))
        for r in range(layout.tp_size)
    ]


def block_ids(ids: tuple[tuple[int, ...], ...]) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=g) for g in ids]


def publish_request(transfer_id: str, request: TransferRequest, **kw) -> pb.PublishBlocksRequest:
    return pb.PublishBlocksRequest(
        transfer_id=transfer_id,
        engine_id="P",
        block_ids=block_ids(request.prefill_block_ids),
        num_tokens=request.num_tokens,
        **kw,
    )


def plan_request(
    transfer_id: str, rank: int, request: TransferRequest, engine_id: str = "D"
) -> pb.GetTransferPlanRequest:
    return pb.GetTransferPlanRequest(
        transfer_id=transfer_id,
        engine_id=engine_id,
        tp_rank=rank,
        block_ids=block_ids(request.decode_block_ids),
    )


def expect_error(call, request, code: grpc.StatusCode, field: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, timeout=WAIT_S)
        if hasattr(result, "__next__"):
            next(result)  # a stream reports its error on the first read
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(f"{field}: "), err.value.details()
    return err.value.details()


def next_release(stream) -> pb.ReleaseEvent:
    return next(stream)


# --------------------------------------------------------------------------- flow


def test_publish_plan_report_release_over_grpc(broker: Broker) -> None:
    sc = build_scenario(hybrid(), 2, 2, 100)
    stub = broker.stub
    p_leases = register(stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    d_leases = register(stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    assert [lease.engine_complete for lease in p_leases] == [False, True]
    assert all(lease.ttl_ms == LEASE_MS for lease in p_leases + d_leases)
    streams = [
        stub.WatchReleases(pb.WatchReleasesRequest(engine_id="P", tp_rank=p), timeout=WAIT_S)
        for p in range(2)
    ]
    published = stub.PublishBlocks(publish_request("t1", sc.request))
    assert published.expires_at_ms == broker.clock.now + TTL_MS

    planner = PairPlanner(sc.prefill, sc.decode)
    plans = [stub.GetTransferPlan(plan_request("t1", d, sc.request)) for d in range(2)]
    for d, plan in enumerate(plans):
        expected = planner.plan_rank(d, sc.request)
        (source,) = plan.sources
        assert source.prefill_rank == d and source.remote_agent_name == f"P-agent{d}"
        assert source.remote_agent_metadata == f"metadata of P rank {d}".encode()
        assert source.local_memory_kind == source.remote_memory_kind == pb.MEMORY_KIND_DRAM
        local, remote = unpack(source.local_descriptors), unpack(source.remote_descriptors)
        assert len(local) == len(remote) == source.num_descriptors == expected.num_descriptors
        assert (local[:, 1] == remote[:, 1]).all()
        assert source.total_bytes == plan.total_bytes == int(local[:, 1].sum()) == expected.nbytes
        assert plan.naive_bytes == expected.naive_bytes
        assert plan.vllm_descriptors == expected.vllm_descriptors
        assert_inside_regions(local, fake_regions(sc.decode, 1, d))
        assert_inside_regions(remote, fake_regions(sc.prefill, 0, d))
        assert source.notification == f"pdbroker:t1:{plan.plan_id}:{d}".encode()

    for d, plan in enumerate(plans):
        reply = stub.ReportTransfer(
            pb.ReportTransferRequest(
                plan_id=plan.plan_id,
                engine_id="D",
                tp_rank=d,
                status=pb.REPORT_STATUS_DONE,
                bytes_moved=plan.total_bytes,
                duration_us=1234,
            )
        )
        assert reply.intact and not reply.duplicate
        event = next_release(streams[d])
        assert (event.transfer_id, event.reason) == ("t1", pb.RELEASE_REASON_COMPLETED)
        assert [tuple(g.ids) for g in event.block_ids] == list(sc.request.prefill_block_ids)
    assert reply.state == pb.TRANSFER_STATE_COMPLETED
    again = stub.ReportTransfer(
        pb.ReportTransferRequest(
            plan_id=plans[0].plan_id, engine_id="D", tp_rank=0, status=pb.REPORT_STATUS_FAILED
        )
    )
    assert again.duplicate and again.state == pb.TRANSFER_STATE_COMPLETED

    info = stub.GetTransfer(pb.GetTransferRequest(transfer_id="t1"))
    assert info.state == pb.TRANSFER_STATE_COMPLETED and info.decode_engine_id == "D"
    assert [(r.tp_rank, r.reason, list(r.consumers)) for r in info.releases] == [
        (0, pb.RELEASE_REASON_COMPLETED, [0]),
        (1, pb.RELEASE_REASON_COMPLETED, [1]),
    ]
    assert [p.status for p in info.plans] == [pb.REPORT_STATUS_DONE] * 2
    assert info.plans[0].duration_us == 1234
    assert (info.timeline[0].event, info.timeline[-1].event) == ("published", "completed")
    assert info.finished_at_ms == broker.clock.now

    engines = stub.ListEngines(pb.ListEnginesRequest()).engines
    assert [(e.engine_id, e.role, e.complete, len(e.ranks)) for e in engines] == [
        ("D", pb.ROLE_DECODE, True, 2),
        ("P", pb.ROLE_PREFILL, True, 2),
    ]
    for lease in p_leases + d_leases:
        assert stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease.lease_id)).ttl_ms == LEASE_MS
        stub.Deregister(pb.DeregisterRequest(lease_id=lease.lease_id))
    assert not stub.ListEngines(pb.ListEnginesRequest()).engines
    for stream in streams:  # the rank is gone: its stream ends cleanly
        assert list(stream) == []


@pytest.mark.parametrize("case", sorted(p.name for p in CASES.glob("*.json")))
def test_plans_over_grpc_are_vllms_reference_byte_for_byte(broker: Broker, case: str) -> None:
    """Registration, publish and every decode rank's plan through the server, the packed
    descriptors mapped back to region offsets through the registered regions: exactly the
    runs vLLM 0.33's own connector moves for the case (the planner is not the oracle)."""
    c = load_case(json.loads((CASES / case).read_text()))
    expected = json.loads((CASES.parent / "expected" / case).read_text())
    register(broker.stub, c.prefill, "P", pb.ROLE_PREFILL, 0)
    register(broker.stub, c.decode, "D", pb.ROLE_DECODE, 1)
    broker.stub.PublishBlocks(publish_request("t", c.request))
    runs, total = [], 0
    for d in range(c.decode.tp_size):
        plan = broker.stub.GetTransferPlan(plan_request("t", d, c.request))
        d_regions = fake_regions(c.decode, 1, d)
        for source in plan.sources:
            p = source.prefill_rank
            p_regions = fake_regions(c.prefill, 0, p)
            local, remote = unpack(source.local_descriptors), unpack(source.remote_descriptors)
            assert_inside_regions(local, d_regions)
            assert_inside_regions(remote, p_regions)
            d_region, d_off = _region_offsets(local, d_regions)
            p_region, p_off = _region_offsets(remote, p_regions)
            runs += [
                [d, dr, do, p, pr, po, n]
                for dr, do, pr, po, n in zip(d_region, d_off, p_region, p_off, local[:, 1].tolist())
            ]
            assert source.total_bytes == int(local[:, 1].sum())
        total += plan.total_bytes
    assert merge_runs(runs) == merge_runs(expected["runs"])
    assert total == expected["total_bytes"]


def _region_offsets(rows: np.ndarray, regions) -> tuple[list[int], list[int]]:
    """Region index and offset in it of each descriptor's address."""
    bases = np.array([r.base_addr for r in regions])
    index = np.searchsorted(bases, rows[:, 0], side="right") - 1
    return index.tolist(), (rows[:, 0] - bases[index]).tolist()


def test_unread_transfer_expires_with_a_release_and_a_clear_error(broker: Broker) -> None:
    sc = build_scenario(hybrid(), 1, 1, 100)
    register(broker.stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    register(broker.stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    stream = broker.stub.WatchReleases(
        pb.WatchReleasesRequest(engine_id="P", tp_rank=0), timeout=WAIT_S
    )
    broker.stub.PublishBlocks(publish_request("t", sc.request, ttl_ms=1_000))
    broker.clock.advance(1_000)  # the reaper notices within REAP_MS
    event = next_release(stream)
    assert (event.transfer_id, event.reason) == ("t", pb.RELEASE_REASON_EXPIRED)
    details = expect_error(
        broker.stub.GetTransferPlan,
        plan_request("t", 0, sc.request),
        grpc.StatusCode.FAILED_PRECONDITION,
        "transfer_id",
    )
    assert "expired" in details
    info = broker.stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"))
    assert info.state == pb.TRANSFER_STATE_EXPIRED and not info.plans


def test_expired_lease_fails_transfers_and_ends_the_stream(broker: Broker) -> None:
    sc = build_scenario(hybrid(), 1, 1, 100)
    register(broker.stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    (decode_lease,) = register(broker.stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    broker.stub.PublishBlocks(publish_request("t", sc.request, ttl_ms=10 * LEASE_MS))
    plan = broker.stub.GetTransferPlan(plan_request("t", 0, sc.request))
    stream = broker.stub.WatchReleases(
        pb.WatchReleasesRequest(engine_id="P", tp_rank=0), timeout=WAIT_S
    )
    broker.clock.advance(LEASE_MS - 1)
    broker.stub.KeepAlive(pb.KeepAliveRequest(lease_id=decode_lease.lease_id))
    broker.clock.advance(1)  # prefill's lease runs out; decode's was renewed
    assert list(stream) == []
    assert [e.engine_id for e in broker.stub.ListEngines(pb.ListEnginesRequest()).engines] == ["D"]
    info = broker.stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"))
    assert info.state == pb.TRANSFER_STATE_FAILED
    assert (info.timeline[-1].event, info.timeline[-1].detail) == (
        "failed",
        "prefill rank 0 lease expired",
    )  # nothing released yet: decode still holds a live plan on prefill rank 0
    with pytest.raises(grpc.RpcError) as info:
        broker.stub.ReportTransfer(
            pb.ReportTransferRequest(
                plan_id=plan.plan_id, engine_id="D", tp_rank=0, status=pb.REPORT_STATUS_DONE
            )
        )
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert info.value.details().startswith("plan_id: ") and "recompute" in info.value.details()


def test_abort_over_grpc(broker: Broker) -> None:
    sc = build_scenario(hybrid(), 2, 1, 100)
    register(broker.stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    register(broker.stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    broker.stub.PublishBlocks(publish_request("t", sc.request))
    reply = broker.stub.AbortTransfer(pb.AbortTransferRequest(transfer_id="t", reason="user left"))
    assert reply.state == pb.TRANSFER_STATE_ABORTED
    for p in range(2):
        stream = broker.stub.WatchReleases(
            pb.WatchReleasesRequest(engine_id="P", tp_rank=p), timeout=WAIT_S
        )
        event = next_release(stream)
        assert (event.reason, event.detail) == (pb.RELEASE_REASON_ABORTED, "user left")
        stream.cancel()


def test_health_and_reflection(broker: Broker) -> None:
    health = health_pb2_grpc.HealthStub(broker.channel)
    for name in ("", "pdbroker.v1.Broker"):
        status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=WAIT_S).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(broker.channel)
    replies = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=WAIT_S
    )
    names = {s.name for s in next(replies).list_services_response.service}
    assert {"pdbroker.v1.Broker", "grpc.health.v1.Health"} <= names


# --------------------------------------------------------------------------- bad input


def _segment_strides_mismatch(req: pb.RegisterRankRequest) -> None:
    del req.layout.groups[0].segments[0].strides[-1]


def _unknown_dtype(req: pb.RegisterRankRequest) -> None:
    req.layout.groups[1].segments[0].dtype = "float7"


def _short_region(req: pb.RegisterRankRequest) -> None:
    req.regions[0].length_bytes -= 1


def _no_memory_kind(req: pb.RegisterRankRequest) -> None:
    req.regions[1].memory_kind = pb.MEMORY_KIND_UNSPECIFIED


def _too_many_regions(req: pb.RegisterRankRequest) -> None:
    req.regions.extend([req.regions[0]] * 4097)


def _segment_past_page(req: pb.RegisterRankRequest) -> None:
    req.layout.groups[0].segments[0].offset = req.layout.page_bytes


REGISTER_ERRORS = [
    (lambda r: setattr(r, "engine_id", ""), grpc.StatusCode.INVALID_ARGUMENT, "engine_id"),
    (lambda r: setattr(r, "role", pb.ROLE_UNSPECIFIED), grpc.StatusCode.INVALID_ARGUMENT, "role"),
    (lambda r: setattr(r, "tp_rank", 5), grpc.StatusCode.INVALID_ARGUMENT, "tp_rank"),
    (lambda r: setattr(r, "tp_size", 0), grpc.StatusCode.INVALID_ARGUMENT, "tp_size"),
    (lambda r: r.ClearField("layout"), grpc.StatusCode.INVALID_ARGUMENT, "layout"),
    (
        lambda r: setattr(r, "model_fingerprint", ""),
        grpc.StatusCode.INVALID_ARGUMENT,
        "model_fingerprint",
    ),
    (
        _segment_strides_mismatch,
        grpc.StatusCode.INVALID_ARGUMENT,
        "layout.groups[0].segments[0].strides",
    ),
    (_unknown_dtype, grpc.StatusCode.INVALID_ARGUMENT, "layout.groups[1].segments[0].dtype"),
    (_segment_past_page, grpc.StatusCode.INVALID_ARGUMENT, "layout.groups[0].segments['conv.x']"),
    (_short_region, grpc.StatusCode.INVALID_ARGUMENT, "regions[0].length_bytes"),
    (_no_memory_kind, grpc.StatusCode.INVALID_ARGUMENT, "regions[1].memory_kind"),
    (_too_many_regions, grpc.StatusCode.RESOURCE_EXHAUSTED, "regions"),
    (lambda r: setattr(r, "agent_name", "P-agent0"), grpc.StatusCode.ALREADY_EXISTS, "agent_name"),
    (lambda r: setattr(r, "engine_id", "P"), grpc.StatusCode.FAILED_PRECONDITION, "tp_size"),
]


@pytest.mark.parametrize(
    "mutate,code,field", REGISTER_ERRORS, ids=[f"{c.name}-{f}" for _, c, f in REGISTER_ERRORS]
)
def test_register_rank_bad_input(broker: Broker, mutate, code, field) -> None:
    sc = build_scenario(hybrid(), 2, 4, 100)
    register(broker.stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    request = register_request(sc.decode, "D", pb.ROLE_DECODE, 0, 1)
    mutate(request)
    expect_error(broker.stub.RegisterRank, request, code, field)
    # Still serving, and the good registration goes through.
    assert broker.stub.RegisterRank(register_request(sc.decode, "D", pb.ROLE_DECODE, 0, 1)).lease_id


def test_every_other_rpc_bad_input(broker: Broker) -> None:
    stub = broker.stub
    sc = build_scenario(hybrid(), 2, 2, 100)
    other = build_scenario(hybrid(kv_heads=8, name="other"), 2, 2, 100)
    register(stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    register(stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    register(stub, other.decode, "X", pb.ROLE_DECODE, 2)
    stub.RegisterRank(register_request(sc.decode, "half", pb.ROLE_DECODE, 0, 3))
    stub.PublishBlocks(publish_request("t", sc.request))
    plan = stub.GetTransferPlan(plan_request("t", 0, sc.request))
    codes = grpc.StatusCode
    bad_ids = sc.request.prefill_block_ids[:1]
    huge = [pb.BlockIds(ids=range(1 << 20)), pb.BlockIds(ids=[1])]
    cases = [
        (stub.KeepAlive, pb.KeepAliveRequest(lease_id="nope"), codes.NOT_FOUND, "lease_id"),
        (stub.Deregister, pb.DeregisterRequest(lease_id="nope"), codes.NOT_FOUND, "lease_id"),
        (stub.PublishBlocks, publish_request("t", sc.request), codes.ALREADY_EXISTS, "transfer_id"),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(transfer_id="u", engine_id="nobody", num_tokens=1),
            codes.NOT_FOUND,
            "engine_id",
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(transfer_id="u", engine_id="P"),
            codes.INVALID_ARGUMENT,
            "num_tokens",
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(
                transfer_id="u", engine_id="P", num_tokens=100, block_ids=block_ids(bad_ids)
            ),
            codes.INVALID_ARGUMENT,
            "block_ids",
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(transfer_id="u", engine_id="P", num_tokens=100, block_ids=huge),
            codes.RESOURCE_EXHAUSTED,
            "block_ids",
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(
                transfer_id="u",
                engine_id="D",
                num_tokens=100,
                block_ids=block_ids(sc.request.prefill_block_ids),
            ),
            codes.FAILED_PRECONDITION,
            "engine_id",
        ),
        (
            stub.GetTransferPlan,
            plan_request("missing", 0, sc.request),
            codes.NOT_FOUND,
            "transfer_id",
        ),
        (
            stub.GetTransferPlan,
            plan_request("t", 1, sc.request, "nobody"),
            codes.NOT_FOUND,
            "engine_id",
        ),
        (
            stub.GetTransferPlan,
            pb.GetTransferPlanRequest(
                transfer_id="t", engine_id="D", tp_rank=1, block_ids=block_ids(bad_ids)
            ),
            codes.INVALID_ARGUMENT,
            "block_ids",
        ),
        (
            stub.GetTransferPlan,
            plan_request("t", 0, sc.request, "half"),
            codes.FAILED_PRECONDITION,
            "engine_id",
        ),
        (
            stub.ReportTransfer,
            pb.ReportTransferRequest(plan_id="nope", engine_id="D", status=pb.REPORT_STATUS_DONE),
            codes.NOT_FOUND,
            "plan_id",
        ),
        (
            stub.ReportTransfer,
            pb.ReportTransferRequest(plan_id=plan.plan_id, engine_id="D"),
            codes.INVALID_ARGUMENT,
            "status",
        ),
        (
            stub.ReportTransfer,
            pb.ReportTransferRequest(
                plan_id=plan.plan_id, engine_id="D", status=pb.REPORT_STATUS_DONE, bytes_moved=1
            ),
            codes.INVALID_ARGUMENT,
            "bytes_moved",
        ),
        (
            stub.WatchReleases,
            pb.WatchReleasesRequest(engine_id="nobody"),
            codes.NOT_FOUND,
            "engine_id",
        ),
        (
            stub.WatchReleases,
            pb.WatchReleasesRequest(engine_id="P", tp_rank=9),
            codes.NOT_FOUND,
            "tp_rank",
        ),
        (
            stub.WatchReleases,
            pb.WatchReleasesRequest(engine_id="D"),
            codes.FAILED_PRECONDITION,
            "engine_id",
        ),
        (
            stub.WatchReleases,
            pb.WatchReleasesRequest(engine_id="P", after_sequence=1, lease_id="an-old-lease"),
            codes.FAILED_PRECONDITION,
            "lease_id",
        ),
        (
            stub.AbortTransfer,
            pb.AbortTransferRequest(transfer_id="missing"),
            codes.NOT_FOUND,
            "transfer_id",
        ),
        (
            stub.GetTransfer,
            pb.GetTransferRequest(transfer_id="missing"),
            codes.NOT_FOUND,
            "transfer_id",
        ),
    ]
    for call, request, code, field in cases:
        expect_error(call, request, code, field)
        # The broker keeps serving after every bad call.
        assert stub.GetTransfer(pb.GetTransferRequest(transfer_id="t")).state == (
            pb.TRANSFER_STATE_IN_PROGRESS
        )
    # Layout mismatch: a decode engine of another model.
    stub.PublishBlocks(publish_request("m", sc.request))
    details = expect_error(
        stub.GetTransferPlan,
        plan_request("m", 0, other.request, "X"),
        codes.FAILED_PRECONDITION,
        "model_fingerprint",
    )
    assert "cannot read from prefill engine 'P'" in details
    # Too many transfers.
    for i in range(48):
        stub.PublishBlocks(publish_request(f"fill{i}", sc.request))
    expect_error(
        stub.PublishBlocks,
        publish_request("over", sc.request),
        codes.RESOURCE_EXHAUSTED,
        "transfer_id",
    )
    assert stub.GetTransferPlan(plan_request("t", 1, sc.request)).plan_id


def test_memory_kind_reaches_the_plan(broker: Broker) -> None:
    sc = build_scenario(hybrid(), 1, 1, 100)
    register(broker.stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    request = register_request(sc.decode, "D", pb.ROLE_BOTH, 0, 1)
    for region in request.regions:
        region.memory_kind = pb.MEMORY_KIND_VRAM
    broker.stub.RegisterRank(request)
    broker.stub.PublishBlocks(publish_request("t", sc.request))
    (source,) = broker.stub.GetTransferPlan(plan_request("t", 0, sc.request)).sources
    assert (source.local_memory_kind, source.remote_memory_kind) == (
        pb.MEMORY_KIND_VRAM,
        pb.MEMORY_KIND_DRAM,
    )
