"""The ``EngineSession`` stream at the gRPC edge and in the decode client: each message
answered in order with its sequence, exactly as the call it carries (per-entry answers,
whole-message refusals, authorization per message under mutual TLS), the bound on open
streams; the decode client's exchanges over it, its fallback to the unary calls when a
replica dies mid-session or the broker predates the stream."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from broker_helpers import hybrid
from conftest import RedisServer
from prerequisites import require_module
from test_security import (  # noqa: F401 - pki, mtls_broker: the mutual-TLS broker fixtures
    DENIED,
    NOT_FOUND,
    Pki,
    mtls_broker,
    pki,
    plan,
    publish,
    register,
    report,
    stub,
)
from test_server import (  # noqa: F401 - broker: the live gRPC broker fixture
    WAIT_S,
    Broker,
    block_ids,
    broker,
    plan_request,
    publish_request,
)
from test_server import register as register_all

from broker.config import ServiceConfig
from broker.limits import LIMITS
from broker.server import BrokerServer
from broker.service import BrokerService
from broker.servicer import BrokerServicer
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from clients import engine_session
from clients.decode import AsyncDecodeClient
from clients.fetches import Fetch, FetchAsk, PlanAsk, PlanReport
from clients.prefill import AsyncPrefillClient
from clients.protocol import BrokerCallError
from clients.transport import NoMemoryTransport, fake_memory
from harness.brokers import BrokerProcess
from harness.scenarios import Scenario, build_scenario

CODE = {code.name: code.value[0] for code in grpc.StatusCode}
SCENARIO: Scenario = build_scenario(hybrid(), 2, 2, 100)
PLAN_ID = re.compile(r"[0-9a-f]{20}-\d+")


def session(broker: Broker, *messages: pb.EngineSessionRequest) -> list[pb.EngineSessionResponse]:  # noqa: F811
    """The answers to ``messages`` sent on one stream."""
    return list(broker.stub.EngineSession(iter(messages), timeout=WAIT_S))


def plans_message(sequence: int, *entries: pb.GetTransferPlanRequest) -> pb.EngineSessionRequest:
    request = pb.GetTransferPlansRequest(engine_id="D", entries=entries)
    return pb.EngineSessionRequest(sequence=sequence, get_transfer_plans=request)


def reports_message(sequence: int, *reports: pb.ReportTransferRequest) -> pb.EngineSessionRequest:
    request = pb.ReportTransfersRequest(engine_id="D", reports=reports)
    return pb.EngineSessionRequest(sequence=sequence, report_transfers=request)


def entries(a: str, b: str) -> list[pb.GetTransferPlanRequest]:
    """A batch over transfers ``a`` and ``b``: plans, a duplicate, refused entries."""
    ids = SCENARIO.request.decode_block_ids
    other_ids = [[i + 1 for i in g] for g in ids]
    return [
        plan_request(a, 0, SCENARIO.request, ""),
        plan_request("nope", 0, SCENARIO.request, ""),
        plan_request(a, 0, SCENARIO.request, ""),  # a duplicate: the same plan again
        plan_request(b, 0, SCENARIO.request, "X"),  # another engine than the call's
        pb.GetTransferPlanRequest(transfer_id=a, tp_rank=0, block_ids=block_ids(other_ids)),
        plan_request(b, 7, SCENARIO.request, ""),
        plan_request(b, 1, SCENARIO.request, ""),
    ]


def done(plan_id: str, rank: int) -> pb.ReportTransferRequest:
    return pb.ReportTransferRequest(
        plan_id=plan_id, tp_rank=rank, status=pb.REPORT_STATUS_DONE, bytes_moved=0
    )


def bare(plan: pb.GetTransferPlanResponse) -> pb.GetTransferPlanResponse:
    """``plan`` without what differs between two transfers asked alike: its id (in its
    notifications too) and the agents' metadata (sent at first contact only)."""
    copy = pb.GetTransferPlanResponse()
    copy.CopyFrom(plan)
    copy.plan_id = ""
    for source in copy.sources:
        source.remote_agent_metadata, source.notification = b"", b""
    return copy


def alike(results: Sequence, names: dict[str, str]) -> list:
    """Batched results without what differs between two transfers asked alike: the plans
    :func:`bare`, plan ids left out of messages, transfer ids in them renamed by
    ``names``."""
    out = []
    for result in results:
        copy = type(result)()
        copy.CopyFrom(result)
        if isinstance(copy, pb.TransferPlanResult) and copy.HasField("plan"):
            copy.plan.CopyFrom(bare(copy.plan))
        copy.message = PLAN_ID.sub("<plan>", copy.message)
        for old, new in names.items():
            copy.message = copy.message.replace(f"'{old}'", f"'{new}'")
        out.append(copy)
    return out


