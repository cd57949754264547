"""The broker's rules for ranks: registration under a lease, renewal, and what a rank's
departure does to the transfers it takes part in (:class:`Registry`).

A departure fails the unfinished transfers of the rank's engine a slice at a time: the unit
of work that removes the rank tells the first :data:`TRANSFERS_PER_UNIT` of them and, when
more are left, stores the departure (a :class:`~broker.records.RankLoss`) for the reaper to
go on with, a slice per unit (:meth:`Registry.tell_losses`). Until then a call that changes
one of those transfers tells it first (:meth:`Registry.settle`): each fails the moment its
rank is gone, whichever comes first, and a crash mid-way leaves the stored departure to the
next reaper, of any replica."""

from __future__ import annotations

import bisect
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from broker import transfers
from broker.api import EngineView, Lease
from broker.clock import Clock
from broker.effects import Effects, Refusal, atomic
from broker.engines import EngineCatalog, assemble_layout, check_regions
from broker.errors import AlreadyExistsError, LimitExceededError, NotFoundError, PreconditionError
from broker.records import (
    RankKey,
    RankLoss,
    RankRecord,
    RankRegistration,
    TransferKey,
    TransferRecord,
)
from broker.wire import Role

LEASE_EXPIRED = "lease expired"
#: Transfers one unit of work tells of a rank's departure, at most.
TRANSFERS_PER_UNIT = 64
#: How long one reaper pass starts units of work for (seconds).
REAP_SLICE_S = 0.002

K = TypeVar("K")


class Backlog(Generic[K]):
    """Keys of due work the store hands out (a due transfer only once, then again after
    :data:`~broker.store.contract.REDELIVER_MS`), worked through a reaper slice at a time:
    those one pass did not reach come first in the next, before the store is asked again."""

    def __init__(self) -> None:
        self._left: deque[K] = deque()
        self._full = False  # whether the last take was a full batch

    def run(
        self,
        take: Callable[[], Sequence[K]],
        unit: Callable[[K], object],
        until: float,
        batch: int | None = None,
    ) -> bool:
        """``unit(key)`` (each its own unit of work) for what is left, else for what
        ``take()`` hands out, and again while its last take was ``batch`` keys (a full batch:
        more may be due); none started once ``time.perf_counter()`` reached ``until``.
        Returns whether some are left."""
        while True:
            if not self._left:
                keys = take()
                self._left.extend(keys)
                self._full = batch is not None and len(keys) >= batch
            while self._left:
                if time.perf_counter() >= until:
                    return True
                unit(self._left.popleft())
            if not self._full:
                return False


@dataclass(frozen=True)
class RankLimits:
    """Registered ranks at once over all engines, and agent metadata per engine (bytes)."""

    lease_ttl_ms: int
    max_ranks: int
    max_metadata_bytes_per_engine: int


