"""RedisStateStore against a real private ``redis-server``: durability across store objects
and server restarts, server-side TTLs, the release cursor, due-transfer redelivery, two
replicas racing (claims and reports) through ``transact``, cross-replica release
notifications, and ``pdbroker serve --store``. The service's own rules run against Redis in
test_service.py and test_server.py (the ``default_store`` parametrization)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import redis
from broker_helpers import (
    FakeClock,
    hybrid,
    reap_all,
    register_engine,
    register_request,
    registration,
)
from conftest import RedisServer, start_redis
from redis._parsers import _RESP2Parser
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from broker.api import PlanQuery, Publication, Report
from broker.auth import AccessGuard, Authenticator, Identity
from broker.config import ServiceConfig
from broker.errors import NotFoundError, StoreUnavailableError
from broker.layout import EngineLayout, GroupKind, GroupLayout, RankLayout, Segment
from broker.records import RankRecord, ReleaseEvent, TransferRecord
from broker.service import BrokerService
from broker.store import codec
from broker.store.contract import REDELIVER_MS
from broker.store.redis import RedisStateStore
from broker.store.redis_unit import Recent, exchange, pack
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import ReleaseReason, ReportStatus, Role
from harness.brokers import serve_command
from harness.scenarios import Scenario, build_scenario

#: The transfer every fleet publishes: id t1 of prefill engine P.
T1 = ("P", "t1")
#: Release backlog budgets that never drop an event (rank, total).
UNBOUNDED = (1 << 40, 1 << 40)

CONFIG = ServiceConfig(default_ttl_ms=5_000, lease_ttl_ms=60_000, retention_ms=10_000)


def fleet(
    store: RedisStateStore, p_tp: int, d_tp: int, clock: FakeClock
) -> tuple[BrokerService, Scenario]:
    """A service on ``store`` with engines P (prefill) and D (decode) registered and transfer
    ``t1`` published."""
    service = BrokerService(store, clock, CONFIG)
    sc = build_scenario(hybrid(), p_tp, d_tp, 100)
    register_engine(service, sc.prefill, "P", Role.PREFILL, 0)
    register_engine(service, sc.decode, "D", Role.DECODE, 1)
    service.publish(Publication("t1", "P", sc.request.prefill_block_ids, sc.request.num_tokens))
    return service, sc


def query(sc: Scenario, d: int) -> PlanQuery:
    return PlanQuery("t1", "D", d, sc.request.decode_block_ids)


def done(plan_id: str, d: int) -> Report:
    return Report(plan_id, "D", d, ReportStatus.DONE, 0, 10)


def plain(t: TransferRecord) -> tuple:
    """A transfer as comparable values (plans hold numpy columns)."""
    plans = {
        p.decode_rank: (
            p.plan_id,
            p.block_ids,
            p.handed_out,
            p.status,
            p.intact,
            p.rank_plan.naive_bytes,
            [
                (
                    s.prefill_rank,
                    np.stack([s.region, s.local_offset, s.remote_offset, s.length]).tolist(),
                )
                for s in p.rank_plan.sources
            ],
        )
        for p in t.plans
    }
    fields = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name != "plans"}
    return fields, plans


def events(
    store: RedisStateStore, key: tuple[str, int], after: int = 0
) -> list[tuple[str, ReleaseReason]]:
    return [(e.transfer_id, e.reason) for e in store.releases_after(key, after)]


def twin(store: RedisStateStore) -> RedisStateStore:
    """A second store object on the same server and prefix: another broker replica."""
    return RedisStateStore(
        type(store.client)(
            connection_pool=type(store.client.connection_pool)(
                **store.client.connection_pool.connection_kwargs
            )
        ),
        store.prefix,
    )


def interleave(store: RedisStateStore, method: str, other: Callable[[], object]) -> list[object]:
    """Make ``store``'s next call of ``method`` run ``other`` (another replica's operation)
    right after it read, once; returns where ``other``'s result will be."""
    original = getattr(store, method)
    results: list[object] = []

    def hooked(*args: object) -> object:
        value = original(*args)
        if not results:
            results.append(other())
        return value

    setattr(store, method, hooked)
    return results


