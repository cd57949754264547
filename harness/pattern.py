"""Recognisable KV-cache contents for end-to-end checks, derived from layout declarations alone.

Every byte of state holds a pseudo-random function of *what* it is: the global tensor, the
global element (for attention the global token), the byte within the element, the layer, a
per-request salt and, for Mamba state, the snapshot (the position of its block in prefill's
list: the last block holds the state after the request's last token, earlier ones older
states). Prefill writes these values through its own declared segments; decode computes what
each of its bytes must be through *its* declaration and compares, never looking at a plan. A
byte read from the wrong rank, head, token, layer, block, snapshot or request differs (with
probability 255/256 per byte). Replicated heads hold equal values on every rank, as in a real
cache. Bytes holding no state get junk that depends on rank, region, offset and salt on prefill,
and :data:`POISON` on decode, where nothing may write them.

Pure numpy; one :class:`Contents` per process caches the global tensors of a model.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from broker.layout import EngineLayout, GroupLayout, RankLayout, Segment

#: What decode memory holds wherever no transfer may write.
POISON = 0xA5
#: Global token positions are below this (it fixes the element numbering, not memory use).
TOKEN_BOUND = 1 << 24
_MIX1, _MIX2, _GOLDEN = (
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
    np.uint64(0x9E3779B97F4A7C15),
)
BlockIds = Sequence[Sequence[int]]


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose top byte looks random."""
    x = (x + _GOLDEN) * _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(56)).astype(np.uint8)


def _segment_view(buffer: np.ndarray, base: int, seg: Segment) -> np.ndarray:
    """``seg`` of the page (or kernel block) starting at byte ``base`` of ``buffer``, as an
    array of shape ``seg.shape + (itemsize,)``."""
    if base + seg.end > buffer.size:
        raise ValueError(f"segment {seg.tensor!r} ends past the buffer")
    return as_strided(
        buffer[base + seg.offset :], shape=seg.shape + (seg.itemsize,), strides=seg.strides + (1,)
    )


class Contents:
    """The global tensors of ``layout``'s model (every shard, tokens up to a growing bound)
    and the code of each layer; one instance serves every rank of a process."""

    def __init__(self, layout: EngineLayout) -> None:
        layers = sorted({layer for g in layout.groups for layer in g.layers})
        self._codes = {layer: 1 + i % 255 for i, layer in enumerate(layers)}
        self._tensors: dict[tuple[str, int], np.ndarray] = {}
        self._ramps: dict[int, np.ndarray] = {}

    def _tensor(self, seg: Segment, tokens: int, snapshot: int = 0) -> np.ndarray:
        """Global bytes of ``seg.tensor`` (of Mamba snapshot ``snapshot``), shape
        ``global_shape + (itemsize,)`` with at least ``tokens`` entries on the token axis.
        Values do not depend on that length."""
        cached = self._tensors.get((seg.tensor, snapshot))
        if cached is not None and (
            seg.token_axis is None or cached.shape[seg.token_axis] >= tokens
        ):
            return cached
        shape = list(seg.global_shape) + [seg.itemsize]
        extents = list(shape)
        if seg.token_axis is not None:
            shape[seg.token_axis] = max(
                tokens, 2 * (cached.shape[seg.token_axis] if cached is not None else 0)
            )
            extents[seg.token_axis] = TOKEN_BOUND
        flat = np.zeros((), dtype=np.uint64)
        for size, extent in zip(shape, extents):
            flat = flat[..., None] * np.uint64(extent) + np.arange(size, dtype=np.uint64)
        flat ^= (np.uint64(zlib.crc32(seg.tensor.encode())) << np.uint64(40)) ^ (
            np.uint64(snapshot) << np.uint64(32)
        )
        self._tensors[seg.tensor, snapshot] = tensor = _mix(flat)
        return tensor

    def write_state(
        self,
        page: np.ndarray,
        group: GroupLayout,
        layer: str,
        page_index: int,
        salt: int,
        token_limit: int | None = None,
    ) -> int:
        """Write ``layer``'s state of the request's page ``page_index`` (attention: the page
        holding tokens ``page_index * block_size ..``; Mamba: snapshot ``page_index``) into
        ``page`` (``page_bytes`` uint8). Attention writes tokens below ``token_limit`` (all
        of the page when ``None``). Returns the bytes written."""
        code = np.uint8(self._codes[layer] ^ salt)
        snapshot = 0 if group.is_attention else page_index
        written = 0
        for kb in range(group.kernel_blocks_per_page):
            first = page_index * group.block_size + kb * group.kernel_block_size
            count = group.kernel_block_size
            if group.is_attention and token_limit is not None:
                count = min(count, token_limit - first)
                if count <= 0:
                    break
            for seg in group.segments:
                view = _segment_view(page, kb * group.kernel_block_bytes, seg)
                box: list[slice] = [slice(None)] * len(seg.shape)
                if seg.shard_axis is not None:
                    box[seg.shard_axis] = slice(
                        seg.shard_start, seg.shard_start + seg.shape[seg.shard_axis]
                    )
                if seg.token_axis is not None:
                    box[seg.token_axis] = slice(first, first + count)
                    local: list[slice] = [slice(None)] * len(seg.shape)
                    local[seg.token_axis] = slice(0, count)
                    view = view[tuple(local)]
                view[...] = self._tensor(seg, first + count, snapshot)[tuple(box)] ^ code
                written += view.size
        return written

    def junk(self, page_bytes: int, rank: int, region: int, block: int, salt: int) -> np.ndarray:
        """Bytes for a prefill page's non-state areas: vary with offset, rank, region, block
        and salt; never shipped."""
        ramp = self._ramps.get(page_bytes)
        if ramp is None:
            ramp = self._ramps[page_bytes] = (
                np.arange(page_bytes, dtype=np.uint32) * 131 % 251
            ).astype(np.uint8)
        return ramp ^ np.uint8((rank * 61 + region * 31 + block * 7 + salt * 13) % 256)


