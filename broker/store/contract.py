"""The storage contract every broker store keeps (:class:`StateStore`).

Storage only: no business rules, no clocks. What both stores promise, and
``tests/test_store_contract.py`` checks against each with failures injected mid-call:

- **Values.** Records are immutable values (:mod:`broker.records`): what a getter returns
  cannot change under its caller, and a change is a ``put`` of a new record.
- **Units of work.** :meth:`StateStore.transact` runs one service call: its reads see its
  own writes, and its writes are committed all together when it returns, or not at all when
  it raises. Outside ``transact`` every call is a unit of its own. Counters
  (:meth:`~StateStore.next_counter`) are the one exception: a value taken by a unit that
  did not commit is skipped, never handed out twice. The reaper's
  :meth:`~StateStore.due_transfers` and :meth:`~StateStore.due_leases` are called outside
  units and take effect at once.
- **Indexes for every lookup a call makes.** A call touches the records it names and those
  the indexes point it to (transfers by engine, by bare id, by plan id, by deadline; ranks
  by engine, data-parallel deployment, lease, agent name and lease deadline; the losses of
  ranks by engine), never a scan of all of them; only the operator listings
  (:meth:`~StateStore.ranks`, :meth:`~StateStore.transfers`) read all.
- Getters return ``None`` for missing keys, deletes of missing keys do nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TypeVar

from broker.records import (
    RankKey,
    RankLoss,
    RankRecord,
    ReleaseEvent,
    TransferKey,
    TransferRecord,
)

T = TypeVar("T")

#: How long a due transfer handed out by :meth:`StateStore.due_transfers` waits before it is
#: handed out again, if whoever took it never put it back (a reaper that died).
REDELIVER_MS = 5_000
#: Due transfers :meth:`StateStore.due_transfers` hands out at most in one call: one call's
#: work (a reply, its keys) stays small however many transfers fall due together.
DUE_PER_CALL = 256


def held_block_ids(record: TransferRecord | None) -> int:
    """Block ids a transfer holds against its prefill engine's quota: all of them until
    every rank was released (then the record drops them)."""
    return 0 if record is None else sum(len(g) for g in record.block_ids)


class StateStore(ABC):
    """Registrations, transfers (with their plans), agent contacts and release queues, with
    the indexes the broker looks them up by; see the module docstring."""

    #: Whether calls wait on I/O (a server then makes them on a thread of their own, one at a
    #: time, so that its event loop never waits for the store).
    blocking: bool = False

    @abstractmethod
    def transact(self, operation: Callable[[], T]) -> T:
        """Run ``operation`` (one service call's reads and writes through this store) as one
        unit of work and return its result. Its writes are committed together when it
        returns and dropped when it raises; a store shared by brokers may run it more than
        once (another broker changed what it read). Nested calls join the outer unit."""

    def subscribe_releases(self, callback: Callable[[RankKey], None]) -> Callable[[], None]:
        """Have ``callback(key)`` called when a broker sharing this store queues a release
        for prefill rank ``key`` or drops its queue; returns the function that stops it. A
        store only one broker uses needs no such calls (the service tells its own server)."""
        return lambda: None

    # ---- counters

    @abstractmethod
    def next_counter(self, name: str) -> int:
        """The next value (from 1) of the named, never-reset counter."""

    def release_sequence(self) -> int:
        """The sequence of a release event about to be queued: the next value of counter
        ``release``, or 0 where :meth:`append_release` takes it as the write is applied."""
        return self.next_counter("release")

    # ---- ranks

    @abstractmethod
    def put_rank(self, record: RankRecord) -> None:
        """Insert or replace the rank at ``record.key``; index its engine (and data-parallel
        deployment), lease, agent name and lease expiry."""

    @abstractmethod
    def get_rank(self, key: RankKey) -> RankRecord | None: ...

    @abstractmethod
    def rank_by_lease(self, lease_id: str) -> RankRecord | None: ...

    @abstractmethod
    def rank_by_agent(self, agent_name: str) -> RankRecord | None:
        """The rank registered with NIXL agent ``agent_name``."""

    @abstractmethod
    def delete_rank(self, key: RankKey) -> None:
        """Remove the rank and its index entries."""

    @abstractmethod
    def engine_ranks(self, engine_id: str) -> list[RankRecord]:
        """The engine's registered ranks, by tp rank."""

    @abstractmethod
    def count_ranks(self) -> int: ...

    @abstractmethod
    def ranks_named(self, names: Collection[str]) -> list[RankKey]:
        """Keys, sorted, of the registered ranks of every engine one of ``names`` names
        (:func:`~broker.wire.names_engine`: the engine itself, or a data-parallel rank
        ``NAME_dp<N>`` of it), read through the engine and deployment indexes without the
        records (a caller's ranks; in a unit of work its own writes count, and what it reads
        here is not watched)."""

    @abstractmethod
    def due_leases(self, now_ms: int) -> list[RankKey]:
        """Ranks whose lease expired at or before ``now_ms`` (until they are put with a new
        expiry or deleted)."""

    @abstractmethod
    def ranks(self) -> list[RankRecord]:
        """Every registered rank, by (engine id, tp rank) (operator listings)."""

    # ---- departures of ranks not yet told to all their engine's transfers

    @abstractmethod
    def put_loss(self, loss: RankLoss) -> None:
        """Insert or replace the loss at ``loss.key``."""

    @abstractmethod
    def delete_loss(self, loss: RankLoss) -> None: ...

    @abstractmethod
    def losses(self, engine_ids: Collection[str] | None = None) -> list[RankLoss]:
        """The losses of ranks of ``engine_ids`` (None: of every engine), by key. Cheap when
        there are none: every call that changes a transfer reads those of its engines."""

    # ---- transfers

    @abstractmethod
    def put_transfer(self, record: TransferRecord) -> None:
        """Insert or replace the transfer at ``record.key``; index it by bare id, by the
        engines it concerns (:attr:`~broker.records.TransferRecord.parties`), by its plans'
        ids and by ``record.deadline_ms``, and count what it holds against its prefill
        engine (:meth:`engine_usage`)."""

    @abstractmethod
    def get_transfer(self, key: TransferKey) -> TransferRecord | None: ...

    @abstractmethod
    def delete_transfer(self, key: TransferKey) -> None:
        """Remove the transfer and its index entries."""

    @abstractmethod
    def transfers_named(self, transfer_id: str) -> list[TransferKey]:
        """Keys of the transfers published under ``transfer_id`` (by any prefill engine)."""

    @abstractmethod
    def transfers_of(self, engine_id: str) -> list[TransferKey]:
        """Keys of the transfers ``engine_id`` is a party of (prefill, or claiming decode)."""

    @abstractmethod
    def transfer_of_plan(self, plan_id: str) -> TransferKey | None:
        """The transfer ``plan_id`` was handed out for (None if unknown). It may name one
        since deleted or published again: callers look for the plan in its record."""

    @abstractmethod
    def due_transfers(self, now_ms: int, limit: int = DUE_PER_CALL) -> list[TransferKey]:
        """At most ``limit`` of the transfers whose ``deadline_ms <= now_ms``, earliest
        first. Each is handed out once, then again every :data:`REDELIVER_MS` until it is put
        with a new deadline or deleted."""

    @abstractmethod
    def count_transfers(self) -> int: ...

    @abstractmethod
    def engine_usage(self, engine_id: str) -> tuple[int, int]:
        """``(transfers, block ids)`` the prefill engine's transfers hold: those that still
        have their block ids (:func:`held_block_ids`)."""

    @abstractmethod
    def transfers(self) -> Iterator[TransferRecord]:
        """Every stored transfer (operator listings)."""

    def expect_engines(self, engine_ids: Iterable[str]) -> None:
        """A hint: the unit of work will read these engines' ranks (:meth:`engine_ranks`),
        which a store may read with its next round trip. Nothing else changes."""

    # ---- agent contacts (which prefill agents a decode rank already knows)

    @abstractmethod
    def add_contact(self, decode: RankKey, generation: int, agent: str) -> bool:
        """Record that ``decode`` (registered as ``generation``) was given ``agent``'s
        metadata; ``True`` if it was new. Once given, it stays known to that generation of
        the rank: its contacts go only with the rank (:meth:`drop_contacts`)."""

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
