"""Templates: the byte runs that fill one decode page from prefill pages, relative to the page
starts, built once per (decode rank, group, chunk shape) and stored in one table per pair.

A template is a resharding of declared segments: for every decode segment (and, for attention,
every piece of a chunk between kernel-block boundaries of both sides) the prefill ranks are
asked in order for the global indices still missing along the TP-sharded axis (interval
subtraction), and each overlap becomes runs contiguous on both sides (:func:`strided_runs`).
Runs that continue each other on both sides merge (:func:`coalesce`). Every template is checked
once: inside one page on both sides, no decode byte written twice, exactly the unpadded state.

:class:`TemplateTable` holds every template of a pair as the columns of one array (rows
:data:`SOURCE` .. :data:`LENGTH`), which a request expands with one gather;
:func:`coalesce_columns` and :func:`group_by_source` order and merge such a gather;
a :class:`RequestShape` holds the gather for requests of one shape.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from broker.errors import IncompatibleLayoutsError, LimitExceededError
from broker.layout import EngineLayout, GroupLayout, Segment

_I64 = np.int64
#: Rows of a template table: source (decode rank * prefill TP size + prefill rank), region,
#: coalescing key (source * regions per rank + region), decode offset, prefill offset, length.
SOURCE, REGION, KEY, LOCAL, REMOTE, LENGTH = range(6)
#: Tokens of an attention page pair one template copies: (prefill page token, decode page
#: token, tokens); a Mamba template's chunk is None (the whole block).
Chunk = tuple[int, int, int]
#: A template's key in its table: (decode rank, group, chunk).
TemplateKey = tuple[int, int, Chunk | None]


#: A plan's runs summed up: the lowest and highest region index, local offset, remote
#: offset and length (:func:`run_bounds`).
Bounds = tuple[int, int, int, int, int, int, int, int]


def run_bounds(
    region: np.ndarray, local_offset: np.ndarray, remote_offset: np.ndarray, length: np.ndarray
) -> Bounds:
    """The lowest and highest value of each of a plan's columns (at least one run)."""
    columns = (region, local_offset, remote_offset, length)
    reductions = (np.minimum.reduce, np.maximum.reduce)
    return tuple(int(f(c)) for c in columns for f in reductions)  # type: ignore[return-value]


@dataclass(frozen=True)
class Template:
    """Runs for one block pair (one chunk of tokens for attention), offsets relative to the
    page start on each side, coalesced; ``vllm_units`` counts vLLM's descriptors for it."""

    prefill_rank: np.ndarray
    remote_offset: np.ndarray
    local_offset: np.ndarray
    length: np.ndarray
    vllm_units: int


class TemplateTable:
    """Every template of a pair (all decode ranks), each repeated over its group's regions,
    stored as the columns of one ``(6, runs)`` array (rows :data:`SOURCE` .. :data:`LENGTH`)
    so that a request expands the block pairs of all its decode ranks with one gather.
    ``meta`` holds per template its first column, its number of columns, vLLM's descriptor
    count for it, and whether a run starts at both page starts and whether one ends at both
    page ends (only such runs can merge with a run of another block pair)."""

    def __init__(self) -> None:
        self.ids: dict[TemplateKey, int] = {}
        self.meta = np.zeros((5, 0), dtype=_I64)
        self.runs = np.zeros((6, 0), dtype=_I64)

    @property
    def nbytes(self) -> int:
        """Bytes its arrays and its id dict hold (the dict's keys aside)."""
        return self.runs.nbytes + self.meta.nbytes + sys.getsizeof(self.ids)

    def add(
        self,
        key: TemplateKey,
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


#: Positions in one group's block id list: a slice, or one index per slot.
Pick = slice | np.ndarray
#: A group and the positions of each slot's prefill and decode block id in its lists.
Picks = tuple[int, Pick, Pick]
#: A request's shape: decode ranks planned, tokens, list lengths per group on each side.
ShapeKey = tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class RequestShape:
    """What planning a request takes that depends only on its shape (:data:`ShapeKey`), not
    on its block ids: which list positions pair, the template-table columns of all planned
    ranks gathered (``base``, None when there are none) and which slot's block offsets each
    column adds (``column_slot``), what each rank's plan counts without its runs, and the
    sources its columns read (their :data:`SOURCE` values, ascending) with the bytes of each
    (which merging runs keeps)."""

    picks: tuple[Picks, ...]
    naive_bytes: int
    vllm_units: list[int]
    rank_ends: list[int]
    mergeable: list[bool] = field(default_factory=list)
    base: np.ndarray | None = None
    column_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=_I64))
    sources: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=_I64))
    source_bytes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        picks = [p for _, *sides in self.picks for p in sides if isinstance(p, np.ndarray)]
        arrays = (self.base, self.column_slot, self.sources, *picks)
        return sum(a.nbytes for a in arrays if a is not None)


def picked(ids: Sequence[int], pick: Pick) -> Sequence[int]:
    """The block ids at ``pick``'s positions of one group's list."""
    if isinstance(pick, slice):
        return ids[pick]
    return np.asarray(ids, dtype=_I64)[pick].tolist()


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


