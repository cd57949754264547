"""Prometheus metrics of the broker, in a registry of their own (one per broker instance).

Names follow Prometheus conventions: ``pdbroker_`` prefix, base units (seconds, bytes),
``_total`` on counters. Plans per second is ``rate(pdbroker_plans_total[1m])``; every label
value exists from the start (at 0), so rates and ratios work before the first event.

Calls of the ``Broker`` service are counted under go-grpc-prometheus's names, labels and
``grpc_code`` spellings, so dashboards and alerts written for it apply:
``grpc_server_started_total`` and ``grpc_server_handling_seconds`` by ``grpc_type``,
``grpc_service`` and ``grpc_method``, ``grpc_server_handled_total`` by those and
``grpc_code``. The registry also holds prometheus_client's process, platform and GC
collectors (``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...). No series
has a ``_created`` twin: creating a :class:`BrokerMetrics` turns them off for the process.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from grpc import StatusCode
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from broker.observer import ServiceObserver
from broker.planner import RankPlan
from broker.wire import ReleaseReason, Role, TransferState

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25,
    0.5, 1.0,
)  # fmt: skip
_HANDLING_BUCKETS = (
    100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip
_RELEASE_BUCKETS = (
    1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip
_DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
#: ``grpc_code`` of each status, spelled as gRPC's Go implementation names them.
GRPC_CODES = {
    StatusCode.OK: "OK",
    StatusCode.CANCELLED: "Canceled",
    StatusCode.UNKNOWN: "Unknown",
    StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    StatusCode.NOT_FOUND: "NotFound",
    StatusCode.ALREADY_EXISTS: "AlreadyExists",
    StatusCode.PERMISSION_DENIED: "PermissionDenied",
    StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    StatusCode.ABORTED: "Aborted",
    StatusCode.OUT_OF_RANGE: "OutOfRange",
    StatusCode.UNIMPLEMENTED: "Unimplemented",
    StatusCode.INTERNAL: "Internal",
    StatusCode.UNAVAILABLE: "Unavailable",
    StatusCode.DATA_LOSS: "DataLoss",
    StatusCode.UNAUTHENTICATED: "Unauthenticated",
}


class MethodMetrics:
    """The ``grpc_server_*`` series of one method, bound once: a call costs
    :attr:`started` ``.inc()`` and one :meth:`handled`."""

    __slots__ = ("_by_code", "_ok", "_seconds", "started")

    def __init__(self, metrics: BrokerMetrics, labels: tuple[str, str, str]) -> None:
        self.started = metrics.rpc_started.labels(*labels)
        self._seconds = metrics.rpc_seconds.labels(*labels)
        self._by_code = {c: metrics.rpc_handled.labels(*labels, n) for c, n in GRPC_CODES.items()}
        self._ok = self._by_code[StatusCode.OK]

    def handled(self, code: StatusCode, seconds: float) -> None:
        """The call ended with ``code`` after ``seconds``."""
        (self._ok if code is StatusCode.OK else self._by_code[code]).inc()
        self._seconds.observe(seconds)


class BrokerMetrics(ServiceObserver):
    """Everything the broker exports, fed by the service through the observer hooks."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.plan_latency = Histogram(
            "pdbroker_plan_latency_seconds",
            "Time the broker took to hand a decode rank its plan (first hand-out).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.plans = Counter(
            "pdbroker_plans_total",
            "Plans handed out to decode ranks; cache=hit when the planner of the engines' layouts "
            "(its templates) was cached.",
            ["cache"],
            registry=r,
        )
        self.planned_bytes = Counter(
            "pdbroker_planned_bytes_total", "Bytes the handed-out plans read.", registry=r
        )
        self.saved_bytes = Counter(
            "pdbroker_saved_bytes_total",
            "Bytes the handed-out plans avoid against copying whole padded pages.",
            registry=r,
        )
        self.plan_descriptors = Histogram(
            "pdbroker_plan_descriptors",
            "Descriptors per handed-out plan.",
            buckets=_DESCRIPTOR_BUCKETS,
            registry=r,
        )
        self.transfers = Counter(
            "pdbroker_transfers_total",
            "Transfers that reached a final state.",
            ["state"],
            registry=r,
        )
        self.transfers_in_flight = Gauge(
            "pdbroker_transfers_in_flight", "Published transfers not yet final.", registry=r
        )
        self.live_ranks = Gauge(
            "pdbroker_live_ranks", "Registered ranks holding a lease.", ["role"], registry=r
        )
        self.lease_expiries = Counter(
            "pdbroker_lease_expiries_total",
            "Rank leases that expired without renewal.",
            registry=r,
        )
        self.releases = Counter(
            "pdbroker_releases_total",
            "Releases queued for prefill ranks.",
            ["reason"],
            registry=r,
        )
        self.blocks_held = Histogram(
            "pdbroker_blocks_held_seconds",
            "From a transfer's publication to a prefill rank's release: how long its blocks "
            "stay held.",
            buckets=_RELEASE_BUCKETS,
            registry=r,
        )
        self.release_delivery = Histogram(
            "pdbroker_release_delivery_seconds",
            "From a release being queued (its transfer reported, failed, expired or aborted) "
            "to its sending on the prefill rank's WatchReleases stream.",
            buckets=_RELEASE_BUCKETS,
            registry=r,
        )
        self.serving = Gauge(
            "pdbroker_serving",
            "1 while the broker reports SERVING, 0 while it reports NOT_SERVING (its store "
            "unreachable, or shutting down).",
            registry=r,
        )
        self.store_threads = Gauge(
            "pdbroker_store_threads",
            "Threads that run calls on a shared store (--store-threads).",
            registry=r,
        )
        self.store_thread_busy = Counter(
            "pdbroker_store_thread_busy_seconds",
            "Seconds the store threads ran calls on a shared store, summed over the threads: "
            "growing by nearly pdbroker_store_threads a second, calls queue for them.",
            registry=r,
        )
        self.store_thread_cpu = Counter(
            "pdbroker_store_thread_cpu_seconds",
            "CPU seconds of those calls; the rest of their busy seconds they waited for the "
            "store's replies or for their turn.",
            registry=r,
        )
        self.store_turn = Counter(
            "pdbroker_store_turn_seconds",
            "Seconds those calls held the turn to run service code (one call at a time, "
            "waits for the store excluded): growing by nearly a second a second, calls queue "
            "for the turn.",
            registry=r,
        )
        self._longest_stall = 0.0
        Gauge(
            "pdbroker_event_loop_longest_stall_seconds",
            "The longest the event loop was late to wake a task (how long it held every "
            "other call) since the previous scrape of this series; probed every 5 ms.",
            registry=r,
        ).set_function(self._take_longest_stall)
        rpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.rpc_started = Counter(
            "grpc_server_started_total",
            "RPCs started on the server.",
            rpc_labels,
            registry=r,
        )
        self.rpc_handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code.",
            [*rpc_labels, "grpc_code"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from a call reaching its handler to its status (streams: to their end).",
            rpc_labels,
            buckets=_HANDLING_BUCKETS,
            registry=r,
        )
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=r)
        disable_created_metrics()
        for cache in ("hit", "miss"):
            self.plans.labels(cache=cache)
        for state in TransferState:
            if state.terminal:
                self.transfers.labels(state=state.value)
        for role in Role:
            self.live_ranks.labels(role=role.value)
        for reason in ReleaseReason:
            self.releases.labels(reason=reason.value)
        self._http: WSGIServer | None = None

    # ------------------------------------------------------------------ observer hooks

    def rank_registered(self, role: Role) -> None:
        self.live_ranks.labels(role=role.value).inc()

    def rank_removed(self, role: Role, lease_expired: bool) -> None:
        self.live_ranks.labels(role=role.value).dec()
        if lease_expired:
            self.lease_expiries.inc()

    def transfer_published(self) -> None:
        self.transfers_in_flight.inc()

    def plan_handed_out(self, seconds: float, plan: RankPlan, cache_hit: bool) -> None:
        nbytes = plan.nbytes
        self.plan_latency.observe(seconds)
        self.plans.labels(cache="hit" if cache_hit else "miss").inc()
        self.planned_bytes.inc(nbytes)
        self.saved_bytes.inc(max(0, plan.naive_bytes - nbytes))
        self.plan_descriptors.observe(plan.num_descriptors)

    def transfer_finished(self, state: TransferState) -> None:
        self.transfers.labels(state=state.value).inc()
        self.transfers_in_flight.dec()

    def rank_released(self, reason: ReleaseReason, held_seconds: float) -> None:
        self.releases.labels(reason=reason.value).inc()
        self.blocks_held.observe(max(0.0, held_seconds))

    def release_delivered(self, seconds: float) -> None:
        self.release_delivery.observe(max(0.0, seconds))

    # ------------------------------------------------------------------ server

    def method(self, grpc_type: str, service: str, method: str) -> MethodMetrics:
        """The series of one RPC method (``grpc_type``: unary, server_stream, ...), at 0 for
        every status code."""
        return MethodMetrics(self, (grpc_type, service, method))

    # ------------------------------------------------------------------ exposition

    def store_call(self, seconds: float, cpu_seconds: float, turn_seconds: float) -> None:
        """A call ran ``seconds`` on a store thread, ``cpu_seconds`` of them on a CPU and
        ``turn_seconds`` holding the turn."""
        self.store_thread_busy.inc(seconds)
        self.store_thread_cpu.inc(cpu_seconds)
        self.store_turn.inc(turn_seconds)

    def loop_stalled(self, seconds: float) -> None:
        """The event loop woke a task ``seconds`` late."""
        self._longest_stall = max(self._longest_stall, seconds)

    def _take_longest_stall(self) -> float:
        """The longest stall since the previous call (a scrape), starting afresh."""
        longest, self._longest_stall = self._longest_stall, 0.0
        return longest

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose ``/metrics`` over HTTP on ``addr:port`` (port 0 picks one) from a daemon
        thread; returns the bound port."""
        self._http, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        """Stop serving ``/metrics``."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
