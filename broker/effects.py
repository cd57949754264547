"""One service call as one unit of work, and what its decisions make happen.

:func:`atomic` runs a call through the store's
:meth:`~broker.store.contract.StateStore.transact`; :class:`Effects` applies what the transfer
state machine decides (:mod:`broker.transfers`) — stores the new record, queues the releases
it calls for — and keeps the side effects that must wait for the commit (metrics, logs,
watcher wake-ups), which run once the unit committed. A call refused because of what it
found raises :class:`Refusal`: what it wrote on the way (an expiry it noticed) is committed,
then the refusal's error is raised; any other exception commits nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial, wraps
from typing import Any, Protocol, TypeVar

from broker import tracing, transfers
from broker.errors import PdbrokerError
from broker.logs import transfer_fields
from broker.observer import ServiceObserver
from broker.records import RankKey, ReleaseEvent, TimelineEntry, TransferRecord
from broker.store.contract import StateStore

log = logging.getLogger("broker.service")
T = TypeVar("T")


class Refusal(Exception):
    """Raised inside a unit of work: keep what it wrote, then answer with ``error``."""

    def __init__(self, error: PdbrokerError) -> None:
        self.error = error


class _HasEffects(Protocol):
    effects: Effects


def atomic(method: Callable[..., T]) -> Callable[..., T]:
    """Run a method of an object with ``effects`` as one unit of work on
    ``effects.store``; the side effects it queued run once, after it committed. A call from
    inside another unit joins it."""

    @wraps(method)
    def call(self: _HasEffects, *args: Any, **kwargs: Any) -> T:
        effects = self.effects
        if effects.queued is not None:  # called from another unit of work
            return method(self, *args, **kwargs)
        queued: list[Callable[[], object]] = []

        def attempt() -> T | Refusal:
            queued.clear()  # a store shared by replicas may run the unit again
            effects.queued = queued
            try:
                return method(self, *args, **kwargs)
            except Refusal as refusal:
                return refusal
            finally:
                effects.queued = None

        result = effects.store.transact(attempt)
        for effect in queued:
            effect()
        if isinstance(result, Refusal):
            raise result.error
        return result

    return call


class _InProgress(threading.local):
    """A thread's unit of work's side effects (None: no unit is in progress)."""

    queued: list[Callable[[], object]] | None = None


class Effects:
    """Applies transfer decisions to the store and runs side effects after the commit.

    ``release_budget`` is ``(per rank, in all)``: the bytes of release events kept
    (:meth:`~broker.store.contract.StateStore.append_release`)."""

    def __init__(
        self,
        store: StateStore,
        observer: ServiceObserver,
        rules: transfers.Rules,
        release_budget: tuple[int, int],
    ) -> None:
        self.store = store
        self.observer = observer
        self.rules = rules
        self.release_budget = release_budget
        self.listeners: list[Callable[[RankKey], None]] = []
        self._in_progress = _InProgress()

    @property
    def queued(self) -> list[Callable[[], object]] | None:
        """Side effects of this thread's unit of work in progress (None: none is)."""
        return self._in_progress.queued

    @queued.setter
    def queued(self, queued: list[Callable[[], object]] | None) -> None:
        self._in_progress.queued = queued

    def later(self, effect: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Run ``effect`` once the unit in progress committed (now outside any unit)."""
        if self.queued is None:
            effect(*args, **kwargs)
        else:
            self.queued.append(partial(effect, *args, **kwargs))

    def notify(self, key: RankKey) -> None:
        """Wake the watchers of prefill rank ``key`` once committed."""
        for listener in self.listeners:
            self.later(listener, key)

    def decide(
        self, t: TransferRecord, event: transfers.Event | tuple[transfers.Event, ...], now: int
    ) -> TransferRecord:
        """Apply ``event`` (or events, in turn) through the state machine and store what it
        did, once; a refusal is raised (as :class:`Refusal`) once that is stored. Returns the
        new record (``t`` when it was forgotten)."""
        step = transfers.step(t, event, now, self.rules)
        self.apply(t, step, now)
        if step.refusal is not None:
            raise Refusal(step.refusal)
        return step.record or t

    def apply(self, before: TransferRecord | None, step: transfers.Step, now: int) -> None:
        """Store ``step``'s record (or forget the transfer ``before`` was) and carry out its
        effects."""
        t = step.record
        if t is None:
            assert before is not None
            self.store.delete_transfer(before.key)
            return
        if t is not before:
            self.store.put_transfer(t)
        for effect in step.effects:
            if isinstance(effect, transfers.Release):
                self._release(t, effect, now)
            elif isinstance(effect, transfers.Finished):
                self.later(self.observer.transfer_finished, effect.state)
            else:
                self._log(t, effect.entry)

    def _release(self, t: TransferRecord, release: transfers.Release, now: int) -> None:
        """Queue prefill rank ``release.prefill_rank``'s event, unless that rank is gone or
        re-registered since publishing (its blocks no longer exist)."""
        key = (t.prefill_engine_id, release.prefill_rank)
        record = self.store.get_rank(key)
        if record is None or record.generation > t.prefill_generation:
            return
        with tracing.span(
            "broker.release",
            t.traceparent,
            {
                "pdbroker.transfer_id": t.transfer_id,
                "pdbroker.prefill_rank": release.prefill_rank,
                "pdbroker.reason": release.reason.value,
            },
        ) as span:
            event = ReleaseEvent(
                self.store.release_sequence(),
                t.transfer_id,
                release.block_ids,
                release.reason,
                release.detail,
                now,
                tracing.span_traceparent(span) or t.traceparent,
            )
            self.store.append_release(key, event, *self.release_budget)
            self.notify(key)
        held = (now - t.published_at_ms) / 1000
        self.later(self.observer.rank_released, release.reason, held)

    def _log(self, t: TransferRecord, entry: TimelineEntry) -> None:
        """Log a timeline entry with its transfer and trace ids, once committed."""
        _, event, detail = entry
        level = logging.WARNING if event in transfers.PROBLEMS else logging.DEBUG
        if log.isEnabledFor(level):
            fields = transfer_fields(t.transfer_id, t.traceparent)
            said = f": {detail}" if detail else ""
            self.later(log.log, level, "%s%s", event, said, extra=fields)
