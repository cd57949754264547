"""What the broker knows of an engine beyond its rank records, and the checks a request
must pass against it.

An :class:`Engine` is a fully registered engine as one call sees it: its ranks, the
:class:`~broker.layout.EngineLayout` they assemble, that layout's digest and its generation.
The :class:`EngineCatalog` caches each engine's assembled layout and digest (newest
generation, from when its last rank registered) and one
:class:`~broker.planner.PairPlanner` per pair of layout *values*, each with the lock that
keeps its template cache to one thread at a time: engines with equal layouts share planners,
whatever their ids, generations or memory addresses (a planner's templates are relative to
page starts; addresses are applied per plan). Pure checks of registrations and publications
against layouts live here too.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import is_

import numpy as np

from broker.errors import (
    IncompatibleLayoutsError,
    InvalidFieldError,
    LayoutError,
    NotFoundError,
    PreconditionError,
    RequestError,
)
from broker.layout import EngineLayout, attention_shortfall
from broker.planner import PairPlanner
from broker.records import RankRecord, RankRegistration
from broker.store.contract import StateStore
from broker.wire import BlockIds, Role, ids_array


@dataclass(frozen=True)
class Engine:
    """A fully registered engine: its ranks by tp rank, their layout (and its
    :func:`layout_digest`) and generation."""

    engine_id: str
    ranks: tuple[RankRecord, ...]
    layout: EngineLayout
    generation: int
    layout_digest: bytes

    @property
    def role(self) -> Role:
        return self.ranks[0].registration.role


def layout_digest(layout: EngineLayout) -> bytes:
    """A digest of everything a planner reads from ``layout`` (all its compared fields):
    equal for equal layouts, whichever engine declared them."""
    value = repr((layout.model, layout.tp_size, layout.ranks)).encode()
    return hashlib.blake2b(value, digest_size=16).digest()


@dataclass
class PairPlanning:
    """The planner of one (prefill, decode) pair of layouts and its lock, shared by every
    engine pair of those layouts. ``counted_bytes``: its size when the catalog last
    counted it."""

    planner: PairPlanner
    lock: threading.Lock = field(default_factory=threading.Lock)
    counted_bytes: int = 0


class EngineCatalog:
    """Assembled layouts per engine and planners per pair of layouts, the least recently
    used dropped while all of them hold more than ``planner_cache_bytes`` of templates.

    Templates are built while planning, after :meth:`pair` handed a planner out, so each
    call recounts the planner it hands out and the one it handed out before (whose
    planning, in place, is done by then; work planned on another thread comes back through
    :meth:`pair`)."""

    def __init__(self, planner_cache_bytes: int) -> None:
        self.planner_cache_bytes = planner_cache_bytes
        #: By engine id: (generation, layout, digest).
        self._layouts: dict[str, tuple[int, EngineLayout, bytes]] = {}
        #: By engine id: the engine last made, handed out again while its ranks are the same.
        self._engines: dict[str, Engine] = {}
        self._pairs: OrderedDict[tuple[bytes, bytes], PairPlanning] = OrderedDict()
        self._cached_bytes = 0

    @property
    def cached_bytes(self) -> int:
        """Template bytes of the cached planners, as last counted."""
        return self._cached_bytes

    def engine(self, store: StateStore, engine_id: str, field_name: str = "engine_id") -> Engine:
        """The engine as stored now; NOT_FOUND or FAILED_PRECONDITION naming ``field_name``
        unless all its ranks are registered."""
        ranks = store.engine_ranks(engine_id)
        if not ranks:
            raise NotFoundError(field_name, f"no engine {engine_id!r} is registered")
        tp_size = ranks[0].registration.tp_size
        if len(ranks) != tp_size:
            raise PreconditionError(
                field_name,
                f"engine {engine_id!r} has {len(ranks)} of its {tp_size} ranks registered",
            )
        made = self._engines.get(engine_id)
        if made is not None and len(made.ranks) == len(ranks) and all(map(is_, made.ranks, ranks)):
            return made
        generation = max(r.generation for r in ranks)
        cached = self._layouts.get(engine_id)
        if cached is None or cached[0] != generation:
            cached = self.remember(
                engine_id, generation, assemble_layout([r.registration for r in ranks])
            )
        made = self._engines[engine_id] = Engine(
            engine_id, tuple(ranks), cached[1], generation, cached[2]
        )
        return made

    def remember(
        self, engine_id: str, generation: int, layout: EngineLayout
    ) -> tuple[int, EngineLayout, bytes]:
        """Cache the engine's layout of ``generation`` (assembled when its last rank
        registered, or when first asked for) with its digest."""
        cached = self._layouts[engine_id] = (generation, layout, layout_digest(layout))
        return cached

    def forget(self, engine_id: str) -> None:
        """Drop the engine's cached layout (one of its ranks left)."""
        self._layouts.pop(engine_id, None)
        self._engines.pop(engine_id, None)

    def pair(self, prefill: Engine, decode: Engine) -> tuple[PairPlanning, bool]:
        """The planner of the pair's layouts (made and cached if new), and whether it was
        cached. IncompatibleLayoutsError names the engines of this pair."""
        key = (prefill.layout_digest, decode.layout_digest)
        recent = next(reversed(self._pairs.values()), None)
        pair = self._pairs.get(key)
        cached = pair is not None
        if pair is None:
            pair = self._pairs[key] = PairPlanning(_planner(prefill, decode))
        else:
            self._pairs.move_to_end(key)
        for counted in (recent, pair):
            if counted is not None:
                nbytes = counted.planner.nbytes
                self._cached_bytes += nbytes - counted.counted_bytes
                counted.counted_bytes = nbytes
        while self._cached_bytes > self.planner_cache_bytes and len(self._pairs) > 1:
            _, dropped = self._pairs.popitem(last=False)
            self._cached_bytes -= dropped.counted_bytes
        return pair, cached


