"""Bad input through a live broker: every limit of :mod:`broker.limits` and every class of
malformed value gets its status (RESOURCE_EXHAUSTED for counts over a limit,
INVALID_ARGUMENT for malformed values) with a message starting with the field's path, and
the broker keeps serving; plus the planner's own limits and the overflow-safe arithmetic."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from broker_helpers import hybrid, register_request
from fuzz_support import DECODE, PREFILL, Fuzzer, LiveBroker, Requests

from broker.config import ServiceConfig
from broker.errors import LimitExceededError
from broker.limits import LIMITS
from broker.models import build_engine_layout
from broker.planner import PairPlanner
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.scenarios import build_scenario, fresh_block_ids

codes = grpc.StatusCode
TOO_MANY, BAD = codes.RESOURCE_EXHAUSTED, codes.INVALID_ARGUMENT
WAIT_S = 10.0


#: Every limit's value as docs/RELIABILITY.md states it. The tests below probe each boundary
#: at ``LIMITS.x + 1``; these pins make a changed limit a visible decision.
DOCUMENTED_LIMITS = {
    "max_request_bytes": 24 << 20,
    "max_id_chars": 256,
    "max_text_chars": 4096,
    "max_tp_size": 128,
    "max_regions": 4096,
    "max_groups": 256,
    "max_segments_per_group": 64,
    "max_dims": 8,
    "max_page_runs": 65_536,
    "max_kernel_blocks_per_page": 4096,
    "max_agent_metadata_bytes": 16 << 20,
    "max_block_ids": 1_048_576,
    "max_allowed_decode_engines": 256,
    "max_extended_transfers": 1024,
    "max_batch_entries": 1024,
    "max_template_runs": 1_048_576,
    "max_plan_runs": 16_777_216,
    "max_unary_plan_bytes": 16 << 20,
    "max_plan_chunk_bytes": 4 << 20,
}
#: The broker's table limits and durations (``pdbroker serve`` flags), as documented.
DOCUMENTED_DEFAULTS = {
    "max_transfers": 100_000,
    "max_ranks": 4096,
    "max_ttl_ms": 3_600_000,
    "default_ttl_ms": 30_000,
    "lease_ttl_ms": 10_000,
    "retention_ms": 60_000,
    "max_read_ms": 60_000,
    "release_backlog_bytes": 64 << 20,
    "release_backlog_total_bytes": 1 << 30,
    "max_transfers_per_engine": 10_000,
    "max_block_ids_per_engine": 1 << 22,
    "max_metadata_bytes_per_engine": 128 << 20,
    "planner_cache_bytes": 256 << 20,
    "max_session_streams": 4096,
    "release_resume_window": 1024,  # the proto's WatchReleasesRequest.after_sequence
}
RELIABILITY = Path(__file__).parents[1] / "docs" / "RELIABILITY.md"


def test_every_limit_has_its_documented_value() -> None:
    assert dataclasses.asdict(LIMITS) == DOCUMENTED_LIMITS
    config = dataclasses.asdict(ServiceConfig())
    assert {name: config[name] for name in DOCUMENTED_DEFAULTS} == DOCUMENTED_DEFAULTS


def test_the_documented_tables_state_the_pinned_values() -> None:
    rows = re.findall(
        r"^\| `(max_\w+|--[\w-]+)` \| ([\d,]+)", RELIABILITY.read_text(), re.MULTILINE
    )
    stated = {
        name.lstrip("-").replace("-", "_"): int(value.replace(",", "")) for name, value in rows
    }
    pinned = {**DOCUMENTED_LIMITS, **DOCUMENTED_DEFAULTS}
    del pinned["release_resume_window"]
    assert stated == pinned


class Live:
    """A broker with prefill P (TP 2), decode D (TP 4) and X (TP 1) registered."""

    def __init__(self) -> None:
        self.broker = LiveBroker()
        self.fuzzer = Fuzzer(self.broker)
        self.requests = Requests(self.fuzzer.model)
        self.stub = pb_grpc.BrokerStub(self.broker.channel)
        for request in self.requests.every_rank():
            self.stub.RegisterRank(request, timeout=WAIT_S)

    def register(self) -> pb.RegisterRankRequest:
        """Rank 0 of decode engine D, as registered."""
        d = self.requests.engines[DECODE]
        return register_request(d.layout, DECODE, d.role, 0, d.index)

    def publish(self, transfer_id: str = "t") -> pb.PublishBlocksRequest:
        request = self.requests.publish(lambda seq: next(iter(seq)))
        request.transfer_id = transfer_id
        del request.allowed_decode_engines[:]
        return request

    def plan(self, transfer_id: str = "t", rank: int = 0) -> pb.GetTransferPlanRequest:
        request = self.requests.plan(lambda seq: next(iter(seq)))
        request.transfer_id, request.tp_rank = transfer_id, rank
        return request

    def expect(self, method: str, request, code: grpc.StatusCode, field: str) -> str:
        """``method(request)`` fails with ``code`` naming ``field``; the broker still answers."""
        with pytest.raises(grpc.RpcError) as err:
            reply = getattr(self.stub, method)(request, timeout=WAIT_S)
            if method == "WatchReleases":
                next(reply)
        details = err.value.details()
        assert err.value.code() == code, details
        assert details.startswith(f"{field}: "), details
        assert {e.engine_id for e in self.stub.ListEngines(pb.ListEnginesRequest()).engines} >= {
            PREFILL,
            DECODE,
        }
        return details


@pytest.fixture
def live() -> Iterator[Live]:
    broker = Live()
    try:
        yield broker
    finally:
        broker.broker.stop()


# --------------------------------------------------------------------------- registration

Mutation = Callable[[pb.RegisterRankRequest], None]


def _grow(field: str, count: int) -> Mutation:
    def grow(r: pb.RegisterRankRequest) -> None:
        repeated = getattr(r, field)
        repeated.extend([repeated[0]] * (count - len(repeated)))

    return grow


def _segments(r: pb.RegisterRankRequest) -> None:
    group = r.layout.groups[0]
    group.segments.extend([group.segments[0]] * LIMITS.max_segments_per_group)


def _dims(r: pb.RegisterRankRequest) -> None:
    segment = r.layout.groups[0].segments[0]
    segment.shape.extend([1] * LIMITS.max_dims)
    segment.strides.extend([1] * LIMITS.max_dims)


def _kernel_blocks(r: pb.RegisterRankRequest) -> None:
    group = r.layout.groups[1]
    group.block_size = group.kernel_block_size * (LIMITS.max_kernel_blocks_per_page + 1)


def _page_runs(r: pb.RegisterRankRequest) -> None:
    """A segment whose strides split it into more runs than a page may have."""
    segment = r.layout.groups[0].segments[3]
    del segment.shape[:], segment.strides[:]
    segment.shape.extend([LIMITS.max_page_runs + 1, 1])
    segment.strides.extend([8, 4])
    for field in ("shard_axis", "shard_start", "global_extent"):  # held whole
        segment.ClearField(field)
    r.layout.page_bytes = 8 * (LIMITS.max_page_runs + 2) + 288


def _overlap(r: pb.RegisterRankRequest) -> None:
    r.layout.groups[0].segments[1].offset = 8


def _alias(r: pb.RegisterRankRequest) -> None:
    del r.layout.groups[0].segments[3].strides[:]
    r.layout.groups[0].segments[3].strides.extend([4, 4, 4])


def _region(field: str, value: int, index: int = 1) -> Mutation:
    return lambda r: setattr(r.regions[index], field, value)


def _layout(field: str, value: int) -> Mutation:
    return lambda r: setattr(r.layout, field, value)


def _segment(field: str, value: int | list[int]) -> Mutation:
    def change(r: pb.RegisterRankRequest) -> None:
        segment = r.layout.groups[0].segments[0]
        if isinstance(value, list):
            del getattr(segment, field)[:]
            getattr(segment, field).extend(value)
        else:
            setattr(segment, field, value)

    return change


def _empty_layer(r: pb.RegisterRankRequest) -> None:
    r.layout.groups[0].layers[1] = ""


REGISTER = [
    # Counts over a limit.
    (lambda r: setattr(r, "tp_size", LIMITS.max_tp_size + 1), TOO_MANY, "tp_size"),
    (_grow("regions", LIMITS.max_regions + 1), TOO_MANY, "regions"),
    (_layout("num_regions", LIMITS.max_regions + 1), TOO_MANY, "layout.num_regions"),
    (lambda r: _grow("groups", LIMITS.max_groups + 1)(r.layout), TOO_MANY, "layout.groups"),
    (
        lambda r: _grow("layers", LIMITS.max_regions + 1)(r.layout.groups[0]),
        TOO_MANY,
        "layout.groups[0].layers",
    ),
    (_segments, TOO_MANY, "layout.groups[0].segments"),
    (_dims, TOO_MANY, "layout.groups[0].segments[0].shape"),
    (_kernel_blocks, TOO_MANY, "layout.groups[1].kernel_block_size"),
    (_page_runs, TOO_MANY, "layout.groups[0].segments"),
    # Malformed values.
    (lambda r: setattr(r, "tp_size", 0), BAD, "tp_size"),
    (lambda r: setattr(r, "tp_rank", 4), BAD, "tp_rank"),
    (lambda r: setattr(r, "engine_id", ""), BAD, "engine_id"),
    (lambda r: setattr(r, "engine_id", "x" * (LIMITS.max_id_chars + 1)), BAD, "engine_id"),
    (lambda r: setattr(r, "agent_name", "agent\n0"), BAD, "agent_name"),
    (lambda r: setattr(r, "model_fingerprint", "\x1b[31m"), BAD, "model_fingerprint"),
    (_empty_layer, BAD, "layout.groups[0].layers[1]"),
    (_region("length_bytes", 0), BAD, "regions[1].length_bytes"),
    (_region("base_addr", 2**63 - 4096), BAD, "regions[1].base_addr"),
    (_region("base_addr", 2**64 - 1), BAD, "regions[1].base_addr"),
    (_region("length_bytes", 2**64 - 1), BAD, "regions[1].base_addr"),
    (_layout("num_blocks", 0), BAD, "layout.num_blocks"),
    (_layout("num_blocks", 2**62), BAD, "layout.page_bytes"),
    (_layout("page_bytes", 2**64 - 1), BAD, "layout.page_bytes"),
    (_segment("offset", 2**64 - 1), BAD, "layout.groups[0].segments['conv.x']"),
    (_segment("strides", [0, 2]), BAD, "layout.groups[0].segments[0].strides"),
    (_segment("shape", [0, 3]), BAD, "layout.groups[0].segments[0].shape"),
    (_segment("shard_start", 2**64 - 1), BAD, "layout.groups[0].segments[0].shard_start"),
    (_overlap, BAD, "layout.groups[0].segments['conv.B']"),
    (_alias, BAD, "layout.groups[0].segments['ssm']"),
]


@pytest.mark.parametrize(
    "mutate,code,field", REGISTER, ids=[f"{c.name}-{f}" for _, c, f in REGISTER]
)
def test_register_rank(live: Live, mutate: Mutation, code: grpc.StatusCode, field: str) -> None:
    request = live.register()
    mutate(request)
    live.expect("RegisterRank", request, code, field)
    assert live.stub.RegisterRank(live.register(), timeout=WAIT_S).lease_id  # the good one


def _rank_one_blocks(r: pb.RegisterRankRequest) -> None:
    r.layout.num_blocks -= 1


def _rank_one_tensor(r: pb.RegisterRankRequest) -> None:
    r.layout.groups[0].segments[0].tensor = "conv.y"


@pytest.mark.parametrize(
    "mutate,field",
    [
        (_rank_one_blocks, "layout.ranks[1].num_blocks"),
        (_rank_one_tensor, "layout.ranks[1].groups"),
    ],
)
def test_ranks_of_an_engine_must_agree(live: Live, mutate: Mutation, field: str) -> None:
    """The planner reads sizes and tensors from rank 0: a rank declaring others used to be
    accepted, then planned out of its pages or failed with INTERNAL (KeyError)."""
    p = live.requests.engines[PREFILL]
    request = register_request(p.layout, PREFILL, p.role, 1, p.index)
    mutate(request)
    live.expect("RegisterRank", request, codes.FAILED_PRECONDITION, field)
    assert live.stub.PublishBlocks(live.publish(), timeout=WAIT_S).expires_at_ms


def test_agent_metadata_up_to_its_limit(live: Live) -> None:
    """Metadata of exactly the limit is accepted (the message limit leaves room for it);
    one byte more is refused by the broker, naming the field, not by gRPC."""
    request = live.register()
    request.agent_metadata = b"m" * LIMITS.max_agent_metadata_bytes
    assert live.stub.RegisterRank(request, timeout=WAIT_S).lease_id
    request.agent_metadata += b"m"
    live.expect("RegisterRank", request, TOO_MANY, "agent_metadata")


def test_message_over_the_request_limit_is_refused_by_grpc(live: Live) -> None:
    request = live.register()
    request.agent_metadata = b"m" * (LIMITS.max_request_bytes + 1)
    with pytest.raises(grpc.RpcError) as err:
        live.stub.RegisterRank(request, timeout=WAIT_S)
    assert err.value.code() == TOO_MANY
    assert live.stub.RegisterRank(live.register(), timeout=WAIT_S).lease_id


# --------------------------------------------------------------------------- transfers


def test_publish(live: Live) -> None:
    over = [pb.BlockIds(ids=range(LIMITS.max_block_ids)), pb.BlockIds(ids=[1])]
    cases = [
        ("block_ids", over, TOO_MANY, "block_ids"),
        ("block_ids", [pb.BlockIds()] * (LIMITS.max_groups + 1), TOO_MANY, "block_ids"),
        (
            "allowed_decode_engines",
            [DECODE] * (LIMITS.max_allowed_decode_engines + 1),
            TOO_MANY,
            "allowed_decode_engines",
        ),
        ("allowed_decode_engines", [DECODE, ""], BAD, "allowed_decode_engines[1]"),
        ("transfer_id", "", BAD, "transfer_id"),
        ("transfer_id", "t\x00", BAD, "transfer_id"),
        ("num_tokens", 0, BAD, "num_tokens"),
        ("ttl_ms", 2**64 - 1, BAD, "ttl_ms"),
        ("block_ids", [pb.BlockIds(ids=[0]), pb.BlockIds(ids=[-1, 2, 3, 4])], BAD, "block_ids[1]"),
        ("block_ids", [pb.BlockIds(ids=[0]), pb.BlockIds(ids=[2**63 - 1])], BAD, "block_ids[1]"),
        ("block_ids", [pb.BlockIds(ids=[0]), pb.BlockIds(ids=[0, 2, 3, 4])], BAD, "block_ids[1]"),
    ]
    for name, value, code, field in cases:
        request = live.publish()
        request.ClearField(name)
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
        if name == "block_ids" and len(value) == 2:  # the third group, as published
            request.block_ids.append(live.publish().block_ids[2])
        live.expect("PublishBlocks", request, code, field)
    assert live.stub.PublishBlocks(live.publish(), timeout=WAIT_S).expires_at_ms


def test_plan(live: Live) -> None:
    live.stub.PublishBlocks(live.publish(), timeout=WAIT_S)
    good = live.plan()
    cases = [
        ([pb.BlockIds(ids=range(LIMITS.max_block_ids + 1))], TOO_MANY, "block_ids"),
        ([pb.BlockIds()] * (LIMITS.max_groups + 1), TOO_MANY, "block_ids"),
        ([good.block_ids[0], pb.BlockIds(ids=[-5]), good.block_ids[2]], BAD, "block_ids[1]"),
        ([good.block_ids[0], pb.BlockIds(ids=[2**63 - 1]), good.block_ids[2]], BAD, "block_ids[1]"),
    ]
    for block_ids, code, field in cases:
        request = live.plan()
        del request.block_ids[:]
        request.block_ids.extend(block_ids)
        live.expect("GetTransferPlan", request, code, field)
    live.expect("GetTransferPlan", pb.GetTransferPlanRequest(engine_id=DECODE), BAD, "transfer_id")
    assert live.stub.GetTransferPlan(good, timeout=WAIT_S).num_descriptors


def test_ids_of_every_other_rpc(live: Live) -> None:
    long = "x" * (LIMITS.max_id_chars + 1)
    for method, request, field in [
        ("KeepAlive", pb.KeepAliveRequest(), "lease_id"),
        ("KeepAlive", pb.KeepAliveRequest(lease_id=long), "lease_id"),
        ("Deregister", pb.DeregisterRequest(lease_id="\x7f"), "lease_id"),
        ("ReportTransfer", pb.ReportTransferRequest(engine_id=DECODE), "plan_id"),
        ("ReportTransfer", pb.ReportTransferRequest(plan_id="p"), "engine_id"),
        ("ReportTransfer", pb.ReportTransferRequest(plan_id="p", engine_id=DECODE), "status"),
        ("WatchReleases", pb.WatchReleasesRequest(), "engine_id"),
        ("AbortTransfer", pb.AbortTransferRequest(transfer_id=long), "transfer_id"),
        ("GetTransfer", pb.GetTransferRequest(), "transfer_id"),
    ]:
        live.expect(method, request, BAD, field)


def test_long_texts_are_cut_not_refused(live: Live) -> None:
    live.stub.PublishBlocks(live.publish(), timeout=WAIT_S)
    reason = "r" * (LIMITS.max_text_chars * 4)
    aborted = live.stub.AbortTransfer(pb.AbortTransferRequest(transfer_id="t", reason=reason))
    assert aborted.state == pb.TRANSFER_STATE_ABORTED
    timeline = live.stub.GetTransfer(pb.GetTransferRequest(transfer_id="t")).timeline
    assert max(len(e.detail) for e in timeline) == LIMITS.max_text_chars


@pytest.mark.parametrize(
    "method,payload",
    [
        ("RegisterRank", b"\xff\xff\xff"),  # not the wire format
        ("GetTransferPlan", b"\x0a\x02\xff\xfe"),  # transfer_id of invalid UTF-8
        ("PublishBlocks", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"),  # varint overflow
        ("WatchReleases", b"\x0a"),  # truncated
    ],
)
def test_undecodable_requests(live: Live, method: str, payload: bytes) -> None:
    """Bytes that do not parse: INVALID_ARGUMENT naming the request (grpc says UNKNOWN)."""
    assert live.fuzzer.call(method, payload) is None
    streaming = method == "WatchReleases"
    call = (live.broker.channel.unary_stream if streaming else live.broker.channel.unary_unary)(
        f"/pdbroker.v1.Broker/{method}"
    )
    with pytest.raises(grpc.RpcError) as err:
        reply = call(payload, timeout=WAIT_S)
        if streaming:
            next(reply)
    assert err.value.code() == BAD
    assert err.value.details().startswith(f"request: not a valid pdbroker.v1.{method}Request (")


# --------------------------------------------------------------------------- address arithmetic


def _unit_axis(request: pb.RegisterRankRequest) -> None:
    """Give the attention segment a leading axis of length 1 whose stride is 2**64 - 1: legal
    (a stride of a length-1 axis is never taken) and outside int64."""
    segment = request.layout.groups[1].segments[0]
    shape, strides = list(segment.shape), list(segment.strides)
    del segment.shape[:], segment.strides[:]
    segment.shape.extend([1, *shape])
    segment.strides.extend([2**64 - 1, *strides])
    segment.shard_axis += 1
    segment.token_axis += 1


def test_strides_past_int64_plan_inside_the_regions(live: Live) -> None:
    """Prefill kernel blocks of 16 tokens, decode ones of 32: the planner copies half kernel
    blocks and enumerates the outer axes, the length-1 one included (it used to overflow
    int64 there: INTERNAL). Every descriptor still lies in its rank's regions."""
    model, tokens = hybrid(), 80
    engines = {
        "P16": (build_engine_layout(model, 2, 8, 32, 16), pb.ROLE_PREFILL, 5),
        "D32": (build_engine_layout(model, 1, 8, 32, 32), pb.ROLE_DECODE, 6),
    }
    for engine_id, (layout, role, index) in engines.items():
        for rank in range(layout.tp_size):
            request = register_request(layout, engine_id, role, rank, index)
            _unit_axis(request)
            assert live.fuzzer.call("RegisterRank", request.SerializeToString()) is not None
    publish = pb.PublishBlocksRequest(
        transfer_id="t",
        engine_id="P16",
        num_tokens=tokens,
        block_ids=[pb.BlockIds(ids=g) for g in fresh_block_ids(engines["P16"][0], tokens)],
    )
    assert live.fuzzer.call("PublishBlocks", publish.SerializeToString()) is not None
    plan = pb.GetTransferPlanRequest(
        transfer_id="t",
        engine_id="D32",
        block_ids=[pb.BlockIds(ids=g) for g in fresh_block_ids(engines["D32"][0], tokens)],
    )
    reply = live.fuzzer.call("GetTransferPlan", plan.SerializeToString())
    assert pb.GetTransferPlanResponse.FromString(reply).num_descriptors