# --------------------------------------------------------------------------- durability


def test_records_survive_a_new_store_object_and_a_server_restart(tmp_path) -> None:
    server = start_redis(tmp_path)
    try:
        clock = FakeClock()
        store = RedisStateStore.from_url(server.url, "durable:")
        service, sc = fleet(store, 2, 2, clock)
        plans = [service.get_plan(query(sc, d)) for d in range(2)]
        service.report(done(plans[0].plan_id, 0))
        before = (store.ranks(), plain(store.get_transfer(T1)), events(store, ("P", 0)))
        assert before[2] == [("t1", ReleaseReason.COMPLETED)]

        server.stop()
        server = start_redis(tmp_path, server.port)
        again = RedisStateStore.from_url(server.url, "durable:")
        assert (again.ranks(), plain(again.get_transfer(T1)), events(again, ("P", 0))) == before
        assert again.transfer_of_plan(plans[1].plan_id) == T1
        assert again.rank_by_lease(before[0][0].lease_id) == before[0][0]
        # A new broker on the restarted server finishes what the first one started.
        restarted = BrokerService(again, clock, CONFIG)
        outcome = restarted.report(done(plans[1].plan_id, 1))
        assert outcome.intact and outcome.state.value == "completed"
        assert events(again, ("P", 1)) == [("t1", ReleaseReason.COMPLETED)]
        assert again.next_counter("generation") == 5  # four registrations before the restart
    finally:
        server.stop()


def test_every_field_round_trips(redis_server: RedisServer) -> None:
    """Transfers, plans and release events keep every field, including fields that are empty
    in the service tests (a field added to a record must survive Redis too)."""
    store = redis_server.store()
    service, sc = fleet(store, 2, 1, FakeClock())
    plan = service.get_plan(query(sc, 0))
    service.report(Report(plan.plan_id, "D", 0, ReportStatus.FAILED, 0, 10, "boom"))
    record = store.get_transfer(T1)
    assert record.finished_at_ms is not None and record.released and record.timeline

    def filled(obj):
        """``obj`` with every empty field of its own set (strings "set", numbers 7)."""
        return dataclasses.replace(
            obj,
            **{
                f.name: "set" if f.type == "str" else 7
                for f in dataclasses.fields(obj)
                if getattr(obj, f.name) in ("", 0, False)
                and f.name not in ("decode_rank", "bytes_moved")
            },
        )

    record = filled(dataclasses.replace(record, plans=tuple(filled(p) for p in record.plans)))
    store.put_transfer(record)
    assert plain(twin(store).get_transfer(T1)) == plain(record)
    event = ReleaseEvent(0, "t", ((1, 2), (3,)), ReleaseReason.CONSUMER_FAILED, "why", 5)
    event = dataclasses.replace(
        event, **{f.name: "set" for f in dataclasses.fields(event) if getattr(event, f.name) == ""}
    )
    store.append_release(("P", 9), event, *UNBOUNDED)
    (back,) = twin(store).releases_after(("P", 9), 0)
    assert dataclasses.replace(back, sequence=0) == event


def test_a_compressed_segment_keeps_its_entry_size(redis_server: RedisServer) -> None:
    """A registration whose segment holds one entry per 4 tokens (a compressed cache) reads
    back as registered; one stored before entries held several tokens reads back as one
    token per entry."""
    store = redis_server.store()
    latent = Segment("c4", 0, (4, 8), (16, 2), "bfloat16", token_axis=0, tokens_per_entry=4)
    group = GroupLayout(GroupKind.ATTENTION, ("l0",), (latent,), 16, 16, 64)
    layout = EngineLayout("compressed", 1, (RankLayout(0, 1, 4, 64, (group,)),))
    BrokerService(store, FakeClock(), CONFIG).register_rank(
        registration(layout, "C", Role.PREFILL, 0)
    )
    back = twin(store).get_rank(("C", 0))
    assert back is not None and back.registration == registration(layout, "C", Role.PREFILL, 0)
    kv = Segment("kv", 0, (16, 2), (4, 2), "bfloat16", token_axis=0)
    plain_rank = RankLayout(0, 1, 4, 64, (dataclasses.replace(group, segments=(kv,)),))
    stored = json.loads(
        codec.encode_registration(dataclasses.replace(back.registration, layout=plain_rank))
    )
    stored["layout"][3][0][5][0].pop()  # as stored before segments had an entry size
    assert codec.decode_registration(json.dumps(stored), b"").layout == plain_rank


