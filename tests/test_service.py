"""BrokerService rules with a hand-driven clock: consumers, releases, expiry, leases, abort."""

from __future__ import annotations

import dataclasses

import pytest
from broker_helpers import (
    MAMBA2,
    FakeClock,
    assert_inside_regions,
    hybrid,
    plan_bytes,
    reap_all,
    register_engine,
    registration,
)

from broker.api import PlanQuery, Publication, Report
from broker.config import ServiceConfig
from broker.errors import (
    AbortedError,
    AlreadyExistsError,
    CompactedError,
    IncompatibleLayoutsError,
    InvalidFieldError,
    LimitExceededError,
    NotFoundError,
    PdbrokerError,
    PreconditionError,
    RequestError,
)
from broker.planner import PairPlanner
from broker.records import TransferRecord
from broker.service import BrokerService
from broker.wire import ReleaseReason, ReportStatus, Role, TransferState
from harness.scenarios import Scenario, build_scenario

#: Every test runs against the in-memory store and against Redis (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_store")
TTL_MS = 5_000
LEASE_MS = 60_000  # longer than TTL and retention: only lease tests reach it
READ_MS = 120_000  # how long a live plan holds its sources after its transfer ended


def make_service(**config: int) -> tuple[BrokerService, FakeClock]:
    clock = FakeClock()
    settings = {
        "default_ttl_ms": TTL_MS,
        "lease_ttl_ms": LEASE_MS,
        "retention_ms": 10_000,
        "max_read_ms": READ_MS,
    } | config
    return BrokerService(clock=clock, config=ServiceConfig(**settings)), clock


def setup(
    p_tp: int, d_tp: int, kv_heads: int = 4, mamba: bool = True, tokens: int = 100, **config: int
) -> tuple[BrokerService, FakeClock, Scenario]:
    service, clock = make_service(**config)
    sc = build_scenario(hybrid(kv_heads, MAMBA2 if mamba else None), p_tp, d_tp, tokens)
    register_engine(service, sc.prefill, "P", Role.PREFILL, 0)
    register_engine(service, sc.decode, "D", Role.DECODE, 1)
    return service, clock, sc


def publish(service: BrokerService, sc: Scenario, transfer_id: str = "t1", **kw) -> int:
    return service.publish(
        Publication(transfer_id, "P", sc.request.prefill_block_ids, sc.request.num_tokens, **kw)
    )


def query(sc: Scenario, rank: int, transfer_id: str = "t1", **kw) -> PlanQuery:
    return PlanQuery(transfer_id, "D", rank, sc.request.decode_block_ids, **kw)


def released(service: BrokerService, p_tp: int, engine: str = "P") -> dict[int, list]:
    """Queued release events per prefill rank: ``[(transfer_id, reason), ...]``."""
    return {
        p: [(e.transfer_id, e.reason) for e in service.store.releases_after((engine, p), 0)]
        for p in range(p_tp)
    }


def done(service: BrokerService, plan_id: str, rank: int, nbytes: int = 0):
    return service.report(Report(plan_id, "D", rank, ReportStatus.DONE, nbytes, 1000))


# --------------------------------------------------------------------------- consumer counting


@pytest.mark.parametrize(
    "p_tp,d_tp,consumers",
    [
        (2, 2, {0: {0}, 1: {1}}),  # homogeneous: one reader each
        (1, 2, {0: {0, 1}}),  # D > P: both decode ranks read prefill rank 0
        (2, 1, {0: {0}, 1: {0}}),  # P > D: decode rank 0 reads both prefill ranks
        (2, 4, {0: {0, 1}, 1: {2, 3}}),
        (4, 2, {0: {0}, 1: {0}, 2: {1}, 3: {1}}),
    ],
)
def test_prefill_rank_released_when_all_its_readers_are_done(p_tp, d_tp, consumers) -> None:
    service, _, sc = setup(p_tp, d_tp)
    publish(service, sc)
    plans = {d: service.get_plan(query(sc, d)) for d in range(d_tp)}
    record = service.get_transfer("t1")
    assert {p: set(c) for p, c in record.consumers.items()} == consumers
    assert record.state is TransferState.IN_PROGRESS
    for d in range(d_tp):
        assert {s.prefill_rank for s in plans[d].sources} == {
            p for p, readers in consumers.items() if d in readers
        }
    for d in range(d_tp):
        outcome = done(service, plans[d].plan_id, d, plans[d].total_bytes)
        assert outcome.intact and not outcome.duplicate
        finished = {d2 for d2 in range(d + 1)}
        for p, readers in consumers.items():
            expected = [("t1", ReleaseReason.COMPLETED)] if readers <= finished else []
            assert released(service, p_tp)[p] == expected, (d, p)
    assert service.get_transfer("t1").state is TransferState.COMPLETED


