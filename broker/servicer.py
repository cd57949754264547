"""The ``pdbroker.v1.Broker`` servicer: each method authorizes its caller, translates
protobuf to service values (:mod:`broker.convert`), calls :class:`~broker.service.BrokerService`
and maps its typed errors to status codes; the message of every error starts with the
offending field's path (:mod:`broker.calls`). Any bad input fails that one call; the server
keeps serving. The batched calls and the ``EngineSession`` stream are
:class:`~broker.batched.BatchedCalls`.

Translating is pure, and for a registration (its layout's validation) or a request of many
block ids it is the costly part of a call: those run on a worker thread
(:meth:`BrokerServicer.offload`), as do planning large transfers and turning large plans into
descriptors and bytes, so the event loop keeps answering health checks and keep-alives
meanwhile. Calls into the service (and authorization, which reads the store) run on the loop
for a store in memory, one at a time; for a store that waits on I/O
(:attr:`~broker.store.contract.StateStore.blocking`, Redis; :meth:`BrokerServicer.stored`) on
a few store threads that take turns running service code and wait for Redis together
(:mod:`broker.store.turns`), so a slow round trip to Redis holds only the calls that wait for
the store, never health checks, streams or the loop, and one call's round trips overlap
others' work.

Trace context: ``PublishBlocks`` keeps the ``traceparent`` its caller sent in metadata with
the transfer (tracing on or off here, so engines that trace get one trace per transfer through
a broker that does not). When this process records spans, each unary handler but
``GetTransferPlan`` also runs in the context its caller sent, so broker spans descend from the
client spans that caused them (done in the handler wrapper: a server interceptor would cost
every call).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial, wraps
from typing import Any, TypeVar

import grpc

from broker import convert, tracing
from broker.api import PlanResult
from broker.auth import AccessGuard, Identity
from broker.batched import BatchedCalls
from broker.calls import (
    OFFLOAD_BLOCK_IDS,
    OFFLOAD_DESCRIPTORS,
    Rule,
    abort,
    as_engine,
    lease_holder,
    operator,
    plan_holder,
    registrant,
    status_code,
    transfer_party,
)
from broker.engines import check_published_blocks
from broker.limits import LIMITS
from broker.plans import Planned, PlanTicket
from broker.records import RankKey
from broker.service import BrokerService
from broker.store.turns import Turns, last_held
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import count_block_ids, ident, optional_ident, text

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
T = TypeVar("T")

Method = Callable[[Any, Req], Resp]
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _unary(rule: Rule) -> Callable[[Method], Handler]:
    """Run a synchronous translate-and-call method once ``rule`` allows the caller, turning
    exceptions into statuses; with tracing on, in the trace context the caller sent."""
    return lambda method: _handler(method, rule)


def _handler(method: Method, rule: Rule) -> Handler:
    @wraps(method)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            who = self.identify(context)
            metadata = context.invocation_metadata() if self.traced else None
            return await self.stored(self.authorized_call, who, rule, request, method, metadata)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)

    return handler


class BrokerServicer(BatchedCalls, pb_grpc.BrokerServicer):
    """``pdbroker.v1.Broker`` over one :class:`BrokerService`; ``guard`` authorizes every
    call (None: callers are not identified, anyone may call anything)."""

    def __init__(
        self,
        service: BrokerService,
        guard: AccessGuard | None = None,
        store_timed: Callable[[float, float, float], None] | None = None,
        store_threads: int = 1,
    ) -> None:
        self.service = service
        self.guard = guard
        #: Told each store call's seconds, CPU seconds and seconds holding the turn (None:
        #: not timed).
        self.store_timed = store_timed
        #: Whether this process records spans (fixed when the server starts).
        self.traced = tracing.enabled()
        self._wakeups: dict[RankKey, set[asyncio.Event]] = {}
        service.add_release_listener(self.wake_from_any_thread)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pdbroker-work")
        self._store_thread = (
            ThreadPoolExecutor(store_threads, thread_name_prefix="pdbroker-store")
            if service.store.blocking
            else None
        )
        self._turns = Turns()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    async def offload(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the worker thread (pure work only: no service calls)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, partial(function, *args)
        )

    async def pure(self, heavy: bool, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` here, or on the worker thread when ``heavy``."""
        return await self.offload(function, *args) if heavy else function(*args)

    async def stored(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)``, a call that reads or writes the store: here for a store in
        memory, else on a store thread, taking turns with the others' calls
        (:mod:`broker.store.turns`), in this task's context (its trace)."""
        if self._store_thread is None:
            return function(*args)
        loop = asyncio.get_running_loop()
        self._loop, self._loop_thread = loop, threading.get_ident()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self._store_thread, self._timed, context, function, args)

    def _timed(self, context: contextvars.Context, function: Callable[..., T], args: tuple) -> T:
        """``function(*args)`` in ``context``, on a store thread holding the turn; its
        seconds, CPU seconds and seconds holding the turn told to :attr:`store_timed`."""
        if self.store_timed is None:
            return self._turns.run(context.run, function, *args)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._turns.run(context.run, function, *args)
        finally:
            self.store_timed(time.perf_counter() - wall, time.thread_time() - cpu, last_held())

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self._store_thread is not None:
            self._store_thread.shutdown(wait=False, cancel_futures=True)

    def wake(self, key: RankKey) -> None:
        """Wake the watchers of prefill rank ``key`` (a release was queued or it went away)."""
        for event in self._wakeups.get(key, ()):
            event.set()

    def wake_from_any_thread(self, key: RankKey) -> None:
        """:meth:`wake`, from the store thread too (through the loop)."""
        if self._loop is None or threading.get_ident() == self._loop_thread:
            self.wake(key)
        else:
            self._loop.call_soon_threadsafe(self.wake, key)

    def identify(self, context: grpc.aio.ServicerContext) -> Identity | None:
        """The caller (None without authorization)."""
        return None if self.guard is None else self.guard.identify(context)

    def authorize(self, who: Identity | None, rule: Rule, request: Any) -> Any:
        """Raise unless ``rule`` allows ``who`` to make ``request`` (reads the store: call it
        through :meth:`stored`); returns what the rule found (None without authorization)."""
        if self.guard is not None:
            assert who is not None
            return rule(self.guard, who, request)
        return None

    async def authorized(self, context: grpc.aio.ServicerContext, rule: Rule, request: Any) -> Any:
        """:meth:`authorize` of the caller of ``context``, where store calls run."""
        return await self.authorized_as(self.identify(context), rule, request)

    async def authorized_as(self, who: Identity | None, rule: Rule, request: Any) -> Any:
        """:meth:`authorize` of ``who``, where store calls run."""
        if self.guard is None:
            return None
        return await self.stored(self.authorize, who, rule, request)

    def authorized_call(
        self, who: Identity | None, rule: Rule, request: Any, method: Method, metadata: Any
    ) -> Any:
        """``method(self, request)`` once ``rule`` allows it, in the trace context of
        ``metadata`` (the caller's, when this process traces)."""
        self.authorize(who, rule, request)
        if metadata is not None:
            return tracing.call_in_context(metadata, method, self, request)
        return method(self, request)

    async def in_context(
        self, context: grpc.aio.ServicerContext, call: Callable[..., T], *args: Any
    ) -> T:
        """``call(*args)`` (a service call: :meth:`stored`), in the trace context the caller
        sent when this process traces."""
        if self.traced:
            metadata = context.invocation_metadata()
            return await self.stored(tracing.call_in_context, metadata, call, *args)
        return await self.stored(call, *args)

    async def RegisterRank(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.RegisterRankResponse:
        try:
            request = await self.parsed(request)
            await self.authorized(context, registrant, request)
            registration = await self.offload(convert.registration_from_proto, request)
            lease = await self.in_context(context, self.service.register_rank, registration)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)
        return convert.lease_to_proto(lease)

    @_unary(lease_holder)
    def KeepAlive(self, request: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        lease_id = ident(request.lease_id, "lease_id")
        return pb.KeepAliveResponse(ttl_ms=self.service.keep_alive(lease_id))

    @_unary(lease_holder)
    def Deregister(self, request: pb.DeregisterRequest) -> pb.DeregisterResponse:
        self.service.deregister(ident(request.lease_id, "lease_id"))
        return pb.DeregisterResponse()

    async def PublishBlocks(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Publications of many block ids are translated and checked against the engine's
        layout on the worker thread; only storing them runs on the loop."""
        traceparent = tracing.traceparent_from_metadata(context.invocation_metadata())
        try:
            request = await self.parsed(request)
            await self.authorized(context, as_engine, request)
            heavy = count_block_ids(request.block_ids) > OFFLOAD_BLOCK_IDS
            pub = await self.pure(heavy, convert.publication_from_proto, request, traceparent)
            checked = None
            if heavy:
                layout, checked = await self.stored(self.service.engine_layout, pub.engine_id)
                await self.offload(check_published_blocks, layout, pub.block_ids, pub.num_tokens)
            expires = await self.stored(self.service.publish, pub, checked)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)
        return pb.PublishBlocksResponse(expires_at_ms=expires)

    async def GetTransferPlan(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """As the other calls, without joining the caller's trace: a plan's spans descend
        from the transfer's publication anyway, and decode links its own trace from its read
        spans, so the hot path need not parse the caller's context. A plan
        whose answer exceeds ``max_unary_plan_bytes`` is refused before it is handed out."""
        try:
            plan = await self._plan(request, context, LIMITS.max_unary_plan_bytes)
            if plan.num_descriptors <= OFFLOAD_DESCRIPTORS:
                return convert.plan_to_proto(plan)
            return await self.offload(_serialized_plan, plan)  # bytes: sent as they are
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)

    async def StreamTransferPlan(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """GetTransferPlan of any size, in messages of at most ``max_plan_chunk_bytes`` of
        descriptors, each encoded on the worker thread (large plans) and sent as it is: the
        loop sends one while the next waits for flow control."""
        try:
            plan = await self._plan(request, context, None)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)
        chunks = convert.plan_chunks(plan, LIMITS.max_plan_chunk_bytes)
        heavy = plan.num_descriptors > OFFLOAD_DESCRIPTORS
        while (chunk := await self.pure(heavy, next, chunks, None)) is not None:
            yield chunk

    async def _plan(
        self, request: Any, context: grpc.aio.ServicerContext, answer_bytes: int | None
    ) -> PlanResult:
        request = await self.parsed(request)
        await self.authorized(context, as_engine, request)
        return await self.planned(request, answer_bytes, count_block_ids(request.block_ids))

    async def planned(
        self, request: pb.GetTransferPlanRequest, answer_bytes: int | None, block_ids: int
    ) -> PlanResult:
        """The decode rank's plan (its request holding ``block_ids`` block ids); the
        planning, descriptors and translation of large ones on the worker thread, deciding
        on the loop (:meth:`BrokerService.plan_step`)."""
        heavy = block_ids > OFFLOAD_BLOCK_IDS
        query = await self.pure(heavy, convert.plan_query_from_proto, request)
        planned: Planned | None = None
        while True:
            step = await self.stored(
                self.service.plan_step, query, planned, answer_bytes, OFFLOAD_BLOCK_IDS
            )
            if isinstance(step, PlanTicket):
                return await self.pure(step.num_descriptors > OFFLOAD_DESCRIPTORS, step.result)
            planned = await self.offload(step.run)  # large, or the planner is busy there

    @_unary(plan_holder)
    def ReportTransfer(self, request: pb.ReportTransferRequest) -> pb.ReportTransferResponse:
        return convert.outcome_to_proto(self.service.report(convert.report_from_proto(request)))

    async def ExtendTransfers(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """A large request (many entries of long ids) is parsed on the worker thread."""
        try:
            request = await self.parsed(request)
            await self.authorized(context, as_engine, request)
            names = convert.extension_from_proto(request)
            extensions = await self.in_context(context, self.service.extend, *names)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)
        return convert.extensions_to_proto(extensions, lambda e: status_code(e).value[0])

    async def AbortTransfer(
        self, request: pb.AbortTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortTransferResponse:
        try:
            state = await self.in_context(
                context,
                self.service.abort,
                ident(request.transfer_id, "transfer_id"),
                text(request.reason),
                await self._publisher(context, request),
                request.held_by_decode,
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)
        return pb.AbortTransferResponse(state=convert.state_to_proto(state))

    @_unary(operator)
    def ListEngines(self, request: pb.ListEnginesRequest) -> pb.ListEnginesResponse:
        return convert.engines_to_proto(self.service.list_engines())

    async def GetTransfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            transfer = await self.in_context(
                context,
                self.service.get_transfer,
                ident(request.transfer_id, "transfer_id"),
                await self._publisher(context, request),
            )
            heavy = sum(len(g) for g in transfer.block_ids) > OFFLOAD_BLOCK_IDS
            now = self.service.clock.now_ms()
            return await self.pure(heavy, convert.transfer_to_proto, transfer, now)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)

    async def _publisher(self, context: grpc.aio.ServicerContext, request: Any) -> str:
        """The prefill engine whose transfer ``request`` names: as named, else the one the
        authorized caller is a party of (callers learn nothing of others' transfers)."""
        named = optional_ident(request.prefill_engine_id, "prefill_engine_id")
        return await self.authorized(context, transfer_party, request) or named

    @_unary(operator)
    def ListTransfers(self, request: pb.ListTransfersRequest) -> pb.ListTransfersResponse:
        return convert.listing_to_proto(
            self.service.list_transfers(request.include_finished, request.limit)
        )

    async def WatchReleases(
        self, request: pb.WatchReleasesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReleaseEvent]:
        """Stream the rank's releases until the client cancels or the rank goes away
        (deregistered, lease expired, re-registered): then the stream ends with OK."""
        try:
            await self.authorized(context, as_engine, request)
            key = (ident(request.engine_id, "engine_id"), request.tp_rank)
            lease_id = optional_ident(request.lease_id, "lease_id")
            feeds = self.service.feeds
            generation, cursor = await self.stored(
                feeds.start, *key, request.after_sequence, lease_id
            )
        except Exception as exc:  # noqa: BLE001
            await abort(context, exc)
        wake = asyncio.Event()
        self._wakeups.setdefault(key, set()).add(wake)
        try:
            while True:
                wake.clear()
                events = await self.stored(feeds.after, key, generation, cursor)
                if events is None:
                    return
                for event in events:
                    heavy = sum(len(g) for g in event.block_ids) > OFFLOAD_BLOCK_IDS
                    yield await self.pure(heavy, convert.release_to_proto, event)
                    queued_ms = self.service.clock.now_ms() - event.released_at_ms
                    self.service.observer.release_delivered(queued_ms / 1000)
                    cursor = event.sequence
                    await self.stored(feeds.delivered, key, cursor)
                if not events:
                    await wake.wait()
        except Exception as exc:  # noqa: BLE001 - events dropped meanwhile, store unavailable
            await abort(context, exc)
        finally:
            waiters = self._wakeups[key]
            waiters.discard(wake)
            if not waiters:
                del self._wakeups[key]

    async def parsed(self, request: Any) -> Any:
        """The request message, parsed on the worker thread if it came unparsed (large)."""
        if isinstance(request, Unparsed):
            return await self.offload(request.parse)
        return request


def _serialized_plan(plan: PlanResult) -> bytes:
    return convert.plan_to_proto(plan).SerializeToString()


class Unparsed:
    """A large request, parsed by its handler on the worker thread (:meth:`BrokerServicer.parsed`)."""

    def __init__(self, parse: Callable[[], Any]) -> None:
        self.parse = parse
