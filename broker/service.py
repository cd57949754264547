"""The broker's business rules, free of protobuf and gRPC.

:class:`BrokerService` registers ranks under leases, assembles an engine's
:class:`~broker.layout.EngineLayout` once all its ranks registered, accepts publications,
computes plans (one cached :class:`~broker.planner.PairPlanner` per pair of engine
generations), turns them into absolute descriptors, counts the consumers of each prefill rank
and releases it when they are done, when the transfer expires, fails or is aborted.

Transfer state machine (see :class:`~broker.records.TransferState`)::

    PUBLISHED --first plan--> IN_PROGRESS --all DONE--> COMPLETED
        |                         |
        +-------------------------+--> FAILED (a FAILED report, a rank lost)
                                  +--> EXPIRED (TTL) / ABORTED (AbortTransfer)

Release rule: prefill rank *p* is released COMPLETED once every decode rank whose plan reads
from it reported DONE. When the transfer ends otherwise, every rank not yet released is
released (CONSUMER_FAILED if one of its readers failed, else the transfer's reason) — except
ranks a *live* plan reads (handed out, not reported): fencing holds those until the plan
reports, its decode rank goes away, or ``max_read_ms`` passes, so prefill never frees blocks a
decode rank may still be reading. A DONE report for a transfer that ended meanwhile is
answered ABORTED (:class:`~broker.errors.AbortedError`): the data is invalid, recompute.

Replicas: each public call runs as one :meth:`~broker.state.StateStore.transact`, so brokers
sharing a store serialise on the records they touch; metrics, logs and watcher wake-ups run
once, after the call's writes committed.

Observability: every timeline entry of a transfer is also a log line carrying its transfer
and trace ids (DEBUG, WARNING when it fails, expires or is aborted); spans ``broker.publish``,
``broker.plan``, ``broker.report``, ``broker.abort`` and ``broker.release`` join the
transfer's trace (:mod:`broker.tracing`); a :class:`~broker.observer.ServiceObserver` (the
metrics) hears of registrations, publications, plans, releases and final states.

Not thread-safe: call it from one thread (the gRPC server's event loop).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, wraps
from itertools import chain
from typing import Any, TypeVar

import numpy as np

from broker import tracing
from broker.api import (
    EngineView,
    Lease,
    PlanQuery,
    PlanResult,
    Publication,
    Report,
    ReportOutcome,
    SourceDescriptors,
    TransferListing,
)
from broker.clock import Clock, SystemClock
from broker.descriptors import descriptor_pair
from broker.errors import (
    AbortedError,
    AlreadyExistsError,
    CompactedError,
    IncompatibleLayoutsError,
    InvalidFieldError,
    LayoutError,
    LimitExceededError,
    NotFoundError,
    PdbrokerError,
    PreconditionError,
    RequestError,
)
from broker.layout import EngineLayout
from broker.logs import transfer_fields
from broker.observer import ServiceObserver
from broker.planner import PairPlanner, RankPlan, TransferRequest
from broker.records import (
    PlanRecord,
    RankKey,
    RankRecord,
    RankRegistration,
    ReleaseEvent,
    TimelineEntry,
    TransferRecord,
)
from broker.state import InMemoryStateStore, StateStore
from broker.wire import BlockIds, ReleaseReason, ReportStatus, Role, TransferState

log = logging.getLogger(__name__)
T = TypeVar("T")
LEASE_EXPIRED = "lease expired"
#: Timeline events logged at WARNING (the others at DEBUG).
_PROBLEMS = frozenset(
    s.value for s in (TransferState.FAILED, TransferState.EXPIRED, TransferState.ABORTED)
)


@dataclass(frozen=True)
class ServiceConfig:
    """Durations in milliseconds."""

    default_ttl_ms: int = 30_000
    max_ttl_ms: int = 3_600_000
    lease_ttl_ms: int = 10_000
    #: How long finished transfers stay queryable (GetTransfer, idempotent reports).
    retention_ms: int = 60_000
    max_transfers: int = 100_000
    #: Registered ranks at once, over all engines.
    max_ranks: int = 4096
    planner_cache_size: int = 64
    #: Delivered release events kept per prefill rank for streams that resume.
    release_resume_window: int = 1024
    #: Bytes of release events (:attr:`~broker.records.ReleaseEvent.nbytes`) kept per prefill
    #: rank, delivered or not, and over all ranks; the oldest beyond either are dropped and a
    #: stream resuming before them is told so (:class:`~broker.errors.CompactedError`), so
    #: its client asks which of its transfers ended. The default per rank holds several
    #: events of requests at the block-id limit (8 MiB each).
    release_backlog_bytes: int = 64 << 20
    release_backlog_total_bytes: int = 1 << 30
    #: Per prefill engine: transfers holding block ids at once, those block ids, and the
    #: agent metadata of its ranks (bytes). One engine at a quota does not stop another.
    max_transfers_per_engine: int = 10_000
    max_block_ids_per_engine: int = 1 << 22
    max_metadata_bytes_per_engine: int = 128 << 20
    #: How long a live plan (handed out, not reported) may hold its prefill ranks after its
    #: transfer ended; then it counts as failed and they are released.
    max_read_ms: int = 60_000


def _atomic(method: Callable[..., T]) -> Callable[..., T]:
    """Run a public call as one store transaction; the side effects it queued with
    :meth:`BrokerService._later` run once, after its writes committed. Domain errors commit
    the writes made before them (an expiry noticed on the way), then propagate."""

    @wraps(method)
    def call(self: BrokerService, *args: Any, **kwargs: Any) -> T:
        if self._effects is not None:  # called from another public call
            return method(self, *args, **kwargs)
        effects: list[Callable[[], None]] = []

        def attempt() -> tuple[T | None, PdbrokerError | None]:
            effects.clear()
            self._effects = effects
            try:
                return method(self, *args, **kwargs), None
            except PdbrokerError as exc:
                return None, exc
            finally:
                self._effects = None

        result, error = self.store.transact(attempt)
        for effect in effects:
            effect()
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    return call


# --------------------------------------------------------------------------- service


class BrokerService:
    """Registrations, publications, plans, reports and releases; see the module docstring."""

    def __init__(
        self,
        store: StateStore | None = None,
        clock: Clock | None = None,
        config: ServiceConfig | None = None,
        observer: ServiceObserver | None = None,
    ) -> None:
        self.store = store if store is not None else InMemoryStateStore()
        self.clock = clock if clock is not None else SystemClock()
        self.config = config if config is not None else ServiceConfig()
        self.observer = observer if observer is not None else ServiceObserver()
        self._layouts: dict[tuple[str, int], EngineLayout] = {}
        self._planners: OrderedDict[tuple[str, int, str, int], PairPlanner] = OrderedDict()
        self._listeners: list[Callable[[RankKey], None]] = []
        #: Side effects of the call in progress, run after it commits (see :func:`_atomic`).
        self._effects: list[Callable[[], None]] | None = None

    def add_release_listener(self, listener: Callable[[RankKey], None]) -> None:
        """``listener(key)`` is called when a release is queued for prefill rank ``key`` or
        that rank goes away (so a watcher can wake up and notice)."""
        self._listeners.append(listener)

    # ------------------------------------------------------------------ registration

    @_atomic
    def register_rank(self, reg: RankRegistration) -> Lease:
        """Register (or re-register, failing the old registration's transfers) one rank."""
        now = self.clock.now_ms()
        _check_regions(reg)
        siblings = [
            r
            for r in self.store.engine_ranks(reg.engine_id)
            if r.registration.tp_rank != reg.tp_rank
        ]
        for name in ("tp_size", "role", "model_fingerprint"):
            if siblings and getattr(siblings[0].registration, name) != getattr(reg, name):
                theirs = getattr(siblings[0].registration, name)
                raise PreconditionError(
                    name,
                    f"engine {reg.engine_id!r} registered its other ranks "
                    f"with {name}={_show(theirs)}, got {_show(getattr(reg, name))}",
                )
        ranks = self.store.ranks()
        if len(ranks) >= self.config.max_ranks and all(
            r.registration.key != reg.key for r in ranks
        ):
            raise LimitExceededError(
                "tp_rank", f"the broker already holds {self.config.max_ranks} registered ranks"
            )
        for other in ranks:
            if (
                other.registration.agent_name == reg.agent_name
                and other.registration.key != reg.key
            ):
                raise AlreadyExistsError(
                    "agent_name",
                    f"{reg.agent_name!r} is already registered by "
                    f"engine {other.registration.engine_id!r} rank "
                    f"{other.registration.tp_rank}",
                )
        metadata = len(reg.agent_metadata) + sum(
            len(s.registration.agent_metadata) for s in siblings
        )
        if metadata > self.config.max_metadata_bytes_per_engine:
            raise LimitExceededError(
                "agent_metadata",
                f"engine {reg.engine_id!r}'s ranks would hold {metadata} bytes of agent "
                f"metadata, over its quota of {self.config.max_metadata_bytes_per_engine} "
                "(--max-metadata-bytes-per-engine)",
            )
        complete = len(siblings) + 1 == reg.tp_size
        if complete:
            self._assemble_layout([s.registration for s in siblings] + [reg])
        old = self.store.get_rank(reg.key)
        if old is not None:
            self._remove_rank(old, "re-registered")
        record = RankRecord(
            reg,
            secrets.token_hex(16),
            now + self.config.lease_ttl_ms,
            now,
            self.store.next_counter("generation"),
        )
        self.store.put_rank(record)
        self._later(self.observer.rank_registered, reg.role)
        return Lease(
            record.lease_id,
            self.config.lease_ttl_ms,
            max([record.generation] + [s.generation for s in siblings]),
            complete,
        )

    @_atomic
    def keep_alive(self, lease_id: str) -> int:
        """Renew a lease; returns its TTL (ms). NOT_FOUND once expired."""
        now = self.clock.now_ms()
        record = self._lease(lease_id)
        if record.lease_expires_at_ms <= now:
            self._remove_rank(record, LEASE_EXPIRED)
            raise NotFoundError("lease_id", "lease expired; register again")
        record.lease_expires_at_ms = now + self.config.lease_ttl_ms
        self.store.put_rank(record)
        return self.config.lease_ttl_ms

    @_atomic
    def deregister(self, lease_id: str) -> None:
        self._remove_rank(self._lease(lease_id), "deregistered")

    def list_engines(self) -> list[EngineView]:
        engines: dict[str, list[RankRecord]] = {}
        for record in self.store.ranks():
            engines.setdefault(record.registration.engine_id, []).append(record)
        views = []
        for engine_id in sorted(engines):
            ranks = engines[engine_id]
            first = ranks[0].registration
            views.append(
                EngineView(
                    engine_id,
                    first.role,
                    first.tp_size,
                    first.model_fingerprint,
                    max(r.generation for r in ranks),
                    tuple(ranks),
                )
            )
        return views

    # ------------------------------------------------------------------ transfers

    @_atomic
    def publish(self, pub: Publication) -> int:
        """Accept a prefill engine's blocks; returns the expiry instant (ms since epoch)."""
        with tracing.span(
            "broker.publish",
            pub.traceparent,
            {"pdbroker.transfer_id": pub.transfer_id, "pdbroker.prefill_engine": pub.engine_id},
        ) as span:
            return self._publish(pub, pub.traceparent or tracing.span_traceparent(span))

    def _publish(self, pub: Publication, traceparent: str) -> int:
        now = self.clock.now_ms()
        if self.store.get_transfer(pub.transfer_id) is not None:
            raise AlreadyExistsError(
                "transfer_id", f"transfer {pub.transfer_id!r} was already published"
            )
        if self.store.count_transfers() >= self.config.max_transfers:
            raise LimitExceededError(
                "transfer_id", f"the broker already holds {self.config.max_transfers} transfers"
            )
        self._check_engine_quota(pub)
        ranks, layout, generation = self._engine(pub.engine_id)
        if not ranks[0].registration.role.publishes:
            raise PreconditionError("engine_id", f"engine {pub.engine_id!r} is a decode engine")
        ttl = pub.ttl_ms or self.config.default_ttl_ms
        if ttl > self.config.max_ttl_ms:
            raise RequestError(
                "ttl_ms", f"{ttl} exceeds the broker's maximum {self.config.max_ttl_ms}"
            )
        _check_published_blocks(layout, pub)
        record = TransferRecord(
            pub.transfer_id,
            pub.engine_id,
            generation,
            layout.tp_size,
            pub.num_tokens,
            pub.block_ids,
            pub.allowed_decode_engines,
            now,
            now + ttl,
            now + ttl,
            traceparent=traceparent,
        )
        self._record(
            record, now, "published", f"by {pub.engine_id}, {pub.num_tokens} tokens, ttl {ttl} ms"
        )
        self.store.put_transfer(record)
        self._later(self.observer.transfer_published)
        return record.expires_at_ms

    @_atomic
    def get_plan(self, query: PlanQuery) -> PlanResult:
        """The decode rank's reads. The first call for a transfer claims it for the decode
        engine and plans every decode rank, which fixes each prefill rank's consumers."""
        started = time.perf_counter()
        now = self.clock.now_ms()
        transfer = self._transfer(query.transfer_id, now)
        with tracing.span(
            "broker.plan",
            transfer.traceparent,
            {
                "pdbroker.transfer_id": transfer.transfer_id,
                "pdbroker.decode_rank": query.tp_rank,
            },
        ) as span:
            traceparent = tracing.span_traceparent(span) or transfer.traceparent
            result, cache_hit, first = self._get_plan(transfer, query, now, traceparent)
            if span is not None:
                span.set_attributes(
                    {
                        "pdbroker.source_ranks": [s.prefill_rank for s in result.sources],
                        "pdbroker.descriptors": result.num_descriptors,
                        "pdbroker.bytes": result.total_bytes,
                        "pdbroker.cache_hit": cache_hit,
                    }
                )
        if first:
            self._later(
                self.observer.plan_handed_out, time.perf_counter() - started, result, cache_hit
            )
        return result

    def _get_plan(
        self, transfer: TransferRecord, query: PlanQuery, now: int, traceparent: str
    ) -> tuple[PlanResult, bool, bool]:
        """The plan, whether the pair's planner was cached, whether this is its first
        hand-out. A decode engine the transfer is not for learns only that there is no such
        transfer."""
        if (query.prefill_engine_id and query.prefill_engine_id != transfer.prefill_engine_id) or (
            transfer.allowed_decode_engines
            and query.engine_id not in transfer.allowed_decode_engines
        ):
            raise NotFoundError("transfer_id", f"no transfer {transfer.transfer_id!r}")
        if transfer.state.terminal:
            raise PreconditionError(
                "transfer_id",
                f"transfer {transfer.transfer_id!r} is "
                f"{transfer.state.value}; its blocks are released",
            )
        d_ranks, d_layout, d_generation = self._engine(query.engine_id)
        if not d_ranks[0].registration.role.reads:
            raise PreconditionError("engine_id", f"engine {query.engine_id!r} is a prefill engine")
        if not 0 <= query.tp_rank < d_layout.tp_size:
            raise RequestError("tp_rank", f"{query.tp_rank} outside [0, {d_layout.tp_size})")
        if transfer.decode_engine_id and transfer.decode_engine_id != query.engine_id:
            raise PreconditionError(
                "transfer_id",
                f"transfer {transfer.transfer_id!r} was claimed by another decode engine",
            )
        p_ranks, p_layout, p_generation = self._engine(transfer.prefill_engine_id, "transfer_id")
        if p_generation != transfer.prefill_generation:
            raise PreconditionError(
                "transfer_id", "the prefill engine re-registered since publishing"
            )
        planner, cache_hit = self._planner(
            transfer.prefill_engine_id,
            p_generation,
            p_layout,
            query.engine_id,
            d_generation,
            d_layout,
        )
        if transfer.state is TransferState.PUBLISHED:
            self._claim(transfer, planner, query, d_generation, now)
        plan = transfer.plans[query.tp_rank]
        if plan.block_ids != query.block_ids:
            if plan.handed_out:
                raise AlreadyExistsError(
                    "block_ids",
                    f"decode rank {query.tp_rank} already holds plan "
                    f"{plan.plan_id} for other block ids",
                )
            self._replan(transfer, plan, planner, query.block_ids)
        result = self._plan_result(
            transfer, plan, p_ranks, d_ranks[query.tp_rank], query, traceparent
        )
        first = not plan.handed_out
        if first:
            plan.handed_out, plan.handed_out_at_ms = True, now
            self._record(
                transfer,
                now,
                "planned",
                f"decode rank {plan.decode_rank}: {result.num_descriptors} "
                f"descriptors, {result.total_bytes} bytes",
            )
        self.store.put_transfer(transfer)
        return result, cache_hit, first

    @_atomic
    def report(self, report: Report) -> ReportOutcome:
        """Record a decode rank's outcome (the first report of a plan wins) and release the
        prefill ranks it settles. A DONE report (or its repetition) for a transfer that ended
        while the rank read is recorded, then answered with :class:`AbortedError`."""
        now = self.clock.now_ms()
        transfer_id = self.store.transfer_of_plan(report.plan_id)
        transfer = None if transfer_id is None else self.store.get_transfer(transfer_id)
        plan = (
            None
            if transfer is None
            else next((p for p in transfer.plans.values() if p.plan_id == report.plan_id), None)
        )
        if transfer is None or plan is None or not plan.handed_out:
            raise NotFoundError("plan_id", f"no plan {report.plan_id!r}")
        with tracing.span(
            "broker.report",
            transfer.traceparent,
            {
                "pdbroker.transfer_id": transfer.transfer_id,
                "pdbroker.decode_rank": plan.decode_rank,
                "pdbroker.status": report.status.value,
            },
        ) as span:
            outcome = self._report(transfer, plan, report, now)
            if span is not None:
                span.set_attributes(
                    {"pdbroker.duplicate": outcome.duplicate, "pdbroker.intact": outcome.intact}
                )
        if report.status is ReportStatus.DONE and not outcome.intact:
            raise AbortedError(
                "plan_id",
                f"transfer {transfer.transfer_id!r} ended ({transfer.state.value}: "
                f"{plan.error or transfer.end_detail}) while decode rank {plan.decode_rank} "
                "read it: the data is invalid, recompute",
            )
        return outcome

    def _report(
        self, transfer: TransferRecord, plan: PlanRecord, report: Report, now: int
    ) -> ReportOutcome:
        if report.engine_id != transfer.decode_engine_id:
            raise RequestError(
                "engine_id",
                f"plan {plan.plan_id} belongs to decode engine {transfer.decode_engine_id!r}",
            )
        if report.tp_rank != plan.decode_rank:
            raise RequestError(
                "tp_rank", f"plan {plan.plan_id} belongs to decode rank {plan.decode_rank}"
            )
        if plan.status is not None:
            return ReportOutcome(True, transfer.state, plan.intact)
        if report.status is ReportStatus.DONE and report.bytes_moved not in (
            0,
            plan.rank_plan.nbytes,
        ):
            raise RequestError(
                "bytes_moved",
                f"{report.bytes_moved} differs from the plan's {plan.rank_plan.nbytes} bytes",
            )
        self._expire_if_due(transfer, now)
        plan.status, plan.bytes_moved = report.status, report.bytes_moved
        plan.duration_us, plan.error = report.duration_us, report.error
        plan.intact = report.status is ReportStatus.DONE and not transfer.state.terminal
        self._record(
            transfer,
            now,
            "reported",
            f"decode rank {plan.decode_rank}: {report.status.value}"
            + (f" ({report.error})" if report.error else ""),
        )
        if not transfer.state.terminal:
            if report.status is ReportStatus.FAILED:
                self._finish(
                    transfer,
                    TransferState.FAILED,
                    ReleaseReason.CONSUMER_FAILED,
                    f"decode rank {plan.decode_rank} failed: {report.error}",
                    now,
                )
            else:
                self._settle(transfer, now)
        else:
            self._release_unheld(transfer, now)  # this plan no longer holds its sources
        self.store.put_transfer(transfer)
        return ReportOutcome(False, transfer.state, plan.intact)

    @_atomic
    def abort(self, transfer_id: str, reason: str) -> TransferState:
        """End a transfer now; returns its (possibly earlier) terminal state."""
        now = self.clock.now_ms()
        transfer = self._transfer(transfer_id, now)
        if not transfer.state.terminal:
            with tracing.span(
                "broker.abort", transfer.traceparent, {"pdbroker.transfer_id": transfer_id}
            ):
                self._finish(
                    transfer,
                    TransferState.ABORTED,
                    ReleaseReason.ABORTED,
                    reason or "aborted",
                    now,
                )
            self.store.put_transfer(transfer)
        return transfer.state

    @_atomic
    def get_transfer(self, transfer_id: str) -> TransferRecord:
        return self._transfer(transfer_id, self.clock.now_ms())

    def list_transfers(self, include_finished: bool = False, limit: int = 0) -> TransferListing:
        """Counts by state of every held transfer; unfinished transfers oldest first, then
        with ``include_finished`` the finished ones most recent first; at most ``limit``
        (0: all)."""
        counts: Counter[TransferState] = Counter()
        unfinished: list[TransferRecord] = []
        finished: list[TransferRecord] = []
        for transfer in self.store.transfers():
            counts[transfer.state] += 1
            (finished if transfer.state.terminal else unfinished).append(transfer)
        unfinished.sort(key=lambda t: (t.published_at_ms, t.transfer_id))
        listed = unfinished
        if include_finished:
            finished.sort(key=lambda t: (-(t.finished_at_ms or 0), t.transfer_id))
            listed += finished
        return TransferListing(
            self.clock.now_ms(), dict(counts), tuple(listed[:limit] if limit else listed)
        )

    # ------------------------------------------------------------------ releases

    def release_stream(
        self, engine_id: str, tp_rank: int, after_sequence: int, lease_id: str = ""
    ) -> tuple[int, int]:
        """Start watching prefill rank ``(engine_id, tp_rank)``: returns its registration
        generation and the cursor to read from (``after_sequence``, or where the last
        watcher stopped when 0). A ``lease_id`` that is not the rank's current lease fails:
        the cursor was read under another registration, whose sequences these are not."""
        record = self.store.get_rank((engine_id, tp_rank))
        if record is None:
            field_name = "tp_rank" if self.store.engine_ranks(engine_id) else "engine_id"
            raise NotFoundError(
                field_name, f"engine {engine_id!r} has no registered rank {tp_rank}"
            )
        if not record.registration.role.publishes:
            raise PreconditionError("engine_id", f"engine {engine_id!r} is a decode engine")
        if lease_id and lease_id != record.lease_id:
            raise PreconditionError(
                "lease_id",
                f"not the current lease of rank {tp_rank}: it registered again since; "
                "watch under the new lease from after_sequence 0",
            )
        cursor = after_sequence or self.store.delivered((engine_id, tp_rank))
        self._check_kept((engine_id, tp_rank), cursor)
        return record.generation, cursor

    def releases(self, key: RankKey, generation: int, cursor: int) -> list[ReleaseEvent] | None:
        """Events after ``cursor`` for the rank, or ``None`` once that registration is gone;
        :class:`CompactedError` when some of them are no longer kept."""
        record = self.store.get_rank(key)
        if record is None or record.generation != generation:
            return None
        self._check_kept(key, cursor)
        return self.store.releases_after(key, cursor)

    def _check_kept(self, key: RankKey, cursor: int) -> None:
        through = self.store.compacted_through(key)
        if cursor < through:
            raise CompactedError(
                "after_sequence",
                f"release events of rank {key[1]} after {cursor} through {through} are no "
                "longer kept; ask GetTransfer which of your transfers were released, then "
                f"watch from after_sequence {through}",
                through,
            )

    def delivered(self, key: RankKey, sequence: int) -> None:
        """A watcher sent events up to ``sequence``."""
        self.store.mark_delivered(key, sequence)
        self.store.trim_releases(key, self.config.release_resume_window)

    # ------------------------------------------------------------------ time

    def reap(self) -> None:
        """Expire leases and transfers that are due, end live plans of ended transfers past
        ``max_read_ms``, forget finished transfers after the retention period. Called
        periodically by the server; each item is its own transaction."""
        now = self.clock.now_ms()
        for record in self.store.ranks():
            if record.lease_expires_at_ms <= now:
                self._expire_lease(record.registration.key)
        for transfer in self.store.due_transfers(now):
            self._reap_transfer(transfer.transfer_id)

    @_atomic
    def _expire_lease(self, key: RankKey) -> None:
        record = self.store.get_rank(key)
        if record is not None and record.lease_expires_at_ms <= self.clock.now_ms():
            self._remove_rank(record, LEASE_EXPIRED)

    @_atomic
    def _reap_transfer(self, transfer_id: str) -> None:
        now = self.clock.now_ms()
        transfer = self.store.get_transfer(transfer_id)
        if transfer is None or transfer.deadline_ms > now:
            return
        if not transfer.state.terminal:
            self._expire_if_due(transfer, now)
        elif len(transfer.released) < transfer.prefill_tp_size:
            for plan in transfer.plans.values():
                if plan.live and plan.handed_out_at_ms + self.config.max_read_ms <= now:
                    plan.status = ReportStatus.FAILED
                    plan.error = f"no report within max_read_ms={self.config.max_read_ms}"
                    self._record(transfer, now, "read timed out", f"decode rank {plan.decode_rank}")
            self._release_unheld(transfer, now)
        else:
            self.store.delete_transfer(transfer_id)
            return
        self.store.put_transfer(transfer)

    # ------------------------------------------------------------------ internals

    def _lease(self, lease_id: str) -> RankRecord:
        record = self.store.rank_by_lease(lease_id)
        if record is None:
            raise NotFoundError("lease_id", "unknown or expired lease; register again")
        return record

    def _check_engine_quota(self, pub: Publication) -> None:
        """RESOURCE_EXHAUSTED when ``pub`` would take its prefill engine past its share of
        the broker (``max_transfers_per_engine``, ``max_block_ids_per_engine``)."""
        transfers, held = self.store.engine_usage(pub.engine_id)
        if transfers >= self.config.max_transfers_per_engine:
            raise LimitExceededError(
                "transfer_id",
                f"engine {pub.engine_id!r} holds {transfers} transfers, its quota "
                "(--max-transfers-per-engine): wait for releases",
            )
        asked = sum(len(g) for g in pub.block_ids)
        if held + asked > self.config.max_block_ids_per_engine:
            raise LimitExceededError(
                "block_ids",
                f"engine {pub.engine_id!r} holds {held} block ids; {asked} more would pass its "
                f"quota of {self.config.max_block_ids_per_engine} (--max-block-ids-per-engine)",
            )

    def _transfer(self, transfer_id: str, now: int) -> TransferRecord:
        transfer = self.store.get_transfer(transfer_id)
        if transfer is None:
            raise NotFoundError("transfer_id", f"no transfer {transfer_id!r}")
        if self._expire_if_due(transfer, now):
            self.store.put_transfer(transfer)
        return transfer

    def _engine(
        self,
        engine_id: str,
        field_name: str = "engine_id",
    ) -> tuple[list[RankRecord], EngineLayout, int]:
        """The engine's ranks, layout and generation; it must be fully registered."""
        ranks = self.store.engine_ranks(engine_id)
        if not ranks:
            raise NotFoundError(field_name, f"no engine {engine_id!r} is registered")
        tp_size = ranks[0].registration.tp_size
        if len(ranks) != tp_size:
            raise PreconditionError(
                field_name,
                f"engine {engine_id!r} has {len(ranks)} of its {tp_size} ranks registered",
            )
        generation = max(r.generation for r in ranks)
        layout = self._layouts.get((engine_id, generation))
        if layout is None:
            layout = self._assemble_layout([r.registration for r in ranks])
            self._layouts[(engine_id, generation)] = layout
        return ranks, layout, generation

    @staticmethod
    def _assemble_layout(registrations: list[RankRegistration]) -> EngineLayout:
        regs = sorted(registrations, key=lambda r: r.tp_rank)
        try:
            return EngineLayout(
                regs[0].model_fingerprint, regs[0].tp_size, tuple(r.layout for r in regs)
            )
        except LayoutError as exc:
            raise PreconditionError(f"layout.{exc.field}", exc.detail) from None

    def _planner(
        self,
        p_engine: str,
        p_generation: int,
        p_layout: EngineLayout,
        d_engine: str,
        d_generation: int,
        d_layout: EngineLayout,
    ) -> tuple[PairPlanner, bool]:
        """The pair's cached planner, and whether it was cached."""
        key = (p_engine, p_generation, d_engine, d_generation)
        planner = self._planners.get(key)
        cached = planner is not None
        if planner is None:
            try:
                planner = PairPlanner(p_layout, d_layout)
            except IncompatibleLayoutsError as exc:
                name = (
                    "model_fingerprint"
                    if exc.field == "model"
                    else (exc.field if exc.field == "tp_size" else f"layout.{exc.field}")
                )
                raise IncompatibleLayoutsError(
                    name,
                    f"decode engine {d_engine!r} cannot read from "
                    f"prefill engine {p_engine!r}: {exc.detail}",
                ) from None
            self._planners[key] = planner
            if len(self._planners) > self.config.planner_cache_size:
                self._planners.popitem(last=False)
        else:
            self._planners.move_to_end(key)
        return planner, cached

    def _plans(
        self,
        planner: PairPlanner,
        transfer: TransferRecord,
        block_ids: BlockIds,
        decode_rank: int | None = None,
    ) -> tuple[RankPlan, ...]:
        """Every decode rank's plan, made together (decode ranks of one engine share block
        ids), or ``decode_rank``'s alone."""
        request = TransferRequest(transfer.num_tokens, transfer.block_ids, block_ids)
        try:
            if decode_rank is None:
                return planner.plan(request).ranks
            return (planner.plan_rank(decode_rank, request),)
        except RequestError as exc:
            raise _planning_error(exc) from None

    def _claim(
        self,
        transfer: TransferRecord,
        planner: PairPlanner,
        query: PlanQuery,
        d_generation: int,
        now: int,
    ) -> None:
        """Plan every decode rank with the asker's block ids (decode ranks of one engine
        share block ids); this fixes the consumers of each prefill rank."""
        claim = secrets.token_hex(10)  # plan ids: unguessable, unique per claim and rank
        plans = {
            rank_plan.decode_rank: PlanRecord(
                f"{claim}-{rank_plan.decode_rank}",
                transfer.transfer_id,
                rank_plan.decode_rank,
                query.block_ids,
                rank_plan,
            )
            for rank_plan in self._plans(planner, transfer, query.block_ids)
        }
        transfer.plans = plans
        for plan in plans.values():
            self.store.index_plan(plan.plan_id, transfer.transfer_id)
        transfer.decode_engine_id, transfer.decode_generation = query.engine_id, d_generation
        transfer.state = TransferState.IN_PROGRESS
        self._count_consumers(transfer)
        self._record(transfer, now, "claimed", f"by decode engine {query.engine_id}")
        self._settle(transfer, now)

    def _replan(
        self, transfer: TransferRecord, plan: PlanRecord, planner: PairPlanner, block_ids: BlockIds
    ) -> None:
        """A decode rank asks with block ids other than those its plan was made with."""
        (rank_plan,) = self._plans(planner, transfer, block_ids, plan.decode_rank)
        released = [p for p in rank_plan.prefill_ranks if p in transfer.released]
        if released:
            raise PreconditionError("block_ids", f"prefill rank {released[0]} was already released")
        plan.block_ids, plan.rank_plan = block_ids, rank_plan
        self._count_consumers(transfer)

    @staticmethod
    def _count_consumers(transfer: TransferRecord) -> None:
        readers: list[set[int]] = [set() for _ in range(transfer.prefill_tp_size)]
        for d, plan in transfer.plans.items():
            for p in plan.prefill_ranks:
                readers[p].add(d)
        transfer.consumers = {p: frozenset(r) for p, r in enumerate(readers)}

    def _settle(self, transfer: TransferRecord, now: int) -> None:
        """Release every prefill rank whose consumers all reported DONE; complete the
        transfer when every plan is DONE."""
        for p, readers in transfer.consumers.items():
            if p not in transfer.released and all(
                transfer.plans[d].status is ReportStatus.DONE for d in readers
            ):
                self._release(transfer, p, ReleaseReason.COMPLETED, "all readers done", now)
        if all(plan.status is ReportStatus.DONE for plan in transfer.plans.values()):
            self._finished(transfer, TransferState.COMPLETED, now)
            self._record(transfer, now, "completed")

    def _finished(self, transfer: TransferRecord, state: TransferState, now: int) -> None:
        """Enter terminal ``state``; the reaper forgets the transfer after the retention."""
        transfer.state, transfer.finished_at_ms = state, now
        transfer.deadline_ms = now + self.config.retention_ms
        self._later(self.observer.transfer_finished, state)
        _drop_block_ids_once_released(transfer)

    def _expire_if_due(self, transfer: TransferRecord, now: int) -> bool:
        if transfer.state.terminal or now < transfer.expires_at_ms:
            return False
        self._finish(transfer, TransferState.EXPIRED, ReleaseReason.EXPIRED, "ttl elapsed", now)
        return True

    def _finish(
        self,
        transfer: TransferRecord,
        state: TransferState,
        reason: ReleaseReason,
        detail: str,
        now: int,
    ) -> None:
        """Enter a terminal state and release every prefill rank no live plan reads."""
        self._finished(transfer, state, now)
        transfer.end_reason, transfer.end_detail = reason, detail
        self._record(transfer, now, state.value, detail)
        self._release_unheld(transfer, now)

    def _release_unheld(self, transfer: TransferRecord, now: int) -> None:
        """For an ended transfer: release each prefill rank not yet released that no live
        plan reads; while some are held, the reaper looks again when the first live plan's
        ``max_read_ms`` ends."""
        reason = transfer.end_reason or ReleaseReason.ABORTED
        held_until = []
        for p in range(transfer.prefill_tp_size):
            if p in transfer.released:
                continue
            readers = [transfer.plans[d] for d in transfer.consumers.get(p, frozenset())]
            live = [plan.handed_out_at_ms for plan in readers if plan.live]
            if live:
                held_until.append(min(live) + self.config.max_read_ms)
                continue
            failed = any(plan.status is ReportStatus.FAILED for plan in readers)
            self._release(
                transfer,
                p,
                ReleaseReason.CONSUMER_FAILED if failed else reason,
                transfer.end_detail,
                now,
            )
        if held_until:
            transfer.deadline_ms = min(held_until)
        elif transfer.finished_at_ms is not None:
            transfer.deadline_ms = max(now, transfer.finished_at_ms) + self.config.retention_ms

    def _release(
        self, transfer: TransferRecord, p: int, reason: ReleaseReason, detail: str, now: int
    ) -> None:
        """Mark prefill rank ``p`` released and queue its event, unless that rank is gone or
        re-registered since publishing (its blocks no longer exist)."""
        transfer.released[p] = reason
        self._record(transfer, now, "released", f"prefill rank {p}: {reason.value}")
        key = (transfer.prefill_engine_id, p)
        record = self.store.get_rank(key)
        if record is None or record.generation > transfer.prefill_generation:
            _drop_block_ids_once_released(transfer)
            return
        with tracing.span(
            "broker.release",
            transfer.traceparent,
            {
                "pdbroker.transfer_id": transfer.transfer_id,
                "pdbroker.prefill_rank": p,
                "pdbroker.reason": reason.value,
            },
        ) as span:
            event = ReleaseEvent(
                self.store.next_counter("release"),
                transfer.transfer_id,
                transfer.block_ids,
                reason,
                detail,
                now,
                tracing.span_traceparent(span) or transfer.traceparent,
            )
            self.store.append_release(
                key,
                event,
                self.config.release_backlog_bytes,
                self.config.release_backlog_total_bytes,
            )
            self._notify(key)
        _drop_block_ids_once_released(transfer)
        self._later(self.observer.rank_released, reason, (now - transfer.published_at_ms) / 1000)

    def _remove_rank(self, record: RankRecord, why: str) -> None:
        """Forget a rank and fail the unfinished transfers it takes part in."""
        now = self.clock.now_ms()
        key = record.registration.key
        engine_id, tp_rank = key
        self.store.delete_rank(key)
        self._later(self.observer.rank_removed, record.registration.role, why == LEASE_EXPIRED)
        self.store.drop_releases(key)
        self.store.drop_contacts(key)
        for cached in [k for k in self._layouts if k[0] == engine_id]:
            del self._layouts[cached]
        for transfer in self.store.transfers():
            if transfer.state.terminal:
                self._drop_live_plan(transfer, record, f"decode rank {tp_rank} {why}", now)
                continue
            if (
                transfer.prefill_engine_id == engine_id
                and record.generation <= transfer.prefill_generation
            ):
                self._finish(
                    transfer,
                    TransferState.FAILED,
                    ReleaseReason.ABORTED,
                    f"prefill rank {tp_rank} {why}",
                    now,
                )
            elif (
                transfer.decode_engine_id == engine_id
                and record.generation <= transfer.decode_generation
            ):
                plan = transfer.plans[tp_rank]
                if plan.handed_out and plan.status is None:
                    plan.status, plan.error = ReportStatus.FAILED, f"decode rank {why}"
                self._finish(
                    transfer,
                    TransferState.FAILED,
                    ReleaseReason.CONSUMER_FAILED,
                    f"decode rank {tp_rank} {why}",
                    now,
                )
            else:
                continue
            self.store.put_transfer(transfer)
        self._notify(key)

    def _drop_live_plan(
        self, transfer: TransferRecord, decode: RankRecord, why: str, now: int
    ) -> None:
        """An ended transfer's live plan whose decode rank went away fails: what it held is
        released."""
        engine_id, tp_rank = decode.registration.key
        plan = transfer.plans.get(tp_rank)
        if (
            transfer.decode_engine_id != engine_id
            or decode.generation > transfer.decode_generation
            or plan is None
            or not plan.live
        ):
            return
        plan.status, plan.error = ReportStatus.FAILED, why
        self._record(transfer, now, "reader lost", why)
        self._release_unheld(transfer, now)
        self.store.put_transfer(transfer)

    def _record(self, transfer: TransferRecord, now: int, event: str, detail: str = "") -> None:
        """Append to the transfer's timeline and log the entry with its transfer and trace
        ids."""
        transfer.timeline.append(TimelineEntry(now, event, detail))
        level = logging.WARNING if event in _PROBLEMS else logging.DEBUG
        if log.isEnabledFor(level):
            self._later(
                log.log,
                level,
                "%s%s",
                event,
                f": {detail}" if detail else "",
                extra=transfer_fields(transfer.transfer_id, transfer.traceparent),
            )

    def _notify(self, key: RankKey) -> None:
        for listener in self._listeners:
            self._later(listener, key)

    def _later(self, effect: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Run ``effect`` once the call in progress committed (now outside any call)."""
        if self._effects is None:
            effect(*args, **kwargs)
        else:
            self._effects.append(partial(effect, *args, **kwargs))

    def _plan_result(
        self,
        transfer: TransferRecord,
        plan: PlanRecord,
        p_ranks: list[RankRecord],
        d_rank: RankRecord,
        query: PlanQuery,
        traceparent: str,
    ) -> PlanResult:
        d_reg = d_rank.registration
        sources = []
        for reads in plan.rank_plan.sources:
            p_rank = p_ranks[reads.prefill_rank]
            p_reg = p_rank.registration
            first = self.store.add_contact(d_reg.key, f"{p_reg.agent_name}#{p_rank.generation}")
            local, remote = descriptor_pair(
                d_reg.region_table,
                p_reg.region_table,
                reads.region,
                reads.local_offset,
                reads.remote_offset,
                reads.length,
            )
            sources.append(
                SourceDescriptors(
                    reads.prefill_rank,
                    p_reg.agent_name,
                    p_reg.agent_metadata if first or query.want_agent_metadata else b"",
                    local,
                    remote,
                    reads.nbytes,
                    f"pdbroker:{transfer.transfer_id}:{plan.plan_id}:{reads.prefill_rank}".encode(),
                    d_reg.regions[0].memory_kind,
                    p_reg.regions[0].memory_kind,
                )
            )
        return PlanResult(
            plan.plan_id,
            tuple(sources),
            plan.rank_plan.naive_bytes,
            plan.rank_plan.vllm_descriptors,
            transfer.expires_at_ms,
            traceparent,
        )


def _planning_error(exc: RequestError) -> PdbrokerError:
    """A planner error as the service's: bad decode block ids name ``block_ids``; a
    published request that cannot be planned fails the transfer's precondition."""
    if exc.field.startswith("decode_block_ids"):
        return RequestError("block_ids" + exc.field.removeprefix("decode_block_ids"), exc.detail)
    return PreconditionError("transfer_id", f"published request cannot be planned: {exc}")


def _drop_block_ids_once_released(transfer: TransferRecord) -> None:
    """A finished transfer whose every prefill rank was released needs its block ids no
    more (its release events carry their own): it keeps its record, not them."""
    if transfer.state.terminal and len(transfer.released) == transfer.prefill_tp_size:
        transfer.block_ids = ()


def _check_published_blocks(layout: EngineLayout, pub: Publication) -> None:
    """Prefill block ids fit the engine: one list per group, ids in range, no id twice, each
    attention group holding ``num_tokens``, each Mamba group at least one block. One numpy
    pass over all ids; the slower per-group pass only runs to name an offending group."""
    if pub.num_tokens <= 0:
        raise RequestError("num_tokens", "must be positive")
    if len(pub.block_ids) != len(layout.groups):
        raise RequestError(
            "block_ids", f"expected {len(layout.groups)} groups, got {len(pub.block_ids)}"
        )
    limit = layout.ranks[0].num_blocks
    ids = np.fromiter(chain.from_iterable(pub.block_ids), dtype=np.int64)
    if ids.size and (
        int(ids.min()) < 0 or int(ids.max()) >= limit or np.unique(ids).size != ids.size
    ):
        seen: set[int] = set()
        for g, group_ids in enumerate(pub.block_ids):
            for b in group_ids:
                if not 0 <= b < limit:
                    raise RequestError(f"block_ids[{g}]", f"block id {b} outside [0, {limit})")
                if b in seen:
                    raise RequestError(f"block_ids[{g}]", f"block id {b} appears twice")
                seen.add(b)
    for g, (group, group_ids) in enumerate(zip(layout.groups, pub.block_ids)):
        if group.is_attention and len(group_ids) * group.block_size < pub.num_tokens:
            raise RequestError(
                f"block_ids[{g}]",
                f"{len(group_ids)} blocks of {group.block_size} "
                f"tokens cannot hold num_tokens={pub.num_tokens}",
            )
        if not group.is_attention and not group_ids:
            raise RequestError(f"block_ids[{g}]", "a Mamba group needs its state block")


def _check_regions(reg: RankRegistration) -> None:
    """One region per layout region, each long enough for ``num_blocks`` pages, addressable
    as int64 and of one memory kind: what makes every planned descriptor land in a region."""
    if not 0 <= reg.tp_rank < reg.tp_size:
        raise InvalidFieldError("tp_rank", f"{reg.tp_rank} outside [0, {reg.tp_size})")
    if len(reg.regions) != reg.layout.num_regions:
        raise InvalidFieldError(
            "regions",
            f"{len(reg.regions)} regions registered, "
            f"layout.num_regions is {reg.layout.num_regions}",
        )
    for i, region in enumerate(reg.regions):
        if region.length_bytes < reg.layout.region_bytes:
            raise InvalidFieldError(
                f"regions[{i}].length_bytes",
                f"{region.length_bytes} is less than num_blocks * page_bytes "
                f"= {reg.layout.region_bytes}",
            )
        if region.base_addr + region.length_bytes >= 1 << 63:
            raise InvalidFieldError(f"regions[{i}].base_addr", "region ends past 2**63")
        if region.memory_kind is not reg.regions[0].memory_kind:
            raise InvalidFieldError(
                f"regions[{i}].memory_kind", "all regions of a rank need the same memory kind"
            )


def _show(value: object) -> str:
    return repr(value.value) if isinstance(value, Role) else repr(value)
