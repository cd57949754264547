"""A sliding-window group beside Mamba2 state through the connector: Nemotron-H-8B's public
``config.json`` with a ``sliding_window`` (vLLM 0.33's Nemotron-H gives every attention layer
the config's window; no public checkpoint sets one), real vLLM 0.33 schedulers on CPU, a live
broker and NIXL reads of vLLM-allocated caches (see ``test_vllm_connector``).

A prompt several windows long: each Mamba group moves its running-state block, the window
group only the blocks holding the window of the token decode computes next (vLLM has
replaced the ones before with its null block), byte-exact, and decode's memory outside those
blocks keeps its poison.
"""

from __future__ import annotations

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
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from broker.preset_configs import PRESET_CONFIGS
from broker.v1 import broker_pb2 as pb
from clients.vllm.metadata import TRANSFER_ID
from harness.brokers import BrokerProcess

WINDOW = 1000
#: Blocks for a prompt of a few thousand tokens in the window group and a state block (and
#: its null padding) in each Mamba group.
NUM_BLOCKS = 24


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "prompt_len"),
    [
        (1, 1, 3500),  # the window starts inside a block
        (2, 1, 3080),  # gathered from two prefill ranks; the window starts on a block
    ],
)
def test_the_window_tail_and_the_mamba_state_move(
    broker: BrokerProcess, tmp_path: Path, prefill_tp: int, decode_tp: int, prompt_len: int
) -> None:
    model = write_model(
        {**PRESET_CONFIGS["nemotron-h-8b"], "sliding_window": WINDOW}, tmp_path / "m"
    )
    producer = make_engine(
        model, prefill_tp, "kv_producer", "prefill-0", broker.address, num_blocks=NUM_BLOCKS
    )
    consumer = make_engine(
        model, decode_tp, "kv_consumer", "decode-0", broker.address, num_blocks=NUM_BLOCKS
    )
    try:
        specs = [g.kv_cache_spec for g in producer.kv_config.kv_cache_groups]
        windowed = [g for g, s in enumerate(specs) if isinstance(s, SlidingWindowSpec)]
        assert len(windowed) == 1 and all(
            isinstance(s, MambaSpec) for g, s in enumerate(specs) if g not in windowed
        )
        sw = windowed[0]
        window, block = specs[sw].sliding_window, specs[sw].block_size
        assert window == WINDOW and 2 * block < prompt_len
        free = producer.free_blocks
        prompt = list(range(1, prompt_len + 1))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        tokens = prompt_len - 1  # decode computes the last token from the state after them
        record = transfer_record(broker, params[TRANSFER_ID])
        assert record.num_tokens == tokens
        # The window group's blocks holding the window of token `tokens`; the rest are null.
        first = (tokens - window + 1) // block
        held = transfer_blocks(producer, "r1")
        assert first > 0 and set(held[sw][:first]) == {0}
        published = [list(g.ids) for g in record.block_ids]
        assert published == [ids[first:] if g == sw else ids for g, ids in enumerate(held)]
        assert all(len(ids) == 1 for g, ids in enumerate(published) if g != sw)
        seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"][0] == 1  # no recompute
        loaded = transfer_blocks(consumer, "r1", seen["blocks"])
        assert set(loaded[sw][:first]) == {0}
        assert_transferred(
            producer,
            [ids[first:] if g == sw else ids for g, ids in enumerate(held)],
            consumer,
            [ids[first:] if g == sw else ids for g, ids in enumerate(loaded)],
            [tokens - first * block if g == sw else tokens for g in range(len(specs))],
        )
        record = transfer_record(broker, params[TRANSFER_ID])
        assert pb.TransferState.Name(record.state) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free  # the release freed the prefill blocks
    finally:
        consumer.close()
        producer.close()
