"""The decode client refuses a plan it must not execute before any NIXL call: one writing
outside its registered regions, writing a byte twice, or whose descriptors do not add up to
its byte counts. Unit checks of :func:`clients.plan_check.check_plan`, then a real broker behind a
proxy that tampers with its plans, real prefill and decode clients with NIXL agents."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from prerequisites import require_module

from broker.limits import LIMITS
from broker.v1 import broker_pb2 as pb
from broker.wire import pack
from clients.plan_check import PlanRejected, SourceRead, check_plan, check_plans
from clients.transport import DRAM, VRAM, Region

REGIONS = (Region(1 << 20, 4096), Region(2 << 20, 4096), Region(1 << 20, 4096, 1, VRAM))


def source(
    local: list[tuple[int, int, int]],
    remote_offset: int = 1 << 30,
    kind: int = pb.MEMORY_KIND_DRAM,
    prefill_rank: int = 0,
) -> pb.SourcePlan:
    rows = np.array(local, dtype=np.int64).reshape(-1, 3)
    remote = rows + np.array([remote_offset, 0, 0])
    return pb.SourcePlan(
        prefill_rank=prefill_rank,
        remote_agent_name=f"p{prefill_rank}",
        local_descriptors=pack(rows),
        remote_descriptors=pack(remote),
        num_descriptors=len(rows),
        total_bytes=int(rows[:, 1].sum()),
        local_memory_kind=kind,
        remote_memory_kind=kind,
    )


def plan(*sources: pb.SourcePlan) -> pb.GetTransferPlanResponse:
    return pb.GetTransferPlanResponse(
        plan_id="plan-1",
        sources=sources,
        total_bytes=sum(s.total_bytes for s in sources),
        num_descriptors=sum(s.num_descriptors for s in sources),
    )


GOOD = plan(
    source([(1 << 20, 100, 0), ((1 << 20) + 200, 3896, 0)]),
    source([(2 << 20, 4096, 0)], prefill_rank=1),
    source([(1 << 20, 4096, 1)], kind=pb.MEMORY_KIND_VRAM, prefill_rank=2),
)


def test_a_plan_inside_the_regions_is_accepted_as_is() -> None:
    reads = check_plan(GOOD, REGIONS, 0)
    assert [r.source.prefill_rank for r in reads] == [0, 1, 2]
    assert [(r.local_kind, r.remote_kind) for r in reads] == [(DRAM, DRAM)] * 2 + [(VRAM, VRAM)]
    np.testing.assert_array_equal(reads[0].local, [[1 << 20, 100, 0], [(1 << 20) + 200, 3896, 0]])
    np.testing.assert_array_equal(reads[0].remote[:, 0] - reads[0].local[:, 0], [1 << 30] * 2)
    assert check_plan(plan(), REGIONS, 0) == []  # nothing to move


def _tampered(change: Callable[[pb.GetTransferPlanResponse], None]) -> pb.GetTransferPlanResponse:
    bad = pb.GetTransferPlanResponse()
    bad.CopyFrom(GOOD)
    change(bad)
    return bad


def _local(
    index: int, rows: list[tuple[int, int, int]]
) -> Callable[[pb.GetTransferPlanResponse], None]:
    """Replace source ``index``'s local descriptors (remote ones moved alike, counts kept)."""

    def change(p: pb.GetTransferPlanResponse) -> None:
        fresh = source(rows, kind=p.sources[index].local_memory_kind)
        s = p.sources[index]
        s.local_descriptors, s.remote_descriptors = (
            fresh.local_descriptors,
            fresh.remote_descriptors,
        )

    return change


def _set(
    field: str, value: int, index: int | None = None
) -> Callable[[pb.GetTransferPlanResponse], None]:
    return lambda p: setattr(p if index is None else p.sources[index], field, value)


REFUSED = [
    ("past the region's end", _local(1, [((2 << 20) + 1, 4096, 0)]), "outside rank 3's registered"),
    ("before every region", _local(1, [((1 << 20) - 4096, 4096, 0)]), "outside rank 3's"),
    ("between two regions", _local(1, [((1 << 20) + 8192, 4096, 0)]), "outside rank 3's"),
    ("on the wrong device", _local(2, [(1 << 20, 4096, 0)]), "outside rank 3's"),
    ("a wrapping length", _local(1, [(2 << 20, 2**63 - 1, 0)]), "outside rank 3's"),
    ("a zero length", _local(1, [(2 << 20, 0, 0)]), "outside rank 3's"),
    (
        "a byte written twice",
        _local(1, [((1 << 20) + 99, 1, 0)]),
        "writes some bytes of rank 3 twice",
    ),
    (
        "plan total_bytes",
        _set("total_bytes", GOOD.total_bytes + 1),
        f"plan-1's descriptors add up to {GOOD.total_bytes} bytes, not its total_bytes",
    ),
    ("plan total_bytes short", _set("total_bytes", GOOD.total_bytes - 1), "not its total_bytes"),
    (
        "source total_bytes",
        _set("total_bytes", 4095, 1),
        "source 1's descriptors add up to 4096 bytes, not its total_bytes 4095",
    ),
    (
        "source num_descriptors",
        _set("num_descriptors", 3, 0),
        "2 descriptors, not its num_descriptors 3",
    ),
    ("memory kind", _set("local_memory_kind", 7, 0), "unknown memory kind"),
]