def group_by_source(runs: np.ndarray) -> np.ndarray:
    """Template-table columns ordered by source, keeping their order within one."""
    source = runs[SOURCE]
    if bool((source[1:] < source[:-1]).any()):
        return runs.take(source.argsort(kind="stable"), axis=1)
    return runs


def coalesce_columns(runs: np.ndarray, local_bits: int | None) -> np.ndarray:
    """:func:`coalesce` for the columns of a template-table gather: sorted by (key, decode
    offset), runs that continue each other on both sides merged. With ``local_bits`` (decode
    offsets are below ``2**local_bits`` and ``key << local_bits`` fits in int64) one argsort
    of ``position = key << local_bits | offset`` orders them: pairs are unique, as no two runs
    of a decode rank write the same byte; and a run continues the one before on the decode
    side when its position is that one's plus its length (a run ends within its region, so
    that sum keeps the key)."""
    if local_bits is None:
        runs = runs.take(np.lexsort((runs[LOCAL], runs[KEY])), axis=1)
        position, key_breaks = runs[LOCAL], runs[KEY, 1:] != runs[KEY, :-1]
    else:
        position = (runs[KEY] << local_bits) | runs[LOCAL]
        # Stable: a merge sort runs through the sorted stretches each block pair brings.
        order = position.argsort(kind="stable")
        runs, position, key_breaks = runs.take(order, axis=1), position.take(order), None
    n = runs.shape[1]
    if n < 2:
        return runs
    length = runs[LENGTH, :-1]
    breaks = np.empty(n, dtype=bool)
    breaks[0] = True
    np.not_equal(position[1:], position[:-1] + length, out=breaks[1:])
    breaks[1:] |= runs[REMOTE, 1:] != runs[REMOTE, :-1] + length
    if key_breaks is not None:
        breaks[1:] |= key_breaks
    starts = breaks.nonzero()[0]
    if starts.size == n:
        return runs
    merged = runs.take(starts, axis=1)
    merged[LENGTH] = np.add.reduceat(runs[LENGTH], starts)
    return merged


def build_template(
    prefill: EngineLayout,
    decode: EngineLayout,
    decode_rank: int,
    g: int,
    chunk: Chunk | None,
    sources: Sequence[int],
    max_runs: int,
    merge: bool,
) -> Template:
    """``decode_rank``'s template for group ``g`` and ``chunk`` (``(prefill page token, decode
    page token, tokens)``; ``None`` for a Mamba block), asking the prefill ranks in ``sources``
    order. Raises :class:`LimitExceededError` past ``max_runs`` runs over the group's regions,
    :class:`IncompatibleLayoutsError` if no prefill rank holds some needed indices; with
    ``merge`` false the runs keep vLLM's granularity (one per segment per kernel block; of a
    block row, which vLLM reads whole, one per layer page)."""
    d_group = decode.ranks[decode_rank].groups[g]
    p_groups = [rank.groups[g] for rank in prefill.ranks]
    pieces = _kernel_pieces(p_groups[0], d_group, chunk)
    ranks_out, d_out, p_out, len_out = [], [], [], []
    # vLLM's descriptors: per source, one per attention kernel block (all its segments: a
    # block-outermost row is read whole), one per Mamba segment.
    vllm_reads: set[tuple[int, ...]] = set()
    budget = max_runs // len(d_group.layers)  # the table repeats it per layer
    for s, d_seg in enumerate(d_group.segments):
        for i, (p_kb, p_tok, d_kb, d_tok, tokens) in enumerate(pieces):
            missing = [d_seg.shard_interval]
            for p in sources:
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
                            f"{max_runs} runs over its {len(d_group.layers)} regions",
                        ) from None
                    budget -= d_off.size
                    ranks_out.append(np.full(d_off.size, p, dtype=_I64))
                    d_out.append(d_off)
                    p_out.append(p_off)
                    len_out.append(np.full(d_off.size, run, dtype=_I64))
                    missing = _subtract(missing, lo, hi)
                if overlaps:
                    vllm_reads.add((i, p) if d_group.is_attention else (s, i, p))
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
    if merge:
        p_rank, d_off, p_off, length = coalesce(*columns)
    else:
        p_rank, d_off, p_off, length = columns
    _check_template(
        d_group,
        chunk,
        d_off,
        p_off,
        length,
        decode.ranks[decode_rank].page_bytes,
        prefill.ranks[0].page_bytes,
        decode_rank,
        g,
    )
    return Template(p_rank, p_off, d_off, length, len(vllm_reads))


def _kernel_pieces(
    p_group: GroupLayout, d_group: GroupLayout, chunk: Chunk | None
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
        axis, per = d_seg.token_axis, d_seg.tokens_per_entry
        # Chunks start and end on kernel-block boundaries of both sides or on whole
        # entries, so a compressed segment's entries are never split.
        extent[axis], d_start[axis], p_start[axis] = tokens // per, d_tok // per, p_tok // per
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
    chunk: Chunk | None,
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
        needed = sum(s.nbytes * chunk[2] // d_group.kernel_block_size for s in d_group.segments)
    if int(length.sum()) != needed:
        raise AssertionError(
            f"template for decode rank {decode_rank} group {g} moves {int(length.sum())} "
            f"bytes, needs {needed}"
        )
