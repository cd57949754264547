"""The transfer planner: a resharding of declared segments, vectorised over block ids.

For every decode (rank, group, segment) the planner finds the prefill pieces that hold the
same global elements, intersects them and emits byte runs that are contiguous on both sides
(:func:`strided_runs`). Which prefill rank serves a piece is decided by interval subtraction
along the TP-sharded axis, preferring the ranks vLLM pairs with that decode rank, so a
replicated head is read once. Per (decode rank, group, chunk shape) the runs relative to the
page starts form a cached :class:`Template`; a request only adds block offsets with numpy and
coalesces runs that continue each other on both sides, for all its decode ranks in one pass.

Invariants, enforced on every plan: every run lies inside its region on both sides; no two
runs write the same decode byte (templates are checked once, block ids per request); the
bytes equal the unpadded state the decode rank needs. Pure: no I/O, no clocks, no globals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, pairwise

import numpy as np

from broker.errors import IncompatibleLayoutsError, LimitExceededError, RequestError
from broker.layout import EngineLayout, GroupLayout, Segment
from broker.limits import LIMITS

_I64 = np.int64
#: Rows of a template table: source (decode rank * prefill TP size + prefill rank), region,
#: coalescing key (source * regions per rank + region), decode offset, prefill offset, length.
_SOURCE, _REGION, _KEY, _LOCAL, _REMOTE, _LENGTH = range(6)


@dataclass(frozen=True)
class TransferRequest:
    """One request's state: ``num_tokens`` whose KV moves and block ids per group per side.

    A decode attention list shorter than the request needs means decode already holds a
    prefix: its blocks are the request's last ones. Mamba lists pair from the prefill tail.
    """

    num_tokens: int
    prefill_block_ids: tuple[tuple[int, ...], ...]
    decode_block_ids: tuple[tuple[int, ...], ...]

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

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            object.__setattr__(self, "nbytes", int(self.length.sum()))

    @property
    def num_descriptors(self) -> int:
        return int(self.length.size)


@dataclass(frozen=True)
class RankPlan:
    """What one decode rank reads, per source prefill rank, and what that saves.

    ``naive_bytes``: whole decode pages (padding included) for every page touched;
    ``vllm_descriptors``: descriptors vLLM 0.33's per-block scheme issues for the same state.
    """

    decode_rank: int
    sources: tuple[SourceReads, ...]
    naive_bytes: int
    vllm_descriptors: int

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sources)

    @property
    def num_descriptors(self) -> int:
        return sum(s.num_descriptors for s in self.sources)

    @property
    def prefill_ranks(self) -> tuple[int, ...]:
        return tuple(s.prefill_rank for s in self.sources)


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


@dataclass(frozen=True)
class Template:
    """Runs for one block pair (one chunk of tokens for attention), offsets relative to the
    page start on each side, coalesced; ``vllm_units`` counts vLLM's descriptors for it."""

    prefill_rank: np.ndarray
    remote_offset: np.ndarray
    local_offset: np.ndarray
    length: np.ndarray
    vllm_units: int