def test_planner_limits() -> None:
    sc = build_scenario(hybrid(), 2, 4, 100)
    with pytest.raises(LimitExceededError, match=r"^layout\.groups\[\d\]\.segments\['[\w.]+'\]"):
        PairPlanner(sc.prefill, sc.decode, max_template_runs=4).plan_rank(0, sc.request)
    with pytest.raises(LimitExceededError, match="^block_ids: the plan of decode rank 0 needs"):
        PairPlanner(sc.prefill, sc.decode, max_plan_runs=4).plan_rank(0, sc.request)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 4), (4, 1)])
def test_template_table_renewal_keeps_plans_right(prefill_tp: int, decode_tp: int) -> None:
    """The table is started afresh only between requests: a request needing more templates
    than fit gets the same plan as with an unbounded table (it used to get another group's
    templates, or an IndexError)."""
    sc = build_scenario(hybrid(), prefill_tp, decode_tp, 100, block_size=32)
    small = PairPlanner(sc.prefill, sc.decode, max_templates=1)
    full = PairPlanner(sc.prefill, sc.decode)
    for _ in range(2):
        for d in range(decode_tp):
            got, want = small.plan_rank(d, sc.request), full.plan_rank(d, sc.request)
            assert got.prefill_ranks == want.prefill_ranks
            for a, b in zip(got.sources, want.sources):
                for column in ("region", "local_offset", "remote_offset", "length"):
                    assert np.array_equal(getattr(a, column), getattr(b, column))
