"""What the broker knows of an engine beyond its rank records, and the checks a request
must pass against it.

An :class:`Engine` is a fully registered engine as one call sees it: its ranks, the
:class:`~broker.layout.EngineLayout` they assemble and its generation. The
:class:`EngineCatalog` caches assembled layouts per engine generation and one
:class:`~broker.planner.PairPlanner` per pair of engine generations, each with the lock that
keeps its template cache to one thread at a time. Pure checks of registrations and
publications against layouts live here too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

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
    """A fully registered engine: its ranks by tp rank, their layout and generation."""

    engine_id: str
    ranks: tuple[RankRecord, ...]
    layout: EngineLayout
    generation: int

    @property
    def role(self) -> Role:
        return self.ranks[0].registration.role


@dataclass
class PairPlanning:
    """The planner of one (prefill, decode) engine-generation pair and its lock."""

    planner: PairPlanner
    lock: threading.Lock = field(default_factory=threading.Lock)


class EngineCatalog:
    """Assembled layouts per (engine, generation) and planners per pair, the newest
    ``planner_cache_size`` pairs."""

    def __init__(self, planner_cache_size: int) -> None:
        self.planner_cache_size = planner_cache_size
        self._layouts: dict[tuple[str, int], EngineLayout] = {}
        self._pairs: OrderedDict[tuple[str, int, str, int], PairPlanning] = OrderedDict()

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
        generation = max(r.generation for r in ranks)
        layout = self._layouts.get((engine_id, generation))
        if layout is None:
            layout = assemble_layout([r.registration for r in ranks])
            self._layouts[(engine_id, generation)] = layout
        return Engine(engine_id, tuple(ranks), layout, generation)

    def forget(self, engine_id: str) -> None:
        """Drop the engine's cached layouts (one of its ranks left)."""
        for cached in [k for k in self._layouts if k[0] == engine_id]:
            del self._layouts[cached]

    def pair(self, prefill: Engine, decode: Engine) -> tuple[PairPlanning, bool]:
        """The pair's planner (made and cached if new), and whether it was cached."""
        key = (prefill.engine_id, prefill.generation, decode.engine_id, decode.generation)
        pair = self._pairs.get(key)
        if pair is not None:
            self._pairs.move_to_end(key)
            return pair, True
        try:
            pair = PairPlanning(PairPlanner(prefill.layout, decode.layout))
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
        self._pairs[key] = pair
        if len(self._pairs) > self.planner_cache_size:
            self._pairs.popitem(last=False)
        return pair, False


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
