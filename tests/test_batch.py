"""Batched decode calls (GetTransferPlans, ReportTransfers) at the gRPC edge: every entry
answered as the unary call would answer it alone, in order, one refused entry leaving the
others alone; duplicates inside a batch; the limits per call and per entry; the shared answer
budget (an entry too large is refused before it is handed out and the client fetches it
streamed); the client's calls. Authorization per entry is in tests/test_security.py, bytes
moved through batched calls in tests/test_e2e.py."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from broker_helpers import hybrid
from test_server import (  # noqa: F401 - broker: the live gRPC broker fixture
    WAIT_S,
    Broker,
    block_ids,
    broker,
    plan_request,
    publish_request,
    register,
)

from broker import batched, convert
from broker.limits import LIMITS
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.wire import Role
from clients import protocol
from clients.transport import DRAM, VRAM, fake_memory
from harness.scenarios import Scenario, build_scenario

#: Every test runs against the in-memory store and against Redis (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_store")
CODE = {code.name: code.value[0] for code in grpc.StatusCode}


def two_by_two(broker: Broker, *transfer_ids: str) -> Scenario:  # noqa: F811
    """P and D, both TP2, registered; ``transfer_ids`` published by P."""
    sc = build_scenario(hybrid(), 2, 2, 100)
    register(broker.stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    register(broker.stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    for transfer_id in transfer_ids:
        broker.stub.PublishBlocks(publish_request(transfer_id, sc.request), timeout=WAIT_S)
    return sc


def entry(
    transfer_id: str, rank: int, sc: Scenario, engine_id: str = ""
) -> pb.GetTransferPlanRequest:
    return plan_request(transfer_id, rank, sc.request, engine_id)


def done(
    plan: pb.GetTransferPlanResponse, rank: int, engine_id: str = ""
) -> pb.ReportTransferRequest:
    return pb.ReportTransferRequest(
        plan_id=plan.plan_id,
        engine_id=engine_id,
        tp_rank=rank,
        status=pb.REPORT_STATUS_DONE,
        bytes_moved=plan.total_bytes,
    )


def without_metadata(plan: pb.GetTransferPlanResponse) -> pb.GetTransferPlanResponse:
    copy = pb.GetTransferPlanResponse()
    copy.CopyFrom(plan)
    for source in copy.sources:
        source.remote_agent_metadata = b""
    return copy


def plans(broker: Broker, *entries: pb.GetTransferPlanRequest) -> list[pb.TransferPlanResult]:  # noqa: F811
    request = pb.GetTransferPlansRequest(engine_id="D", entries=entries)
    return list(broker.stub.GetTransferPlans(request, timeout=WAIT_S).results)


def test_each_entry_is_answered_alone_and_as_the_unary_call_answers_it(broker: Broker) -> None:  # noqa: F811
    sc = two_by_two(broker, "t1", "t2")
    other_ids = [[i + 1 for i in g] for g in sc.request.decode_block_ids]
    results = plans(
        broker,
        entry("t1", 0, sc),
        entry("t1", 1, sc, "D"),  # naming the call's engine is allowed
        entry("nope", 0, sc),
        entry("t1", 0, sc),  # a duplicate: the same plan again
        entry("", 1, sc),
        entry("t2", 0, sc, "X"),  # another engine than the call's
        pb.GetTransferPlanRequest(transfer_id="t1", tp_rank=0, block_ids=block_ids(other_ids)),
        entry("t2", 7, sc),
        entry("t2", 1, sc),
    )
    codes = [r.code for r in results]
    assert codes == [
        0,
        0,
        CODE["NOT_FOUND"],
        0,
        CODE["INVALID_ARGUMENT"],
        CODE["INVALID_ARGUMENT"],
        CODE["ALREADY_EXISTS"],
        CODE["INVALID_ARGUMENT"],
        0,
    ]
    assert results[2].message == "entries[2].transfer_id: no transfer 'nope'"
    assert results[4].message.startswith("entries[4].transfer_id: ")
    assert results[5].message.startswith("entries[5].engine_id: 'X' is not the call's")
    assert results[6].message.startswith("entries[6].block_ids: ")
    assert results[7].message.startswith("entries[7].tp_rank: ")
    assert not results[0].message and not results[2].HasField("plan")
    first, second, repeated = results[0].plan, results[1].plan, results[3].plan
    # Agent metadata comes with a rank's first contact with a prefill agent only.
    assert all(s.remote_agent_metadata for s in first.sources)
    assert not any(s.remote_agent_metadata for s in repeated.sources)
    assert repeated == without_metadata(first) and first.plan_id != second.plan_id
    # The unary call answers a rank the batch was handed exactly as the batch did.
    unary = broker.stub.GetTransferPlan(plan_request("t1", 1, sc.request), timeout=WAIT_S)
    assert unary == without_metadata(second)
    unary = broker.stub.GetTransferPlan(plan_request("t2", 0, sc.request), timeout=WAIT_S)
    assert plans(broker, entry("t2", 0, sc))[0].plan == unary
    for plan in (first, second, unary):
        assert plan.total_bytes > 0 and plan.sources and plan.traceparent == ""


def test_entries_of_one_transfer_asked_together_are_each_answered_as_alone(broker: Broker) -> None:  # noqa: F811
    """Adjacent entries of one transfer (handed out in one unit of work) among entries of
    others: each answered as on its own, a rank twice, a refused entry inside the group."""
    sc = two_by_two(broker, "a", "b", "c")
    results = plans(
        broker,
        entry("a", 0, sc),
        entry("a", 1, sc),
        entry("a", 1, sc),  # a duplicate inside the group
        entry("b", 1, sc),  # another transfer, ranks in reverse
        entry("b", 0, sc),
        entry("c", 0, sc),
        entry("c", 5, sc),  # refused, between two entries of its transfer
        entry("c", 1, sc),
    )
    assert [r.code for r in results] == [0, 0, 0, 0, 0, 0, CODE["INVALID_ARGUMENT"], 0]
    assert results[6].message.startswith("entries[6].tp_rank: ")
    a0, a1, a1_again, b1, b0, c0, _, c1 = (r.plan for r in results)
    # One claim per transfer: its ranks' plan ids share it; metadata with first contacts only.
    assert a0.plan_id.rsplit("-", 1)[0] == a1.plan_id.rsplit("-", 1)[0] != b0.plan_id[:-2]
    assert all(s.remote_agent_metadata for p in (a0, a1) for s in p.sources)
    assert a1_again == without_metadata(a1)
    assert not any(s.remote_agent_metadata for p in (b0, b1, c0, c1) for s in p.sources)
    # Every plan was handed out by the batch, and can be reported.
    for transfer_id in "abc":
        state = broker.stub.GetTransfer(
            pb.GetTransferRequest(transfer_id=transfer_id), timeout=WAIT_S
        )
        assert [p.handed_out for p in state.plans] == [True, True]
    # Each plan is the one the unary call answers for that transfer and rank.
    for transfer_id, rank, plan in (("a", 0, a0), ("a", 1, a1), ("b", 0, b0), ("b", 1, b1)):
        unary = broker.stub.GetTransferPlan(
            plan_request(transfer_id, rank, sc.request), timeout=WAIT_S
        )
        assert unary == without_metadata(plan) and unary.total_bytes > 0
    reports = [done(p, rank) for p, rank in ((a0, 0), (a1, 1), (b1, 1), (b0, 0), (c0, 0), (c1, 1))]
    request = pb.ReportTransfersRequest(engine_id="D", reports=reports)
    outcomes = broker.stub.ReportTransfers(request, timeout=WAIT_S).results
    assert [r.code for r in outcomes] == [0] * 6


def test_entries_grouped_for_one_unit_of_work() -> None:
    """Runs of adjacent entries of one transfer (and publisher) for the call's engine, each
    small, at most ``GROUP_ENTRIES``; an entry that is not alike starts the next group."""
    names = ["a", "a", "b", "a", "a", "a", "c", "c"] + ["d"] * (convert.GROUP_ENTRIES + 1)
    entries = [pb.GetTransferPlanRequest(transfer_id=n) for n in names]
    entries[4].engine_id = "X"  # another engine than the call's
    entries[5].prefill_engine_id = "P"
    counts = [1] * len(entries)
    counts[7] = 5  # too many block ids to plan in place

    def groups() -> list[int]:
        ends, start = [], 0
        while start < len(entries):
            start = convert.alike_entries(entries, counts, start, "D", 4)
            ends.append(start)
        return ends

    assert groups() == [2, 3, 4, 5, 6, 7, 8, 8 + convert.GROUP_ENTRIES, len(entries)]
    entries[4].engine_id = "D"  # naming the call's engine is alike
    assert groups()[:3] == [2, 3, 5]


def test_a_ticket_is_written_into_the_answer_as_its_plan_result_would_be() -> None:
    """The batched answer is written from a ticket's descriptors (:func:`convert.ticket_to_proto`)
    exactly as its :class:`PlanResult` (:func:`convert.plan_to_proto`) is: a decode rank
    reading two prefill ranks, prefill memory in DRAM and decode memory in VRAM."""
    sc = build_scenario(hybrid(), 2, 1, 100)
    service = BrokerService()
    for layout, engine_id, role, kind in (
        (sc.prefill, "P", Role.PREFILL, DRAM),
        (sc.decode, "D", Role.DECODE, VRAM),
    ):
        for rank, regions in fake_memory(layout, 1 << 40 if kind == VRAM else 1 << 30).items():
            regions = tuple(dataclasses.replace(r, kind=kind) for r in regions)
            service.register_rank(
                convert.registration_from_proto(
                    protocol.registration(
                        layout.ranks[rank],
                        regions,
                        engine_id=engine_id,
                        role=role,
                        tp_size=layout.tp_size,
                        agent_name=f"{engine_id}-{rank}",
                        agent_metadata=b"m" * (rank + 1),
                        model_fingerprint=layout.model,
                    )
                )
            )
    service.publish(convert.publication_from_proto(publish_request("t", sc.request), ""))
    queries = convert.plan_queries_alike([entry("t", 0, sc, "D"), entry("t", 0, sc, "D")])
    assert queries is not None
    tickets = service.plan_group(queries, 1 << 30, 1 << 20)
    assert tickets is not None
    for ticket in tickets:  # the rank's first contacts with metadata, then without
        written = pb.GetTransferPlanResponse()
        convert.ticket_to_proto(ticket, written)
        expected = convert.plan_to_proto(ticket.result())
        assert written.SerializeToString() == expected.SerializeToString()
        assert [s.prefill_rank for s in written.sources] == [0, 1]
        assert {s.local_memory_kind for s in written.sources} == {pb.MEMORY_KIND_VRAM}
        assert {s.remote_memory_kind for s in written.sources} == {pb.MEMORY_KIND_DRAM}
        assert written.total_bytes == sum(s.total_bytes for s in written.sources) > 0
        assert written.num_descriptors == sum(s.num_descriptors for s in written.sources)
    assert [bool(s.agent_metadata) for t in tickets for s in t.sources] == [1, 1, 0, 0]


def test_reports_are_recorded_each_on_its_own(broker: Broker) -> None:  # noqa: F811
    sc = two_by_two(broker, "t1", "t2", "t3")
    t1_0, t1_1, t2_0, t3_0 = (
        r.plan
        for r in plans(
            broker, *(entry(t, k, sc) for t, k in (("t1", 0), ("t1", 1), ("t2", 0), ("t3", 0)))
        )
    )
    broker.stub.AbortTransfer(
        pb.AbortTransferRequest(transfer_id="t3", reason="gone"), timeout=WAIT_S
    )
    failed = pb.ReportTransferRequest(
        plan_id=t2_0.plan_id, tp_rank=0, status=pb.REPORT_STATUS_FAILED, error="link down"
    )
    request = pb.ReportTransfersRequest(
        engine_id="D",
        reports=[
            done(t1_0, 0),
            done(t1_1, 1, "D"),
            done(t1_0, 0),  # a repetition: recorded once, answered duplicate
            pb.ReportTransferRequest(plan_id="nope", tp_rank=0, status=pb.REPORT_STATUS_DONE),
            done(t3_0, 0),  # its transfer ended while the rank read
            failed,
            done(t2_0, 0, "X"),
        ],
    )
    results = broker.stub.ReportTransfers(request, timeout=WAIT_S).results
    assert [r.code for r in results] == [
        0,
        0,
        0,
        CODE["NOT_FOUND"],
        CODE["ABORTED"],
        0,
        CODE["INVALID_ARGUMENT"],
    ]
    one, two, again = (results[i].outcome for i in range(3))
    assert one.intact and not one.duplicate and one.state == pb.TRANSFER_STATE_IN_PROGRESS
    assert two.intact and two.state == pb.TRANSFER_STATE_COMPLETED
    assert again.duplicate and again.intact
    assert results[3].message == "reports[3].plan_id: no plan 'nope'"
    assert results[4].message.startswith("reports[4].")
    assert results[5].outcome.state == pb.TRANSFER_STATE_FAILED and not results[5].outcome.intact
    assert results[6].message.startswith("reports[6].engine_id: ")
    states = {
        t: broker.stub.GetTransfer(pb.GetTransferRequest(transfer_id=t), timeout=WAIT_S).state
        for t in ("t1", "t2", "t3")
    }
    assert states == {
        "t1": pb.TRANSFER_STATE_COMPLETED,
        "t2": pb.TRANSFER_STATE_FAILED,
        "t3": pb.TRANSFER_STATE_ABORTED,
    }


def test_limits_of_a_call(broker: Broker) -> None:  # noqa: F811
    sc = two_by_two(broker, "t1")
    stub = broker.stub
    too_many = pb.GetTransferPlansRequest(
        engine_id="D", entries=[entry("t1", 0, sc)] * (LIMITS.max_batch_entries + 1)
    )
    for call, request, field in (
        (stub.GetTransferPlans, too_many, "entries"),
        (
            stub.ReportTransfers,
            pb.ReportTransfersRequest(
                engine_id="D",
                reports=[pb.ReportTransferRequest(plan_id="p")] * (LIMITS.max_batch_entries + 1),
            ),
            "reports",
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=WAIT_S)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details().startswith(f"{field}: "), err.value.details()
    # Block ids count over all entries, as one request's do.
    group = pb.BlockIds(ids=range(LIMITS.max_block_ids // 2 + 1))
    heavy = pb.GetTransferPlanRequest(transfer_id="t1", block_ids=[group])
    with pytest.raises(grpc.RpcError) as err:
        stub.GetTransferPlans(
            pb.GetTransferPlansRequest(engine_id="D", entries=[heavy, heavy]), timeout=WAIT_S
        )
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("entries: ") and "block ids" in err.value.details()
    for request, code in (
        (
            pb.GetTransferPlansRequest(engine_id="", entries=[entry("t1", 0, sc)]),
            "INVALID_ARGUMENT",
        ),
        (
            pb.GetTransferPlansRequest(engine_id="D" * (LIMITS.max_id_chars + 1)),
            "INVALID_ARGUMENT",
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.GetTransferPlans(request, timeout=WAIT_S)
        assert err.value.code().name == code and err.value.details().startswith("engine_id: ")
    # An empty batch is answered empty; an unknown engine is each entry's NOT_FOUND.
    assert not stub.GetTransferPlans(
        pb.GetTransferPlansRequest(engine_id="D"), timeout=WAIT_S
    ).results
    (unknown,) = stub.GetTransferPlans(
        pb.GetTransferPlansRequest(engine_id="Q", entries=[entry("t1", 0, sc)]), timeout=WAIT_S
    ).results
    assert unknown.code == CODE["NOT_FOUND"] and unknown.message.startswith(
        "entries[0].engine_id: "
    )


def test_plans_share_one_answer_budget_and_the_client_streams_what_does_not_fit(
    broker: Broker,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sc = two_by_two(broker, "t1")
    alone = broker.stub.GetTransferPlan(plan_request("t1", 0, sc.request), timeout=WAIT_S)
    budget = alone.ByteSize() + 100  # room for one plan of this size, not two
    monkeypatch.setattr(batched, "LIMITS", dataclasses.replace(LIMITS, max_unary_plan_bytes=budget))
    fits, refused = plans(broker, entry("t1", 0, sc), entry("t1", 1, sc))
    assert fits.plan == without_metadata(alone)
    assert refused.code == CODE["RESOURCE_EXHAUSTED"]
    assert (
        refused.message.startswith("entries[1].plan: ") and "StreamTransferPlan" in refused.message
    )
    # Refused before it was handed out: nothing of rank 1 can be reported yet.
    state = broker.stub.GetTransfer(pb.GetTransferRequest(transfer_id="t1"), timeout=WAIT_S)
    assert [p.handed_out for p in state.plans] == [True, False]

    async def as_client() -> list:
        stub = protocol.FailoverStub(broker.address)
        try:
            return await protocol.get_plans(
                stub, "D", [entry("t1", 0, sc), entry("t1", 1, sc), entry("t9", 0, sc)], WAIT_S
            )
        finally:
            await stub.close()

    first, streamed, unknown = asyncio.run(as_client())
    assert first == without_metadata(alone)
    again = broker.stub.GetTransferPlan(plan_request("t1", 1, sc.request), timeout=WAIT_S)
    assert without_metadata(streamed) == again and streamed.total_bytes > 0
    assert isinstance(unknown, protocol.BrokerCallError)
    assert unknown.code is grpc.StatusCode.NOT_FOUND and unknown.field == "entries[2].transfer_id"