def two_by_two(broker: Broker, *transfer_ids: str) -> None:  # noqa: F811
    register_all(broker.stub, SCENARIO.prefill, "P", pb.ROLE_PREFILL, 0)
    register_all(broker.stub, SCENARIO.decode, "D", pb.ROLE_DECODE, 1)
    for transfer_id in transfer_ids:
        broker.stub.PublishBlocks(publish_request(transfer_id, SCENARIO.request), timeout=WAIT_S)


@pytest.mark.usefixtures("default_store")
def test_each_message_is_answered_in_order_as_its_call_answers_it(broker: Broker) -> None:  # noqa: F811
    """The same batches on analogous transfers, one way each: unary calls (t1, t2) and
    session messages (s1, s2), answered alike entry by entry; sequences echoed in order."""
    two_by_two(broker, "t1", "t2", "s1", "s2")
    unary = broker.stub.GetTransferPlans(
        pb.GetTransferPlansRequest(engine_id="D", entries=entries("t1", "t2")), timeout=WAIT_S
    ).results
    planned, reported = session(
        broker,
        plans_message(9, *entries("s1", "s2")),
        reports_message(3),  # its reports are sent below, once the plans are known
    )
    assert (planned.sequence, reported.sequence) == (9, 3)
    assert planned.WhichOneof("response") == "get_transfer_plans"
    streamed = planned.get_transfer_plans.results
    assert [r.code for r in streamed] == [
        0,
        CODE["NOT_FOUND"],
        0,
        CODE["INVALID_ARGUMENT"],
        CODE["ALREADY_EXISTS"],
        CODE["INVALID_ARGUMENT"],
        0,
    ]
    assert alike(streamed, {"s1": "t1", "s2": "t2"}) == alike(unary, {})
    assert reported.WhichOneof("response") == "report_transfers"
    assert not reported.report_transfers.results

    def reports(results: Sequence[pb.TransferPlanResult]) -> list[pb.ReportTransferRequest]:
        first, last = results[0].plan.plan_id, results[6].plan.plan_id
        return [done(first, 0), done(first, 0), done("no-such-plan", 0), done(last, 1)]

    unary_outcomes = broker.stub.ReportTransfers(
        pb.ReportTransfersRequest(engine_id="D", reports=reports(unary)), timeout=WAIT_S
    ).results
    (answer,) = session(broker, reports_message(1 << 63, *reports(streamed)))
    assert answer.sequence == 1 << 63
    outcomes = answer.report_transfers.results
    assert [(r.code, r.outcome.duplicate) for r in outcomes] == [
        (0, False),
        (0, True),  # a duplicate inside a message: answered as a repeat
        (CODE["NOT_FOUND"], False),
        (0, False),
    ]
    assert alike(outcomes, {}) == alike(unary_outcomes, {})


@pytest.mark.usefixtures("default_store")
def test_a_refused_message_answers_its_sequence_and_the_stream_goes_on(broker: Broker) -> None:  # noqa: F811
    """Too many entries, another engine's reports, a message naming no call: each is answered
    with the status its call ends with (or would), the next message as usual."""
    two_by_two(broker, "t1")
    too_many = [plan_request("t1", 0, SCENARIO.request, "")] * (LIMITS.max_batch_entries + 1)
    nobody = pb.ReportTransfersRequest(reports=[done("p", 0)])  # names no engine
    answers = session(
        broker,
        plans_message(1, *too_many),
        pb.EngineSessionRequest(sequence=2, report_transfers=nobody),
        pb.EngineSessionRequest(sequence=3),
        plans_message(4, plan_request("t1", 0, SCENARIO.request, "")),
    )
    assert [a.sequence for a in answers] == [1, 2, 3, 4]
    assert [a.WhichOneof("response") for a in answers] == ["error"] * 3 + ["get_transfer_plans"]
    for answer, call, request in (
        (answers[0], broker.stub.GetTransferPlans, plans_message(0, *too_many).get_transfer_plans),
        (answers[1], broker.stub.ReportTransfers, nobody),
    ):
        with pytest.raises(grpc.RpcError) as unary:
            call(request, timeout=WAIT_S)
        status = (unary.value.code().value[0], unary.value.details())
        assert (answer.error.code, answer.error.message) == status
    assert answers[0].error.code == CODE["RESOURCE_EXHAUSTED"]
    assert answers[0].error.message.startswith("entries: ")
    assert answers[1].error.code == CODE["INVALID_ARGUMENT"]
    assert answers[1].error.message.startswith("engine_id: ")
    assert answers[2].error.code == CODE["INVALID_ARGUMENT"]
    assert answers[2].error.message.startswith("request: ")
    (result,) = answers[3].get_transfer_plans.results
    assert result.code == 0 and result.plan.total_bytes > 0


