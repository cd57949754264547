"""Where the broker's records live: the :class:`StateStore` interface and its in-memory default.

Storage only: no business rules, no clocks. Records are read with ``get_*`` and written back
with ``put_*`` after every change, so a networked store (Redis) can implement the same
interface; :class:`InMemoryStateStore` keeps them in dicts of one process.
"""

from __future__ import annotations

import bisect
import heapq
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterator
from dataclasses import replace
from operator import attrgetter
from typing import TypeVar

from broker.records import RankKey, RankRecord, ReleaseEvent, TransferRecord

T = TypeVar("T")


def held_block_ids(record: TransferRecord | None) -> int:
    """Block ids a transfer holds against its prefill engine's quota: all of them until
    every rank was released (then the record drops them)."""
    return 0 if record is None else sum(len(g) for g in record.block_ids)


class StateStore(ABC):
    """Registrations, transfers (with their plans), plan index, agent contacts and release
    queues. Methods never raise for missing keys: getters return ``None``, deletes no-op."""

    def transact(self, operation: Callable[[], T]) -> T:
        """Run ``operation`` (one service call's reads and writes) atomically with respect to
        other brokers sharing this store, and return its result; it may run more than once.
        A store only one broker uses just calls it."""
        return operation()

    def subscribe_releases(self, callback: Callable[[RankKey], None]) -> Callable[[], None]:
        """Have ``callback(key)`` called when a broker sharing this store queues a release
        for prefill rank ``key`` or drops its queue; returns the function that stops it. A
        store only one broker uses needs no such calls (the service tells its own server)."""
        return lambda: None

    # ---- counters

    @abstractmethod
    def next_counter(self, name: str) -> int:
        """The next value (from 1) of the named, never-reset counter."""

    # ---- ranks

    @abstractmethod
    def put_rank(self, record: RankRecord) -> None:
        """Insert or replace the rank at ``record.registration.key`` and index its lease."""

    @abstractmethod
    def get_rank(self, key: RankKey) -> RankRecord | None: ...

    @abstractmethod
    def rank_by_lease(self, lease_id: str) -> RankRecord | None: ...

    @abstractmethod
    def delete_rank(self, key: RankKey) -> None:
        """Remove the rank and its lease index entry."""

    @abstractmethod
    def ranks(self) -> list[RankRecord]:
        """Every registered rank, by (engine id, tp rank)."""

    @abstractmethod
    def engine_ranks(self, engine_id: str) -> list[RankRecord]:
        """The engine's registered ranks, by tp rank."""

    # ---- transfers and plans

    @abstractmethod
    def put_transfer(self, record: TransferRecord) -> None:
        """Insert or replace the transfer and index it by ``record.deadline_ms``."""

    @abstractmethod
    def get_transfer(self, transfer_id: str) -> TransferRecord | None: ...

    @abstractmethod
    def delete_transfer(self, transfer_id: str) -> None:
        """Remove the transfer and the plan index entries of its plans."""

    @abstractmethod
    def transfers(self) -> Iterator[TransferRecord]:
        """Every stored transfer (a snapshot: the caller may put/delete while iterating)."""

    @abstractmethod
    def due_transfers(self, now_ms: int) -> list[TransferRecord]:
        """Transfers whose ``deadline_ms <= now_ms``, each returned once per deadline it was
        put with (put it again with a new deadline to be returned again)."""

    @abstractmethod
    def count_transfers(self) -> int: ...

    @abstractmethod
    def engine_usage(self, engine_id: str) -> tuple[int, int]:
        """``(transfers, block ids)`` the prefill engine's transfers hold: those that still
        have their block ids (:func:`held_block_ids`)."""

    @abstractmethod
    def index_plan(self, plan_id: str, transfer_id: str) -> None: ...

    @abstractmethod
    def transfer_of_plan(self, plan_id: str) -> str | None: ...

    # ---- agent contacts (which prefill agents a decode rank already knows)

    @abstractmethod
    def add_contact(self, decode: RankKey, agent: str) -> bool:
        """Record that ``decode`` was given ``agent``'s metadata; ``True`` if it was new."""

    @abstractmethod
    def drop_contacts(self, decode: RankKey) -> None: ...

    # ---- release queues, one per prefill rank

    @abstractmethod
    def append_release(
        self, key: RankKey, event: ReleaseEvent, rank_bytes: int, total_bytes: int
    ) -> None:
        """Queue ``event``; sequences appended to one key are increasing. Then, while the
        rank's kept events exceed ``rank_bytes`` (:attr:`ReleaseEvent.nbytes`), drop its
        oldest; while all ranks' exceed ``total_bytes``, the oldest of the rank holding most.
        Dropped events advance :meth:`compacted_through`."""

    @abstractmethod
    def compacted_through(self, key: RankKey) -> int:
        """The newest sequence of ``key`` no longer kept (dropped, or trimmed once
        delivered); 0 when every event is still kept. A resume from before it would miss
        events."""

    @abstractmethod
    def releases_after(self, key: RankKey, sequence: int) -> list[ReleaseEvent]:
        """Queued events with ``event.sequence > sequence``, oldest first."""

    @abstractmethod
    def mark_delivered(self, key: RankKey, sequence: int) -> None:
        """Events up to ``sequence`` were sent to a watcher (the cursor never goes back)."""

    @abstractmethod
    def delivered(self, key: RankKey) -> int:
        """The largest sequence sent to any watcher of ``key`` (0 if none)."""

    @abstractmethod
    def trim_releases(self, key: RankKey, keep_delivered: int) -> None:
        """Forget delivered events beyond the newest ``keep_delivered`` of them."""

    @abstractmethod
    def drop_releases(self, key: RankKey) -> None:
        """Forget the queue, cursor and compaction mark of ``key`` (the rank is gone)."""


