"""The engines of the control-plane benchmark (:mod:`harness.control_plane_bench`): a broker
as its own process (``pdbroker serve --insecure``, optionally under cProfile), and a prefill
engine ``P`` and a decode engine ``D`` of a scenario in this process (:class:`BenchEngines`),
each the client library over :class:`~clients.transport.NoMemoryTransport` (fake, disjoint
regions: the broker never touches memory), so the broker sees the calls engines make.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from broker.layout import EngineLayout
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import Role
from clients import protocol
from clients.decode import AsyncDecodeClient
from clients.prefill import AsyncPrefillClient
from clients.session import LoopThread
from clients.transport import NoMemoryTransport, fake_memory
from harness.scenarios import Scenario

if TYPE_CHECKING:
    from broker.clock import Clock
    from broker.service import BrokerService
    from broker.store.contract import StateStore

PREFILL_ADDR, DECODE_ADDR = 0x7F00_0000_0000, 0x7E00_0000_0000
#: Address space of each decode engine's fake regions (below DECODE_ADDR's).
DECODE_ADDRESS_SPAN = 1 << 36
#: Size of each rank's agent metadata (bytes; NIXL's is a few KiB).
AGENT_METADATA_BYTES = 4096
#: Deadline of one RPC (seconds).
CALL_TIMEOUT_S = 30.0
#: How often ``P`` polls its agents (seconds): nobody reads, nothing needs the polls.
POLL_INTERVAL_S = 1.0
T = TypeVar("T")


def registrations(
    layout: EngineLayout, engine_id: str, role: Role, first_addr: int
) -> list[pb.RegisterRankRequest]:
    """Every rank's registration, with fake, disjoint regions of exactly the layout's size
    from ``first_addr`` on (:func:`~clients.transport.fake_memory`), as the clients build it."""
    return [
        protocol.registration(
            rank,
            regions,
            engine_id=engine_id,
            role=role,
            tp_size=layout.tp_size,
            agent_name=f"{engine_id}-{rank.tp_rank}",
            agent_metadata=b"m" * AGENT_METADATA_BYTES,
            model_fingerprint=layout.model,
        )
        for rank, regions in zip(layout.ranks, fake_memory(layout, first_addr).values())
    ]


def register(
    stub: pb_grpc.BrokerStub, layout: EngineLayout, engine_id: str, role: Role, first_addr: int
) -> None:
    """Register every rank of ``layout`` as ``engine_id`` (see :func:`registrations`) over a
    blocking stub, without lease renewals (the broker's leases must outlast the run)."""
    for request in registrations(layout, engine_id, role, first_addr):
        stub.RegisterRank(request)


def published_service(
    sc: Scenario,
    transfers: int,
    store: StateStore | None = None,
    clock: Clock | None = None,
    ttl_ms: int = 3_600_000,
    capacity: int = 0,
) -> BrokerService:
    """An in-process broker service (no gRPC; on ``store`` and ``clock``, by default in
    memory and on the system clock) with ``sc``'s prefill ``P`` and decode ``D`` registered
    (fake addresses, leases of an hour) and ``transfers`` of its request published by ``P``
    as ``t0``, ``t1``, ... for ``ttl_ms`` (:func:`publish_transfers`); it holds at most
    ``capacity`` transfers (``transfers`` for 0): what the in-process benchmarks work on."""
    from broker import convert
    from broker.config import ServiceConfig
    from broker.service import BrokerService

    config = ServiceConfig(
        max_transfers=capacity or transfers,
        max_transfers_per_engine=capacity or transfers,
        default_ttl_ms=ttl_ms,
        lease_ttl_ms=3_600_000,
    )
    service = BrokerService(store, clock, config)
    for registration in registrations(sc.prefill, "P", Role.PREFILL, PREFILL_ADDR) + registrations(
        sc.decode, "D", Role.DECODE, DECODE_ADDR
    ):
        service.register_rank(convert.registration_from_proto(registration))
    publish_transfers(service, sc, range(transfers))
    return service


def publish_transfers(service: BrokerService, sc: Scenario, numbers: Iterable[int]) -> None:
    """``P`` of :func:`published_service` publishes ``sc``'s request as ``t<n>`` for each of
    ``numbers``."""
    from broker import convert

    published = [pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids]
    for i in numbers:
        publication = pb.PublishBlocksRequest(
            transfer_id=f"t{i}",
            engine_id="P",
            block_ids=published,
            num_tokens=sc.request.num_tokens,
        )
        service.publish(convert.publication_from_proto(publication, ""))


def _process_tree(pid: int) -> Iterator[int]:
    """``pid`` and its running children (a broker's workers), theirs and so on (/proc)."""
    yield pid
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        yield from _process_tree(int(child))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) and of its running
    children (a broker's workers), from /proc (Linux)."""
    ticks = 0
    for process in _process_tree(pid):
        fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Context switches of every thread of process ``pid`` and of its running children (a
    broker's workers), voluntary (a thread waited: a lock, I/O) and not (preempted), from
    /proc (Linux; a thread that ended took its count with it)."""
    switches = 0
    for process in _process_tree(pid):
        for task in Path(f"/proc/{process}/task").iterdir():
            try:
                lines = (task / "status").read_text().splitlines()
            except OSError:  # a thread that just ended
                continue
            switches += sum(int(line.split()[1]) for line in lines if "ctxt_switches:" in line)
    return switches


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (bytes), from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_broker(max_transfers: int, profile: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``pdbroker serve --insecure`` on a free loopback port (under cProfile writing
    ``profile`` when it stops, if given); returns the process and its address."""
    python = [sys.executable]
    if profile:
        python += ["-m", "cProfile", "-o", str(profile)]
    cmd = [
        *python,
        "-m",
        "broker.cli",
        "serve",
        "--insecure",
        "--listen",
        "127.0.0.1:0",
        "--max-transfers",
        str(max_transfers),
        "--max-transfers-per-engine",
        str(max_transfers),
        "--default-ttl-ms",
        "600000",
        "--lease-ttl-ms",
        "600000",
        "--log-level",
        "ERROR",
    ]  # leases outlast the run; the engines leaving at its end fail what they held (warnings)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"broker did not start: {line!r}")
    return proc, match.group(1)


def stop_broker(proc: subprocess.Popen) -> None:
    """SIGTERM (the broker stops cleanly, cProfile writes its file), then wait."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class BenchEngines:
    """``P`` (every prefill rank of ``sc``) and ``D`` (every decode rank) in this process, on
    a loop thread (their engine ids start with ``prefix``): ``P`` publishes, ``D`` warms
    the broker up and samples a plan."""

    def __init__(self, address: str, sc: Scenario, prefix: str = "") -> None:
        self.sc = sc
        transport = NoMemoryTransport(AGENT_METADATA_BYTES)
        self.prefill = AsyncPrefillClient(
            address,
            f"{prefix}P",
            sc.prefill,
            fake_memory(sc.prefill, PREFILL_ADDR),
            progress_interval_s=POLL_INTERVAL_S,
            idle_interval_s=POLL_INTERVAL_S,
            call_timeout_s=CALL_TIMEOUT_S,
            transport=transport,
        )
        self.decode = AsyncDecodeClient(
            address,
            f"{prefix}D",
            sc.decode,
            fake_memory(sc.decode, DECODE_ADDR),
            call_timeout_s=CALL_TIMEOUT_S,
            transport=transport,
        )
        self._loop = LoopThread("bench-engines")
        try:
            self._loop.run(self.prefill.start())
            self._loop.run(self.decode.start())
        except BaseException:
            self.close()
            raise

    def publish(self, transfer_ids: Sequence[str], concurrency: int = 16) -> None:
        """``P`` publishes the scenario's request as each of ``transfer_ids``, ``concurrency``
        at once."""
        request = self.sc.request

        async def lane(lane_ids: Sequence[str]) -> None:
            for transfer_id in lane_ids:
                await self.prefill.publish(
                    transfer_id, request.prefill_block_ids, request.num_tokens
                )

        async def lanes() -> None:
            await asyncio.gather(*(lane(transfer_ids[k::concurrency]) for k in range(concurrency)))

        self._loop.run(lanes())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` on the engines' loop thread; its result."""
        return self._loop.run(coro)

    def plan(self, transfer_ids: Sequence[str]) -> pb.GetTransferPlanResponse:
        """``D`` plans each transfer on every rank in turn; returns the last plan."""

        async def plans() -> pb.GetTransferPlanResponse:
            for transfer_id in transfer_ids:
                for rank in range(self.sc.decode.tp_size):
                    ids = self.sc.request.decode_block_ids
                    plan = await self.decode.plan(rank, transfer_id, ids)
            return plan

        return self._loop.run(plans())

    def close(self) -> None:
        """Deregister both engines (the broker must still run) and stop the loop thread."""
        try:
            self._loop.run(self.decode.close())
            self._loop.run(self.prefill.close())
        finally:
            self._loop.close()
