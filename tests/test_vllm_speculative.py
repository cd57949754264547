"""Speculative decoding (MTP on a hybrid model, EAGLE on an attention model) through the
connector, with real vLLM 0.33 schedulers on CPU, a live broker and NIXL reads of
vLLM-allocated caches (see ``test_vllm_connector``).

With MTP, vLLM gives every Mamba/GDN group of a request speculative scratch blocks after its
running-state block, and the drafter's attention layers join the model's in the KV cache:
only the running state may move (never a scratch block), the drafter's KV must move with the
model's, and decode must go straight on with the last prompt token. With EAGLE on an
attention model the drafter's layers join the model's one attention group, and prefill
computes the whole prompt (vLLM's prefill backoff is 0: an EAGLE drafter reads one token
ahead, which the prompt's last token's sampled successor supplies). A prefill engine whose
speculative configuration differs from decode's in a way the state cannot bridge must be
refused at the first request, saying which settings differ, not recomputed in silence.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import (
    assert_transferred,
    decode,
    prefill,
    transfer_blocks,
    transfer_record,
    transfer_state,
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
from vllm.v1.kv_cache_interface import MambaSpec

from clients.vllm.metadata import TRANSFER_ID
from harness.brokers import BrokerProcess

#: Every request holds a block per Mamba group for its state and two scratch blocks.
NUM_BLOCKS = 24


def mtp(drafts: int) -> dict[str, Any] | None:
    """Qwen3.5's MTP drafter (one full-attention decoder layer, run once per draft token);
    None for no speculative decoding."""
    return {"method": "mtp", "num_speculative_tokens": drafts} if drafts else None


def mtp_model(directory: Path) -> Path:
    """Qwen3.5-0.8B's config with its MTP module (``mtp_num_hidden_layers``, as published)."""
    model = write_model("qwen3.5-0.8b", directory)
    config = json.loads((model / "config.json").read_text())
    config.get("text_config", config)["mtp_num_hidden_layers"] = 1
    (model / "config.json").write_text(json.dumps(config))
    return model


#: A small Llama-class model (Llama-3's layer structure: grouped-query attention, no head_dim).
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
#: Its EAGLE heads: one decoder layer of the model's shape (as yuhuili/EAGLE-LLaMA3-Instruct-8B
#: for Llama-3-8B); EAGLE-3's architecture as in yuhuili/EAGLE3-LLaMA3.1-Instruct-8B.
EAGLE_HEADS = {
    "eagle": {**LLAMA, "num_hidden_layers": 1},
    "eagle3": {
        **LLAMA,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": 1024,
    },
}


def llama_with_eagle(directory: Path, method: str) -> tuple[Path, Path]:
    """The model's directory and its ``method`` head's, each holding its ``config.json``."""
    paths = (directory / "model", directory / f"{method}-head")
    for path, config in zip(paths, (LLAMA, EAGLE_HEADS[method])):
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config))
    return paths


def eagle(method: str, head: Path, drafts: int) -> dict[str, Any]:
    return {"method": method, "model": str(head), "num_speculative_tokens": drafts}


