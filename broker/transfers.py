"""A transfer's lifecycle as one pure function: ``step(record, event, now, rules)``.

Every change to a :class:`~broker.records.TransferRecord` after its publication is an event
applied here; the result is the new record, the effects the service must carry out once the
change is stored (queue a release for a prefill rank, log a timeline entry, count a finished
transfer) and, when the event is refused, why. No store, clock, planner or I/O: the service
loads a record, decides through :func:`step` and applies what comes back, so the rules below
can be driven by property tests without a broker.

Before any event the transfer's expiry is checked (``now >= expires_at_ms`` ends it
EXPIRED), so every caller notices an expiry the reaper has not seen yet. The transition table
(docs/ARCHITECTURE.md shows it as a table) — each row is one function here:

====================  ============================  =========================================
from                  event                         to, effects
====================  ============================  =========================================
(new)                 :func:`publish`               PUBLISHED
PUBLISHED             :class:`Claim`                IN_PROGRESS; ranks nobody reads released
IN_PROGRESS           :class:`Replan`               plan remade for other decode block ids
IN_PROGRESS           :class:`HandOut`              plan live (its sources fenced)
IN_PROGRESS           :class:`Report` DONE          ranks whose readers are all DONE released;
                                                    COMPLETED once every plan is DONE
IN_PROGRESS           :class:`Report` FAILED        FAILED; unfenced ranks released
PUBLISHED/IN_PROGRESS :class:`Extend`               expiry moved to now + its TTL, at most
                                                    publication + ``max_ttl_ms``
PUBLISHED             :class:`Abort` held by decode COMPLETED (nothing read); every rank
                                                    released
PUBLISHED/IN_PROGRESS :class:`Abort`                ABORTED; unfenced ranks released
PUBLISHED/IN_PROGRESS :class:`Tick` past expiry     EXPIRED; unfenced ranks released
PUBLISHED/IN_PROGRESS :class:`LoseRank` prefill     FAILED (ABORTED releases)
IN_PROGRESS           :class:`LoseRank` decode      FAILED (CONSUMER_FAILED releases)
ended                 :class:`Report` of live plan  recorded, not intact; its ranks released
ended                 :class:`LoseRank` decode      its live plan FAILED; its ranks released
ended                 :class:`Tick` past a read     live plans past ``max_read_ms`` FAILED;
                                                    their ranks released
ended, all released   :class:`Tick` past retention  forgotten
====================  ============================  =========================================

Invariants (``tests/test_transfers.py`` drives random event sequences through them): every
prefill rank is released exactly once, never while a live plan (handed out, not reported)
reads it unless that plan's ``max_read_ms`` passed; a DONE report is intact only if the
transfer had not ended, and DONE after the end is refused ABORTED.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.api import Report
from broker.errors import (
    AbortedError,
    AlreadyExistsError,
    PdbrokerError,
    PermissionDeniedError,
    PreconditionError,
    RequestError,
)
from broker.planner import RankPlan
from broker.records import PlanRecord, TimelineEntry, TransferRecord, consumers_of, evolve
from broker.wire import BlockIds, ReleaseReason, ReportStatus, TransferState

#: Timeline events about an ended transfer that operators must see (logged at WARNING).
PROBLEMS = frozenset(
    s.value for s in (TransferState.FAILED, TransferState.EXPIRED, TransferState.ABORTED)
)


@dataclass(frozen=True)
class Rules:
    """Durations in milliseconds: how long a finished transfer stays queryable, how long a
    live plan may hold its prefill ranks after its transfer ended, and how long after its
    publication a transfer may live at most, extensions included."""

    retention_ms: int
    max_read_ms: int
    max_ttl_ms: int


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Claim:
    """A decode engine's first plan request: ``plans`` holds every decode rank's plan,
    which fixes each prefill rank's consumers."""

    decode_engine_id: str
    decode_generation: int
    plans: tuple[PlanRecord, ...]


@dataclass(frozen=True)
class Replan:
    """Decode rank ``decode_rank`` asks, before it was given its plan, with other block ids."""

    decode_rank: int
    block_ids: BlockIds
    rank_plan: RankPlan


@dataclass(frozen=True)
class HandOut:
    """Decode rank ``decode_rank`` asks for its plan, made for ``block_ids``."""

    decode_rank: int
    block_ids: BlockIds