def test_prefill_rank_nobody_reads_is_released_when_the_transfer_is_claimed() -> None:
    # 2 KV heads over P TP4: ranks 0,1 hold head 0, ranks 2,3 head 1; decode TP2 reads each
    # head once, from the first rank holding it, so prefill ranks 1 and 3 have no reader.
    service, _, sc = setup(4, 2, kv_heads=2, mamba=False)
    publish(service, sc)
    plan0 = service.get_plan(query(sc, 0))
    assert [s.prefill_rank for s in plan0.sources] == [0]
    assert released(service, 4) == {
        0: [],
        1: [("t1", ReleaseReason.COMPLETED)],
        2: [],
        3: [("t1", ReleaseReason.COMPLETED)],
    }
    done(service, plan0.plan_id, 0)
    assert released(service, 4)[0] == [("t1", ReleaseReason.COMPLETED)]
    assert released(service, 4)[2] == []


def test_a_first_plan_request_claims_and_hands_out_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc, "t1")
    publish(service, sc, "t2")
    writes: list[str] = []
    put = service.store.put_transfer

    def counted(record: TransferRecord) -> None:
        writes.append(record.transfer_id)
        put(record)

    monkeypatch.setattr(service.store, "put_transfer", counted)
    service.get_plan(query(sc, 1))
    assert writes == ["t1"]
    t = service.get_transfer("t1")
    assert t.state is TransferState.IN_PROGRESS
    assert [p.handed_out for p in t.plans] == [False, True]
    service.get_plan(query(sc, 0))
    assert writes == ["t1", "t1"]
    # A first request whose answer would be too large claims nothing: the transfer stays
    # PUBLISHED, for that rank to ask StreamTransferPlan.
    with pytest.raises(LimitExceededError) as refused:
        service.plan_step(query(sc, 0, "t2"), answer_bytes=100, in_place=1 << 20)
    assert refused.value.field == "plan"
    assert service.get_transfer("t2").state is TransferState.PUBLISHED
    assert writes == ["t1", "t1"]


def test_plan_matches_the_planner_at_absolute_addresses() -> None:
    service, _, sc = setup(1, 2)
    publish(service, sc)
    planner = PairPlanner(sc.prefill, sc.decode)
    for d in range(2):
        result = service.get_plan(query(sc, d))
        expected = planner.plan_rank(d, sc.request)
        assert plan_bytes(result) == expected.nbytes == result.total_bytes
        assert result.num_descriptors == expected.num_descriptors
        assert (result.naive_bytes, result.vllm_descriptors) == (
            expected.naive_bytes,
            expected.vllm_descriptors,
        )
        d_regions = registration(sc.decode, "D", Role.DECODE, d, 1).regions
        p_regions = registration(sc.prefill, "P", Role.PREFILL, 0, 0).regions
        for source, reads in zip(result.sources, expected.sources):
            assert_inside_regions(source.local, d_regions)
            assert_inside_regions(source.remote, p_regions)
            bases = [r.base_addr for r in d_regions]
            assert (
                source.local[:, 0]
                == [bases[r] + o for r, o in zip(reads.region, reads.local_offset)]
            ).all()
            assert source.notification.startswith(b"pdbroker:t1:")


# --------------------------------------------------------------------------- reports


def test_reports_are_idempotent_and_the_first_one_wins() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc)
    plan = service.get_plan(query(sc, 0))
    first = done(service, plan.plan_id, 0)
    again = service.report(Report(plan.plan_id, "D", 0, ReportStatus.FAILED, 0, 0, "late"))
    assert (again.duplicate, again.intact, again.state) == (True, True, first.state)
    assert released(service, 2)[0] == [("t1", ReleaseReason.COMPLETED)]
    assert service.get_transfer("t1").plans[0].status is ReportStatus.DONE


def test_failed_report_releases_every_prefill_rank_with_consumer_failed() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc)
    p0, p1 = (service.get_plan(query(sc, d)) for d in range(2))
    outcome = service.report(Report(p0.plan_id, "D", 0, ReportStatus.FAILED, 0, 10, "nixl error"))
    assert outcome.state is TransferState.FAILED and not outcome.intact
    # Decode rank 1 may still be reading prefill rank 1: fenced until it reports.
    assert released(service, 2) == {0: [("t1", ReleaseReason.CONSUMER_FAILED)], 1: []}
    with pytest.raises(AbortedError, match="recompute"):
        done(service, p1.plan_id, 1)
    assert released(service, 2)[1] == [("t1", ReleaseReason.CONSUMER_FAILED)]
    with pytest.raises(AbortedError):  # a repeated report gets the same answer
        done(service, p1.plan_id, 1)
    assert len(released(service, 2)[1]) == 1


def test_report_validation() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc)
    plan = service.get_plan(query(sc, 0))
    with pytest.raises(NotFoundError) as err:
        done(service, "nope", 0)
    assert err.value.field == "plan_id"
    with pytest.raises(RequestError) as err:
        done(service, plan.plan_id, 1)
    assert err.value.field == "tp_rank"
    with pytest.raises(RequestError) as err:
        service.report(Report(plan.plan_id, "X", 0, ReportStatus.DONE))
    assert err.value.field == "engine_id"
    with pytest.raises(RequestError) as err:
        done(service, plan.plan_id, 0, plan.total_bytes - 1)
    assert err.value.field == "bytes_moved"
    # A plan never handed out (decode rank 1 did not ask) is unknown to reporters.
    other = service.get_transfer("t1").plans[1].plan_id
    with pytest.raises(NotFoundError):
        done(service, other, 1)


