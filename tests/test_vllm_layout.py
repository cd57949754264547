"""Layouts the connector derives from vLLM 0.33's own objects equal the planner's presets.

For every preset model and TP size (and FlashInfer's kernel blocks of 16 tokens), vLLM builds
the layer specs, the KV-cache groups, the ``KVCacheConfig`` and the cache tensors
(:mod:`vllm_engines`); :func:`clients.vllm.layout.derive_rank_memory` reads them back as a
``RankLayout``, which must equal ``build_engine_layout(resolve_model(preset), ...)`` rank for
rank, field for field. The regions must be the tensors vLLM allocated.
"""

from __future__ import annotations

import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
from vllm_engines import allocate, engine_config, kv_cache_config, storage_bytes, write_model

# isort: split
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flashinfer import FlashInferBackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

from broker.errors import LayoutError
from broker.models import build_engine_layout
from broker.presets import PRESET_CONFIGS, resolve_model
from clients.vllm.layout import ModelFacts, derive_rank_memory, model_fingerprint

#: MLA models run an MLA backend (Triton MLA: kernel blocks of any multiple of 16 tokens).
MLA_PRESETS = ("deepseek-v2-lite",)
CASES = [
    (preset, tp, TritonMLABackend if preset in MLA_PRESETS else FlashAttentionBackend)
    for preset in PRESET_CONFIGS
    for tp in (1, 2, 4, 8)
]
CASES += [
    ("nemotron-h-8b", 16, FlashAttentionBackend),  # replicated KV heads and B/C groups
    ("qwen3.5-4b", 16, FlashAttentionBackend),  # replicated KV heads
    ("nemotron-h-8b", 2, FlashInferBackend),  # kernel blocks of 16 in 1040-token pages
    ("qwen3.5-27b", 4, FlashInferBackend),
]
NUM_BLOCKS = 3


def derive(preset: str, tp: int, backend: type, tmp_path: Path):
    config = engine_config(write_model(preset, tmp_path / preset), tp, backend=backend)
    kv_config = kv_cache_config(config, NUM_BLOCKS, backend)
    caches = allocate(config, kv_config, backend)
    model = config.model_config
    facts = ModelFacts(model.get_total_num_kv_heads(), getattr(model.hf_text_config, "n_groups", 0))
    memories = [
        derive_rank_memory(kv_config, caches, tp, r, facts, get_conv_state_layout())
        for r in range(tp)
    ]
    return config, kv_config, caches, memories


@pytest.mark.parametrize(
    ("preset", "tp", "backend"),
    CASES,
    ids=[f"{p}-tp{t}-{b.get_name().lower()}" for p, t, b in CASES],
)
def test_derived_layout_equals_the_preset(
    preset: str, tp: int, backend: type, tmp_path: Path
) -> None:
    config, kv_config, caches, memories = derive(preset, tp, backend, tmp_path)
    attention = next(g for g in memories[0].layout.groups if g.is_attention)
    expected = build_engine_layout(
        resolve_model(preset),
        tp,
        kv_config.num_blocks,
        config.cache_config.block_size,
        attention.kernel_block_size,
    )
    assert [m.layout for m in memories] == list(expected.ranks)
    if backend is FlashInferBackend:
        assert attention.kernel_block_size == 16 < attention.block_size
    # The regions are vLLM's allocation: one per layer index, back to back, covering it all.
    backing = storage_bytes(next(iter(caches.values())))
    regions = memories[0].regions
    assert regions[0].base_addr == backing.data_ptr()
    assert all(b.base_addr == a.base_addr + a.length_bytes for a, b in pairwise(regions))
    assert sum(r.length_bytes for r in regions) == backing.numel()


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
