"""The storage contract (broker/store/contract.py), checked against both stores: records are
values; a unit of work sees its own writes and commits all of them or, when it raises midway,
none; every index a service call uses answers from the records put; due deadlines come back
until handled. Failures are injected in the middle of units, in the store and in the
service's own calls."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator

import pytest
from broker_helpers import FakeClock, hybrid, register_engine, registration
from conftest import RedisServer

from broker.api import PlanQuery, Publication, Report
from broker.config import ServiceConfig
from broker.records import RankLoss, RankRecord, ReleaseEvent, TransferRecord
from broker.service import BrokerService
from broker.store.contract import REDELIVER_MS, StateStore
from broker.store.memory import InMemoryStateStore
from broker.wire import ReleaseReason, ReportStatus, Role, TransferState
from harness.scenarios import build_scenario

SC = build_scenario(hybrid(), 2, 1, 100)
UNBOUNDED = (1 << 40, 1 << 40)


class Injected(RuntimeError):
    """The failure a test plants in the middle of a unit of work."""


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    if request.param == "memory":
        yield InMemoryStateStore()
    else:
        yield request.getfixturevalue("redis_server").store()


def rank(engine: str, tp_rank: int, generation: int, expires: int = 10_000) -> RankRecord:
    role = Role.PREFILL if engine.startswith("P") else Role.DECODE
    layout = SC.prefill if role is Role.PREFILL else SC.decode
    reg = registration(layout, engine, role, tp_rank, engine_index=ord(engine[-1]) % 8)
    return RankRecord(reg, f"lease-{engine}-{tp_rank}-{generation}", expires, 0, generation)


def transfer(engine: str, transfer_id: str, deadline: int = 5_000, **changes) -> TransferRecord:
    record = TransferRecord(
        transfer_id,
        engine,
        1,
        2,
        100,
        SC.request.prefill_block_ids,
        frozenset(),
        0,
        deadline,
        deadline,
        deadline,
        released=(None, None),
    )
    return dataclasses.replace(record, **changes)


def event(transfer_id: str) -> ReleaseEvent:
    return ReleaseEvent(0, transfer_id, ((1, 2),), ReleaseReason.COMPLETED, "", 0)


def snapshot(store: StateStore) -> tuple:
    """Everything the contract lets a caller read about the records these tests write."""
    keys = [("P", 0), ("P", 1), ("Q", 0), ("D", 0)]
    transfers = sorted((t.key, t) for t in store.transfers())
    return (
        store.ranks(),
        [store.rank_by_agent(r.registration.agent_name) for r in store.ranks()],
        store.count_ranks(),
        [store.ranks_named({name}) for name in ("P", "D", "D_dp1")],
        transfers,
        store.count_transfers(),
        [store.transfers_named(name) for name in ("t1", "t2")],
        [store.transfers_of(engine) for engine in ("P", "Q", "D")],
        [store.engine_usage(engine) for engine in ("P", "Q")],
        [[(e.transfer_id, e.block_ids) for e in store.releases_after(k, 0)] for k in keys],
        [(store.delivered(k), store.compacted_through(k)) for k in keys],
        store.losses(),
    )


def test_records_are_values(store: StateStore) -> None:
    store.put_rank(rank("P", 0, 1))
    got = store.get_rank(("P", 0))
    assert got == rank("P", 0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.lease_id = "changed"  # type: ignore[misc]
    store.put_transfer(transfer("P", "t1"))
    record = store.get_transfer(("P", "t1"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.state = TransferState.ABORTED  # type: ignore[misc]
    store.put_transfer(dataclasses.replace(record, state=TransferState.ABORTED))
    assert store.get_transfer(("P", "t1")).state is TransferState.ABORTED
    assert store.get_rank(("P", 9)) is None and store.get_transfer(("P", "none")) is None
    store.delete_rank(("P", 9))  # missing: nothing happens
    store.delete_transfer(("P", "none"))


def test_a_unit_sees_its_own_writes_and_commits_them_together(store: StateStore) -> None:
    def work() -> list:
        store.put_rank(rank("P", 0, 1))
        store.put_transfer(transfer("P", "t1"))
        seen = [
            store.get_rank(("P", 0)) is not None,
            store.rank_by_lease("lease-P-0-1") is not None,
            store.rank_by_agent("P-agent0") is not None,
            [r.key for r in store.engine_ranks("P")],
            store.transfers_named("t1"),
            store.transfers_of("P"),
        ]
        store.delete_transfer(("P", "t1"))
        seen.append(store.transfers_named("t1"))
        return seen

    assert store.transact(work) == [True, True, True, [("P", 0)], [("P", "t1")], [("P", "t1")], []]
    assert store.get_rank(("P", 0)) is not None and store.get_transfer(("P", "t1")) is None


def _fill(store: StateStore) -> None:
    """Records of every kind, committed."""
    for record in (rank("P", 0, 1), rank("P", 1, 2), rank("D", 0, 3)):
        store.put_rank(record)
    store.put_transfer(transfer("P", "t1"))
    store.put_transfer(transfer("Q", "t1", decode_engine_id="D"))
    store.append_release(("P", 0), event("t0"), *UNBOUNDED)
    store.mark_delivered(("P", 0), 1)
    store.put_loss(RankLoss("P", 2, 1, "deregistered"))


#: Writes of every kind a unit of work may make before it fails.
WRITES: dict[str, Callable[[StateStore], object]] = {
    "put rank": lambda s: s.put_rank(rank("Q", 0, 4)),
    "put data-parallel rank": lambda s: s.put_rank(rank("D_dp1", 0, 5)),
    "renew lease": lambda s: s.put_rank(dataclasses.replace(rank("P", 0, 1), lease_id="new")),
    "delete rank": lambda s: s.delete_rank(("P", 1)),
    "put transfer": lambda s: s.put_transfer(transfer("P", "t2")),
    "change transfer": lambda s: s.put_transfer(
        transfer(
            "P",
            "t1",
            state=TransferState.FAILED,
            block_ids=(),
            released=(ReleaseReason.ABORTED,) * 2,
        )
    ),
    "extend transfer": lambda s: s.put_transfer(transfer("Q", "t1", deadline=9_000)),
    "delete transfer": lambda s: s.delete_transfer(("Q", "t1")),
    "append release": lambda s: s.append_release(("P", 1), event("t1"), *UNBOUNDED),
    "mark delivered": lambda s: s.mark_delivered(("P", 0), 7),
    "trim releases": lambda s: s.trim_releases(("P", 0), 0),
    "drop releases": lambda s: s.drop_releases(("P", 0)),
    "put loss": lambda s: s.put_loss(RankLoss("D", 0, 3, "lease expired")),
    "move loss on": lambda s: s.put_loss(RankLoss("P", 2, 1, "deregistered", ("P", "t1"))),
    "delete loss": lambda s: s.delete_loss(RankLoss("P", 2, 1, "deregistered")),
}


@pytest.mark.parametrize("failing_after", range(1, len(WRITES) + 1))
def test_a_unit_that_raises_midway_commits_nothing(store: StateStore, failing_after: int) -> None:
    _fill(store)
    before = snapshot(store)
    writes = list(WRITES.values())

    def work() -> None:
        for write in writes[:failing_after]:
            write(store)
        raise Injected

    with pytest.raises(Injected):
        store.transact(work)
    assert snapshot(store) == before
    # The deadlines index was undone too: both transfers come due at their own deadline.
    assert store.due_transfers(4_999) == []
    assert sorted(store.due_transfers(5_000)) == [("P", "t1"), ("Q", "t1")]


def test_engines_expected_are_read_as_the_unit_sees_them(store: StateStore) -> None:
    """Expecting engines is a hint: their ranks, read ahead, still show the unit's own
    writes, and an engine with no ranks reads as none."""
    store.put_rank(rank("P", 0, 1))

    def work() -> tuple[list, list]:
        store.expect_engines(["P", "nobody"])
        store.transfers_named("t1")  # a read the expected engines may go with
        store.put_rank(rank("P", 1, 1))
        return [r.key for r in store.engine_ranks("P")], store.engine_ranks("nobody")

    assert store.transact(work) == ([("P", 0), ("P", 1)], [])


def test_engines_read_ahead_are_watched(redis_server: RedisServer) -> None:
    """A rank removed through another replica after its engine was read ahead fails the
    unit's commit: the unit runs again and reads the engine as it is."""
    from broker.store.redis import RedisStateStore

    prefix = f"ahead-{uuid.uuid4().hex[:12]}:"
    first = RedisStateStore.from_url(redis_server.url, prefix)
    other = RedisStateStore.from_url(redis_server.url, prefix)
    first.put_rank(rank("P", 0, 1))
    first.put_rank(rank("P", 1, 1))
    first.transact(lambda: first.engine_ranks("P"))  # its ranks, guessed in reads ahead
    seen: list[list] = []

    def work() -> list:
        first.expect_engines(["P"])
        first.transfers_named("t1")
        if not seen:
            other.delete_rank(("P", 0))  # between the read ahead and the commit
        seen.append([r.key for r in first.engine_ranks("P")])
        return seen[-1]

    assert first.transact(work) == [("P", 1)]
    assert seen == [[("P", 0), ("P", 1)], [("P", 1)]]


