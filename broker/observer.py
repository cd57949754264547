"""What :class:`broker.service.BrokerService` tells an observer (metrics) as it works.

The base class ignores everything; :class:`broker.metrics.BrokerMetrics` counts it. Calls come
from the service's thread, after the change they describe (:meth:`~ServiceObserver.call_received`
from the server's event loop, as a call arrives); they must be cheap and must not call the
service back.
"""

from __future__ import annotations

from broker.planner import RankPlan
from broker.wire import ReleaseReason, Role, TransferState


class ServiceObserver:
    """Hooks with no effect; override the ones you need."""

    def call_received(self, method: str) -> None:
        """A call of the Broker service's ``method`` arrived (before it is parsed or
        authorized)."""

    def rank_registered(self, role: Role) -> None:
        """A rank of ``role`` registered (re-registration: after :meth:`rank_removed`)."""

    def rank_removed(self, role: Role, lease_expired: bool) -> None:
        """A rank left: deregistered, replaced, or its lease expired (``lease_expired``)."""

    def transfer_published(self) -> None:
        """A transfer was accepted; it is in flight until :meth:`transfer_finished`."""

    def plan_handed_out(self, seconds: float, plan: RankPlan, cache_hit: bool) -> None:
        """A decode rank received ``plan`` for the first time; ``seconds`` since its request
        came, ``cache_hit`` when the engine pair's planner (its templates) was already
        cached."""

    def transfer_finished(self, state: TransferState) -> None:
        """A transfer reached terminal ``state``."""

    def rank_released(self, reason: ReleaseReason, held_seconds: float) -> None:
        """A release was queued for a prefill rank, ``held_seconds`` after publication."""