# --------------------------------------------------------------------------- plans


def test_plan_retry_returns_the_same_plan_and_metadata_only_on_first_contact() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc)
    publish(service, sc, "t2")
    first = service.get_plan(query(sc, 0))
    assert first.sources[0].agent_metadata == b"metadata of P rank 0"
    retry = service.get_plan(query(sc, 0))
    assert retry.plan_id == first.plan_id and retry.sources[0].agent_metadata == b""
    second = service.get_plan(query(sc, 0, "t2"))
    assert second.plan_id != first.plan_id and second.sources[0].agent_metadata == b""
    forced = service.get_plan(query(sc, 0, "t2", want_agent_metadata=True))
    assert forced.sources[0].agent_metadata == b"metadata of P rank 0"
    other_ids = tuple(tuple(b + 1 for b in g) for g in sc.request.decode_block_ids)
    with pytest.raises(AlreadyExistsError) as err:
        service.get_plan(PlanQuery("t1", "D", 0, other_ids))
    assert err.value.field == "block_ids"


def test_decode_rank_with_its_own_block_ids_is_replanned() -> None:
    service, _, sc = setup(2, 2)
    # Rank 1's decode engine placed the request elsewhere; both plans stay exact.
    blocks = sc.decode.ranks[0].num_blocks
    publish(service, sc)
    service.get_plan(query(sc, 0))
    shifted = tuple(tuple(blocks - 1 - b for b in g) for g in sc.request.decode_block_ids)
    result = service.get_plan(PlanQuery("t1", "D", 1, shifted))
    expected = PairPlanner(sc.prefill, sc.decode).plan_rank(
        1, type(sc.request)(sc.request.num_tokens, sc.request.prefill_block_ids, shifted)
    )
    assert plan_bytes(result) == expected.nbytes
    assert service.get_transfer("t1").plans[1].block_ids == shifted


def test_plan_errors_name_their_field() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc, allowed_decode_engines=frozenset({"D"}))
    publish(service, sc, "t-open")
    cases = [
        (PlanQuery("missing", "D", 0, sc.request.decode_block_ids), NotFoundError, "transfer_id"),
        (PlanQuery("t1", "nobody", 0, sc.request.decode_block_ids), NotFoundError, "transfer_id"),
        (PlanQuery("t-open", "nobody", 0, sc.request.decode_block_ids), NotFoundError, "engine_id"),
        (PlanQuery("t-open", "P", 0, sc.request.decode_block_ids), PreconditionError, "engine_id"),
        (PlanQuery("t1", "D", 7, sc.request.decode_block_ids), RequestError, "tp_rank"),
        (PlanQuery("t1", "D", 0, sc.request.decode_block_ids[:2]), RequestError, "block_ids"),
        (
            PlanQuery("t1", "D", 0, ((10**6,),) + sc.request.decode_block_ids[1:]),
            RequestError,
            "block_ids[0]",
        ),
    ]
    for q, error, field in cases:
        with pytest.raises(error) as err:
            service.get_plan(q)
        assert err.value.field == field, q
    assert service.get_transfer("t1").state is TransferState.PUBLISHED
    register_engine(service, sc.decode, "D2", Role.DECODE, 2)
    # An engine the publication does not allow learns nothing: as for an unknown id.
    unknown = _refusal(service, PlanQuery("t-none", "D2", 0, sc.request.decode_block_ids))
    assert isinstance(unknown, NotFoundError)
    not_allowed = _refusal(service, PlanQuery("t1", "D2", 0, sc.request.decode_block_ids))
    assert (type(not_allowed), not_allowed.field) == (NotFoundError, "transfer_id")
    assert str(not_allowed) == str(unknown).replace("t-none", "t1")
    publish(service, sc, "t2")
    service.get_plan(query(sc, 0, "t2"))
    with pytest.raises(PreconditionError, match="claimed by another decode engine$"):
        service.get_plan(PlanQuery("t2", "D2", 0, sc.request.decode_block_ids))


def _refusal(service: BrokerService, q: PlanQuery) -> Exception:
    with pytest.raises(PdbrokerError) as err:
        service.get_plan(q)
    return err.value


def test_decode_may_name_the_prefill_engine_it_expects() -> None:
    """A transfer id published by another prefill engine (squatted, or a stale id) is
    NOT_FOUND for a decode engine expecting its own prefill engine, as an unknown id is."""
    service, _ = make_service()
    sc = build_scenario(hybrid(), 1, 1, 100)
    register_engine(service, sc.prefill, "P", Role.PREFILL, 0)
    register_engine(service, sc.prefill, "Q", Role.PREFILL, 1)
    register_engine(service, sc.decode, "D", Role.DECODE, 2)
    service.publish(Publication("t1", "Q", sc.request.prefill_block_ids, sc.request.num_tokens))
    ids = sc.request.decode_block_ids
    squatted = _refusal(service, PlanQuery("t1", "D", 0, ids, prefill_engine_id="P"))
    assert (type(squatted), str(squatted)) == (NotFoundError, "transfer_id: no transfer 't1'")
    assert service.get_transfer("t1").state is TransferState.PUBLISHED  # not claimed
    assert service.get_plan(PlanQuery("t1", "D", 0, ids, prefill_engine_id="Q")).sources