@pytest.mark.parametrize("change,message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_bad_plan_is_refused_naming_the_check(change, message: str) -> None:
    with pytest.raises(PlanRejected, match=message):
        check_plan(_tampered(change), REGIONS, 3)


def test_plans_on_one_device_are_checked_alike() -> None:
    """A rank whose regions all lie on one device (the common case, checked by address
    alone): a byte written twice, one outside the regions and a wrong total are refused as
    on several devices, whether the plan has one source or several."""
    one = plan(source([(1 << 20, 100, 0), ((1 << 20) + 200, 3896, 0)]))
    two = plan(one.sources[0], source([(2 << 20, 4096, 0)], prefill_rank=1))
    for good in (one, two):
        assert [r.source.prefill_rank for r in check_plan(good, REGIONS[:2], 0)] == list(
            range(len(good.sources))
        )
    twice = plan(one.sources[0], source([((1 << 20) + 4000, 96, 0)], prefill_rank=1))
    with pytest.raises(PlanRejected, match="writes some bytes of rank 0 twice"):
        check_plan(twice, REGIONS[:2], 0)
    within = plan(source([(1 << 20, 50, 0), ((1 << 20) + 49, 10, 0)]))
    with pytest.raises(PlanRejected, match="writes some bytes of rank 0 twice"):
        check_plan(within, REGIONS[:2], 0)
    # Disjoint writes out of address order are fine.
    unordered = plan(source([(2 << 20, 4096, 0), ((1 << 20) + 200, 3896, 0), (1 << 20, 100, 0)]))
    assert len(check_plan(unordered, REGIONS[:2], 0)[0].local) == 3
    outside = plan(one.sources[0], source([((2 << 20) + 1, 4096, 0)], prefill_rank=1))
    with pytest.raises(PlanRejected, match="source 1 .* writes outside rank 0's"):
        check_plan(outside, REGIONS[:2], 0)
    short = pb.GetTransferPlanResponse()
    short.CopyFrom(one)
    short.sources[0].total_bytes -= 1
    with pytest.raises(PlanRejected, match="source 0's descriptors add up to 3996 bytes"):
        check_plan(short, REGIONS[:2], 0)


def test_descriptors_that_do_not_pair_are_refused() -> None:
    unpaired = _tampered(
        lambda p: setattr(p.sources[0], "remote_descriptors", p.sources[0].remote_descriptors[:24])
    )
    with pytest.raises(PlanRejected, match="source 0 .*: 2 local descriptors for 1 remote"):
        check_plan(unpaired, REGIONS, 0)
    torn = _tampered(lambda p: setattr(p.sources[0], "local_descriptors", b"\0" * 25))
    with pytest.raises(PlanRejected, match="25 bytes is not a whole number"):
        check_plan(torn, REGIONS, 0)
    longer = _tampered(
        lambda p: setattr(p.sources[1], "remote_descriptors", pack(np.array([[3 << 30, 4095, 0]])))
    )
    with pytest.raises(PlanRejected, match="local and remote descriptor lengths differ"):
        check_plan(longer, REGIONS, 0)
    empty = _tampered(
        lambda p: (
            setattr(p.sources[1], "local_descriptors", b""),
            setattr(p.sources[1], "remote_descriptors", b""),
        )
    )
    with pytest.raises(PlanRejected, match="source 1 .*: no descriptors"):
        check_plan(empty, REGIONS, 0)


TORN = [
    (
        "unpaired",
        lambda p: setattr(p.sources[0], "remote_descriptors", p.sources[0].remote_descriptors[:24]),
        "2 local descriptors for 1 remote",
    ),
    ("torn", lambda p: setattr(p.sources[0], "local_descriptors", b"\0" * 25), "25 bytes"),
    (
        "longer remote",
        lambda p: setattr(p.sources[1], "remote_descriptors", pack(np.array([[3 << 30, 4095, 0]]))),
        "local and remote descriptor lengths differ",
    ),
    (
        "source and plan total_bytes both short",
        lambda p: (
            setattr(p.sources[1], "total_bytes", 4095),
            setattr(p, "total_bytes", p.total_bytes - 1),  # the sources' totals add up
        ),
        "source 1's descriptors add up to 4096 bytes, not its total_bytes 4095",
    ),
]


def _same_reads(a: list[SourceRead], b: list[SourceRead]) -> bool:
    return [(r.source, r.local_kind, r.remote_kind) for r in a] == [
        (r.source, r.local_kind, r.remote_kind) for r in b
    ] and all(
        np.array_equal(x.local, y.local) and np.array_equal(x.remote, y.remote)
        for x, y in zip(a, b)
    )


def test_a_steps_plans_are_checked_together_as_one_by_one() -> None:
    """A rank checks a step's plans at once (:func:`check_plans`): each plan gets the reads
    :func:`check_plan` gives it, out of one array of every plan's descriptors. Plans may
    write between each other's bytes, and two plans of a step are not checked against each
    other (each is checked as on its own)."""
    between = plan(source([((1 << 20) + 100, 100, 0)]), source([((2 << 20) + 8, 8, 0)]))
    plans = [GOOD, between, plan(), GOOD]
    together = check_plans(plans, REGIONS, 0)
    for p, reads in zip(plans, together):
        assert not isinstance(reads, PlanRejected)
        assert _same_reads(reads, check_plan(p, REGIONS, 0))
    bases = {id(r.local.base) for reads in together for r in reads}  # type: ignore[union-attr]
    assert len(bases) == 1  # checked together, not one by one


@pytest.mark.parametrize(
    "change,message", [r[1:] for r in REFUSED + TORN], ids=[r[0] for r in REFUSED + TORN]
)
def test_a_bad_plan_among_a_steps_is_refused_alone(change, message: str) -> None:
    """One plan of a step failing a check is refused naming it, as on its own; the step's
    other plans are read."""
    checked = check_plans([GOOD, _tampered(change), GOOD], REGIONS, 3)
    assert isinstance(checked[1], PlanRejected) and re.search(message, str(checked[1]))
    for reads in (checked[0], checked[2]):
        assert not isinstance(reads, PlanRejected) and _same_reads(
            reads, check_plan(GOOD, REGIONS, 3)
        )


OUTSIDE_DRAM = [r for r in REFUSED[:6] if r[0] != "on the wrong device"]


@pytest.mark.parametrize(
    "change,message", [r[1:] for r in OUTSIDE_DRAM], ids=[r[0] for r in OUTSIDE_DRAM]
)
def test_a_write_outside_the_regions_is_refused_in_a_step_on_one_memory_kind(
    change, message: str
) -> None:
    """As above, with every plan of the step writing one memory kind (the common case)."""
    dram = plan(GOOD.sources[0], GOOD.sources[1])
    bad = pb.GetTransferPlanResponse()
    bad.CopyFrom(dram)
    change(bad)
    checked = check_plans([dram, bad], REGIONS, 3)
    assert isinstance(checked[1], PlanRejected) and re.search(message, str(checked[1]))
    assert not isinstance(checked[0], PlanRejected)


# --------------------------------------------------------------------------- through NIXL


class TamperingProxy:
    """A gRPC endpoint that forwards every unary call to ``target`` as bytes and passes each
    ``GetTransferPlan`` answer through ``tamper`` (as a compromised or buggy broker would)."""

    def __init__(self, target: str) -> None:
        self.tamper: Callable[[pb.GetTransferPlanResponse], None] = lambda plan: None
        options = [
            ("grpc.max_receive_message_length", LIMITS.max_request_bytes),
            ("grpc.max_send_message_length", LIMITS.max_request_bytes),
        ]
        self._channel = grpc.insecure_channel(target, options=options)
        self._server = grpc.server(ThreadPoolExecutor(4), options=options)
        self._server.add_generic_rpc_handlers([self])
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        forward = self._channel.unary_unary(method)

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                reply = forward(request, timeout=10)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details())
            if method.endswith("/GetTransferPlan"):
                plan = pb.GetTransferPlanResponse.FromString(reply)
                self.tamper(plan)
                reply = plan.SerializeToString()
            return reply

        return (
            None
            if method.endswith("/WatchReleases")
            else grpc.unary_unary_rpc_method_handler(handle)
        )

    def close(self) -> None:
        self._server.stop(0)
        self._channel.close()


