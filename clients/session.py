"""What the prefill and decode clients share: the broker channel, one registered rank (its
transport agent, regions and lease), the base engine client, and the event-loop thread behind
the blocking clients.

An engine client hosts some ranks of one engine (all of them, or the one of a worker process);
each hosted rank gets its own agent (NIXL by default: :mod:`clients.transport`), registration
and lease. Protobuf layouts come from
:func:`broker.wire.rank_layout_to_proto`, the codec the broker shares.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import grpc
from opentelemetry import context as otel_context

from broker import tracing
from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.layout import EngineLayout, RankLayout
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import MEMORY_KIND, MemoryKind, rank_layout_to_proto
from clients.nixl_transport import NixlTransport
from clients.transport import Agent, Region, Transport, describe_region

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Pause before retrying a broken release stream or a failed lease renewal (seconds); it
#: doubles while the broker stays unreachable, up to MAX_RETRY_DELAY_S.
RETRY_DELAY_S = 0.2
MAX_RETRY_DELAY_S = 5.0
#: Calls the broker answers alike when they are repeated while the first may still be running
#: (a plan or report again, a lease renewed twice, a publish that finds its own transfer):
#: :class:`FailoverStub` repeats them on the next replica when one does not answer in time.
REPEATABLE = frozenset(
    {
        "KeepAlive",
        "GetTransferPlan",
        "ReportTransfer",
        "AbortTransfer",
        "PublishBlocks",
        "GetTransfer",
        "ListEngines",
        "ListTransfers",
        "Deregister",
    }
)


class BrokerCallError(RuntimeError):
    """A broker RPC failed: ``code`` is the gRPC status, ``field`` the offending field path
    the broker names at the start of its message (empty when it names none)."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details
        head = details.split(":", 1)[0]
        self.field = head if ":" in details and " " not in head else ""


async def call(stub: pb_grpc.BrokerStub, method: str, request: Any, timeout_s: float) -> Any:
    """One unary RPC carrying the current trace context; a failure raises
    :class:`BrokerCallError`."""
    try:
        return await getattr(stub, method)(
            request, timeout=timeout_s, metadata=tracing.grpc_metadata() or None
        )
    except grpc.aio.AioRpcError as exc:
        raise BrokerCallError(method, exc.code(), exc.details() or "") from None


def open_channel(target: str, security: ChannelSecurity = PLAINTEXT) -> grpc.aio.Channel:
    """A channel to the broker at ``HOST:PORT`` (plans of long requests are large); plaintext
    unless ``security`` names a CA."""
    return security.aio_channel(
        target,
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
    )


def broker_addresses(target: str | Sequence[str]) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]`` (or a sequence of them) as a tuple of addresses."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    addresses = tuple(a.strip() for a in parts if a.strip())
    if not addresses:
        raise ValueError("target: name at least one broker address")
    return addresses


#: Statuses on which :class:`FailoverStub` moves a call on to the next replica.
_MOVING_ON = frozenset({grpc.StatusCode.UNAVAILABLE})
_MOVING_ON_REPEATABLE = _MOVING_ON | {grpc.StatusCode.DEADLINE_EXCEEDED}


