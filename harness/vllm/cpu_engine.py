"""A vLLM 0.33 engine's configuration, KV-cache groups and cache tensors on CPU, from vLLM's
own pieces (the connector tests and ``pdbroker bench planner`` build engines with it).

A model's config comes from a preset's ``config.json`` (:data:`broker.presets.PRESET_CONFIGS`)
through vLLM's ``ModelConfig``/``VllmConfig``; a hybrid model's block size from vLLM's
``Platform._align_hybrid_block_size`` for an attention backend (FlashAttention: any multiple
of 16 tokens; FlashInfer: kernel blocks of 16, 32 or 64); Mamba state shapes and dtypes from
the model class's ``get_mamba_state_shape_from_config``/``get_mamba_state_dtype_from_config``;
KV-cache groups, the ``KVCacheConfig`` and the cache tensors from vLLM's own planner and
allocator. Only layer names and kinds come from our preset parser (vLLM learns them by
instantiating the model).

Importing this module sets ``VLLM_TARGET_DEVICE=cpu`` (the CUDA wheel on a CPU host: vLLM's
CPU platform, which supports the hybrid allocator) and ``VLLM_SSM_CONV_STATE_LAYOUT=DS``
unless they are set, before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, cast

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.platforms.interface import Platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.worker.utils import (
    allocate_kv_cache,
    customize_attention_spec,
    select_common_block_size,
)

from broker.layout import GroupKind
from broker.presets import PRESET_CONFIGS, model_from_hf_file
from harness.vllm import deepseek_v4

#: vLLM's Mamba backend of each model family (the mixer class's ``mamba_type``; Kimi-Linear's
#: KDA layer inherits GDN's).
MAMBA_TYPES = {
    "jamba": MambaAttentionBackendEnum.MAMBA1,
    "nemotron_h": MambaAttentionBackendEnum.MAMBA2,
    "qwen3_5": MambaAttentionBackendEnum.GDN_ATTN,
    "kimi_linear": MambaAttentionBackendEnum.GDN_ATTN,
}


def write_model(preset: str | Mapping[str, Any], directory: Path) -> Path:
    """A model directory holding the preset's ``config.json`` (or ``preset`` itself, a
    ``config.json`` object)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = PRESET_CONFIGS[preset] if isinstance(preset, str) else preset
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def vllm_config(
    model_dir: Path,
    tp: int,
    transfer: KVTransferConfig | None,
    connector: Any,
    backend: type = FlashAttentionBackend,
    speculative: dict[str, Any] | None = None,
    **cache: Any,
) -> VllmConfig:
    """vLLM's config of an engine serving ``model_dir`` at ``tp`` with ``transfer``, its KV
    cache layout the one ``connector`` (class) requires, a hybrid model's block size aligned
    for ``backend``; ``speculative``: ``SpeculativeConfig`` fields (e.g. MTP, or EAGLE with
    its head's directory as ``model``); ``cache``: more
    ``CacheConfig`` fields (e.g. ``block_size``; prefix caching is off unless set)."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, language_model_only=True)
    parallel = ParallelConfig(tensor_parallel_size=tp)
    config = VllmConfig(
        model_config=model,
        parallel_config=parallel,
        cache_config=CacheConfig(**{"enable_prefix_caching": False, **cache}),
        kv_transfer_config=transfer,
        speculative_config=SpeculativeConfig(
            target_model_config=model, target_parallel_config=parallel, **speculative
        )
        if speculative
        else None,
    )
    if deepseek_v4.is_deepseek_v4(config):
        config.cache_config.block_size = deepseek_v4.BLOCK_SIZE
        deepseek_v4.resolve_layout(config)
        return config
    # The engine core resolves the layout from the connector's requirement, else (vLLM's
    # NIXL connector under MLA) from the layouts the attention backend supports.
    config.cache_config.kv_cache_layout = connector.get_required_kvcache_layout(config)
    if config.cache_config.kv_cache_layout is None:
        supported = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
        resolve_kv_cache_layout(config, [supported])
    if model.is_hybrid:
        Platform._align_hybrid_block_size(config, backend)
    return config


class _MambaStateModel(Protocol):
    """What :func:`layer_specs` calls on a model class with Mamba state."""

    @classmethod
    def get_mamba_state_shape_from_config(
        cls, vllm_config: VllmConfig
    ) -> Iterable[tuple[int, ...]]: ...

    @classmethod
    def get_mamba_state_dtype_from_config(
        cls, vllm_config: VllmConfig
    ) -> Iterable[torch.dtype]: ...


def _layer_index(name: str) -> int:
    """The ``N`` of a ``...layers.N....`` layer name."""
    found = re.search(r"layers\.(\d+)\.", name)
    if found is None:
        raise ValueError(f"layer {name!r} has no index")
    return int(found.group(1))


#: Where each EAGLE drafter class numbers its decoder layers from: after the target model's
#: layers, as the class counts them (EAGLE: this pipeline stage's, EAGLE-3: all of them).
_EAGLE_FIRST_LAYER: dict[type, Callable[[VllmConfig], int]] = {
    EagleLlamaForCausalLM: lambda c: c.model_config.get_num_layers(c.parallel_config),
    Eagle3LlamaForCausalLM: lambda c: c.model_config.get_total_num_hidden_layers(),
}


def _drafter_layers(config: VllmConfig) -> list[str]:
    """The attention layers a speculative drafter registers after the model's own: Qwen3.5's
    MTP modules (full-attention decoder layers named ``mtp.layers.N``), or an EAGLE/EAGLE-3
    Llama head's decoder layers (``model.layers.N``, ``N`` counting on from the target's).
    None without a draft model (n-gram drafting keeps no KV)."""
    speculative = config.speculative_config
    draft = speculative.draft_model_config if speculative is not None else None
    if speculative is None or draft is None:
        return []
    if speculative.method == "mtp" and draft.hf_config.model_type == "qwen3_5_mtp":
        return [f"mtp.layers.{i}.self_attn.attn" for i in range(draft.hf_config.n_predict or 1)]
    if speculative.method in ("eagle", "eagle3"):
        draft_cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, model_config=draft)
        first = _EAGLE_FIRST_LAYER.get(draft_cls)
        if first is not None:
            start = first(config)
            return [
                f"model.layers.{start + i}.self_attn.attn"
                for i in range(draft.hf_config.num_hidden_layers)
            ]
    raise ValueError(f"no drafter layers known for {speculative.method!r} on this model")


def _attention_spec(
    model: ModelConfig, parallel: ParallelConfig, cache: CacheConfig, backend: type
) -> AttentionSpec:
    """The spec of ``model``'s full-attention layers at ``parallel``'s TP, stored in
    ``cache.cache_dtype`` (``--kv-cache-dtype``) as vLLM's attention layer declares it."""
    if model.use_mla:
        return customize_attention_spec(backend, _mla_spec(model, cache))
    return customize_attention_spec(
        backend,
        FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_size=model.get_head_size(),
            dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model),
            kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
        ),
    )