def test_a_transfer_id_belongs_to_the_engine_that_published_it() -> None:
    """Q publishing the id P will use (squatting) neither stops P's publication nor tells Q
    that P's exists; each is its own transfer, planned, released and aborted apart. A caller
    that names no publisher gets the one transfer of that id, or is asked to name it."""
    service, _ = make_service()
    sc = build_scenario(hybrid(), 1, 1, 100)
    register_engine(service, sc.prefill, "P", Role.PREFILL, 0)
    register_engine(service, sc.prefill, "Q", Role.PREFILL, 1)
    register_engine(service, sc.decode, "D", Role.DECODE, 2)
    ids, tokens = sc.request.prefill_block_ids, sc.request.num_tokens
    service.publish(Publication("t1", "Q", ids, tokens))  # squatted first
    assert service.get_transfer("t1").prefill_engine_id == "Q"  # the one of that id
    service.publish(Publication("t1", "P", ids, tokens))  # P's own, not ALREADY_EXISTS
    with pytest.raises(AlreadyExistsError):
        service.publish(Publication("t1", "P", ids, tokens))  # P's id, published twice

    unnamed = _refusal(service, query(sc, 0))
    assert (type(unnamed), unnamed.field) == (PreconditionError, "prefill_engine_id")
    with pytest.raises(PreconditionError, match="name the one you mean"):
        service.get_transfer("t1")
    plan = service.get_plan(query(sc, 0, prefill_engine_id="P"))
    assert service.get_transfer("t1", "P").state is TransferState.IN_PROGRESS
    assert service.get_transfer("t1", "Q").state is TransferState.PUBLISHED
    done(service, plan.plan_id, 0)
    assert released(service, 1) == {0: [("t1", ReleaseReason.COMPLETED)]}
    assert released(service, 1, "Q") == {0: []}  # Q's transfer is untouched
    assert service.abort("t1", "user left", "Q") is TransferState.ABORTED
    assert service.get_transfer("t1", "P").state is TransferState.COMPLETED
    assert released(service, 1, "Q") == {0: [("t1", ReleaseReason.ABORTED)]}


def test_incompatible_and_partially_registered_engines() -> None:
    service, _, sc = setup(2, 2)
    other = build_scenario(hybrid(kv_heads=8, name="other"), 2, 2, 100)
    register_engine(service, other.decode, "X", Role.DECODE, 3)
    service.register_rank(registration(sc.decode, "half", Role.DECODE, 0, 4))
    publish(service, sc)
    with pytest.raises(IncompatibleLayoutsError) as err:
        service.get_plan(PlanQuery("t1", "X", 0, other.request.decode_block_ids))
    assert err.value.field == "model_fingerprint"
    with pytest.raises(PreconditionError, match="1 of its 2 ranks") as err:
        service.get_plan(PlanQuery("t1", "half", 0, sc.request.decode_block_ids))
    assert err.value.field == "engine_id"


def test_publish_validation() -> None:
    service, _, sc = setup(2, 2, max_transfers=2)
    ids = sc.request.prefill_block_ids
    limit = sc.prefill.ranks[0].num_blocks
    cases = [
        (Publication("a", "nobody", ids, 100), NotFoundError, "engine_id"),
        (Publication("a", "D", ids, 100), PreconditionError, "engine_id"),
        (Publication("a", "P", ids[:2], 100), RequestError, "block_ids"),
        (Publication("a", "P", ((limit,),) + ids[1:], 100), RequestError, "block_ids[0]"),
        (Publication("a", "P", (ids[1][:1],) + ids[1:], 100), RequestError, "block_ids[1]"),
        (Publication("a", "P", ids, 10_000), RequestError, "block_ids[1]"),
        (Publication("a", "P", ((),) + ids[1:], 100), RequestError, "block_ids[0]"),
        (Publication("a", "P", ids, 100, ttl_ms=10**9), RequestError, "ttl_ms"),
    ]
    for pub, error, field in cases:
        with pytest.raises(error) as err:
            service.publish(pub)
        assert err.value.field == field, pub
    publish(service, sc)
    with pytest.raises(AlreadyExistsError):
        publish(service, sc)
    publish(service, sc, "t2")
    with pytest.raises(LimitExceededError):
        publish(service, sc, "t3")


# --------------------------------------------------------------------------- expiry and abort


def test_unread_transfer_expires_and_decode_gets_a_clear_error() -> None:
    service, clock, sc = setup(2, 2)
    expires = publish(service, sc, ttl_ms=1_000)
    assert expires == clock.now + 1_000
    clock.advance(999)
    reap_all(service)
    assert released(service, 2) == {0: [], 1: []}
    clock.advance(1)
    reap_all(service)
    assert released(service, 2) == {
        0: [("t1", ReleaseReason.EXPIRED)],
        1: [("t1", ReleaseReason.EXPIRED)],
    }
    with pytest.raises(PreconditionError, match="expired") as err:
        service.get_plan(query(sc, 0))
    assert err.value.field == "transfer_id"