class _TemplateTable:
    """Every template of a pair (all decode ranks), each repeated over its group's regions,
    stored as the columns of one ``(6, runs)`` array (rows :data:`_SOURCE` .. :data:`_LENGTH`)
    so that a request expands the block pairs of all its decode ranks with one gather.
    ``meta`` holds per template its first column, its number of columns, vLLM's descriptor
    count for it, and whether a run starts at both page starts and whether one ends at both
    page ends (only such runs can merge with a run of another block pair)."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.meta = np.zeros((5, 0), dtype=_I64)
        self.runs = np.zeros((6, 0), dtype=_I64)

    def add(
        self,
        key: tuple,
        tpl: Template,
        num_regions: int,
        first_source: int,
        regions_per_rank: int,
        p_page: int,
        d_page: int,
    ) -> int:
        """Append ``tpl`` repeated over ``num_regions`` regions, its prefill ranks numbered
        from ``first_source``; returns its id."""
        runs = tpl.length.size
        tid = self.ids[key] = self.meta.shape[1]
        source = np.tile(tpl.prefill_rank + first_source, num_regions)
        region = np.repeat(np.arange(num_regions, dtype=_I64), runs)
        added = np.stack(
            [
                source,
                region,
                source * regions_per_rank + region,
                np.tile(tpl.local_offset, num_regions),
                np.tile(tpl.remote_offset, num_regions),
                np.tile(tpl.length, num_regions),
            ]
        )
        starts_pages = np.any((tpl.local_offset == 0) & (tpl.remote_offset == 0))
        ends_pages = np.any(
            (tpl.local_offset + tpl.length == d_page) & (tpl.remote_offset + tpl.length == p_page)
        )
        column = [
            self.runs.shape[1],
            runs * num_regions,
            tpl.vllm_units * num_regions,
            int(starts_pages),
            int(ends_pages),
        ]
        self.meta = np.append(self.meta, np.array(column, dtype=_I64)[:, None], axis=1)
        self.runs = np.concatenate([self.runs, added], axis=1)
        return tid


# --------------------------------------------------------------------------- run emission


def strided_runs(
    extent: Sequence[int],
    itemsize: int,
    d_base: int,
    d_start: Sequence[int],
    d_strides: Sequence[int],
    p_base: int,
    p_start: Sequence[int],
    p_strides: Sequence[int],
    max_runs: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Byte runs copying a box of ``extent`` elements between two strided arrays.

    The box starts at local index ``d_start`` / ``p_start`` on each side. Trailing axes whose
    strides make the box contiguous on *both* sides fold into one run; the remaining outer
    axes enumerate runs. Returns ``(d_offsets, p_offsets, run_length)``; raises
    :class:`LimitExceededError` (field ``strides``) before building more than ``max_runs``.
    """
    run, inner = itemsize, len(extent)
    while inner > 0:
        axis = inner - 1
        if extent[axis] != 1 and (d_strides[axis] != run or p_strides[axis] != run):
            break
        run *= extent[axis]
        inner -= 1
    count = math.prod(extent[:inner])
    if max_runs is not None and count > max_runs:
        raise LimitExceededError("strides", f"{count} runs, at most {max_runs}")
    d_off = np.array([d_base + sum(s * t for s, t in zip(d_start, d_strides))], dtype=_I64)
    p_off = np.array([p_base + sum(s * t for s, t in zip(p_start, p_strides))], dtype=_I64)
    for axis in range(inner):
        if extent[axis] == 1:  # any stride, even one past int64, moves nowhere
            continue
        steps = np.arange(extent[axis], dtype=_I64)
        d_off = (d_off[:, None] + steps * d_strides[axis]).ravel()
        p_off = (p_off[:, None] + steps * p_strides[axis]).ravel()
    return d_off, p_off, run


