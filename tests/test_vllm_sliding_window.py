"""Sliding-window attention (gpt-oss: sliding and full attention in alternate layers) through
the connector, with real vLLM 0.33 schedulers on CPU, a live broker and NIXL reads of
vLLM-allocated caches (see ``test_vllm_connector``).

A prompt several windows long: the full-attention group moves every token, the
sliding-window group only the blocks holding the window of the token decode computes next
(vLLM has already replaced the blocks before it with its null block, on both engines). The
prefill engine's out-of-window pages are never read (the plans move exactly the in-window
and full-attention bytes), decode's memory outside the request's blocks keeps its poison (the
null block included), and decode goes straight on: an attention-only model's prefill
computes the whole prompt (backoff 0) and decode computes the last token again for its
logits.
"""

from __future__ import annotations

from itertools import dropwhile
from pathlib import Path

import pytest
from test_vllm_connector import (
    assert_transferred,
    decode,
    make_engine,
    prefill,
    transfer_blocks,
    transfer_record,
)
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    init_vllm_distributed,
    shutdown_vllm_distributed,
    vllm_distributed,
    write_model,
)

# isort: split
import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from broker.layout import window_blocks
from broker.v1 import broker_pb2 as pb
from clients.vllm.metadata import TRANSFER_ID, ConnectorSettings
from clients.vllm.scheduler import SchedulerHalf
from harness.brokers import BrokerProcess
from harness.vllm import cpu_engine

#: gpt-oss-20b: 24 layers, half of them in each group; 8 KV heads of 64, K and V, bfloat16.
LAYERS_PER_GROUP = 12
KV_BYTES_PER_TOKEN = 8 * 64 * 2 * 2
#: Blocks for a prompt of a few hundred tokens in each group (the window group frees its
#: out-of-window blocks only once the prompt is computed).
NUM_BLOCKS = 80


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "prompt_len"),
    [
        (1, 1, 512),  # the window starts on a block: prefill's null block is in vLLM's tail
        (1, 2, 500),  # KV heads split on decode; the window starts inside a block
        (2, 1, 456),  # gathered from two prefill ranks
        # The window of token prompt_len starts on a block: the block before it holds the
        # first token of the window of the token decode computes again (prompt_len - 1).
        (1, 1, 207),
        (1, 2, 335),
    ],
)
def test_the_full_group_and_the_window_move(
    broker: BrokerProcess, tmp_path: Path, prefill_tp: int, decode_tp: int, prompt_len: int
) -> None:
    model = write_model("gpt-oss-20b", tmp_path / "m")
    producer = make_engine(
        model, prefill_tp, "kv_producer", "prefill-0", broker.address, num_blocks=NUM_BLOCKS
    )
    consumer = make_engine(
        model, decode_tp, "kv_consumer", "decode-0", broker.address, num_blocks=NUM_BLOCKS
    )
    try:
        specs = [g.kv_cache_spec for g in producer.kv_config.kv_cache_groups]
        sliding = [g for g, s in enumerate(specs) if isinstance(s, SlidingWindowSpec)]
        assert sliding == [0] and len(specs) == 2
        window, block = specs[0].sliding_window, specs[0].block_size
        assert (window, block) == (128, 16)
        free = producer.free_blocks
        prompt = list(range(1, prompt_len + 1))
        params = prefill(producer, "r1", prompt, backoff=0)
        assert params is not None
        record = transfer_record(broker, params[TRANSFER_ID])
        assert record.num_tokens == prompt_len
        # The blocks holding the window of token prompt_len (from prompt_len - window + 1 on),
        # on both engines: the same positions in each request's block table.
        first = (prompt_len - window + 1) // block
        held = transfer_blocks(producer, "r1")
        in_window = [held[0][first:], held[1]]
        assert set(held[0][:first]) == {0}  # vLLM's null block: out of the window, freed
        assert 0 not in in_window[0]
        # vLLM's own clipping (the window's blocks plus one) keeps the null blocks it reaches
        # (one, at 512 and 207 tokens); the published list holds only real pages.
        keep = window // block + 1
        assert held[0][-keep:].count(0) == max(0, first - (len(held[0]) - keep))
        assert [list(g.ids) for g in record.block_ids] == in_window
        # Decode computes token prompt_len - 1 again, whose window (the token itself and the
        # window - 1 before it, as vLLM's sliding-window manager counts) starts one token
        # earlier, at prompt_len - window. vLLM sizes the tables of both engines by the
        # window of token prompt_len, so where that is a block start, the block holding
        # token prompt_len - window is vLLM's null block on both engines: no connector can
        # move the token and decode's attention reads the null block for it.
        manager = consumer.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        assert manager.get_num_skipped_tokens(prompt_len - 1) == prompt_len - window
        recomputed_from = (prompt_len - window) // block
        on_boundary = (prompt_len - window + 1) % block == 0
        assert (held[0][recomputed_from] == 0) == on_boundary
        seen = decode(consumer, "r1", prompt, params, producer)
        # No recompute: vLLM computes the last prompt token again for its logits.
        assert seen["scheduled"][0] == 1
        loaded = transfer_blocks(consumer, "r1", seen["blocks"])
        assert set(loaded[0][:first]) == {0}
        assert (loaded[0][recomputed_from] == 0) == on_boundary
        window_tokens = prompt_len - first * block
        assert_transferred(
            producer,
            in_window,
            consumer,
            [loaded[0][first:], loaded[1]],
            [window_tokens, prompt_len],
        )
        record = transfer_record(broker, params[TRANSFER_ID])
        assert pb.TransferState.Name(record.state) == "TRANSFER_STATE_COMPLETED"
        # Whole pages (the kernel block is the page): the window's, and every full one.
        pages = -(-prompt_len // block)
        moved = sum(p.total_bytes for p in record.plans)
        assert moved == LAYERS_PER_GROUP * KV_BYTES_PER_TOKEN * ((pages - first) + pages) * block
        assert producer.free_blocks == free  # the release freed the prefill blocks
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(("window", "block_size"), [(128, 16), (129, 16), (100, 32)])
def test_the_window_lists_are_vllms_without_its_null_blocks(window: int, block_size: int) -> None:
    """The connector publishes and loads what vLLM's NIXL scheduler exchanges, less the null
    blocks heading a window group's list: for block tables as vLLM keeps them (the skipped
    blocks replaced by its null block) and before it frees them (tokens still in flight).
    A window one token past a block boundary puts two null blocks in vLLM's lists, which the
    broker would refuse (a block id twice)."""
    head = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.bfloat16}
    groups = [
        KVCacheGroupSpec(
            ["s"], SlidingWindowSpec(block_size=block_size, sliding_window=window, **head)
        ),
        KVCacheGroupSpec(["f"], FullAttentionSpec(block_size=block_size, **head)),
    ]
    kv_config = KVCacheConfig(256, [], groups)
    vllm, ours = both_schedulers(block_size, kv_config)
    nulls = set()
    for tokens in range(1, 8 * window):
        pages = -(-tokens // block_size)
        full = list(range(100, 100 + pages))
        for skipped in {max(0, tokens - window + 1) // block_size, 0}:
            table = [0] * skipped + list(range(1 + skipped, pages + 1))
            window_ids, full_ids = vllm.get_exchange_clipped_blocks((table, full))
            nulls.add(list(window_ids).count(0))
            expected = (tuple(dropwhile(lambda b: b == 0, window_ids)), tuple(full_ids))
            assert ours.transfer_blocks((table, full)) == expected
            assert 0 not in expected[0] and len(expected[0]) <= vllm.blocks_per_sw[0]
    assert nulls == ({0, 1, 2} if window % block_size == 1 else {0, 1})


def nixl_config(block_size: int) -> VllmConfig:
    """A kv_both engine's config for vLLM's NIXL connector, no model; its KV-cache layout
    resolved (as the engine core does) to the one our connector requires."""
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", engine_id="e"
        ),
    )
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


