"""MLA (DeepSeek-V2-Lite) between real vLLM 0.33 schedulers and a live broker, on CPU.

Every TP rank of an MLA model caches the whole latent of each token (``kv_lora_rank`` +
``qk_rope_head_dim`` elements), so a decode rank reads it once, from one prefill rank: the
one vLLM's NIXL connector picks (``decode_rank * prefill_tp // decode_tp``); the other prefill
ranks are only released. The prefill ranks' pages hold different random bytes, so the bytes
each decode rank ends up with also say which prefill rank it read. Both sides run vLLM's Triton
MLA backend's layout (``[blocks, 1, tokens, latent]``) and prefill computes the whole prompt,
as for any attention model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_vllm_connector import (
    assert_poison_elsewhere,
    decode,
    prefill,
    rank_state,
    transfer_blocks,
    transfer_record,
)
from test_vllm_connector import (
    make_engine as connector_engine,
)
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    Engine,
    engine_config,
    init_vllm_distributed,
    shutdown_vllm_distributed,
    vllm_distributed,
    write_model,
)

# isort: split
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

from broker.v1 import broker_pb2 as pb
from clients.vllm.metadata import TRANSFER_ID
from harness.brokers import BrokerProcess

NUM_BLOCKS = 24
PRESET = "deepseek-v2-lite"
#: Elements of one token's latent in one layer: kv_lora_rank + qk_rope_head_dim.
LATENT = 512 + 64
LAYERS = 27


def make_engine(
    model_dir: Path, tp: int, role: str, engine_id: str, broker: str, cache_dtype: str
) -> Engine:
    cache = {"cache_dtype": cache_dtype}
    return connector_engine(
        model_dir,
        tp,
        role,
        engine_id,
        broker,
        cache,
        num_blocks=NUM_BLOCKS,
        backend=TritonMLABackend,
    )


def source_rank(decode_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """The prefill rank vLLM's NIXL connector reads an MLA decode rank's latent from."""
    return decode_rank * prefill_tp // decode_tp


def assert_latents_transferred(
    producer: Engine,
    prefill_blocks: list[list[int]],
    consumer: Engine,
    decode_blocks: list[list[int]],
    tokens: int,
) -> None:
    """Each decode rank holds, layer by layer, the latents of its source prefill rank, and
    poison everywhere the request does not own."""
    p_tp, d_tp = len(producer.caches), len(consumer.caches)
    for d in range(d_tp):
        actual = rank_state(consumer, d, decode_blocks, tokens)
        expected = rank_state(producer, source_rank(d, p_tp, d_tp), prefill_blocks, tokens)
        assert actual.keys() == expected.keys() and len(actual) == LAYERS
        for name, (want,) in expected.items():
            assert torch.equal(actual[name][0], want), f"rank {d} layer {name}"
    assert_poison_elsewhere(consumer, decode_blocks)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "cache_dtype", "itemsize"),
    [(2, 1, "auto", 2), (1, 2, "auto", 2), (2, 1, "fp8", 1)],  # bfloat16 or fp8 latents
)
def test_each_decode_rank_reads_the_latent_once(
    broker: BrokerProcess,
    tmp_path: Path,
    prefill_tp: int,
    decode_tp: int,
    cache_dtype: str,
    itemsize: int,
) -> None:
    model = write_model(PRESET, tmp_path / PRESET)
    producer = make_engine(
        model, prefill_tp, "kv_producer", "prefill-0", broker.address, cache_dtype
    )
    consumer = make_engine(model, decode_tp, "kv_consumer", "decode-0", broker.address, cache_dtype)
    try:
        free = producer.free_blocks
        prompt = list(range(1, 151))
        params = prefill(producer, "r1", prompt, backoff=0)
        assert params is not None
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        assert_latents_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            len(prompt),
        )
        record = transfer_record(broker, params[TRANSFER_ID])
        assert pb.TransferState.Name(record.state) == "TRANSFER_STATE_COMPLETED"
        # One copy of the latent per decode rank: 150 tokens in 10 pages of 16, all layers,
        # read from vLLM's source rank alone.
        one_copy = LAYERS * 10 * 16 * LATENT * itemsize
        plans = sorted(record.plans, key=lambda p: p.decode_rank)
        assert [(p.decode_rank, list(p.prefill_ranks)) for p in plans] == [
            (d, [source_rank(d, prefill_tp, decode_tp)]) for d in range(decode_tp)
        ]
        assert [(p.total_bytes, p.bytes_moved) for p in plans] == [(one_copy, one_copy)] * decode_tp
        # A prefill rank nobody reads is released all the same (at the claim).
        readers = {r.tp_rank: list(r.consumers) for r in record.releases}
        assert readers == {
            p: [d for d in range(decode_tp) if source_rank(d, prefill_tp, decode_tp) == p]
            for p in range(prefill_tp)
        }
        assert {pb.ReleaseReason.Name(r.reason) for r in record.releases} == {
            "RELEASE_REASON_COMPLETED"
        }
        assert producer.free_blocks == free  # the release freed the prefill blocks
    finally:
        consumer.close()
        producer.close()
