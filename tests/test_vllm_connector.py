"""The connector between real vLLM 0.33 schedulers and a live broker, on CPU.

Each test runs a ``pdbroker serve`` process and two engines in this process
(:class:`vllm_engines.Engine`): vLLM's own ``Scheduler`` builds the scheduler-side connector,
each TP rank has a vLLM-allocated KV cache and a worker-side connector with its own NIXL agent
(UCX over loopback). The prefill request's pages are filled with random bytes (standing in
for the model's forward pass); after the decode engine's load every layer's state is read
back through vLLM's own views (attention ``[blocks, heads, tokens, K|V]``, Mamba conv and SSM
state as vLLM packs them) and compared with the prefill state, resharded by vLLM's TP rules
(heads, and each conv sub-projection, split evenly over ranks). Decode memory starts as a
poison value that must survive everywhere the request does not own.

Failures must end in vLLM's recompute path (``kv_load_failure_policy=recompute``): the load is
reported in ``failed_recving``, vLLM resets the request and computes its whole prompt, and the
prefill engine still frees its blocks.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    POISON,
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
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import Request, RequestStatus

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from clients.vllm.metadata import (
    BROKER,
    DO_REMOTE_PREFILL,
    NUM_TOKENS,
    PREFILL_ENGINE,
    TRANSFER_ID,
)
from harness.brokers import BrokerProcess

NUM_BLOCKS = 12
#: Seconds a request may take on one engine (loads and releases travel in the background).
DEADLINE_S = 60.0


def make_engine(
    model_dir: Path,
    tp: int,
    role: str,
    engine_id: str,
    broker: str,
    cache: dict[str, Any] | None = None,
    *,
    num_blocks: int = NUM_BLOCKS,
    backend: type = FlashAttentionBackend,
    **extra: Any,
) -> Engine:
    """An engine with this connector on ``backend``'s cache layout; ``cache``: ``CacheConfig``
    fields (e.g. ``cache_dtype``) and ``speculative``, ``extra``: more
    ``kv_connector_extra_config`` keys."""
    config = engine_config(
        model_dir,
        tp,
        backend=backend,
        role=role,
        engine_id=engine_id,
        extra={"broker": broker, "model_name": "test-model", **extra},
        **(cache or {}),
    )
    return Engine(config, num_blocks, backend, poison=role == "kv_consumer")


# ------------------------------------------------------------------ driving requests


def prefill(
    engine: Engine, request_id: str, prompt: list[int], backoff: int = 1
) -> dict[str, Any] | None:
    """Run the prefill leg (``do_remote_decode``), fill its pages, return its output's
    ``kv_transfer_params``. The engine computes all prompt tokens but the last ``backoff``
    (Mamba models: one, decode computes the last token from the state after N-1)."""
    request = engine.add(request_id, prompt, 1, {"do_remote_decode": True})
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        _, outputs = engine.step()
        for output in outputs:
            if output.request_id == request_id and output.finished:
                if request_id in engine.scheduler.requests:  # blocks kept for the decode engine
                    fill_pages(engine, request_id)
                assert request.num_prompt_tokens == len(prompt) - backoff
                return output.kv_transfer_params
    raise AssertionError("the prefill request did not finish")


def decode(
    engine: Engine,
    request_id: str,
    prompt: list[int],
    params: dict[str, Any] | None,
    prefill_engine: Engine,
    max_tokens: int = 3,
) -> dict[str, Any]:
    """Run the decode leg to its end while the prefill engine keeps stepping (it collects
    releases). Returns what happened: the blocks the load wrote into, the tokens each
    compute step scheduled for the request, and whether the prefill engine freed its blocks."""
    return follow(engine, engine.add(request_id, prompt, max_tokens, params), prefill_engine)


def follow(engine: Engine, request: Request, prefill_engine: Engine) -> dict[str, Any]:
    """:func:`decode` of a request already added to ``engine``."""
    request_id = request.request_id
    seen: dict[str, Any] = {"scheduled": [], "released": False, "blocks": None}
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        out, _ = engine.step(token=9)
        if seen["blocks"] is None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            seen["blocks"] = engine.block_ids(request_id)  # where the load writes
        if out.num_scheduled_tokens.get(request_id):
            seen["scheduled"].append(out.num_scheduled_tokens[request_id])
        prefill_engine.step()
        if request_id not in prefill_engine.scheduler.requests:
            seen["released"] = True
        if request.is_finished() and seen["released"]:
            return seen
        time.sleep(0.005)
    raise AssertionError(f"decode did not finish: {request.status}, {seen}")


# ------------------------------------------------------------------ state through vLLM's views


def transfer_blocks(
    engine: Engine,
    request_id: str,
    block_ids: tuple[list[int], ...] | None = None,
) -> list[list[int]]:
    """The request's blocks per KV-cache group; a Mamba group's running-state block alone
    (vLLM's rule: not its speculative scratch blocks, not the blocks before it)."""
    groups = block_ids if block_ids is not None else engine.block_ids(request_id)
    specs = [g.kv_cache_spec for g in engine.kv_config.kv_cache_groups]
    return [
        clip_ssm_state_blocks(list(ids), s.num_speculative_blocks)
        if isinstance(s, MambaSpec)
        else list(ids)
        for ids, s in zip(groups, specs)
    ]


def fill_pages(engine: Engine, request_id: str) -> None:
    """Random bytes in every layer's pages of every block the request holds (a Mamba
    group's scratch blocks too), on every rank."""
    generator = torch.Generator().manual_seed(hash(request_id) % 2**31)
    for cache in engine.caches:
        for group, ids in zip(engine.kv_config.kv_cache_groups, engine.block_ids(request_id)):
            for name in group.layer_names:
                view = cache[name]
                ratio = view.shape[0] // engine.kv_config.num_blocks
                for block in ids:
                    pages = view[block * ratio : (block + 1) * ratio].view(torch.uint8)
                    pages.copy_(
                        torch.randint(0, 256, pages.shape, dtype=torch.uint8, generator=generator)
                    )


def rank_state(
    engine: Engine,
    rank: int,
    blocks: list[list[int]],
    tokens: int | Sequence[int],
) -> dict[str, list[torch.Tensor]]:
    """Per layer, the request's state on one rank as vLLM's views hold it, in bytes:
    attention ``[heads, tokens, K|V bytes]`` (the first ``tokens`` its blocks hold, or a
    count per group); Mamba ``[conv (dim, rows bytes), ssm (first axis, rest bytes)]`` from
    the page as vLLM packs it (conv state, then SSM)."""
    state: dict[str, list[torch.Tensor]] = {}
    counts = [tokens] * len(blocks) if isinstance(tokens, int) else tokens
    for group, ids, count in zip(engine.kv_config.kv_cache_groups, blocks, counts):
        spec = group.kv_cache_spec
        for name in group.layer_names:
            view = engine.caches[rank][name]
            if isinstance(spec, MambaSpec):
                page = view[ids[0]].reshape(-1).view(torch.uint8)
                (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes, spec.dtypes
                conv_bytes = conv_shape[0] * conv_shape[1] * conv_dtype.itemsize
                ssm_bytes = torch.Size(ssm_shape).numel() * ssm_dtype.itemsize
                state[name] = [
                    page[:conv_bytes].reshape(conv_shape[0], -1),
                    page[conv_bytes : conv_bytes + ssm_bytes].reshape(ssm_shape[0], -1),
                ]
            else:
                ratio = view.shape[0] // engine.kv_config.num_blocks
                pages = [
                    view[b * ratio : (b + 1) * ratio].transpose(0, 1).flatten(1, 2) for b in ids
                ]
                state[name] = [torch.cat(pages, 1)[:, :count].contiguous().view(torch.uint8)]
    return state


def conv_pieces(engine: Engine) -> list[int]:
    """Global rows of the conv sub-projections, from the model's config (none without Mamba
    layers)."""
    if not engine.kv_config.has_mamba_layers:
        return []
    config = engine.config.model_config.hf_text_config
    model_type = engine.config.model_config.hf_config.model_type
    if model_type == "jamba":  # Mamba1: x alone
        return [config.mamba_expand * config.hidden_size]
    if model_type == "nemotron_h":
        groups = config.n_groups * config.ssm_state_size
        return [config.mamba_num_heads * config.mamba_head_dim, groups, groups]
    if model_type == "kimi_linear":  # KDA: Q|K|V of as many heads each
        linear = config.linear_attn_config
        return [linear["num_heads"] * linear["head_dim"]] * 3
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    return [keys, keys, config.linear_num_value_heads * config.linear_value_head_dim]


def global_state(
    engine: Engine, blocks: list[list[int]], tokens: int | Sequence[int]
) -> dict[str, list[torch.Tensor]]:
    """The request's global state: every rank's slices put back together (heads, each conv
    sub-projection and SSM heads split evenly over the TP ranks, in rank order)."""
    tp = len(engine.caches)
    ranks = [rank_state(engine, r, blocks, tokens) for r in range(tp)]
    local = [n // tp for n in conv_pieces(engine)]
    merged = {}
    for name, parts in ranks[0].items():
        if len(parts) == 1:
            merged[name] = [torch.cat([r[name][0] for r in ranks])]
            continue
        convs = [r[name][0].split(local) for r in ranks]
        merged[name] = [
            torch.cat([torch.cat([c[i] for c in convs]) for i in range(len(local))]),
            torch.cat([r[name][1] for r in ranks]),
        ]
    return merged


def expected_rank_state(
    state: dict[str, list[torch.Tensor]],
    engine: Engine,
    rank: int,
) -> dict[str, list[torch.Tensor]]:
    """One rank's slice of the global state under ``engine``'s TP."""
    tp = len(engine.caches)

    def part(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.split(n // tp)[rank]

    pieces = conv_pieces(engine)
    return {
        name: [part(parts[0], parts[0].shape[0])]
        if len(parts) == 1
        else [
            torch.cat([part(p, n) for p, n in zip(parts[0].split(pieces), pieces)]),
            part(parts[1], parts[1].shape[0]),
        ]
        for name, parts in state.items()
    }


def assert_same_state(
    prefill_engine: Engine,
    prefill_blocks: list[list[int]],
    decode_engine: Engine,
    decode_blocks: list[list[int]],
    tokens: int | Sequence[int],
) -> None:
    """Every decode rank's blocks hold its slice of the state prefill's blocks hold (the
    first ``tokens`` tokens of the attention blocks given, or a count per group)."""
    state = global_state(prefill_engine, prefill_blocks, tokens)
    for rank in range(len(decode_engine.caches)):
        actual = rank_state(decode_engine, rank, decode_blocks, tokens)
        expected = expected_rank_state(state, decode_engine, rank)
        for name in expected:
            for got, want in zip(actual[name], expected[name]):
                assert torch.equal(got, want), f"rank {rank} layer {name}"


def assert_transferred(
    prefill_engine: Engine,
    prefill_blocks: list[list[int]],
    decode_engine: Engine,
    decode_blocks: list[list[int]],
    tokens: int | Sequence[int],
) -> None:
    """Decode holds prefill's state of the request on every rank (``tokens`` as
    :func:`assert_same_state` takes them), and poison outside ``decode_blocks``."""
    assert_same_state(prefill_engine, prefill_blocks, decode_engine, decode_blocks, tokens)
    assert_poison_elsewhere(decode_engine, decode_blocks)


def assert_poison_elsewhere(decode_engine: Engine, decode_blocks: list[list[int]]) -> None:
    """Every rank of the decode engine still holds poison wherever the request does not own
    a block."""
    owned = {b for ids in decode_blocks for b in ids}
    for cache in decode_engine.caches:
        memory = storage_bytes(next(iter(cache.values())))
        tensor = decode_engine.kv_config.kv_cache_tensors[0]
        untouched = torch.ones(memory.numel(), dtype=torch.bool)
        for region in range(memory.numel() // tensor.layer_stride):
            for block in owned:
                start = region * tensor.layer_stride + block * tensor.block_stride
                untouched[start : start + tensor.block_stride] = False
        assert bool((memory[untouched] == POISON).all())


def transfer_record(broker: BrokerProcess, transfer_id: str) -> pb.GetTransferResponse:
    with grpc.insecure_channel(broker.address) as channel:
        response: pb.GetTransferResponse = pb_grpc.BrokerStub(channel).GetTransfer(
            pb.GetTransferRequest(transfer_id=transfer_id), timeout=10
        )
    return response


def transfer_state(broker: BrokerProcess, transfer_id: str) -> str:
    return pb.TransferState.Name(transfer_record(broker, transfer_id).state)


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize(
    ("preset", "prefill_tp", "decode_tp", "prompt_len"),
    [
        ("qwen3.5-0.8b", 1, 1, 1200),  # GDN; both sides through vLLM's connector factory
        ("qwen3.5-0.8b", 1, 2, 1500),  # GDN heads, Q|K|V and KV heads split on decode
        ("nemotron-3-nano-30b-a3b", 2, 1, 2500),  # Mamba2 x|B|C gathered from two prefill ranks
    ],
)
def test_prompt_state_moves_between_vllm_engines(
    broker: BrokerProcess,
    tmp_path: Path,
    preset: str,
    prefill_tp: int,
    decode_tp: int,
    prompt_len: int,
) -> None:
    model = write_model(preset, tmp_path / preset)
    producer = make_engine(model, prefill_tp, "kv_producer", "prefill-0", broker.address)
    consumer = make_engine(model, decode_tp, "kv_consumer", "decode-0", broker.address)
    try:
        free = producer.free_blocks
        prompt = list(range(1, prompt_len + 1))
        params = prefill(producer, "r1", prompt)
        assert params is not None and params[DO_REMOTE_PREFILL] is True
        assert (params[BROKER], params[PREFILL_ENGINE], params[NUM_TOKENS]) == (
            broker.address,
            "prefill-0",
            prompt_len - 1,
        )
        assert set(params) <= {
            DO_REMOTE_PREFILL,
            TRANSFER_ID,
            BROKER,
            PREFILL_ENGINE,
            NUM_TOKENS,
            "remote_prefill_cached_tokens",
        }
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        # The load covered N-1 tokens: decode computes the last prompt token, then decodes.
        assert seen["scheduled"] == [1, 1, 1]
        assert_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            prompt_len - 1,
        )
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free  # the release freed the prefill blocks
    finally:
        consumer.close()
        producer.close()


def test_state_moves_over_explicit_nixl_backends_and_threads(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    """NixlConnector's ``backends`` and ``num_threads`` keys on both engines: every rank's
    agent runs UCX with those threads, and the state arrives intact."""
    nixl = {"backends": ["UCX"], "num_threads": 2}
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address, **nixl)
    consumer = make_engine(model, 1, "kv_consumer", "decode-0", broker.address, **nixl)
    try:
        for engine in (producer, consumer):
            (session,) = engine.workers[0].worker.client.sessions.values()
            assert session.agent._nixl.get_backend_params("UCX")["num_threads"] == "2"
        prompt = list(range(1, 1001))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"] == [1, 1, 1]
        assert_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            len(prompt) - 1,
        )
    finally:
        consumer.close()
        producer.close()


def test_a_backend_nixl_cannot_load_fails_start_up(broker: BrokerProcess, tmp_path: Path) -> None:
    """vLLM's connector factory builds the worker connector: a backend NIXL has no plugin for
    fails there, before the model would load, naming the key and NIXL's plugins."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    config = engine_config(
        model,
        1,
        role="kv_consumer",
        engine_id="decode-0",
        extra={"broker": broker.address, "backends": ["UCX", "EFA"]},
    )
    with pytest.raises(
        ValueError,
        match=r"^kv_connector_extra_config\.backends: 'EFA' is not an installed NIXL plugin; "
        r"installed: \[.*'UCX'",
    ):
        KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config(config, NUM_BLOCKS)
        )


def test_engines_fail_over_from_a_broker_address_that_does_not_answer(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    """Both engines list a dead address before the live broker: the scheduler's publish and
    the workers' registrations, plans and releases move on to the live one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    brokers = f"{dead},{broker.address}"
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", brokers)
    consumer = make_engine(model, 1, "kv_consumer", "decode-0", brokers)
    try:
        free = producer.free_blocks
        prompt = list(range(1, 801))
        params = prefill(producer, "r1", prompt)
        assert params is not None and params[BROKER] == brokers
        seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"] == [1, 1, 1]
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free
    finally:
        consumer.close()
        producer.close()


def test_a_layout_mismatch_is_recomputed(broker: BrokerProcess, tmp_path: Path) -> None:
    """Decode keeps its conv state in float32, prefill in bfloat16: the broker refuses the
    plan, decode aborts the transfer (prefill frees at once) and vLLM recomputes."""
    model = write_model("nemotron-3-nano-30b-a3b", tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address)
    config = engine_config(
        model,
        1,
        role="kv_consumer",
        engine_id="decode-0",
        extra={"broker": broker.address, "model_name": "test-model"},
        mamba_cache_dtype="float32",
    )
    consumer = Engine(config, NUM_BLOCKS)
    try:
        prompt = list(range(1, 1001))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"][0] == len(prompt)  # the whole prompt, computed by decode
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_ABORTED"
    finally:
        consumer.close()
        producer.close()


def test_a_token_count_mismatch_is_recomputed(broker: BrokerProcess, tmp_path: Path) -> None:
    """Decode's prompt is longer than what prefill published: using the state would skip
    tokens, so the load fails, the transfer is aborted and vLLM recomputes."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address)
    consumer = make_engine(model, 1, "kv_consumer", "decode-0", broker.address)
    try:
        params = prefill(producer, "r1", list(range(1, 801)))
        seen = decode(consumer, "r1", list(range(1, 901)), params, producer)
        assert seen["scheduled"][0] == 900
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_ABORTED"
    finally:
        consumer.close()
        producer.close()


def test_an_expired_transfer_is_recomputed(broker: BrokerProcess, tmp_path: Path) -> None:
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address, publish_ttl_ms=200)
    consumer = make_engine(model, 1, "kv_consumer", "decode-0", broker.address)
    try:
        prompt = list(range(1, 801))
        params = prefill(producer, "r1", prompt)
        time.sleep(0.4)
        seen = decode(consumer, "r1", prompt, params, producer)
        assert seen["scheduled"][0] == len(prompt)
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_EXPIRED"
    finally:
        consumer.close()
        producer.close()


def test_an_unreachable_broker_is_recomputed(broker: BrokerProcess, tmp_path: Path) -> None:
    """The broker goes away after a publish: decode's load fails and vLLM recomputes; a
    prefill request finishing now frees its blocks at once and hands decode no transfer."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address)
    consumer = make_engine(model, 1, "kv_consumer", "decode-0", broker.address)
    try:
        free = producer.free_blocks
        prompt = list(range(1, 801))
        params = prefill(producer, "r1", prompt)
        broker.stop()
        request = consumer.add("r1", prompt, 2, params)
        scheduled = []
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            out, _ = consumer.step()
            scheduled += (
                [out.num_scheduled_tokens["r1"]] if "r1" in out.num_scheduled_tokens else []
            )
            if request.is_finished():
                break
            time.sleep(0.005)
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert scheduled == [len(prompt), 1]
        assert prefill(producer, "r2", prompt) is None
        assert producer.free_blocks < free  # r1's blocks wait for a release that cannot come
        assert "r2" not in producer.scheduler.requests
    finally:
        consumer.close()
        producer.close()
