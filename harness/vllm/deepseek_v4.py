"""DeepSeek-V4's KV-cache specs and layout resolution as vLLM 0.33 makes them, without
instantiating the model (its layers need AMX or CUDA kernels to be built).

Each attention layer ``model.layers.N.attn`` of compress ratio ``r`` (``compress_ratios`` or
``layer_types`` + ``compress_rates`` of ``config.json``, through vLLM's
``get_compress_ratios``) owns a sliding-window cache (``.swa_cache``); with ``r > 1`` also a
compressed latent (the layer itself, one state per ``r`` tokens) and its compressor's state
(``.compressor.state_cache``); with ``r == 4`` also an indexer key cache
(``.indexer.k_cache``) and the indexer compressor's state. Their specs come from the vLLM
classes' own ``get_kv_cache_spec``, called on the attributes they read. The cache format is
the one vLLM resolves (``_resolve_dsv4_kv_cache_dtype``): ``--kv-cache-dtype fp8_ds_mla``
selects the packed format of FlashMLA and of vLLM's CPU backend, any other the plain rows of
FlashInfer's sparse MLA backend.

vLLM can group these caches only in a block-outermost layout; the engine core picks it from
the backends' supported layouts whatever a connector prefers (``resolve_kv_cache_layout``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.models.deepseek_v4.attention import (
    DeepseekV4Attention,
    DeepseekV4IndexerCache,
    _resolve_dsv4_kv_cache_dtype,
)
from vllm.models.deepseek_v4.compressor import CompressorBackend, CompressorStateCache
from vllm.models.deepseek_v4.cpu.cpu_mla import (
    DeepseekV4CPUIndexerBackend,
    DeepseekV4CPUSparseBackend,
)
from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend, DeepseekV4SWACache
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import KVCacheSpec

#: vLLM's DeepSeek-V4 CPU backend needs this block size (``CpuPlatform``).
BLOCK_SIZE = 256


def is_deepseek_v4(config: VllmConfig) -> bool:
    return bool(get_compress_ratios(config.model_config.hf_config))


def layer_specs(config: VllmConfig) -> dict[str, KVCacheSpec]:
    """Each cache layer's spec, in the order the model registers them."""
    hf, cache = config.model_config.hf_config, config.cache_config
    packed = cache.cache_dtype == "fp8_ds_mla"
    kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(packed, cache.cache_dtype, cache)
    head_dim, window = hf.head_dim, hf.sliding_window
    ratios = get_compress_ratios(hf)[: hf.num_hidden_layers]
    specs: dict[str, KVCacheSpec] = {}
    for i, ratio in enumerate(ratios):
        prefix = f"model.layers.{i}.attn"
        swa = SimpleNamespace(
            bounded_replay=False,
            block_size=64,
            head_dim=head_dim,
            dtype=kv_torch_dtype,
            window_size=window,
            cache_config=cache,
            packed_bytes_per_token=584,
            packed_page_alignment=576,
            packed_block_stride_alignment=None,
        )
        specs[f"{prefix}.swa_cache"] = DeepseekV4SWACache.get_kv_cache_spec(swa, config)  # type: ignore[arg-type]
        if ratio <= 1:
            continue
        layer = SimpleNamespace(
            compress_ratio=ratio,
            kv_cache_dtype=kv_dtype,
            head_dim=head_dim,
            kv_cache_torch_dtype=kv_torch_dtype,
        )
        latent = DeepseekV4Attention.get_kv_cache_spec(layer, config)  # type: ignore[arg-type]
        assert latent is not None
        specs[prefix] = latent
        specs[f"{prefix}.compressor.state_cache"] = _state_spec(config, ratio, head_dim)
        if ratio == 4:
            index_dim = hf.index_head_dim
            keys = SimpleNamespace(
                cache_config=cache,
                # fp8 keys and one float32 scale per 128 values
                head_dim=index_dim + index_dim // 128 * 4,
                dtype=torch.uint8,
                compress_ratio=ratio,
            )
            specs[f"{prefix}.indexer.k_cache"] = DeepseekV4IndexerCache.get_kv_cache_spec(
                keys,  # type: ignore[arg-type]
                config,
            )
            specs[f"{prefix}.indexer.compressor.state_cache"] = _state_spec(
                config, ratio, index_dim
            )
    return specs


def _state_spec(config: VllmConfig, ratio: int, head_dim: int) -> KVCacheSpec:
    """A compressor's state cache (``DeepseekCompressor``: kv and score state, doubled where
    windows overlap, ``ratio == 4``)."""
    overlap = 1 + (ratio == 4)
    state = SimpleNamespace(
        block_size=4 if ratio == 4 else 8,
        state_dim=2 * overlap * head_dim,
        dtype=torch.float32,
        sliding_window=overlap * ratio,
    )
    return CompressorStateCache.get_kv_cache_spec(state, config)  # type: ignore[arg-type]


def layer_backends(config: VllmConfig) -> dict[str, type]:
    """Each cache layer's attention backend on CPU, as its vLLM class returns it: the latent's
    sparse MLA backend, the sliding window's, the indexer keys' and the compressor states'."""
    suffixes = {
        ".swa_cache": DeepseekSparseSWABackend,
        ".indexer.k_cache": DeepseekV4CPUIndexerBackend,
        ".state_cache": CompressorBackend,
    }
    return {
        name: next((b for s, b in suffixes.items() if name.endswith(s)), DeepseekV4CPUSparseBackend)
        for name in layer_specs(config)
    }


def resolve_layout(config: VllmConfig) -> None:
    """Set the cache layout as vLLM's engine core resolves it for the model's specs and the
    backends of its CPU layers (latent, sliding window, indexer keys, compressor state)."""
    # The backend classes are abstract to mypy, but vLLM only reads their class methods.
    backends: list[Any] = [
        DeepseekV4CPUSparseBackend,
        DeepseekSparseSWABackend,
        DeepseekV4CPUIndexerBackend,
        CompressorBackend,
    ]
    supported = get_supported_kv_cache_layouts(backends)
    resolve_kv_cache_layout(config, [[m.name for m in supported]], layer_specs(config).values())
