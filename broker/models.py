"""Build :class:`EngineLayout` declarations from model parameters, as vLLM 0.33 allocates.

Conventions (see ``tests/data/testvectors/README.md``): attention pages are blocks-first,
``R = block_size // kernel_block_size`` kernel blocks of ``[heads_local, kbs, 2*head_dim]``
(MLA: ``[1, kbs, head_dim]``, one latent vector per token, the same on every rank);
Mamba pages hold the conv state in dim-first layout (sub-projections ``x|B|C``, ``Q|K|V`` or
``x``, each TP-sharded on its own), then the SSM state sharded on its first axis, then padding.
Every region's page is the attention page at that rank's TP (HMA makes the pages equal).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

from broker.errors import LayoutError
from broker.layout import (
    EngineLayout,
    GroupKind,
    GroupLayout,
    RankLayout,
    Segment,
    contiguous_strides,
    dtype_bytes,
)
from broker.row_models import (
    DEFAULT_ROW_BLOCK_SIZE,
    RowCache,
    build_row_rank_layout,
    row_groups,
    with_block_size,
    with_row_kv_dtype,
)

#: Token alignment of the attention kernel used when vLLM's HMA grows the block size.
DEFAULT_BLOCK_ALIGNMENT = 16
MAMBA_KINDS = ("mamba1", "mamba2", "gdn")


@dataclass(frozen=True)
class AttentionParams:
    """Full-attention layers: global KV heads, head size and KV-cache dtype.

    ``latent``: multi-head latent attention (MLA), which caches one vector of ``head_dim``
    (``kv_lora_rank + qk_rope_head_dim``) per token instead of K and V per head, replicated
    on every TP rank (``num_kv_heads`` is 1).
    """

    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    latent: bool = False

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int, dtype: str) -> AttentionParams:
        """MLA's cache: one latent per token (the compressed KV, then the rotary key)."""
        return cls(1, kv_lora_rank + qk_rope_head_dim, dtype, latent=True)


@dataclass(frozen=True)
class MambaParams:
    """Global (TP=1) dimensions of the SSM layers; which fields matter depends on ``kind``.

    mamba1: ``intermediate_size``, ``state_size``; mamba2: those plus ``n_groups``,
    ``num_heads``, ``head_dim``; gdn: ``num_k_heads``, ``num_v_heads``, ``head_k_dim``,
    ``head_v_dim``. ``local_shapes`` optionally overrides the per-rank shapes by TP size:
    ``{tp: (conv_proj_dims, ssm_shape)}``.
    """

    kind: str
    conv_kernel: int
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"
    intermediate_size: int = 0
    state_size: int = 0
    n_groups: int = 0
    num_heads: int = 0
    head_dim: int = 0
    num_k_heads: int = 0
    num_v_heads: int = 0
    head_k_dim: int = 0
    head_v_dim: int = 0
    local_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if self.kind not in MAMBA_KINDS:
            raise LayoutError("mamba_type", f"must be one of {MAMBA_KINDS}, got {self.kind!r}")
        if self.conv_kernel < 2:
            raise LayoutError("mamba.conv_kernel", "must be >= 2")


@dataclass(frozen=True)
class ModelSpec:
    """A hybrid model: its KV-carrying layers grouped as vLLM's KV-cache groups."""

    name: str
    groups: tuple[tuple[GroupKind, tuple[str, ...]], ...]
    attention: AttentionParams | None
    mamba: MambaParams | None
    #: Per group, the sliding window in tokens (0: full attention); empty: no window at all.
    sliding_windows: tuple[int, ...] = ()
    #: The cache layers of a model vLLM packs block-outermost (:mod:`broker.row_models`), in
    #: registration order; ``groups`` then hold their names.
    row_caches: tuple[RowCache, ...] = ()

    @property
    def num_regions(self) -> int:
        return 1 if self.row_caches else max(len(layers) for _, layers in self.groups)

    @property
    def fingerprint(self) -> str:
        """Identifies the model's state shapes; prefill and decode must agree on it."""
        state: tuple[object, ...] = (self.groups, self.attention, self.mamba)
        if any(self.sliding_windows):
            state += (self.sliding_windows,)
        if self.row_caches:
            state += (self.row_caches,)
        digest = hashlib.sha256(repr(state).encode())
        return f"{self.name}:{digest.hexdigest()[:12]}"

    def sliding_window(self, group: int) -> int:
        """Group ``group``'s sliding window in tokens (0: full attention or Mamba)."""
        return self.sliding_windows[group] if self.sliding_windows else 0


