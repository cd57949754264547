"""What a call costs does not grow with the cluster: engines of equal layouts share one
planner (its templates), the planner cache is bounded in bytes, and registration and
authorization read the caller's own ranks only. On both stores."""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from broker_helpers import (
    FakeClock,
    assert_inside_regions,
    hybrid,
    register_engine,
    register_request,
    registration,
)

import broker.engines
from broker import convert
from broker.api import PlanQuery, PlanResult, Publication
from broker.auth import AccessGuard, Authenticator, Identity
from broker.config import ServiceConfig
from broker.errors import IncompatibleLayoutsError, LayoutError, LimitExceededError
from broker.observer import ServiceObserver
from broker.planner import PairPlanner, RankPlan
from broker.presets import resolve_model
from broker.service import BrokerService
from broker.store.contract import StateStore
from broker.store.redis import RedisStateStore
from broker.v1 import broker_pb2 as pb
from broker.wire import Role
from harness.scenarios import Scenario, build_scenario

#: Every test runs against the in-memory store and against Redis (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_store")
SC = build_scenario(hybrid(), 2, 2, 100)


class FirstAsks(ServiceObserver):
    """Whether each plan handed out found its planner cached."""

    def __init__(self) -> None:
        self.cache_hits: list[bool] = []

    def plan_handed_out(self, seconds: float, plan: RankPlan, cache_hit: bool) -> None:
        self.cache_hits.append(cache_hit)


def first_ask(service: BrokerService, sc: Scenario, decode: str, transfer_id: str) -> PlanResult:
    """Publish a transfer from ``P`` and have rank 0 of ``decode`` ask for it (claiming it:
    every decode rank is planned)."""
    service.publish(
        Publication(transfer_id, "P", sc.request.prefill_block_ids, sc.request.num_tokens)
    )
    return service.get_plan(PlanQuery(transfer_id, decode, 0, sc.request.decode_block_ids))


def make_service(**config: int) -> tuple[BrokerService, FirstAsks]:
    observer = FirstAsks()
    service = BrokerService(clock=FakeClock(), config=ServiceConfig(**config), observer=observer)
    return service, observer


def test_engines_of_equal_layouts_share_the_planner_and_keep_their_addresses() -> None:
    service, observer = make_service()
    bigger = build_scenario(hybrid(), 2, 2, 100, decode_offset=8)  # 8 more decode blocks
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    register_engine(service, SC.decode, "D1", Role.DECODE, 1)
    register_engine(service, SC.decode, "D2", Role.DECODE, 2)
    register_engine(service, bigger.decode, "D3", Role.DECODE, 3)
    first_ask(service, SC, "D1", "t1")
    result = first_ask(service, SC, "D2", "t2")
    first_ask(service, bigger, "D3", "t3")
    assert observer.cache_hits == [False, True, False]
    expected = PairPlanner(SC.prefill, SC.decode).plan_rank(0, SC.request)
    assert result.total_bytes == expected.nbytes
    for source in result.sources:  # D2's and P's regions, not those of D1
        assert_inside_regions(
            source.local, registration(SC.decode, "D2", Role.DECODE, 0, 2).regions
        )
        assert_inside_regions(
            source.remote,
            registration(SC.prefill, "P", Role.PREFILL, source.prefill_rank, 0).regions,
        )


def test_a_layout_digest_is_computed_once_per_engine_generation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When an engine's last rank registers, not on the plan path."""
    digested: list[int] = []
    digest = broker.engines.layout_digest
    monkeypatch.setattr(
        broker.engines, "layout_digest", lambda layout: digested.append(1) or digest(layout)
    )
    service, observer = make_service()
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    register_engine(service, SC.decode, "D1", Role.DECODE, 1)
    register_engine(service, SC.decode, "D2", Role.DECODE, 2)
    assert len(digested) == 3
    for i, decode in enumerate(("D1", "D2", "D1")):
        first_ask(service, SC, decode, f"t{i}")
    assert len(digested) == 3
    service.register_rank(registration(SC.decode, "D1", Role.DECODE, 1, 1))  # a new generation
    first_ask(service, SC, "D1", "t3")
    assert len(digested) == 4
    assert observer.cache_hits[-1]


