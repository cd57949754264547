"""The broker's default store: dicts in one process (:class:`InMemoryStateStore`).

Each unit of work keeps a journal: before a table entry changes for the first time in the
unit, its old value (a shallow copy when it is a collection) is saved, so a unit that raises
is undone entry by entry and commits nothing. Deadline heaps are validated lazily against
their tables, so only what a unit popped from them needs restoring.
"""

from __future__ import annotations

import bisect
import heapq
from array import array
from collections.abc import Callable, Collection, Hashable, Iterator
from functools import partial
from operator import attrgetter
from typing import Any, TypeVar, cast

from broker.records import (
    RankKey,
    RankLoss,
    RankRecord,
    ReleaseEvent,
    TransferKey,
    TransferRecord,
    evolve,
)
from broker.store.contract import DUE_PER_CALL, REDELIVER_MS, StateStore, held_block_ids
from broker.wire import data_parallel_deployment

T = TypeVar("T")
_MISSING = object()


class _Journal:
    """How to undo each change one unit of work made, in order: undone last first, each
    change costs its own size to remember, never a copy of the collection it touched."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def on_undo(self, action: Callable[[], None]) -> None:
        self._undo.append(action)

    def undo(self) -> None:
        for action in reversed(self._undo):
            action()


class InMemoryStateStore(StateStore):
    """Dicts in one process; see the module docstring. Not thread-safe: use it from one
    thread (the broker's event loop)."""

    def __init__(self) -> None:
        self._counters: dict[str, int] = {}
        self._ranks: dict[RankKey, RankRecord] = {}
        self._engines: dict[str, set[int]] = {}
        #: Engines with registered ranks by data-parallel deployment (``X`` of ``X_dp<N>``).
        self._deployments: dict[str, set[str]] = {}
        self._leases: dict[str, RankKey] = {}
        self._agents: dict[str, RankKey] = {}
        # (expiry, key) min-heaps; an entry is live while its table agrees with it.
        self._lease_heap: list[tuple[int, RankKey]] = []
        self._transfers: dict[TransferKey, TransferRecord] = {}
        self._named: dict[str, set[TransferKey]] = {}
        self._parties: dict[str, set[TransferKey]] = {}
        self._plans: dict[str, TransferKey] = {}
        self._deadline_heap: list[tuple[int, TransferKey]] = []
        self._deadlines: dict[TransferKey, int] = {}
        self._usage: dict[str, tuple[int, int]] = {}  # engine_usage by prefill engine
        self._contacts: dict[RankKey, set[str]] = {}
        self._releases: dict[RankKey, list[ReleaseEvent]] = {}
        self._delivered: dict[RankKey, int] = {}
        self._release_bytes: dict[RankKey, int] = {}  # kept events' nbytes, by rank
        self._totals: dict[str, int] = {"release_bytes": 0}
        self._compacted: dict[RankKey, int] = {}
        self._losses: dict[tuple[str, int, int], RankLoss] = {}
        self._journal: _Journal | None = None

    # ------------------------------------------------------------------ units of work

    def transact(self, operation: Callable[[], T]) -> T:
        if self._journal is not None:
            return operation()
        self._journal = journal = _Journal()
        try:
            return operation()
        except BaseException:
            journal.undo()
            raise
        finally:
            self._journal = None

    def _on_undo(self, action: Callable[[], None]) -> None:
        if self._journal is not None:
            self._journal.on_undo(action)

    def _restore(self, table: dict, key: Hashable) -> None:
        """About to change ``table[key]``: inside a unit of work, remember how to put back
        what it holds now (the value itself, not a copy: values are replaced, not changed)."""
        if self._journal is not None:
            old = table.get(key, _MISSING)
            if old is _MISSING:
                self._journal.on_undo(lambda: table.pop(key, None))
            else:
                self._journal.on_undo(lambda: table.__setitem__(key, old))

    def _set(self, table: dict, key: Hashable, value: Any) -> None:
        self._restore(table, key)
        table[key] = value

    def _pop(self, table: dict, key: Hashable) -> Any:
        self._restore(table, key)
        return table.pop(key, None)

    def _add_to(self, table: dict[Any, set], key: Hashable, member: Any) -> None:
        members = table.setdefault(key, set())
        if member not in members:
            members.add(member)
            self._on_undo(lambda: self._discard(table, key, member))

    def _remove_from(self, table: dict[Any, set], key: Hashable, member: Any) -> None:
        if member in table.get(key, ()):
            self._discard(table, key, member)
            self._on_undo(lambda: table.setdefault(key, set()).add(member))

    @staticmethod
    def _discard(table: dict[Any, set], key: Hashable, member: Any) -> None:
        members = table[key]
        members.discard(member)
        if not members:
            del table[key]

    def _take_due(
        self,
        heap: list,
        is_due: Callable[[Any, Any], bool],
        now_ms: int,
        limit: int | None = None,
    ) -> list:
        """Keys of heap entries due at ``now_ms`` that ``is_due(deadline, key)`` still agrees
        with (stale entries are dropped), at most ``limit``; what was popped is put back if
        the unit of work is undone."""
        due: list = []
        popped: list = []
        while heap and heap[0][0] <= now_ms and (limit is None or len(due) < limit):
            entry = heapq.heappop(heap)
            popped.append(entry)
            if is_due(*entry):
                due.append(entry[1])
        if popped and self._journal is not None:

            def put_back() -> None:
                for entry in popped:
                    heapq.heappush(heap, entry)

            self._journal.on_undo(put_back)
        return due

    # ------------------------------------------------------------------ counters

    def next_counter(self, name: str) -> int:
        value = self._counters.get(name, 0) + 1
        self._counters[name] = value
        return value

    # ------------------------------------------------------------------ ranks

    def put_rank(self, record: RankRecord) -> None:
        key = record.key
        old = self._ranks.get(key)
        if old is not None:
            self._pop(self._leases, old.lease_id)
            self._pop(self._agents, old.registration.agent_name)
        self._set(self._ranks, key, record)
        self._add_to(self._engines, key[0], key[1])
        deployment = data_parallel_deployment(key[0])
        if deployment:
            self._add_to(self._deployments, deployment, key[0])
        self._set(self._leases, record.lease_id, key)
        self._set(self._agents, record.registration.agent_name, key)
        if old is None or old.lease_expires_at_ms != record.lease_expires_at_ms:
            heapq.heappush(self._lease_heap, (record.lease_expires_at_ms, key))

    def get_rank(self, key: RankKey) -> RankRecord | None:
        return self._ranks.get(key)

    def rank_by_lease(self, lease_id: str) -> RankRecord | None:
        key = self._leases.get(lease_id)
        return None if key is None else self._ranks.get(key)

    def rank_by_agent(self, agent_name: str) -> RankRecord | None:
        key = self._agents.get(agent_name)
        return None if key is None else self._ranks.get(key)

    def delete_rank(self, key: RankKey) -> None:
        record = self._pop(self._ranks, key)
        if record is not None:
            self._pop(self._leases, record.lease_id)
            self._pop(self._agents, record.registration.agent_name)
            self._remove_from(self._engines, key[0], key[1])
            deployment = data_parallel_deployment(key[0])
            if deployment and key[0] not in self._engines:
                self._remove_from(self._deployments, deployment, key[0])

    def engine_ranks(self, engine_id: str) -> list[RankRecord]:
        return [self._ranks[(engine_id, r)] for r in sorted(self._engines.get(engine_id, ()))]

    def count_ranks(self) -> int:
        return len(self._ranks)

    def ranks_named(self, names: Collection[str]) -> list[RankKey]:
        engines = {name for name in names if name in self._engines}
        for name in names:
            engines.update(self._deployments.get(name, ()))
        return sorted((engine, r) for engine in engines for r in self._engines[engine])

    def due_leases(self, now_ms: int) -> list[RankKey]:
        def expired(expires: int, key: RankKey) -> bool:
            record = self._ranks.get(key)
            return record is not None and record.lease_expires_at_ms == expires

        due = self._take_due(self._lease_heap, expired, now_ms)
        for key in due:  # handed out again until renewed or deleted
            heapq.heappush(self._lease_heap, (self._ranks[key].lease_expires_at_ms, key))
        return due

    def ranks(self) -> list[RankRecord]:
        return [self._ranks[k] for k in sorted(self._ranks)]

    # ------------------------------------------------------------------ rank losses

    def put_loss(self, loss: RankLoss) -> None:
        self._set(self._losses, loss.key, loss)

    def delete_loss(self, loss: RankLoss) -> None:
        self._pop(self._losses, loss.key)

    def losses(self, engine_ids: Collection[str] | None = None) -> list[RankLoss]:
        if not self._losses:
            return []
        return [
            loss
            for key, loss in sorted(self._losses.items())
            if engine_ids is None or loss.engine_id in engine_ids
        ]

    # ------------------------------------------------------------------ transfers

    def put_transfer(self, record: TransferRecord) -> None:
        key = record.key
        old = self._transfers.get(key)
        if old is None or old.block_ids is not record.block_ids:
            self._account(old, record)
        self._set(self._transfers, key, record)
        if old is None or old.decode_engine_id != record.decode_engine_id:
            self._add_to(self._named, record.transfer_id, key)
            for engine in record.parties:
                self._add_to(self._parties, engine, key)
        if old is None or old.plans is not record.plans:
            for plan in record.plans:
                if plan.plan_id not in self._plans:
                    self._set(self._plans, plan.plan_id, key)
        if self._deadlines.get(key) != record.deadline_ms:
            self._set(self._deadlines, key, record.deadline_ms)
            heapq.heappush(self._deadline_heap, (record.deadline_ms, key))

    def get_transfer(self, key: TransferKey) -> TransferRecord | None:
        return self._transfers.get(key)

    def delete_transfer(self, key: TransferKey) -> None:
        record = self._pop(self._transfers, key)
        if record is None:
            return
        self._account(record, None)
        self._remove_from(self._named, record.transfer_id, key)
        for engine in record.parties:
            self._remove_from(self._parties, engine, key)
        for plan in record.plans:
            self._pop(self._plans, plan.plan_id)
        self._pop(self._deadlines, key)

    def transfers_named(self, transfer_id: str) -> list[TransferKey]:
        return sorted(self._named.get(transfer_id, ()))

    def transfers_of(self, engine_id: str) -> list[TransferKey]:
        return sorted(self._parties.get(engine_id, ()))

    def transfer_of_plan(self, plan_id: str) -> TransferKey | None:
        return self._plans.get(plan_id)

    def due_transfers(self, now_ms: int, limit: int = DUE_PER_CALL) -> list[TransferKey]:
        due = self._take_due(
            self._deadline_heap,
            lambda deadline, key: self._deadlines.get(key) == deadline,
            now_ms,
            limit,
        )
        for key in due:  # handed out again later unless put with a new deadline or deleted
            self._set(self._deadlines, key, now_ms + REDELIVER_MS)
            heapq.heappush(self._deadline_heap, (now_ms + REDELIVER_MS, key))
        return due

    def count_transfers(self) -> int:
        return len(self._transfers)

    def _account(self, old: TransferRecord | None, new: TransferRecord | None) -> None:
        """Count ``new`` against its prefill engine's usage instead of ``old``."""
        for record, sign in ((old, -1), (new, 1)):
            held = held_block_ids(record)
            if record is not None and held:
                engine = record.prefill_engine_id
                transfers, ids = self._usage.get(engine, (0, 0))
                transfers, ids = transfers + sign, ids + sign * held
                if transfers:
                    self._set(self._usage, engine, (transfers, ids))
                else:
                    self._pop(self._usage, engine)

    def engine_usage(self, engine_id: str) -> tuple[int, int]:
        return self._usage.get(engine_id, (0, 0))

    def transfers(self) -> Iterator[TransferRecord]:
        return iter(list(self._transfers.values()))

    # ------------------------------------------------------------------ agent contacts

    def add_contact(self, decode: RankKey, generation: int, agent: str) -> bool:
        if agent in self._contacts.get(decode, ()):
            return False
        self._add_to(self._contacts, decode, agent)
        return True

    def drop_contacts(self, decode: RankKey) -> None:
        self._pop(self._contacts, decode)

    # ------------------------------------------------------------------ release queues

    def append_release(
        self, key: RankKey, event: ReleaseEvent, rank_bytes: int, total_bytes: int
    ) -> None:
        # Block ids as arrays of int64: 8 bytes an id rather than a Python int each (long
        # groups already are, and are shared with the record they came from).
        compact = tuple(g if isinstance(g, array) else array("q", g) for g in event.block_ids)
        queue = self._releases.setdefault(key, [])
        queue.append(evolve(event, block_ids=compact))
        self._on_undo(lambda: self._unappend(key))
        self._add_bytes(key, event.nbytes)
        self._forget_oldest(key, lambda: self._release_bytes[key] > rank_bytes)
        while self._totals["release_bytes"] > total_bytes:
            largest = max(self._release_bytes, key=self._release_bytes.__getitem__)
            self._forget_oldest(largest, lambda: False, at_least=1)

    def _unappend(self, key: RankKey) -> None:
        queue = self._releases[key]
        queue.pop()
        if not queue:
            del self._releases[key]

    def _add_bytes(self, key: RankKey, size: int) -> None:
        self._set(self._release_bytes, key, self._release_bytes.get(key, 0) + size)
        self._set(self._totals, "release_bytes", self._totals["release_bytes"] + size)

    def _forget_oldest(self, key: RankKey, over: Callable[[], bool], at_least: int = 0) -> None:
        """Drop ``key``'s oldest events: ``at_least`` of them, then while ``over()``."""
        queue = self._releases[key]
        dropped = 0
        while dropped < len(queue) and (dropped < at_least or over()):
            self._add_bytes(key, -queue[dropped].nbytes)
            dropped += 1
        if dropped:
            self._set(self._compacted, key, queue[dropped - 1].sequence)
            forgotten = queue[:dropped]
            del queue[:dropped]
            self._on_undo(lambda: queue.__setitem__(slice(0, 0), forgotten))

    def compacted_through(self, key: RankKey) -> int:
        return self._compacted.get(key, 0)

    def releases_after(self, key: RankKey, sequence: int) -> list[ReleaseEvent]:
        queue = self._releases.get(key, [])
        # Sequences are increasing: scan back from the newest event.
        start = len(queue)
        while start > 0 and queue[start - 1].sequence > sequence:
            start -= 1
        events = queue[start:]
        if events and _packed(events[0]):  # a stream resuming before what was delivered
            events = [_unpacked(e) if _packed(e) else e for e in events]
        return events

    def mark_delivered(self, key: RankKey, sequence: int) -> None:
        if sequence > self._delivered.get(key, 0):
            self._set(self._delivered, key, sequence)

    def delivered(self, key: RankKey) -> int:
        return self._delivered.get(key, 0)

    def trim_releases(self, key: RankKey, keep_delivered: int) -> None:
        queue = self._releases.get(key)
        if not queue:
            return
        cursor = self._delivered.get(key, 0)
        delivered = bisect.bisect_right(queue, cursor, key=attrgetter("sequence"))
        if delivered > keep_delivered:
            self._forget_oldest(key, lambda: False, at_least=delivered - keep_delivered)
            delivered = keep_delivered
        # Delivered events stay only for streams that resume: their block ids packed into
        # bytes, which the garbage collector does not track (it walks every array in each
        # collection of the generation holding it). Newest first, down to one packed before.
        for i in range(delivered - 1, -1, -1):
            event = queue[i]
            if _packed(event):
                break
            groups = cast("tuple[array[int], ...]", event.block_ids)  # see append_release
            queue[i] = evolve(event, block_ids=tuple(g.tobytes() for g in groups))
            self._on_undo(partial(queue.__setitem__, i, event))

    def drop_releases(self, key: RankKey) -> None:
        self._pop(self._releases, key)
        self._pop(self._delivered, key)
        self._pop(self._compacted, key)
        dropped = self._pop(self._release_bytes, key) or 0
        self._set(self._totals, "release_bytes", self._totals["release_bytes"] - dropped)


def _packed(event: ReleaseEvent) -> bool:
    """Whether ``event``'s block ids are packed (an event with none counts as packed)."""
    return not event.block_ids or type(event.block_ids[0]) is bytes


def _unpacked(event: ReleaseEvent) -> ReleaseEvent:
    return evolve(event, block_ids=tuple(array("q", g) for g in event.block_ids))
