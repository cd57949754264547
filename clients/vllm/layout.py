"""The page layout a vLLM 0.33 worker declares, derived from what vLLM allocated.

Inputs are vLLM's own objects: the :class:`~vllm.v1.kv_cache_interface.KVCacheConfig` (groups,
their :class:`FullAttentionSpec` / dense :class:`MLAAttentionSpec` / :class:`MambaSpec`, block
count) and the per-layer cache
views vLLM hands a connector's ``register_kv_caches`` (``[blocks * R, heads, kbs, K|V]`` in the
cache dtype for attention, ``[blocks, 1, 1, state bytes]`` int8 for Mamba). What the specs do
not say is read from the views: region base addresses (HMA aliasing: layer *i* of every group
must start at the same address), page and kernel-block strides, the kernel block size, the
element strides of the attention block. Model facts neither carries are parameters: the
global KV head count and, for Mamba2, the global ``n_groups`` (which tells sharded B/C groups
from replicated ones).

Conv state must be in vLLM's ``DS`` layout ``(dim, rows)`` (``VLLM_SSM_CONV_STATE_LAYOUT=DS``),
where each sub-projection (Mamba1 ``x``; Mamba2 ``x|B|C``; GDN ``Q|K|V``) is a contiguous run
of rows, as the planner needs to reshard it between TP sizes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from broker.errors import LayoutError
from broker.layout import GroupKind, GroupLayout, RankLayout, Segment, contiguous_strides
from broker.models import split_evenly, split_or_replicate
from clients.transport import DRAM, VRAM, Region
from clients.vllm.row_layout import derive_row_memory, packs_rows

#: KV-cache quantisations whose page is one dense ``[heads, kbs, K|V]`` array (no scales).
_DENSE_QUANT = (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR)


#: ``--kv-cache-dtype`` values vLLM stores as ``uint8``, by the fp8 format they hold (``fp8``
#: is e4m3): the cache tensors cannot tell them apart, the layout must.
_FP8_FORMATS = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@dataclass(frozen=True)
class ModelFacts:
    """What neither the specs nor the tensors say: the global KV head count, for Mamba2
    the global ``n_groups`` (0: treat B/C as evenly sharded), and the KV cache dtype setting
    (``CacheConfig.cache_dtype``: which fp8 format a byte cache holds)."""

    total_kv_heads: int
    mamba2_groups: int = 0
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class RankMemory:
    """One rank's declaration and the regions (one per layout region) to register."""

    layout: RankLayout
    regions: tuple[Region, ...]