def row_model(name: str, caches: tuple[RowCache, ...]) -> ModelSpec:
    """A model of block-outermost cache layers, grouped as vLLM groups them in blocks of the
    default size."""
    groups = row_groups(with_block_size(caches, DEFAULT_ROW_BLOCK_SIZE))
    return ModelSpec(
        name,
        tuple((GroupKind.ATTENTION, tuple(c.name for c in g)) for g in groups),
        None,
        None,
        tuple(g[0].sliding_window for g in groups),
        caches,
    )


def with_kv_dtype(model: ModelSpec, kv_dtype: str | None) -> ModelSpec:
    """``model`` with its KV cache stored in ``kv_dtype`` (e.g. ``fp8``); unchanged for None
    or a model without attention. Block-outermost caches store their latents in vLLM's dtype
    for that cache dtype (:func:`broker.row_models.with_row_kv_dtype`)."""
    if kv_dtype and model.row_caches:
        return row_model(model.name, with_row_kv_dtype(model.row_caches, kv_dtype))
    if not kv_dtype or model.attention is None:
        return model
    return replace(model, attention=replace(model.attention, dtype=kv_dtype))


def split_evenly(total: int, tp: int, rank: int, field_name: str) -> tuple[int, int]:
    """``(start, length)`` of rank's slice of an axis of ``total`` sharded over ``tp``."""
    if total % tp:
        raise LayoutError(field_name, f"{total} is not divisible by tp={tp}")
    local = total // tp
    return rank * local, local


