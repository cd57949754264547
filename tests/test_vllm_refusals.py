"""Every KV cache the connector cannot declare, and every setting it does not support, fails
start-up with an error naming the field, built where possible from vLLM 0.33's own objects:
the layer specs vLLM's layers declare for a cache dtype or attention type, vLLM's grouping,
``KVCacheConfig`` and allocation (:mod:`vllm_engines`), vLLM's connector factory.

(The conv state layout and the hybrid allocator's shared regions are in
``test_vllm_layout``; ``kv_connector_extra_config`` values in ``test_vllm_settings``.)
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_layout import attention_as
from vllm_engines import (
    allocate,
    cpu_engine,
    engine_config,
    init_vllm_distributed,
    kv_cache_config,
    shutdown_vllm_distributed,
    write_model,
)

# isort: split
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

from broker.errors import LayoutError
from clients.vllm.layout import ModelFacts, derive_rank_memory

NUM_BLOCKS = 3
#: The model's KV heads and Mamba2 groups, per preset.
FACTS = {"qwen3.5-0.8b": ModelFacts(2), "nemotron-h-8b": ModelFacts(8, 8)}


def built(
    preset: str,
    tmp_path: Path,
    tp: int = 1,
    layer_spec: Callable[[KVCacheSpec], KVCacheSpec] | None = None,
    **cache: Any,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's ``KVCacheConfig`` and cache views for ``preset`` at ``tp`` (``layer_spec``: what
    each layer declares instead of its own spec; ``cache``: ``CacheConfig`` fields)."""
    config = engine_config(write_model(preset, tmp_path / preset), tp, **cache)
    specs = cpu_engine.layer_specs(config)
    if layer_spec is not None:
        specs = {name: layer_spec(spec) for name, spec in specs.items()}
    kv_config = kv_cache_config(config, NUM_BLOCKS, specs=specs)
    return kv_config, allocate(config, kv_config)


def refused(
    kv_config: KVCacheConfig,
    caches: dict[str, torch.Tensor],
    facts: ModelFacts,
    field: str,
    message: str,
    tp: int = 1,
) -> None:
    with pytest.raises(LayoutError, match=message) as exc:
        derive_rank_memory(kv_config, caches, tp, 0, facts)
    assert exc.value.field == field, exc.value


def group_of(kv_config: KVCacheConfig, kind: type) -> int:
    return next(
        g
        for g, group in enumerate(kv_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, kind)
    )


def with_group_spec(kv_config: KVCacheConfig, g: int, spec: KVCacheSpec) -> KVCacheConfig:
    groups = list(kv_config.kv_cache_groups)
    groups[g] = dataclasses.replace(groups[g], kv_cache_spec=spec)
    return dataclasses.replace(kv_config, kv_cache_groups=groups)


# ------------------------------------------------------------------ attention


@pytest.mark.parametrize(
    "layer_spec",
    [
        attention_as(ChunkedLocalAttentionSpec, attention_chunk_size=8192),  # Llama 4
        attention_as(CrossAttentionSpec),  # encoder-decoder models
    ],
    ids=["chunked-local", "cross-attention"],
)
def test_attention_other_than_full_is_refused(
    tmp_path: Path, layer_spec: Callable[[KVCacheSpec], KVCacheSpec]
) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path, layer_spec=layer_spec)
    g = len(kv_config.kv_cache_groups) - 1
    name = type(kv_config.kv_cache_groups[g].kv_cache_spec).__name__
    refused(
        kv_config,
        caches,
        FACTS["qwen3.5-0.8b"],
        f"kv_cache_groups[{g}].kv_cache_spec",
        f"{name} is not supported; full attention, sliding-window attention, MLA and Mamba groups are",
    )


