"""The asyncio gRPC edge: ``pdbroker.v1.Broker`` plus health checking and reflection.

Servicer methods only translate protobuf ⇄ domain (:mod:`broker.convert`), call
:class:`~broker.service.BrokerService` and map its typed errors to status codes; the message
of every error starts with the offending field's path. A background task reaps expired
leases and transfers. Any bad input fails that one call; the server keeps serving.

Trace context: ``PublishBlocks`` keeps the ``traceparent`` its caller sent in metadata with
the transfer (tracing on or off here, so engines that trace get one trace per transfer through
a broker that does not). When this process records spans, each unary handler but ``GetTransferPlan``
also runs in the context its caller sent, so broker spans descend from the client spans that
caused them (done in the handler wrapper: a server interceptor would cost every call).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from broker import convert, tracing
from broker.errors import (
    AlreadyExistsError,
    IncompatibleLayoutsError,
    LimitExceededError,
    NotFoundError,
    PdbrokerError,
    PermissionDeniedError,
    PreconditionError,
)
from broker.records import RankKey
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Broker"].full_name
#: Largest inbound message (bytes): registrations carry agent metadata and layouts.
MAX_RECEIVE_BYTES = 64 << 20

#: First matching class wins; any other :class:`PdbrokerError` is INVALID_ARGUMENT.
_STATUS_BY_ERROR: tuple[tuple[type[PdbrokerError], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (IncompatibleLayoutsError, grpc.StatusCode.FAILED_PRECONDITION),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def status_code(exc: PdbrokerError) -> grpc.StatusCode:
    for cls, code in _STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the call with the status of ``exc`` (INTERNAL for anything but our errors)."""
    if isinstance(exc, PdbrokerError):
        await context.abort(status_code(exc), str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


Method = Callable[[Any, Req], Resp]
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _handler(method: Method, join_caller: bool) -> Handler:
    """Run a synchronous translate-and-call method, turning exceptions into statuses; with
    tracing on and ``join_caller``, in the trace context the caller sent."""

    @wraps(method)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            if join_caller and self.traced:
                return tracing.call_in_context(context.invocation_metadata(), method, self, request)
            return method(self, request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)

    return handler


def _unary(method: Method) -> Handler:
    return _handler(method, join_caller=True)


def _hot(method: Method) -> Handler:
    """:func:`_unary` for ``GetTransferPlan``, without joining the caller's trace: a plan's
    spans descend from the transfer's publication anyway, and decode links its own trace from
    its read spans, so the hot path need not parse the caller's context (~25 µs a plan)."""
    return _handler(method, join_caller=False)


class BrokerServicer(pb_grpc.BrokerServicer):
    """``pdbroker.v1.Broker`` over one :class:`BrokerService`."""

    def __init__(self, service: BrokerService) -> None:
        self.service = service
        #: Whether this process records spans (fixed when the server starts).
        self.traced = tracing.enabled()
        self._wakeups: dict[RankKey, set[asyncio.Event]] = {}
        service.add_release_listener(self._wake)

    def _wake(self, key: RankKey) -> None:
        for event in self._wakeups.get(key, ()):
            event.set()

    @_unary
    def RegisterRank(self, request: pb.RegisterRankRequest) -> pb.RegisterRankResponse:
        return convert.lease_to_proto(
            self.service.register_rank(convert.registration_from_proto(request))
        )

    @_unary
    def KeepAlive(self, request: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        return pb.KeepAliveResponse(ttl_ms=self.service.keep_alive(request.lease_id))

    @_unary
    def Deregister(self, request: pb.DeregisterRequest) -> pb.DeregisterResponse:
        self.service.deregister(request.lease_id)
        return pb.DeregisterResponse()

    async def PublishBlocks(
        self, request: pb.PublishBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishBlocksResponse:
        traceparent = tracing.traceparent_from_metadata(context.invocation_metadata())
        try:
            expires = self.service.publish(convert.publication_from_proto(request, traceparent))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)
        return pb.PublishBlocksResponse(expires_at_ms=expires)

    @_hot
    def GetTransferPlan(self, request: pb.GetTransferPlanRequest) -> pb.GetTransferPlanResponse:
        return convert.plan_to_proto(self.service.get_plan(convert.plan_query_from_proto(request)))

    @_unary
    def ReportTransfer(self, request: pb.ReportTransferRequest) -> pb.ReportTransferResponse:
        outcome = self.service.report(convert.report_from_proto(request))
        return pb.ReportTransferResponse(
            duplicate=outcome.duplicate,
            intact=outcome.intact,
            state=convert.state_to_proto(outcome.state),
        )

    @_unary
    def AbortTransfer(self, request: pb.AbortTransferRequest) -> pb.AbortTransferResponse:
        state = self.service.abort(request.transfer_id, request.reason)
        return pb.AbortTransferResponse(state=convert.state_to_proto(state))

    @_unary
    def ListEngines(self, request: pb.ListEnginesRequest) -> pb.ListEnginesResponse:
        return convert.engines_to_proto(self.service.list_engines())

    @_unary
    def GetTransfer(self, request: pb.GetTransferRequest) -> pb.GetTransferResponse:
        transfer = self.service.get_transfer(request.transfer_id)
        return convert.transfer_to_proto(transfer, self.service.clock.now_ms())

    @_unary
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
            key = (request.engine_id, request.tp_rank)
            generation, cursor = self.service.release_stream(*key, request.after_sequence)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
        wake = asyncio.Event()
        self._wakeups.setdefault(key, set()).add(wake)
        try:
            while True:
                wake.clear()
                events = self.service.releases(key, generation, cursor)
                if events is None:
                    return
                for event in events:
                    yield convert.release_to_proto(event)
                    cursor = event.sequence
                    self.service.delivered(key, cursor)
                if not events:
                    await wake.wait()
        finally:
            waiters = self._wakeups[key]
            waiters.discard(wake)
            if not waiters:
                del self._wakeups[key]


class BrokerServer:
    """A ``grpc.aio`` server hosting the broker, health and reflection, plus the reaper.

    ``listen`` is ``HOST:PORT`` (port 0 picks a free one; :attr:`port` is the bound one).
    """

    def __init__(
        self, service: BrokerService, listen: str = "127.0.0.1:0", reap_interval_ms: int = 100
    ) -> None:
        self.service = service
        self.listen = listen
        self.reap_interval_ms = reap_interval_ms
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._reaper: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``HOST:PORT`` with the bound port."""
        return f"{self.listen.rsplit(':', 1)[0]}:{self.port}"

    async def start(self) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_BrokerServicer_to_server(BrokerServicer(self.service), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        self.port = server.add_insecure_port(self.listen)
        if not self.port:
            raise OSError(f"cannot listen on {self.listen}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_ms / 1000)
            try:
                self.service.reap()
            except Exception:
                log.exception("reaper failed")

    async def wait(self) -> None:
        """Until the server stops."""
        assert self._server is not None, "start() first"
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Report NOT_SERVING, stop the reaper, finish in-flight calls within ``grace_s``."""
        if self._server is None:
            return
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._reaper is not None:
            self._reaper.cancel()
        await self._server.stop(grace_s)
        self._server = None
