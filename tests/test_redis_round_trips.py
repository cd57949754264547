"""Round trips to Redis per broker call, pinned: each call of a transfer's life (and a
rank's) costs the same few round trips in a cluster of one pair as in one of ten engines
holding 40 other transfers, and no more than :data:`PINNED` (a change that adds one fails
here; one that removes some lowers the pin); and the same commands and values read, there
and among 2,048 registered ranks. Counted on the store's connections against a real
``redis-server`` (:mod:`harness.redis_counts`), in the steady state: a first cycle loads the
scripts and this replica's caches, the second is measured."""

from __future__ import annotations

import itertools

import pytest
from prerequisites import require_module

require_module("redis", "dev")

from broker_helpers import FakeClock, hybrid, register_engine, registration
from conftest import RedisServer

from broker import service as service_module
from broker.api import PlanQuery, Publication, Report
from broker.config import ServiceConfig
from broker.records import RankRecord
from broker.service import BrokerService
from broker.store.redis import RedisStateStore
from broker.wire import ReportStatus, Role
from harness.redis_counts import RedisCost, RedisCounter
from harness.scenarios import Scenario, build_scenario

CONFIG = ServiceConfig(default_ttl_ms=600_000, lease_ttl_ms=60_000)
#: Round trips of each call in the steady state.
PINNED = {
    "RegisterRank (first rank of an engine)": 6,
    "RegisterRank (its last rank)": 7,
    "KeepAlive": 2,
    "PublishBlocks": 5,
    "GetTransferPlan (first ask)": 2,
    "GetTransferPlan (later rank)": 2,
    "ReportTransfer": 2,
    "ReportTransfer (last: releases)": 2,
    "Deregister": 3,
    "reap (one lease expires)": 8,
    "reap (nothing due)": 3,
}


class Cluster:
    """A service on a counted Redis store: prefill ``P`` and decode ``D`` (TP 2 each) and,
    when large, eight more engines with ``held`` transfers of theirs in flight."""

    def __init__(self, store: RedisStateStore, engines: int, held: int) -> None:
        self.counter = RedisCounter(store)
        self.clock = FakeClock()
        self.service = BrokerService(store, self.clock, CONFIG)
        self.sc: Scenario = build_scenario(hybrid(), 2, 2, 100)
        self.leases: list[str] = []
        roles = itertools.cycle([("P", Role.PREFILL), ("D", Role.DECODE)])
        for i, (kind, role) in zip(range(engines), roles):
            name = kind if i < 2 else f"{kind}{i}"
            layout = self.sc.prefill if role is Role.PREFILL else self.sc.decode
            leases = register_engine(self.service, layout, name, role, i)
            self.leases += [lease.lease_id for lease in leases]
        for i in range(held):
            self._publish(f"held{i}", "P2")
        self.ids = itertools.count()

    def _publish(self, transfer_id: str, engine_id: str = "P") -> int:
        request = self.sc.request
        pub = Publication(transfer_id, engine_id, request.prefill_block_ids, request.num_tokens)
        return self.service.publish(pub)

    def _keep_alive(self) -> None:
        for lease_id in self.leases:
            self.service.keep_alive(lease_id)

    def cycle(self) -> dict[str, int]:
        """Round trips of each call of one transfer's and one engine's life."""
        trips: dict[str, int] = {}
        self.costs: dict[str, RedisCost] = {}

        def measured(name: str, call: object) -> object:
            result, cost = self.counter.measure(call)  # type: ignore[arg-type]
            trips[name], self.costs[name] = cost.round_trips, cost
            return result

        n, service, sc = next(self.ids), self.service, self.sc
        self._keep_alive()
        new = f"N{n}"
        lease = measured(
            "RegisterRank (first rank of an engine)",
            lambda: service.register_rank(registration(sc.prefill, new, Role.PREFILL, 0, 20)),
        )
        last = measured(
            "RegisterRank (its last rank)",
            lambda: service.register_rank(registration(sc.prefill, new, Role.PREFILL, 1, 20)),
        )
        measured("KeepAlive", lambda: service.keep_alive(lease.lease_id))
        measured("PublishBlocks", lambda: self._publish(f"t{n}"))
        plans = [
            measured(
                name,
                lambda d=d: service.get_plan(
                    PlanQuery(f"t{n}", "D", d, sc.request.decode_block_ids)
                ),
            )
            for d, name in enumerate(
                ("GetTransferPlan (first ask)", "GetTransferPlan (later rank)")
            )
        ]
        for d, name in enumerate(("ReportTransfer", "ReportTransfer (last: releases)")):
            report = Report(plans[d].plan_id, "D", d, ReportStatus.DONE, 0, 10)
            measured(name, lambda report=report: service.report(report))
        measured("Deregister", lambda: service.deregister(lease.lease_id))
        self.clock.advance(30_000)  # the other rank of N is due first
        self._keep_alive()
        self.clock.advance(30_001)
        measured("reap (one lease expires)", service.reap)
        assert service.store.get_rank((new, 1)) is None and last.lease_id
        measured("reap (nothing due)", service.reap)
        return trips