@pytest.mark.parametrize(
    ("cache_dtype", "mode"),
    [
        ("int8_per_token_head", "INT8_PER_TOKEN_HEAD"),
        ("fp8_per_token_head", "FP8_PER_TOKEN_HEAD"),
        ("int4_per_token_head", "INT4_PER_TOKEN_HEAD"),
        ("nvfp4", "NVFP4"),
        ("turboquant_k8v4", "TURBOQUANT_K8V4"),
    ],
)
def test_packed_or_scaled_kv_caches_are_refused(
    tmp_path: Path, cache_dtype: str, mode: str
) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path, cache_dtype=cache_dtype)
    g = group_of(kv_config, FullAttentionSpec)
    refused(
        kv_config,
        caches,
        FACTS["qwen3.5-0.8b"],
        f"kv_cache_groups[{g}].kv_cache_spec",
        rf"packed or scaled KV cache \({mode}\) is not supported",
    )


def test_layers_of_one_group_with_different_specs_are_refused(tmp_path: Path) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path)
    g = group_of(kv_config, FullAttentionSpec)
    group = kv_config.kv_cache_groups[g]
    spec = group.kv_cache_spec
    assert isinstance(spec, FullAttentionSpec)
    mixed = UniformTypeKVCacheSpecs(
        block_size=spec.block_size,
        kv_cache_specs={
            name: dataclasses.replace(spec, head_size=spec.head_size // (1 + i % 2))
            for i, name in enumerate(group.layer_names)
        },
    )
    refused(
        with_group_spec(kv_config, g, mixed),
        caches,
        FACTS["qwen3.5-0.8b"],
        f"kv_cache_groups[{g}].kv_cache_spec",
        "layers of the group differ in their spec",
    )


@pytest.mark.parametrize(
    ("facts", "tp", "field", "message"),
    [
        (ModelFacts(4), 1, "kv_cache_spec.num_kv_heads", "2 heads on rank 0 of 1, but 4 heads"),
        (ModelFacts(3), 1, "kv_cache_spec.num_kv_heads", "2 heads on rank 0 of 1, but 3 heads"),
    ],
)
def test_kv_heads_the_model_does_not_shard_into_are_refused(
    tmp_path: Path, facts: ModelFacts, tp: int, field: str, message: str
) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path, tp)
    g = group_of(kv_config, FullAttentionSpec)
    refused(kv_config, caches, facts, f"kv_cache_groups[{g}].{field}", message, tp)


def test_kv_heads_that_do_not_split_over_tp_are_refused(tmp_path: Path) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path, 2)
    refused(
        kv_config,
        caches,
        ModelFacts(3),
        "attention.total_num_kv_heads",
        "3 is not divisible by tp=2",
        tp=2,
    )


# ------------------------------------------------------------------ Mamba


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        (
            {"tp_replicated": True},
            "kv_cache_spec.shapes",
            r"only \(conv, ssm\) state that is sharded over TP is supported",
        ),
        (
            {"mamba_type": MambaAttentionBackendEnum.SHORT_CONV},  # LFM2
            "kv_cache_spec.mamba_type",
            "SHORT_CONV is not supported; Mamba1, Mamba2 and GDN are",
        ),
        (
            {"mamba_type": MambaAttentionBackendEnum.LINEAR},  # MiniMax linear attention
            "kv_cache_spec.mamba_type",
            "LINEAR is not supported; Mamba1, Mamba2 and GDN are",
        ),
    ],
)
def test_mamba_state_other_than_mamba1_mamba2_gdn_is_refused(
    tmp_path: Path, change: dict[str, Any], field: str, message: str
) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path)
    g = group_of(kv_config, MambaSpec)
    spec = dataclasses.replace(kv_config.kv_cache_groups[g].kv_cache_spec, **change)
    refused(
        with_group_spec(kv_config, g, spec),
        caches,
        FACTS["qwen3.5-0.8b"],
        f"kv_cache_groups[{g}].{field}",
        message,
    )


def test_conv_channels_the_sub_projections_do_not_cover_are_refused(tmp_path: Path) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path)
    g = group_of(kv_config, MambaSpec)
    spec = kv_config.kv_cache_groups[g].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    (dim, rows), ssm = spec.shapes
    wider = dataclasses.replace(spec, shapes=((dim + 1, rows), ssm))
    refused(
        with_group_spec(kv_config, g, wider),
        caches,
        FACTS["qwen3.5-0.8b"],
        f"kv_cache_groups[{g}].kv_cache_spec.shapes[0]",
        f"sub-projections cover {dim} of {dim + 1} conv channels",
    )