def test_expiry_is_checked_on_access_before_the_reaper_runs() -> None:
    service, clock, sc = setup(2, 2)
    publish(service, sc)  # default TTL
    clock.advance(TTL_MS)
    with pytest.raises(PreconditionError, match="expired"):
        service.get_plan(query(sc, 1))
    assert service.get_transfer("t1").state is TransferState.EXPIRED
    assert released(service, 2)[1] == [("t1", ReleaseReason.EXPIRED)]


def test_in_progress_transfer_expires_and_late_report_is_not_intact() -> None:
    service, clock, sc = setup(2, 2)
    publish(service, sc)
    p0, p1 = (service.get_plan(query(sc, d)) for d in range(2))
    done(service, p0.plan_id, 0)
    clock.advance(TTL_MS)
    reap_all(service)
    assert service.get_transfer("t1").state is TransferState.EXPIRED
    # Decode rank 1's plan is live: prefill rank 1 stays fenced while it may be read.
    assert released(service, 2) == {0: [("t1", ReleaseReason.COMPLETED)], 1: []}
    with pytest.raises(AbortedError, match="expired.*recompute"):
        done(service, p1.plan_id, 1)
    assert released(service, 2)[1] == [("t1", ReleaseReason.EXPIRED)]


def test_a_live_plan_that_never_reports_holds_its_sources_for_max_read_ms() -> None:
    read_ms = LEASE_MS // 2
    service, clock, sc = setup(2, 2, max_read_ms=read_ms)
    publish(service, sc)
    plan = service.get_plan(query(sc, 0))
    service.abort("t1", "operator")
    assert released(service, 2) == {0: [], 1: [("t1", ReleaseReason.ABORTED)]}
    clock.advance(read_ms - 1)
    reap_all(service)
    assert released(service, 2)[0] == []
    clock.advance(1)
    reap_all(service)
    assert released(service, 2)[0] == [("t1", ReleaseReason.CONSUMER_FAILED)]
    with pytest.raises(AbortedError, match="max_read_ms"):
        done(service, plan.plan_id, 0)
    assert len(released(service, 2)[0]) == 1


def test_a_decode_rank_lost_while_reading_an_ended_transfer_frees_its_sources() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc)
    service.get_plan(query(sc, 0))
    service.abort("t1", "operator")
    assert released(service, 2)[0] == []
    d0 = next(r for r in service.store.ranks() if r.registration.key == ("D", 0))
    service.deregister(d0.lease_id)
    assert released(service, 2)[0] == [("t1", ReleaseReason.CONSUMER_FAILED)]


def test_finished_transfers_are_forgotten_after_retention() -> None:
    service, clock, sc = setup(2, 2)
    publish(service, sc)
    plan = service.get_plan(query(sc, 0))
    service.abort("t1", "operator")
    failed = Report(plan.plan_id, "D", 0, ReportStatus.FAILED, 0, 10, "aborted")
    assert not service.report(failed).intact  # the decode rank gave up: nothing is held
    clock.advance(9_999)
    reap_all(service)
    assert service.get_transfer("t1").state is TransferState.ABORTED
    clock.advance(1)
    reap_all(service)
    with pytest.raises(NotFoundError):
        service.get_transfer("t1")
    with pytest.raises(NotFoundError):
        done(service, plan.plan_id, 0)
    publish(service, sc)  # the id may be reused once forgotten


def test_abort_releases_everything_and_is_idempotent() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc)
    plan = service.get_plan(query(sc, 0))
    assert service.abort("t1", "cancelled by user") is TransferState.ABORTED
    # Decode rank 0 holds a live plan on prefill rank 0: fenced until it reports.
    assert released(service, 2) == {0: [], 1: [("t1", ReleaseReason.ABORTED)]}
    assert service.abort("t1", "again") is TransferState.ABORTED
    assert len(released(service, 2)[1]) == 1
    with pytest.raises(PreconditionError, match="aborted"):
        service.get_plan(query(sc, 1))
    with pytest.raises(AbortedError, match="aborted.*recompute"):
        done(service, plan.plan_id, 0)
    assert released(service, 2)[0] == [("t1", ReleaseReason.ABORTED)]
    with pytest.raises(NotFoundError):
        service.abort("nope", "")
    timeline = [event for _, event, _ in service.get_transfer("t1").timeline]
    assert timeline[:3] == ["published", "claimed", "planned"] and "aborted" in timeline


# --------------------------------------------------------------------------- leases


def test_keep_alive_extends_and_expired_lease_is_gone() -> None:
    service, clock = make_service()
    sc = build_scenario(hybrid(), 1, 1, 100)
    (lease,) = register_engine(service, sc.prefill, "P", Role.PREFILL)
    clock.advance(LEASE_MS - 1)
    assert service.keep_alive(lease.lease_id) == LEASE_MS
    clock.advance(LEASE_MS - 1)
    reap_all(service)
    assert [e.engine_id for e in service.list_engines()] == ["P"]
    clock.advance(1)
    reap_all(service)
    assert service.list_engines() == []
    with pytest.raises(NotFoundError) as err:
        service.keep_alive(lease.lease_id)
    assert err.value.field == "lease_id"


