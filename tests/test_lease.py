"""Decode engines keeping the transfers they wait for alive (ExtendTransfers): the service's
rules on both stores (the expiry and the reaper's deadline index follow an extension, the cap
at publication + max_ttl_ms, each entry answered on its own) and the gRPC edge (statuses,
field paths, the entry limit, the request bound, the client's call)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from broker_helpers import hybrid, reap_all, register_engine
from test_server import (  # noqa: F401 - broker: the live gRPC broker fixture
    Broker,
    broker,
    plan_request,
    publish_request,
    register,
)
from test_service import TTL_MS, done, publish, query, released, setup

from broker import transfers
from broker.api import Extension, PlanQuery
from broker.errors import (
    InvalidFieldError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    StoreUnavailableError,
)
from broker.limits import LIMITS
from broker.store import codec
from broker.v1 import broker_pb2 as pb
from broker.wire import ReleaseReason, Role, TransferState
from clients import protocol
from harness.scenarios import build_scenario

#: Every test runs against the in-memory store and against Redis (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_store")
MAX_TTL_MS = 12_000
WAIT_S = 5.0


# --------------------------------------------------------------------------- the service


def test_an_extended_transfer_outlives_its_ttl_and_is_then_read() -> None:
    service, clock, sc = setup(1, 1)
    published_at = clock.now
    publish(service, sc)
    clock.advance(TTL_MS - 1_000)
    (extension,) = service.extend("D", [("t1", "P")])
    assert extension == Extension(clock.now + TTL_MS, TTL_MS)
    # The reaper's index follows: nothing is due at the first expiry, the transfer is at the new.
    assert service.store.due_transfers(published_at + TTL_MS) == []
    assert service.store.due_transfers(extension.expires_at_ms) == [("P", "t1")]
    clock.advance(TTL_MS - 1)  # past the first expiry, before the new one
    reap_all(service)
    assert service.get_transfer("t1").state is TransferState.PUBLISHED
    assert released(service, 1) == {0: []}
    plan = service.get_plan(query(sc, 0))
    assert plan.expires_at_ms == extension.expires_at_ms
    assert done(service, plan.plan_id, 0, plan.total_bytes).intact
    assert released(service, 1) == {0: [("t1", ReleaseReason.COMPLETED)]}


def test_a_transfer_nobody_extends_expires_and_prefill_frees_it() -> None:
    service, clock, sc = setup(1, 1)
    publish(service, sc)
    clock.advance(TTL_MS - 1_000)
    (extension,) = service.extend("D", [("t1", "")])  # the publisher need not be named
    clock.now = extension.expires_at_ms
    reap_all(service)
    assert service.get_transfer("t1").state is TransferState.EXPIRED
    assert released(service, 1) == {0: [("t1", ReleaseReason.EXPIRED)]}


def test_extensions_stop_at_publication_plus_max_ttl() -> None:
    service, clock, sc = setup(1, 1, max_ttl_ms=MAX_TTL_MS)
    published_at = clock.now
    publish(service, sc)
    expiries = []
    for _ in range(4):
        clock.advance(TTL_MS // 2)
        (extension,) = service.extend("D", [("t1", "P")])
        expiries.append(extension.expires_at_ms)
    # Asked at 2.5, 5, 7.5 and 10 s: now + 5 s, at most 12 s after the publication.
    assert [e - published_at for e in expiries] == [7_500, 10_000, MAX_TTL_MS, MAX_TTL_MS]
    clock.now = published_at + MAX_TTL_MS
    (refused,) = service.extend("D", [("t1", "P")])
    assert isinstance(refused.error, PreconditionError) and refused.error.field == "transfer_id"
    assert "expired" in str(refused.error)
    assert released(service, 1) == {0: [("t1", ReleaseReason.EXPIRED)]}


def test_each_entry_is_answered_on_its_own() -> None:
    service, clock, sc = setup(1, 1)
    register_engine(service, sc.decode, "D2", Role.DECODE, 2)
    for transfer_id, allowed in (("ok", ()), ("only-d2", ("D2",)), ("ended", ()), ("taken", ())):
        publish(service, sc, transfer_id, allowed_decode_engines=frozenset(allowed))
    service.abort("ended", "user left")
    service.get_plan(PlanQuery("taken", "D2", 0, sc.request.decode_block_ids))
    clock.advance(1_000)
    malformed = InvalidFieldError("transfer_id", "must not be empty")
    names = [("ok", "P"), ("unknown", "P"), ("ended", "P"), ("taken", "P"), ("only-d2", "P")]
    ok, unknown, ended, taken, not_allowed, bad = service.extend("D", [*names, malformed])
    assert ok == Extension(clock.now + TTL_MS, TTL_MS)
    assert isinstance(unknown.error, NotFoundError) and unknown.error.field == "transfer_id"
    assert isinstance(ended.error, PreconditionError) and "aborted" in str(ended.error)
    # Not for D: exactly what an unknown id gets. Claimed by D2, which D could have claimed.
    assert type(not_allowed.error) is NotFoundError
    assert str(not_allowed.error) == str(unknown.error).replace("unknown", "only-d2")
    assert isinstance(taken.error, PermissionDeniedError)
    for refused in (taken, not_allowed):
        assert refused.error.field == "transfer_id" and "D2" not in str(refused.error)
        assert (refused.expires_at_ms, refused.ttl_ms) == (0, 0)
    assert bad.error is malformed
    assert service.get_transfer("taken").expires_at_ms == clock.now - 1_000 + TTL_MS  # unchanged


def test_the_extending_engine_must_be_a_registered_reader() -> None:
    service, _, sc = setup(1, 1)
    publish(service, sc)
    with pytest.raises(NotFoundError) as unknown:
        service.extend("nobody", [("t1", "P")])
    assert unknown.value.field == "engine_id"
    with pytest.raises(PreconditionError) as prefill:
        service.extend("P", [("t1", "P")])
    assert prefill.value.field == "engine_id"


def test_an_unavailable_store_fails_the_whole_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """UNAVAILABLE for the call, not a refusal per entry: the client moves on to another
    replica."""
    service, clock, sc = setup(1, 1)
    publish(service, sc)
    clock.advance(1_000)

    def down(*args: object) -> None:
        raise StoreUnavailableError("store", "the store does not answer")

    monkeypatch.setattr(service.store, "put_transfer", down)
    with pytest.raises(StoreUnavailableError):
        service.extend("D", [("t1", "P"), ("t1", "P")])


# --------------------------------------------------------------------------- the gRPC edge


def extend_request(*names: tuple[str, str], engine_id: str = "D") -> pb.ExtendTransfersRequest:
    return pb.ExtendTransfersRequest(
        engine_id=engine_id,
        transfers=[pb.TransferName(transfer_id=t, prefill_engine_id=p) for t, p in names],
    )


def test_extend_transfers_over_grpc(broker: Broker) -> None:  # noqa: F811
    sc = build_scenario(hybrid(), 1, 1, 100)
    stub = broker.stub
    register(stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    register(stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    stub.PublishBlocks(publish_request("t1", sc.request))
    stub.PublishBlocks(publish_request("t2", sc.request, allowed_decode_engines=["D"]))
    broker.clock.advance(4_000)
    answer = stub.ExtendTransfers(
        extend_request(("t1", "P"), ("nope", "P"), ("", "P"), ("t2", "P")), timeout=WAIT_S
    )
    first, unknown, malformed, second = answer.transfers
    assert (first.expires_at_ms, first.ttl_ms, first.code) == (broker.clock.now + TTL_MS, TTL_MS, 0)
    assert second.expires_at_ms == first.expires_at_ms and not second.message
    assert unknown.code == grpc.StatusCode.NOT_FOUND.value[0] and not unknown.expires_at_ms
    assert unknown.message == "transfers[1].transfer_id: no transfer 'nope'"
    assert malformed.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert malformed.message.startswith("transfers[2].transfer_id: ")

    # Past the first expiry the reaper (every 10 ms) leaves the extended transfer alone.
    broker.clock.advance(4_000)
    time.sleep(0.2)
    plan = stub.GetTransferPlan(plan_request("t1", 0, sc.request))
    assert plan.expires_at_ms == first.expires_at_ms

    # The client's call: per entry the broker's answer, or its refusal as an error.
    async def extend_as_client() -> list:
        failover = protocol.FailoverStub(broker.address)
        try:
            return await protocol.extend(failover, "D", [("t2", "P"), ("t9", "P")], WAIT_S)
        finally:
            await failover.close()

    extended, refused = asyncio.run(extend_as_client())
    assert extended.expires_at_ms == broker.clock.now + TTL_MS
    assert isinstance(refused, protocol.BrokerCallError)
    assert refused.code is grpc.StatusCode.NOT_FOUND and refused.field == "transfers[1].transfer_id"


def test_extend_transfers_limits_and_whole_call_errors(broker: Broker) -> None:  # noqa: F811
    sc = build_scenario(hybrid(), 1, 1, 100)
    stub = broker.stub
    register(stub, sc.prefill, "P", pb.ROLE_PREFILL, 0)
    register(stub, sc.decode, "D", pb.ROLE_DECODE, 1)
    longest = ("x" * LIMITS.max_id_chars, "P" * LIMITS.max_id_chars)
    too_many = extend_request(*[longest] * (LIMITS.max_extended_transfers + 1))
    with pytest.raises(grpc.RpcError) as err:
        stub.ExtendTransfers(too_many, timeout=WAIT_S)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("transfers: "), err.value.details()
    # The largest allowed call passes the request gate and is answered entry by entry.
    most = extend_request(*[longest] * LIMITS.max_extended_transfers)
    answer = stub.ExtendTransfers(most, timeout=WAIT_S)
    assert len(answer.transfers) == LIMITS.max_extended_transfers
    assert {e.code for e in answer.transfers} == {grpc.StatusCode.NOT_FOUND.value[0]}
    for request, code in (
        (extend_request(("t1", "P"), engine_id=""), grpc.StatusCode.INVALID_ARGUMENT),
        (extend_request(("t1", "P"), engine_id="nobody"), grpc.StatusCode.NOT_FOUND),
        (extend_request(("t1", "P"), engine_id="P"), grpc.StatusCode.FAILED_PRECONDITION),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.ExtendTransfers(request, timeout=WAIT_S)
        assert err.value.code() is code and err.value.details().startswith("engine_id: ")


def test_a_transfer_stored_before_extensions_existed_reads_its_ttl_from_its_expiry() -> None:
    """Replicas of an older broker stored no TTL: a record written so extends by the TTL it
    was published with."""
    step = transfers.publish("t", "P", 1, 1, 10, ((1,),), frozenset(), 1_000, 7_000)
    assert step.record is not None
    values, _ = codec.plans_token_of(codec.encode_transfer(step.record, "token"))
    assert codec.decode_transfer(values, {}) == step.record
    del values["ttl"]
    assert codec.decode_transfer(values, {}).ttl_ms == 7_000