def test_ranks_read_ahead_for_a_report_are_watched(redis_server: RedisServer) -> None:
    """A replica reads the prefill ranks of a plan it handed out with the plan's transfer
    (what its report may release); one removed through another replica before the commit
    fails the unit, which reads it again."""
    from broker.store.redis import RedisStateStore

    prefix = f"ranks-ahead-{uuid.uuid4().hex[:12]}:"
    first = RedisStateStore.from_url(redis_server.url, prefix)
    other = RedisStateStore.from_url(redis_server.url, prefix)
    service, _ = _service(first)
    service.publish(Publication("t1", "P", SC.request.prefill_block_ids, SC.request.num_tokens))
    plan = service.get_plan(PlanQuery("t1", "D", 0, SC.request.decode_block_ids))
    seen: list[bool] = []

    def work() -> bool:
        key = first.transfer_of_plan(plan.plan_id)
        assert key is not None and first.get_transfer(key) is not None
        if not seen:
            other.delete_rank(("P", 0))  # between the read ahead and the commit
        seen.append(first.get_rank(("P", 0)) is not None)
        return seen[-1]

    assert first.transact(work) is False
    assert seen == [True, False]


def test_a_contact_stays_known_to_its_rank_generation_only(store: StateStore) -> None:
    """A decode rank's generation is told an agent's metadata once; a unit that fails tells
    nothing; the rank's next generation (its contacts dropped with it) is told again."""
    decode = ("D", 0)
    assert store.transact(lambda: store.add_contact(decode, 1, "a#1"))
    assert not store.transact(lambda: store.add_contact(decode, 1, "a#1"))

    def told_then_failed() -> None:
        assert store.add_contact(decode, 1, "b#1")
        raise Injected

    with pytest.raises(Injected):
        store.transact(told_then_failed)
    assert store.transact(lambda: store.add_contact(decode, 1, "b#1"))
    store.transact(lambda: store.drop_contacts(decode))
    assert store.transact(lambda: store.add_contact(decode, 2, "a#1"))
    assert not store.transact(lambda: store.add_contact(decode, 2, "a#1"))