def test_server_side_ttls_forget_what_nobody_renews(redis_server: RedisServer) -> None:
    store = redis_server.store(rank_ttl_ms=400, transfer_ttl_ms=400)
    service, sc = fleet(store, 1, 1, FakeClock())
    service.get_plan(query(sc, 0))
    lease = store.get_rank(("P", 0)).lease_id
    for _ in range(3):  # keep-alives of P renew its keys; D's and the transfer's lapse
        time.sleep(0.2)
        service.keep_alive(lease)
    assert store.get_rank(("P", 0)) is not None and store.rank_by_lease(lease) is not None
    assert store.get_rank(("D", 0)) is None and store.engine_ranks("D") == []
    assert store.ranks_named({"P", "D"}) == [("P", 0)]
    assert store.get_transfer(T1) is None and list(store.transfers()) == []
    assert [r.registration.key for r in store.ranks()] == [("P", 0)]
    assert store.client.smembers(store._key("ranks")) == {b"0:P"}  # index entry cleaned
    assert store.count_transfers() == 0
    assert store.due_transfers(2**62) == []
    time.sleep(0.5)
    assert store.ranks() == [] and store.rank_by_lease(lease) is None


def test_a_deregistered_data_parallel_rank_leaves_no_index_entry(
    redis_server: RedisServer,
) -> None:
    store = redis_server.store()
    service = BrokerService(store, FakeClock(), CONFIG)
    sc = build_scenario(hybrid(), 1, 1, 100)
    (lease,) = register_engine(service, sc.decode, "D_dp0", Role.DECODE, 1)
    assert store.client.smembers(store._key("deployment", "D")) == {b"0:D_dp0"}
    service.deregister(lease.lease_id)
    assert store.ranks_named({"D"}) == []
    assert not store.client.exists(store._key("deployment", "D"), store._key("engine", "D_dp0"))


def test_release_cursor_resumes_from_another_store(redis_server: RedisServer) -> None:
    store = redis_server.store()
    key = ("P", 0)
    for i in range(5):
        store.append_release(
            key, ReleaseEvent(0, f"t{i}", ((i,),), ReleaseReason.COMPLETED, "", i), *UNBOUNDED
        )
    sequences = [e.sequence for e in store.releases_after(key, 0)]
    assert sequences == sorted(set(sequences)) and len(sequences) == 5
    store.mark_delivered(key, sequences[2])
    store.mark_delivered(key, sequences[0])  # the cursor never goes back
    store.trim_releases(key, 1)
    other = twin(store)
    assert other.compacted_through(key) == sequences[1]  # t0 and t1 are gone
    assert other.delivered(key) == sequences[2]
    assert [e.transfer_id for e in other.releases_after(key, 0)] == ["t2", "t3", "t4"]
    assert [e.transfer_id for e in other.releases_after(key, sequences[2])] == ["t3", "t4"]
    other.append_release(
        key, ReleaseEvent(0, "t5", ((5,),), ReleaseReason.EXPIRED, "ttl", 9), *UNBOUNDED
    )
    assert store.releases_after(key, sequences[4])[0].sequence > sequences[4]
    store.drop_releases(key)
    assert other.releases_after(key, 0) == [] and other.delivered(key) == 0
    assert other.compacted_through(key) == 0


