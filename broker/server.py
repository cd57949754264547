"""The asyncio gRPC server: ``pdbroker.v1.Broker`` (:mod:`broker.servicer`) plus health
checking and reflection, the gate every request passes before its handler, the connection
bounds, and a background task that reaps expired leases and transfers.

The gate: each method refuses a request larger than it can need
(:func:`~broker.limits.max_request_bytes_of`) before parsing it, answers one that does not
parse INVALID_ARGUMENT (not UNKNOWN), and leaves large ones for their handler to parse on the
worker thread. Security (:class:`~broker.server_security.ServerSecurity`): the port speaks TLS
or, when asked, plaintext. When callers are identified (client certificates, tokens), a call
whose metadata cannot authenticate it is refused UNAUTHENTICATED before its request is
received (:class:`_AuthenticateFirst`), and every Broker call then passes its rule of
:class:`~broker.auth.AccessGuard` (UNAUTHENTICATED, PERMISSION_DENIED); health and reflection
stay open, and ``health_port`` serves health alone in plaintext for probes that cannot speak
TLS.

Observation, in the same per-method wrapper (a server interceptor would cost every call more):
with metrics, every Broker call is counted by method and status code
(:class:`~broker.metrics.MethodMetrics`), those refused before their request included; when
the process traces, each call is served as a traced call (:func:`broker.tracing.serving`), so
the spans its handler opens for it are SERVER spans carrying its method and status code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from broker import tracing
from broker.auth import Authenticator
from broker.calls import OFFLOAD_REQUEST_BYTES, Refused, abort
from broker.config import STORE_THREADS
from broker.errors import (
    StoreUnavailableError,
)
from broker.limits import LIMITS, max_request_bytes_of
from broker.records import RankKey
from broker.server_security import ServerSecurity
from broker.service import BrokerService
from broker.servicer import BrokerServicer, Unparsed
from broker.v1 import broker_pb2 as pb

if TYPE_CHECKING:  # prometheus_client: only where metrics are served
    from broker.metrics import BrokerMetrics, MethodMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Broker"].full_name
#: How often the event loop's stalls are probed when metrics are kept (seconds).
STALL_PROBE_S = 0.005
#: Broker methods that answer with a stream.
_STREAMING = frozenset(
    m.name for m in pb.DESCRIPTOR.services_by_name["Broker"].methods if m.server_streaming
)
#: Largest inbound message (bytes): registrations carry agent metadata and layouts.
MAX_RECEIVE_BYTES = LIMITS.max_request_bytes


def _serializer(response_type: type[Message]) -> Callable[[Any], bytes]:
    """A response serializer that sends bytes a handler serialized itself as they are."""
    serialize = response_type.SerializeToString

    def encode(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return encode


def _lenient(message_type: type[Message], max_bytes: int) -> Callable[[bytes], Any]:
    """A request deserializer that returns :class:`_Undecodable` rather than raising (grpc
    would answer UNKNOWN) for bytes that do not parse, and without parsing them for more
    than ``max_bytes``."""
    name = message_type.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or RecursionError when too deep
            why = str(exc).rsplit(": ", 1)[-1]  # DecodeError repeats the type name
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid {name} ({why})") from None

    def parse(data: bytes) -> Any:
        if len(data) > max_bytes:
            return Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(data)} bytes is more than a {name} may have ({max_bytes})",
            )
        if len(data) > OFFLOAD_REQUEST_BYTES:
            return Unparsed(partial(decode, data))
        try:
            return decode(data)
        except Refused as refused:
            return refused

    return parse


#: A call cancelled with at most this share of its time left, plus DEADLINE_SLACK_S, ended at
#: its client's deadline: the timeout a client sends is rounded up (by up to 1%) and reaches
#: the server after the request's transit, so the client's deadline passes first and it
#: cancels before the server's own deadline fires.
DEADLINE_SHARE = 0.02
DEADLINE_SLACK_S = 0.05


def _status_of(
    exc: BaseException, context: grpc.aio.ServicerContext, elapsed: float
) -> grpc.StatusCode:
    """The status a call ends with when ``exc`` leaves its handler ``elapsed`` seconds in."""
    if isinstance(exc, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        left = context.time_remaining()
        if left is not None and left <= DEADLINE_SHARE * (elapsed + left) + DEADLINE_SLACK_S:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _served(
    behavior: Callable, streaming: bool, metrics: MethodMetrics | None, traced_as: str
) -> Callable:
    """``behavior``, answering a request its deserializer refused with its status; each call
    counted in ``metrics`` (None: not counted) and, when ``traced_as`` names its method (this
    process traces), served as a traced call (:func:`broker.tracing.serving`: its SERVER
    spans)."""
    observed = metrics is not None or bool(traced_as)
    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = _Started(metrics, traced_as) if observed else None
            try:
                if isinstance(request, Refused):
                    await abort(context, request)
                async for item in behavior(request, context):
                    yield item
            except BaseException as exc:
                if started is not None:
                    started.failed(exc, context)
                raise
            if started is not None:
                started.ended(grpc.StatusCode.OK)

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = _Started(metrics, traced_as) if observed else None
        try:
            if isinstance(request, Refused):
                await abort(context, request)
            response = await behavior(request, context)
        except BaseException as exc:
            if started is not None:
                started.failed(exc, context)
            raise
        if started is not None:
            started.ended(grpc.StatusCode.OK)
        return response

    return unary


class _Started:
    """A call under way: counted as started, and served in a trace when ``traced_as``."""

    __slots__ = ("_at", "_metrics", "_served")

    def __init__(self, metrics: MethodMetrics | None, traced_as: str) -> None:
        self._metrics = metrics
        self._served = tracing.serving(traced_as) if traced_as else None
        if metrics is not None:
            metrics.started.inc()
        self._at = time.perf_counter()

    def ended(self, code: grpc.StatusCode) -> None:
        if self._metrics is not None:
            self._metrics.handled(code, time.perf_counter() - self._at)
        if self._served is not None:
            self._served.end(code.value[0])

    def failed(self, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        """``exc`` left the handler: ended with the status it stands for."""
        self.ended(_status_of(exc, context, time.perf_counter() - self._at))


def _observed_message(
    metrics: dict[str, MethodMetrics] | None, traced: bool, method: str
) -> _Started:
    """An EngineSession message carrying a call of ``method``, observed as that call."""
    return _Started(None if metrics is None else metrics[method], method if traced else "")


def _method_metrics(metrics: BrokerMetrics) -> dict[str, MethodMetrics]:
    """The series of each Broker method, by name."""
    types = {(False, False): "unary", (False, True): "server_stream",
             (True, False): "client_stream", (True, True): "bidi_stream"}  # fmt: skip
    return {
        m.name: metrics.method(types[m.client_streaming, m.server_streaming], SERVICE_NAME, m.name)
        for m in pb.DESCRIPTOR.services_by_name["Broker"].methods
    }


def _add_broker(
    servicer: BrokerServicer,
    server: grpc.aio.Server,
    metrics: dict[str, MethodMetrics] | None,
    traced: bool,
) -> None:
    """``pb_grpc.add_BrokerServicer_to_server``, except that a request that does not parse
    fails with INVALID_ARGUMENT ``request: not a valid ...`` instead of UNKNOWN, and one
    larger than its method needs with RESOURCE_EXHAUSTED, unparsed; every call is counted in
    its method's ``metrics`` and, when ``traced``, served as a traced call."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Broker"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        make = (
            grpc.stream_stream_rpc_method_handler
            if method.client_streaming
            else grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            _served(
                getattr(servicer, method.name),
                method.server_streaming,
                None if metrics is None else metrics[method.name],
                method.name if traced else "",
            ),
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

    def __init__(
        self, authenticator: Authenticator, metrics: dict[str, MethodMetrics] | None
    ) -> None:
        self.authenticator = authenticator
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if not details.method.startswith(f"/{SERVICE_NAME}/"):  # health, reflection
            return await continuation(details)
        why = self.authenticator.refusal(details.invocation_metadata)
        if why is None:
            return await continuation(details)
        name = details.method.rsplit("/", 1)[-1]
        log.warning("unauthenticated %s refused before its request: %s", name, why)
        detail = f"authorization: {why}"
        streaming = name in _STREAMING
        counted = None if self.metrics is None else self.metrics.get(name)
        if counted is not None:
            counted.started.inc()
            counted.handled(grpc.StatusCode.UNAUTHENTICATED, 0.0)

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

    ``metrics``: where every Broker call is counted (``grpc_server_*``), and whether it
    reports SERVING (``pdbroker_serving``); None counts nothing.

    ``reuse_port``: bind both ports with ``SO_REUSEPORT``, so that other processes doing the
    same serve them too (the kernel spreads connections over them); without it a port in
    use fails :meth:`start`.

    ``store_threads``: threads that run calls on a shared store, taking turns running
    service code (:mod:`broker.store.turns`): while one waits for Redis, another works.
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
        metrics: BrokerMetrics | None = None,
        reuse_port: bool = False,
        store_threads: int = STORE_THREADS,
    ) -> None:
        if store_threads < 1:
            raise ValueError(f"store_threads: {store_threads} is not a positive count")
        self.service = service
        self.reuse_port = reuse_port
        self.store_threads = store_threads
        self.metrics = metrics
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
        self._stall_probe: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] = lambda: None

    @property
    def address(self) -> str:
        """``HOST:PORT`` with the bound port."""
        return f"{self.listen.rsplit(':', 1)[0]}:{self.port}"

    def _connection_options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.so_reuseport", int(self.reuse_port)),
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
        counted = None if self.metrics is None else _method_metrics(self.metrics)
        server = grpc.aio.server(
            interceptors=()
            if self._guard is None
            else (_AuthenticateFirst(self._guard.authenticator, counted),),
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", -1),
                # A fixed 64 KiB receive window per stream: a request the edge refuses unread
                # costs no more than that (window growth would let each stream send MiBs).
                ("grpc.http2.bdp_probe", 0),
                *self._connection_options(),
            ],
        )
        timed = None
        if self.metrics is not None:
            timed = self.metrics.store_call
            self.metrics.store_threads.set(self.store_threads if self.service.store.blocking else 0)
        servicer = self._servicer = BrokerServicer(
            self.service, self._guard, timed, self.store_threads
        )
        _add_broker(servicer, server, counted, servicer.traced)
        if counted is not None or servicer.traced:
            servicer.observe_message = partial(_observed_message, counted, servicer.traced)
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
            self._health_server = grpc.aio.server(options=self._connection_options())
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            health_listen = f"{self.listen.rsplit(':', 1)[0]}:{self.health_port}"
            self.health_port = self._health_server.add_insecure_port(health_listen)
            if not self.health_port:
                raise OSError(f"cannot listen on {health_listen}")
            await self._health_server.start()
        await server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        loop = asyncio.get_running_loop()

        # Releases other brokers on a shared store queue wake this server's watchers too.
        def wake(key: RankKey) -> None:
            loop.call_soon_threadsafe(servicer.wake, key)

        self._unsubscribe = self.service.store.subscribe_releases(wake)
        self._reaper = asyncio.create_task(self._reap_forever())
        if self.metrics is not None:
            self._stall_probe = asyncio.create_task(self._probe_stalls(self.metrics))

    async def _reap_forever(self) -> None:
        """Reap every ``reap_interval_ms`` (where store calls run:
        :meth:`~broker.servicer.BrokerServicer.stored`), and again once other tasks ran while
        a reap left work; while the store fails, report
        NOT_SERVING (a replica that cannot reach Redis leaves its load balancer) and log
        once."""
        serving, more = True, False
        servicer = self._servicer
        assert servicer is not None
        while True:
            await asyncio.sleep(0 if more else self.reap_interval_ms / 1000)
            try:
                more = await servicer.stored(self.service.reap)
            except Exception as exc:
                more = False
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

    async def _probe_stalls(self, metrics: BrokerMetrics) -> None:
        """Tell ``metrics`` how late the loop wakes a task every :data:`STALL_PROBE_S`."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(STALL_PROBE_S)
            metrics.loop_stalled(loop.time() - started - STALL_PROBE_S)

    async def _set_health(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.serving.set(status == health_pb2.HealthCheckResponse.SERVING)
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
        if self.metrics is not None:
            self.metrics.serving.set(0)
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for task in (self._reaper, self._stall_probe):
            if task is not None:
                task.cancel()
        self._unsubscribe()
        await self._server.stop(grace_s)
        self._server = None
        if self._servicer is not None:
            self._servicer.close()
            self._servicer = None
        if self._health_server is not None:
            await self._health_server.stop(grace_s)
            self._health_server = None
