"""The transfer planner: a resharding of declared segments, vectorised over block ids.

For every decode (rank, group, segment) the planner finds the prefill pieces that hold the
same global elements, intersects them and emits byte runs that are contiguous on both sides.
Which prefill rank serves a piece is decided by interval subtraction along the TP-sharded axis,
preferring the ranks vLLM pairs with that decode rank (:meth:`PairPlanner.source_ranks`), so a
replicated head is read once and a replicated segment (MLA's latent: no shard axis) whole from
the first of them. Per (decode rank, group, chunk shape) the runs relative to the
page starts form a cached template (:mod:`broker.plan_templates`), and per request shape
(tokens and list lengths) the templates of all its slots are gathered once; a request only
adds block offsets with numpy and coalesces runs that continue each other on both sides, for
all its decode ranks in one pass. A pair of layouts is checked once (:mod:`broker.compatibility`).

This module holds the request and plan value types and :class:`PairPlanner`, which splits a
request into block pairs, checks its block ids and expands the templates over them.

Invariants, enforced on every plan: every run lies inside its region on both sides; no two
runs write the same decode byte (templates are checked once, block ids per request); the
bytes equal the unpadded state the decode rank needs. Pure: no I/O, no clocks, no globals.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, pairwise

import numpy as np

from broker.compatibility import check_compatible
from broker.errors import LimitExceededError, RequestError
from broker.layout import EngineLayout, attention_shortfall, tail_start
from broker.limits import LIMITS
from broker.plan_templates import (
    LENGTH,
    LOCAL,
    REGION,
    REMOTE,
    SOURCE,
    Bounds,
    Chunk,
    Pick,
    Picks,
    RequestShape,
    ShapeKey,
    TemplateTable,
    build_template,
    coalesce_columns,
    group_by_source,
    picked,
    run_bounds,
)

_I64 = np.int64


@dataclass(frozen=True)
class TransferRequest:
    """One request's state: ``num_tokens`` whose KV moves and block ids per group per side
    (each group a tuple, or an ``array('q')`` as the wire decodes long ones).

    A decode attention list shorter than the request needs means decode already holds a
    prefix: its blocks are the request's last ones. A sliding-window group's lists hold only
    the request's last blocks on both sides (:func:`broker.layout.window_tail`). Mamba lists
    pair from the prefill tail.
    """

    num_tokens: int
    prefill_block_ids: tuple[Sequence[int], ...]
    decode_block_ids: tuple[Sequence[int], ...]

    @classmethod
    def of(
        cls, num_tokens: int, prefill: Sequence[Sequence[int]], decode: Sequence[Sequence[int]]
    ) -> TransferRequest:
        return cls(num_tokens, tuple(tuple(g) for g in prefill), tuple(tuple(g) for g in decode))


@dataclass(frozen=True)
class SourceReads:
    """Reads of one decode rank from one prefill rank: parallel int64 columns, offsets in
    bytes from the start of region ``region`` (same region index on both sides)."""

    prefill_rank: int
    region: np.ndarray
    local_offset: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray
    #: Bytes read: the sum of ``length`` (computed when not given).
    nbytes: int = -1
    #: The lowest and highest value of each column (computed when not given), what the
    #: checks of its descriptors against the registered regions start from.
    bounds: Bounds = field(default=(), repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            object.__setattr__(self, "nbytes", int(self.length.sum()))
        if not self.bounds and self.length.size:
            bounds = run_bounds(self.region, self.local_offset, self.remote_offset, self.length)
            object.__setattr__(self, "bounds", bounds)

    @property
    def num_descriptors(self) -> int:
        return int(self.length.size)


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one decode rank reads, per source prefill rank, and what that saves.

    ``naive_bytes``: whole decode pages (padding included) for every page touched;
    ``vllm_descriptors``: descriptors vLLM 0.33's per-block scheme issues for the same state.
    Its bytes, descriptors and prefill ranks are counted once, when it is made (the broker
    reads them several times per plan request and report); in slots, no ``__dict__``.
    """

    decode_rank: int
    sources: tuple[SourceReads, ...]
    naive_bytes: int
    vllm_descriptors: int
    nbytes: int = field(init=False, compare=False, repr=False)
    num_descriptors: int = field(init=False, compare=False, repr=False)
    prefill_ranks: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        reads = self.sources
        object.__setattr__(self, "nbytes", sum([r.nbytes for r in reads]))
        object.__setattr__(self, "num_descriptors", sum([r.length.size for r in reads]))
        object.__setattr__(self, "prefill_ranks", tuple([r.prefill_rank for r in reads]))