class InMemoryStateStore(StateStore):
    """Dicts in one process; the broker's default store."""

    def __init__(self) -> None:
        self._counters: dict[str, int] = {}
        self._ranks: dict[RankKey, RankRecord] = {}
        self._engines: dict[str, dict[int, RankRecord]] = {}
        self._leases: dict[str, RankKey] = {}
        self._transfers: dict[str, TransferRecord] = {}
        # (deadline, transfer id) min-heap; an entry is live while _deadlines agrees with it.
        self._deadline_heap: list[tuple[int, str]] = []
        self._deadlines: dict[str, int] = {}
        self._plans: dict[str, str] = {}
        self._usage: dict[str, tuple[int, int]] = {}  # engine_usage by prefill engine
        self._held: dict[str, tuple[str, int]] = {}  # what each transfer counts there
        self._contacts: dict[RankKey, set[str]] = {}
        self._releases: dict[RankKey, list[ReleaseEvent]] = {}
        self._delivered: dict[RankKey, int] = {}
        self._release_bytes: dict[RankKey, int] = {}  # kept events' nbytes, by rank
        self._total_release_bytes = 0
        self._compacted: dict[RankKey, int] = {}

    def next_counter(self, name: str) -> int:
        value = self._counters.get(name, 0) + 1
        self._counters[name] = value
        return value

    def put_rank(self, record: RankRecord) -> None:
        key = record.registration.key
        old = self._ranks.get(key)
        if old is not None:
            self._leases.pop(old.lease_id, None)
        self._ranks[key] = record
        self._engines.setdefault(key[0], {})[key[1]] = record
        self._leases[record.lease_id] = key

    def get_rank(self, key: RankKey) -> RankRecord | None:
        return self._ranks.get(key)

    def rank_by_lease(self, lease_id: str) -> RankRecord | None:
        key = self._leases.get(lease_id)
        return None if key is None else self._ranks.get(key)

    def delete_rank(self, key: RankKey) -> None:
        record = self._ranks.pop(key, None)
        if record is not None:
            self._leases.pop(record.lease_id, None)
            ranks = self._engines[key[0]]
            del ranks[key[1]]
            if not ranks:
                del self._engines[key[0]]

    def ranks(self) -> list[RankRecord]:
        return [self._ranks[k] for k in sorted(self._ranks)]

    def engine_ranks(self, engine_id: str) -> list[RankRecord]:
        ranks = self._engines.get(engine_id, {})
        return [ranks[r] for r in sorted(ranks)]

    def put_transfer(self, record: TransferRecord) -> None:
        self._account(record.transfer_id, record)
        self._transfers[record.transfer_id] = record
        if self._deadlines.get(record.transfer_id) != record.deadline_ms:
            self._deadlines[record.transfer_id] = record.deadline_ms
            heapq.heappush(self._deadline_heap, (record.deadline_ms, record.transfer_id))

    def get_transfer(self, transfer_id: str) -> TransferRecord | None:
        return self._transfers.get(transfer_id)

    def delete_transfer(self, transfer_id: str) -> None:
        record = self._transfers.pop(transfer_id, None)
        self._account(transfer_id, None)
        self._deadlines.pop(transfer_id, None)
        if record is not None:
            for plan in record.plans.values():
                self._plans.pop(plan.plan_id, None)

    def transfers(self) -> Iterator[TransferRecord]:
        return iter(list(self._transfers.values()))

    def due_transfers(self, now_ms: int) -> list[TransferRecord]:
        due = []
        heap = self._deadline_heap
        while heap and heap[0][0] <= now_ms:
            deadline, transfer_id = heapq.heappop(heap)
            if self._deadlines.get(transfer_id) == deadline:
                del self._deadlines[transfer_id]
                due.append(self._transfers[transfer_id])
        return due

    def _account(self, transfer_id: str, record: TransferRecord | None) -> None:
        """Count ``record`` (None: nothing) instead of what ``transfer_id`` counted before.
        Records are shared with the caller, who mutates them: what each counted is kept."""
        engine, held = self._held.pop(transfer_id, ("", 0))
        if held:
            self._add_usage(engine, -1, -held)
        held = held_block_ids(record)
        if record is not None and held:
            self._held[transfer_id] = (record.prefill_engine_id, held)
            self._add_usage(record.prefill_engine_id, 1, held)

    def _add_usage(self, engine_id: str, transfers: int, block_ids: int) -> None:
        held_transfers, held_ids = self._usage.pop(engine_id, (0, 0))
        if held_transfers + transfers:
            self._usage[engine_id] = (held_transfers + transfers, held_ids + block_ids)

    def engine_usage(self, engine_id: str) -> tuple[int, int]:
        return self._usage.get(engine_id, (0, 0))

    def count_transfers(self) -> int:
        return len(self._transfers)

    def index_plan(self, plan_id: str, transfer_id: str) -> None:
        self._plans[plan_id] = transfer_id

    def transfer_of_plan(self, plan_id: str) -> str | None:
        return self._plans.get(plan_id)

    def add_contact(self, decode: RankKey, agent: str) -> bool:
        known = self._contacts.setdefault(decode, set())
        if agent in known:
            return False
        known.add(agent)
        return True

    def drop_contacts(self, decode: RankKey) -> None:
        self._contacts.pop(decode, None)

    def append_release(
        self, key: RankKey, event: ReleaseEvent, rank_bytes: int, total_bytes: int
    ) -> None:
        # Block ids as arrays of int64: 8 bytes an id rather than a Python int each.
        compact = tuple(array("q", g) for g in event.block_ids)
        self._releases.setdefault(key, []).append(replace(event, block_ids=compact))
        self._release_bytes[key] = self._release_bytes.get(key, 0) + event.nbytes
        self._total_release_bytes += event.nbytes
        self._forget_oldest(key, lambda: self._release_bytes[key] > rank_bytes)
        while self._total_release_bytes > total_bytes:
            largest = max(self._release_bytes, key=self._release_bytes.__getitem__)
            self._forget_oldest(largest, lambda: False, at_least=1)

    def _forget_oldest(self, key: RankKey, over: Callable[[], bool], at_least: int = 0) -> None:
        """Drop ``key``'s oldest events: ``at_least`` of them, then while ``over()``."""
        queue = self._releases[key]
        dropped = 0
        while queue[dropped:] and (dropped < at_least or over()):
            size = queue[dropped].nbytes
            self._release_bytes[key] -= size
            self._total_release_bytes -= size
            dropped += 1
        if dropped:
            self._compacted[key] = queue[dropped - 1].sequence
            del queue[:dropped]

    def compacted_through(self, key: RankKey) -> int:
        return self._compacted.get(key, 0)

    def releases_after(self, key: RankKey, sequence: int) -> list[ReleaseEvent]:
        queue = self._releases.get(key, [])
        # Sequences are increasing: scan back from the newest event.
        start = len(queue)
        while start > 0 and queue[start - 1].sequence > sequence:
            start -= 1
        return queue[start:]

    def mark_delivered(self, key: RankKey, sequence: int) -> None:
        self._delivered[key] = max(self._delivered.get(key, 0), sequence)

    def delivered(self, key: RankKey) -> int:
        return self._delivered.get(key, 0)

    def trim_releases(self, key: RankKey, keep_delivered: int) -> None:
        queue = self._releases.get(key)
        if not queue:
            return
        cursor = self._delivered.get(key, 0)
        delivered = bisect.bisect_right(queue, cursor, key=attrgetter("sequence"))
        if delivered > keep_delivered:
            count = delivered - keep_delivered
            self._forget_oldest(key, lambda: False, at_least=count)

    def drop_releases(self, key: RankKey) -> None:
        self._releases.pop(key, None)
        self._delivered.pop(key, None)
        self._compacted.pop(key, None)
        self._total_release_bytes -= self._release_bytes.pop(key, 0)
