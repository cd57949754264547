"""What the broker keeps: rank registrations, transfers, their plans and release events.

Immutable values with no behaviour beyond derived properties: the rules that make new ones
live in :mod:`broker.transfers` and :mod:`broker.service`, their storage behind
:class:`broker.store.StateStore`. Instants are
milliseconds since the Unix epoch on the broker's clock (``*_at_ms``), sizes bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, TypeVar

import numpy as np

from broker.descriptors import RegionTable
from broker.layout import RankLayout
from broker.planner import RankPlan
from broker.wire import (
    BlockIds,
    MemoryKind,
    ReleaseReason,
    ReportStatus,
    Role,
    TransferState,
    names_engine,
)

R = TypeVar("R", "PlanRecord", "TransferRecord", "ReleaseEvent")

#: ``(engine_id, tp_rank)`` of one registered rank.
RankKey = tuple[str, int]
#: ``(prefill_engine_id, transfer_id)`` of one transfer: ids are scoped by their publisher.
TransferKey = tuple[str, str]


#: One registered region as a registration holds it: ``(base_addr, length_bytes,
#: device_id, memory kind's value)``. A plain tuple of plain values, which the garbage
#: collector stops tracking once it has seen it: a cluster's regions (one per layer of each
#: rank) were most of the objects its records held, walked by every collection of the middle
#: generation (docs/BENCHMARKS.md §13).
RegionRow = tuple[int, int, int, str]
_KINDS = {kind.value: kind for kind in MemoryKind}


@dataclass(frozen=True)
class MemoryRegion:
    """One registered tensor: ``length_bytes`` from virtual address ``base_addr``."""

    base_addr: int
    length_bytes: int
    device_id: int
    memory_kind: MemoryKind

    @property
    def row(self) -> RegionRow:
        return (self.base_addr, self.length_bytes, self.device_id, self.memory_kind.value)

    @classmethod
    def of(cls, row: RegionRow) -> MemoryRegion:
        base_addr, length_bytes, device_id, kind = row
        return cls(base_addr, length_bytes, device_id, _KINDS[kind])


def region_rows(regions: Iterable[MemoryRegion]) -> tuple[RegionRow, ...]:
    """``regions`` as a registration holds them."""
    return tuple(r.row for r in regions)


@dataclass(frozen=True)
class RankRegistration:
    """What one TP rank declares when it registers; region *i* holds layer *i* of every
    group and is at least ``layout.region_bytes`` long (checked by :mod:`broker.convert`)."""

    engine_id: str
    role: Role
    tp_size: int
    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    region_rows: tuple[RegionRow, ...]
    layout: RankLayout
    model_fingerprint: str

    @property
    def key(self) -> RankKey:
        return (self.engine_id, self.tp_rank)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(map(MemoryRegion.of, self.region_rows))

    @cached_property
    def region_table(self) -> RegionTable:
        """Its regions as descriptors are made from them: base address, length (bytes) and
        device id per region, and what follows from them."""
        array = np.array([r[:3] for r in self.region_rows], dtype=np.int64).reshape(-1, 3)
        return RegionTable.of(np.ascontiguousarray(array.T))

    @property
    def memory_kind(self) -> MemoryKind:
        """Where its first region lives: what a plan tells of all its regions."""
        return _KINDS[self.region_rows[0][3]]


@dataclass(frozen=True)
class RankRecord:
    """A live registration and its lease. ``generation`` is unique broker-wide and grows
    with every registration; an engine's generation is the largest of its ranks'."""

    registration: RankRegistration
    lease_id: str
    lease_expires_at_ms: int
    registered_at_ms: int
    generation: int

    @property
    def key(self) -> RankKey:
        return self.registration.key


@dataclass(frozen=True)
class RankLoss:
    """A rank's departure (``why``: deregistered, lease expired, re-registered) not yet told
    to every transfer of its engine: those after ``done_through`` (by key) still wait for it,
    a slice of them per unit of work."""

    engine_id: str
    tp_rank: int
    generation: int
    why: str
    done_through: TransferKey = ("", "")

    @property
    def key(self) -> tuple[str, int, int]:
        return self.engine_id, self.tp_rank, self.generation


#: ``allowed_decode_engines`` naming none (any engine may read): one object however many
#: transfers keep it (each empty frozenset made is an object the garbage collector tracks).
ANY_DECODE_ENGINE: frozenset[str] = frozenset()

#: One event of a transfer's timeline: ``(at_ms, event, detail)``; a plain tuple of plain
#: values, which the garbage collector stops tracking (as :data:`RegionRow`).
TimelineEntry = tuple[int, str, str]


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One decode rank's plan for one transfer. ``rank_plan`` holds the region-relative runs
    (:class:`broker.planner.RankPlan`) for the decode ``block_ids`` it was made with."""

    plan_id: str
    decode_rank: int
    block_ids: BlockIds
    rank_plan: RankPlan
    #: When that rank was first given it (ms since epoch; None: not yet). A plan handed out
    #: and not yet reported is *live*: the prefill ranks it reads are not released until it
    #: reports or dies.
    handed_out_at_ms: int | None = None
    status: ReportStatus | None = None
    bytes_moved: int = 0
    duration_us: int = 0
    error: str = ""
    #: Reported DONE while the transfer was still live: only then is what it read usable.
    intact: bool = False

    @property
    def handed_out(self) -> bool:
        return self.handed_out_at_ms is not None

    @property
    def live(self) -> bool:
        """Handed out and not reported: decode may be reading its sources right now."""
        return self.handed_out and self.status is None

    @property
    def prefill_ranks(self) -> tuple[int, ...]:
        return self.rank_plan.prefill_ranks


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """A published request and everything that happened to it; a value (changes make a new
    record, see :mod:`broker.transfers`).

    A transfer is named by its prefill engine and its id (:attr:`key`): an id belongs to the
    engine that published it. ``plans[d]`` is decode rank ``d``'s plan (empty until a decode
    engine claims the transfer); ``released[p]`` is set once prefill rank ``p`` may free its
    blocks. ``prefill_generation`` is the prefill engine's generation at publish time.
    ``deadline_ms`` is when the reaper must next look at it: its expiry while unfinished, the
    first live plan's read deadline while one holds a prefill rank after the end, then the end
    of its retention.
    """

    transfer_id: str
    prefill_engine_id: str
    prefill_generation: int
    prefill_tp_size: int
    num_tokens: int
    block_ids: BlockIds
    allowed_decode_engines: frozenset[str]
    published_at_ms: int
    #: How long the publication waits for its decode engine: its expiry is publication
    #: time + this, moved on by extensions (:class:`broker.transfers.Extend`).
    ttl_ms: int
    expires_at_ms: int
    deadline_ms: int
    state: TransferState = TransferState.PUBLISHED
    decode_engine_id: str = ""
    decode_generation: int = 0
    plans: tuple[PlanRecord, ...] = ()
    #: Per prefill rank, why it was released (None: not yet); set on publication.
    released: tuple[ReleaseReason | None, ...] = ()
    finished_at_ms: int | None = None
    timeline: tuple[TimelineEntry, ...] = ()
    #: W3C traceparent of the transfer's trace: the publisher's, else the broker's publish
    #: span; '' when nobody traces. Spans about the transfer anywhere descend from it.
    traceparent: str = ""
    #: Why it ended, for the prefill ranks still held by live plans when it did (released
    #: with this reason once those plans report or die); None while unfinished.
    end_reason: ReleaseReason | None = None
    end_detail: str = ""

    @property
    def key(self) -> TransferKey:
        return (self.prefill_engine_id, self.transfer_id)

    @property
    def consumers(self) -> dict[int, frozenset[int]]:
        """Per prefill rank, the decode ranks whose plans read from it."""
        return consumers_of(self.plans, self.prefill_tp_size)

    @property
    def parties(self) -> frozenset[str]:
        """Engines the transfer concerns: its prefill engine and, once claimed, its decode
        engine (what the store indexes it under)."""
        return frozenset(e for e in (self.prefill_engine_id, self.decode_engine_id) if e)

    def admits(self, decode_engine_id: str) -> bool:
        """Whether the publication lets ``decode_engine_id`` read it: it names no decode
        engine, or names that one or the deployment of a data-parallel rank ``X_dp<N>``."""
        return not self.allowed_decode_engines or names_engine(
            self.allowed_decode_engines, decode_engine_id
        )

    def plan_by_id(self, plan_id: str) -> PlanRecord | None:
        return next((p for p in self.plans if p.plan_id == plan_id), None)