def both_schedulers(
    block_size: int, kv_config: KVCacheConfig
) -> tuple[NixlPullConnectorScheduler, SchedulerHalf]:
    """vLLM's NIXL scheduler and ours over the same KV-cache groups."""
    config = nixl_config(block_size)
    return (
        NixlPullConnectorScheduler(config, "e", kv_config),
        SchedulerHalf(config, kv_config, ConnectorSettings.from_extra_config({"broker": "x:1"})),
    )


@pytest.mark.parametrize("speculative_blocks", [0, 2])
def test_window_and_mamba_groups_clip_in_one_pass_as_vllms(speculative_blocks: int) -> None:
    """A sliding-window group beside Mamba2 groups (Nemotron-H with ``sliding_window``), grouped
    by vLLM's hybrid allocator: each exchange keeps the window group's tail (less the null
    blocks heading it) and each Mamba group's running-state block alone, as vLLM's NIXL
    scheduler clips both in one ``get_exchange_clipped_blocks`` pass."""
    window, block_size = 100, 16
    head = {"num_kv_heads": 2, "head_size": 8, "dtype": torch.bfloat16}
    sliding = SlidingWindowSpec(block_size=block_size, sliding_window=window, **head)
    mamba = MambaSpec(
        block_size=block_size,
        shapes=((3, 28), (8, 2, 3)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=sliding.page_size_bytes,
        num_speculative_blocks=speculative_blocks,
    )
    specs: dict[str, KVCacheSpec] = {f"m.{i}": mamba for i in range(4)}
    specs |= {"s.0": sliding, "s.1": sliding}
    kv_config = cpu_engine.kv_cache_config(nixl_config(block_size), 256, specs=specs)
    kinds = [type(g.kv_cache_spec) for g in kv_config.transfer_groups]
    assert sorted(k.__name__ for k in kinds) == ["MambaSpec", "MambaSpec", "SlidingWindowSpec"]
    vllm, ours = both_schedulers(block_size, kv_config)
    assert sorted(vllm.blocks_per_sw) == [0, 0, window_blocks(window, block_size)]
    tail_lengths = set()
    for tokens in range(1, 4 * window, 7):
        pages = -(-tokens // block_size)
        skipped = max(0, tokens - window + 1) // block_size
        tables = {
            SlidingWindowSpec: [0] * skipped + list(range(1 + skipped, pages + 1)),
            MambaSpec: [0] * (pages - 1) + list(range(200, 201 + speculative_blocks)),
        }
        block_ids = tuple(tables[kind] for kind in kinds)
        clipped = vllm.get_exchange_clipped_blocks(block_ids)
        expected = tuple(
            tuple(dropwhile(lambda b: b == 0, ids)) if kind is SlidingWindowSpec else tuple(ids)
            for ids, kind in zip(clipped, kinds)
        )
        assert ours.transfer_blocks(block_ids) == expected
        for ids, kind in zip(expected, kinds):
            assert ids == (200,) if kind is MambaSpec else 0 not in ids
            if kind is SlidingWindowSpec:
                tail_lengths.add(len(ids))
    # Short prompts move whole, long ones the window's blocks (plus one, less the null block).
    assert min(tail_lengths) == 1 and max(tail_lengths) == window_blocks(window, block_size)