def _mla_spec(model: ModelConfig, cache: CacheConfig) -> MLAAttentionSpec:
    """The spec of an MLA model's layers, as ``MLAAttention.get_kv_cache_spec`` declares it
    for dense MLA (no sliding window, no sparse indexer): one latent head of the model's
    head size, the same on every TP rank."""
    return MLAAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=model.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model),
        cache_dtype_str=cache.cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
        state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(cache.cache_dtype),
    )


def layer_specs(
    config: VllmConfig, backend: type = FlashAttentionBackend
) -> dict[str, KVCacheSpec]:
    """Each KV-carrying layer's spec, in the order vLLM's model runner finds them (the
    model's layers by index, then a speculative drafter's), as the layers declare them
    (names and kinds from the model's ``config.json``, through our preset parser)."""
    if deepseek_v4.is_deepseek_v4(config):
        return deepseek_v4.layer_specs(config)
    model, cache = config.model_config, config.cache_config
    spec = model_from_hf_file(Path(model.model))
    layers = sorted(
        ((name, kind) for kind, names in spec.groups for name in names),
        key=lambda layer: _layer_index(layer[0]),
    )
    attention = _attention_spec(model, config.parallel_config, cache, backend)
    specs: dict[str, KVCacheSpec] = {name: attention for name, _ in layers}
    for g, (_, names) in enumerate(spec.groups):
        if spec.sliding_window(g):
            window = _sliding_window_spec(config, backend, spec.sliding_window(g))
            specs |= {name: window for name in names}
    if any(kind is GroupKind.MAMBA for _, kind in layers):
        mamba = _mamba_spec(config)
        specs |= {name: mamba for name, kind in layers if kind is GroupKind.MAMBA}
    speculative = config.speculative_config
    if speculative is None or speculative.draft_model_config is None:
        return specs
    drafter = _attention_spec(
        speculative.draft_model_config, speculative.draft_parallel_config, cache, backend
    )
    return specs | {name: drafter for name in _drafter_layers(config)}


