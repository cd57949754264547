"""Sliding-window attention through the connector: the block lists its scheduler half
exchanges are vLLM's NIXL connector's, less the null blocks vLLM pads skipped blocks with."""

from __future__ import annotations

from itertools import dropwhile

import pytest
from vllm_engines import write_model  # noqa: F401  (configures vLLM for CPU first)

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
    SlidingWindowSpec,
)

from clients.vllm.metadata import ConnectorSettings
from clients.vllm.scheduler import SchedulerHalf


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
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", engine_id="e"
        ),
    )
    vllm = NixlPullConnectorScheduler(config, "e", kv_config)
    ours = SchedulerHalf(config, kv_config, ConnectorSettings.from_extra_config({"broker": "x:1"}))
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
