"""What the prefill and decode clients share: one registered rank (its transport agent,
regions and lease), the base engine client, and the event-loop thread behind the blocking
clients and the vLLM connector.

An engine client hosts some ranks of one engine (all of them, or the one of a worker process);
each hosted rank gets its own agent (NIXL by default: :mod:`clients.transport`), registration
and lease. Requests are built and sent by :mod:`clients.protocol`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import grpc
from opentelemetry import context as otel_context

from broker import tracing
from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.layout import EngineLayout, RankLayout
from broker.v1 import broker_pb2 as pb
from broker.wire import Role, TransferState
from clients import protocol
from clients.nixl_transport import NixlTransport
from clients.protocol import (
    MAX_RETRY_DELAY_S,
    RETRY_DELAY_S,
    BrokerCallError,
    FailoverStub,
    call,
)
from clients.transport import Agent, Region, RegionIndex, Transport, describe_region

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankSession:
    """One hosted rank: its transport agent and registered regions, its broker registration
    and lease. Region *i* holds layer *i* of every group, as the layout declares."""

    def __init__(
        self,
        stub: FailoverStub,
        engine_id: str,
        role: Role,
        tp_size: int,
        layout: RankLayout,
        fingerprint: str,
        agent: Agent,
        regions: tuple[Region, ...],
    ) -> None:
        self.stub = stub
        self.engine_id = engine_id
        self.role = role
        self.tp_size = tp_size
        self.layout = layout
        self.fingerprint = fingerprint
        self.agent = agent
        self.regions = regions
        #: The regions indexed for checking plans (:func:`~clients.plan_check.check_plan`).
        self.region_index = RegionIndex(regions)
        self.lease_id = ""
        self.ttl_ms = 0
        self.generation = 0
        #: Called after the rank registered again because the broker lost its lease (lease
        #: expiry, broker restart): the broker failed the transfers of the old registration.
        self.on_registered_again: Callable[[RankSession], None] | None = None
        self._check_now = asyncio.Event()  # renew the lease without waiting for its time
        self._known: list[asyncio.Future[None]] = []  # callers of known_again()

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    def registration(self) -> pb.RegisterRankRequest:
        return protocol.registration(
            self.layout,
            self.regions,
            engine_id=self.engine_id,
            role=self.role,
            tp_size=self.tp_size,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata,
            model_fingerprint=self.fingerprint,
        )

    async def register(self, timeout_s: float) -> None:
        lease = await call(self.stub, "RegisterRank", self.registration(), timeout_s)
        self.lease_id, self.ttl_ms, self.generation = lease.lease_id, lease.ttl_ms, lease.generation

    async def known_again(self) -> None:
        """Return once the broker is known to hold this rank: its lease renewed now or, if
        the broker lost it (a restart), the rank registered again (by the renewal task)."""
        known = asyncio.get_running_loop().create_future()
        self._known.append(known)
        self._check_now.set()
        await known

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when :meth:`known_again` asks for a renewal."""
        if not self._check_now.is_set():
            try:
                await asyncio.wait_for(self._check_now.wait(), seconds)
            except asyncio.TimeoutError:
                pass
        self._check_now.clear()

    def _confirmed(self) -> None:
        known, self._known = self._known, []
        for future in known:
            if not future.done():
                future.set_result(None)

    async def keep_alive_forever(self, timeout_s: float) -> None:
        """Renew the lease every third of its TTL; register again if it was lost (the
        broker then failed this rank's transfers; new ones work again). While the broker
        cannot be reached, retry with a doubling pause (up to ``MAX_RETRY_DELAY_S``)."""
        delay = RETRY_DELAY_S
        lost = False
        while True:
            await self._pause(delay if lost else self.ttl_ms / 3000)
            try:
                if lost:
                    await self.register(timeout_s)
                    log.warning("rank %s/%d: registered again", self.engine_id, self.tp_rank)
                    lost, delay = False, RETRY_DELAY_S
                    if self.on_registered_again is not None:
                        self.on_registered_again(self)
                    self._confirmed()
                    continue
                self.ttl_ms = (
                    await call(
                        self.stub,
                        "KeepAlive",
                        pb.KeepAliveRequest(lease_id=self.lease_id),
                        timeout_s,
                    )
                ).ttl_ms
                delay = RETRY_DELAY_S
                self._confirmed()
            except BrokerCallError as exc:
                if not lost and exc.code is grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "rank %s/%d: lease lost, registering again", self.engine_id, self.tp_rank
                    )
                    lost = True
                    delay = 0.0
                    continue
                log.warning(
                    "rank %s/%d: %s failed: %s",
                    self.engine_id,
                    self.tp_rank,
                    "registering again" if lost else "lease renewal",
                    exc,
                )
                delay = min(max(2 * delay, RETRY_DELAY_S), MAX_RETRY_DELAY_S)

    async def deregister(self, timeout_s: float) -> None:
        """Leave the broker; a lease that already expired is not an error."""
        try:
            await call(
                self.stub, "Deregister", pb.DeregisterRequest(lease_id=self.lease_id), timeout_s
            )
        except BrokerCallError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND:
                raise