def derive_rank_memory(
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    tp_size: int,
    tp_rank: int,
    facts: ModelFacts,
    conv_layout: str = "DS",
) -> RankMemory:
    """The layout of rank ``tp_rank`` of ``tp_size`` and its regions, from the transfer
    groups of ``kv_cache_config`` and the cache views ``kv_caches`` (layer name -> view).
    ``conv_layout`` is vLLM's conv state layout (``get_conv_state_layout()``). Raises
    :class:`LayoutError` naming what cannot be declared. A block-outermost cache (DeepSeek-V4)
    is declared by :mod:`clients.vllm.row_layout`."""
    if packs_rows(kv_cache_config, kv_caches):
        return RankMemory(*derive_row_memory(kv_cache_config, kv_caches, tp_rank))
    num_blocks = kv_cache_config.num_blocks
    groups: list[GroupLayout] = []
    region_bases: dict[int, int] = {}
    pages: set[int] = set()
    devices: set[tuple[str, int]] = set()
    for g, group in enumerate(kv_cache_config.transfer_groups):
        where = f"kv_cache_groups[{g}]"
        spec = _layer_spec(group.kv_cache_spec, where)
        views = []
        for i, name in enumerate(group.layer_names):
            view = kv_caches.get(name)
            if view is None:
                raise LayoutError(f"{where}.layer_names[{i}]", f"no KV cache tensor for {name!r}")
            base = region_bases.setdefault(i, view.data_ptr())
            if view.data_ptr() != base:
                raise LayoutError(
                    f"{where}.layer_names[{i}]",
                    f"{name!r} does not share region {i} with the other groups' "
                    f"layer {i} (the hybrid allocator's aliasing is required)",
                )
            devices.add((view.device.type, view.get_device()))
            views.append(view)
        if isinstance(spec, MambaSpec):
            if conv_layout != "DS":
                raise LayoutError(
                    "conv_layout",
                    f"Mamba conv state in {conv_layout!r} layout; "
                    "set VLLM_SSM_CONV_STATE_LAYOUT=DS",
                )
            groups.append(_mamba_group(spec, group.layer_names, tp_size, tp_rank, facts, where))
            pages.add(_block_stride(views, num_blocks, where))
        else:
            kernel_blocks = views[0].shape[0] // num_blocks
            group_layout = _attention_group(
                spec, views[0], group.layer_names, tp_size, tp_rank, facts, kernel_blocks, where
            )
            groups.append(group_layout)
            pages.add(_block_stride(views, num_blocks * kernel_blocks, where) * kernel_blocks)
    if len(pages) != 1:
        raise LayoutError(
            "kv_cache_groups",
            f"groups disagree on the page stride: {sorted(pages)} "
            "bytes (the hybrid allocator makes them equal)",
        )
    if len(devices) != 1:
        raise LayoutError("kv_caches", f"KV caches on several devices: {sorted(devices)}")
    (page_bytes,), ((device_type, device_index),) = pages, devices
    kind = DRAM if device_type == "cpu" else VRAM
    regions = tuple(
        Region(region_bases[i], num_blocks * page_bytes, max(device_index, 0), kind)
        for i in range(len(region_bases))
    )
    storage = next(iter(kv_caches.values())).untyped_storage()
    if any(
        r.base_addr < storage.data_ptr()
        or r.base_addr + r.length_bytes > storage.data_ptr() + storage.nbytes()
        for r in regions
    ):
        raise LayoutError(
            "kv_caches",
            f"{len(regions)} regions of {num_blocks} pages of "
            f"{page_bytes} bytes do not fit the KV cache allocation",
        )
    layout = RankLayout(tp_rank, len(regions), num_blocks, page_bytes, tuple(groups))
    return RankMemory(layout, regions)


def model_fingerprint(name: str, layout: RankLayout) -> str:
    """``name`` plus a digest of the TP-independent state shapes (global tensor shapes, dtypes,
    groups): engines of one model agree on it at any TP size, kernel block size or padding."""
    summary = [
        (
            g.kind.value,
            g.layers,
            tuple(
                (
                    s.tensor,
                    s.dtype,
                    tuple(0 if a == s.token_axis else n for a, n in enumerate(s.global_shape)),
                )
                for s in g.segments
            ),
        )
        for g in layout.groups
    ]
    return f"{name}:{hashlib.sha256(repr(summary).encode()).hexdigest()[:12]}"


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``, as :mod:`broker.layout` names dtypes."""
    return str(dtype).removeprefix("torch.")


def _layer_spec(spec: KVCacheSpec, where: str) -> FullAttentionSpec | SlidingWindowSpec | MambaSpec:
    """The one spec all layers of a group share (unwrapping ``UniformTypeKVCacheSpecs``)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        specs = set(spec.kv_cache_specs.values())
        if len(specs) != 1:
            raise LayoutError(f"{where}.kv_cache_spec", "layers of the group differ in their spec")
        (spec,) = specs
    if isinstance(spec, MambaSpec):
        return spec
    if type(spec) is MLAAttentionSpec:
        return _dense_mla(spec, where)
    if isinstance(spec, FullAttentionSpec) and not isinstance(spec, MLAAttentionSpec):
        return spec
    if type(spec) is SlidingWindowSpec and not spec.extra_retained_tokens:
        return spec
    raise LayoutError(
        f"{where}.kv_cache_spec",
        f"{type(spec).__name__} is not supported; full attention, sliding-window attention, "
        "MLA and Mamba groups are",
    )