def split_or_replicate(
    units: int, unit_size: int, tp: int, rank: int, field_name: str
) -> tuple[int, int]:
    """Shard ``units`` of ``unit_size`` over ``tp``; when ``units < tp`` each rank holds the
    whole unit ``rank * units // tp`` (replicated KV heads, replicated Mamba2 groups)."""
    if units >= tp:
        start, local = split_evenly(units, tp, rank, field_name)
        return start * unit_size, local * unit_size
    if tp % units:
        raise LayoutError(field_name, f"tp={tp} is not a multiple of {units}")
    return (rank * units // tp) * unit_size, unit_size


def fa_bytes_per_token(attn: AttentionParams, tp: int) -> int:
    """Bytes of K and V (MLA: of the latent) one token occupies on one rank."""
    item = dtype_bytes(attn.dtype, "attention.dtype")
    if attn.latent:
        return attn.head_dim * item
    heads_local = max(1, attn.num_kv_heads // tp)
    return 2 * heads_local * attn.head_dim * item


def _conv_projections(m: MambaParams) -> list[tuple[str, int, int]]:
    """``(tensor, units, unit_rows)`` of each conv sub-projection, in page order."""
    if m.kind == "mamba1":
        return [("conv.x", m.intermediate_size, 1)]
    if m.kind == "mamba2":
        return [
            ("conv.x", m.intermediate_size, 1),
            ("conv.B", m.n_groups, m.state_size),
            ("conv.C", m.n_groups, m.state_size),
        ]
    qk = m.num_k_heads
    return [
        ("conv.Q", qk, m.head_k_dim),
        ("conv.K", qk, m.head_k_dim),
        ("conv.V", m.num_v_heads, m.head_v_dim),
    ]


def _ssm_global_shape(m: MambaParams) -> tuple[int, ...]:
    if m.kind == "mamba1":
        return (m.intermediate_size, m.state_size)
    if m.kind == "mamba2":
        return (m.num_heads, m.head_dim, m.state_size)
    return (m.num_v_heads, m.head_v_dim, m.head_k_dim)


def mamba_segments(m: MambaParams, tp: int, rank: int) -> tuple[Segment, ...]:
    """Conv sub-projections (dim-first) then the SSM state, packed from the page start."""
    rows = m.conv_kernel - 1
    conv_item = dtype_bytes(m.conv_dtype, "mamba.conv_dtype")
    segments: list[Segment] = []
    offset = 0
    explicit = m.local_shapes.get(tp)
    for p, (tensor, units, unit_rows) in enumerate(_conv_projections(m)):
        if explicit:
            local = explicit[0][p]
            start, extent = rank * local, local * tp
        else:
            start, local = split_or_replicate(units, unit_rows, tp, rank, f"mamba.{tensor}")
            extent = units * unit_rows
        shape = (local, rows)
        segments.append(
            Segment(
                tensor,
                offset,
                shape,
                contiguous_strides(shape, conv_item),
                m.conv_dtype,
                shard_axis=0,
                shard_start=start,
                global_extent=extent,
            )
        )
        offset += local * rows * conv_item
    if explicit:
        ssm_shape = tuple(explicit[1])
        start, extent = rank * ssm_shape[0], ssm_shape[0] * tp
    else:
        global_shape = _ssm_global_shape(m)
        start, heads = split_evenly(global_shape[0], tp, rank, "mamba.ssm")
        ssm_shape, extent = (heads, *global_shape[1:]), global_shape[0]
    ssm_item = dtype_bytes(m.ssm_dtype, "mamba.ssm_dtype")
    segments.append(
        Segment(
            "ssm",
            offset,
            ssm_shape,
            contiguous_strides(ssm_shape, ssm_item),
            m.ssm_dtype,
            shard_axis=0,
            shard_start=start,
            global_extent=extent,
        )
    )
    return tuple(segments)


def mamba_state_bytes(m: MambaParams, tp: int) -> int:
    """Unpadded bytes of one Mamba page on one rank (conv + SSM)."""
    return sum(s.nbytes for s in mamba_segments(m, tp, 0))


def attention_segment(attn: AttentionParams, tp: int, rank: int, kernel_block_size: int) -> Segment:
    """One kernel block ``[heads_local, kbs, 2*head_dim]``: K then V per head and token; MLA:
    ``[1, kbs, head_dim]``, the latent of each token, replicated (no shard axis)."""
    if attn.latent:
        return latent_segment(attn, kernel_block_size)
    start, heads = split_or_replicate(
        attn.num_kv_heads, 1, tp, rank, "attention.total_num_kv_heads"
    )
    shape = (heads, kernel_block_size, 2 * attn.head_dim)
    item = dtype_bytes(attn.dtype, "attention.dtype")
    return Segment(
        "kv",
        0,
        shape,
        contiguous_strides(shape, item),
        attn.dtype,
        shard_axis=0,
        shard_start=start,
        global_extent=attn.num_kv_heads,
        token_axis=1,
    )


def latent_segment(attn: AttentionParams, kernel_block_size: int) -> Segment:
    """MLA's kernel block ``[1, kbs, head_dim]``: every rank holds the whole latent."""
    if attn.num_kv_heads != 1:
        raise LayoutError(
            "attention.num_kv_heads", f"MLA caches one latent head, got {attn.num_kv_heads}"
        )
    shape = (1, kernel_block_size, attn.head_dim)
    item = dtype_bytes(attn.dtype, "attention.dtype")
    return Segment("latent", 0, shape, contiguous_strides(shape, item), attn.dtype, token_axis=1)


def hma_block_size(
    model: ModelSpec, tp: int, user_block_size: int = 0, alignment: int = DEFAULT_BLOCK_ALIGNMENT
) -> int:
    """Block size (tokens) vLLM 0.33's hybrid allocator settles on, as
    ``Platform._align_hybrid_block_size`` does: with ``step = max(alignment, user_block_size)``,
    the smallest multiple of ``step`` whose attention page holds the Mamba state, rounded up to
    a multiple of ``alignment`` (the attention backend's smallest kernel block). A user block
    size is thus a step, not a floor: ``--block-size 64`` yields a multiple of 64.
    Block-outermost caches: the user's block size, else 256 tokens."""
    if model.row_caches:
        return user_block_size or DEFAULT_ROW_BLOCK_SIZE
    if model.attention is None or model.mamba is None:
        return user_block_size or alignment
    step = max(alignment, user_block_size)
    per_token = fa_bytes_per_token(model.attention, tp)
    tokens = step * -(-mamba_state_bytes(model.mamba, tp) // (step * per_token))
    return alignment * -(-tokens // alignment)


def build_rank_layout(
    model: ModelSpec, tp: int, rank: int, num_blocks: int, block_size: int, kernel_block_size: int
) -> RankLayout:
    groups: list[GroupLayout] = []
    page_bytes = 0
    if model.attention is not None:
        kv = attention_segment(model.attention, tp, rank, kernel_block_size)
        page_bytes = kv.nbytes * (block_size // kernel_block_size)
    mamba = mamba_segments(model.mamba, tp, rank) if model.mamba is not None else ()
    mamba_bytes = sum(s.nbytes for s in mamba)
    if page_bytes and mamba_bytes > page_bytes:
        raise LayoutError(
            "block_size",
            f"a {block_size}-token attention page ({page_bytes} bytes) cannot hold the "
            f"{mamba_bytes}-byte Mamba state at tp={tp}; use >= {hma_block_size(model, tp)}",
        )
    page_bytes = page_bytes or mamba_bytes
    for g, (kind, layers) in enumerate(model.groups):
        if kind is GroupKind.ATTENTION:
            if model.attention is None:
                raise LayoutError("attention", "an attention group needs attention parameters")
            groups.append(
                GroupLayout(
                    kind,
                    layers,
                    (kv,),
                    block_size,
                    kernel_block_size,
                    kv.nbytes,
                    model.sliding_window(g),
                )
            )
        else:
            if model.mamba is None:
                raise LayoutError("mamba", "a mamba group needs mamba parameters")
            groups.append(GroupLayout(kind, layers, mamba))
    return RankLayout(rank, model.num_regions, num_blocks, page_bytes, tuple(groups))


def build_engine_layout(
    model: ModelSpec, tp: int, num_blocks: int, block_size: int = 0, kernel_block_size: int = 0
) -> EngineLayout:
    """Layout of every rank of an engine serving ``model`` at ``tp``.

    ``block_size`` 0 picks vLLM's HMA block size; ``kernel_block_size`` 0 means "same as the
    logical block size".
    """
    if tp <= 0:
        raise LayoutError("tp", "must be positive")
    block_size = block_size or hma_block_size(model, tp)
    kernel_block_size = kernel_block_size or block_size
    if block_size % kernel_block_size:
        raise LayoutError(
            "kernel_block_size", f"{kernel_block_size} does not divide block_size {block_size}"
        )
    if model.row_caches:
        if kernel_block_size != block_size:
            raise LayoutError(
                "kernel_block_size", "block-outermost caches are not split into kernel blocks"
            )
        ranks = tuple(
            build_row_rank_layout(model.row_caches, r, num_blocks, block_size) for r in range(tp)
        )
        return EngineLayout(model.fingerprint, tp, ranks)
    ranks = tuple(
        build_rank_layout(model, tp, r, num_blocks, block_size, kernel_block_size)
        for r in range(tp)
    )
    return EngineLayout(model.fingerprint, tp, ranks)
