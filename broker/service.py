"""The broker's business rules, free of protobuf and gRPC.

:class:`BrokerService` registers ranks under leases, accepts publications, hands out plans,
records reports and queues releases. Each public call is one unit of work on the store
(:meth:`~broker.store.contract.StateStore.transact`): it loads the records it names, decides
through the transfer state machine (:mod:`broker.transfers`) and applies what comes back —
stores the new record, queues the releases it calls for — then, once committed, runs the side
effects (metrics, logs, watcher wake-ups). A call refused because of what it found commits
what it noticed on the way (an expiry) and then raises; any other exception commits nothing.

Plans take pure work the service hands out as values (:mod:`broker.plans`):
:meth:`BrokerService.plan_step` answers a plan request or names the planning it needs first,
so the server can run large work off its event loop; :meth:`BrokerService.get_plan` does
all of it in place.

Observability: every timeline entry of a transfer is also a log line carrying its transfer
and trace ids (DEBUG; WARNING when it fails, expires or is aborted); spans ``broker.publish``,
``broker.plan``, ``broker.report``, ``broker.abort`` and ``broker.release`` join the
transfer's trace (:mod:`broker.tracing`); a :class:`~broker.observer.ServiceObserver` (the
metrics) hears of registrations, publications, plans, releases and final states.

Not thread-safe: call it from one thread (the gRPC server's event loop).
"""

from __future__ import annotations

import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial

from broker import tracing, transfers
from broker.api import (
    EngineView,
    Extension,
    Lease,
    PlanQuery,
    PlanResult,
    Publication,
    Report,
    ReportOutcome,
    TransferListing,
    TransferName,
)
from broker.clock import Clock, SystemClock
from broker.config import ServiceConfig
from broker.effects import Effects, Refusal, atomic
from broker.engines import Engine, EngineCatalog, check_published_blocks
from broker.errors import (
    AlreadyExistsError,
    LimitExceededError,
    NotFoundError,
    PdbrokerError,
    PreconditionError,
    RequestError,
    StoreUnavailableError,
)
from broker.layout import EngineLayout
from broker.observer import ServiceObserver
from broker.planner import TransferRequest
from broker.plans import (
    Planned,
    PlanTicket,
    PlanWork,
    SourceAgent,
    answer_bound,
    check_answer_size,
)
from broker.records import (
    PlanRecord,
    RankKey,
    RankRegistration,
    TransferKey,
    TransferRecord,
)
from broker.registry import REAP_SLICE_S, Backlog, RankLimits, Registry
from broker.releases import ReleaseFeeds
from broker.store.contract import DUE_PER_CALL, StateStore
from broker.store.memory import InMemoryStateStore
from broker.wire import TransferState


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
        self.config = config = config if config is not None else ServiceConfig()
        self.observer = observer if observer is not None else ServiceObserver()
        self.effects = Effects(
            self.store,
            self.observer,
            transfers.Rules(config.retention_ms, config.max_read_ms, config.max_ttl_ms),
            (config.release_backlog_bytes, config.release_backlog_total_bytes),
        )
        self.engines = EngineCatalog(config.planner_cache_bytes)
        self.registry = Registry(
            self.effects,
            self.clock,
            self.engines,
            RankLimits(config.lease_ttl_ms, config.max_ranks, config.max_metadata_bytes_per_engine),
        )
        #: What release streams read (:class:`~broker.releases.ReleaseFeeds`).
        self.feeds = ReleaseFeeds(self.effects, config.release_resume_window)
        self._due: Backlog[TransferKey] = Backlog()

    def add_release_listener(self, listener: Callable[[RankKey], None]) -> None:
        """``listener(key)`` is called when a release is queued for prefill rank ``key`` or
        that rank goes away (so a watcher can wake up and notice)."""
        self.effects.listeners.append(listener)

    # ------------------------------------------------------------------ ranks

    def register_rank(self, reg: RankRegistration) -> Lease:
        """Register (or re-register, failing the old registration's transfers) one rank."""
        return self.registry.register(reg)

    def keep_alive(self, lease_id: str) -> int:
        """Renew a lease; returns its TTL (ms). NOT_FOUND once expired."""
        return self.registry.keep_alive(lease_id)

    def deregister(self, lease_id: str) -> None:
        self.registry.deregister(lease_id)

    def list_engines(self) -> list[EngineView]:
        return self.registry.engines_view()

    def engine_layout(self, engine_id: str) -> tuple[EngineLayout, int]:
        """A fully registered engine's layout and generation (for checks made outside a
        unit of work: :meth:`publish`'s ``checked_generation``)."""
        engine = self.store.transact(lambda: self.engines.engine(self.store, engine_id))
        return engine.layout, engine.generation

    # ------------------------------------------------------------------ transfers

    @atomic
    def publish(self, pub: Publication, checked_generation: int | None = None) -> int:
        """Accept a prefill engine's blocks; returns the expiry instant (ms since epoch).
        ``checked_generation``: the engine generation whose layout the block ids were
        already checked against (:func:`~broker.engines.check_published_blocks`)."""
        with tracing.span(
            "broker.publish",
            pub.traceparent,
            {"pdbroker.transfer_id": pub.transfer_id, "pdbroker.prefill_engine": pub.engine_id},
        ) as span:
            return self._publish(
                pub, checked_generation, pub.traceparent or tracing.span_traceparent(span)
            )

    def _publish(self, pub: Publication, checked: int | None, traceparent: str) -> int:
        config, store = self.config, self.store
        if store.get_transfer((pub.engine_id, pub.transfer_id)) is not None:
            raise AlreadyExistsError(
                "transfer_id", f"transfer {pub.transfer_id!r} was already published"
            )
        if store.count_transfers() >= config.max_transfers:
            raise LimitExceededError(
                "transfer_id", f"the broker already holds {config.max_transfers} transfers"
            )
        self._check_engine_quota(pub)
        engine = self.engines.engine(store, pub.engine_id)
        if not engine.role.publishes:
            raise PreconditionError("engine_id", f"engine {pub.engine_id!r} is a decode engine")
        ttl = pub.ttl_ms or config.default_ttl_ms
        if ttl > config.max_ttl_ms:
            raise RequestError("ttl_ms", f"{ttl} exceeds the broker's maximum {config.max_ttl_ms}")
        if checked != engine.generation:
            check_published_blocks(engine.layout, pub.block_ids, pub.num_tokens)
        now = self.clock.now_ms()
        step = transfers.publish(
            pub.transfer_id,
            pub.engine_id,
            engine.generation,
            engine.layout.tp_size,
            pub.num_tokens,
            pub.block_ids,
            pub.allowed_decode_engines,
            now,
            ttl,
            traceparent,
        )
        assert step.record is not None
        self.effects.apply(None, step, now)
        self.effects.later(self.observer.transfer_published)
        return step.record.expires_at_ms

    def get_plan(self, query: PlanQuery) -> PlanResult:
        """The decode rank's reads, all work done in place (see :meth:`plan_step`)."""
        planned: Planned | None = None
        while True:
            step = self.plan_step(query, planned, in_place=sys.maxsize)
            if isinstance(step, PlanTicket):
                return step.result()
            planned = step.run()

    @atomic
    def plan_step(
        self,
        query: PlanQuery,
        planned: Planned | None = None,
        answer_bytes: int | None = None,
        in_place: int = 0,
    ) -> PlanWork | PlanTicket:
        """Hand the decode rank its plan, as a :class:`PlanTicket` to turn into descriptors.
        The first request for a transfer claims it for the decode engine and plans every
        decode rank, which fixes each prefill rank's consumers: planning of requests of at
        most ``in_place`` block ids is done here (unless another thread plans with the same
        planner), else the :class:`PlanWork` that makes the plans is returned — run it
        and call again with its result. A plan whose answer would exceed ``answer_bytes`` is
        refused (RESOURCE_EXHAUSTED naming ``plan``) before it is handed out."""
        started = planned.work.started if planned is not None else time.perf_counter()
        now = self.clock.now_ms()
        t, prefill, decode = self._plan_parties(query, (query.tp_rank,), now)
        pair, cache_hit = self.engines.pair(prefill, decode)
        cache_hit = cache_hit and (planned is None or planned.work.cache_hit)
        basis = (t.key, prefill.generation, decode.engine_id, decode.generation, query.block_ids)
        rank = query.tp_rank

        def plans_for(decode_rank: int | None) -> Planned | PlanWork:
            """The plans ``planned`` holds for ``decode_rank`` (None: every rank), else made
            here when small, else the work that makes them."""
            if planned is not None and (planned.work.basis, planned.work.decode_rank) == (
                basis,
                decode_rank,
            ):
                return planned
            request = TransferRequest(t.num_tokens, t.block_ids, query.block_ids)
            work = PlanWork(pair, request, decode_rank, basis, started, cache_hit)
            made = work.run_if_free() if work.block_ids <= in_place else None
            return work if made is None else made

        claim: tuple[transfers.Claim, ...] = ()  # stored with the hand-out, in one write
        if t.state is TransferState.PUBLISHED:
            made = plans_for(None)
            if isinstance(made, PlanWork):
                return made
            claim = (self._claim(decode, query, made),)
            plan = claim[0].plans[rank]
        else:
            if t.plans[rank].block_ids != query.block_ids and not t.plans[rank].handed_out:
                made = plans_for(rank)
                if isinstance(made, PlanWork):
                    return made
                replan = transfers.Replan(rank, query.block_ids, made.plans[0])
                t = self.effects.decide(t, replan, now)
            plan = t.plans[rank]
        if answer_bytes is not None:
            check_answer_size(plan, prefill, answer_bytes)
        first = not plan.handed_out
        events: tuple[transfers.Event, ...] = (*claim, transfers.HandOut(rank, query.block_ids))
        t, ticket = self._hand_out(t, events, now, query, prefill, decode, cache_hit)
        if first:
            seconds = time.perf_counter() - started
            self.effects.later(self.observer.plan_handed_out, seconds, ticket.rank_plan, cache_hit)
        return ticket

    @atomic
    def plan_group(
        self, queries: Sequence[PlanQuery], answer_bytes: int, in_place: int
    ) -> list[PlanTicket] | None:
        """:meth:`plan_step` of several asks for one transfer with the same block ids (ranks
        of one decode engine, in order, a rank maybe twice) as one unit of work: one lookup,
        one state-machine step and one store write for all, the same tickets and hand-outs.
        None, having decided nothing, when an ask would fare otherwise than being handed its
        plan (refused, replanned, planned elsewhere, its answer near ``answer_bytes``, which
        the tickets' answers share): ask them one by one then (an expiry noticed is stored)."""
        started, now, query = time.perf_counter(), self.clock.now_ms(), queries[0]
        if any(q.block_ids != query.block_ids for q in queries):
            return None
        try:
            t, prefill, decode = self._plan_parties(query, [q.tp_rank for q in queries], now)
            pair, cache_hit = self.engines.pair(prefill, decode)
            claim: tuple[transfers.Claim, ...] = ()
            if t.state is TransferState.PUBLISHED:
                request = TransferRequest(t.num_tokens, t.block_ids, query.block_ids)
                work = PlanWork(pair, request, None, None, started, cache_hit)
                made = work.run_if_free() if work.block_ids <= in_place else None
                if made is None:
                    return None
                claim = (self._claim(decode, query, made),)
        except (PdbrokerError, Refusal):
            return None
        plans = claim[0].plans if claim else t.plans
        answers = 0  # each answer's most bytes, in order: what every check below passes
        for q in queries:
            answers += answer_bound(plans[q.tp_rank], prefill)
            if plans[q.tp_rank].block_ids != query.block_ids or answers > answer_bytes:
                return None
        handed = {plan.decode_rank for plan in plans if plan.handed_out}
        events: tuple[transfers.Event, ...] = (
            *claim,
            *(transfers.HandOut(q.tp_rank, q.block_ids) for q in queries),
        )
        tickets = []
        for q in queries:
            t, ticket = self._hand_out(t, events, now, q, prefill, decode, cache_hit)
            events = ()
            if q.tp_rank not in handed:
                handed.add(q.tp_rank)
                seconds = time.perf_counter() - started
                self.effects.later(
                    self.observer.plan_handed_out, seconds, ticket.rank_plan, cache_hit
                )
            tickets.append(ticket)
            cache_hit = True  # the group's first plan built the pair's planner, if any did
        return tickets

    def _plan_parties(
        self, query: PlanQuery, ranks: Sequence[int], now: int
    ) -> tuple[TransferRecord, Engine, Engine]:
        """The transfer ``query`` names (what time did to it stored), its prefill and decode
        engine, once the decode engine's ``ranks`` may be handed plans of it."""
        store = self.store
        store.expect_engines((query.engine_id,))  # read with the transfer, where a store can
        t = self._find(query.transfer_id, query.prefill_engine_id, query.engine_id)
        t = self._settle_time(t, now)
        if t.state.terminal:
            raise Refusal(_ended(t))
        decode = self.engines.engine(store, query.engine_id)
        if not decode.role.reads:
            raise PreconditionError("engine_id", f"engine {query.engine_id!r} is a prefill engine")
        for rank in ranks:
            if not 0 <= rank < decode.layout.tp_size:
                raise RequestError("tp_rank", f"{rank} outside [0, {decode.layout.tp_size})")
        if t.decode_engine_id and t.decode_engine_id != query.engine_id:
            raise PreconditionError(
                "transfer_id", f"transfer {t.transfer_id!r} was claimed by another decode engine"
            )
        prefill = self.engines.engine(store, t.prefill_engine_id, "transfer_id")
        if prefill.generation != t.prefill_generation:
            raise PreconditionError(
                "transfer_id", "the prefill engine re-registered since publishing"
            )
        return t, prefill, decode

    @staticmethod
    def _claim(decode: Engine, query: PlanQuery, made: Planned) -> transfers.Claim:
        """The decode engine's claim of a transfer with every rank's plan in ``made``."""
        claim_id = secrets.token_hex(10)  # plan ids: unguessable, unique per claim and rank
        plans = tuple(
            PlanRecord(f"{claim_id}-{p.decode_rank}", p.decode_rank, query.block_ids, p)
            for p in made.plans
        )
        return transfers.Claim(decode.engine_id, decode.generation, plans)

    def _hand_out(
        self,
        t: TransferRecord,
        events: tuple[transfers.Event, ...],
        now: int,
        query: PlanQuery,
        prefill: Engine,
        decode: Engine,
        cache_hit: bool,
    ) -> tuple[TransferRecord, PlanTicket]:
        """Decide ``events`` (none: decided already) in the ``broker.plan`` span of
        ``query``'s rank, and its ticket."""
        rank = query.tp_rank
        with tracing.span(
            "broker.plan",
            t.traceparent,
            {"pdbroker.transfer_id": t.transfer_id, "pdbroker.decode_rank": rank},
        ) as span:
            if events:
                t = self.effects.decide(t, events, now)
            traceparent = tracing.span_traceparent(span) or t.traceparent
            ticket = self._ticket(t, t.plans[rank], prefill, decode, query, traceparent)
            if span is not None:
                span.set_attributes(
                    {
                        "pdbroker.source_ranks": list(ticket.rank_plan.prefill_ranks),
                        "pdbroker.descriptors": ticket.num_descriptors,
                        "pdbroker.bytes": ticket.rank_plan.nbytes,
                        "pdbroker.cache_hit": cache_hit,
                    }
                )
        return t, ticket

    def _ticket(
        self,
        t: TransferRecord,
        plan: PlanRecord,
        prefill: Engine,
        decode: Engine,
        query: PlanQuery,
        traceparent: str,
    ) -> PlanTicket:
        d_rank = decode.ranks[plan.decode_rank]
        agents = []
        for reads in plan.rank_plan.sources:
            p_rank = prefill.ranks[reads.prefill_rank]
            p_reg = p_rank.registration
            agent = f"{p_reg.agent_name}#{p_rank.generation}"
            first = self.store.add_contact(d_rank.key, d_rank.generation, agent)
            agents.append(
                SourceAgent(
                    reads.prefill_rank,
                    p_reg,
                    p_reg.agent_metadata if first or query.want_agent_metadata else b"",
                )
            )
        return PlanTicket(
            plan.plan_id,
            t.transfer_id,
            plan.rank_plan,
            d_rank.registration,
            tuple(agents),
            t.expires_at_ms,
            traceparent,
        )

    @atomic
    def report(self, report: Report) -> ReportOutcome:
        """Record a decode rank's outcome (the first report of a plan wins) and release the
        prefill ranks it settles. A DONE report (or its repetition) for a transfer that ended
        while the rank read is recorded, then answered with :class:`AbortedError`."""
        t = self.registry.transfer(self.store.transfer_of_plan(report.plan_id))
        plan = None if t is None else t.plan_by_id(report.plan_id)
        if t is None or plan is None or not plan.handed_out:
            raise NotFoundError("plan_id", f"no plan {report.plan_id!r}")
        with tracing.span(
            "broker.report",
            t.traceparent,
            {
                "pdbroker.transfer_id": t.transfer_id,
                "pdbroker.decode_rank": plan.decode_rank,
                "pdbroker.status": report.status.value,
            },
        ) as span:
            now = self.clock.now_ms()
            step = transfers.step(t, report, now, self.effects.rules)
            after = step.record or t
            recorded = after.plan_by_id(report.plan_id) or plan
            outcome = ReportOutcome(plan.status is not None, after.state, recorded.intact)
            if span is not None:
                span.set_attributes(
                    {"pdbroker.duplicate": outcome.duplicate, "pdbroker.intact": outcome.intact}
                )
            self.effects.apply(t, step, now)  # the releases it settles are its child spans
        if step.refusal is not None:
            raise Refusal(step.refusal)
        return outcome

    def extend(
        self, engine_id: str, names: Sequence[TransferName | PdbrokerError]
    ) -> list[Extension]:
        """Decode engine ``engine_id`` (registered, reading) keeps the transfers it waits for
        alive (:class:`~broker.transfers.Extend`), each in a unit of work of its own, so one
        refused entry (an error of ``names`` already: refused by the caller) leaves the
        others alone. Only an unavailable store fails the whole call."""
        decode = self.store.transact(lambda: self.engines.engine(self.store, engine_id))
        if not decode.role.reads:
            raise PreconditionError("engine_id", f"engine {engine_id!r} is a prefill engine")
        return [self._extension(engine_id, name) for name in names]

    def _extension(self, engine_id: str, name: TransferName | PdbrokerError) -> Extension:
        if isinstance(name, PdbrokerError):
            return Extension(error=name)
        try:
            t = self._extend(engine_id, *name)
        except StoreUnavailableError:
            raise
        except PdbrokerError as refusal:
            return Extension(error=refusal)
        return Extension(t.expires_at_ms, t.ttl_ms)

    @atomic
    def _extend(self, engine_id: str, transfer_id: str, prefill_engine_id: str) -> TransferRecord:
        t = self._find(transfer_id, prefill_engine_id, reader=engine_id)
        return self.effects.decide(t, transfers.Extend(engine_id), self.clock.now_ms())

    @atomic
    def abort(
        self,
        transfer_id: str,
        reason: str,
        prefill_engine_id: str = "",
        held_by_decode: bool = False,
    ) -> TransferState:
        """End a transfer now (see :class:`~broker.transfers.Abort`); returns its (possibly
        earlier) terminal state."""
        now = self.clock.now_ms()
        t = self._settle_time(self._find(transfer_id, prefill_engine_id), now)
        if not t.state.terminal:
            with tracing.span("broker.abort", t.traceparent, {"pdbroker.transfer_id": transfer_id}):
                t = self.effects.decide(t, transfers.Abort(reason, held_by_decode), now)
        return t.state

    @atomic
    def get_transfer(self, transfer_id: str, prefill_engine_id: str = "") -> TransferRecord:
        t = self._find(transfer_id, prefill_engine_id)
        return self._settle_time(t, self.clock.now_ms())

    def list_transfers(self, include_finished: bool = False, limit: int = 0) -> TransferListing:
        """Counts by state of every held transfer; unfinished transfers oldest first, then
        with ``include_finished`` the finished ones most recent first; at most ``limit``
        (0: all)."""
        counts: Counter[TransferState] = Counter()
        unfinished: list[TransferRecord] = []
        finished: list[TransferRecord] = []
        for t in self.store.transfers():
            counts[t.state] += 1
            (finished if t.state.terminal else unfinished).append(t)
        unfinished.sort(key=lambda t: (t.published_at_ms, t.transfer_id))
        listed = unfinished
        if include_finished:
            finished.sort(key=lambda t: (-(t.finished_at_ms or 0), t.transfer_id))
            listed += finished
        return TransferListing(
            self.clock.now_ms(), dict(counts), tuple(listed[:limit] if limit else listed)
        )

    # ------------------------------------------------------------------ time

    def reap(self) -> bool:
        """Expire what is due (leases, transfers, live plans past ``max_read_ms``, finished
        transfers past retention), go on failing departed ranks' transfers: each its own
        unit of work, none started after ``REAP_SLICE_S``. Returns whether work is left."""
        now, until = self.clock.now_ms(), time.perf_counter() + REAP_SLICE_S
        due = partial(self.store.due_transfers, now, DUE_PER_CALL)
        return (
            self.registry.expire_due(now, until)
            or self._due.run(due, self._reap_transfer, until, DUE_PER_CALL)
            or self.registry.tell_losses(until)
        )

    @atomic
    def _reap_transfer(self, key: TransferKey) -> None:
        t = self.registry.transfer(key)
        if t is not None:
            self.effects.decide(t, transfers.Tick(), self.clock.now_ms())

    # ------------------------------------------------------------------ internals

    def _find(
        self, transfer_id: str, prefill_engine_id: str = "", reader: str = ""
    ) -> TransferRecord:
        """The transfer ``transfer_id`` of ``prefill_engine_id`` ('': of whichever prefill
        engine published one under that id). With ``reader`` (a decode engine), only
        transfers it may read count: another is NOT_FOUND, exactly as an unknown id."""
        keys = (
            [(prefill_engine_id, transfer_id)]
            if prefill_engine_id
            else self.store.transfers_named(transfer_id)
        )
        found = [t for key in keys if (t := self.store.get_transfer(key)) is not None]
        if reader:
            found = [t for t in found if t.admits(reader)]
        if not found:
            raise NotFoundError("transfer_id", f"no transfer {transfer_id!r}")
        if len(found) > 1:
            raise PreconditionError(
                "prefill_engine_id",
                f"{len(found)} prefill engines published transfer {transfer_id!r}: "
                "name the one you mean",
            )
        return self.registry.settle(found[0])

    def _settle_time(self, t: TransferRecord, now: int) -> TransferRecord:
        """``t`` with what time did to it (an expiry the reaper has not seen yet)."""
        if t.deadline_ms <= now and not t.state.terminal:
            return self.effects.decide(t, transfers.Tick(), now) or t
        return t

    def _check_engine_quota(self, pub: Publication) -> None:
        """RESOURCE_EXHAUSTED when ``pub`` would take its prefill engine past its share of
        the broker (``max_transfers_per_engine``, ``max_block_ids_per_engine``)."""
        transfers_held, held = self.store.engine_usage(pub.engine_id)
        if transfers_held >= self.config.max_transfers_per_engine:
            raise LimitExceededError(
                "transfer_id",
                f"engine {pub.engine_id!r} holds {transfers_held} transfers, its quota "
                "(--max-transfers-per-engine): wait for releases",
            )
        asked = sum(len(g) for g in pub.block_ids)
        if held + asked > self.config.max_block_ids_per_engine:
            raise LimitExceededError(
                "block_ids",
                f"engine {pub.engine_id!r} holds {held} block ids; {asked} more would pass its "
                f"quota of {self.config.max_block_ids_per_engine} (--max-block-ids-per-engine)",
            )


def _ended(t: TransferRecord) -> PreconditionError:
    return PreconditionError(
        "transfer_id",
        f"transfer {t.transfer_id!r} is {t.state.value}; its blocks are released",
    )