@dataclass(frozen=True)
class Extend:
    """Decode engine ``decode_engine_id``, which will read the transfer, keeps it alive: its
    expiry moves to now + its TTL, never earlier than it was, never past its publication +
    ``max_ttl_ms`` (so a decode engine that stops asking, or never reads, cannot hold the
    prefill blocks longer than that)."""

    decode_engine_id: str


@dataclass(frozen=True)
class Abort:
    """End the transfer now. ``held_by_decode``: the decode engine needs nothing read (its
    prefix cache holds every published token), which completes a transfer not yet claimed."""

    reason: str
    held_by_decode: bool = False


@dataclass(frozen=True)
class Tick:
    """Time passed: the reaper looks at a transfer whose ``deadline_ms`` came."""


@dataclass(frozen=True)
class LoseRank:
    """Rank ``tp_rank`` of ``engine_id``, registered under ``generation``, went away
    (``why``: deregistered, lease expired, re-registered)."""

    engine_id: str
    tp_rank: int
    generation: int
    why: str


Event = Claim | Replan | HandOut | Report | Extend | Abort | Tick | LoseRank


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Release:
    """Prefill rank ``prefill_rank`` may free ``block_ids``."""

    prefill_rank: int
    reason: ReleaseReason
    detail: str
    block_ids: BlockIds


@dataclass(frozen=True)
class Finished:
    """The transfer reached terminal ``state``."""

    state: TransferState


@dataclass(frozen=True)
class Noted:
    """``entry`` was added to the transfer's timeline (and is to be logged)."""

    entry: TimelineEntry


Effect = Release | Finished | Noted


@dataclass(frozen=True)
class Step:
    """What an event did: the new ``record`` (``None``: forget the transfer), the effects to
    apply once it is stored, and ``refusal``, the error to answer the caller with after
    storing it (the record may still have changed: an expiry noticed on the way)."""

    record: TransferRecord | None
    effects: tuple[Effect, ...] = ()
    refusal: PdbrokerError | None = None


# --------------------------------------------------------------------------- publication


def publish(
    transfer_id: str,
    prefill_engine_id: str,
    prefill_generation: int,
    prefill_tp_size: int,
    num_tokens: int,
    block_ids: BlockIds,
    allowed_decode_engines: frozenset[str],
    now: int,
    ttl_ms: int,
    traceparent: str = "",
) -> Step:
    """A new transfer, PUBLISHED until ``now + ttl_ms``."""
    entry = (now, "published", f"by {prefill_engine_id}, {num_tokens} tokens, ttl {ttl_ms} ms")
    record = TransferRecord(
        transfer_id,
        prefill_engine_id,
        prefill_generation,
        prefill_tp_size,
        num_tokens,
        block_ids,
        allowed_decode_engines,
        now,
        ttl_ms,
        now + ttl_ms,
        now + ttl_ms,
        released=(None,) * prefill_tp_size,
        timeline=(entry,),
        traceparent=traceparent,
    )
    return Step(record, (Noted(entry),))


# --------------------------------------------------------------------------- step


def step(record: TransferRecord, event: Event | tuple[Event, ...], now: int, rules: Rules) -> Step:
    """Apply ``event`` to ``record`` at ``now`` (see the module's table); a tuple of events
    is applied in turn as one change (one record to store), ended by the first refused."""
    events = event if isinstance(event, tuple) else (event,)
    change = _Change(record, now, rules)
    if Tick not in map(type, events):
        change.expire_if_due()
    try:
        for e in events:
            _APPLY[type(e)](change, e)
    except PdbrokerError as refusal:
        return change.done(refusal)
    return change.done()


def _claim(change: _Change, event: Claim) -> None:
    t = change.record
    change.refuse_if_ended()
    if t.state is not TransferState.PUBLISHED:
        if t.decode_engine_id != event.decode_engine_id:
            raise PreconditionError(
                "transfer_id", f"transfer {t.transfer_id!r} was claimed by another decode engine"
            )
        return  # claimed meanwhile by another rank of the same engine: its plans stand
    change.set(
        plans=event.plans,
        decode_engine_id=event.decode_engine_id,
        decode_generation=event.decode_generation,
        state=TransferState.IN_PROGRESS,
    )
    change.note("claimed", f"by decode engine {event.decode_engine_id}")
    change.settle()