def test_due_transfers_come_once_and_again_if_never_put_back(redis_server: RedisServer) -> None:
    store = redis_server.store()
    service, _ = fleet(store, 1, 1, FakeClock())
    deadline = store.get_transfer(T1).deadline_ms
    assert store.due_transfers(deadline - 1) == []
    assert store.due_transfers(deadline) == [T1]
    assert store.due_transfers(deadline) == []  # another replica's reaper gets nothing
    # A reaper that took it and died: it comes back once REDELIVER_MS passed.
    assert store.due_transfers(deadline + REDELIVER_MS) == [T1]
    service.clock.advance(CONFIG.default_ttl_ms + 2 * REDELIVER_MS)
    reap_all(service)  # expires it: put back with the retention deadline
    assert store.get_transfer(T1).state.value == "expired"
    assert store.due_transfers(service.clock.now + REDELIVER_MS) == []


# --------------------------------------------------------------------------- replicas


def test_two_replicas_claiming_at_once(redis_server: RedisServer) -> None:
    """Replica B claims the transfer while replica A's claim is between read and write: A's
    transaction fails, runs again and hands out B's claim (one claim, one set of plans)."""
    clock = FakeClock()
    store_a = redis_server.store()
    service_a, sc = fleet(store_a, 1, 2, clock)
    store_b = twin(store_a)
    service_b = BrokerService(store_b, clock, CONFIG)
    from_b = interleave(store_a, "engine_ranks", lambda: service_b.get_plan(query(sc, 1)))
    plan_a = service_a.get_plan(query(sc, 0))
    plan_b = from_b[0]
    assert plan_a.plan_id.rsplit("-", 1)[0] == plan_b.plan_id.rsplit("-", 1)[0]  # one claim
    for d, plan in enumerate((plan_a, plan_b)):
        service_b.report(done(plan.plan_id, d))
    assert events(store_a, ("P", 0)) == [("t1", ReleaseReason.COMPLETED)]


def test_a_claim_between_a_replicas_read_ahead_and_its_commit(redis_server: RedisServer) -> None:
    """A replica that saw transfer t1 reads its record with the set of transfers named t1,
    watched: replica B claiming it right after that read fails A's commit, and A, run
    again, hands out B's claim."""
    clock = FakeClock()
    store_a = redis_server.store()
    service_a, sc = fleet(store_a, 1, 2, clock)  # published here: A knows what t1 names
    service_b = BrokerService(twin(store_a), clock, CONFIG)
    from_b = interleave(store_a, "transfers_named", lambda: service_b.get_plan(query(sc, 1)))
    plan_a = service_a.get_plan(query(sc, 0))
    assert plan_a.plan_id.rsplit("-", 1)[0] == from_b[0].plan_id.rsplit("-", 1)[0]  # one claim


def test_an_engine_read_ahead_is_watched(redis_server: RedisServer) -> None:
    """A plan reads its prefill engine's ranks with its decode engine's, in one round trip
    and watched: replica B keeping a prefill rank alive between that read and A's commit
    fails A's commit, and A runs again on B's record."""
    clock = FakeClock()
    store_a = redis_server.store()
    service_a, sc = fleet(store_a, 1, 2, clock)
    service_b = BrokerService(twin(store_a), clock, CONFIG)
    prefill = store_a.get_rank(("P", 0))
    assert prefill is not None
    interleave(store_a, "engine_ranks", lambda: service_b.keep_alive(prefill.lease_id))
    commits: list[bool] = []
    commit = store_a._units.link.commit

    def counted(commands: list) -> object:
        replies = commit(commands)
        commits.append(replies is not None)
        return replies

    store_a._units.link.commit = counted  # type: ignore[method-assign]
    service_a.get_plan(query(sc, 0))
    assert commits == [False, True]


def test_a_transfer_another_replica_wrote_since_is_read_anew(redis_server: RedisServer) -> None:
    """A replica takes a transfer it wrote as written only while Redis holds what it wrote:
    once replica B has claimed it, A reads B's record."""
    clock = FakeClock()
    store_a = redis_server.store()
    _, sc = fleet(store_a, 1, 1, clock)  # published here
    published = store_a.get_transfer(T1)
    assert published is not None and not published.plans
    BrokerService(twin(store_a), clock, CONFIG).get_plan(query(sc, 0))
    claimed = store_a.get_transfer(T1)
    assert claimed is not None and claimed.decode_engine_id == "D" and len(claimed.plans) == 1