@pytest.fixture
def nixl_agent_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """``(agent name, method)`` of every ``read`` and ``add_remote`` NIXL is asked for."""
    require_module("nixl", "engine")
    from clients.nixl_transport import NixlAgent

    calls: list[tuple[str, str]] = []
    for name in ("read", "add_remote"):
        original = getattr(NixlAgent, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append((self.name, _name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(NixlAgent, name, spy)
    return calls


@pytest.fixture
def broker() -> Iterator[str]:
    require_module("nixl", "engine")
    from harness.brokers import BrokerProcess

    process = BrokerProcess()
    try:
        yield process.address
    finally:
        process.stop()


def _out_of_region(plan: pb.GetTransferPlanResponse) -> None:
    """Move the plan's last write to just past the end of the region it lies in."""
    rows = np.frombuffer(plan.sources[-1].local_descriptors, dtype="<i8").reshape(-1, 3).copy()
    rows[-1, 0] += 1 << 40
    plan.sources[-1].local_descriptors = pack(rows)


def _one_byte_more(plan: pb.GetTransferPlanResponse) -> None:
    plan.total_bytes += 1


@pytest.mark.parametrize(
    "tamper,message",
    [
        (_out_of_region, "'s registered regions"),
        (_one_byte_more, "descriptors add up to"),
    ],
    ids=["write outside the regions", "total one byte more"],
)
def test_a_tampered_plan_is_refused_before_nixl_and_reported_failed(
    broker: str, nixl_agent_calls: list[tuple[str, str]], tamper, message: str
) -> None:
    from test_e2e import PAIRS

    from clients.decode import AsyncDecodeClient, FetchError
    from clients.prefill import AsyncPrefillClient
    from harness.pattern import (
        POISON,
        Contents,
        check_decode,
        decode_limits,
        fill_prefill,
        host_memory,
    )
    from harness.scenarios import block_counts

    prefill, decode = PAIRS[1].layouts(inflight=1)  # FA+Mamba2 P1 -> D2
    p_mem = host_memory(prefill)
    d_mem = host_memory(decode, POISON)
    tokens = 150
    counts = block_counts(prefill, tokens)
    blocks = [list(range(sum(counts[:g]), sum(counts[: g + 1]))) for g in range(len(counts))]
    contents_p, contents_d = Contents(prefill), Contents(decode)
    for rank in prefill.ranks:
        fill_prefill(contents_p, rank, p_mem[rank.tp_rank], blocks, salt=9)
    proxy = TamperingProxy(broker)

    async def scenario() -> None:
        async with (
            AsyncPrefillClient(broker, "p", prefill, p_mem) as p,
            AsyncDecodeClient(proxy.address, "d", decode, d_mem) as d,
        ):
            decode_agents = {s.agent.name for s in d.sessions.values()}
            await p.publish("bad", blocks, tokens)
            proxy.tamper = tamper
            with pytest.raises(FetchError) as refused:
                await d.fetch("bad", blocks)
            # Each rank refuses the plan it was given; a rank that asks after another one's
            # refusal failed the transfer is refused by the broker instead.
            rejected = []
            for rank in decode.ranks:
                error = refused.value.errors[rank.tp_rank]
                if isinstance(error, PlanRejected):
                    assert message in str(error), error
                    rejected.append(rank.tp_rank)
                else:
                    assert "is failed; its blocks are released" in str(error), error
            assert rejected
            assert [c for c in nixl_agent_calls if c[0] in decode_agents] == []
            assert all((region == POISON).all() for regions in d_mem.values() for region in regions)

            # The broker recorded each rank's refusal as its FAILED report, with the reason.
            with grpc.insecure_channel(broker) as channel:
                from broker.v1 import broker_pb2_grpc as pb_grpc

                info = pb_grpc.BrokerStub(channel).GetTransfer(
                    pb.GetTransferRequest(transfer_id="bad"), timeout=10
                )
            assert info.state == pb.TRANSFER_STATE_FAILED
            reports = [e.detail for e in info.timeline if e.event == "reported"]
            assert len(reports) == len(rejected) and all(message in r for r in reports), reports

            # The same client reads an honest plan afterwards, every byte as its layout says.
            proxy.tamper = lambda plan: None
            await p.publish("good", blocks, tokens)
            fetch = await d.fetch("good", blocks)
            limits = decode_limits(prefill, decode, tokens, [len(ids) for ids in blocks])
            for rank in decode.ranks:
                assert (
                    check_decode(contents_d, rank, d_mem[rank.tp_rank], blocks, 9, limits)[0] == 0
                )
            assert fetch.nbytes > 0
            assert {c[1] for c in nixl_agent_calls if c[0] in decode_agents} == {
                "read",
                "add_remote",
            }

    try:
        asyncio.run(scenario())
    finally:
        proxy.close()