def test_lost_prefill_rank_fails_its_transfers() -> None:
    service, clock, sc = setup(2, 2)
    leases = {e.engine_id: e for e in service.list_engines()}
    assert leases["P"].complete and leases["D"].complete
    publish(service, sc, ttl_ms=2 * LEASE_MS)
    publish(service, sc, "t2", ttl_ms=2 * LEASE_MS)
    service.get_plan(query(sc, 0, "t2"))
    # Everyone but prefill rank 1 keeps their lease alive.
    keep = [r.lease_id for r in service.store.ranks() if r.registration.key != ("P", 1)]
    clock.advance(LEASE_MS - 1)
    for lease_id in keep:
        service.keep_alive(lease_id)
    clock.advance(1)
    reap_all(service)
    for t in ("t1", "t2"):
        assert service.get_transfer(t).state is TransferState.FAILED
    # t2's decode rank 0 may still read prefill rank 0: fenced until it reports.
    assert released(service, 2) == {0: [("t1", ReleaseReason.ABORTED)], 1: []}
    with pytest.raises(AbortedError):
        done(service, service.get_transfer("t2").plans[0].plan_id, 0)
    assert released(service, 2) == {
        0: [("t1", ReleaseReason.ABORTED), ("t2", ReleaseReason.ABORTED)],
        1: [],
    }
    with pytest.raises(PreconditionError):
        service.get_plan(query(sc, 0))
    with pytest.raises(PreconditionError, match="1 of its 2 ranks"):
        publish(service, sc, "t3")
    assert released(service, 2)[0][-1] == ("t2", ReleaseReason.ABORTED)


def test_lost_decode_rank_fails_its_claimed_transfers() -> None:
    service, _clock, sc = setup(2, 2)
    publish(service, sc)
    publish(service, sc, "t2")
    service.get_plan(query(sc, 1))
    decode_lease = next(r.lease_id for r in service.store.ranks() if r.registration.key == ("D", 1))
    service.deregister(decode_lease)
    record = service.get_transfer("t1")
    assert record.state is TransferState.FAILED
    assert record.plans[1].status is ReportStatus.FAILED
    assert released(service, 2) == {
        0: [("t1", ReleaseReason.CONSUMER_FAILED)],
        1: [("t1", ReleaseReason.CONSUMER_FAILED)],
    }
    # t2 was never claimed: it waits for another decode engine.
    assert service.get_transfer("t2").state is TransferState.PUBLISHED


def test_re_registration_fails_old_transfers_and_bumps_the_generation() -> None:
    service, _, sc = setup(2, 2)
    publish(service, sc)
    before = {e.engine_id: e.generation for e in service.list_engines()}
    lease = service.register_rank(registration(sc.prefill, "P", Role.PREFILL, 1, 0))
    assert lease.engine_complete and lease.generation > before["P"]
    assert service.get_transfer("t1").state is TransferState.FAILED
    # The restarted rank never hears about blocks of its previous life.
    assert released(service, 2) == {0: [("t1", ReleaseReason.ABORTED)], 1: []}
    publish(service, sc, "t2")
    plan = service.get_plan(query(sc, 1, "t2"))
    assert plan.sources[0].agent_metadata  # a new agent generation: metadata again


def test_a_plan_after_a_re_registration_elsewhere_reads_the_new_registration() -> None:
    """Engines looked up again while their ranks are unchanged are reused: a rank that
    registers again through another broker on the same store (other regions, another agent)
    is what this broker's next plan reads from."""
    service, clock, sc = setup(2, 2)
    publish(service, sc)
    assert service.get_plan(query(sc, 1)).sources[0].agent_name == "P-agent1"
    moved = registration(sc.prefill, "P", Role.PREFILL, 1, 7)
    replica = BrokerService(service.store, clock, service.config)
    replica.register_rank(dataclasses.replace(moved, agent_name="P-restarted1"))
    publish(service, sc, "t2")
    source = service.get_plan(query(sc, 1, "t2")).sources[0]
    assert source.agent_name == "P-restarted1"
    regions = [(r.base_addr, r.base_addr + r.length_bytes) for r in moved.regions]
    for address in source.remote[:, 0].tolist():
        assert any(start <= address < end for start, end in regions)


def test_registration_validation() -> None:
    service, _, sc = setup(2, 2)
    reg = registration(sc.prefill, "Q", Role.PREFILL, 0, 5)
    cases = [
        (dataclasses.replace(reg, agent_name="P-agent0"), AlreadyExistsError, "agent_name"),
        (dataclasses.replace(reg, region_rows=reg.region_rows[:1]), InvalidFieldError, "regions"),
        (
            dataclasses.replace(
                reg,
                region_rows=(dataclasses.replace(reg.regions[0], length_bytes=8).row,)
                + reg.region_rows[1:],
            ),
            InvalidFieldError,
            "regions[0].length_bytes",
        ),
        (dataclasses.replace(reg, tp_rank=2), InvalidFieldError, "tp_rank"),
    ]
    for bad, error, field in cases:
        with pytest.raises(error) as err:
            service.register_rank(bad)
        assert err.value.field == field
    service.register_rank(reg)
    for name, value in (("tp_size", 4), ("role", Role.DECODE), ("model_fingerprint", "x")):
        with pytest.raises(PreconditionError) as err:
            service.register_rank(
                dataclasses.replace(
                    registration(sc.prefill, "Q", Role.PREFILL, 1, 5), **{name: value}
                )
            )
        assert err.value.field == name
    # Ranks of one engine must declare the same groups.
    mismatched = registration(
        build_scenario(hybrid(mamba=None), 2, 2, 100).prefill, "Q", Role.PREFILL, 1, 5
    )
    with pytest.raises(PreconditionError) as err:
        service.register_rank(dataclasses.replace(mismatched, model_fingerprint=sc.prefill.model))
    assert err.value.field.startswith("layout.")


