"""Kimi-Linear (KDA + MLA) between real vLLM 0.33 schedulers and a live broker, on CPU.

Kimi-Linear interleaves KDA layers (Kimi Delta Attention, whose state vLLM keeps as Gated
DeltaNet's: a conv over ``Q|K|V`` and a ``(heads, head_dim, head_dim)`` recurrent state, both
sharded over TP) with MLA layers (one latent per token, whole on every rank). Across TP sizes a
decode rank gathers or splits the KDA state like any GDN state, and reads each MLA latent
once, from the prefill rank vLLM's NIXL connector picks. Prefill computes all prompt tokens but
the last, as for any model with Mamba-like state. Both sides run vLLM's Triton MLA backend's
layout; the KV cache holds the preset's 27 layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_vllm_connector import (
    assert_poison_elsewhere,
    decode,
    expected_rank_state,
    global_state,
    prefill,
    rank_state,
    transfer_blocks,
    transfer_record,
)
from test_vllm_mla import make_engine, source_rank
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    Engine,
    init_vllm_distributed,
    shutdown_vllm_distributed,
    vllm_distributed,
    write_model,
)

# isort: split
from vllm.v1.kv_cache_interface import MambaSpec

from broker.v1 import broker_pb2 as pb
from clients.vllm.metadata import TRANSFER_ID
from harness.brokers import BrokerProcess

PRESET = "kimi-linear-48b-a3b"
#: Elements of one token's MLA latent: kv_lora_rank + qk_rope_head_dim.
LATENT = 512 + 64
MLA_LAYERS, KDA_LAYERS = 7, 20
#: Bytes of one KDA layer's state at TP 1: the conv over Q|K|V (3 x 32 heads x 128, 3 rows,
#: bfloat16), then the float32 recurrent state of 32 heads of 128 x 128.
KDA_STATE = 3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4


def assert_kimi_transferred(
    producer: Engine,
    prefill_blocks: list[list[int]],
    consumer: Engine,
    decode_blocks: list[list[int]],
    tokens: int,
) -> None:
    """Each decode rank holds its TP slice of every KDA layer's state and, in every MLA layer,
    the latents of its source prefill rank; poison everywhere the request does not own."""
    p_tp, d_tp = len(producer.caches), len(consumer.caches)
    kda = {
        name
        for group in producer.kv_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, MambaSpec)
        for name in group.layer_names
    }
    state = global_state(producer, prefill_blocks, tokens)
    for d in range(d_tp):
        actual = rank_state(consumer, d, decode_blocks, tokens)
        resharded = expected_rank_state({n: state[n] for n in kda}, consumer, d)
        latents = rank_state(producer, source_rank(d, p_tp, d_tp), prefill_blocks, tokens)
        assert len(actual) == MLA_LAYERS + KDA_LAYERS and len(resharded) == KDA_LAYERS
        for name, got in actual.items():
            want = resharded[name] if name in kda else latents[name]
            assert len(got) == len(want), name
            for g, w in zip(got, want):
                assert torch.equal(g, w), f"rank {d} layer {name}"
    assert_poison_elsewhere(consumer, decode_blocks)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "sources"),
    [
        (1, 2, [[0], [0]]),  # each decode rank: half the KDA heads and the whole latent
        (2, 1, [[0, 1]]),  # KDA gathered from both prefill ranks, the latent from rank 0 alone
    ],
)
def test_kda_state_reshards_and_each_latent_is_read_once(
    broker: BrokerProcess,
    tmp_path: Path,
    prefill_tp: int,
    decode_tp: int,
    sources: list[list[int]],
) -> None:
    model = write_model(PRESET, tmp_path / PRESET)
    producer = make_engine(model, prefill_tp, "kv_producer", "prefill-0", broker.address, "auto")
    consumer = make_engine(model, decode_tp, "kv_consumer", "decode-0", broker.address, "auto")
    try:
        free = producer.free_blocks
        prompt = list(range(1, 1501))
        params = prefill(producer, "r1", prompt, backoff=1)
        assert params is not None
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        # The load covered N-1 tokens: decode computes the last prompt token, then decodes.
        assert seen["scheduled"] == [1, 1, 1]
        assert_kimi_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            len(prompt) - 1,
        )
        record = transfer_record(broker, params[TRANSFER_ID])
        assert pb.TransferState.Name(record.state) == "TRANSFER_STATE_COMPLETED"
        # Per decode rank: its share of every KDA layer's state, and one copy of the latents
        # of 1920 tokens per MLA layer: 1499 tokens rounded up to decode's kernel blocks, at
        # most the tokens prefill's blocks hold; either way the one 1920-token block of TP 1
        # (TP 2's blocks hold 1024: the KDA state shrinks with TP, the latent does not).
        one_copy = KDA_LAYERS * KDA_STATE // decode_tp + MLA_LAYERS * 1920 * LATENT * 2
        plans = sorted(record.plans, key=lambda p: p.decode_rank)
        assert [list(p.prefill_ranks) for p in plans] == sources
        assert [(p.total_bytes, p.bytes_moved) for p in plans] == [(one_copy, one_copy)] * decode_tp
        assert {pb.ReleaseReason.Name(r.reason) for r in record.releases} == {
            "RELEASE_REASON_COMPLETED"
        }
        assert producer.free_blocks == free  # the release freed the prefill blocks
    finally:
        consumer.close()
        producer.close()