class Registry:
    """Ranks and their leases. A rank that goes away (deregistered, replaced, lease
    expired) fails the unfinished transfers it takes part in (:class:`transfers.LoseRank`)."""

    def __init__(
        self, effects: Effects, clock: Clock, engines: EngineCatalog, limits: RankLimits
    ) -> None:
        self.effects = effects
        self.store = effects.store
        self.clock = clock
        self.engines = engines
        self.limits = limits
        #: Each departure's transfer keys as first read here, sorted: a slice finds its own
        #: by bisection instead of reading and sorting all of them again.
        self._loss_keys: dict[tuple[str, int, int], list[TransferKey]] = {}
        self._expired: Backlog[RankKey] = Backlog()

    @atomic
    def register(self, reg: RankRegistration) -> Lease:
        """Register (or re-register, failing the old registration's transfers) one rank."""
        limits, store = self.limits, self.store
        check_regions(reg)
        siblings = [r for r in store.engine_ranks(reg.engine_id) if r.key != reg.key]
        for name in ("tp_size", "role", "model_fingerprint") if siblings else ():
            theirs, ours = getattr(siblings[0].registration, name), getattr(reg, name)
            if theirs != ours:
                raise PreconditionError(
                    name,
                    f"engine {reg.engine_id!r} registered its other ranks "
                    f"with {name}={_show(theirs)}, got {_show(ours)}",
                )
        old = store.get_rank(reg.key)
        if old is None and store.count_ranks() >= limits.max_ranks:
            raise LimitExceededError(
                "tp_rank", f"the broker already holds {limits.max_ranks} registered ranks"
            )
        holder = store.rank_by_agent(reg.agent_name)
        if holder is not None and holder.key != reg.key:
            raise AlreadyExistsError(
                "agent_name",
                f"{reg.agent_name!r} is already registered by engine "
                f"{holder.registration.engine_id!r} rank {holder.registration.tp_rank}",
            )
        metadata = len(reg.agent_metadata) + sum(
            len(r.registration.agent_metadata) for r in siblings
        )
        if metadata > limits.max_metadata_bytes_per_engine:
            raise LimitExceededError(
                "agent_metadata",
                f"engine {reg.engine_id!r}'s ranks would hold {metadata} bytes of agent "
                f"metadata, over its quota of {limits.max_metadata_bytes_per_engine} "
                "(--max-metadata-bytes-per-engine)",
            )
        complete = len(siblings) + 1 == reg.tp_size
        layout = assemble_layout([s.registration for s in siblings] + [reg]) if complete else None
        if old is not None:
            self.remove(old, "re-registered")
        now = self.clock.now_ms()
        record = RankRecord(
            reg,
            secrets.token_hex(16),
            now + limits.lease_ttl_ms,
            now,
            store.next_counter("generation"),
        )
        store.put_rank(record)
        self.effects.later(self.effects.observer.rank_registered, reg.role)
        generation = max([record.generation] + [s.generation for s in siblings])
        if layout is not None:
            self.engines.remember(reg.engine_id, generation, layout)
        return Lease(record.lease_id, limits.lease_ttl_ms, generation, complete)

    @atomic
    def keep_alive(self, lease_id: str) -> int:
        """Renew a lease; returns its TTL (ms). NOT_FOUND once expired."""
        now = self.clock.now_ms()
        record = self.lease(lease_id)
        if record.lease_expires_at_ms <= now:
            self.remove(record, LEASE_EXPIRED)
            raise Refusal(NotFoundError("lease_id", "lease expired; register again"))
        self.store.put_rank(replace(record, lease_expires_at_ms=now + self.limits.lease_ttl_ms))
        return self.limits.lease_ttl_ms

    @atomic
    def deregister(self, lease_id: str) -> None:
        self.remove(self.lease(lease_id), "deregistered")

    def expire_due(self, now: int, until: float) -> bool:
        """Remove the ranks whose lease expired by ``now``, each in a unit of work of its own,
        none started once ``time.perf_counter()`` reached ``until``; returns whether some are
        left."""
        return self._expired.run(lambda: self.store.due_leases(now), self.expire_lease, until)

    @atomic
    def expire_lease(self, key: RankKey) -> None:
        """Remove the rank if its lease is still expired (its own unit of work)."""
        record = self.store.get_rank(key)
        if record is not None and record.lease_expires_at_ms <= self.clock.now_ms():
            self.remove(record, LEASE_EXPIRED)

    def engines_view(self) -> list[EngineView]:
        """Every engine with its registered ranks, by engine id (operators)."""
        engines: dict[str, list[RankRecord]] = {}
        for record in self.store.ranks():
            engines.setdefault(record.registration.engine_id, []).append(record)
        views = []
        for engine_id, ranks in sorted(engines.items()):
            first = ranks[0].registration
            generation = max(r.generation for r in ranks)
            views.append(
                EngineView(
                    engine_id,
                    first.role,
                    first.tp_size,
                    first.model_fingerprint,
                    generation,
                    tuple(ranks),
                )
            )
        return views

    def lease(self, lease_id: str) -> RankRecord:
        record = self.store.rank_by_lease(lease_id)
        if record is None:
            raise NotFoundError("lease_id", "unknown or expired lease; register again")
        return record

    def remove(self, record: RankRecord, why: str) -> None:
        """Forget a rank (inside a unit of work) and fail the unfinished transfers it takes
        part in (the first slice of them now, see the module docstring)."""
        effects, store, key = self.effects, self.store, record.key
        store.delete_rank(key)
        effects.later(effects.observer.rank_removed, record.registration.role, why == LEASE_EXPIRED)
        store.drop_releases(key)
        store.drop_contacts(key)
        self.engines.forget(key[0])
        self._tell(RankLoss(key[0], key[1], record.generation, why), stored=False)
        effects.notify(key)

    def _tell(self, loss: RankLoss, stored: bool) -> bool:
        """Fail the next :data:`TRANSFERS_PER_UNIT` transfers of ``loss``'s engine (those
        after ``done_through``, by key), then store how far it got, or forget the loss
        (``stored``) once none is left; returns whether some are."""
        store, event, now = self.store, _event(loss), self.clock.now_ms()
        keys = self._loss_keys.get(loss.key)
        if keys is None:  # the transfers published or claimed later are not of this rank
            keys = self._loss_keys[loss.key] = sorted(store.transfers_of(loss.engine_id))
        start = bisect.bisect_right(keys, loss.done_through)
        for key in keys[start : start + TRANSFERS_PER_UNIT]:
            t = store.get_transfer(key)
            if t is not None:
                self.effects.decide(t, event, now)
        if start + TRANSFERS_PER_UNIT < len(keys):
            store.put_loss(replace(loss, done_through=keys[start + TRANSFERS_PER_UNIT - 1]))
            return True
        self._loss_keys.pop(loss.key, None)  # another thread's call may have told it too
        if stored:
            store.delete_loss(loss)
        return False

    def tell_losses(self, until: float) -> bool:
        """Go on with the stored departures, a slice per unit of work, until
        ``time.perf_counter()`` reaches ``until``; returns whether some are left."""
        losses = self.store.losses()
        for key in self._loss_keys.keys() - {loss.key for loss in losses}:
            self._loss_keys.pop(key, None)  # finished elsewhere, or its unit did not commit
        for loss in losses:
            while True:
                if time.perf_counter() >= until:
                    return True
                if not self._tell_next(loss.key):
                    break
        return False

    @atomic
    def _tell_next(self, key: tuple[str, int, int]) -> bool:
        loss = next((x for x in self.store.losses((key[0],)) if x.key == key), None)
        return loss is not None and self._tell(loss, stored=True)

    def transfer(self, key: TransferKey | None) -> TransferRecord | None:
        """The transfer at ``key`` (None: none), inside a unit of work, settled
        (:meth:`settle`)."""
        t = None if key is None else self.store.get_transfer(key)
        return None if t is None else self.settle(t)

    def settle(self, t: TransferRecord) -> TransferRecord:
        """``t`` (inside a unit of work) told of the departures of its engines' ranks that
        no slice told it yet."""
        engines = (
            (t.prefill_engine_id, t.decode_engine_id)
            if t.decode_engine_id
            else (t.prefill_engine_id,)
        )
        losses = self.store.losses(engines)
        if not losses:
            return t
        return self.effects.decide(t, tuple(map(_event, losses)), self.clock.now_ms())


def _event(loss: RankLoss) -> transfers.LoseRank:
    return transfers.LoseRank(loss.engine_id, loss.tp_rank, loss.generation, loss.why)


def _show(value: object) -> str:
    return repr(value.value) if isinstance(value, Role) else repr(value)