class AsyncEngineClient:
    """Base of the async clients: hosts ``memory``'s ranks of one engine.

    ``memory[tp_rank]`` lists that rank's regions (tensors, arrays or
    :class:`~clients.transport.Region`), one per ``layout`` region, each at least
    ``num_blocks * page_bytes`` long; the caller keeps them alive until :meth:`close`.
    :meth:`start` creates one agent of ``transport`` per rank (NIXL by default; with
    :class:`~clients.transport.NoMemoryTransport` no memory is touched), registers the memory
    with it and the rank with the broker at ``target`` (``HOST:PORT``, or replicas sharing a
    store as ``HOST:PORT,HOST:PORT``: see :class:`FailoverStub`), and keeps the leases alive.
    ``security``: TLS and this engine's credentials (client certificate or token naming
    ``engine_id``); plaintext by default.
    """

    role: ClassVar[Role]
    #: Whether the batched calls go over one ``EngineSession`` stream (:class:`FailoverStub`).
    session_stream = True

    def __init__(
        self,
        target: str,
        engine_id: str,
        layout: EngineLayout,
        memory: Mapping[int, Sequence[object]],
        *,
        call_timeout_s: float = 10.0,
        security: ChannelSecurity = PLAINTEXT,
        transport: Transport | None = None,
    ) -> None:
        if not memory:
            raise ValueError("memory: host at least one rank")
        for tp_rank, regions in memory.items():
            if not 0 <= tp_rank < layout.tp_size:
                raise ValueError(f"memory: rank {tp_rank} outside [0, {layout.tp_size})")
            if len(regions) != layout.ranks[tp_rank].num_regions:
                raise ValueError(
                    f"memory[{tp_rank}]: {len(regions)} regions, the layout declares "
                    f"{layout.ranks[tp_rank].num_regions}"
                )
        self.target = target
        self.engine_id = engine_id
        self.layout = layout
        self.call_timeout_s = call_timeout_s
        self.security = security
        self.transport: Transport = transport or NixlTransport()
        self._memory = {r: tuple(memory[r]) for r in sorted(memory)}
        self._stub: FailoverStub | None = None
        self.sessions: dict[int, RankSession] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def ranks(self) -> tuple[int, ...]:
        """The hosted tp ranks."""
        return tuple(self._memory)

    @property
    def stub(self) -> FailoverStub:
        if self._stub is None:
            raise RuntimeError("start() the client first")
        return self._stub

    async def start(self) -> None:
        """Create the agents, register memory and ranks, start the background tasks. On
        failure everything created so far is closed again."""
        self._stub = FailoverStub(self.target, self.security, session_stream=self.session_stream)
        try:
            for tp_rank, memory in self._memory.items():
                rank_layout = self.layout.ranks[tp_rank]
                regions = tuple(describe_region(m) for m in memory)
                for i, region in enumerate(regions):
                    if region.length_bytes < rank_layout.region_bytes:
                        raise ValueError(
                            f"memory[{tp_rank}][{i}]: {region.length_bytes} bytes, the "
                            f"layout needs {rank_layout.region_bytes}"
                        )
                agent = self.transport.agent(
                    f"{self.engine_id}.rank{tp_rank}.{secrets.token_hex(4)}"
                )
                self.sessions[tp_rank] = RankSession(
                    self._stub,
                    self.engine_id,
                    self.role,
                    self.layout.tp_size,
                    rank_layout,
                    self.layout.model,
                    agent,
                    regions,
                )
                agent.register(regions)
            outcomes = await asyncio.gather(
                *(s.register(self.call_timeout_s) for s in self.sessions.values()),
                return_exceptions=True,
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            for session in self.sessions.values():
                self._spawn(session.keep_alive_forever(self.call_timeout_s))
            self._started()
        except BaseException:
            await self.close()
            raise

    async def abort(
        self, transfer_id: str, reason: str, prefill_engine_id: str = ""
    ) -> TransferState:
        """Abort ``transfer_id`` of ``prefill_engine_id`` (see :func:`clients.protocol.abort`)."""
        return await protocol.abort(
            self.stub, transfer_id, reason, self.call_timeout_s, prefill_engine_id
        )

    async def transfer(
        self, transfer_id: str, prefill_engine_id: str = ""
    ) -> pb.GetTransferResponse:
        """What the broker holds about ``transfer_id`` of ``prefill_engine_id`` ('': of the
        one engine that published that id); NOT_FOUND once it forgot it."""
        return await protocol.get_transfer(
            self.stub, transfer_id, self.call_timeout_s, prefill_engine_id
        )

    def _started(self) -> None:
        """Hook: start role-specific background tasks with :meth:`_spawn`."""

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def close(self) -> None:
        """Stop background tasks, deregister every rank, close the agents and the channel.
        Idempotent; the ranks are gone from the broker when it returns."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sessions = [s for s in self.sessions.values() if s.lease_id]
        errors = await asyncio.gather(
            *(s.deregister(self.call_timeout_s) for s in sessions), return_exceptions=True
        )
        for session in self.sessions.values():
            session.agent.close()
        self.sessions.clear()
        if self._stub is not None:
            await self._stub.close()
            self._stub = None
        for error in errors:
            if isinstance(error, BaseException):
                raise error

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _within(ctx: otel_context.Context, coro: Coroutine[Any, Any, T]) -> T:
    with tracing.attached(ctx):
        return await coro


class LoopThread:
    """An asyncio event loop in a daemon thread, for the blocking clients and the vLLM
    connector: :meth:`run` runs a coroutine on it and waits for the result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop in the caller's trace context (so the caller's current
        span is linked from the transfer's spans)."""
        if tracing.enabled():
            coro = _within(otel_context.get_current(), coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """:meth:`submit` ``coro`` and wait for its result."""
        return self.submit(coro).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


class BlockingEngineClient:
    """Base of the blocking clients: runs an :class:`AsyncEngineClient` on a private
    :class:`LoopThread` (callbacks given to the client run on that thread)."""

    def __init__(self, client: AsyncEngineClient) -> None:
        self._async = client
        self._loop = LoopThread(f"pdbroker-{client.engine_id}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._async.ranks

    @property
    def sessions(self) -> dict[int, RankSession]:
        return self._async.sessions

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def start(self) -> Self:
        try:
            self._run(self._async.start())
        except BaseException:
            self._loop.close()  # the async client already closed what it had opened
            raise
        return self

    def close(self) -> None:
        """Close the client and stop the loop thread. Idempotent."""
        if self._loop.loop.is_closed():
            return
        try:
            self._run(self._async.close())
        finally:
            self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