# --------------------------------------------------------------------------- release streams


def test_release_cursor_resumes_and_new_watchers_start_after_delivered_events() -> None:
    service, _, sc = setup(1, 1)
    for t in ("a", "b", "c"):
        publish(service, sc, t)
        service.abort(t, "")
    generation, cursor = service.feeds.start("P", 0, 0)
    events = service.feeds.after(("P", 0), generation, cursor)
    assert [e.transfer_id for e in events] == ["a", "b", "c"]
    assert [e.sequence for e in events] == sorted(e.sequence for e in events)
    service.feeds.delivered(("P", 0), events[1].sequence)
    _, cursor = service.feeds.start("P", 0, 0)
    assert [e.transfer_id for e in service.feeds.after(("P", 0), generation, cursor)] == ["c"]
    _, cursor = service.feeds.start("P", 0, events[0].sequence)
    assert [e.transfer_id for e in service.feeds.after(("P", 0), generation, cursor)] == ["b", "c"]
    with pytest.raises(NotFoundError) as err:
        service.feeds.start("P", 3, 0)
    assert err.value.field == "tp_rank"
    with pytest.raises(PreconditionError):
        service.feeds.start("D", 0, 0)
    lease = service.store.get_rank(("P", 0)).lease_id
    service.deregister(lease)
    assert service.feeds.after(("P", 0), generation, 0) is None


def _event_bytes(service: BrokerService, key=("P", 0)) -> list[int]:
    return [e.nbytes for e in service.store.releases_after(key, 0)]


def test_release_backlog_is_bounded_in_bytes_and_a_resume_before_it_is_refused() -> None:
    """Nobody watches P's rank: its kept events stay within release_backlog_bytes, the
    oldest dropped first; a stream resuming before the dropped ones is refused naming the
    newest dropped sequence, and one resuming after it gets every event kept."""
    service, _, sc = setup(1, 1, release_backlog_bytes=1000, release_backlog_total_bytes=1 << 20)
    for i in range(12):
        publish(service, sc, f"t{i:02}")
        service.abort(f"t{i:02}", "x" * 100)
    sizes = _event_bytes(service)
    assert sum(sizes) <= 1000 < sum(sizes) + sizes[0]  # no event dropped needlessly
    kept = [e.transfer_id for e in service.store.releases_after(("P", 0), 0)]
    assert kept == [f"t{i:02}" for i in range(12 - len(kept), 12)] and 0 < len(kept) < 12
    for after in (0, 1):
        with pytest.raises(CompactedError) as err:
            service.feeds.start("P", 0, after)
        assert err.value.field == "after_sequence"
    through = err.value.through
    assert through == service.store.compacted_through(("P", 0)) > 0
    generation, cursor = service.feeds.start("P", 0, through)
    events = service.feeds.after(("P", 0), generation, cursor)
    assert [e.transfer_id for e in events] == kept and events[0].sequence > through


def test_release_backlog_over_all_ranks_drops_from_the_largest() -> None:
    service, _, sc = setup(1, 1, release_backlog_bytes=1 << 20, release_backlog_total_bytes=500)
    register_engine(service, sc.prefill, "Q", Role.PREFILL, 2)
    for i in range(6):
        publish(service, sc, f"p{i}")
        service.abort(f"p{i}", "")
    service.publish(Publication("q0", "Q", sc.request.prefill_block_ids, sc.request.num_tokens))
    service.abort("q0", "")
    total = sum(_event_bytes(service)) + sum(_event_bytes(service, ("Q", 0)))
    assert total <= 500
    assert service.store.compacted_through(("P", 0)) > 0  # P held most: its oldest went
    assert service.store.compacted_through(("Q", 0)) == 0
    assert [e.transfer_id for e in service.store.releases_after(("Q", 0), 0)] == ["q0"]


def test_a_resume_below_the_kept_delivered_window_is_refused_not_silent() -> None:
    service, _, sc = setup(1, 1, release_resume_window=2)
    for t in ("a", "b", "c", "d"):
        publish(service, sc, t)
        service.abort(t, "")
    generation, cursor = service.feeds.start("P", 0, 0)
    events = service.feeds.after(("P", 0), generation, cursor)
    service.feeds.delivered(("P", 0), events[-1].sequence)  # a and b are trimmed: 2 are kept
    with pytest.raises(CompactedError) as err:
        service.feeds.start("P", 0, events[0].sequence)
    assert err.value.through == events[1].sequence
    _, cursor = service.feeds.start("P", 0, events[1].sequence)
    assert [e.transfer_id for e in service.feeds.after(("P", 0), generation, cursor)] == ["c", "d"]


