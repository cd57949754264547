"""The layout of a block-outermost vLLM 0.33 KV cache (``BLHNC``/``BHLNC``), as vLLM packs
DeepSeek-V4's MLA caches.

There one allocation holds ``num_blocks`` rows of one block stride; block id *b* is row *b*,
which holds one page of every layer of the group the block was allocated to, each layer's
page at its own offset in the row (``[blocks, 1, entries, width]`` views striding whole rows).
It is declared as one region whose pages are the rows: a group's segments are its layers'
pages, padding (vLLM's page alignment, the row's unused tail) in none of them. Every rank
holds the whole of each page (MLA's latent is not split over TP, nor are DeepSeek-V4's
compressor state and indexer keys), so every segment is replicated. A compressed cache (one
state per ``tokens_per_state`` tokens) declares entries of that many tokens.

The plain-row cache (bfloat16, or fp8 with one per-tensor scale) declares a page per entry.
The packed ``fp8_ds_mla`` format (``state_content_bytes`` per entry: FlashMLA's and vLLM's
CPU backend's latent, its values for every entry before the block's scales) does not keep an
entry's bytes together: its page is declared as one entry of the whole block, which moves
whole. ``nvfp4_ds_mla`` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)

from broker.errors import LayoutError
from broker.layout import GroupKind, GroupLayout, RankLayout, Segment
from broker.row_models import packed_page_segment
from clients.transport import DRAM, VRAM, Region


def packs_rows(kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor]) -> bool:
    """Whether the cache is block-outermost: two layers of one group start within one block
    stride of each other (layer-outermost caches keep each layer in a region of its own)."""
    for group in kv_cache_config.transfer_groups:
        views = [kv_caches[n] for n in group.layer_names if n in kv_caches]
        if len(views) > 1:
            starts = sorted(v.data_ptr() for v in views)
            row = views[0].stride(0) * views[0].element_size()
            if starts[-1] - starts[0] < row:
                return True
    return False


def derive_row_memory(
    kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor], tp_rank: int
) -> tuple[RankLayout, tuple[Region, ...]]:
    """Rank ``tp_rank``'s layout (one region of rows) and that region, from the transfer groups
    of ``kv_cache_config`` and the cache views ``kv_caches``. Raises :class:`LayoutError`
    naming what cannot be declared."""
    num_blocks = kv_cache_config.num_blocks
    first = next(iter(kv_caches.values()))
    storage = first.untyped_storage()
    base, row = storage.data_ptr(), first.stride(0) * first.element_size()
    groups = []
    for g, group in enumerate(kv_cache_config.transfer_groups):
        where = f"kv_cache_groups[{g}]"
        segments = []
        windows: set[int] = set()
        block_sizes: set[int] = set()
        for i, name in enumerate(group.layer_names):
            lwhere = f"{where}.layer_names[{i}]"
            view = kv_caches.get(name)
            if view is None:
                raise LayoutError(lwhere, f"no KV cache tensor for {name!r}")
            spec = _row_spec(_member_spec(group.kv_cache_spec, name), f"{where}.kv_cache_spec")
            if (
                view.untyped_storage().data_ptr() != base
                or view.stride(0) * view.element_size() != row
            ):
                raise LayoutError(lwhere, f"{name!r} is not a page of the shared block rows")
            segments.append(_page_segment(name, spec, view, base, num_blocks, lwhere))
            block_sizes.add(spec.block_size)
            windows.add(spec.sliding_window if isinstance(spec, SlidingWindowMLASpec) else 0)
        if len(block_sizes) != 1 or len(windows) != 1:
            raise LayoutError(
                f"{where}.kv_cache_spec", "layers of the group differ in block size or window"
            )
        (block_size,), (window,) = block_sizes, windows
        groups.append(
            GroupLayout(
                GroupKind.ATTENTION,
                (f"rows.{g}",),
                tuple(segments),
                block_size,
                block_size,
                row,
                window,
            )
        )
    if num_blocks * row > storage.nbytes():
        raise LayoutError(
            "kv_caches", f"{num_blocks} rows of {row} bytes do not fit the KV cache allocation"
        )
    kind, device = (DRAM, 0) if first.device.type == "cpu" else (VRAM, max(first.get_device(), 0))
    layout = RankLayout(tp_rank, 1, num_blocks, row, tuple(groups))
    return layout, (Region(base, num_blocks * row, device, kind),)


#: The packed cache format whose pages are declared whole.
PACKED = "fp8_ds_mla"


def _member_spec(spec: KVCacheSpec, layer: str) -> KVCacheSpec:
    """``layer``'s own spec in a group (a ``UniformTypeKVCacheSpecs`` keeps one per layer)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer]
    return spec


def _row_spec(spec: KVCacheSpec, where: str) -> MLAAttentionSpec | SlidingWindowMLASpec:
    """``spec`` if its page is a plain row of one replicated latent (or state) per entry."""
    if not isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        raise LayoutError(
            where,
            f"{type(spec).__name__} in a block-outermost KV cache is not supported; "
            "MLA and sliding-window MLA pages are",
        )
    if spec.num_head_slots or (spec.state_content_bytes and spec.cache_dtype_str != PACKED):
        raise LayoutError(
            f"{where}.state_content_bytes",
            f"{type(spec).__name__} in the packed {spec.cache_dtype_str!r} format "
            f"({spec.state_content_bytes} bytes per token) is not supported; "
            f"the plain bfloat16 or per-tensor fp8 cache and the packed {PACKED!r} one are",
        )
    if isinstance(spec, SlidingWindowMLASpec) and (
        spec.extra_retained_tokens or spec.bounded_replay
    ):
        raise LayoutError(
            f"{where}.bounded_replay",
            "sliding-window MLA with bounded replay or retained tokens is not supported",
        )
    return spec


def _page_segment(
    name: str,
    spec: MLAAttentionSpec | SlidingWindowMLASpec,
    view: torch.Tensor,
    base: int,
    num_blocks: int,
    where: str,
) -> Segment:
    """The layer's page in a row: ``[entries, width]`` of one entry per ``tokens_per_state``
    tokens, as the view strides it; a packed page as one entry of the whole block."""
    per = int(spec.tokens_per_state)
    if per != spec.tokens_per_state:
        raise LayoutError(where, f"{spec.tokens_per_state} tokens per state is not whole")
    width = spec.state_content_bytes or spec.head_size
    if (
        view.dim() != 4
        or view.shape[0] != num_blocks
        or view.shape[1] != 1
        or view.shape[2] * per != spec.block_size
        or view.shape[3] != width
    ):
        raise LayoutError(
            where,
            f"cache view {tuple(view.shape)} is not {num_blocks} pages of "
            f"{spec.block_size} tokens / {per} per entry x {width}",
        )
    item = view.element_size()
    if spec.state_content_bytes:
        if not view[0].is_contiguous() or item != 1:
            raise LayoutError(
                where, f"packed cache view {tuple(view.shape)} is not one contiguous page of bytes"
            )
        content = view[0].numel()
        return packed_page_segment(name, view.data_ptr() - base, content, spec.block_size)
    return Segment(
        name,
        view.data_ptr() - base,
        (view.shape[2], view.shape[3]),
        (view.stride(2) * item, view.stride(3) * item),
        str(view.dtype).removeprefix("torch."),
        token_axis=0,
        tokens_per_entry=per,
    )