def _dense_mla(spec: MLAAttentionSpec, where: str) -> MLAAttentionSpec:
    """``spec`` if it is dense MLA: one latent per token, no sparse indexer, no compression."""
    for name, value, dense in (
        ("topk_buffer_width", spec.topk_buffer_width, None),
        ("is_index_group_leader", spec.is_index_group_leader, False),
        ("model_version", spec.model_version, None),
        ("tokens_per_state", spec.tokens_per_state, 1),
    ):
        if value != dense:
            raise LayoutError(
                f"{where}.kv_cache_spec.{name}",
                f"sparse or compressed MLA ({value!r}) is not supported; dense MLA is",
            )
    return spec


def _block_stride(views: list[torch.Tensor], blocks: int, where: str) -> int:
    """Bytes between consecutive blocks (kernel blocks for attention), equal for all layers."""
    strides = {v.stride(0) * v.element_size() for v in views}
    if len(strides) != 1 or any(v.shape[0] != blocks for v in views):
        raise LayoutError(
            f"{where}.layer_names",
            f"layers disagree on {blocks} blocks of one stride: strides {sorted(strides)}",
        )
    return strides.pop()


def _attention_group(
    spec: FullAttentionSpec | SlidingWindowSpec,
    view: torch.Tensor,
    layers: list[str],
    tp_size: int,
    tp_rank: int,
    facts: ModelFacts,
    kernel_blocks: int,
    where: str,
) -> GroupLayout:
    """One kernel block ``[heads, kbs, K|V]`` as the view strides it, heads sharded by vLLM's
    rule (rank *r* of ``tp > heads`` holds head ``r * heads // tp``); MLA: ``[1, kbs,
    latent]``, the same on every rank (a replicated segment)."""
    if spec.kv_quant_mode not in _DENSE_QUANT or spec.num_head_slots or spec.state_content_bytes:
        raise LayoutError(
            f"{where}.kv_cache_spec",
            f"packed or scaled KV cache ({spec.kv_quant_mode.name}) is not supported",
        )
    if view.dim() != 4 or spec.block_size % kernel_blocks:
        raise LayoutError(
            f"{where}.layer_names", f"unexpected attention cache shape {tuple(view.shape)}"
        )
    heads, kbs, content = view.shape[1:]
    if (
        heads != spec.num_kv_heads
        or kbs * kernel_blocks != spec.block_size
        or (content != spec.head_size + spec.head_size_v)
    ):
        raise LayoutError(
            f"{where}.layer_names",
            f"cache view {tuple(view.shape)} does not match "
            f"the spec ({spec.num_kv_heads} heads, "
            f"{spec.block_size} tokens per block)",
        )
    item = view.element_size()
    strides = tuple(s * item for s in view.stride()[1:])
    kernel_block_bytes = view.stride(0) * item
    dtype = _dtype_name(view.dtype)
    if view.dtype == torch.uint8:
        dtype = _FP8_FORMATS.get(facts.kv_cache_dtype, dtype)
    if isinstance(spec, MLAAttentionSpec):
        latent = Segment("latent", 0, (heads, kbs, content), strides, dtype, token_axis=1)
        return GroupLayout(
            GroupKind.ATTENTION, tuple(layers), (latent,), spec.block_size, kbs, kernel_block_bytes
        )
    start, local = split_or_replicate(
        facts.total_kv_heads, 1, tp_size, tp_rank, "attention.total_num_kv_heads"
    )
    if local != heads:
        raise LayoutError(
            f"{where}.kv_cache_spec.num_kv_heads",
            f"{heads} heads on rank {tp_rank} of {tp_size}, but "
            f"{facts.total_kv_heads} heads shard into {local}",
        )
    kv = Segment(
        "kv",
        0,
        (heads, kbs, content),
        strides,
        dtype,
        shard_axis=0,
        shard_start=start,
        global_extent=facts.total_kv_heads,
        token_axis=1,
    )
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0
    return GroupLayout(
        GroupKind.ATTENTION,
        tuple(layers),
        (kv,),
        spec.block_size,
        kbs,
        kernel_block_bytes,
        window,
    )


