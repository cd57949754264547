"""Models whose KV caches vLLM 0.33 packs block-outermost (DeepSeek-V4): the cache layers they
declare, how vLLM groups them and where each layer's page lies in a block's row.

Such a model keeps several caches per attention layer, of different block and page sizes
(:class:`RowCache`). vLLM buckets the caches by type (block size and sliding window, buckets
in the order the model registers their first cache) and splits the buckets whose page sizes
repeat in a pattern into groups of an equal number of repeats, the number picked to pad
least (``_get_packed_kv_cache_groups`` in ``vllm/v1/core/kv_cache_planning.py``). It then
allocates ``num_blocks`` rows as wide as the widest group's pages: block *b* of every group
is row *b*, holding one page of each of the group's layers, layers of one spec side by side
(specs in the order they first appear), each page padded to its alignment
(``get_kv_cache_config_from_groups``). Every TP rank holds every page whole, so every
segment is replicated; the padding and the row's unused tail lie in no segment.

A page is a plain array of entries, or (``packed``) a record of the whole block in a format
that does not keep an entry's bytes together (vLLM's ``fp8_ds_mla`` latent: every entry's
fp8 NoPE and bfloat16 RoPE values, then every entry's scales). Such a page is declared as one
entry of the whole block, so it moves whole, as vLLM's connector moves it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from broker.errors import LayoutError
from broker.layout import (
    GroupKind,
    GroupLayout,
    RankLayout,
    Segment,
    contiguous_strides,
    dtype_bytes,
)

#: Tokens per block of the caches that follow the engine's block size, unless one is given:
#: the block size vLLM's DeepSeek-V4 attention backends work in.
DEFAULT_ROW_BLOCK_SIZE = 256


@dataclass(frozen=True)
class RowCache:
    """One cache layer: blocks of ``block_size`` tokens (0: the engine's block size), one
    entry of ``width`` elements of ``dtype`` per ``tokens_per_entry`` tokens, the page padded
    to ``alignment`` bytes, the last ``sliding_window`` tokens kept (0: all). ``latent``: it
    holds the attention latent, which is stored in the KV-cache dtype. ``packed``: the page
    is one record of the block, not addressable by entry."""

    name: str
    block_size: int
    tokens_per_entry: int
    width: int
    dtype: str
    sliding_window: int = 0
    latent: bool = False
    alignment: int = 512
    packed: bool = False

    @property
    def entries(self) -> int:
        """Entries per block (the block size must be resolved and a multiple of
        ``tokens_per_entry``)."""
        if not self.block_size or self.block_size % self.tokens_per_entry:
            raise LayoutError(
                "block_size",
                f"{self.name}: a {self.block_size}-token block does not hold whole entries "
                f"of {self.tokens_per_entry} tokens",
            )
        return self.block_size // self.tokens_per_entry

    @property
    def content_bytes(self) -> int:
        return self.entries * self.width * dtype_bytes(self.dtype, f"{self.name}.dtype")

    @property
    def page_bytes(self) -> int:
        """The page with its alignment padding: what the layer takes in a row."""
        return -(-self.content_bytes // self.alignment) * self.alignment

    @property
    def spec(self) -> tuple[object, ...]:
        """What vLLM's spec of the layer holds (layers of equal specs lie side by side)."""
        return (
            self.block_size,
            self.tokens_per_entry,
            self.width,
            self.dtype,
            self.sliding_window,
            self.latent,
            self.alignment,
            self.packed,
        )


def with_block_size(caches: Iterable[RowCache], block_size: int) -> tuple[RowCache, ...]:
    """``caches`` with those that follow the engine's block size in ``block_size`` blocks."""
    return tuple(replace(c, block_size=c.block_size or block_size) for c in caches)


#: vLLM's packed ``fp8_ds_mla`` latent (FlashMLA, vLLM's CPU backend): per entry 448 fp8 NoPE
#: values and 64 bfloat16 RoPE values, then 8 scale bytes in an area after the block's values.
PACKED_LATENT_BYTES = 584
#: The alignment of every DeepSeek-V4 page (latent or not) under ``fp8_ds_mla``.
PACKED_PAGE_ALIGNMENT = 576


def with_row_kv_dtype(caches: Iterable[RowCache], kv_dtype: str) -> tuple[RowCache, ...]:
    """``caches`` as vLLM stores them for ``--kv-cache-dtype kv_dtype``
    (``_resolve_dsv4_kv_cache_dtype``): latents as bfloat16 or per-tensor e4m3 plain rows
    (any other fp8 format), or as packed ``fp8_ds_mla`` pages, which pads every page to 576
    bytes."""
    if kv_dtype == "fp8_ds_mla":
        return tuple(_packed(replace(c, alignment=PACKED_PAGE_ALIGNMENT)) for c in caches)
    if kv_dtype in ("auto", "bfloat16"):
        dtype = "bfloat16"
    elif kv_dtype.startswith("fp8") and not kv_dtype.endswith("_ds_mla"):
        dtype = "float8_e4m3fn"
    else:
        raise LayoutError(
            "kv_dtype",
            f"{kv_dtype!r}: block-outermost MLA caches are bfloat16 or fp8 (e4m3) plain rows "
            "or packed fp8_ds_mla pages",
        )
    return tuple(replace(c, dtype=dtype) if c.latent else c for c in caches)


def _packed(cache: RowCache) -> RowCache:
    if not cache.latent:
        return cache
    return replace(cache, width=PACKED_LATENT_BYTES, dtype="uint8", packed=True)


def row_groups(caches: Sequence[RowCache]) -> list[list[RowCache]]:
    """vLLM's KV-cache groups of ``caches`` (block sizes resolved), in registration order."""
    buckets: dict[tuple[int, int], list[RowCache]] = {}
    for cache in caches:
        buckets.setdefault((cache.block_size, cache.sliding_window), []).append(cache)
    if len({cache.page_bytes for cache in caches}) < 2:
        raise LayoutError(
            "layers", "vLLM packs caches in block rows only where their page sizes differ"
        )
    patterns = [_by_page(bucket) for bucket in buckets.values()]
    balanced = [len({len(v) for v in p.values()}) == 1 for p in patterns]
    repeats = [max(len(v) for v in p.values()) for p in patterns]
    # Buckets repeating a pattern of several page sizes stay whole: the largest one sets the
    # least number of repeats a group holds.
    floor = max((r for r, b, p in zip(repeats, balanced, patterns) if b and len(p) > 1), default=0)
    per_group = _least_padding([r for r, b in zip(repeats, balanced) if b], floor) if floor else 0
    counts = [-(-r // per_group) if per_group and b else 1 for r, b in zip(repeats, balanced)]
    # Without such a pattern, sliding-window buckets hold states, which split down to what a
    # row already holds.
    states = [not per_group and window > 0 for _, window in buckets]
    anchor = max(
        sum(-(-len(v) // (len(bucket) if state else n)) * page for page, v in p.items())
        for bucket, p, state, n in zip(buckets.values(), patterns, states, counts)
    )
    groups: list[list[RowCache]] = []
    for bucket, pattern, state, n in zip(buckets.values(), patterns, states, counts):
        if state:
            n = max(n, -(-len(bucket) // max(anchor // bucket[0].page_bytes, 1)))
        if n == 1:
            groups.append(bucket)
            continue
        pattern_repeats = list(zip(*pattern.values()))
        groups.extend([c for r in pattern_repeats[i::n] for c in r] for i in range(n))
    return groups


def _by_page(bucket: list[RowCache]) -> dict[int, list[RowCache]]:
    out: dict[int, list[RowCache]] = {}
    for cache in bucket:
        out.setdefault(cache.page_bytes, []).append(cache)
    return out


def _least_padding(values: list[int], lower_bound: int) -> int:
    """The divisor ``d >= lower_bound`` that pads ``values`` up to multiples of ``d`` least,
    the larger on ties (vLLM's ``_approximate_gcd``)."""
    best, best_pad = lower_bound, None
    for d in range(lower_bound, max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def build_row_rank_layout(
    caches: Sequence[RowCache], tp_rank: int, num_blocks: int, block_size: int
) -> RankLayout:
    """Rank ``tp_rank``'s layout: one region of ``num_blocks`` rows; per group, each layer's
    page as a replicated segment at its offset in the row."""
    groups = row_groups(with_block_size(caches, block_size))
    row = max(sum(c.page_bytes for c in members) for members in groups)
    layouts = []
    for g, members in enumerate(groups):
        by_spec: dict[tuple[object, ...], list[RowCache]] = {}
        for cache in members:
            by_spec.setdefault(cache.spec, []).append(cache)
        offsets, offset = {}, 0
        for same in by_spec.values():
            for cache in same:
                offsets[cache.name] = offset
                offset += cache.page_bytes
        first = members[0]
        layouts.append(
            GroupLayout(
                GroupKind.ATTENTION,
                (f"rows.{g}",),
                tuple(_segment(c, offsets[c.name]) for c in members),
                first.block_size,
                first.block_size,
                row,
                first.sliding_window,
            )
        )
    return RankLayout(tp_rank, 1, num_blocks, row, tuple(layouts))


def _segment(cache: RowCache, offset: int) -> Segment:
    """The layer's page: ``[entries, width]``, one entry per ``tokens_per_entry`` tokens; a
    packed page ``[1, content bytes]``, one entry of the whole block."""
    if cache.packed:
        return packed_page_segment(cache.name, offset, cache.content_bytes, cache.block_size)
    shape = (cache.entries, cache.width)
    return Segment(
        cache.name,
        offset,
        shape,
        contiguous_strides(shape, dtype_bytes(cache.dtype, f"{cache.name}.dtype")),
        cache.dtype,
        token_axis=0,
        tokens_per_entry=cache.tokens_per_entry,
    )


def packed_page_segment(name: str, offset: int, content_bytes: int, block_size: int) -> Segment:
    """A packed page at ``offset`` in the row: its ``content_bytes`` as one entry of all
    ``block_size`` tokens of the block."""
    return Segment(
        name,
        offset,
        (1, content_bytes),
        (content_bytes, 1),
        "uint8",
        token_axis=0,
        tokens_per_entry=block_size,
    )