def _replan(change: _Change, event: Replan) -> None:
    change.refuse_if_ended()
    plan = change.plan(event.decode_rank)
    if plan.handed_out:
        raise AlreadyExistsError(
            "block_ids",
            f"decode rank {plan.decode_rank} already holds plan {plan.plan_id} for other block ids",
        )
    released = [p for p in event.rank_plan.prefill_ranks if change.record.released[p]]
    if released:
        raise PreconditionError("block_ids", f"prefill rank {released[0]} was already released")
    change.set_plan(evolve(plan, block_ids=event.block_ids, rank_plan=event.rank_plan))


def _hand_out(change: _Change, event: HandOut) -> None:
    change.refuse_if_ended()
    plan = change.plan(event.decode_rank)
    if plan.block_ids != event.block_ids:
        if plan.handed_out:
            raise AlreadyExistsError(
                "block_ids",
                f"decode rank {plan.decode_rank} already holds plan {plan.plan_id} "
                "for other block ids",
            )
        raise PreconditionError(
            "block_ids", f"decode rank {plan.decode_rank}'s plan was made for other block ids"
        )
    if plan.handed_out:
        return
    change.set_plan(evolve(plan, handed_out_at_ms=change.now))
    runs = plan.rank_plan
    change.note(
        "planned",
        f"decode rank {plan.decode_rank}: {runs.num_descriptors} descriptors, {runs.nbytes} bytes",
    )


def _report(change: _Change, event: Report) -> None:
    t = change.record
    plan = t.plan_by_id(event.plan_id)
    if plan is None:
        raise RequestError("plan_id", f"no plan {event.plan_id!r} in transfer {t.transfer_id!r}")
    if event.engine_id != t.decode_engine_id:
        raise RequestError(
            "engine_id", f"plan {plan.plan_id} belongs to decode engine {t.decode_engine_id!r}"
        )
    if event.tp_rank != plan.decode_rank:
        raise RequestError(
            "tp_rank", f"plan {plan.plan_id} belongs to decode rank {plan.decode_rank}"
        )
    if plan.status is None:
        if event.status is ReportStatus.DONE and event.bytes_moved not in (
            0,
            plan.rank_plan.nbytes,
        ):
            raise RequestError(
                "bytes_moved",
                f"{event.bytes_moved} differs from the plan's {plan.rank_plan.nbytes} bytes",
            )
        ended = change.record.state.terminal
        plan = evolve(
            plan,
            status=event.status,
            bytes_moved=event.bytes_moved,
            duration_us=event.duration_us,
            error=event.error,
            intact=event.status is ReportStatus.DONE and not ended,
        )
        change.set_plan(plan)
        change.note(
            "reported",
            f"decode rank {plan.decode_rank}: {event.status.value}"
            + (f" ({event.error})" if event.error else ""),
        )
        if ended:
            change.release_unheld()  # this plan no longer holds its sources
        elif event.status is ReportStatus.FAILED:
            change.finish(
                TransferState.FAILED,
                ReleaseReason.CONSUMER_FAILED,
                f"decode rank {plan.decode_rank} failed: {event.error}",
            )
        else:
            change.settle()
    if event.status is ReportStatus.DONE and not plan.intact:
        t = change.record
        raise AbortedError(
            "plan_id",
            f"transfer {t.transfer_id!r} ended ({t.state.value}: "
            f"{plan.error or t.end_detail}) while decode rank {plan.decode_rank} "
            "read it: the data is invalid, recompute",
        )


def _extend(change: _Change, event: Extend) -> None:
    t, engine = change.record, event.decode_engine_id
    if not t.admits(engine):
        raise PermissionDeniedError(
            "transfer_id", f"transfer {t.transfer_id!r} is not for decode engine {engine!r}"
        )
    if t.decode_engine_id not in ("", engine):
        raise PermissionDeniedError(
            "transfer_id", f"transfer {t.transfer_id!r} was claimed by another decode engine"
        )
    change.refuse_if_ended()
    longest = t.published_at_ms + change.rules.max_ttl_ms
    expires = max(t.expires_at_ms, min(change.now + t.ttl_ms, longest))
    if expires != t.expires_at_ms:
        change.set(expires_at_ms=expires, deadline_ms=expires)


