"""DeepSeek-V4 (sliding-window and compressed MLA) through the layout the connector derives
from vLLM 0.33's own objects: the specs DeepSeek-V4's cache layers declare, vLLM's grouping
and block-outermost allocation (:mod:`harness.vllm.deepseek_v4`); then between real vLLM
schedulers on CPU, a live broker and NIXL reads (see ``test_vllm_connector``).

vLLM cannot run DeepSeek-V4's layers here (its CPU kernels need AMX, its GPU ones CUDA), so the
end-to-end test fills the prefill pages with random bytes, as the other connector tests do.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_vllm_connector import decode, prefill, transfer_record
from test_vllm_connector import make_engine as connector_engine
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    POISON,
    Engine,
    allocate,
    engine_config,
    kv_cache_config,
    storage_bytes,
    vllm_distributed,
    write_model,
)

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
from broker.v1 import broker_pb2 as pb
from clients.vllm.layout import ModelFacts, derive_rank_memory, model_fingerprint
from clients.vllm.metadata import TRANSFER_ID
from harness.brokers import BrokerProcess
from harness.vllm import deepseek_v4

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


@pytest.mark.parametrize(
    ("tp", "cache_dtype"), [(1, "auto"), (2, "auto"), (2, "fp8"), (1, "fp8_ds_mla")]
)
def test_segments_address_exactly_each_layers_pages(
    tp: int, cache_dtype: str, tmp_path: Path
) -> None:
    """For every group, writing its layers' cache views changes exactly the bytes its
    segments address in every row (no padding, nothing of another layer), and each segment
    reads back its layer's page entry by entry; every rank declares the same. The plain-row
    cache in bfloat16 or per-tensor fp8 (e4m3, the latent and sliding-window caches), and the
    packed fp8_ds_mla one (latent pages of bytes)."""
    _, kv_config, caches = engine(tmp_path, tp, cache_dtype=cache_dtype)
    memories = [derive(kv_config, caches, tp, r) for r in range(tp)]
    layout = memories[0].layout
    assert all(m.layout.groups == layout.groups for m in memories)
    latent = next(s for g in layout.groups for s in g.segments if s.tensor == "model.layers.1.attn")
    dtypes = {"auto": "bfloat16", "fp8": "float8_e4m3fn", "fp8_ds_mla": "uint8"}
    assert latent.dtype == dtypes[cache_dtype]
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


def test_packed_fp8_ds_mla_pages_are_one_entry_of_the_whole_block(tmp_path: Path) -> None:
    """The packed latents (584 bytes per entry, a block's scales after all its values) are
    declared as one entry of the whole block, their content without the 576-byte alignment
    padding; the other caches keep their entries, padded to 576 bytes too."""
    _, kv_config, caches = engine(tmp_path, 2, cache_dtype="fp8_ds_mla")
    layout = derive(kv_config, caches, 2, 1).layout
    packed = 0
    for group, declared in zip(kv_config.transfer_groups, layout.groups):
        specs = group.kv_cache_spec.kv_cache_specs  # type: ignore[attr-defined]
        for seg in declared.segments:
            spec = specs[seg.tensor]
            assert spec.alignment == 576 and seg.nbytes == spec.real_page_size_bytes
            if spec.state_content_bytes:
                packed += 1
                assert spec.state_content_bytes == 584
                assert (seg.shape, seg.dtype) == ((1, seg.nbytes), "uint8")
                assert seg.tokens_per_entry == declared.block_size == spec.block_size
            else:
                assert seg.tokens_per_entry == spec.tokens_per_state
    assert packed == 7  # four sliding-window latents, three compressed ones


def test_the_packed_nvfp4_ds_mla_cache_is_refused_naming_the_spec(tmp_path: Path) -> None:
    """The packed NVFP4 format is refused at start-up, naming the spec, the format and the
    field."""
    _, kv_config, caches = engine(tmp_path, 1, cache_dtype="nvfp4_ds_mla")
    with pytest.raises(LayoutError) as err:
        derive(kv_config, caches, 1, 0)
    assert err.value.field.endswith(".kv_cache_spec.state_content_bytes")
    assert "SlidingWindowMLASpec" in err.value.detail and "nvfp4_ds_mla" in err.value.detail


def test_a_bounded_replay_window_is_refused(tmp_path: Path) -> None:
    """DeepSeek-V4.1's sliding window under bounded replay (decode replays the window after a
    load, so prefill must stop short of it) is refused at start-up, naming the field."""
    config = engine_config(write_model(CONFIG, tmp_path / "dsv4"), 1)
    specs = {
        name: replace(spec, bounded_replay=True) if isinstance(spec, SlidingWindowMLASpec) else spec
        for name, spec in deepseek_v4.layer_specs(config).items()
    }
    kv_config = kv_cache_config(config, NUM_BLOCKS, specs=specs)
    with pytest.raises(LayoutError) as err:
        derive(kv_config, allocate(config, kv_config), 1, 0)
    assert err.value.field.endswith(".kv_cache_spec.bounded_replay")


# ------------------------------------------------------------------ end to end

#: Blocks for a 300-token prompt in every group (they share one pool: 75 of the 4-token
#: compressor-state group alone), on both engines.
E2E_BLOCKS = 160


def make_engine(
    model: Path, tp: int, role: str, engine_id: str, broker: str, cache_dtype: str
) -> Engine:
    return connector_engine(
        model, tp, role, engine_id, broker, {"cache_dtype": cache_dtype}, num_blocks=E2E_BLOCKS
    )


def moved_blocks(engine: Engine, block_ids: tuple[list[int], ...]) -> list[list[int]]:
    """The blocks vLLM's NIXL connector moves per group: a sliding-window group's last
    ``ceil(window / block_size) + 1`` (``get_exchange_clipped_blocks``), others whole; never
    vLLM's null block (0)."""
    out = []
    for group, ids in zip(engine.kv_config.transfer_groups, block_ids):
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None) or 0
        keep = -(-window // spec.block_size) + 1 if window else len(ids)
        out.append([b for b in list(ids)[-keep:] if b != 0])
    return out


def page(engine: Engine, rank: int, name: str, block: int) -> torch.Tensor:
    return engine.caches[rank][name][block].view(torch.uint8).flatten()


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "cache_dtype"),
    [(1, 2, "auto"), (2, 1, "auto"), (1, 2, "fp8_ds_mla"), (2, 1, "fp8_ds_mla")],
)
def test_in_window_and_compressed_pages_move_once_per_decode_rank(
    broker: BrokerProcess, tmp_path: Path, prefill_tp: int, decode_tp: int, cache_dtype: str
) -> None:
    """A prompt of 300 tokens: longer than every window (128 tokens for the sliding-window
    caches and the ratio-128 compressor state, 8 for the ratio-4 ones). Each decode rank gets,
    from vLLM's source rank (``d * P // D``), every layer's page of the blocks vLLM's
    connector would move, byte for byte; the bytes the plans move are exactly those pages'
    content (no alignment padding, no row tail, no out-of-window block, one copy per decode
    rank); everything else on decode keeps its poison. The bfloat16 plain rows, and the packed
    fp8_ds_mla pages (each moved whole)."""
    model = write_model(CONFIG, tmp_path / "dsv4")
    producer = make_engine(
        model, prefill_tp, "kv_producer", "prefill-0", broker.address, cache_dtype
    )
    consumer = make_engine(model, decode_tp, "kv_consumer", "decode-0", broker.address, cache_dtype)
    try:
        groups = producer.kv_config.transfer_groups
        prompt = list(range(1, 301))
        params = prefill(producer, "r1", prompt, backoff=0)
        assert params is not None
        p_moved = moved_blocks(producer, producer.block_ids("r1"))
        seen = decode(consumer, "r1", prompt, params, producer)
        d_moved = moved_blocks(consumer, seen["blocks"])
        # Windows clip: 3 of the 5 sliding-window blocks, 17 of the 38 ratio-128 compressor
        # state blocks, 2 of the 75 ratio-4 ones (the third block vLLM's rule keeps is out
        # of the 8-token window, already its null block); both compressed blocks whole.
        by_block_size = sorted(
            (g.kv_cache_spec.block_size, len(ids)) for g, ids in zip(groups, d_moved)
        )
        assert by_block_size == [(4, 2), (8, 17), (64, 3), (64, 3), (256, 2)]
        assert [len(ids) for ids in d_moved] == [len(ids) for ids in p_moved]
        content = 0  # bytes of the moved pages, per decode rank
        for group, p_ids, d_ids in zip(groups, p_moved, d_moved):
            specs = group.kv_cache_spec.kv_cache_specs  # type: ignore[attr-defined]
            content += len(d_ids) * sum(specs[n].real_page_size_bytes for n in group.layer_names)
        for d in range(decode_tp):
            source = d * prefill_tp // decode_tp
            memory = storage_bytes(next(iter(consumer.caches[d].values())))
            written = torch.zeros(memory.numel(), dtype=torch.bool)
            base = memory.data_ptr()
            for group, p_ids, d_ids in zip(groups, p_moved, d_moved):
                for name in group.layer_names:
                    for p_block, d_block in zip(p_ids, d_ids):
                        got = page(consumer, d, name, d_block)
                        assert torch.equal(got, page(producer, source, name, p_block)), name
                        view = consumer.caches[d][name][d_block]
                        assert view.is_contiguous()
                        start = view.data_ptr() - base
                        written[start : start + got.numel()] = True
            assert bool((memory[~written] == POISON).all()), f"decode rank {d}"
        record = transfer_record(broker, params[TRANSFER_ID])
        assert pb.TransferState.Name(record.state) == "TRANSFER_STATE_COMPLETED"
        plans = sorted(record.plans, key=lambda p: p.decode_rank)
        assert [(p.decode_rank, list(p.prefill_ranks)) for p in plans] == [
            (d, [d * prefill_tp // decode_tp]) for d in range(decode_tp)
        ]
        assert [(p.total_bytes, p.bytes_moved) for p in plans] == [(content, content)] * decode_tp
    finally:
        consumer.close()
        producer.close()
