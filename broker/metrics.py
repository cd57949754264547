"""Prometheus metrics of the broker, in a registry of their own (one per broker instance).

Names follow Prometheus conventions: ``pdbroker_`` prefix, base units (seconds, bytes),
``_total`` on counters. Plans per second is ``rate(pdbroker_plans_total[1m])``; every label
value exists from the start (at 0), so rates and ratios work before the first event.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from broker.observer import ServiceObserver
from broker.planner import RankPlan
from broker.v1 import broker_pb2 as pb
from broker.wire import ReleaseReason, Role, TransferState

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25,
    0.5, 1.0,
)  # fmt: skip
_RELEASE_BUCKETS = (
    1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip
_DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


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
            "Plans handed out to decode ranks; cache=hit when the engine pair's planner "
            "templates were cached.",
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
        self.release_latency = Histogram(
            "pdbroker_release_latency_seconds",
            "From publication to a prefill rank's release: how long its blocks stay held.",
            buckets=_RELEASE_BUCKETS,
            registry=r,
        )
        self.calls = Counter(
            "pdbroker_calls_total",
            "Calls received, by Broker method (refused ones included).",
            ["method"],
            registry=r,
        )
        self._calls = {
            m.name: self.calls.labels(method=m.name)
            for m in pb.DESCRIPTOR.services_by_name["Broker"].methods
        }
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

    def call_received(self, method: str) -> None:
        self._calls[method].inc()

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
        self.release_latency.observe(max(0.0, held_seconds))

    # ------------------------------------------------------------------ exposition

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