@dataclass(frozen=True)
class TransferPlan:
    """Plans of every decode rank for one request."""

    ranks: tuple[RankPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_descriptors for r in self.ranks)

    @property
    def naive_bytes(self) -> int:
        return sum(r.naive_bytes for r in self.ranks)

    @property
    def vllm_descriptors(self) -> int:
        return sum(r.vllm_descriptors for r in self.ranks)

    def rows(self) -> np.ndarray:
        """``[d_rank, d_region, d_offset, p_rank, p_region, p_offset, length]`` per run."""
        parts = [
            np.stack(
                [
                    np.full_like(s.region, r.decode_rank),
                    s.region,
                    s.local_offset,
                    np.full_like(s.region, s.prefill_rank),
                    s.region,
                    s.remote_offset,
                    s.length,
                ],
                axis=1,
            )
            for r in self.ranks
            for s in r.sources
        ]
        return np.concatenate(parts) if parts else np.zeros((0, 7), dtype=_I64)


#: Python ints a request's lists may hold before they are converted to numpy a slice at a
#: time: one numpy call over a million Python ints would hold the interpreter for tens of
#: milliseconds, and a huge request is planned on a thread beside the server's event loop.
_VALUES_PER_STEP = 1 << 16


def _large(values: list[int]) -> list[int] | np.ndarray:
    """``values`` as they are, or converted to int64 a slice at a time when there are many
    (see :data:`_VALUES_PER_STEP`)."""
    if len(values) <= _VALUES_PER_STEP:
        return values
    return np.concatenate(
        [
            np.fromiter(values[i : i + _VALUES_PER_STEP], dtype=_I64)
            for i in range(0, len(values), _VALUES_PER_STEP)
        ]
    )


def _outside(ids: list[int] | np.ndarray, limit: int) -> bool:
    """Whether an id lies outside ``[0, limit)``."""
    if isinstance(ids, np.ndarray):
        return bool(ids.size) and (int(ids.min()) < 0 or int(ids.max()) >= limit)
    return bool(ids) and (min(ids) < 0 or max(ids) >= limit)


def _ids(groups: Sequence[Sequence[int]]) -> list[int] | np.ndarray:
    """All block ids of a request's groups (see :func:`_large`); groups given as int64
    buffers (``array('q')``) are read without a copy."""
    if not any(isinstance(g, array) for g in groups):
        return _large(list(chain.from_iterable(groups)))
    return np.concatenate(
        [
            np.frombuffer(g, dtype=_I64)
            if isinstance(g, array)
            else np.asarray(_large(list(g)), dtype=_I64)
            for g in groups
        ]
    )


#: Bytes the request shapes a planner keeps hold in all: past it they are dropped, and a
#: larger shape is gathered afresh per request.
_SHAPE_BYTES = 4 << 20


# --------------------------------------------------------------------------- pair planner