class FailoverStub:
    """A ``BrokerStub`` over broker replicas that share one store (``pdbroker serve --store
    redis://``). Unary calls go to the current replica; one that is UNAVAILABLE (down,
    unreachable, draining, its store unreachable) makes the call move on to the next, round
    the list with a doubling pause, until the call's timeout runs out. A :data:`REPEATABLE`
    call to one of several replicas gets its share of the time left (half of it with two
    replicas, then all that remains), so a replica that hangs (stopped, overloaded) answers
    DEADLINE_EXCEEDED in time for the call to move on as well. Streams (``WatchReleases``)
    are opened on the current replica; their consumer calls :meth:`fail_over` with that
    replica when one breaks, and reopens them when :meth:`moved_from` it.

    Every broker call is safe to repeat (plans, reports, keep-alives, aborts are
    idempotent); a ``PublishBlocks`` whose reply was lost with its replica comes back
    ALREADY_EXISTS, which :class:`~clients.prefill.AsyncPrefillClient` checks and accepts.
    """

    def __init__(self, target: str | Sequence[str], security: ChannelSecurity = PLAINTEXT) -> None:
        self.addresses = broker_addresses(target)
        self._security = security
        self._stubs: dict[int, tuple[grpc.aio.Channel, pb_grpc.BrokerStub]] = {}
        self._current = 0
        self._moved = asyncio.Event()  # set (and replaced) whenever calls move on
        #: How many times calls moved on to another replica.
        self.failovers = 0

    @property
    def address(self) -> str:
        """The replica calls go to now."""
        return self.addresses[self._current]

    def _stub(self) -> pb_grpc.BrokerStub:
        if self._current not in self._stubs:
            channel = open_channel(self.address, self._security)
            self._stubs[self._current] = (channel, pb_grpc.BrokerStub(channel))
        return self._stubs[self._current][1]

    def fail_over(self, failed: str) -> None:
        """Replica ``failed`` did not answer: move on to the next one, unless another call
        already moved away from it (a no-op with one address)."""
        if failed != self.address:
            return
        self.failovers += 1
        if len(self.addresses) > 1:
            self._current = (self._current + 1) % len(self.addresses)
            log.warning("broker calls go to %s now", self.address)
            self._moved.set()
            self._moved = asyncio.Event()

    async def moved_from(self, address: str) -> None:
        """Return once calls no longer go to ``address`` (never, with one address)."""
        while self.address == address:
            await self._moved.wait()

    def WatchReleases(self, request: pb.WatchReleasesRequest, **kwargs: Any) -> Any:
        return self._stub().WatchReleases(request, **kwargs)

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        if not method[:1].isupper():
            raise AttributeError(method)

        repeatable = method in REPEATABLE
        moving_on = _MOVING_ON_REPEATABLE if repeatable else _MOVING_ON

        async def unary(request: Any, *, timeout: float | None = None, **kwargs: Any) -> Any:
            deadline = None if timeout is None else time.monotonic() + timeout
            delay = RETRY_DELAY_S
            tried = 0
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and repeatable:  # a share for each replica left this round
                    left /= len(self.addresses) - tried % len(self.addresses)
                address = self.address
                try:
                    return await getattr(self._stub(), method)(request, timeout=left, **kwargs)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in moving_on:
                        raise
                    self.fail_over(address)
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
                    tried += 1
                    if tried % len(self.addresses) == 0:  # every replica refused: back off
                        if deadline is not None and time.monotonic() + delay >= deadline:
                            raise
                        await asyncio.sleep(delay)
                        delay = min(2 * delay, MAX_RETRY_DELAY_S)

        return unary

    async def close(self) -> None:
        stubs, self._stubs = self._stubs, {}
        await asyncio.gather(*(channel.close() for channel, _ in stubs.values()))


class RankSession:
    """One hosted rank: its transport agent and registered regions, its broker registration
    and lease. Region *i* holds layer *i* of every group, as the layout declares."""

    def __init__(
        self,
        stub: FailoverStub,
        engine_id: str,
        role: int,
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
        return pb.RegisterRankRequest(
            engine_id=self.engine_id,
            role=self.role,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata,
            regions=[
                pb.Region(
                    base_addr=r.base_addr,
                    length_bytes=r.length_bytes,
                    device_id=r.device_id,
                    memory_kind=MEMORY_KIND.to_proto(MemoryKind[r.kind]),
                )
                for r in self.regions
            ],
            layout=rank_layout_to_proto(self.layout),
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

    role: ClassVar[int] = pb.ROLE_UNSPECIFIED

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
        self._stub = FailoverStub(self.target, self.security)
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


class LoopThread:
    """An asyncio event loop in a daemon thread, for the blocking clients: :meth:`run`
    submits a coroutine to it and waits for the result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


async def _within(ctx: otel_context.Context, coro: Coroutine[Any, Any, T]) -> T:
    with tracing.attached(ctx):
        return await coro


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
        """Run ``coro`` on the loop thread, in this thread's trace context (so a caller's
        current span is linked from the transfer's spans)."""
        if tracing.enabled():
            coro = _within(otel_context.get_current(), coro)
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