def _abort(change: _Change, event: Abort) -> None:
    state = change.record.state
    if state.terminal:
        return
    if event.held_by_decode and state is TransferState.PUBLISHED:
        change.finish(
            TransferState.COMPLETED,
            ReleaseReason.COMPLETED,
            event.reason or "decode holds every published token; nothing read",
        )
    else:
        change.finish(TransferState.ABORTED, ReleaseReason.ABORTED, event.reason or "aborted")


def _tick(change: _Change, event: Tick) -> None:
    t, now = change.record, change.now
    if t.deadline_ms > now:
        return
    if not t.state.terminal:
        change.expire_if_due()
    elif not all(t.released):
        for plan in t.plans:
            if plan.live and change.read_deadline(plan) <= now:
                change.set_plan(
                    evolve(
                        plan,
                        status=ReportStatus.FAILED,
                        error=f"no report within max_read_ms={change.rules.max_read_ms}",
                    )
                )
                change.note("read timed out", f"decode rank {plan.decode_rank}")
        change.release_unheld()
    else:
        change.forget = True


def _lose_rank(change: _Change, event: LoseRank) -> None:
    t = change.record
    reader = event.engine_id == t.decode_engine_id and event.generation <= t.decode_generation
    if t.state.terminal:
        plan = t.plans[event.tp_rank] if reader and event.tp_rank < len(t.plans) else None
        if plan is not None and plan.live:
            why = f"decode rank {event.tp_rank} {event.why}"
            change.set_plan(evolve(plan, status=ReportStatus.FAILED, error=why))
            change.note("reader lost", why)
            change.release_unheld()
    elif event.engine_id == t.prefill_engine_id and event.generation <= t.prefill_generation:
        change.finish(
            TransferState.FAILED, ReleaseReason.ABORTED, f"prefill rank {event.tp_rank} {event.why}"
        )
    elif reader:
        plan = t.plans[event.tp_rank]
        if plan.live:
            change.set_plan(
                evolve(plan, status=ReportStatus.FAILED, error=f"decode rank {event.why}")
            )
        change.finish(
            TransferState.FAILED,
            ReleaseReason.CONSUMER_FAILED,
            f"decode rank {event.tp_rank} {event.why}",
        )


#: The handler of each event type; each takes the event of its key's type.
_APPLY: dict[type, Callable[[_Change, Any], None]] = {
    Claim: _claim,
    Replan: _replan,
    HandOut: _hand_out,
    Report: _report,
    Extend: _extend,
    Abort: _abort,
    Tick: _tick,
    LoseRank: _lose_rank,
}


# --------------------------------------------------------------------------- the change