def _planner(prefill: Engine, decode: Engine) -> PairPlanner:
    """A planner of the two engines' layouts; IncompatibleLayoutsError naming them."""
    try:
        return PairPlanner(prefill.layout, decode.layout)
    except IncompatibleLayoutsError as exc:
        name = (
            "model_fingerprint"
            if exc.field == "model"
            else (exc.field if exc.field == "tp_size" else f"layout.{exc.field}")
        )
        raise IncompatibleLayoutsError(
            name,
            f"decode engine {decode.engine_id!r} cannot read from "
            f"prefill engine {prefill.engine_id!r}: {exc.detail}",
        ) from None


def assemble_layout(registrations: Sequence[RankRegistration]) -> EngineLayout:
    """The engine layout of all its ranks' registrations; FAILED_PRECONDITION naming the
    layout field when they do not describe one engine."""
    regs = sorted(registrations, key=lambda r: r.tp_rank)
    try:
        return EngineLayout(
            regs[0].model_fingerprint, regs[0].tp_size, tuple(r.layout for r in regs)
        )
    except LayoutError as exc:
        raise PreconditionError(f"layout.{exc.field}", exc.detail) from None


def check_regions(reg: RankRegistration) -> None:
    """One region per layout region, each long enough for ``num_blocks`` pages, addressable
    as int64 and of one memory kind: what makes every planned descriptor land in a region."""
    if not 0 <= reg.tp_rank < reg.tp_size:
        raise InvalidFieldError("tp_rank", f"{reg.tp_rank} outside [0, {reg.tp_size})")
    rows = reg.region_rows
    if len(rows) != reg.layout.num_regions:
        raise InvalidFieldError(
            "regions",
            f"{len(rows)} regions registered, layout.num_regions is {reg.layout.num_regions}",
        )
    for i, (base_addr, length_bytes, _, memory_kind) in enumerate(rows):
        if length_bytes < reg.layout.region_bytes:
            raise InvalidFieldError(
                f"regions[{i}].length_bytes",
                f"{length_bytes} is less than num_blocks * page_bytes = {reg.layout.region_bytes}",
            )
        if base_addr + length_bytes >= 1 << 63:
            raise InvalidFieldError(f"regions[{i}].base_addr", "region ends past 2**63")
        if memory_kind != rows[0][3]:
            raise InvalidFieldError(
                f"regions[{i}].memory_kind", "all regions of a rank need the same memory kind"
            )


def check_published_blocks(layout: EngineLayout, block_ids: BlockIds, num_tokens: int) -> None:
    """Prefill block ids fit the engine: one list per group, ids in range, no id twice, each
    attention group holding ``num_tokens``, each Mamba group at least one block. One numpy
    pass over all ids; the slower per-group pass only runs to name an offending group."""
    if num_tokens <= 0:
        raise RequestError("num_tokens", "must be positive")
    if len(block_ids) != len(layout.groups):
        raise RequestError(
            "block_ids", f"expected {len(layout.groups)} groups, got {len(block_ids)}"
        )
    limit = layout.ranks[0].num_blocks
    if all(isinstance(g, tuple) for g in block_ids):  # short groups: one numpy call
        ids = np.fromiter(chain.from_iterable(block_ids), dtype=np.int64)
    else:
        ids = np.concatenate([ids_array(g) for g in block_ids])
    if ids.size and (
        int(ids.min()) < 0 or int(ids.max()) >= limit or np.unique(ids).size != ids.size
    ):
        seen: set[int] = set()
        for g, group_ids in enumerate(block_ids):
            for b in group_ids:
                if not 0 <= b < limit:
                    raise RequestError(f"block_ids[{g}]", f"block id {b} outside [0, {limit})")
                if b in seen:
                    raise RequestError(f"block_ids[{g}]", f"block id {b} appears twice")
                seen.add(b)
    for g, (group, group_ids) in enumerate(zip(layout.groups, block_ids)):
        shortfall = group.is_attention and attention_shortfall(group, num_tokens, len(group_ids))
        if shortfall:
            raise RequestError(f"block_ids[{g}]", shortfall)
        if not group.is_attention and not group_ids:
            raise RequestError(f"block_ids[{g}]", "a Mamba group needs its state block")