def decode_token_limit(
    prefill_group: GroupLayout, decode_group: GroupLayout, num_tokens: int, prefill_pages: int
) -> int:
    """Tokens of an attention group that reach decode: whole decode kernel blocks holding a
    token below ``num_tokens``, as far as prefill's ``prefill_pages`` pages reach."""
    kbs = decode_group.kernel_block_size
    return min(-(-num_tokens // kbs) * kbs, prefill_pages * prefill_group.block_size)


def decode_limits(
    prefill: EngineLayout, decode: EngineLayout, num_tokens: int, prefill_pages: Sequence[int]
) -> list[int]:
    """What reaches decode per group, for :func:`check_decode`: an attention group's tokens
    (:func:`decode_token_limit`), a Mamba group's count of prefill state blocks (decode's
    list pairs with their tail)."""
    return [
        decode_token_limit(pg, dg, num_tokens, pages) if dg.is_attention else pages
        for pg, dg, pages in zip(prefill.groups, decode.groups, prefill_pages)
    ]


def host_memory(layout: EngineLayout, fill: int = 0) -> dict[int, list[np.ndarray]]:
    """Every rank's regions of ``layout`` as DRAM arrays of ``fill`` bytes, by tp rank
    (prefill: 0; decode: :data:`POISON`, so bytes nobody wrote show)."""
    return {
        r.tp_rank: [np.full(r.region_bytes, fill, np.uint8) for _ in range(r.num_regions)]
        for r in layout.ranks
    }


def _pages(rank: RankLayout, regions: Sequence[np.ndarray], block: int) -> list[np.ndarray]:
    return [region[block * rank.page_bytes : (block + 1) * rank.page_bytes] for region in regions]


def scrub_pages(rank: RankLayout, regions: Sequence[np.ndarray], block_ids: BlockIds) -> None:
    """Overwrite a request's pages on one rank with :data:`POISON`, as a freed block's next
    owner would: a reader still copying them afterwards finds mismatches, not the data."""
    for ids in block_ids:
        for block in ids:
            for page in _pages(rank, regions, block):
                page.fill(POISON)


def fill_prefill(
    contents: Contents,
    rank: RankLayout,
    regions: Sequence[np.ndarray],
    block_ids: BlockIds,
    salt: int,
) -> None:
    """Write a request's pages on one prefill rank: junk everywhere, then every group's state
    of each layer in its region (attention: whole pages; Mamba: snapshot *i* in the group's
    *i*-th block, the newest in the last)."""
    for group, ids in zip(rank.groups, block_ids):
        for page_index, block in enumerate(ids):
            for r, page in enumerate(_pages(rank, regions, block)):
                page[:] = contents.junk(rank.page_bytes, rank.tp_rank, r, block, salt)
                if r < len(group.layers):
                    contents.write_state(page, group, group.layers[r], page_index, salt)


def check_decode(
    contents: Contents,
    rank: RankLayout,
    regions: Sequence[np.ndarray],
    block_ids: BlockIds,
    salt: int,
    limits: Sequence[int],
    rest: bool = True,
) -> tuple[int, int]:
    """Compare every byte of one decode rank's ``regions`` with what the request must have
    left there: each group's state in its pages, POISON everywhere else (``rest`` False: its
    pages only, when other requests' pages still hold theirs). ``limits`` per group
    (:func:`decode_limits`): attention pages hold tokens below the limit; a Mamba group's *n*
    blocks hold the newest *n* of the limit's prefill snapshots, oldest first, and blocks past
    the limit nothing. Restores POISON in the request's pages. Returns ``(mismatched bytes,
    state bytes expected)``."""
    mismatches = expected_state = 0
    for group, ids, limit in zip(rank.groups, block_ids, limits):
        # Mamba: decode block j holds prefill snapshot first + j, for j < received.
        received = len(ids) if group.is_attention else min(len(ids), limit)
        first = 0 if group.is_attention else limit - received
        for page_index, block in enumerate(ids):
            for r, page in enumerate(_pages(rank, regions, block)):
                expected = np.full(rank.page_bytes, POISON, dtype=np.uint8)
                if r < len(group.layers) and page_index < received:
                    expected_state += contents.write_state(
                        expected,
                        group,
                        group.layers[r],
                        first + page_index,
                        salt,
                        limit if group.is_attention else None,
                    )
                mismatches += int(np.count_nonzero(page != expected))
                page[:] = POISON
    if rest:
        mismatches += strays(regions)
    return mismatches, expected_state


def strays(regions: Sequence[np.ndarray]) -> int:
    """Bytes of ``regions`` that are not :data:`POISON`."""
    return sum(int(np.count_nonzero(region != POISON)) for region in regions)