def test_each_message_is_authorized_as_its_call_would_be(pki: Pki, mtls_broker: str) -> None:  # noqa: F811
    """Mutual TLS: a stream opened as D may speak only for D: a message naming D2 is refused
    PERMISSION_DENIED, the next one is served, each entry authorized on its own."""
    p, d, d2 = (stub(mtls_broker, pki.mtls(c)) for c in ("P", "D", "D2"))
    register(p, "P", pb.ROLE_PREFILL, 0)
    register(d, "D", pb.ROLE_DECODE, 1)
    register(d2, "D2", pb.ROLE_DECODE, 2)
    for transfer_id, allowed in (("st1", ("D",)), ("st2", ("D2",))):
        p.PublishBlocks(publish(transfer_id, allowed=allowed), timeout=WAIT_S)

    def plans(engine_id: str, sequence: int, *transfer_ids: str) -> pb.EngineSessionRequest:
        request = pb.GetTransferPlansRequest(
            engine_id=engine_id, entries=[plan(t, "") for t in transfer_ids]
        )
        return pb.EngineSessionRequest(sequence=sequence, get_transfer_plans=request)

    (theirs,) = d2.GetTransferPlans(plans("D2", 0, "st2").get_transfer_plans).results
    stolen_report = pb.ReportTransfersRequest(
        engine_id="D", reports=[report(theirs.plan.plan_id, "")]
    )
    denied, served, stolen = d.EngineSession(
        iter(
            [
                plans("D2", 1, "st2"),
                plans("D", 2, "st1", "st2"),
                pb.EngineSessionRequest(sequence=3, report_transfers=stolen_report),
            ]
        ),
        timeout=WAIT_S,
    )
    assert denied.error.code == DENIED.value[0]
    assert denied.error.message.startswith("engine_id: ")
    mine, not_mine = served.get_transfer_plans.results
    assert mine.code == 0 and mine.plan.total_bytes
    assert (not_mine.code, not_mine.message) == (
        NOT_FOUND.value[0],
        "entries[1].transfer_id: no transfer 'st2'",
    )
    (refused,) = stolen.report_transfers.results
    assert refused.code == DENIED.value[0] and refused.message.startswith("reports[0].plan_id: ")


@contextlib.asynccontextmanager
async def serving(**config: int) -> AsyncIterator[BrokerServer]:
    """A broker on this event loop."""
    server = BrokerServer(BrokerService(config=ServiceConfig(**config)), "127.0.0.1:0")
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