def test_a_replica_remembers_contacts_by_rank_generation(redis_server: RedisServer) -> None:
    """A replica that knows a contact asks Redis nothing for it again, and a decode rank
    registered afresh through another replica (its contacts dropped) is told again by it."""
    from broker.store.redis import RedisStateStore
    from harness.redis_counts import RedisCost, RedisCounter

    prefix = f"contacts-{uuid.uuid4().hex[:12]}:"
    first = RedisStateStore.from_url(redis_server.url, prefix)
    other = RedisStateStore.from_url(redis_server.url, prefix)
    counter = RedisCounter(first)
    decode = ("D", 0)

    def told(store: StateStore, generation: int) -> bool:
        return store.transact(lambda: store.add_contact(decode, generation, "a#1"))

    assert told(first, 1) and not told(other, 1)  # the other learns it from Redis
    assert counter.measure(lambda: told(first, 1)) == (False, RedisCost(0, {}))
    other.transact(lambda: other.drop_contacts(decode))  # the rank went, through the other
    assert told(first, 2)


def test_losses_are_kept_by_rank_and_generation_and_read_by_engine(store: StateStore) -> None:
    first, again = RankLoss("P", 0, 1, "deregistered"), RankLoss("P", 0, 4, "lease expired")
    other = RankLoss("D", 1, 2, "re-registered")

    def work() -> list:
        store.put_transfer(transfer("P", "t1"))
        store.get_transfer(("P", "t1"))  # a Redis unit reads the losses with it
        for loss in (first, again, other):
            store.put_loss(loss)
        store.put_loss(dataclasses.replace(first, done_through=("P", "t1")))
        return [store.losses(("P",)), store.losses(("D", "Q")), len(store.losses())]

    moved = dataclasses.replace(first, done_through=("P", "t1"))
    assert store.transact(work) == [[moved, again], [other], 3]
    assert store.losses() == [other, moved, again]
    store.delete_loss(first)
    assert store.transact(lambda: store.losses(("P",))) == [again]


