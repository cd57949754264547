"""Faults survived, with real processes: a ``pdbroker serve`` process, and prefill and decode
engines as processes with NIXL agents moving real bytes (``harness.engines.engine_main``,
driven here command by command). SIGKILL stands for a crash.

After each fault: no transfer left unfinished in the broker, no prefill rank released twice
(the prefill engine reports it), and no read of released blocks — a prefill engine scrubs a
rank's pages with POISON the moment it is released, so a decode rank that copied them after
that would find mismatches; every fetch that succeeds is verified byte for byte.

Protocol-level faults (duplicate and out-of-order reports, a plan outliving its TTL, a release
stream that reconnects) use a raw gRPC client against the same real server.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from prerequisites import require_module

require_module("nixl", "engine")

from broker_helpers import hybrid, register_request
from test_e2e import MAMBA2
from test_e2e import hybrid as e2e_model

from broker.client_security import PLAINTEXT
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.brokers import BrokerProcess
from harness.engines import engine_main
from harness.fleet import PairSpec
from harness.scenarios import build_scenario

LEASE_MS = 1000
WAIT_S = 30.0
PAIR = PairSpec("FA+Mamba2 P2->D2", e2e_model("m2", MAMBA2, 4), 2, 2, 40, 300)
P_LAYOUT, D_LAYOUT = PAIR.layouts(4)


@dataclass
class Engine:
    """One engine process and every message it sent."""

    role: str
    engine_id: str
    process: mp.process.BaseProcess
    conn: object
    messages: list[tuple] = field(default_factory=list)

    def pump(self) -> None:
        while self.conn.poll():
            try:
                self.messages.append(self.conn.recv())
            except EOFError:
                return

    def wait_for(self, test: Callable[[tuple], bool], timeout_s: float = WAIT_S) -> tuple:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            self.pump()
            for message in self.messages[seen:]:
                if message[0] == "error":
                    raise AssertionError(f"{self.engine_id} failed:\n{message[2]}")
                if test(message):
                    return message
            seen = len(self.messages)
            self.conn.poll(0.05)
        raise AssertionError(
            f"{self.engine_id}: nothing matched within {timeout_s} s: {self.messages}"
        )

    def kinds(self, kind: str) -> list[tuple]:
        self.pump()
        return [m for m in self.messages if m[0] == kind]


def start_engine(role: str, engine_id: str, target: str) -> Engine:
    layout, peer = (P_LAYOUT, D_LAYOUT) if role == "prefill" else (D_LAYOUT, P_LAYOUT)
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(
        target=engine_main,
        args=(role, engine_id, layout, peer, target, child, 0, PLAINTEXT),
        daemon=True,
    )
    process.start()
    engine = Engine(role, engine_id, process, parent)
    engine.wait_for(lambda m: m[0] == "ready", 120)
    return engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broker_process(port: int = 0, *flags: str) -> BrokerProcess:
    return BrokerProcess("--listen", f"127.0.0.1:{port}", "--lease-ttl-ms", str(LEASE_MS), *flags)


def stub_for(broker: BrokerProcess) -> pb_grpc.BrokerStub:
    return pb_grpc.BrokerStub(grpc.insecure_channel(broker.address))


def publish(prefill: Engine, transfer_id: str, tokens: int = 200, salt: int = 7) -> tuple:
    prefill.conn.send(("publish", transfer_id, tokens, salt))
    return prefill.wait_for(lambda m: m[:2] == ("published", transfer_id))


def fetch(decode: Engine, published: tuple, tokens: int = 200, salt: int = 7) -> tuple:
    transfer_id, pages = published[1], published[5]
    decode.conn.send(("fetch", transfer_id, tokens, salt, pages))
    return decode.wait_for(lambda m: m[0] in ("fetched", "fetch_failed") and m[1] == transfer_id)


def released(prefill: Engine, transfer_id: str, ranks: int = 2) -> list[str]:
    """Wait for every rank's release of ``transfer_id``; their reasons by rank."""
    for p in range(ranks):
        prefill.wait_for(lambda m, p=p: m[0] == "released" and m[1:3] == (transfer_id, p))
    return [
        next(m[3] for m in prefill.kinds("released") if m[1:3] == (transfer_id, p))
        for p in range(ranks)
    ]