@dataclass(frozen=True, slots=True)
class ReleaseEvent:
    """Prefill rank may free ``block_ids`` of ``transfer_id``. ``sequence`` grows
    broker-wide, so it is strictly increasing (not contiguous) per rank: a resume cursor."""

    sequence: int
    transfer_id: str
    block_ids: BlockIds
    reason: ReleaseReason
    detail: str
    released_at_ms: int
    #: W3C traceparent the prefill rank's free span descends from ('' when nobody traces).
    traceparent: str = ""

    @property
    def nbytes(self) -> int:
        """What the event counts against a release backlog: 8 bytes a block id, its texts,
        and 64 for the rest (a group a store keeps packed into ``bytes`` counts its length)."""
        return (
            64
            + sum(len(g) if type(g) is bytes else 8 * len(g) for g in self.block_ids)
            + len(self.transfer_id)
            + len(self.detail)
            + len(self.traceparent)
        )


def consumers_of(plans: tuple[PlanRecord, ...], prefill_tp_size: int) -> dict[int, frozenset[int]]:
    """Per prefill rank (of ``prefill_tp_size``), the decode ranks whose ``plans`` read it."""
    readers: list[set[int]] = [set() for _ in range(prefill_tp_size)]
    for plan in plans:
        for p in plan.prefill_ranks:
            readers[p].add(plan.decode_rank)
    return {p: frozenset(r) for p, r in enumerate(readers)}