def _subtract(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for a, b in intervals:
        if b <= lo or a >= hi:
            out.append((a, b))
            continue
        if a < lo:
            out.append((a, lo))
        if b > hi:
            out.append((hi, b))
    return out


def coalesce(
    keys: np.ndarray,
    d_off: np.ndarray,
    p_off: np.ndarray,
    length: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sort runs by (key, decode offset) and merge those that continue each other on both
    sides. ``keys`` must identify (prefill rank, region): runs never merge across them."""
    order = np.lexsort((d_off, keys))
    keys, d_off, p_off, length = keys[order], d_off[order], p_off[order], length[order]
    if keys.size < 2:
        return keys, d_off, p_off, length
    joins = (
        (keys[1:] == keys[:-1])
        & (d_off[1:] == d_off[:-1] + length[:-1])
        & (p_off[1:] == p_off[:-1] + length[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return keys[starts], d_off[starts], p_off[starts], np.add.reduceat(length, starts)


def _group_by_source(runs: np.ndarray) -> np.ndarray:
    """Template-table columns ordered by source, keeping their order within one."""
    source = runs[_SOURCE]
    if bool((source[1:] < source[:-1]).any()):
        return runs.take(np.argsort(source, kind="stable"), axis=1)
    return runs


def _coalesce_columns(runs: np.ndarray, local_bits: int | None) -> np.ndarray:
    """:func:`coalesce` for the columns of a template-table gather: sorted by (key, decode
    offset), runs that continue each other on both sides merged. With ``local_bits`` (decode
    offsets are below ``2**local_bits`` and ``key << local_bits`` fits in int64) one argsort
    of ``key << local_bits | offset`` orders them: pairs are unique, as no two runs of a decode
    rank write the same byte."""
    if local_bits is None:
        order = np.lexsort((runs[_LOCAL], runs[_KEY]))
    else:
        # Stable: a merge sort runs through the sorted stretches each block pair brings.
        order = np.argsort((runs[_KEY] << local_bits) | runs[_LOCAL], kind="stable")
    runs = runs.take(order, axis=1)
    n = runs.shape[1]
    if n < 2:
        return runs
    key, local, remote, length = runs[_KEY], runs[_LOCAL], runs[_REMOTE], runs[_LENGTH]
    breaks = np.empty(n, dtype=bool)
    breaks[0] = True
    np.not_equal(key[1:], key[:-1], out=breaks[1:])
    breaks[1:] |= local[1:] != local[:-1] + length[:-1]
    breaks[1:] |= remote[1:] != remote[:-1] + length[:-1]
    starts = breaks.nonzero()[0]
    if starts.size == n:
        return runs
    merged = runs.take(starts, axis=1)
    merged[_LENGTH] = np.add.reduceat(length, starts)
    return merged


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
    _table: _TemplateTable = field(default_factory=_TemplateTable, init=False, repr=False)
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
        map to each rank's templates; one gather expands them all, block offsets are added,
        runs that continue each other merge, and the runs split by decode and prefill rank."""
        self._check_request(request)
        tp = self.decode.tp_size
        table = self._table
        if len(table.ids) >= self.max_templates * tp or (
            table.runs.shape[1] >= self.max_template_runs * tp
        ):
            # Only between requests: the ids collected below index one table.
            table = self._table = _TemplateTable()
        chunks, slot_p, slot_d, naive_pages = self._block_pairs(request)
        slots = len(slot_p)
        tids: list[int] = []
        for d in ranks:
            for g, chunk, count in chunks:
                tids += [self._template_id(d, g, chunk)] * count
        if not slots:
            return tuple(RankPlan(d, (), naive_pages * self._d_page, 0) for d in ranks)
        start, size, units, starts_pages, ends_pages = table.meta.take(tids, axis=1)
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
            return tuple(
                RankPlan(d, (), naive_pages * self._d_page, n) for d, n in zip(ranks, vllm_units)
            )
        runs = table.runs.take(
            np.arange(total, dtype=_I64) + (start - ends + size).repeat(size), axis=1
        )
        block_offsets = np.array((slot_d * len(ranks), slot_p * len(ranks)), dtype=_I64)
        block_offsets *= self._page_column
        runs[_LOCAL : _REMOTE + 1] += block_offsets.repeat(size, axis=1)
        # A rank's runs merge only if one of its block pairs ends where another could start;
        # decided per rank, so that its plan is the same however many ranks are planned.
        mergeable = [False] * len(ranks)
        if self.coalesce:
            mergeable = (
                np.logical_or.reduceat(starts_pages, per_rank)
                & np.logical_or.reduceat(ends_pages, per_rank)
            ).tolist()
        if all(mergeable):
            runs = _coalesce_columns(runs, self._local_bits)
        elif not any(mergeable):
            runs = _group_by_source(runs)
        else:  # gathered runs are rank after rank
            runs = np.concatenate(
                [
                    _coalesce_columns(part, self._local_bits) if merge else _group_by_source(part)
                    for part, merge in zip(np.split(runs, rank_ends[:-1], axis=1), mergeable)
                ],
                axis=1,
            )
        return self._split(ranks, runs, naive_pages, vllm_units)

    def _split(
        self, ranks: Sequence[int], runs: np.ndarray, naive_pages: int, vllm_units: list[int]
    ) -> tuple[RankPlan, ...]:
        """Runs ordered by source, as one :class:`RankPlan` per decode rank."""
        source = runs[_SOURCE]
        starts = [0, *((source[1:] != source[:-1]).nonzero()[0] + 1).tolist()]
        nbytes = np.add.reduceat(runs[_LENGTH], starts).tolist()
        by_rank: dict[int, list[SourceReads]] = {d: [] for d in ranks}
        p_tp = self.prefill.tp_size
        for (lo, hi), size in zip(pairwise([*starts, source.size]), nbytes):
            d, p = divmod(int(source[lo]), p_tp)
            by_rank[d].append(
                SourceReads(
                    p,
                    runs[_REGION, lo:hi],
                    runs[_LOCAL, lo:hi],
                    runs[_REMOTE, lo:hi],
                    runs[_LENGTH, lo:hi],
                    size,
                )
            )
        return tuple(
            RankPlan(d, tuple(by_rank[d]), naive_pages * self._d_page, units)
            for d, units in zip(ranks, vllm_units)
        )

    def _block_pairs(
        self,
        request: TransferRequest,
    ) -> tuple[list[tuple[int, tuple[int, int, int] | None, int]], list[int], list[int], int]:
        """The request's block pairs, the same for every decode rank: runs of ``(group,
        chunk, count)`` (template keys, in slot order), the prefill and decode block id of
        each slot, and the number of decode pages written (over all layers)."""
        chunks: list[tuple[int, tuple[int, int, int] | None, int]] = []
        slot_p: list[int] = []
        slot_d: list[int] = []
        naive_pages = 0
        for g, d_group in enumerate(self.decode.groups):
            p_ids, d_ids = request.prefill_block_ids[g], request.decode_block_ids[g]
            if d_group.is_attention:
                shapes, p_sel, d_sel, pages = self._attention_chunks(
                    g, request.num_tokens, p_ids, d_ids
                )
                chunks += [(g, shape, count) for shape, count in shapes]
            else:
                n = min(len(p_ids), len(d_ids))
                if n:
                    chunks.append((g, None, n))
                p_sel, d_sel, pages = p_ids[len(p_ids) - n :], d_ids[:n], n
            slot_p += p_sel
            slot_d += d_sel
            naive_pages += pages * len(d_group.layers)
        return chunks, slot_p, slot_d, naive_pages

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
        p_all = list(chain.from_iterable(request.prefill_block_ids))
        d_all = list(chain.from_iterable(request.decode_block_ids))
        p_limit, d_limit = self.prefill.ranks[0].num_blocks, self.decode.ranks[0].num_blocks
        if (p_all and (min(p_all) < 0 or max(p_all) >= p_limit)) or (
            d_all and (min(d_all) < 0 or max(d_all) >= d_limit)
        ):
            _raise_out_of_range(request, p_limit, d_limit)
        if len(set(d_all)) != len(d_all):
            raise RequestError(
                "decode_block_ids",
                "a decode block id appears twice; two groups would write the same page",
            )
        for g in self._attention_groups:
            block_size = self.prefill.groups[g].block_size
            held = len(request.prefill_block_ids[g]) * block_size
            if held < request.num_tokens:
                raise RequestError(
                    f"prefill_block_ids[{g}]",
                    f"{len(request.prefill_block_ids[g])} blocks of {block_size} "
                    f"tokens cannot hold num_tokens={request.num_tokens}",
                )

    def _attention_chunks(
        self,
        g: int,
        num_tokens: int,
        p_ids: Sequence[int],
        d_ids: Sequence[int],
    ) -> tuple[list[tuple[tuple[int, int, int], int]], list[int], list[int], int]:
        """Split the tokens decode is missing into chunks that lie in one prefill and one
        decode page; returns the chunk shapes (with how many consecutive chunks have each),
        both block ids per chunk, and the number of decode pages written."""
        p_group, d_group = self.prefill.groups[g], self.decode.groups[g]
        p_bs, d_bs = p_group.block_size, d_group.block_size
        needed = -(-num_tokens // d_bs)
        skip = max(0, needed - len(d_ids))  # decode already holds a prefix of `skip` pages
        first = skip * d_bs
        # Decode kernel blocks holding a token below num_tokens arrive whole (as vLLM moves
        # them), as far as prefill's pages reach.
        last = min(_round_up(num_tokens, d_group.kernel_block_size), len(p_ids) * p_bs)
        if last <= first or not d_ids:
            return [], [], [], 0
        if p_bs == d_bs:  # chunks are whole pages but the last
            count = -(-(last - first) // d_bs)
            tail = last - first - (count - 1) * d_bs
            shapes = (
                [((0, 0, d_bs), count - 1), ((0, 0, tail), 1)] if count > 1 else [((0, 0, tail), 1)]
            )
            return shapes, list(p_ids[skip : skip + count]), list(d_ids[:count]), count
        starts = np.union1d(
            np.arange(first, last, d_bs, dtype=_I64),
            np.arange(_round_up(first, p_bs), last, p_bs, dtype=_I64),
        )
        starts = np.union1d(starts, [first])
        ends = np.append(starts[1:], last)
        p_index, d_index = starts // p_bs, starts // d_bs
        shapes = zip(
            (starts - p_index * p_bs).tolist(),
            (starts - d_index * d_bs).tolist(),
            (ends - starts).tolist(),
        )
        d_sel = np.asarray(d_ids, dtype=_I64)[d_index - skip]
        return (
            [(shape, 1) for shape in shapes],
            np.asarray(p_ids, dtype=_I64)[p_index].tolist(),
            d_sel.tolist(),
            int(np.unique(d_sel).size),
        )

    # ---- templates

    def _template_id(self, decode_rank: int, g: int, chunk: tuple[int, int, int] | None) -> int:
        """Id in the pair's table of ``decode_rank``'s template for group ``g`` and ``chunk``
        (``(prefill page token, decode page token, tokens)``; ``None`` for a Mamba block)."""
        table = self._table
        key = (decode_rank, g, chunk)
        tid = table.ids.get(key)
        if tid is None:
            tpl = self._build_template(decode_rank, g, chunk)
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

    def _build_template(
        self, decode_rank: int, g: int, chunk: tuple[int, int, int] | None
    ) -> Template:
        d_group = self.decode.ranks[decode_rank].groups[g]
        p_groups = [rank.groups[g] for rank in self.prefill.ranks]
        pieces = _kernel_pieces(p_groups[0], d_group, chunk)
        ranks_out, d_out, p_out, len_out = [], [], [], []
        units = 0
        budget = self.max_template_runs // len(d_group.layers)  # the table repeats it per layer
        for d_seg in d_group.segments:
            for p_kb, p_tok, d_kb, d_tok, tokens in pieces:
                missing = [d_seg.shard_interval]
                for p in self.source_ranks(decode_rank):
                    p_seg = p_groups[p].segment(d_seg.tensor)
                    overlaps = [
                        (max(a, p_seg.shard_interval[0]), min(b, p_seg.shard_interval[1]))
                        for a, b in missing
                    ]
                    overlaps = [(a, b) for a, b in overlaps if a < b]
                    for lo, hi in overlaps:
                        try:
                            d_off, p_off, run = _segment_box(
                                d_seg,
                                p_seg,
                                lo,
                                hi,
                                d_tok,
                                p_tok,
                                tokens,
                                d_kb * d_group.kernel_block_bytes,
                                p_kb * p_groups[p].kernel_block_bytes,
                                budget,
                            )
                        except LimitExceededError:
                            raise LimitExceededError(
                                f"layout.groups[{g}].segments[{d_seg.tensor!r}].strides",
                                f"prefill and decode strides split a page into more than "
                                f"{self.max_template_runs} runs over its {len(d_group.layers)} "
                                "regions",
                            ) from None
                        budget -= d_off.size
                        ranks_out.append(np.full(d_off.size, p, dtype=_I64))
                        d_out.append(d_off)
                        p_out.append(p_off)
                        len_out.append(np.full(d_off.size, run, dtype=_I64))
                        missing = _subtract(missing, lo, hi)
                    units += bool(overlaps)
                    if not missing:
                        break
                if missing:
                    raise IncompatibleLayoutsError(
                        f"groups[{g}].segments[{d_seg.tensor!r}]",
                        f"decode rank {decode_rank} needs global indices {missing} that no "
                        "prefill rank holds",
                    )
        if not d_out:
            empty = np.zeros(0, dtype=_I64)
            return Template(empty, empty, empty, empty, 0)
        columns = [np.concatenate(c) for c in (ranks_out, d_out, p_out, len_out)]
        if self.coalesce:
            p_rank, d_off, p_off, length = coalesce(*columns)
        else:
            p_rank, d_off, p_off, length = columns
        _check_template(
            d_group,
            chunk,
            d_off,
            p_off,
            length,
            self.decode.ranks[decode_rank].page_bytes,
            self.prefill.ranks[0].page_bytes,
            decode_rank,
            g,
        )
        return Template(p_rank, p_off, d_off, length, units)


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


def _kernel_pieces(
    p_group: GroupLayout, d_group: GroupLayout, chunk: tuple[int, int, int] | None
) -> list[tuple[int, int, int, int, int]]:
    """Split a chunk at kernel-block boundaries of both sides: ``(p_kernel_block,
    p_token_in_kb, d_kernel_block, d_token_in_kb, tokens)``. Mamba: one whole piece."""
    if chunk is None:
        return [(0, 0, 0, 0, 0)]
    p_at, d_at, count = chunk
    p_kbs, d_kbs = p_group.kernel_block_size, d_group.kernel_block_size
    cuts = {0, count}
    cuts.update(k * p_kbs - p_at for k in range(p_at // p_kbs + 1, (p_at + count) // p_kbs + 1))
    cuts.update(k * d_kbs - d_at for k in range(d_at // d_kbs + 1, (d_at + count) // d_kbs + 1))
    bounds = sorted(c for c in cuts if 0 <= c <= count)
    return [
        ((p_at + u) // p_kbs, (p_at + u) % p_kbs, (d_at + u) // d_kbs, (d_at + u) % d_kbs, v - u)
        for u, v in pairwise(bounds)
    ]


def _segment_box(
    d_seg: Segment,
    p_seg: Segment,
    lo: int,
    hi: int,
    d_tok: int,
    p_tok: int,
    tokens: int,
    d_base: int,
    p_base: int,
    max_runs: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Runs copying global shard indices ``[lo, hi)`` (and a token range) of one tensor; at
    most ``max_runs`` (else :class:`LimitExceededError`)."""
    extent, d_start, p_start = list(d_seg.shape), [0] * len(d_seg.shape), [0] * len(d_seg.shape)
    if d_seg.shard_axis is not None:
        axis = d_seg.shard_axis
        extent[axis] = hi - lo
        d_start[axis], p_start[axis] = lo - d_seg.shard_start, lo - p_seg.shard_start
    if d_seg.token_axis is not None:
        axis = d_seg.token_axis
        extent[axis], d_start[axis], p_start[axis] = tokens, d_tok, p_tok
    return strided_runs(
        extent,
        d_seg.itemsize,
        d_base + d_seg.offset,
        d_start,
        d_seg.strides,
        p_base + p_seg.offset,
        p_start,
        p_seg.strides,
        max_runs,
    )


def _check_template(
    d_group: GroupLayout,
    chunk: tuple[int, int, int] | None,
    d_off: np.ndarray,
    p_off: np.ndarray,
    length: np.ndarray,
    d_page: int,
    p_page: int,
    decode_rank: int,
    g: int,
) -> None:
    """A template stays inside one page on both sides and writes each needed decode byte
    exactly once. With block ids checked per request, every plan then stays inside its
    regions: ``block * page_bytes + offset < num_blocks * page_bytes``."""
    if (
        d_off.min() < 0
        or p_off.min() < 0
        or (d_off + length).max() > d_page
        or (p_off + length).max() > p_page
    ):
        raise AssertionError(f"template for decode rank {decode_rank} group {g} leaves its page")
    order = np.argsort(d_off)
    if np.any(d_off[order][1:] < (d_off + length)[order][:-1]):
        raise AssertionError(f"template for decode rank {decode_rank} group {g} overlaps itself")
    if chunk is None:
        needed = sum(s.nbytes for s in d_group.segments)
    else:
        needed = sum(s.nbytes // d_group.kernel_block_size for s in d_group.segments) * chunk[2]
    if int(length.sum()) != needed:
        raise AssertionError(
            f"template for decode rank {decode_rank} group {g} moves {int(length.sum())} "
            f"bytes, needs {needed}"
        )


# --------------------------------------------------------------------------- compatibility


def check_compatible(prefill: EngineLayout, decode: EngineLayout) -> None:
    """Raise :class:`IncompatibleLayoutsError` unless decode can be filled from prefill."""
    if prefill.model and decode.model and prefill.model != decode.model:
        raise IncompatibleLayoutsError(
            "model", f"prefill serves {prefill.model!r}, decode {decode.model!r}"
        )
    p_tp, d_tp = prefill.tp_size, decode.tp_size
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        raise IncompatibleLayoutsError(
            "tp_size", f"prefill tp={p_tp} and decode tp={d_tp}: one must divide the other"
        )
    if len(prefill.groups) != len(decode.groups):
        raise IncompatibleLayoutsError(
            "groups",
            f"prefill has {len(prefill.groups)} KV-cache groups, decode {len(decode.groups)}",
        )
    if prefill.ranks[0].num_regions != decode.ranks[0].num_regions:
        raise IncompatibleLayoutsError(
            "num_regions",
            f"prefill {prefill.ranks[0].num_regions}, decode {decode.ranks[0].num_regions}",
        )
    for g, (pg, dg) in enumerate(zip(prefill.groups, decode.groups)):
        where = f"groups[{g}]"
        if pg.kind != dg.kind:
            raise IncompatibleLayoutsError(
                f"{where}.kind", f"prefill {pg.kind.value}, decode {dg.kind.value}"
            )
        if pg.layers != dg.layers:
            raise IncompatibleLayoutsError(
                f"{where}.layers", "prefill and decode list different layers"
            )
        p_tensors = {s.tensor: s for s in pg.segments}
        for ds in dg.segments:
            ps = p_tensors.get(ds.tensor)
            swhere = f"{where}.segments[{ds.tensor!r}]"
            if ps is None:
                raise IncompatibleLayoutsError(swhere, "prefill pages have no such tensor")
            _check_segment_pair(swhere, ps, ds)
        extra = set(p_tensors) - {s.tensor for s in dg.segments}
        if extra:
            raise IncompatibleLayoutsError(
                f"{where}.segments", f"decode pages lack {sorted(extra)}"
            )


def _check_segment_pair(where: str, ps: Segment, ds: Segment) -> None:
    if ps.dtype != ds.dtype:
        raise IncompatibleLayoutsError(f"{where}.dtype", f"prefill {ps.dtype}, decode {ds.dtype}")
    if (ps.shard_axis, ps.token_axis) != (ds.shard_axis, ds.token_axis):
        raise IncompatibleLayoutsError(
            f"{where}.shard_axis", "prefill and decode shard different axes"
        )
    p_shape, d_shape = list(ps.global_shape), list(ds.global_shape)
    if ds.token_axis is not None:
        p_shape[ds.token_axis] = d_shape[ds.token_axis] = 0
    if p_shape != d_shape:
        raise IncompatibleLayoutsError(
            f"{where}.shape",
            f"global shapes differ: prefill {ps.global_shape}, decode {ds.global_shape}",
        )