def test_indexes_answer_from_the_records_put(store: StateStore) -> None:
    _fill(store)
    assert [r.key for r in store.engine_ranks("P")] == [("P", 0), ("P", 1)]
    assert store.count_ranks() == 3
    assert store.ranks_named({"P", "D", "Q"}) == [("D", 0), ("P", 0), ("P", 1)]
    assert store.rank_by_lease("lease-P-1-2").key == ("P", 1)
    assert store.rank_by_agent("P-agent1").key == ("P", 1)
    assert store.transfers_named("t1") == [("P", "t1"), ("Q", "t1")]
    assert store.transfers_of("D") == [("Q", "t1")]  # D claimed Q's, not P's
    assert store.transfers_of("Q") == [("Q", "t1")]
    assert store.count_transfers() == 2
    held = sum(len(g) for g in SC.request.prefill_block_ids)
    assert store.engine_usage("P") == (1, held)
    planned = transfer("P", "t1", plans=(), decode_engine_id="D")
    store.put_transfer(planned)
    assert store.transfers_of("D") == [("P", "t1"), ("Q", "t1")]
    store.put_transfer(dataclasses.replace(planned, block_ids=()))  # released: holds nothing
    assert store.engine_usage("P") == (0, 0)
    store.delete_rank(("P", 1))
    assert store.rank_by_lease("lease-P-1-2") is None and store.rank_by_agent("P-agent1") is None
    assert store.ranks_named({"P"}) == [("P", 0)]
    store.delete_transfer(("Q", "t1"))
    assert store.transfers_named("t1") == [("P", "t1")] and store.transfers_of("Q") == []


def test_ranks_named_are_an_engine_and_its_data_parallel_ranks(store: StateStore) -> None:
    for record in (
        rank("P", 0, 1),
        rank("P_dp0", 0, 2),
        rank("P_dp0", 1, 3),
        rank("P_dp1", 0, 4),
        rank("P_dp1_dp2", 0, 5),  # rank 2 of P_dp1, not of P
        rank("Px", 0, 6),
        rank("D_dp0", 0, 7),
    ):
        store.put_rank(record)
    p, dp0, dp1 = [("P", 0)], [("P_dp0", 0), ("P_dp0", 1)], [("P_dp1", 0)]
    assert store.ranks_named({"P"}) == p + dp0 + dp1
    assert store.ranks_named({"P_dp1"}) == dp1 + [("P_dp1_dp2", 0)]
    assert store.ranks_named({"P_dp0", "D", "nobody"}) == [("D_dp0", 0)] + dp0
    assert store.ranks_named(set()) == []
    store.delete_rank(("P_dp0", 0))
    assert store.ranks_named({"P"}) == p + [("P_dp0", 1)] + dp1
    store.delete_rank(("P_dp0", 1))
    store.delete_rank(("P", 0))
    assert store.ranks_named({"P"}) == dp1

    def put_in_a_unit() -> list:
        store.put_rank(rank("P_dp3", 0, 8))
        store.delete_rank(("P_dp1", 0))
        return store.ranks_named({"P"})

    assert store.transact(put_in_a_unit) == [("P_dp3", 0)]  # its own writes count
    assert store.ranks_named({"P"}) == [("P_dp3", 0)]