def _sliding_window_spec(config: VllmConfig, backend: type, window: int) -> KVCacheSpec:
    """The spec vLLM's ``Attention`` layer declares with ``per_layer_sliding_window=window``
    (its own ``get_kv_cache_spec``, on the attributes it reads)."""
    model, cache = config.model_config, config.cache_config
    layer = SimpleNamespace(
        attn_type=AttentionType.DECODER,
        sliding_window=window,
        attn_backend=backend,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(),
        head_size_v=model.get_head_size(),
        kv_cache_dtype=cache.cache_dtype,
        kv_cache_torch_dtype=model.dtype,
    )
    spec = Attention.get_kv_cache_spec(cast(Attention, layer), config)
    assert spec is not None
    return spec


def _mamba_spec(config: VllmConfig) -> MambaSpec:
    """The spec of the model's Mamba layers, from its model class."""
    model, cache = config.model_config, config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    # resolve_model_cls is typed as returning any module class; for these models it is one
    # with Mamba state, whose classmethods vLLM's IsHybrid protocol only partly declares.
    stateful = cast("type[_MambaStateModel]", model_cls)
    return MambaSpec(
        shapes=tuple(stateful.get_mamba_state_shape_from_config(config)),
        dtypes=tuple(stateful.get_mamba_state_dtype_from_config(config)),
        block_size=cache.mamba_block_size or cache.block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MAMBA_TYPES[model.hf_config.model_type],
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=config.num_speculative_tokens,
    )


def kv_cache_config(
    config: VllmConfig,
    num_blocks: int,
    backend: type = FlashAttentionBackend,
    specs: dict[str, KVCacheSpec] | None = None,
) -> KVCacheConfig:
    """vLLM's grouping and placement of the model's layers (``specs``, by default
    :func:`layer_specs`) over ``num_blocks`` blocks."""
    groups = get_kv_cache_groups(config, specs or layer_specs(config, backend))
    probe = get_kv_cache_config_from_groups(config, groups, 1 << 50)
    per_block = probe.kv_cache_tensors[0].size // probe.num_blocks
    return get_kv_cache_config_from_groups(config, groups, per_block * num_blocks)


def allocate(
    config: VllmConfig, kv_config: KVCacheConfig, backend: type = FlashAttentionBackend
) -> dict[str, torch.Tensor]:
    """The per-layer cache views a worker hands ``register_kv_caches``."""
    kernel_block_sizes = [
        select_common_block_size(g.kv_cache_spec.block_size, [backend], [g.kv_cache_spec])
        if isinstance(g.kv_cache_spec, FullAttentionSpec)
        else g.kv_cache_spec.block_size
        for g in kv_config.kv_cache_groups
    ]
    return allocate_kv_cache(
        kv_config,
        torch.device("cpu"),
        config.cache_config.get_resolved_kv_cache_layout(),
        kernel_block_sizes,
    )
