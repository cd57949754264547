"""DeepSeek-V4 (sliding-window and compressed MLA) through the layout the connector derives
from vLLM 0.33's own objects: the specs DeepSeek-V4's cache layers declare, vLLM's grouping
and block-outermost allocation (:mod:`harness.vllm.deepseek_v4`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vllm_engines import allocate, engine_config, kv_cache_config, storage_bytes, write_model

# isort: split
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
import torch
from vllm.v1.kv_cache_interface import (
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)

from broker.errors import LayoutError
from broker.layout import EngineLayout
from clients.vllm.layout import ModelFacts, derive_rank_memory, model_fingerprint

#: DeepSeek-V4's attention schedule in four layers: a sliding-window-only layer, then
#: compressed layers of ratio 4 (with an indexer) and 128; the rest as the public model's.
CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "torch_dtype": "bfloat16",
}
NUM_BLOCKS = 5


def engine(tmp_path: Path, tp: int, **cache):
    config = engine_config(write_model(CONFIG, tmp_path / "dsv4"), tp, **cache)
    kv_config = kv_cache_config(config, NUM_BLOCKS)
    return config, kv_config, allocate(config, kv_config)


def derive(kv_config, caches, tp: int, rank: int):
    return derive_rank_memory(kv_config, caches, tp, rank, ModelFacts(1, 0, "auto"))


def test_vllm_packs_the_caches_in_block_rows(tmp_path: Path) -> None:
    """What vLLM allocates: groups of the sliding-window caches (window 128, 64-token
    blocks), one of the compressed latents and indexer keys (256-token blocks), one per
    compressor state size; a block-outermost layout: one allocation of block rows."""
    config, kv_config, _ = engine(tmp_path, 1)
    assert config.cache_config.get_resolved_kv_cache_layout().is_block_outermost
    summary = []
    for group in kv_config.transfer_groups:
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        members = set(spec.kv_cache_specs.values())
        windows = {getattr(s, "sliding_window", None) or 0 for s in members}
        ratios = {s.tokens_per_state for s in members}
        summary.append((spec.block_size, tuple(windows), tuple(sorted(ratios)), len(members)))
    assert sorted(summary) == sorted(
        [
            (64, (128,), (1,), 1),
            (64, (128,), (1,), 1),
            (256, (0,), (4, 128), 3),
            (4, (8,), (1,), 2),
            (8, (128,), (1,), 1),
        ]
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_segments_address_exactly_each_layers_pages(tp: int, tmp_path: Path) -> None:
    """For every group, writing its layers' cache views changes exactly the bytes its
    segments address in every row (no padding, nothing of another layer), and each segment
    reads back its layer's page entry by entry; every rank declares the same."""
    _, kv_config, caches = engine(tmp_path, tp)
    memories = [derive(kv_config, caches, tp, r) for r in range(tp)]
    layout = memories[0].layout
    assert all(m.layout.groups == layout.groups for m in memories)
    ((region,),) = {m.regions for m in memories}
    memory = storage_bytes(next(iter(caches.values())))
    base = memory.untyped_storage().data_ptr()
    assert (region.base_addr, region.length_bytes) == (base, NUM_BLOCKS * layout.page_bytes)
    rows = memory[: region.length_bytes].numpy().reshape(NUM_BLOCKS, layout.page_bytes)
    generator = torch.Generator().manual_seed(0)
    for g, (group, declared) in enumerate(zip(kv_config.transfer_groups, layout.groups)):
        memory.zero_()
        for seg, name in zip(declared.segments, group.layer_names, strict=True):
            assert seg.tensor == name and seg.shard_axis is None
            page_bytes = caches[name].view(torch.uint8)
            page_bytes.copy_(torch.randint(1, 256, page_bytes.shape, generator=generator))
        covered = np.zeros(layout.page_bytes, dtype=bool)
        for seg, name in zip(declared.segments, group.layer_names):
            starts, length = seg.runs()
            at = (starts[:, None] + np.arange(length)).ravel()
            covered[at] = True
            for block in range(NUM_BLOCKS):
                page = caches[name][block].view(torch.uint8).flatten().numpy()
                np.testing.assert_array_equal(rows[block, at], page, err_msg=f"group {g} {name}")
        assert (rows[:, ~covered] == 0).all() and (rows[:, covered] != 0).all(), f"group {g}"


def test_windows_and_compressed_entries_are_vllms(tmp_path: Path) -> None:
    """Sliding-window groups keep vLLM's window, compressed latents and indexer keys one entry
    per ``tokens_per_state`` tokens; the fingerprint does not depend on the TP size."""
    _, kv_config, caches = engine(tmp_path, 2)
    layout = derive(kv_config, caches, 2, 1).layout
    for group, declared in zip(kv_config.transfer_groups, layout.groups):
        specs = group.kv_cache_spec.kv_cache_specs  # type: ignore[attr-defined]
        for seg in declared.segments:
            spec = specs[seg.tensor]
            assert isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec))
            assert seg.tokens_per_entry == spec.tokens_per_state
            assert seg.nbytes == spec.real_page_size_bytes
        windows = {getattr(s, "sliding_window", None) or 0 for s in specs.values()}
        assert {declared.sliding_window} == windows
        assert declared.block_size == group.kv_cache_spec.block_size
    ranks = tuple(derive(kv_config, caches, 2, r).layout for r in range(2))
    two = EngineLayout("dsv4", 2, ranks)
    _, kv_one, caches_one = engine(tmp_path, 1)
    one = derive(kv_one, caches_one, 1, 0).layout
    assert model_fingerprint("dsv4", one) == model_fingerprint("dsv4", two.ranks[0])


def test_the_packed_fp8_ds_mla_cache_is_refused_naming_the_spec(tmp_path: Path) -> None:
    """The packed format (NoPE fp8, RoPE bf16 and scales in 584 bytes per token) is refused
    at start-up, naming the spec, the format and the field."""
    _, kv_config, caches = engine(tmp_path, 1, cache_dtype="fp8_ds_mla")
    with pytest.raises(LayoutError) as err:
        derive(kv_config, caches, 1, 0)
    assert err.value.field.endswith(".kv_cache_spec.state_content_bytes")
    assert "SlidingWindowMLASpec" in err.value.detail and "fp8_ds_mla" in err.value.detail