class _Change:
    """The record being changed by one event and the effects gathered on the way."""

    def __init__(self, record: TransferRecord, now: int, rules: Rules) -> None:
        self._record = record
        #: Field changes and timeline entries not yet in ``_record``: a record is made once
        #: per read of :attr:`record` that follows changes, not once per change.
        self._changes: dict[str, Any] = {}
        self._noted: list[TimelineEntry] = []
        self.now = now
        self.rules = rules
        self.effects: list[Effect] = []
        self.forget = False
        self._consumers: tuple[tuple[PlanRecord, ...], dict[int, frozenset[int]]] | None = None

    def done(self, refusal: PdbrokerError | None = None) -> Step:
        return Step(None if self.forget else self.record, tuple(self.effects), refusal)

    def consumers(self) -> dict[int, frozenset[int]]:
        """The record's consumers (:attr:`TransferRecord.consumers`), kept while its plans
        are the same tuple."""
        plans = self.field("plans")
        if self._consumers is None or self._consumers[0] is not plans:
            self._consumers = (plans, consumers_of(plans, self._record.prefill_tp_size))
        return self._consumers[1]

    @property
    def record(self) -> TransferRecord:
        """The record with every change made so far."""
        if self._changes or self._noted:
            changes = self._changes
            if self._noted:
                timeline = changes.get("timeline", self._record.timeline)
                changes["timeline"] = (*timeline, *self._noted)
                self._noted = []
            self._record = evolve(self._record, **changes)
            self._changes = {}
        return self._record

    def set(self, **changes: Any) -> None:
        """Replace fields of the record."""
        self._changes.update(changes)

    def field(self, name: str) -> Any:
        """A field of :attr:`record` (its timeline aside), without making the record."""
        return self._changes[name] if name in self._changes else getattr(self._record, name)

    def plan(self, decode_rank: int) -> PlanRecord:
        return self.field("plans")[decode_rank]

    def set_plan(self, plan: PlanRecord) -> None:
        plans = list(self.field("plans"))
        plans[plan.decode_rank] = plan
        self.set(plans=tuple(plans))

    def note(self, event: str, detail: str = "") -> None:
        entry = (self.now, event, detail)
        self._noted.append(entry)
        self.effects.append(Noted(entry))

    def read_deadline(self, plan: PlanRecord) -> int:
        """When live ``plan`` stops holding its sources after its transfer ended."""
        assert plan.handed_out_at_ms is not None
        return plan.handed_out_at_ms + self.rules.max_read_ms

    def refuse_if_ended(self) -> None:
        if self.field("state").terminal:
            t = self.record
            raise PreconditionError(
                "transfer_id",
                f"transfer {t.transfer_id!r} is {t.state.value}; its blocks are released",
            )

    def expire_if_due(self) -> None:
        t = self.record
        if not t.state.terminal and self.now >= t.expires_at_ms:
            self.finish(TransferState.EXPIRED, ReleaseReason.EXPIRED, "ttl elapsed")

    def settle(self) -> None:
        """Release every prefill rank whose consumers all reported DONE; complete the
        transfer when every plan is DONE."""
        plans, released = self.field("plans"), self.field("released")  # no record made
        for p, readers in self.consumers().items():
            if not released[p] and all(plans[d].status is ReportStatus.DONE for d in readers):
                self.release(p, ReleaseReason.COMPLETED, "all readers done")
        if all(plan.status is ReportStatus.DONE for plan in plans):
            self.finished(TransferState.COMPLETED)
            self.note("completed")

    def finished(self, state: TransferState) -> None:
        """Enter terminal ``state``; the reaper forgets the transfer after the retention."""
        self.set(
            state=state,
            finished_at_ms=self.now,
            deadline_ms=self.now + self.rules.retention_ms,
        )
        self.effects.append(Finished(state))
        self.drop_block_ids_once_released()

    def finish(self, state: TransferState, reason: ReleaseReason, detail: str) -> None:
        """Enter a terminal state and release every prefill rank no live plan reads."""
        self.finished(state)
        self.set(end_reason=reason, end_detail=detail)
        self.note(state.value, detail)
        self.release_unheld()

    def release_unheld(self) -> None:
        """For an ended transfer: release each prefill rank not yet released that no live
        plan reads; while some are held, the reaper looks again when the first live plan's
        ``max_read_ms`` ends."""
        t = self.record
        reason = t.end_reason or ReleaseReason.ABORTED
        held_until = []
        for p, readers in self.consumers().items():
            if t.released[p]:
                continue
            plans = [t.plans[d] for d in readers]
            live = [self.read_deadline(plan) for plan in plans if plan.live]
            if live:
                held_until.append(min(live))
                continue
            failed = any(plan.status is ReportStatus.FAILED for plan in plans)
            self.release(p, ReleaseReason.CONSUMER_FAILED if failed else reason, t.end_detail)
        if held_until:
            self.set(deadline_ms=min(held_until))
        elif self.record.finished_at_ms is not None:
            finished = self.record.finished_at_ms
            self.set(deadline_ms=max(self.now, finished) + self.rules.retention_ms)

    def release(self, p: int, reason: ReleaseReason, detail: str) -> None:
        t = self.record
        released = list(t.released)
        released[p] = reason
        self.set(released=tuple(released))
        self.note("released", f"prefill rank {p}: {reason.value}")
        self.effects.append(Release(p, reason, detail, t.block_ids))
        if t.state.terminal:  # else its block ids are still needed
            self.drop_block_ids_once_released()

    def drop_block_ids_once_released(self) -> None:
        """A finished transfer whose every prefill rank was released needs its block ids no
        more (its release events carry their own): it keeps its record, not them."""
        t = self.record
        if t.state.terminal and all(t.released) and t.block_ids:
            self.set(block_ids=())
