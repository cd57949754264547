"""A rank that goes away while its engine holds many transfers fails them a slice per unit
of work (:data:`~broker.registry.TRANSFERS_PER_UNIT`), on both stores: no unit changes more,
yet each transfer fails the moment the rank is gone for every call that touches it (a DONE
report of a plan that read it is refused), the reaper of another broker on the same store
(a replica, or this one restarted) finishes what a removal left, every transfer ends FAILED
and the surviving prefill rank is released once per transfer; on Redis a replica whose unit
read a transfer before another removed its rank runs again and sees it. In memory, a broker whose
rank's lease expires under 3,000 transfers holds its event loop, in any one reap, for a small
share of the CPU all its reaps take (the times and wall-clock gaps are printed: on a shared
host they are the host's too). The
reaper's pass over transfers past their deadline stops starting units once its slice is
spent, as its pass over expired leases does."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from broker_helpers import FakeClock, hybrid, longest_loop_gap, register_engine
from conftest import RedisServer

from broker.api import PlanQuery, Publication, Report
from broker.config import ServiceConfig
from broker.errors import AbortedError
from broker.records import TransferKey, TransferRecord
from broker.registry import REAP_SLICE_S, TRANSFERS_PER_UNIT
from broker.server import BrokerServer
from broker.service import BrokerService
from broker.store.contract import StateStore
from broker.wire import ReleaseReason, ReportStatus, Role, TransferState
from harness.scenarios import build_scenario

CONFIG = ServiceConfig(default_ttl_ms=3_600_000, lease_ttl_ms=60_000)
SC = build_scenario(hybrid(), 2, 2, 100)
#: Transfers the prefill engine holds: several slices' worth.
HELD = 3 * TRANSFERS_PER_UNIT + 5


def _publish(service: BrokerService, transfer_id: str, ttl_ms: int = 0) -> None:
    request = SC.request
    service.publish(
        Publication(transfer_id, "P", request.prefill_block_ids, request.num_tokens, ttl_ms)
    )


def _expiring(held: int) -> tuple[BrokerService, FakeClock]:
    """A broker where ``P`` published ``held`` transfers ``t0``, ... due in 1 s."""
    clock = FakeClock()
    service = BrokerService(clock=clock, config=CONFIG)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    for i in range(held):
        _publish(service, f"t{i}", ttl_ms=1_000)
    return service, clock


def _count_changes_per_unit(store: StateStore, per_unit: list[int] | None = None) -> list[int]:
    """Transfers written by each unit of work on ``store`` from now on, appended to
    ``per_unit`` (instrumented in place: the store's own methods still do the work)."""
    per_unit = [] if per_unit is None else per_unit
    put_transfer, transact = store.put_transfer, store.transact

    def counted_put(record: Any) -> None:
        per_unit[-1] += 1
        put_transfer(record)

    def counted_transact(operation: Callable[[], Any], *args: Any) -> Any:
        per_unit.append(0)
        return transact(operation, *args)

    store.put_transfer = counted_put  # type: ignore[method-assign]
    store.transact = counted_transact  # type: ignore[method-assign]
    return per_unit


def _replica(service: BrokerService) -> BrokerService:
    """Another broker on ``service``'s store (in memory: the same one)."""
    store = service.store
    if hasattr(store, "client"):
        from broker.store.redis import RedisStateStore

        store = RedisStateStore(store.client, store.prefix)
    return BrokerService(store, service.clock, CONFIG)


@pytest.mark.usefixtures("default_store")
def test_a_departure_fails_its_engines_transfers_a_slice_per_unit() -> None:
    clock = FakeClock()
    service = BrokerService(clock=clock, config=CONFIG)
    leases = register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    register_engine(service, SC.decode, "D", Role.DECODE, 1)
    for i in range(HELD - 1):
        _publish(service, f"t{i:04d}")
    _publish(service, "zz")  # last by key: no slice reaches it before the reaper's last
    plan = service.get_plan(PlanQuery("zz", "D", 0, SC.request.decode_block_ids))
    replica = _replica(service)
    per_unit = _count_changes_per_unit(service.store)
    if replica.store is not service.store:
        per_unit = _count_changes_per_unit(replica.store, per_unit)

    service.deregister(leases[0].lease_id)
    assert service.store.losses(), "the removal told every transfer in one unit"
    with pytest.raises(AbortedError):  # its prefill rank is gone: the data is invalid
        replica.report(Report(plan.plan_id, "D", 0, ReportStatus.DONE, 0, 10))
    assert replica.get_transfer("t0190").state is TransferState.FAILED
    for _ in range(10 * HELD):
        if not replica.reap():
            break
    assert not replica.store.losses()
    assert max(per_unit) <= TRANSFERS_PER_UNIT, per_unit
    assert sum(n > 1 for n in per_unit) >= 2, per_unit  # sliced, not one by one

    listing = replica.list_transfers(include_finished=True)
    assert listing.counts == {TransferState.FAILED: HELD}
    for t in listing.transfers:
        assert t.end_detail == "prefill rank 0 deregistered", t
    released = replica.store.releases_after(("P", 1), 0)
    assert sorted(e.transfer_id for e in released) == sorted(
        t.transfer_id for t in listing.transfers
    )
    assert {e.reason for e in released} == {ReleaseReason.ABORTED}
    assert replica.store.releases_after(("P", 0), 0) == []  # the departed rank's queue went


@pytest.mark.usefixtures("default_store")
def test_the_reaper_expires_due_transfers_a_slice_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each unit of work takes a quarter of the reaper's slice on a clock that moves only
    with them: a pass starts at most four (one more for rounding), and passes go on until
    every transfer expired."""
    held = 50
    service, clock = _expiring(held)
    per_unit = _count_changes_per_unit(service.store)
    unit_s = REAP_SLICE_S / 4
    clocked = SimpleNamespace(perf_counter=lambda: len(per_unit) * unit_s)
    monkeypatch.setattr("broker.registry.time", clocked)
    monkeypatch.setattr("broker.service.time", clocked)
    clock.advance(1_000)

    per_pass = []
    while True:
        before = len(per_unit)
        more = service.reap()
        per_pass.append(len(per_unit) - before)
        if not more:
            break
    assert max(per_pass) <= 5, per_pass
    assert sum(per_pass) == held, per_pass
    assert service.list_transfers().counts == {TransferState.EXPIRED: held}


@pytest.mark.usefixtures("default_store")
def test_a_pass_takes_due_transfers_a_bounded_number_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many transfers due at once: a reaper pass asks the store for at most
    ``DUE_PER_CALL`` at a time (one reply, one batch of keys), and asks again after a full
    batch while its slice lasts, so one pass with time to spare expires them all."""
    held = 50
    service, clock = _expiring(held)
    monkeypatch.setattr("broker.service.DUE_PER_CALL", 8)
    handed: list[int] = []
    due = service.store.due_transfers

    def counted(now_ms: int, limit: int) -> list[TransferKey]:
        keys = due(now_ms, limit)
        handed.append(len(keys))
        return keys

    monkeypatch.setattr(service.store, "due_transfers", counted)
    now = SimpleNamespace(perf_counter=lambda: 0.0)
    monkeypatch.setattr("broker.registry.time", now)
    monkeypatch.setattr("broker.service.time", now)
    clock.advance(1_000)
    assert service.reap() is False  # one pass, all done
    assert handed == [8] * 6 + [2]  # asked again after each full batch only
    assert service.list_transfers().counts == {TransferState.EXPIRED: held}

    # Passes ending inside a batch (each unit a quarter of the slice) go on with the rest
    # of it, then ask again: the reaper says work is left until none is.
    for i in range(held):
        _publish(service, f"u{i}", ttl_ms=1_000)
    per_unit = _count_changes_per_unit(service.store)
    now.perf_counter = lambda: len(per_unit) * REAP_SLICE_S / 4
    clock.advance(1_000)
    while service.reap():
        pass
    counts = service.list_transfers(include_finished=True).counts
    assert counts == {TransferState.EXPIRED: 2 * held}, counts


def test_a_departure_committed_while_a_replica_reports_makes_it_look_again(
    redis_server: RedisServer,
) -> None:
    """On Redis: replica B reads a transfer for a DONE report, replica A removes its prefill
    rank before B commits; B's commit fails (it read the departures) and its second attempt
    sees the departure: the report is refused, the transfer FAILED."""
    a = BrokerService(redis_server.store(), FakeClock(), CONFIG)
    leases = register_engine(a, SC.prefill, "P", Role.PREFILL, 0)
    register_engine(a, SC.decode, "D", Role.DECODE, 1)
    for i in range(TRANSFERS_PER_UNIT):
        _publish(a, f"t{i:04d}")
    _publish(a, "zz")  # beyond the removal's own slice
    plan = a.get_plan(PlanQuery("zz", "D", 0, SC.request.decode_block_ids))
    b = _replica(a)
    read = b.store.get_transfer

    def read_then_lose_the_rank(key: TransferKey) -> TransferRecord | None:
        found = read(key)
        if key == ("P", "zz") and a.store.get_rank(("P", 0)) is not None:
            a.deregister(leases[0].lease_id)  # committed between B's read and its commit
        return found

    b.store.get_transfer = read_then_lose_the_rank  # type: ignore[method-assign]
    with pytest.raises(AbortedError):
        b.report(Report(plan.plan_id, "D", 0, ReportStatus.DONE, 0, 10))
    assert a.get_transfer("zz").state is TransferState.FAILED


def test_an_expiry_under_many_transfers_keeps_the_loop_answering(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In memory, where units of work run on the event loop."""
    caplog.set_level(logging.ERROR, logger="broker")  # 3,000 warnings are not the point
    clock = FakeClock()
    service = BrokerService(clock=clock, config=CONFIG)
    register_engine(service, SC.prefill, "P", Role.PREFILL, 0)
    held = 3_000
    for i in range(held):
        _publish(service, f"t{i}")

    busy: list[float] = []  # CPU seconds of each reap: what it holds the loop for, preemption aside
    reap = service.reap

    def timed_reap() -> bool:
        started = time.thread_time()
        try:
            return reap()
        finally:
            busy.append(time.thread_time() - started)

    service.reap = timed_reap  # type: ignore[method-assign]

    async def scenario() -> float:
        server = BrokerServer(service, "127.0.0.1:0", reap_interval_ms=5)
        await server.start()
        try:
            stop = asyncio.Event()
            ticker = asyncio.create_task(longest_loop_gap(stop, 0.001))
            await asyncio.sleep(0.05)
            clock.advance(CONFIG.lease_ttl_ms)  # both ranks' leases expire
            deadline = time.monotonic() + 30
            while service.store.count_ranks() or service.store.losses():
                assert time.monotonic() < deadline, service.store.losses()
                await asyncio.sleep(0.01)
            stop.set()
            return await ticker
        finally:
            await server.stop(None)

    gc.disable()  # a full collection of this heap pauses ~25 ms, whatever the unit
    try:
        longest = asyncio.run(scenario())
    finally:
        gc.enable()
    assert service.list_transfers().counts == {TransferState.FAILED: held}
    total = sum(busy)
    print(
        f"\n3,000 transfers failed in {len(busy)} reaps, the longest {max(busy) * 1e3:.1f} ms "
        f"of CPU of {total * 1e3:.1f}; longest event loop gap {longest * 1e3:.1f} ms"
    )
    # Against the reaps' own total, so the bound holds on a slow or busy machine: one reap
    # failing them all would hold nearly all of it; sliced, each holds a few percent.
    assert max(busy) < total / 4, (
        f"a reap held the loop for {max(busy) * 1e3:.0f} ms of CPU, "
        f"{max(busy) / total:.0%} of the {total * 1e3:.0f} ms all reaps took"
    )