def test_due_deadlines_come_back_until_handled(store: StateStore) -> None:
    store.put_rank(rank("P", 0, 1, expires=100))
    store.put_transfer(transfer("P", "t1", deadline=50))
    assert store.due_leases(99) == [] and store.due_transfers(49) == []
    assert store.due_leases(100) == [("P", 0)] and store.due_leases(100) == [("P", 0)]
    store.put_rank(dataclasses.replace(rank("P", 0, 1), lease_expires_at_ms=500))  # renewed
    assert store.due_leases(100) == []
    assert store.due_transfers(50) == [("P", "t1")]
    assert store.due_transfers(50) == []  # handed out once...
    assert store.due_transfers(50 + REDELIVER_MS) == [("P", "t1")]  # ...again if never put back
    store.put_transfer(transfer("P", "t1", deadline=10 * REDELIVER_MS))
    assert store.due_transfers(9 * REDELIVER_MS) == []
    # Put back with a later deadline before it came due (an extension): due then, not before.
    store.put_transfer(transfer("P", "t1", deadline=12 * REDELIVER_MS))
    assert store.due_transfers(11 * REDELIVER_MS) == []
    assert store.due_transfers(12 * REDELIVER_MS) == [("P", "t1")]


def test_due_transfers_come_a_bounded_number_at_a_time_earliest_first(store: StateStore) -> None:
    """However many transfers fall due together, one call hands out at most its limit,
    earliest deadline first, and the next call the next ones."""
    for i in range(7):
        store.put_transfer(transfer("P", f"t{i}", deadline=100 - i))  # t6 earliest
    assert store.due_transfers(200, limit=3) == [("P", "t6"), ("P", "t5"), ("P", "t4")]
    assert store.due_transfers(200, limit=3) == [("P", "t3"), ("P", "t2"), ("P", "t1")]
    assert store.due_transfers(200, limit=3) == [("P", "t0")]
    assert store.due_transfers(200, limit=3) == []


# --------------------------------------------------------------------------- through the service


def _service(store: StateStore) -> tuple[BrokerService, FakeClock]:
    clock = FakeClock()
    config = ServiceConfig(default_ttl_ms=5_000, lease_ttl_ms=60_000, retention_ms=10_000)
    service = BrokerService(store, clock, config)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    register_engine(service, SC.decode, "D", Role.DECODE, 1)
    return service, clock


@pytest.mark.parametrize(
    "call,failing",
    [
        ("publish", "put_transfer"),
        ("claim", "add_contact"),
        ("report", "append_release"),
        ("abort", "append_release"),
        ("deregister", "put_transfer"),
        ("extend", "put_transfer"),
    ],
)
def test_a_service_call_failing_in_the_store_midway_changes_nothing(
    store: StateStore, monkeypatch: pytest.MonkeyPatch, call: str, failing: str
) -> None:
    service, clock = _service(store)
    service.publish(Publication("t1", "P", SC.request.prefill_block_ids, SC.request.num_tokens))
    query = PlanQuery("t1", "D", 0, SC.request.decode_block_ids)
    plan = service.get_plan(query) if call == "report" else None
    clock.advance(1_000)  # an extension now moves the expiry
    before = snapshot(store)
    calls = {
        "publish": lambda: service.publish(
            Publication("t2", "P", SC.request.prefill_block_ids, SC.request.num_tokens)
        ),
        "claim": lambda: service.get_plan(query),
        "report": lambda: service.report(Report(plan.plan_id, "D", 0, ReportStatus.DONE)),
        "abort": lambda: service.abort("t1", "user left"),
        "deregister": lambda: service.deregister(store.get_rank(("P", 0)).lease_id),
        "extend": lambda: service.extend("D", [("t1", "P")]),
    }

    def broken(*args: object, **kwargs: object) -> None:
        raise Injected

    with monkeypatch.context() as patch:
        patch.setattr(store, failing, broken)
        with pytest.raises(Injected):
            calls[call]()
    assert snapshot(store) == before
    calls[call]()  # the same call, now that the store works, goes through
    assert snapshot(store) != before
