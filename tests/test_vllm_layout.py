"""Layouts the connector derives from vLLM 0.33's own objects equal the planner's presets.

For every preset model and TP size (and FlashInfer's kernel blocks of 16 tokens), vLLM builds
the layer specs, the KV-cache groups, the ``KVCacheConfig`` and the cache tensors
(:mod:`vllm_engines`); :func:`clients.vllm.layout.derive_rank_memory` reads them back as a
``RankLayout``, which must equal ``build_engine_layout(resolve_model(preset), ...)`` rank for
rank, field for field. The regions must be the tensors vLLM allocated. DeepSeek-V4, whose
caches vLLM packs block-outermost, is compared the same way in its own test.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import fields, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from vllm_engines import (
    allocate,
    cpu_engine,
    engine_config,
    kv_cache_config,
    storage_bytes,
    write_model,
)

# isort: split
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flashinfer import FlashInferBackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    RSWASpec,
    SinkFullAttentionSpec,
)

from broker.compatibility import check_compatible
from broker.errors import IncompatibleLayoutsError, LayoutError
from broker.layout import EngineLayout, GroupKind
from broker.models import build_engine_layout, with_kv_dtype
from broker.presets import PRESET_CONFIGS, model_from_hf_config, resolve_model
from clients.vllm.layout import ModelFacts, derive_rank_memory, model_fingerprint

#: MLA models run an MLA backend (Triton MLA: kernel blocks of any multiple of 16 tokens).
MLA_PRESETS = ("deepseek-v2-lite", "kimi-linear-48b-a3b")
#: Presets whose caches vLLM packs in block rows (test_deepseek_v4_rows_equal_the_preset).
ROW_PRESETS = ("deepseek-v4-flash",)
CASES = [
    (preset, tp, TritonMLABackend if preset in MLA_PRESETS else FlashAttentionBackend)
    for preset in PRESET_CONFIGS
    if preset not in ROW_PRESETS
    for tp in (1, 2, 4, 8)
]
CASES += [
    ("nemotron-h-8b", 16, FlashAttentionBackend),  # replicated KV heads and B/C groups
    ("qwen3.5-4b", 16, FlashAttentionBackend),  # replicated KV heads
    ("nemotron-h-8b", 2, FlashInferBackend),  # kernel blocks of 16 in 1040-token pages
    ("qwen3.5-27b", 4, FlashInferBackend),
]
NUM_BLOCKS = 3


def derive(
    preset: str,
    tp: int,
    backend: type,
    tmp_path: Path,
    specs: Callable[[VllmConfig], dict[str, KVCacheSpec]] | None = None,
    **cache: Any,
):
    """Each rank's memory as the connector derives it from vLLM's objects for ``preset`` at
    ``tp`` (``cache``: ``CacheConfig`` fields; ``specs``: the layers' specs, by default
    those the model's layers declare)."""
    config = engine_config(write_model(preset, tmp_path / preset), tp, backend=backend, **cache)
    kv_config = kv_cache_config(config, NUM_BLOCKS, backend, specs(config) if specs else None)
    caches = allocate(config, kv_config, backend)
    model = config.model_config
    facts = ModelFacts(
        model.get_total_num_kv_heads(),
        getattr(model.hf_text_config, "n_groups", 0),
        config.cache_config.cache_dtype,
    )
    memories = [
        derive_rank_memory(kv_config, caches, tp, r, facts, get_conv_state_layout())
        for r in range(tp)
    ]
    return config, kv_config, caches, memories


def attention_as(cls: type[AttentionSpec], **more: Any) -> Callable[[KVCacheSpec], KVCacheSpec]:
    """The full-attention layers' spec as another attention type declares it (``more``: its
    own fields); other layers' specs unchanged."""

    def convert(spec: KVCacheSpec) -> KVCacheSpec:
        if not isinstance(spec, FullAttentionSpec):
            return spec
        common = {f.name: getattr(spec, f.name) for f in fields(AttentionSpec)}
        return cls(**common, **more)

    return convert


def expected_layout(preset: str, config: VllmConfig, kv_config, memory, kv_dtype: str | None):
    """The planner's layout of ``preset`` with the KV cache in ``kv_dtype`` and the SSM state
    in the dtype vLLM's platform settled on (vLLM's CPU platform stores the SSM state of
    backends other than GDN in float32, whatever the model's dtype)."""
    model = with_kv_dtype(resolve_model(preset), kv_dtype)
    ssm_dtype = config.cache_config.mamba_ssm_cache_dtype
    if model.mamba is not None and ssm_dtype != "auto":
        model = replace(model, mamba=replace(model.mamba, ssm_dtype=ssm_dtype))
    attention = next(g for g in memory.layout.groups if g.is_attention)
    return build_engine_layout(
        model,
        config.parallel_config.tensor_parallel_size,
        kv_config.num_blocks,
        config.cache_config.block_size,
        attention.kernel_block_size,
    )


@pytest.mark.parametrize(
    ("preset", "tp", "backend"),
    CASES,
    ids=[f"{p}-tp{t}-{b.get_name().lower()}" for p, t, b in CASES],
)
def test_derived_layout_equals_the_preset(
    preset: str, tp: int, backend: type, tmp_path: Path
) -> None:
    config, kv_config, caches, memories = derive(preset, tp, backend, tmp_path)
    expected = expected_layout(preset, config, kv_config, memories[0], None)
    assert [m.layout for m in memories] == list(expected.ranks)
    attention = next(g for g in memories[0].layout.groups if g.is_attention)
    if backend is FlashInferBackend:
        assert attention.kernel_block_size == 16 < attention.block_size
    # The regions are vLLM's allocation: one per layer index, back to back, covering it all.
    backing = storage_bytes(next(iter(caches.values())))
    regions = memories[0].regions
    assert regions[0].base_addr == backing.data_ptr()
    assert all(b.base_addr == a.base_addr + a.length_bytes for a, b in pairwise(regions))
    assert sum(r.length_bytes for r in regions) == backing.numel()


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize(
    ("cache_dtype", "fp8_format"),
    [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")],
)
def test_an_fp8_kv_cache_equals_the_one_byte_preset(
    cache_dtype: str, fp8_format: str, tp: int, tmp_path: Path
) -> None:
    """``--kv-cache-dtype fp8*``: vLLM stores the KV cache as bytes (``uint8``) in pages half
    the size, so the hybrid block doubles; the layout names the fp8 format the bytes hold."""
    config, kv_config, _, memories = derive(
        "nemotron-h-8b", tp, FlashAttentionBackend, tmp_path, cache_dtype=cache_dtype
    )
    expected = expected_layout("nemotron-h-8b", config, kv_config, memories[0], fp8_format)
    assert [m.layout for m in memories] == list(expected.ranks)
    (kv,) = next(g for g in memories[0].layout.groups if g.is_attention).segments
    assert (kv.dtype, kv.strides[-1]) == (fp8_format, 1)
    bf16_config = derive("nemotron-h-8b", tp, FlashAttentionBackend, tmp_path / "bf16")[0]
    assert config.cache_config.block_size == 2 * bf16_config.cache_config.block_size


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["sink", "rswa"])
def test_full_attention_subclasses_declare_full_attention_pages(
    kind: str, tp: int, tmp_path: Path
) -> None:
    """Static-sink attention (its sink tokens in blocks of their own, outside every request's
    block table) and reference sliding-window attention (all prompt blocks kept; only decode
    tokens past the window are evicted) store a request's prompt in full-attention pages:
    the connector accepts them and declares exactly those pages."""

    def specs(config: VllmConfig) -> dict[str, KVCacheSpec]:
        block = config.cache_config.block_size
        convert = (
            attention_as(SinkFullAttentionSpec, sink_len=block)
            if kind == "sink"
            else attention_as(RSWASpec, rswa_window=block)
        )
        return {name: convert(s) for name, s in cpu_engine.layer_specs(config).items()}

    config, kv_config, _, memories = derive(
        "qwen3.5-0.8b", tp, FlashAttentionBackend, tmp_path, specs
    )
    expected_type = SinkFullAttentionSpec if kind == "sink" else RSWASpec
    assert any(isinstance(g.kv_cache_spec, expected_type) for g in kv_config.kv_cache_groups)
    expected = expected_layout("qwen3.5-0.8b", config, kv_config, memories[0], None)
    assert [m.layout for m in memories] == list(expected.ranks)


def test_fp8_formats_and_bf16_kv_caches_are_refused_naming_the_dtype(tmp_path: Path) -> None:
    """The byte caches of e4m3 and e5m2 look alike to NIXL; the broker must still refuse to
    pair them, as it refuses fp8 against bfloat16."""
    layouts = {}
    for dtype in ("fp8", "fp8_e5m2", "auto"):
        memories = derive(
            "qwen3.5-0.8b", 1, FlashAttentionBackend, tmp_path / dtype, cache_dtype=dtype
        )[3]
        ranks = tuple(m.layout for m in memories)
        layouts[dtype] = EngineLayout(model_fingerprint("m", ranks[0]), 1, ranks)
    check_compatible(layouts["fp8"], layouts["fp8"])
    for prefill, decode, message in [
        ("fp8", "fp8_e5m2", "prefill fp8_e4m3, decode fp8_e5m2"),
        ("fp8", "auto", "prefill fp8_e4m3, decode bfloat16"),
    ]:
        with pytest.raises(IncompatibleLayoutsError, match=r"segments\['kv'\]\.dtype: " + message):
            check_compatible(layouts[prefill], layouts[decode])


def test_the_fingerprint_names_the_model_not_its_tp(tmp_path: Path) -> None:
    prints = {
        tp: model_fingerprint(
            "qwen",
            derive("qwen3.5-0.8b", tp, FlashAttentionBackend, tmp_path / str(tp))[3][0].layout,
        )
        for tp in (1, 2)
    }
    other = derive("qwen3.5-4b", 1, FlashAttentionBackend, tmp_path / "4b")[3][0].layout
    assert prints[1] == prints[2] != model_fingerprint("qwen", other)


def test_conv_state_must_be_dim_first(tmp_path: Path) -> None:
    config = engine_config(write_model("nemotron-h-8b", tmp_path / "m"), 1)
    kv_config = kv_cache_config(config, NUM_BLOCKS)
    with pytest.raises(LayoutError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
        derive_rank_memory(kv_config, allocate(config, kv_config), 1, 0, ModelFacts(8, 8), "SD")


def test_a_layer_outside_the_shared_regions_is_refused(tmp_path: Path) -> None:
    """HMA aliasing is what makes region *i* hold layer *i* of every group."""
    _, kv_config, caches, _ = derive("qwen3.5-0.8b", 1, FlashAttentionBackend, tmp_path)
    first_attention = next(
        g for g in kv_config.kv_cache_groups if not hasattr(g.kv_cache_spec, "shapes")
    ).layer_names[0]
    caches[first_attention] = caches[first_attention].clone()
    with pytest.raises(LayoutError, match="does not share region 0"):
        derive_rank_memory(kv_config, caches, 1, 0, ModelFacts(2), "DS")


def test_the_broker_never_imports_vllm() -> None:
    """Every module of the broker package loads without vLLM (nor torch, nor NIXL)."""
    code = (
        "import importlib, pkgutil, sys, broker\n"
        "for m in pkgutil.walk_packages(broker.__path__, 'broker.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'nixl'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_mla_latent_is_one_replicated_segment(cache_dtype: str, tmp_path: Path) -> None:
    """Every rank declares the whole latent of each token (512 compressed KV + 64 rotary key
    elements), in the cache dtype: bfloat16, or one byte for fp8."""
    config = engine_config(
        write_model("deepseek-v2-lite", tmp_path / "m"),
        2,
        backend=TritonMLABackend,
        cache_dtype=cache_dtype,
    )
    kv_config = kv_cache_config(config, NUM_BLOCKS, TritonMLABackend)
    caches = allocate(config, kv_config, TritonMLABackend)
    segments = {
        derive_rank_memory(kv_config, caches, 2, r, ModelFacts(1)).layout.groups[0].segments
        for r in range(2)
    }
    ((latent,),) = segments  # the same on both ranks
    assert (latent.tensor, latent.shape, latent.shard_axis) == ("latent", (1, 16, 576), None)
    assert latent.itemsize == (1 if cache_dtype == "fp8" else 2)


def test_packed_mla_cache_is_refused_naming_the_spec(tmp_path: Path) -> None:
    """DeepSeek's packed fp8 MLA cache (latent, rope and scales in 656 bytes) is refused."""
    config = engine_config(
        write_model("deepseek-v2-lite", tmp_path / "m"),
        1,
        backend=TritonMLABackend,
        cache_dtype="fp8_ds_mla",
    )
    kv_config = kv_cache_config(config, NUM_BLOCKS, TritonMLABackend)
    with pytest.raises(LayoutError) as err:
        derive_rank_memory(
            kv_config, allocate(config, kv_config, TritonMLABackend), 1, 0, ModelFacts(1)
        )
    assert err.value.field == "kv_cache_groups[0].kv_cache_spec"


def test_kimi_linear_kda_layers_are_the_ones_vllm_builds(tmp_path: Path) -> None:
    """The preset's KDA (Mamba) layers are those vLLM's ``KimiLinearConfig.is_kda_layer``
    builds as KDA; the others are its MLA layers."""
    preset = "kimi-linear-48b-a3b"
    hf_config = engine_config(
        write_model(preset, tmp_path / "m"), 1, backend=TritonMLABackend
    ).model_config.hf_config
    kinds = {name: kind for kind, names in resolve_model(preset).groups for name in names}
    assert kinds == {
        f"model.layers.{i}.self_attn": GroupKind.MAMBA
        if hf_config.is_kda_layer(i)
        else GroupKind.ATTENTION
        for i in range(hf_config.num_hidden_layers)
    }


def dsv4_layers(*layer_types: str) -> dict[str, Any]:
    """DeepSeek-V4-Flash's config with these layers, named by ``layer_types``."""
    flash = {k: v for k, v in PRESET_CONFIGS["deepseek-v4-flash"].items() if k != "compress_ratios"}
    return {**flash, "num_hidden_layers": len(layer_types), "layer_types": list(layer_types)}


SWA, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
DSV4_CASES = [
    ("deepseek-v4-flash", 1, "auto"),
    ("deepseek-v4-flash", 2, "auto"),
    ("deepseek-v4-flash", 4, "fp8"),
    ("deepseek-v4-flash", 1, "fp8_e5m2"),
    # The packed format: latent pages of 584 bytes per entry, every page padded to 576 bytes.
    ("deepseek-v4-flash", 2, "fp8_ds_mla"),
    ((SWA, CSA, HCA, CSA), 1, "fp8_ds_mla"),
    ((SWA, HCA, HCA, HCA, HCA, HCA), 2, "fp8_ds_mla"),
    # Every layer kind: every bucket's page sizes repeat, the sliding-window one is split.
    ((SWA, CSA, HCA, CSA), 2, "auto"),
    # No ratio-4 layer, so no bucket of mixed page sizes: the sliding-window and compressor
    # state buckets split down to what the widest row holds.
    ((SWA, HCA, HCA, HCA, HCA, HCA), 1, "auto"),
    ((HCA, HCA, CSA, HCA, CSA, HCA, CSA, HCA), 1, "fp8"),
    # Groups of 3 and of 4 repeats pad alike: vLLM takes 4, so the sliding-window caches
    # stay one group.
    ((SWA, CSA, CSA, CSA), 1, "auto"),
]


@pytest.mark.parametrize(
    ("model", "tp", "cache_dtype"),
    DSV4_CASES,
    ids=[
        f"{m if isinstance(m, str) else ''.join(k[0] for k in m)}-tp{t}-{d}"
        for m, t, d in DSV4_CASES
    ],
)
def test_deepseek_v4_rows_equal_the_preset(
    model: str | tuple[str, ...], tp: int, cache_dtype: str, tmp_path: Path
) -> None:
    """DeepSeek-V4's layout as the connector derives it from vLLM's own specs, grouping and
    block-outermost allocation equals the planner's (:mod:`broker.row_models`) on every
    rank: the row stride, each group's block size and window, and each layer's segment
    (offset in the row, shape, strides, dtype, tokens per entry). The region is vLLM's
    allocation."""
    config_json = PRESET_CONFIGS[model] if isinstance(model, str) else dsv4_layers(*model)
    config = engine_config(write_model(config_json, tmp_path / "m"), tp, cache_dtype=cache_dtype)
    kv_config = kv_cache_config(config, NUM_BLOCKS)
    caches = allocate(config, kv_config)
    memories = [
        derive_rank_memory(kv_config, caches, tp, r, ModelFacts(1, 0, cache_dtype))
        for r in range(tp)
    ]
    spec = model_from_hf_config(config_json, "dsv4")
    expected = build_engine_layout(
        with_kv_dtype(spec, None if cache_dtype == "auto" else cache_dtype),
        tp,
        kv_config.num_blocks,
        config.cache_config.block_size,
    )
    assert [m.layout for m in memories] == list(expected.ranks)
    backing = storage_bytes(next(iter(caches.values())))
    for memory in memories:
        (region,) = memory.regions
        assert (region.base_addr, region.length_bytes) == (backing.data_ptr(), backing.numel())