def test_mamba2_groups_the_state_does_not_hold_are_refused(tmp_path: Path) -> None:
    """Nemotron-H-8B has 8 B/C groups of 128 rows; declared as 4, the conv state's rows do
    not match."""
    kv_config, caches = built("nemotron-h-8b", tmp_path)
    g = group_of(kv_config, MambaSpec)
    refused(
        kv_config,
        caches,
        ModelFacts(8, 4),
        f"kv_cache_groups[{g}].kv_cache_spec.shapes[0]",
        "1024 B/C rows on rank 0, but 4 groups of 128 shard into 512",
    )


# ------------------------------------------------------------------ the cache tensors


def test_a_layer_without_a_cache_tensor_is_refused(tmp_path: Path) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path)
    name = kv_config.kv_cache_groups[0].layer_names[1]
    del caches[name]
    refused(
        kv_config,
        caches,
        FACTS["qwen3.5-0.8b"],
        "kv_cache_groups[0].layer_names[1]",
        f"no KV cache tensor for {name!r}",
    )


def test_layers_of_a_group_with_other_block_counts_are_refused(tmp_path: Path) -> None:
    kv_config, caches = built("qwen3.5-0.8b", tmp_path)
    name = kv_config.kv_cache_groups[0].layer_names[1]
    caches[name] = caches[name][: NUM_BLOCKS - 1]
    refused(
        kv_config,
        caches,
        FACTS["qwen3.5-0.8b"],
        "kv_cache_groups[0].layer_names",
        f"layers disagree on {NUM_BLOCKS} blocks of one stride",
    )


def test_groups_with_other_page_strides_are_refused(tmp_path: Path) -> None:
    """Without the hybrid allocator's common page, a Mamba group's pages would be smaller."""
    kv_config, caches = built("qwen3.5-0.8b", tmp_path)
    g = group_of(kv_config, MambaSpec)
    for name in kv_config.kv_cache_groups[g].layer_names:
        view = caches[name]
        half = view.stride(0) // 2
        caches[name] = view.as_strided((view.shape[0], 1, 1, half), (half, half, half, 1))
    refused(
        kv_config,
        caches,
        FACTS["qwen3.5-0.8b"],
        "kv_cache_groups",
        "groups disagree on the page stride",
    )


# ------------------------------------------------------------------ connector settings


@pytest.fixture(scope="module")
def vllm_distributed() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_vllm_distributed(port)
    yield
    shutdown_vllm_distributed()


@pytest.mark.parametrize(
    "setting",
    ["pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"],
)
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_pipeline_or_context_parallelism_fails_start_up(
    tmp_path: Path, setting: str, role: KVConnectorRole
) -> None:
    config = engine_config(
        write_model("qwen3.5-0.8b", tmp_path / "m"),
        1,
        role="kv_producer",
        engine_id="prefill-0",
        extra={"broker": "127.0.0.1:1"},
    )
    kv_config = kv_cache_config(config, NUM_BLOCKS)
    setattr(config.parallel_config, setting, 2)
    with pytest.raises(
        ValueError, match=rf"^parallel_config\.{setting}: 2; .*tensor parallelism only"
    ):
        KVConnectorFactory.create_connector(config, role, kv_config)


@pytest.mark.usefixtures("vllm_distributed")
def test_kv_both_fails_start_up(tmp_path: Path) -> None:
    config = engine_config(
        write_model("qwen3.5-0.8b", tmp_path / "m"),
        1,
        role="kv_both",
        engine_id="engine-0",
        extra={"broker": "127.0.0.1:1"},
    )
    with pytest.raises(ValueError, match="kv_role must be kv_producer .* or kv_consumer"):
        KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config(config, NUM_BLOCKS)
        )