@pytest.fixture(autouse=True)
def _whole_reaper_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round trips are counted here, not time: a reaper pass is never cut short at its
    slice's end by a slow host (which would leave its work, and its round trips, for the
    next pass)."""
    monkeypatch.setattr(service_module, "REAP_SLICE_S", 60.0)


def test_round_trips_per_call_are_few_and_fixed(redis_server: RedisServer) -> None:
    """And the commands Redis runs per call are the same in both clusters."""
    small, large = Cluster(redis_server.store(), 2, 0), Cluster(redis_server.store(), 10, 40)
    for cluster in (small, large):
        cluster.cycle()  # scripts loaded, this replica's caches filled
    trips = {"one pair": small.cycle(), "ten engines": large.cycle()}
    print("\ncall: round trips, commands, values read (one pair; ten engines, 40 held)")
    for name, n in trips["one pair"].items():
        ours, theirs = small.costs[name], large.costs[name]
        print(
            f"{name:40s} {n:3d} {ours.total_commands:4d} {ours.reply_values:4d}   "
            f"{theirs.total_commands:4d} {theirs.reply_values:4d}"
        )
    assert trips == {"one pair": PINNED, "ten engines": PINNED}
    assert small.costs == large.costs


def test_a_call_costs_the_same_among_2048_ranks(redis_server: RedisServer) -> None:
    """No call reads what grows with the registered ranks: RegisterRank, an expiry and every
    other call send the same commands and read the same number of values with one engine
    pair registered as with 1,024 engines (2,048 ranks)."""
    few, many = Cluster(redis_server.store(), 2, 0), Cluster(redis_server.store(), 1_024, 0)
    for cluster in (few, many):
        cluster.cycle()  # scripts loaded, this replica's caches filled
        cluster.cycle()
    assert many.service.store.count_ranks() == 2_048
    assert few.costs == many.costs


def _rank(engine_id: str) -> RankRecord:
    layout = build_scenario(hybrid(), 1, 1, 100).prefill
    return RankRecord(
        registration(layout, engine_id, Role.PREFILL, 0), f"lease-{engine_id}", 1, 0, 1
    )


def test_a_unit_that_raised_leaves_no_watch_to_fail_the_next(redis_server: RedisServer) -> None:
    """Its watches are cleared with the next unit's first commands: a key it watched that
    changed since does not make the next unit's ``EXEC`` fail and run again."""
    store = redis_server.store()
    counter = RedisCounter(store)
    store.put_rank(_rank("E"))

    def read_then_fail() -> None:
        store.get_rank(("E", 0))  # watched
        raise LookupError("refused")

    with pytest.raises(LookupError):
        store.transact(read_then_fail)
    store.client.hset(f"{store.prefix}rank:0:E", "exp", 1)  # as another replica would
    _, cost = counter.measure(lambda: store.transact(lambda: store.put_rank(_rank("F"))))
    assert cost.commands.get("exec") == 1, cost.commands
