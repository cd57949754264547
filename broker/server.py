"""The asyncio gRPC edge: ``pdbroker.v1.Broker`` plus health checking and reflection.

Servicer methods only translate protobuf ⇄ domain (:mod:`broker.convert`), call
:class:`~broker.service.BrokerService` and map its typed errors to status codes; the message
of every error starts with the offending field's path. A background task reaps expired
leases and transfers. Any bad input fails that one call; the server keeps serving.

Translating is pure, and for a registration (its layout's validation) or a request of many
block ids it is the costly part of a call: those run on a worker thread
(:meth:`BrokerServicer.offload`), so the event loop keeps answering health checks and
keep-alives meanwhile; calls into the service stay on the loop, one at a time.

Security (:class:`~broker.server_security.ServerSecurity`): the port speaks TLS or, when asked,
plaintext. When callers are identified (client certificates, tokens), a call whose metadata
cannot authenticate it is refused UNAUTHENTICATED before its request is received
(:class:`_AuthenticateFirst`), and every Broker call then passes its rule of
:class:`~broker.auth.AccessGuard` (UNAUTHENTICATED, PERMISSION_DENIED); health and
reflection stay open, and ``health_port`` serves health alone in plaintext for probes that
cannot speak TLS. Each method refuses a request larger than it can need
(:func:`~broker.limits.max_request_bytes_of`) before parsing it.

Trace context: ``PublishBlocks`` keeps the ``traceparent`` its caller sent in metadata with
the transfer (tracing on or off here, so engines that trace get one trace per transfer through
a broker that does not). When this process records spans, each unary handler but ``GetTransferPlan``
also runs in the context its caller sent, so broker spans descend from the client spans that
caused them (done in the handler wrapper: a server interceptor would cost every call).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial, wraps
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from broker import convert, tracing
from broker.auth import AccessGuard, Authenticator, Identity
from broker.errors import (
    COMPACTED_THROUGH_KEY,
    AbortedError,
    AlreadyExistsError,
    CompactedError,
    IncompatibleLayoutsError,
    LimitExceededError,
    NotFoundError,
    PdbrokerError,
    PermissionDeniedError,
    PreconditionError,
    StoreUnavailableError,
    UnauthenticatedError,
)
from broker.limits import LIMITS, max_request_bytes_of
from broker.records import RankKey
from broker.server_security import ServerSecurity
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import ident, optional_ident, text

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Broker"].full_name
#: Largest inbound message (bytes): registrations carry agent metadata and layouts.
MAX_RECEIVE_BYTES = LIMITS.max_request_bytes
#: Requests with more block ids than this are translated (and their plans) off the loop;
#: smaller ones take less than a thread hand-off.
OFFLOAD_BLOCK_IDS = 16_384
#: Bytes of serialized large plans kept for repeated asks of the same plan.
PLAN_BYTES_CACHE = 256 << 20

#: First matching class wins; any other :class:`PdbrokerError` is INVALID_ARGUMENT.
_STATUS_BY_ERROR: tuple[tuple[type[PdbrokerError], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (IncompatibleLayoutsError, grpc.StatusCode.FAILED_PRECONDITION),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (AbortedError, grpc.StatusCode.ABORTED),
    (StoreUnavailableError, grpc.StatusCode.UNAVAILABLE),  # another replica may serve it
    (CompactedError, grpc.StatusCode.OUT_OF_RANGE),
)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
T = TypeVar("T")


def status_code(exc: PdbrokerError) -> grpc.StatusCode:
    for cls, code in _STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the call with the status of ``exc`` (INTERNAL for anything but our errors)."""
    if isinstance(exc, CompactedError):
        await context.abort(
            status_code(exc),
            str(exc),
            trailing_metadata=((COMPACTED_THROUGH_KEY, str(exc.through)),),
        )
    if isinstance(exc, PdbrokerError):
        await context.abort(status_code(exc), str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


Method = Callable[[Any, Req], Resp]
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
#: An RPC's authorization: raises unless the identified caller may make this request.
Rule = Callable[[AccessGuard, Identity, Any], None]


def _as_engine(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.act_as(who, request.engine_id)


def _registrant(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.register(who, request.engine_id, request.tp_rank)


def _lease_holder(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.hold_lease(who, request.lease_id)


def _plan_holder(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.act_as(who, request.engine_id)
    guard.report_plan(who, request.plan_id)


def _transfer_party(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.see_transfer(who, request.transfer_id)


def _operator(guard: AccessGuard, who: Identity, request: Any) -> None:
    guard.administer(who)


def _unary(rule: Rule) -> Callable[[Method], Handler]:
    """Run a synchronous translate-and-call method once ``rule`` allows the caller, turning
    exceptions into statuses; with tracing on, in the trace context the caller sent."""
    return lambda method: _handler(method, rule)


def _handler(method: Method, rule: Rule) -> Handler:
    @wraps(method)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            self.authorize(context, rule, request)
            if self.traced:
                return tracing.call_in_context(context.invocation_metadata(), method, self, request)
            return method(self, request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)

    return handler


class BrokerServicer(pb_grpc.BrokerServicer):
    """``pdbroker.v1.Broker`` over one :class:`BrokerService`; ``guard`` authorizes every
    call (None: callers are not identified, anyone may call anything)."""

    def __init__(self, service: BrokerService, guard: AccessGuard | None = None) -> None:
        self.service = service
        self.guard = guard
        #: Whether this process records spans (fixed when the server starts).
        self.traced = tracing.enabled()
        self._wakeups: dict[RankKey, set[asyncio.Event]] = {}
        service.add_release_listener(self.wake)
        self._translator = ThreadPoolExecutor(1, thread_name_prefix="pdbroker-translate")
        self._plan_bytes: OrderedDict[tuple, bytes] = OrderedDict()
        self._plan_bytes_held = 0

    async def offload(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the translating thread (pure work only: no service calls)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._translator, partial(function, *args)
        )

    def close(self) -> None:
        self._translator.shutdown(wait=False, cancel_futures=True)

    def _keep_plan_bytes(self, key: tuple, encoded: bytes) -> None:
        """Keep a large plan's answer for the same rank's repeated asks (a plan never
        changes once handed out), the newest :data:`PLAN_BYTES_CACHE` bytes."""
        if len(encoded) > PLAN_BYTES_CACHE or key in self._plan_bytes:  # asked at once
            return
        self._plan_bytes[key] = encoded
        self._plan_bytes_held += len(encoded)
        while self._plan_bytes_held > PLAN_BYTES_CACHE:
            self._plan_bytes_held -= len(self._plan_bytes.popitem(last=False)[1])

    def wake(self, key: RankKey) -> None:
        """Wake the watchers of prefill rank ``key`` (a release was queued or it went away)."""
        for event in self._wakeups.get(key, ()):
            event.set()

    def authorize(self, context: grpc.aio.ServicerContext, rule: Rule, request: Any) -> None:
        """Raise unless the caller is identified and ``rule`` allows ``request``."""
        if self.guard is not None:
            rule(self.guard, self.guard.identify(context), request)

    async def RegisterRank(
        self, request: pb.RegisterRankRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterRankResponse:
        try:
            self.authorize(context, _registrant, request)
            registration = await self.offload(convert.registration_from_proto, request)
            if self.traced:
                lease = tracing.call_in_context(
                    context.invocation_metadata(), self.service.register_rank, registration
                )
            else:
                lease = self.service.register_rank(registration)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)
        return convert.lease_to_proto(lease)

    @_unary(_lease_holder)
    def KeepAlive(self, request: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        lease_id = ident(request.lease_id, "lease_id")
        return pb.KeepAliveResponse(ttl_ms=self.service.keep_alive(lease_id))

    @_unary(_lease_holder)
    def Deregister(self, request: pb.DeregisterRequest) -> pb.DeregisterResponse:
        self.service.deregister(ident(request.lease_id, "lease_id"))
        return pb.DeregisterResponse()

    async def PublishBlocks(
        self, request: pb.PublishBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishBlocksResponse:
        traceparent = tracing.traceparent_from_metadata(context.invocation_metadata())
        try:
            self.authorize(context, _as_engine, request)
            if _many_block_ids(request.block_ids):
                publication = await self.offload(
                    convert.publication_from_proto, request, traceparent
                )
            else:
                publication = convert.publication_from_proto(request, traceparent)
            expires = self.service.publish(publication)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)
        return pb.PublishBlocksResponse(expires_at_ms=expires)

    async def GetTransferPlan(
        self, request: pb.GetTransferPlanRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetTransferPlanResponse:
        """As the other calls, without joining the caller's trace: a plan's spans descend
        from the transfer's publication anyway, and decode links its own trace from its read
        spans, so the hot path need not parse the caller's context (~25 µs a plan). The
        service checks the publication's ``allowed_decode_engines``."""
        try:
            self.authorize(context, _as_engine, request)
            if not _many_block_ids(request.block_ids):
                return convert.plan_to_proto(
                    self.service.get_plan(convert.plan_query_from_proto(request))
                )
            query = await self.offload(convert.plan_query_from_proto, request)
            plan = self.service.get_plan(query)
            key = (
                plan.plan_id,
                plan.expires_at_ms,
                plan.traceparent,
                tuple(bool(s.agent_metadata) for s in plan.sources),
            )
            encoded = self._plan_bytes.get(key)
            if encoded is None:
                encoded = await self.offload(_serialized_plan, plan)
                self._keep_plan_bytes(key, encoded)
            return encoded  # bytes: sent as they are

        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)

    @_unary(_plan_holder)
    def ReportTransfer(self, request: pb.ReportTransferRequest) -> pb.ReportTransferResponse:
        outcome = self.service.report(convert.report_from_proto(request))
        return pb.ReportTransferResponse(
            duplicate=outcome.duplicate,
            intact=outcome.intact,
            state=convert.state_to_proto(outcome.state),
        )

    @_unary(_transfer_party)
    def AbortTransfer(self, request: pb.AbortTransferRequest) -> pb.AbortTransferResponse:
        transfer_id = ident(request.transfer_id, "transfer_id")
        state = self.service.abort(transfer_id, text(request.reason))
        return pb.AbortTransferResponse(state=convert.state_to_proto(state))

    @_unary(_operator)
    def ListEngines(self, request: pb.ListEnginesRequest) -> pb.ListEnginesResponse:
        return convert.engines_to_proto(self.service.list_engines())

    @_unary(_transfer_party)
    def GetTransfer(self, request: pb.GetTransferRequest) -> pb.GetTransferResponse:
        transfer = self.service.get_transfer(ident(request.transfer_id, "transfer_id"))
        return convert.transfer_to_proto(transfer, self.service.clock.now_ms())

    @_unary(_operator)
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
            self.authorize(context, _as_engine, request)
            key = (ident(request.engine_id, "engine_id"), request.tp_rank)
            lease_id = optional_ident(request.lease_id, "lease_id")
            generation, cursor = self.service.release_stream(*key, request.after_sequence, lease_id)
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
        except Exception as exc:  # noqa: BLE001 - events dropped meanwhile, store unavailable
            await _abort(context, exc)
        finally:
            waiters = self._wakeups[key]
            waiters.discard(wake)
            if not waiters:
                del self._wakeups[key]


def _many_block_ids(groups: Sequence[pb.BlockIds]) -> bool:
    return sum(len(g.ids) for g in groups) > OFFLOAD_BLOCK_IDS


def _serialized_plan(plan: Any) -> bytes:
    return convert.plan_to_proto(plan).SerializeToString()


def _serializer(response_type: type) -> Callable[[Any], bytes]:
    """A response serializer that sends bytes a handler serialized itself as they are."""
    serialize = response_type.SerializeToString

    def encode(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return encode


class _Undecodable:
    """Stands in for a request that is refused unparsed: ``code`` and ``detail`` say why."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        self.code, self.detail = code, detail


def _lenient(message_type: type, max_bytes: int) -> Callable[[bytes], Any]:
    """A request deserializer that returns :class:`_Undecodable` rather than raising (grpc
    would answer UNKNOWN) for bytes that do not parse, and without parsing them for more
    than ``max_bytes``."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        if len(data) > max_bytes:
            return _Undecodable(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(data)} bytes is more than a {name} may have ({max_bytes})",
            )
        try:
            return message_type.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or RecursionError when too deep
            why = str(exc).rsplit(": ", 1)[-1]  # DecodeError repeats the type name
            return _Undecodable(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid {name} ({why})")

    return parse


def _refuse_undecodable(behavior: Callable, streaming: bool) -> Callable:
    """``behavior``, answering an :class:`_Undecodable` request with its status."""

    async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(request.code, f"request: {request.detail}")

    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            async for item in behavior(request, context):
                yield item

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await behavior(request, context)

    return unary


def _add_broker(servicer: BrokerServicer, server: grpc.aio.Server) -> None:
    """``pb_grpc.add_BrokerServicer_to_server``, except that a request that does not parse
    fails with INVALID_ARGUMENT ``request: not a valid ...`` instead of UNKNOWN, and one
    larger than its method needs with RESOURCE_EXHAUSTED, unparsed."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Broker"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            _refuse_undecodable(getattr(servicer, method.name), method.server_streaming),
            request_deserializer=_lenient(request_type, max_request_bytes_of(method.name)),
            response_serializer=_serializer(response_type),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _AuthenticateFirst(grpc.aio.ServerInterceptor):
    """Refuses a Broker call UNAUTHENTICATED from its metadata alone when they cannot
    authenticate it (no, a malformed or an unknown bearer token), before its request is
    received: the refusal is served as a client-streaming handler that never reads, so the
    request's bytes stay with the caller (HTTP/2 flow control) and are never parsed."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not details.method.startswith(f"/{SERVICE_NAME}/"):  # health, reflection
            return await continuation(details)
        why = self.authenticator.refusal(details.invocation_metadata)
        if why is None:
            return await continuation(details)
        log.warning(
            "unauthenticated %s refused before its request: %s",
            details.method.rsplit("/", 1)[-1],
            why,
        )
        detail = f"authorization: {why}"
        streaming = details.method.endswith("/WatchReleases")

        async def unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)

        async def stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)
            yield  # pragma: no cover - abort raises

        if streaming:
            return grpc.stream_stream_rpc_method_handler(stream)
        return grpc.stream_unary_rpc_method_handler(unary)


class BrokerServer:
    """A ``grpc.aio`` server hosting the broker, health and reflection, plus the reaper.

    ``listen`` is ``HOST:PORT`` (port 0 picks a free one; :attr:`port` is the bound one).
    ``security``: TLS and authorization (None: plaintext, anyone may call anything, for
    in-process use). ``health_port``: also serve health alone, in plaintext, on this port of
    the ``listen`` host (0 picks one; :attr:`health_port` is then the bound one). Certificate,
    key and tokens files are read here: ``ValueError`` names the flag of a bad one.

    Connections, on each port (None: gRPC's default): at most ``max_connections`` at once (one
    more is accepted and closed at once); one that has not completed its TLS and HTTP/2
    handshake within ``handshake_timeout_ms`` is closed; one without calls for
    ``idle_timeout_ms`` is closed with GOAWAY. A client pinging without data more often than
    every 30 s is sent GOAWAY ``too_many_pings`` at the third ping that comes too soon.
    """

    def __init__(
        self,
        service: BrokerService,
        listen: str = "127.0.0.1:0",
        reap_interval_ms: int = 100,
        security: ServerSecurity | None = None,
        health_port: int | None = None,
        max_connections: int | None = None,
        handshake_timeout_ms: int | None = None,
        idle_timeout_ms: int | None = None,
    ) -> None:
        self.service = service
        self.max_connections = max_connections
        self.handshake_timeout_ms = handshake_timeout_ms
        self.idle_timeout_ms = idle_timeout_ms
        self.listen = listen
        self.reap_interval_ms = reap_interval_ms
        self.port = 0
        self.health_port = health_port
        self._credentials = None if security is None else security.server_credentials()
        self._guard = None if security is None else security.guard(service.store)
        self._server: grpc.aio.Server | None = None
        self._servicer: BrokerServicer | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] = lambda: None

    @property
    def address(self) -> str:
        """``HOST:PORT`` with the bound port."""
        return f"{self.listen.rsplit(':', 1)[0]}:{self.port}"

    def _connection_options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
            ("grpc.http2.max_ping_strikes", 2),
            # Pings on a connection without calls are held to the same interval (not 2 h):
            # idle connections are closed by the idle timeout, which pings do not reset.
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        for name, value in (("grpc.max_allowed_incoming_connections", self.max_connections),
                            ("grpc.server_handshake_timeout_ms", self.handshake_timeout_ms),
                            ("grpc.max_connection_idle_ms", self.idle_timeout_ms)):  # fmt: skip
            if value is not None:
                options.append((name, value))
        return options

    async def start(self) -> None:
        server = grpc.aio.server(
            interceptors=()
            if self._guard is None
            else (_AuthenticateFirst(self._guard.authenticator),),
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
                # A fixed 64 KiB receive window per stream: a request the edge refuses unread
                # costs no more than that (window growth would let each stream send MiBs).
                ("grpc.http2.bdp_probe", 0),
                *self._connection_options(),
            ],
        )
        servicer = self._servicer = BrokerServicer(self.service, self._guard)
        _add_broker(servicer, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        if self._credentials is None:
            self.port = server.add_insecure_port(self.listen)
        else:
            self.port = server.add_secure_port(self.listen, self._credentials)
        if not self.port:
            raise OSError(f"cannot listen on {self.listen}")
        if self.health_port is not None:
            self._health_server = grpc.aio.server(
                options=[("grpc.so_reuseport", 0), *self._connection_options()]
            )
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            health_listen = f"{self.listen.rsplit(':', 1)[0]}:{self.health_port}"
            self.health_port = self._health_server.add_insecure_port(health_listen)
            if not self.health_port:
                raise OSError(f"cannot listen on {health_listen}")
            await self._health_server.start()
        await server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        loop = asyncio.get_running_loop()
        # Releases other brokers on a shared store queue wake this server's watchers too.
        self._unsubscribe = self.service.store.subscribe_releases(
            lambda key: loop.call_soon_threadsafe(servicer.wake, key)
        )
        self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        """Reap every ``reap_interval_ms``; while the store fails, report NOT_SERVING (a
        replica that cannot reach Redis leaves its load balancer) and log once."""
        serving = True
        while True:
            await asyncio.sleep(self.reap_interval_ms / 1000)
            try:
                self.service.reap()
            except Exception as exc:
                if serving:
                    if isinstance(exc, StoreUnavailableError):
                        log.warning("%s; reporting NOT_SERVING until it is back", exc.detail)
                    else:
                        log.exception("reaper failed; reporting NOT_SERVING until it succeeds")
                    await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                serving = False
                continue
            if not serving:
                log.warning("reaper succeeded again; SERVING")
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            serving = True

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        if self._health is not None:
            for name in ("", SERVICE_NAME):
                await self._health.set(name, status)

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
        self._unsubscribe()
        await self._server.stop(grace_s)
        self._server = None
        if self._servicer is not None:
            self._servicer.close()
            self._servicer = None
        if self._health_server is not None:
            await self._health_server.stop(grace_s)
            self._health_server = None