def test_two_replicas_counting_reports_at_once_release_each_rank_once(
    redis_server: RedisServer,
) -> None:
    clock = FakeClock()
    store_a = redis_server.store()
    service_a, sc = fleet(store_a, 2, 2, clock)
    plans = [service_a.get_plan(query(sc, d)) for d in range(2)]
    store_b = twin(store_a)
    service_b = BrokerService(store_b, clock, CONFIG)
    from_b = interleave(
        store_a,
        "transfer_of_plan",
        lambda: service_b.report(done(plans[1].plan_id, 1)),
    )
    outcome_a = service_a.report(done(plans[0].plan_id, 0))
    assert from_b[0].intact and outcome_a.intact and outcome_a.state.value == "completed"
    assert [events(store_b, ("P", p)) for p in range(2)] == [[("t1", ReleaseReason.COMPLETED)]] * 2
    # Both replicas abort at once: the transfer is already finished, nothing is released again.
    service_a.abort("t1", "late")
    service_b.abort("t1", "late")
    assert [len(store_a.releases_after(("P", p), 0)) for p in range(2)] == [1, 1]


def test_an_agent_name_another_replica_gave_to_another_rank_is_read_anew(
    redis_server: RedisServer,
) -> None:
    """A replica reads the rank an agent or lease key named when it last saw it in the same
    round trip as the key: when another replica has since given the name to another rank,
    or re-registered the rank under a new lease, the key's answer wins."""
    store_a = redis_server.store()
    store_b = twin(store_a)
    layout = build_scenario(hybrid(), 1, 1, 100).prefill
    first, second = (
        RankRecord(
            dataclasses.replace(registration(layout, e, Role.PREFILL, 0), agent_name="shared"),
            f"lease-{e}",
            1,
            0,
            1,
        )
        for e in ("E", "F")
    )
    store_a.put_rank(first)
    assert store_a.rank_by_agent("shared") == first == store_a.rank_by_lease("lease-E")
    store_b.transact(lambda: (store_b.delete_rank(first.key), store_b.put_rank(second)))
    assert store_a.rank_by_agent("shared") == second
    assert store_a.rank_by_lease("lease-E") is None
    store_b.put_rank(dataclasses.replace(second, lease_id="lease-F2"))
    assert store_a.rank_by_lease("lease-F") is None
    assert store_a.rank_by_lease("lease-F2") == dataclasses.replace(second, lease_id="lease-F2")


def test_a_stale_plan_of_a_transfer_published_again_is_unknown_not_denied(
    redis_server: RedisServer,
) -> None:
    """A replica remembers the transfer of each plan it handed out; when another replica
    has since deleted that transfer and published it again for another decode engine, the
    old plan's report is an unknown plan to authorization and to the service."""
    clock = FakeClock()
    store_a = redis_server.store()
    service_a, sc = fleet(store_a, 1, 1, clock)
    register_engine(service_a, sc.decode, "D2", Role.DECODE, 2)
    stale = service_a.get_plan(query(sc, 0))
    store_b = twin(store_a)
    service_b = BrokerService(store_b, clock, CONFIG)
    store_b.transact(lambda: store_b.delete_transfer(T1))
    publication = Publication("t1", "P", sc.request.prefill_block_ids, sc.request.num_tokens)
    service_b.publish(publication)
    service_b.get_plan(PlanQuery("t1", "D2", 0, sc.request.decode_block_ids))
    guard = AccessGuard(Authenticator(False, None), store_a)
    guard.report_plan(Identity(frozenset({"D"})), stale.plan_id)  # not PERMISSION_DENIED
    with pytest.raises(NotFoundError, match="no plan"):
        service_a.report(done(stale.plan_id, 0))