def test_released_transfers_drop_their_block_ids() -> None:
    service, _, sc = setup(1, 1)
    publish(service, sc)
    assert service.get_transfer("t1").block_ids == sc.request.prefill_block_ids
    service.abort("t1", "")
    assert service.get_transfer("t1").block_ids == ()  # kept for GetTransfer, without them
    (event,) = service.store.releases_after(("P", 0), 0)
    assert [list(g) for g in event.block_ids] == [list(g) for g in sc.request.prefill_block_ids]


def test_one_engine_at_its_transfer_quota_does_not_stop_another() -> None:
    service, clock, sc = setup(1, 1, max_transfers_per_engine=3)
    register_engine(service, sc.prefill, "Q", Role.PREFILL, 2)
    for t in ("a", "b", "c"):
        publish(service, sc, t)
    ids = sum(len(g) for g in sc.request.prefill_block_ids)
    assert service.store.engine_usage("P") == (3, 3 * ids)
    with pytest.raises(LimitExceededError, match="--max-transfers-per-engine") as err:
        publish(service, sc, "d")
    assert err.value.field == "transfer_id"
    service.publish(Publication("q", "Q", sc.request.prefill_block_ids, sc.request.num_tokens))
    assert service.store.engine_usage("Q") == (1, ids)
    service.abort("a", "")  # released on every rank: its hold ends
    assert service.store.engine_usage("P") == (2, 2 * ids)
    publish(service, sc, "d")
    plan = service.get_plan(query(sc, 0, "d"))
    done(service, plan.plan_id, 0, plan.total_bytes)  # completed: released, hold ends
    assert service.store.engine_usage("P") == (2, 2 * ids)
    clock.advance(TTL_MS + 1)
    reap_all(service)  # b, c and q expire
    assert service.store.engine_usage("P") == service.store.engine_usage("Q") == (0, 0)
    clock.advance(20_000)
    reap_all(service)  # and are forgotten after retention, the counts unchanged
    assert service.store.engine_usage("P") == (0, 0) and not list(service.store.transfers())


def test_block_id_and_metadata_quotas_per_engine() -> None:
    sc = build_scenario(hybrid(), 1, 1, 100)
    ids = sum(len(g) for g in sc.request.prefill_block_ids)
    service, _, sc = setup(1, 1, max_block_ids_per_engine=2 * ids)
    publish(service, sc, "a")
    publish(service, sc, "b")
    with pytest.raises(LimitExceededError, match="--max-block-ids-per-engine") as err:
        publish(service, sc, "c")
    assert err.value.field == "block_ids"
    service, _ = make_service(max_metadata_bytes_per_engine=100)
    big = dataclasses.replace(
        registration(sc.prefill, "P", Role.PREFILL, 0), agent_metadata=b"m" * 101
    )
    with pytest.raises(LimitExceededError, match="--max-metadata-bytes-per-engine") as err:
        service.register_rank(big)
    assert err.value.field == "agent_metadata"
    service.register_rank(registration(sc.prefill, "P", Role.PREFILL, 0))  # small: accepted


def test_a_cursor_of_an_earlier_registration_is_refused_not_resumed() -> None:
    """A broker restarted without a shared store numbers releases anew: a watcher resuming
    with its old cursor would skip the new registration's first events. Naming the lease the
    cursor was read under makes the broker refuse instead."""
    service, _, sc = setup(1, 1)
    publish(service, sc, "before")
    service.abort("before", "")
    old_lease = service.store.get_rank(("P", 0)).lease_id
    generation, cursor = service.feeds.start("P", 0, 0, old_lease)
    (event,) = service.feeds.after(("P", 0), generation, cursor)
    restarted, _, _ = setup(1, 1)  # same engines, a fresh broker
    publish(restarted, sc, "after")
    restarted.abort("after", "")
    with pytest.raises(PreconditionError) as err:
        restarted.feeds.start("P", 0, event.sequence, old_lease)
    assert err.value.field == "lease_id"
    # What the check prevents: the same sequence numbers, so the old cursor skips "after".
    generation, cursor = restarted.feeds.start("P", 0, event.sequence)
    assert restarted.feeds.after(("P", 0), generation, cursor) == []
    new_lease = restarted.store.get_rank(("P", 0)).lease_id
    generation, cursor = restarted.feeds.start("P", 0, 0, new_lease)
    assert [e.transfer_id for e in restarted.feeds.after(("P", 0), generation, cursor)] == ["after"]


def test_registrations_beyond_max_ranks_are_refused() -> None:
    service, _ = make_service(max_ranks=3)
    sc = build_scenario(hybrid(), 2, 2, 100)
    register_engine(service, sc.prefill, "P", Role.PREFILL, 0)
    service.register_rank(registration(sc.decode, "D", Role.DECODE, 0, 1))
    with pytest.raises(LimitExceededError, match="3 registered ranks"):
        service.register_rank(registration(sc.decode, "D", Role.DECODE, 1, 1))
    service.register_rank(registration(sc.prefill, "P", Role.PREFILL, 1, 0))  # re-registering