def evolve(record: R, **changes: object) -> R:
    """A copy of ``record`` with ``changes``: :func:`dataclasses.replace` without running
    ``__init__`` again, which these records (plain frozen fields, nothing derived or
    validated at construction) do not need; the state machine makes several per event.

    The records keep their fields in slots, with no ``__dict__``: one object each for the
    garbage collector, not two (docs/BENCHMARKS.md §13). A frozen record's slots are set
    through their descriptors, by a copier made once per class (:func:`_copier_of`)."""
    cls = type(record)
    copy = _COPIERS.get(cls) or _COPIERS.setdefault(cls, _copier_of(cls))
    return copy(record, changes)


#: Per record class: its copier (:func:`_copier_of`).
_COPIERS: dict[type, Callable[[Any, dict[str, object]], Any]] = {}


def _copier_of(cls: type) -> Callable[[Any, dict[str, object]], Any]:
    """``copy(record, changes)`` for slots dataclass ``cls``: a new instance with each field
    set through its slot's descriptor, one statement a field (no loop over the fields), then
    ``changes``."""
    names = [f.name for f in fields(cls)]  # a slots dataclass: one slot per field
    setters = {name: getattr(cls, name).__set__ for name in names}
    scope: dict[str, Any] = {"cls": cls, "new": object.__new__, "setters": setters}
    body = ["def copy(record, changes):", "    made = new(cls)"]
    for i, name in enumerate(names):
        scope[f"set{i}"] = setters[name]
        body.append(f"    set{i}(made, record.{name})")
    body += [
        "    for name, value in changes.items():",
        "        setters[name](made, value)",
        "    return made",
    ]
    exec("\n".join(body), scope)  # noqa: S102 - made above from the field names alone
    return scope["copy"]