def test_open_streams_are_bounded() -> None:
    """``--max-session-streams 2``: a third stream is refused RESOURCE_EXHAUSTED naming the
    flag; once one ends, another opens."""

    async def scenario() -> None:
        async with (
            serving(max_session_streams=2) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            broker = pb_grpc.BrokerStub(channel)

            async def opened() -> grpc.aio.StreamStreamCall:
                stream = broker.EngineSession(timeout=WAIT_S)
                await stream.write(pb.EngineSessionRequest(sequence=1))
                answer = await stream.read()
                assert answer.sequence == 1 and answer.error.message.startswith("request: ")
                return stream

            first, _ = await opened(), await opened()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await opened()
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-session-streams" in (refused.value.details() or "")
            await first.done_writing()
            assert await first.read() is grpc.aio.EOF
            await opened()

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def engines(
    target: str, *, session_stream: bool = True, decode_id: str = "D"
) -> AsyncIterator[tuple[AsyncPrefillClient, AsyncDecodeClient]]:
    """Prefill P and decode ``decode_id`` (both TP2) over the no-memory transport."""
    transport = NoMemoryTransport()
    async with (
        AsyncPrefillClient(
            target,
            "P",
            SCENARIO.prefill,
            fake_memory(SCENARIO.prefill, 1 << 44),
            transport=transport,
        ) as prefill,
        AsyncDecodeClient(
            target,
            decode_id,
            SCENARIO.decode,
            fake_memory(SCENARIO.decode, 1 << 45),
            transport=transport,
            session_stream=session_stream,
        ) as decode,
    ):
        yield prefill, decode


async def published(prefill: AsyncPrefillClient, *transfer_ids: str) -> None:
    request = SCENARIO.request
    for transfer_id in transfer_ids:
        await prefill.publish(transfer_id, request.prefill_block_ids, request.num_tokens)


def asks(*transfer_ids: str) -> list[PlanAsk]:
    ids = SCENARIO.request.decode_block_ids
    return [PlanAsk(rank, t, ids) for t in transfer_ids for rank in (0, 1)]


def test_the_decode_client_gets_over_the_stream_what_unary_calls_give() -> None:
    """Plans asked on the session stream (one open while the client is) equal the unary
    call's for the same requests; ``fetch_many`` over the stream reads and reports."""

    async def scenario() -> None:
        async with serving() as server, engines(server.address) as (prefill, decode):
            await published(prefill, "t1", "t2", "t3")
            streamed = await decode.plans(asks("t1", "t2"))
            servicer = server._servicer
            assert isinstance(servicer, BrokerServicer) and servicer.sessions_open == 1
            ids = SCENARIO.request.decode_block_ids
            unary = await decode.stub.GetTransferPlans(
                pb.GetTransferPlansRequest(
                    engine_id="D",
                    entries=[
                        pb.GetTransferPlanRequest(
                            transfer_id=a.transfer_id, tp_rank=a.tp_rank, block_ids=block_ids(ids)
                        )
                        for a in asks("t1", "t2")
                    ],
                ),
                timeout=WAIT_S,
            )
            assert [bare(p) for p in streamed] == [r.plan for r in alike(unary.results, {})]
            (fetch,) = await decode.fetch_many([FetchAsk("t3", ids)])
            assert isinstance(fetch, Fetch) and fetch.nbytes > 0
        assert servicer.sessions_open == 0

    asyncio.run(scenario())


class _Calls(grpc.aio.ServerInterceptor):
    """Records the method of every call the server receives."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation, details):
        self.methods.append(details.method.rsplit("/", 1)[-1])
        return await continuation(details)


@contextlib.asynccontextmanager
async def unary_only(
    servicer: BrokerServicer, calls: _Calls, **more: grpc.RpcMethodHandler
) -> AsyncIterator[str]:
    """A server of ``servicer``'s unary calls (and the ``more`` handlers by method) on this
    event loop, recording every call in ``calls``; yields its address."""
    server = grpc.aio.server(interceptors=(calls,))
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=getattr(pb, m.input_type.name).FromString,
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
        for m in pb.DESCRIPTOR.services_by_name["Broker"].methods
        if not (m.client_streaming or m.server_streaming)
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdbroker.v1.Broker", handlers | more),)
    )
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield address
    finally:
        await server.stop(0)


def test_a_broker_without_the_stream_is_asked_with_unary_calls() -> None:
    """A broker serving the unary calls only (the servicer of this one, without the stream)
    answers the stream UNIMPLEMENTED: the exchange is made as the unary call, and every
    later one too, without asking for the stream again."""

    async def scenario() -> list[str]:
        calls = _Calls()
        servicer = BrokerServicer(BrokerService())
        try:
            async with (
                unary_only(servicer, calls) as address,
                engines(address) as (prefill, decode),
            ):
                await published(prefill, "t1", "t2")
                for transfer_id in ("t1", "t2"):
                    plans = await decode.plans(asks(transfer_id))
                    assert not any(isinstance(p, BrokerCallError) for p in plans)
                    outcomes = await decode.report_many(
                        [PlanReport(r, p.plan_id, p.total_bytes) for r, p in enumerate(plans)]
                    )
                    assert all(o.intact for o in outcomes)
        finally:
            servicer.close()
        return calls.methods

    methods = asyncio.run(scenario())
    batched = [m for m in methods if m in ("EngineSession", "GetTransferPlans", "ReportTransfers")]
    assert batched == [
        "EngineSession",
        "GetTransferPlans",
        "ReportTransfers",
        "GetTransferPlans",
        "ReportTransfers",
    ]


def test_a_client_refused_a_stream_makes_unary_calls_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker holding its ``--max-session-streams`` refuses the decode client's stream:
    that exchange and every one for ``REFUSED_RETRY_S`` are unary calls, without asking for
    a stream each time; after that the client asks again, and gets one once there is room."""
    monkeypatch.setattr(engine_session, "REFUSED_RETRY_S", 1.0)

    async def scenario() -> tuple[list[str], int]:
        calls = _Calls()
        servicer = BrokerServicer(BrokerService(config=ServiceConfig(max_session_streams=1)))
        stream = grpc.stream_stream_rpc_method_handler(
            servicer.EngineSession,
            request_deserializer=pb.EngineSessionRequest.FromString,
            response_serializer=pb.EngineSessionResponse.SerializeToString,
        )
        try:
            async with (
                unary_only(servicer, calls, EngineSession=stream) as address,
                grpc.aio.insecure_channel(address) as channel,
                engines(address) as (prefill, decode),
            ):
                held = pb_grpc.BrokerStub(channel).EngineSession(timeout=WAIT_S)
                await held.write(pb.EngineSessionRequest(sequence=1))
                await held.read()  # the broker's one stream is taken
                await published(prefill, "t1", "t2", "t3")
                for transfer_id in ("t1", "t2"):
                    plans = await decode.plans(asks(transfer_id))
                    assert not any(isinstance(p, BrokerCallError) for p in plans)
                await held.done_writing()
                assert await held.read() is grpc.aio.EOF
                await asyncio.sleep(1.0)
                plans = await decode.plans(asks("t3"))
                assert not any(isinstance(p, BrokerCallError) for p in plans)
                return calls.methods, servicer.sessions_open
        finally:
            servicer.close()

    methods, open_after = asyncio.run(scenario())
    batched = [m for m in methods if m in ("EngineSession", "GetTransferPlans")]
    assert batched == [
        "EngineSession",  # the test's own, holding the one stream
        "EngineSession",  # the client's, refused
        "GetTransferPlans",
        "GetTransferPlans",  # t2: no stream asked for
        "EngineSession",  # t3, after the wait: there is room again
    ]
    assert open_after == 1


def test_a_replica_killed_mid_session_loses_nothing(redis_server: RedisServer) -> None:
    """Two replicas on one Redis; the decode client's stream is open on A when A is killed:
    its next reports and plans go through B (the stream reopened there), every plan is
    recorded intact and every transfer completes."""
    redis = require_module("redis", "dev")
    url = redis_server.url.rsplit("/", 1)[0] + "/6"  # a database of its own
    redis.Redis.from_url(url).flushdb()
    a = BrokerProcess("--store", url, "--lease-ttl-ms", "60000")
    b = BrokerProcess("--store", url, "--lease-ttl-ms", "60000")

    async def scenario() -> list[int]:
        async with engines(f"{a.address},{b.address}") as (prefill, decode):
            await published(prefill, "t1", "t2")
            before = await decode.plans(asks("t1", "t2"))
            a.process.send_signal(signal.SIGKILL)
            a.process.wait()
            outcomes = await decode.report_many(
                [PlanReport(i % 2, p.plan_id, p.total_bytes) for i, p in enumerate(before)]
            )
            await published(prefill, "t3")
            ids = SCENARIO.request.decode_block_ids
            (fetch,) = await decode.fetch_many([FetchAsk("t3", ids)])
            assert isinstance(fetch, Fetch), fetch
            assert decode.stub.address == b.address
            states = [
                (await decode.stub.GetTransfer(pb.GetTransferRequest(transfer_id=t))).state
                for t in ("t1", "t2", "t3")
            ]
            assert all(o.intact for o in outcomes)
            return states

    try:
        states = asyncio.run(scenario())
    finally:
        a.stop()
        b.stop()
    assert states == [pb.TRANSFER_STATE_COMPLETED] * 3


def test_a_stream_that_does_not_answer_in_time_is_left_for_the_next_replica() -> None:
    """Replica A's stream takes every message and answers none; B serves the same store.
    The exchange gets A its share of the call's timeout, then the client moves on to B
    (DEADLINE_EXCEEDED, as a unary call to a hung replica does) and its plans come from B."""

    async def scenario() -> tuple[float, list[str]]:
        calls = _Calls()

        async def hung(requests: AsyncIterator[pb.EngineSessionRequest], context: object):
            async for _ in requests:
                await asyncio.sleep(3600)
            yield pb.EngineSessionResponse()  # pragma: no cover - never reached

        held = grpc.stream_stream_rpc_method_handler(
            hung,
            request_deserializer=pb.EngineSessionRequest.FromString,
            response_serializer=pb.EngineSessionResponse.SerializeToString,
        )
        async with serving() as b:
            servicer = b._servicer
            assert isinstance(servicer, BrokerServicer)
            async with (
                unary_only(servicer, calls, EngineSession=held) as a,
                engines(f"{a},{b.address}") as (prefill, decode),
            ):
                decode.call_timeout_s = 1.0
                await published(prefill, "t1")
                started = asyncio.get_running_loop().time()
                plans = await decode.plans(asks("t1"))
                took = asyncio.get_running_loop().time() - started
                assert not any(isinstance(p, BrokerCallError) for p in plans)
                assert decode.stub.address == b.address
        return took, calls.methods

    took, methods = asyncio.run(scenario())
    assert 0.5 <= took < 1.0  # A's share (half of the timeout with two replicas), then B
    assert [m for m in methods if m in ("EngineSession", "GetTransferPlans")] == ["EngineSession"]