@dataclass
class PairPlanner:
    """Plans transfers from one prefill engine layout to one decode engine layout.

    Construction checks that the layouts describe the same state; templates are built
    lazily per (decode rank, group, chunk shape) and cached on the instance.
    """

    prefill: EngineLayout
    decode: EngineLayout
    #: Templates per decode rank the shared table holds before it is started afresh.
    max_templates: int = 4096
    #: Runs of one template over all its group's regions (a request that needs more is
    #: refused), and per decode rank of the template table before it is started afresh.
    max_template_runs: int = LIMITS.max_template_runs
    #: Runs (descriptors before coalescing) of one decode rank's plan.
    max_plan_runs: int = LIMITS.max_plan_runs
    #: False keeps vLLM's granularity (one run per segment per kernel block per source);
    #: benchmarks use it to compare against vLLM's descriptor scheme.
    coalesce: bool = True
    _table: TemplateTable = field(default_factory=TemplateTable, init=False, repr=False)
    _shapes: dict[ShapeKey, RequestShape] = field(default_factory=dict, init=False, repr=False)
    _shape_bytes: int = field(default=0, init=False, repr=False)
    _attention_groups: list[int] = field(default_factory=list, init=False, repr=False)
    #: Page bytes of a decode rank (EngineLayout makes all ranks alike), and (decode,
    #: prefill) page bytes as a column.
    _d_page: int = field(default=0, init=False, repr=False)
    _page_column: np.ndarray = field(
        default_factory=lambda: np.zeros((2, 1), dtype=_I64), init=False, repr=False
    )
    #: Bits of a decode offset when ``key << bits | offset`` fits in int64 (else None).
    _local_bits: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_compatible(self.prefill, self.decode)
        self._attention_groups = [
            g for g, group in enumerate(self.decode.groups) if group.is_attention
        ]
        d_rank = self.decode.ranks[0]
        self._d_page = d_rank.page_bytes
        self._page_column = np.array(
            [[self._d_page], [self.prefill.ranks[0].page_bytes]], dtype=_I64
        )
        local_bits = d_rank.region_bytes.bit_length()
        max_key = self.decode.tp_size * self.prefill.tp_size * d_rank.num_regions
        if max_key.bit_length() + local_bits <= 62:
            self._local_bits = local_bits

    # ---- public API

    @property
    def nbytes(self) -> int:
        """Bytes its cached templates (:attr:`TemplateTable.nbytes`) and request shapes hold."""
        return self._table.nbytes + self._shape_bytes + sys.getsizeof(self._shapes)

    def plan(self, request: TransferRequest) -> TransferPlan:
        """Plans of every decode rank, made together: one pass over all their runs."""
        return TransferPlan(self._plan_ranks(range(self.decode.tp_size), request))

    def source_ranks(self, decode_rank: int) -> tuple[int, ...]:
        """Prefill ranks in the order they are asked for data: vLLM's partners of this
        decode rank first (``d*P//D``, or ``d*k .. d*k+k-1``), then the others."""
        p_tp, d_tp = self.prefill.tp_size, self.decode.tp_size
        if d_tp >= p_tp:
            preferred = [decode_rank * p_tp // d_tp]
        else:
            k = p_tp // d_tp
            preferred = list(range(decode_rank * k, decode_rank * k + k))
        return tuple(preferred + [p for p in range(p_tp) if p not in preferred])

    def plan_rank(self, decode_rank: int, request: TransferRequest) -> RankPlan:
        """What ``decode_rank`` reads for ``request``. Raises :class:`RequestError`, or
        :class:`LimitExceededError` past ``max_template_runs`` / ``max_plan_runs``."""
        if not 0 <= decode_rank < self.decode.tp_size:
            raise RequestError("decode_rank", f"{decode_rank} outside [0, {self.decode.tp_size})")
        return self._plan_ranks((decode_rank,), request)[0]

    def _plan_ranks(self, ranks: Sequence[int], request: TransferRequest) -> tuple[RankPlan, ...]:
        """The plans of ``ranks``. The request's block pairs (the same for every decode rank)
        map to each rank's templates, gathered once per request shape (:class:`RequestShape`);
        block offsets are added, runs that continue each other merge, and the runs split by
        decode and prefill rank."""
        self._check_request(request)
        shape = self._shape(tuple(ranks), request)
        if shape.base is None:
            return tuple(
                RankPlan(d, (), shape.naive_bytes, n) for d, n in zip(ranks, shape.vllm_units)
            )
        slot_p: list[int] = []
        slot_d: list[int] = []
        for g, p_pick, d_pick in shape.picks:
            slot_p += picked(request.prefill_block_ids[g], p_pick)
            slot_d += picked(request.decode_block_ids[g], d_pick)
        block_offsets = np.array([_large(slot_d), _large(slot_p)], dtype=_I64)
        block_offsets *= self._page_column
        runs = shape.base.copy()
        runs[LOCAL : REMOTE + 1] += block_offsets.take(shape.column_slot, axis=1)
        mergeable = shape.mergeable
        if all(mergeable):
            runs = coalesce_columns(runs, self._local_bits)
        elif not any(mergeable):
            runs = group_by_source(runs)
        else:  # gathered runs are rank after rank
            runs = np.concatenate(
                [
                    coalesce_columns(part, self._local_bits) if merge else group_by_source(part)
                    for part, merge in zip(np.split(runs, shape.rank_ends[:-1], axis=1), mergeable)
                ],
                axis=1,
            )
        return self._split(ranks, runs, shape)

    def _shape(self, ranks: tuple[int, ...], request: TransferRequest) -> RequestShape:
        """The :class:`RequestShape` of ``request`` for ``ranks``, cached while the template table
        lasts (raises as :meth:`_plan_ranks` for a shape past the limits, caching nothing)."""
        key = (
            ranks,
            request.num_tokens,
            tuple(map(len, request.prefill_block_ids)),
            tuple(map(len, request.decode_block_ids)),
        )
        shape = self._shapes.get(key)
        if shape is not None:
            return shape
        tp = self.decode.tp_size
        table = self._table
        if len(table.ids) >= self.max_templates * tp or (
            table.runs.shape[1] >= self.max_template_runs * tp
        ):
            # Only between requests: the ids collected below index one table.
            table = self._table = TemplateTable()
            self._shapes.clear()
            self._shape_bytes = 0
        chunks, picks, naive_pages = self._block_pairs(key[1], key[2], key[3])
        slots = sum(count for _, _, count in chunks)
        tids: list[int] = []
        for d in ranks:
            for g, chunk, count in chunks:
                tids += [self._template_id(d, g, chunk)] * count
        naive_bytes = naive_pages * self._d_page
        if not slots:
            return self._cached(key, RequestShape(picks, naive_bytes, [0] * len(ranks), []))
        start, size, units, starts_pages, ends_pages = table.meta.take(_large(tids), axis=1)
        ends = size.cumsum()
        rank_ends = ends[slots - 1 :: slots].tolist()
        for d, (lo, hi) in zip(ranks, pairwise([0, *rank_ends])):
            if hi - lo > self.max_plan_runs:
                raise LimitExceededError(
                    "block_ids",
                    f"the plan of decode rank {d} needs {hi - lo} runs, "
                    f"at most {self.max_plan_runs}",
                )
        per_rank = range(0, len(tids), slots)
        vllm_units = np.add.reduceat(units, per_rank).tolist()
        total = rank_ends[-1]
        if not total:
            return self._cached(key, RequestShape(picks, naive_bytes, vllm_units, rank_ends))
        first_column = (start - ends + size).repeat(size)
        # A rank's runs merge only if one of its block pairs ends where another could start;
        # decided per rank, so that its plan is the same however many ranks are planned.
        mergeable = [False] * len(ranks)
        if self.coalesce:
            mergeable = (
                np.logical_or.reduceat(starts_pages, per_rank)
                & np.logical_or.reduceat(ends_pages, per_rank)
            ).tolist()
        base = table.runs.take(np.arange(total, dtype=_I64) + first_column, axis=1)
        sources, which = np.unique(base[SOURCE], return_inverse=True)
        source_bytes = np.zeros(sources.size, dtype=_I64)
        np.add.at(source_bytes, which, base[LENGTH])
        shape = RequestShape(
            picks,
            naive_bytes,
            vllm_units,
            rank_ends,
            mergeable,
            base,
            (np.arange(len(tids), dtype=_I64) % slots).repeat(size),
            sources,
            source_bytes.tolist(),
        )
        return self._cached(key, shape)

    def _cached(self, key: ShapeKey, shape: RequestShape) -> RequestShape:
        """``shape``, kept unless too large (see :data:`_SHAPE_BYTES`)."""
        size = shape.nbytes
        if size <= _SHAPE_BYTES:
            if self._shape_bytes + size > _SHAPE_BYTES:
                self._shapes.clear()
                self._shape_bytes = 0
            self._shapes[key] = shape
            self._shape_bytes += size
        return shape

    def _split(
        self, ranks: Sequence[int], runs: np.ndarray, shape: RequestShape
    ) -> tuple[RankPlan, ...]:
        """Runs of ``shape`` ordered by source, as one :class:`RankPlan` per decode rank."""
        source = runs[SOURCE]
        starts = source.searchsorted(shape.sources).tolist()
        lowest = np.minimum.reduceat(runs, starts, axis=1).T.tolist()
        highest = np.maximum.reduceat(runs, starts, axis=1).T.tolist()
        by_rank: dict[int, list[SourceReads]] = {d: [] for d in ranks}
        spans = pairwise([*starts, source.size])
        for (lo, hi), size, low, high in zip(spans, shape.source_bytes, lowest, highest):
            d, p = divmod(low[SOURCE], self.prefill.tp_size)
            sides = (low[REGION], high[REGION], low[LOCAL], high[LOCAL], low[REMOTE], high[REMOTE])
            bounds: Bounds = (*sides, low[LENGTH], high[LENGTH])
            region, local = runs[REGION, lo:hi], runs[LOCAL, lo:hi]
            remote, length = runs[REMOTE, lo:hi], runs[LENGTH, lo:hi]
            by_rank[d].append(SourceReads(p, region, local, remote, length, size, bounds))
        return tuple(
            RankPlan(d, tuple(by_rank[d]), shape.naive_bytes, units)
            for d, units in zip(ranks, shape.vllm_units)
        )

    def _block_pairs(
        self, num_tokens: int, p_lengths: tuple[int, ...], d_lengths: tuple[int, ...]
    ) -> tuple[list[tuple[int, Chunk | None, int]], tuple[Picks, ...], int]:
        """The block pairs of a request of ``num_tokens`` with lists of these lengths, the
        same for every decode rank: runs of ``(group, chunk, count)`` (template keys, in slot
        order), per group the positions in its prefill and decode lists of each slot's block
        id, and the number of decode pages written (over all layers)."""
        chunks: list[tuple[int, Chunk | None, int]] = []
        picks: list[Picks] = []
        naive_pages = 0
        for g, d_group in enumerate(self.decode.groups):
            p_len, d_len = p_lengths[g], d_lengths[g]
            if d_group.is_attention:
                shapes, p_pick, d_pick, pages = self._attention_chunks(g, num_tokens, p_len, d_len)
                chunks += [(g, shape, count) for shape, count in shapes]
            else:
                n = min(p_len, d_len)
                if n:
                    chunks.append((g, None, n))
                p_pick, d_pick, pages = slice(p_len - n, p_len), slice(0, n), n
            picks.append((g, p_pick, d_pick))
            naive_pages += pages * len(d_group.layers)
        return chunks, tuple(picks), naive_pages

    # ---- request handling

    def _check_request(self, request: TransferRequest) -> None:
        """Block ids in range, none written twice on decode, prefill holding every token.
        A fast pass over all ids; on failure a slower one names the offending group."""
        if request.num_tokens <= 0:
            raise RequestError("num_tokens", f"must be positive, got {request.num_tokens}")
        num_groups = len(self.decode.groups)
        for side, ids in (
            ("prefill_block_ids", request.prefill_block_ids),
            ("decode_block_ids", request.decode_block_ids),
        ):
            if len(ids) != num_groups:
                raise RequestError(side, f"expected {num_groups} groups, got {len(ids)}")
        p_all = _ids(request.prefill_block_ids)
        d_all = _ids(request.decode_block_ids)
        p_limit, d_limit = self.prefill.ranks[0].num_blocks, self.decode.ranks[0].num_blocks
        if _outside(p_all, p_limit) or _outside(d_all, d_limit):
            _raise_out_of_range(request, p_limit, d_limit)
        if len(np.unique(d_all) if isinstance(d_all, np.ndarray) else set(d_all)) != len(d_all):
            raise RequestError(
                "decode_block_ids",
                "a decode block id appears twice; two groups would write the same page",
            )
        for g in self._attention_groups:
            shortfall = attention_shortfall(
                self.prefill.groups[g], request.num_tokens, len(request.prefill_block_ids[g])
            )
            if shortfall:
                raise RequestError(f"prefill_block_ids[{g}]", shortfall)

    def _attention_chunks(
        self, g: int, num_tokens: int, p_len: int, d_len: int
    ) -> tuple[list[tuple[Chunk, int]], Pick, Pick, int]:
        """Split the tokens decode is missing into chunks that lie in one prefill and one
        decode page; returns the chunk shapes (with how many consecutive chunks have each),
        the positions in the prefill and decode lists of each chunk's block id, and the
        number of decode pages written."""
        p_group, d_group = self.prefill.groups[g], self.decode.groups[g]
        p_bs, d_bs = p_group.block_size, d_group.block_size
        # Both lists hold the request's last blocks: decode's a shorter list when it already
        # holds a prefix (or keeps only a window), prefill's when it keeps only a window.
        d_first = tail_start(num_tokens, d_len, d_bs)
        p_first = tail_start(num_tokens, p_len, p_bs)
        first = max(d_first, p_first)
        # Decode kernel blocks holding a token below num_tokens arrive whole (as vLLM moves
        # them), as far as prefill's pages reach.
        last = min(_round_up(num_tokens, d_group.kernel_block_size), p_first + p_len * p_bs)
        if last <= first or not d_len:
            return [], slice(0), slice(0), 0
        if p_bs == d_bs:  # chunks are whole pages but the last
            count = -(-(last - first) // d_bs)
            tail = last - first - (count - 1) * d_bs
            shapes = (
                [((0, 0, d_bs), count - 1), ((0, 0, tail), 1)] if count > 1 else [((0, 0, tail), 1)]
            )
            p_at, d_at = (first - p_first) // p_bs, (first - d_first) // d_bs
            return shapes, slice(p_at, p_at + count), slice(d_at, d_at + count), count
        starts = np.union1d(
            np.arange(_round_up(first, d_bs), last, d_bs, dtype=_I64),
            np.arange(_round_up(first, p_bs), last, p_bs, dtype=_I64),
        )
        starts = np.union1d(starts, [first])
        ends = np.append(starts[1:], last)
        p_index = (starts - p_first) // p_bs
        d_index = (starts - d_first) // d_bs
        spans = zip(
            (starts % p_bs).tolist(),
            (starts % d_bs).tolist(),
            (ends - starts).tolist(),
        )
        # Decode block ids are distinct (checked per request): as many pages as positions.
        return [(span, 1) for span in spans], p_index, d_index, int(np.unique(d_index).size)

    # ---- templates

    def _template_id(self, decode_rank: int, g: int, chunk: Chunk | None) -> int:
        """Id in the pair's table of ``decode_rank``'s template for group ``g`` and ``chunk``
        (``(prefill page token, decode page token, tokens)``; ``None`` for a Mamba block)."""
        table = self._table
        key = (decode_rank, g, chunk)
        tid = table.ids.get(key)
        if tid is None:
            tpl = build_template(
                self.prefill,
                self.decode,
                decode_rank,
                g,
                chunk,
                self.source_ranks(decode_rank),
                self.max_template_runs,
                self.coalesce,
            )
            tid = table.add(
                key,
                tpl,
                len(self.decode.groups[g].layers),
                decode_rank * self.prefill.tp_size,
                self.decode.ranks[decode_rank].num_regions,
                self.prefill.ranks[0].page_bytes,
                self._d_page,
            )
        return tid


def _raise_out_of_range(request: TransferRequest, p_limit: int, d_limit: int) -> None:
    for side, ids, limit in (
        ("prefill_block_ids", request.prefill_block_ids, p_limit),
        ("decode_block_ids", request.decode_block_ids, d_limit),
    ):
        for g, group_ids in enumerate(ids):
            for b in group_ids:
                if not 0 <= b < limit:
                    raise RequestError(f"{side}[{g}]", f"block id {b} outside [0, {limit})")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