def _mamba_group(
    spec: MambaSpec, layers: list[str], tp_size: int, tp_rank: int, facts: ModelFacts, where: str
) -> GroupLayout:
    """``| conv state (dim, rows) | SSM state |`` from the page start, as vLLM packs
    ``spec.shapes``; each conv sub-projection is a contiguous block of rows."""
    if len(spec.shapes) != 2 or spec.tp_replicated:
        raise LayoutError(
            f"{where}.kv_cache_spec.shapes",
            "only (conv, ssm) state that is sharded over TP is supported",
        )
    conv_shape, ssm_shape = spec.shapes
    conv_dtype, ssm_dtype = spec.dtypes
    dim, rows = conv_shape
    conv_item = torch.empty((), dtype=conv_dtype).element_size()
    segments: list[Segment] = []
    column = 0
    for tensor, start, local, extent in _conv_pieces(
        spec, dim, ssm_shape, tp_size, tp_rank, facts, where
    ):
        segments.append(
            Segment(
                tensor,
                column * rows * conv_item,
                (local, rows),
                (rows * conv_item, conv_item),
                _dtype_name(conv_dtype),
                shard_axis=0,
                shard_start=start,
                global_extent=extent,
            )
        )
        column += local
    if column != dim:
        raise LayoutError(
            f"{where}.kv_cache_spec.shapes[0]",
            f"sub-projections cover {column} of {dim} conv channels",
        )
    ssm_item = torch.empty((), dtype=ssm_dtype).element_size()
    ssm_start, _ = split_evenly(ssm_shape[0] * tp_size, tp_size, tp_rank, "mamba.ssm")
    segments.append(
        Segment(
            "ssm",
            dim * rows * conv_item,
            tuple(ssm_shape),
            contiguous_strides(tuple(ssm_shape), ssm_item),
            _dtype_name(ssm_dtype),
            shard_axis=0,
            shard_start=ssm_start,
            global_extent=ssm_shape[0] * tp_size,
        )
    )
    return GroupLayout(GroupKind.MAMBA, tuple(layers), tuple(segments))


def _conv_pieces(
    spec: MambaSpec,
    dim: int,
    ssm_shape: tuple[int, ...],
    tp_size: int,
    tp_rank: int,
    facts: ModelFacts,
    where: str,
) -> list[tuple[str, int, int, int]]:
    """``(tensor, global start, local rows, global rows)`` of each conv sub-projection, in
    page order, from the local conv width and the SSM state shape."""
    kind = spec.mamba_type
    if kind == MambaAttentionBackendEnum.MAMBA1:
        return [("conv.x", tp_rank * dim, dim, dim * tp_size)]
    if kind == MambaAttentionBackendEnum.MAMBA2:
        heads, head_dim, d_state = ssm_shape
        x = heads * head_dim
        groups_rows = (dim - x) // 2
        total_groups = facts.mamba2_groups or groups_rows * tp_size // d_state
        bc_start, bc_local = split_or_replicate(
            total_groups, d_state, tp_size, tp_rank, "mamba.n_groups"
        )
        if bc_local != groups_rows:
            raise LayoutError(
                f"{where}.kv_cache_spec.shapes[0]",
                f"{groups_rows} B/C rows on rank {tp_rank}, but {total_groups} "
                f"groups of {d_state} shard into {bc_local}",
            )
        pieces = [("conv.x", tp_rank * x, x, x * tp_size)]
        return pieces + [
            (t, bc_start, bc_local, total_groups * d_state) for t in ("conv.B", "conv.C")
        ]
    if kind == MambaAttentionBackendEnum.GDN_ATTN:
        v_heads, v_dim, _ = ssm_shape
        v = v_heads * v_dim
        qk = (dim - v) // 2
        return [
            (t, tp_rank * n, n, n * tp_size)
            for t, n in (("conv.Q", qk), ("conv.K", qk), ("conv.V", v))
        ]
    raise LayoutError(
        f"{where}.kv_cache_spec.mamba_type",
        f"{kind.name} is not supported; Mamba1, Mamba2 and GDN are",
    )