def assert_clean(stub: pb_grpc.BrokerStub, *engines: Engine) -> None:
    """Nothing unfinished in the broker, no rank released twice, every fetch verified."""
    listing = stub.ListTransfers(pb.ListTransfersRequest(), timeout=10)
    assert list(listing.transfers) == [], listing
    for engine in engines:
        assert engine.kinds("released_twice") == []
        for fetched in engine.kinds("fetched"):
            assert fetched[3] == 0, f"{fetched[1]}: {fetched[3]} mismatching bytes"


def wait_registered(stub: pb_grpc.BrokerStub, *engine_ids: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            engines = stub.ListEngines(pb.ListEnginesRequest(), timeout=5).engines
            complete = {e.engine_id for e in engines if len(e.ranks) == e.tp_size}
            if set(engine_ids) <= complete:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{engine_ids} did not register again within {WAIT_S} s")


def stop(*engines: Engine) -> None:
    for engine in engines:
        if engine.process.is_alive():
            engine.conn.send(("close",))
            engine.process.join(30)
        if engine.process.is_alive():
            engine.process.kill()


# --------------------------------------------------------------------------- processes killed


def test_prefill_killed_mid_transfer_then_replaced() -> None:
    broker = broker_process()
    stub = stub_for(broker)
    try:
        prefill = start_engine("prefill", "P", broker.address)
        decode = start_engine("decode", "D", broker.address)
        lost = publish(prefill, "t-lost")
        prefill.process.kill()  # SIGKILL with its blocks published and unread
        failed = fetch(decode, lost)
        assert failed[0] == "fetch_failed"
        info = stub.GetTransfer(pb.GetTransferRequest(transfer_id="t-lost"), timeout=10)
        assert info.state == pb.TRANSFER_STATE_FAILED
        replacement = start_engine("prefill", "P", broker.address)  # same engine id, new agents
        ok = fetch(decode, publish(replacement, "t-after"))
        assert ok[0] == "fetched"
        assert released(replacement, "t-after") == ["completed", "completed"]
        assert all(m[1] != "t-lost" for m in replacement.kinds("released"))
        assert_clean(stub, replacement, decode)
        stop(replacement, decode)
    finally:
        broker.stop()


def test_decode_killed_mid_read_releases_its_sources_once() -> None:
    """The decode process dies with its NIXL reads posted and nothing reported: both its
    ranks told us their reads were posted, the broker shows both plans handed out and none
    reported, then SIGKILL. The broker fails the transfer when the decode lease expires and
    only then releases each prefill rank, once, as consumer_failed."""
    broker = broker_process()
    stub = stub_for(broker)
    try:
        prefill = start_engine("prefill", "P", broker.address)
        decode = start_engine("decode", "D", broker.address)
        published = publish(prefill, "t-read", tokens=300)
        decode.conn.send(("fetch_and_hold", "t-read", 300, 7, published[5]))
        deadline = time.monotonic() + WAIT_S
        while len(posted := decode.kinds("reads_posted")) < D_LAYOUT.tp_size:
            assert time.monotonic() < deadline and decode.process.is_alive(), decode.messages
            decode.conn.poll(0.05)
        assert all(m[1] == "t-read" and m[2] > 0 for m in posted), posted
        info = stub.GetTransfer(pb.GetTransferRequest(transfer_id="t-read"), timeout=10)
        assert info.state == pb.TRANSFER_STATE_IN_PROGRESS
        assert [(p.handed_out, p.status) for p in info.plans] == [
            (True, pb.REPORT_STATUS_UNSPECIFIED)
        ] * D_LAYOUT.tp_size
        assert prefill.kinds("released") == []
        killed_at = time.monotonic()
        decode.process.kill()
        decode.process.join(10)
        assert released(prefill, "t-read") == ["consumer_failed", "consumer_failed"]
        assert all(m[4] > killed_at for m in prefill.kinds("released") if m[1] == "t-read")
        info = stub.GetTransfer(pb.GetTransferRequest(transfer_id="t-read"), timeout=10)
        assert info.state == pb.TRANSFER_STATE_FAILED
        replacement = start_engine("decode", "D", broker.address)
        ok = fetch(replacement, publish(prefill, "t-next"))
        assert ok[0] == "fetched"
        assert released(prefill, "t-next") == ["completed", "completed"]
        assert_clean(stub, prefill, replacement)
        stop(prefill, replacement)
    finally:
        broker.stop()


def test_broker_killed_and_restarted_engines_register_again() -> None:
    port = free_port()
    broker = broker_process(port)
    try:
        prefill = start_engine("prefill", "P", broker.address)
        decode = start_engine("decode", "D", broker.address)
        assert fetch(decode, publish(prefill, "t-before"))[0] == "fetched"
        assert released(prefill, "t-before") == ["completed", "completed"]
        stranded = publish(prefill, "t-stranded")  # published, then the broker dies
        broker.process.kill()
        broker.process.wait()
        broker = broker_process(port)  # same address, empty memory
        stub = stub_for(broker)
        wait_registered(stub, "P", "D")
        # The stranded transfer fails cleanly on both sides: the decode cannot get a plan,
        # prefill frees its blocks itself (the new broker knows nothing of them).
        assert fetch(decode, stranded)[0] == "fetch_failed"
        assert released(prefill, "t-stranded") == ["aborted", "aborted"]
        assert fetch(decode, publish(prefill, "t-after"))[0] == "fetched"
        assert released(prefill, "t-after") == ["completed", "completed"]
        assert_clean(stub, prefill, decode)
        stop(prefill, decode)
    finally:
        broker.stop()


def test_slow_decode_past_ttl_gets_a_clear_error_and_prefill_one_release() -> None:
    broker = broker_process(0, "--default-ttl-ms", "300")
    stub = stub_for(broker)
    try:
        prefill = start_engine("prefill", "P", broker.address)
        decode = start_engine("decode", "D", broker.address)
        late = publish(prefill, "t-late")
        assert released(prefill, "t-late") == ["expired", "expired"]
        failed = fetch(decode, late)
        assert failed[0] == "fetch_failed" and "expired" in failed[2]
        assert_clean(stub, prefill, decode)
        stop(prefill, decode)
    finally:
        broker.stop()


# --------------------------------------------------------------------------- protocol faults


@pytest.fixture
def raw() -> Iterator[tuple[pb_grpc.BrokerStub, object]]:
    """A real broker with a 2-rank prefill and a 2-rank decode engine registered by a raw
    client (no memory is read: the broker never touches it)."""
    broker = broker_process(0, "--lease-ttl-ms", "60000", "--default-ttl-ms", "2000")
    channel = grpc.insecure_channel(broker.address)
    stub = pb_grpc.BrokerStub(channel)
    sc = build_scenario(hybrid(), 2, 2, 100)
    for r in range(2):
        stub.RegisterRank(register_request(sc.prefill, "P", pb.ROLE_PREFILL, r, 0), timeout=10)
        stub.RegisterRank(register_request(sc.decode, "D", pb.ROLE_DECODE, r, 1), timeout=10)
    try:
        yield stub, sc
    finally:
        channel.close()
        broker.stop()


def _publish(stub: pb_grpc.BrokerStub, sc: object, transfer_id: str) -> None:
    stub.PublishBlocks(
        pb.PublishBlocksRequest(
            transfer_id=transfer_id,
            engine_id="P",
            num_tokens=sc.request.num_tokens,
            block_ids=[pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids],
        ),
        timeout=10,
    )


def _plan(
    stub: pb_grpc.BrokerStub, sc: object, transfer_id: str, rank: int
) -> pb.GetTransferPlanResponse:
    return stub.GetTransferPlan(
        pb.GetTransferPlanRequest(
            transfer_id=transfer_id,
            engine_id="D",
            tp_rank=rank,
            block_ids=[pb.BlockIds(ids=g) for g in sc.request.decode_block_ids],
        ),
        timeout=10,
    )


def _report(
    stub: pb_grpc.BrokerStub,
    plan: pb.GetTransferPlanResponse,
    rank: int,
    status: int = pb.REPORT_STATUS_DONE,
) -> pb.ReportTransferResponse:
    return stub.ReportTransfer(
        pb.ReportTransferRequest(
            plan_id=plan.plan_id,
            engine_id="D",
            tp_rank=rank,
            status=status,
            bytes_moved=plan.total_bytes if status == pb.REPORT_STATUS_DONE else 0,
        ),
        timeout=10,
    )


def _events(
    stub: pb_grpc.BrokerStub, rank: int, after: int = 0, count: int = 0
) -> list[pb.ReleaseEvent]:
    """Read ``count`` events (or what is there within a second) from a fresh stream."""
    stream = stub.WatchReleases(
        pb.WatchReleasesRequest(engine_id="P", tp_rank=rank, after_sequence=after),
        timeout=1 if not count else 10,
    )
    events = []
    try:
        for event in stream:
            events.append(event)
            if count and len(events) == count:
                break
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream.cancel()
    return events


def test_duplicate_and_out_of_order_reports_release_each_rank_once(raw) -> None:
    stub, sc = raw
    _publish(stub, sc, "t")
    plans = [_plan(stub, sc, "t", d) for d in range(2)]
    assert _plan(stub, sc, "t", 1).plan_id == plans[1].plan_id  # asking again: same plan
    first = _report(stub, plans[1], 1)  # rank 1 before rank 0
    assert (first.duplicate, first.intact) == (False, True)
    again = _report(stub, plans[1], 1)
    assert (again.duplicate, again.intact) == (True, True)
    last = _report(stub, plans[0], 0)
    assert last.state == pb.TRANSFER_STATE_COMPLETED
    assert _report(stub, plans[0], 0).duplicate
    failed_late = _report(stub, plans[0], 0, pb.REPORT_STATUS_FAILED)  # contradicts: first wins
    assert failed_late.duplicate and failed_late.state == pb.TRANSFER_STATE_COMPLETED
    for p in range(2):
        events = _events(stub, p)
        assert [(e.transfer_id, e.reason) for e in events] == [("t", pb.RELEASE_REASON_COMPLETED)]


def test_a_plan_outliving_its_ttl_holds_the_blocks_and_its_report_is_aborted(raw) -> None:
    stub, sc = raw
    _publish(stub, sc, "t")
    plans = [_plan(stub, sc, "t", d) for d in range(2)]
    _report(stub, plans[0], 0)
    time.sleep(2.5)  # past the 2 s TTL while decode rank 1 is "still reading"
    assert (
        stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"), timeout=10).state
        == pb.TRANSFER_STATE_EXPIRED
    )
    assert [e.reason for e in _events(stub, 0)] == [pb.RELEASE_REASON_COMPLETED]
    assert _events(stub, 1) == []  # fenced: rank 1's reader has not reported
    with pytest.raises(grpc.RpcError) as info:
        _report(stub, plans[1], 1)
    assert info.value.code() == grpc.StatusCode.ABORTED and "recompute" in info.value.details()
    assert [e.reason for e in _events(stub, 1)] == [pb.RELEASE_REASON_EXPIRED]


def test_release_stream_reconnects_from_its_cursor_without_loss(raw) -> None:
    stub, sc = raw
    for i in range(5):
        _publish(stub, sc, f"t{i}")
        for d in range(2):
            _report(stub, _plan(stub, sc, f"t{i}", d), d)
    first = _events(stub, 0, count=2)  # the consumer goes away after two events
    assert [e.transfer_id for e in first] == ["t0", "t1"]
    rest = _events(stub, 0, after=first[-1].sequence, count=3)
    assert [e.transfer_id for e in rest] == ["t2", "t3", "t4"]
    assert _events(stub, 0, after=rest[-1].sequence) == []  # nothing twice