def test_the_planner_cache_drops_the_least_recently_used_past_its_bytes() -> None:
    """Three decode layouts whose planners hold ``size`` bytes each once planned; the cache
    holds two and a half. A planner is counted when it is handed out and on the next ask
    (its planning done), so the third one pushes out the least recently used then."""
    scenarios = {
        name: build_scenario(hybrid(), 2, 2, 100, decode_offset=offset)
        for name, offset in (("A", 0), ("B", 8), ("C", 16))
    }
    sizes = set()
    for sc in scenarios.values():
        planner = PairPlanner(sc.prefill, sc.decode)
        planner.plan(sc.request)
        sizes.add(planner.nbytes)
    (size,) = sizes
    service, observer = make_service(planner_cache_bytes=size * 5 // 2)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    for i, (name, sc) in enumerate(scenarios.items()):
        register_engine(service, sc.decode, name, Role.DECODE, i + 1)
    for i, name in enumerate("ABACABC"):
        first_ask(service, scenarios[name], name, f"t{i}")
    # B is dropped when A is asked again (C then counted), A when C is (B then counted).
    assert observer.cache_hits == [False, False, True, False, True, False, True]
    assert service.engines.cached_bytes <= size * 5 // 2


def test_incompatible_layouts_name_the_engines_asking_even_when_shared() -> None:
    service, observer = make_service()
    other = build_scenario(hybrid(kv_heads=8, name="other"), 2, 2, 100)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    register_engine(service, other.decode, "X1", Role.DECODE, 1)
    register_engine(service, other.decode, "X2", Role.DECODE, 2)
    for i, decode in enumerate(("X1", "X2", "X1")):
        with pytest.raises(IncompatibleLayoutsError) as err:
            first_ask(service, SC, decode, f"t{i}")
        assert err.value.field == "model_fingerprint"
        (sharer,) = {"X1", "X2"} - {decode}
        assert f"decode engine {decode!r} cannot read from prefill engine 'P'" in str(err.value)
        assert repr(sharer) not in str(err.value)
    assert observer.cache_hits == []


# --------------------------------------------------------------------------- registration


class CountingStore:
    """A real store whose calls count the rows they hand back: the records or keys of a
    list, one for any other answer."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.rows = 0
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            answer = attr(*args, **kwargs)
            self.calls[name] += 1
            self.rows += len(answer) if isinstance(answer, list) else answer is not None
            return answer

        return counted

    def reset(self) -> None:
        self.rows = 0
        self.calls.clear()


def reads_of(calls: Callable[[BrokerService, AccessGuard], object], unrelated: int) -> Counter:
    """Rows and calls the store answers ``calls`` with, after ``unrelated`` TP1 engines of
    other callers registered."""
    store = CountingStore(BrokerService().store)
    service = BrokerService(store, FakeClock(), ServiceConfig(max_ranks=1024))
    guard = AccessGuard(Authenticator(False, None), store, max_ranks_per_identity=3)
    tp1 = build_scenario(hybrid(), 1, 1, 100)
    for i in range(unrelated):
        register_engine(service, tp1.decode, f"U{i}_dp0", Role.DECODE, 8 + i)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    service.register_rank(registration(SC.decode, "X_dp0", Role.DECODE, 0, 1))
    store.reset()
    calls(service, guard)
    return store.calls + Counter(rows=store.rows)


def register_as_x(service: BrokerService, guard: AccessGuard) -> None:
    """X registers rank 1 of X_dp0 and rank 0 of X_dp1; its quota of 3 then refuses a fourth
    rank but lets one of its ranks register again."""
    x = Identity(frozenset({"X"}))
    for engine, rank in (("X_dp0", 1), ("X_dp1", 0)):
        guard.register(x, engine, rank)
        service.register_rank(registration(SC.decode, engine, Role.DECODE, rank, 2 + rank))
    with pytest.raises(LimitExceededError, match="holds 3 registered ranks"):
        guard.register(x, "X_dp1", 1)
    guard.register(x, "X_dp0", 0)


def see_as_x(service: BrokerService, guard: AccessGuard) -> None:
    """X, whose X_dp0 may read a transfer nobody claimed yet, is one of its parties."""
    service.publish(Publication("t1", "P", SC.request.prefill_block_ids, 100))
    assert guard.see_transfer(Identity(frozenset({"X"})), "t1") == "P"


@pytest.mark.parametrize("calls", [register_as_x, see_as_x])
def test_registration_and_authorization_read_only_the_callers_ranks(
    calls: Callable[[BrokerService, AccessGuard], object],
) -> None:
    alone = reads_of(calls, 0)
    among_others = reads_of(calls, 200)
    assert among_others == alone
    assert not {"ranks", "transfers"} & set(alone)  # no operator listing


# A real model's layout: many segments per group, the objects equal layouts no longer repeat.
NANO_TP8 = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 8, 8, 1024)


def register_converted(service: BrokerService, engines: int, first: int = 0) -> list[str]:
    """Register ``engines`` TP8 decode engines of one model as the server does, each rank's
    request converted afresh; returns their lease ids."""
    return [
        service.register_rank(
            convert.registration_from_proto(
                register_request(NANO_TP8.decode, f"D{e}", pb.ROLE_DECODE, rank, e)
            )
        ).lease_id
        for e in range(first, first + engines)
        for rank in range(8)
    ]


def test_ranks_of_equal_layouts_hold_one_layout_until_none_does() -> None:
    """Engines of one model and TP size declare equal layouts: every rank's registration,
    as converted from its request and as a store gives it back (on Redis, a replica too,
    decoding what it reads), holds the one layout of its tp rank; the layout goes when the
    last registration holding it does, once each store has seen the ranks gone."""
    service, _ = make_service()
    leases = register_converted(service, 3)
    stores = [service.store]
    if isinstance(service.store, RedisStateStore):
        stores.append(RedisStateStore(service.store.client, service.store.prefix))
    for store in stores:
        ranks = [r for e in ("D0", "D1", "D2") for r in store.engine_ranks(e)]
        by_rank = [{id(r.registration.layout) for r in ranks if r.key[1] == n} for n in range(8)]
        assert all(len(layouts) == 1 for layouts in by_rank)
        assert len(set().union(*by_rank)) == 8  # one per tp rank: their shards differ
    kept = weakref.ref(ranks[0].registration.layout)
    for lease in leases:
        service.deregister(lease)
    for store in stores:  # each reads them gone
        assert not any(store.get_rank(r.key) for r in ranks)
    del ranks
    gc.collect()
    assert kept() is None


def test_a_registered_rank_leaves_the_collector_few_objects() -> None:
    """What a registered rank keeps, once collected, is a handful of objects the garbage
    collector walks (its record, its registration, what the store indexes it by): its
    layout is shared and its regions are plain values, which the collector stops tracking;
    so a collection of the middle generation after a cluster registered stays short."""
    service, _ = make_service()
    register_converted(service, 1)  # the store's and catalog's first objects
    gc.collect()
    before = len(gc.get_objects())
    register_converted(service, 8, first=1)
    gc.collect()
    per_rank = (len(gc.get_objects()) - before) / 64
    assert per_rank <= 6, f"{per_rank:.1f} tracked objects per registered rank"


def test_a_transfer_in_flight_leaves_the_collector_few_objects() -> None:
    """A transfer published and planned (both decode ranks' plans made and one handed out)
    keeps about a dozen objects the garbage collector walks: its records keep their fields
    in slots (no ``__dict__`` beside each) and its timeline as plain tuples, which the
    collector stops tracking; each collection of the middle generation walks every transfer
    in flight."""
    service, _ = make_service(max_transfers=1000, max_transfers_per_engine=1000)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    register_engine(service, SC.decode, "D", Role.DECODE, 1)
    first_ask(service, SC, "D", "warm")
    gc.collect()
    before = len(gc.get_objects())
    for i in range(100):
        first_ask(service, SC, "D", f"t{i}")
    gc.collect()
    per_transfer = (len(gc.get_objects()) - before) / 100
    assert per_transfer <= 12.5, f"{per_transfer:.1f} tracked objects per transfer in flight"


def test_a_layout_declared_before_is_not_converted_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Converting and validating a layout is most of a registration's conversion: a rank
    declaring the layout another rank of its tp rank holds gets that one without either; a
    layout refused is refused each time it is declared."""
    converted: list[int] = []
    convert_layout = convert.rank_layout_from_proto
    monkeypatch.setattr(
        convert,
        "rank_layout_from_proto",
        lambda msg, tp_rank: converted.append(tp_rank) or convert_layout(msg, tp_rank),
    )
    gc.collect()  # layouts of earlier tests gone
    service, _ = make_service()
    register_converted(service, 3)
    assert sorted(converted) == list(range(8))  # once per tp rank, for three engines
    bad = register_request(NANO_TP8.decode, "X", pb.ROLE_DECODE, 0, 9)
    bad.layout.groups[0].segments[0].shape[0] = 0
    for _ in range(2):
        with pytest.raises(LayoutError):
            convert.registration_from_proto(bad)
    assert len(converted) == 10


def test_a_transfer_published_leaves_the_collector_few_objects() -> None:
    """A transfer published (from its request, as the server converts it) and not yet
    asked for keeps a few objects the garbage collector walks: a publication naming no
    decode engine shares one empty set of them, not one of its own."""
    service, _ = make_service(max_transfers=1000, max_transfers_per_engine=1000)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    groups = [pb.BlockIds(ids=g) for g in SC.request.prefill_block_ids]

    def publish(transfer_id: str) -> None:
        request = pb.PublishBlocksRequest(
            transfer_id=transfer_id,
            engine_id="P",
            block_ids=groups,
            num_tokens=SC.request.num_tokens,
        )
        service.publish(convert.publication_from_proto(request))

    publish("warm")
    gc.collect()
    before = len(gc.get_objects())
    for i in range(100):
        publish(f"t{i}")
    gc.collect()
    per_transfer = (len(gc.get_objects()) - before) / 100
    assert per_transfer <= 3.5, f"{per_transfer:.1f} tracked objects per transfer published"


def test_delivered_release_events_kept_for_resuming_leave_the_collector_few_objects(
    default_store: str,
) -> None:
    """Release events delivered to a watcher are kept for streams that resume (the resume
    window). In memory their block ids are then packed: each event stops leaving the garbage
    collector an object per KV-cache group (and the tuple of them) beside its record. On
    both stores a stream resuming from before them reads them back as they were sent."""
    service, _ = make_service(max_transfers=1000, max_transfers_per_engine=1000)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    key, groups = ("P", 0), len(SC.request.prefill_block_ids)
    assert groups >= 2
    for i in range(100):
        service.publish(
            Publication(f"t{i}", "P", SC.request.prefill_block_ids, SC.request.num_tokens)
        )
        service.abort(f"t{i}", "test", "P")
    generation, cursor = service.feeds.start("P", 0, 0)
    events = service.feeds.after(key, generation, cursor)
    sent = [(e.transfer_id, [list(g) for g in e.block_ids], e.nbytes) for e in events]
    first, last = events[0].sequence, events[-1].sequence
    del events
    gc.collect()
    before = len(gc.get_objects())
    service.feeds.delivered(key, last)
    gc.collect()
    untracked = (before - len(gc.get_objects())) / 100
    if default_store == "memory":  # Redis keeps the events, not the broker
        assert untracked >= groups, f"{untracked:.1f} objects fewer per delivered event"
    resumed = service.feeds.after(key, generation, first - 1)
    assert [(e.transfer_id, [list(g) for g in e.block_ids], e.nbytes) for e in resumed] == sent
    assert len(sent) == 100
