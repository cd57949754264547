"""Decode-side prefix caching through the connector, with real vLLM 0.33 schedulers on CPU, a
live broker and NIXL reads of vLLM-allocated caches (see ``test_vllm_connector``).

The decode engine caches prefixes as vLLM does for hybrid models (``mamba_cache_mode=align``:
attention pages by block hash, Mamba state only at block boundaries). Its first request
loads everything. A second turn of the conversation (the first prompt, its answer and a new
question) finds the first turn's attention pages in decode's cache, but no Mamba state
there (a loaded state sits at N-1 tokens, not on a block boundary): the connector declares
that it completes such a divergent hit, so only the attention pages past the hit and each
Mamba group's state move, and the cached pages stay as they were. A prompt decode already
holds whole (its state loaded on a block boundary) moves nothing: the transfer completes
without a read and prefill frees its blocks at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_vllm_connector import (
    assert_same_state,
    assert_transferred,
    decode,
    prefill,
    transfer_blocks,
    transfer_state,
)
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    Engine,
    engine_config,
    init_vllm_distributed,
    kv_cache_config,
    shutdown_vllm_distributed,
    storage_bytes,
    vllm_distributed,
    write_model,
)

# isort: split
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec

from clients.vllm.metadata import TRANSFER_ID
from clients.vllm.scheduler import held_tokens
from harness.brokers import BrokerProcess

#: Room for both turns' blocks (with a Mamba block per attention page in align mode).
NUM_BLOCKS = 48


def engines(model: Path, prefill_tp: int, broker: str) -> tuple[Engine, Engine]:
    """A prefill engine (no prefix caching) and a TP1 decode engine caching prefixes."""
    extra = {"broker": broker, "model_name": "test-model"}
    producer = Engine(
        engine_config(model, prefill_tp, role="kv_producer", engine_id="prefill-0", extra=extra),
        NUM_BLOCKS,
    )
    consumer = Engine(
        engine_config(
            model,
            1,
            role="kv_consumer",
            engine_id="decode-0",
            extra=extra,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
        ),
        NUM_BLOCKS,
        poison=True,
    )
    return producer, consumer


def attention_group(engine: Engine) -> tuple[int, int]:
    """The attention group's index and block size (tokens per page)."""
    (g,) = [
        i
        for i, group in enumerate(engine.kv_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, FullAttentionSpec)
    ]
    return g, engine.kv_config.kv_cache_groups[g].kv_cache_spec.block_size


def pages(engine: Engine, group: int, blocks: list[int]) -> list[torch.Tensor]:
    """Copies of every layer's pages of ``blocks`` in ``group`` on rank 0, as bytes (random
    bytes hold NaNs, which never compare equal as floats)."""
    cache = engine.caches[0]
    out = []
    for name in engine.kv_config.kv_cache_groups[group].layer_names:
        view = cache[name]
        ratio = view.shape[0] // engine.kv_config.num_blocks
        out += [view[b * ratio : (b + 1) * ratio].view(torch.uint8).clone() for b in blocks]
    return out


@pytest.mark.parametrize(
    ("preset", "prefill_tp"),
    [
        ("qwen3.5-0.8b", 1),  # GDN
        ("nemotron-3-nano-30b-a3b", 2),  # Mamba2, gathered from two prefill ranks
    ],
)
def test_a_second_turn_reads_only_what_decode_does_not_hold(
    broker: BrokerProcess, tmp_path: Path, preset: str, prefill_tp: int
) -> None:
    model = write_model(preset, tmp_path / preset)
    producer, consumer = engines(model, prefill_tp, broker.address)
    try:
        g, block_size = attention_group(consumer)
        free = producer.free_blocks
        first = list(range(1, block_size + 113))
        params = prefill(producer, "turn-1", first)
        assert params is not None
        sent = transfer_blocks(producer, "turn-1")
        seen = decode(consumer, "turn-1", first, params, producer)
        assert seen["scheduled"] == [1, 1, 1]
        loaded = transfer_blocks(consumer, "turn-1", seen["blocks"])
        assert_transferred(producer, sent, consumer, loaded, len(first) - 1)
        cached = loaded[g][:1]  # the first turn's full page, in decode's prefix cache
        before = pages(consumer, g, cached)

        # The first prompt, the three tokens decode answered, and a new question.
        second = first + [9, 9, 9] + list(range(5000, 5400))
        params = prefill(producer, "turn-2", second)
        assert params is not None
        sent = transfer_blocks(producer, "turn-2")
        seen = decode(consumer, "turn-2", second, params, producer)
        assert seen["scheduled"] == [1, 1, 1]  # no recompute
        loaded = transfer_blocks(consumer, "turn-2", seen["blocks"])
        assert loaded[g][:1] == cached  # the hit: decode's own page
        # Past the hit, the attention tail and every Mamba group's state came from prefill.
        assert_same_state(
            producer,
            [ids[1:] if i == g else ids for i, ids in enumerate(sent)],
            consumer,
            [ids[1:] if i == g else ids for i, ids in enumerate(loaded)],
            len(second) - 1 - block_size,
        )
        after = pages(consumer, g, cached)
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # the hit was not read
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free
    finally:
        consumer.close()
        producer.close()


def test_a_prompt_decode_holds_whole_moves_nothing(broker: BrokerProcess, tmp_path: Path) -> None:
    """The prompt's published tokens end on a block boundary, so decode's first load caches
    the Mamba state there too: asked again, decode holds it all and reads nothing."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer, consumer = engines(model, 1, broker.address)
    try:
        _, block_size = attention_group(consumer)
        free = producer.free_blocks
        prompt = list(range(1, 2 * block_size + 2))  # publishes 2 * block_size tokens
        params = prefill(producer, "first", prompt)
        assert params is not None
        decode(consumer, "first", prompt, params, producer)
        memory = [storage_bytes(next(iter(c.values()))).clone() for c in consumer.caches]

        params = prefill(producer, "again", prompt)
        assert params is not None
        seen = decode(consumer, "again", prompt, params, producer)
        assert seen["scheduled"] == [1, 1, 1]
        assert seen["blocks"] is None  # never waited for a load
        for before, cache in zip(memory, consumer.caches):
            assert torch.equal(before, storage_bytes(next(iter(cache.values()))))
        # Done, not abandoned: the transfer completes without a read, prefill's blocks freed.
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free
    finally:
        consumer.close()
        producer.close()


def test_held_tokens_are_the_cached_pages_every_attention_group_starts_with(
    tmp_path: Path,
) -> None:
    """What decode says it holds when it needs nothing read: its cached attention pages (a
    hit vLLM reconciled below the published tokens is no such claim)."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    kv_config = kv_cache_config(engine_config(model, 1), NUM_BLOCKS)
    g = next(
        i
        for i, group in enumerate(kv_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, FullAttentionSpec)
    )
    block_size = kv_config.kv_cache_groups[g].kv_cache_spec.block_size

    def block(block_id: int, cached: bool) -> KVCacheBlock:
        made = KVCacheBlock(block_id)
        if cached:
            made.set_block_hash(BlockHashWithGroupId(block_id.to_bytes(8, "little")))
        return made

    def held(attention: list[bool]) -> int:
        groups = tuple(
            [block(10 + j, c) for j, c in enumerate(attention)] if i == g else [block(i, False)]
            for i in range(len(kv_config.kv_cache_groups))
        )
        return held_tokens(kv_config, KVCacheBlocks(groups))

    assert held([True, True, False]) == 2 * block_size
    assert held([False, False, False]) == 0
    assert held([]) == 0
