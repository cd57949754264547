"""Model families and cache dtypes through the connector, with real vLLM 0.33 schedulers on CPU,
a live broker and NIXL reads of vLLM-allocated caches (see ``test_vllm_connector``).

Jamba (Mamba1 + attention, AI21-Jamba-1.5-Mini's config): the conv state holds one
sub-projection, ``x``, split over TP ranks with the SSM state. An fp8 KV cache
(``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``) is one byte per element, which vLLM stores as
``uint8`` whatever the format: the bytes must move unchanged, and engines whose KV caches hold
different formats (or fp8 against bfloat16) must be refused, naming the dtype, and recomputed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_vllm_connector import (
    assert_transferred,
    decode,
    make_engine,
    prefill,
    transfer_blocks,
    transfer_state,
)
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    init_vllm_distributed,
    shutdown_vllm_distributed,
    vllm_distributed,
    write_model,
)

# isort: split
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from clients.vllm.metadata import TRANSFER_ID
from harness.brokers import BrokerProcess


@pytest.mark.parametrize(
    ("preset", "prefill_tp", "decode_tp", "cache_dtype", "prompt_len"),
    [
        ("jamba-1.5-mini", 1, 1, "auto", 430),  # Mamba1, through vLLM's connector factory
        ("jamba-1.5-mini", 1, 2, "auto", 430),  # x, SSM state and KV heads split on decode
        ("jamba-1.5-mini", 2, 1, "fp8_e5m2", 430),  # gathered from two ranks, e5m2 KV
        ("qwen3.5-0.8b", 1, 2, "fp8", 1500),  # GDN with fp8 (e4m3) KV
    ],
)
def test_the_state_moves_byte_for_byte(
    broker: BrokerProcess,
    tmp_path: Path,
    preset: str,
    prefill_tp: int,
    decode_tp: int,
    cache_dtype: str,
    prompt_len: int,
) -> None:
    model = write_model(preset, tmp_path / preset)
    cache = {"cache_dtype": cache_dtype}
    producer = make_engine(model, prefill_tp, "kv_producer", "prefill-0", broker.address, cache)
    consumer = make_engine(model, decode_tp, "kv_consumer", "decode-0", broker.address, cache)
    try:
        specs = [g.kv_cache_spec for g in consumer.kv_config.kv_cache_groups]
        (attention,) = [s for s in specs if isinstance(s, FullAttentionSpec)]
        assert attention.dtype.itemsize == (2 if cache_dtype == "auto" else 1)
        assert any(isinstance(s, MambaSpec) for s in specs)
        free = producer.free_blocks
        prompt = list(range(1, prompt_len + 1))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"] == [1, 1, 1]  # the last prompt token, then two decoded
        assert_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            prompt_len - 1,
        )
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(
    ("prefill_dtype", "decode_dtype", "named"),
    [
        ("fp8", "auto", "prefill fp8_e4m3, decode bfloat16"),
        ("fp8", "fp8_e5m2", "prefill fp8_e4m3, decode fp8_e5m2"),
    ],
)
def test_kv_caches_of_other_dtypes_are_refused_naming_the_dtype(
    broker: BrokerProcess,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    prefill_dtype: str,
    decode_dtype: str,
    named: str,
) -> None:
    """The first request is refused with an error naming the KV dtypes (the transfer
    aborted, prefill's blocks freed); vLLM computes the whole prompt."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(
        model, 1, "kv_producer", "prefill-0", broker.address, {"cache_dtype": prefill_dtype}
    )
    consumer = make_engine(
        model, 1, "kv_consumer", "decode-0", broker.address, {"cache_dtype": decode_dtype}
    )
    try:
        free = producer.free_blocks
        prompt = list(range(1, 801))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        with caplog.at_level(logging.WARNING):
            seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"][0] == len(prompt)
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_ABORTED"
        assert producer.free_blocks == free
        refusals = [r.getMessage() for r in caplog.records if "load of r1 failed" in r.getMessage()]
        assert refusals and all(
            part in refusals[0] for part in ("segments['kv'].dtype: ", named)
        ), refusals
    finally:
        consumer.close()
        producer.close()