def test_releases_wake_watchers_on_other_replicas(redis_server: RedisServer) -> None:
    store = redis_server.store()
    woken: queue.Queue = queue.Queue()
    stop = twin(store).subscribe_releases(woken.put)
    try:
        time.sleep(0.1)  # the subscription is in place
        store.append_release(
            ("P", 3), ReleaseEvent(0, "t", ((1,),), ReleaseReason.ABORTED, "", 0), *UNBOUNDED
        )
        assert woken.get(timeout=5) == ("P", 3)
        store.drop_releases(("engine:with:colons", 0))
        assert woken.get(timeout=5) == ("engine:with:colons", 0)
    finally:
        stop()


# --------------------------------------------------------------------------- pdbroker serve


def serve(*flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        serve_command(*flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PDBROKER_STORE": "memory"},
    )


def test_serve_replicas_on_one_redis_share_registrations(redis_server: RedisServer) -> None:
    replicas = [serve("--store", redis_server.url) for _ in range(2)]
    try:
        addresses = [p.stdout.readline().rsplit(" ", 1)[-1].strip() for p in replicas]
        layout = build_scenario(hybrid(), 1, 1, 100).prefill
        with grpc.insecure_channel(addresses[0]) as one, grpc.insecure_channel(addresses[1]) as two:
            pb_grpc.BrokerStub(one).RegisterRank(
                register_request(layout, "P", pb.ROLE_PREFILL, 0), timeout=10
            )
            engines = pb_grpc.BrokerStub(two).ListEngines(pb.ListEnginesRequest(), timeout=10)
        assert [e.engine_id for e in engines.engines] == ["P"]
    finally:
        for p in replicas:
            p.terminate()
            assert p.wait(10) == 0
    assert [r.registration.key for r in RedisStateStore.from_url(redis_server.url).ranks()] == [
        ("P", 0)
    ]


def test_serve_refuses_unknown_or_unreachable_stores(redis_server: RedisServer) -> None:
    bad = serve("--store", "mysql://db/0")
    assert bad.wait(10) != 0 and "neither memory nor redis://" in bad.stderr.read()
    closed = redis_server.url.rsplit(":", 1)[0] + ":1/0"
    down = serve("--store", closed)
    assert down.wait(30) != 0 and "cannot reach" in down.stderr.read()


def test_a_stalled_server_fails_calls_within_the_timeout_then_at_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """SIGSTOP in the middle of a transaction (its connection watching a key): the call fails
    with StoreUnavailableError after one timeout, later calls fail without waiting, and the
    store works again once the server resumes."""
    server = start_redis(tmp_path_factory.mktemp("redis-stall"))
    store = RedisStateStore.from_url(server.url, "stall:", timeout_ms=300)
    fleet(store, 1, 1, FakeClock())  # publishes t1

    def read_then_stall() -> TransferRecord | None:
        store.get_transfer(T1)  # watched
        os.kill(server.process.pid, signal.SIGSTOP)
        return store.get_transfer("t2")

    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as first:
            store.transact(read_then_stall)
        first_s = time.monotonic() - started
        assert first.value.field == "store" and f"127.0.0.1:{server.port}" in str(first.value)
        assert not store.available
        started = time.monotonic()
        for _ in range(20):
            with pytest.raises(StoreUnavailableError):
                store.transact(lambda: store.get_transfer(T1))
        at_once_s = time.monotonic() - started
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    try:
        deadline = time.monotonic() + 5
        while not store.available:
            assert time.monotonic() < deadline, "the store never came back"
            time.sleep(0.02)
        assert store.transact(lambda: store.get_transfer(T1)).transfer_id == "t1"
    finally:
        server.stop()
    assert 0.25 < first_s < 1.0, first_s  # one 300 ms timeout, not one per retry or attempt
    assert at_once_s < 0.1, at_once_s


def test_what_a_replica_remembers_is_bounded() -> None:
    """The newest ``size`` entries stay; putting one again makes it the newest."""
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    recent.put("a", 3)
    recent.put("c", 4)
    assert [recent.get(k) for k in "abc"] == [3, None, 4]


def test_commands_packed_here_reach_redis_as_redis_py_packs_them(
    redis_server: RedisServer,
) -> None:
    """Text (UTF-8), bytes holding the protocol's own separators, integers and floats are
    sent as redis-py's packer sends them; other types are refused before anything is sent."""
    store = redis_server.store()
    values = ["naïve ✓", b"a\r\n$3\r\nb\x00", 12345678901234, -7, 0.25]
    commands = [("SET", f"{store.prefix}v{i}", v) for i, v in enumerate(values)]
    redis_py = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    assert pack(commands) == b"".join(b"".join(redis_py.pack(*c)) for c in commands)
    connection = store.client.connection_pool.get_connection()
    assert exchange(connection, commands) == [b"OK"] * len(values)
    read = exchange(connection, [("GET", f"{store.prefix}v{i}") for i in range(len(values))])
    assert read == ["naïve ✓".encode(), b"a\r\n$3\r\nb\x00", b"12345678901234", b"-7", b"0.25"]
    for bad in (True, None, [1]):
        with pytest.raises(TypeError, match="is not a Redis argument"):
            pack([("SET", "k", bad)])


@pytest.mark.parametrize("parser", ["hiredis", "python"])
def test_a_round_trips_replies_read_at_once_are_redis_pys(
    redis_server: RedisServer, parser: str
) -> None:
    """Replies of every kind, one larger than a socket read among them, come back as
    ``read_response`` gives them, with hiredis's reader or redis-py's own parser; an error
    reply raises and drops the connection (its other replies unread), which the next round
    trip opens again; a round trip counts as the health check it makes unneeded."""
    store = RedisStateStore.from_url(redis_server.url, f"replies-{parser}:")
    if parser == "python":
        kwargs = store.client.connection_pool.connection_kwargs
        kwargs["parser_class"] = _RESP2Parser  # the RESP3 one where RESP3 is spoken
    connection = store.client.connection_pool.get_connection()
    assert (type(connection._parser).__name__ == "_HiredisParser") == (parser == "hiredis")
    big = os.urandom(3 << 20)  # several socket reads
    k = store.prefix
    writes = [
        ("DEL", f"{k}s", f"{k}h", f"{k}big"),
        ("SADD", f"{k}s", "a", "b"),
        ("HSET", f"{k}h", "f", "v"),
        ("SET", f"{k}big", big),
    ]
    assert exchange(connection, writes) == [0, 2, 1, b"OK"]
    reads = [
        ("GET", f"{k}big"),
        ("HMGET", f"{k}h", "f", "missing"),
        ("GET", f"{k}none"),
        ("INCRBY", f"{k}n", 0),
        ("SMEMBERS", f"{k}s"),
        ("HGETALL", f"{k}h"),
    ]
    connection.next_health_check = time.monotonic() + 1  # not due: no PING sent first
    replies = exchange(connection, reads)
    assert connection.next_health_check > time.monotonic() + 25  # 30 s from the replies
    for command in reads:
        connection.send_command(*command)
    assert replies == [connection.read_response() for _ in reads]
    assert replies[0] == big and replies[1] == [b"v", None] and replies[2] is None
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        exchange(connection, [("GET", f"{k}s"), ("GET", f"{k}h"), ("GET", f"{k}big")])
    assert connection._sock is None  # dropped: the replies after the error are not read
    assert exchange(connection, [("GET", f"{k}big")]) == [big]


def test_a_changed_registration_is_written_anew(redis_server: RedisServer) -> None:
    """A keep-alive writes the registration as it was stored; one registered again with
    other memory is encoded and written afresh."""
    store = redis_server.store()
    layout = build_scenario(hybrid(), 1, 1, 100).prefill
    first = RankRecord(registration(layout, "E", Role.PREFILL, 0), "lease-E", 1, 0, 1)
    store.put_rank(first)
    store.put_rank(dataclasses.replace(first, lease_expires_at_ms=2))  # a keep-alive
    moved = registration(layout, "E", Role.PREFILL, 0, engine_index=5)
    assert moved.regions != first.registration.regions
    again = RankRecord(moved, "lease-E2", 3, 0, 2)
    store.put_rank(again)
    assert twin(store).get_rank(("E", 0)) == again