def make_engine(
    model: Path, tp: int, role: str, engine_id: str, broker: str, speculative: Any
) -> Engine:
    cache = {"speculative": speculative}
    return connector_engine(model, tp, role, engine_id, broker, cache, num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize(("drafts", "decode_tp"), [(2, 1), (3, 2)])
def test_mtp_moves_the_running_state_and_the_drafters_kv(
    broker: BrokerProcess, tmp_path: Path, drafts: int, decode_tp: int
) -> None:
    model = mtp_model(tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address, mtp(drafts))
    consumer = make_engine(model, decode_tp, "kv_consumer", "decode-0", broker.address, mtp(drafts))
    try:
        drafter = [n for g in producer.kv_config.kv_cache_groups for n in g.layer_names]
        assert "mtp.layers.0.self_attn.attn" in drafter
        free = producer.free_blocks
        prompt = list(range(1, 1201))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        held = producer.block_ids("r1")
        specs = [g.kv_cache_spec for g in producer.kv_config.kv_cache_groups]
        # Each Mamba group holds its running state and a scratch block per draft token, all
        # filled with distinct bytes: reading a scratch block would fail the comparison below.
        mamba_blocks = [len(ids) for ids, s in zip(held, specs) if isinstance(s, MambaSpec)]
        assert mamba_blocks == [1 + drafts] * 3
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        # No recompute: the last prompt token, and a slot for each draft token vLLM reserves.
        assert seen["scheduled"][0] == 1 + drafts
        assert_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            len(prompt) - 1,
        )
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(
    ("prefill_drafts", "decode_drafts", "named"),
    [
        # Prefill's caches lack the drafter's attention layer.
        (0, 2, ["groups[3].layers", "decode alone has 1 (mtp.layers.0.self_attn.attn)"]),
        # A conv state keeps a row per draft token: the states differ in shape.
        (1, 3, ["segments['conv.Q'].shape", "(2048, 4), decode (2048, 6)", "num_speculative"]),
    ],
)
def test_speculative_settings_that_differ_are_refused_naming_them(
    broker: BrokerProcess,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    prefill_drafts: int,
    decode_drafts: int,
    named: list[str],
) -> None:
    """The first request is refused with an error that names what differs (the transfer
    aborted, prefill's blocks freed); vLLM computes the prompt."""
    model = mtp_model(tmp_path / "m")
    producer = make_engine(
        model, 1, "kv_producer", "prefill-0", broker.address, mtp(prefill_drafts)
    )
    consumer = make_engine(model, 1, "kv_consumer", "decode-0", broker.address, mtp(decode_drafts))
    try:
        free = producer.free_blocks
        prompt = list(range(1, 801))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        with caplog.at_level(logging.WARNING):
            seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"][0] >= len(prompt)
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_ABORTED"
        assert producer.free_blocks == free
        refusals = [r.getMessage() for r in caplog.records if "load of r1 failed" in r.getMessage()]
        assert refusals and all(part in refusals[0] for part in named), refusals
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(("method", "drafts", "decode_tp"), [("eagle", 3, 1), ("eagle3", 2, 2)])
def test_eagle_moves_the_models_and_the_drafters_kv(
    broker: BrokerProcess, tmp_path: Path, method: str, drafts: int, decode_tp: int
) -> None:
    """The drafter's layer (``model.layers.4``, after the model's four) shares the model's
    attention group; prefill computes and publishes every prompt token, all of which move."""
    model, head = llama_with_eagle(tmp_path, method)
    speculative = eagle(method, head, drafts)
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address, speculative)
    consumer = make_engine(model, decode_tp, "kv_consumer", "decode-0", broker.address, speculative)
    try:
        (group,) = producer.kv_config.kv_cache_groups
        assert group.layer_names == [f"model.layers.{i}.self_attn.attn" for i in range(5)]
        free = producer.free_blocks
        prompt = list(range(1, 301))
        params = prefill(producer, "r1", prompt, backoff=0)
        assert params is not None
        assert transfer_record(broker, params[TRANSFER_ID]).num_tokens == len(prompt)
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        # No recompute: vLLM computes the last prompt token again for its logits, with a
        # slot for each draft token.
        assert seen["scheduled"][0] == 1 + drafts
        assert_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            len(prompt),
        )
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free
    finally:
        consumer.close()
        producer.close()


def test_an_eagle_drafter_on_decode_alone_is_refused_naming_its_layer(
    broker: BrokerProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill serves the model without speculative decoding, decode with EAGLE: both publish
    and expect every prompt token, but decode's cache holds the drafter's layer too. The first
    request is refused naming it, the transfer aborted (prefill frees), the prompt computed."""
    model, head = llama_with_eagle(tmp_path, "eagle")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address, None)
    consumer = make_engine(
        model, 1, "kv_consumer", "decode-0", broker.address, eagle("eagle", head, 2)
    )
    try:
        free = producer.free_blocks
        prompt = list(range(1, 301))
        params = prefill(producer, "r1", prompt, backoff=0)
        assert params is not None
        with caplog.at_level(logging.WARNING):
            seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"][0] >= len(prompt)
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_ABORTED"
        assert producer.free_blocks == free
        refusals = [r.getMessage() for r in caplog.records if "load of r1 failed" in r.getMessage()]
        named = ["groups[0].layers", "decode alone has 1 (model.layers.4.self_attn.attn)"]
        assert refusals and all(part in refusals[0] for part in named), refusals
    finally:
        consumer.close()
        producer.close()
