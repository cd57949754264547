"""Publications kept alive while their decode requests wait in a busy vLLM engine's queue.

The decode engine runs one request at a time (``max_num_seqs=1``), so a disaggregated request
added while another runs waits behind it, where vLLM's scheduler never shows it to the
connector (it stops looking at the queue once every run slot is taken): only
``on_new_request`` saw it. The prefill engine publishes with a 1.5 s TTL; the request waits
3.5 s. Engines, broker and checks are those of ``tests/test_vllm_connector.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from vllm_engines import (  # noqa: F401 - vllm_distributed: an autouse fixture
    Engine,
    engine_config,
    vllm_distributed,
    write_model,
)

# isort: split
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
from test_vllm_connector import (
    DEADLINE_S,
    NUM_BLOCKS,
    assert_transferred,
    follow,
    make_engine,
    prefill,
    transfer_blocks,
    transfer_state,
)
from vllm.v1.request import Request, RequestStatus

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from clients.vllm.metadata import TRANSFER_ID
from harness.brokers import BrokerProcess

TTL_MS = 1_500
#: How long the decode request waits behind the running one: well past its TTL.
QUEUED_S = 3.5
#: ``--max-ttl-ms`` of the broker in the test of the cap.
MAX_TTL_MS = 5_000
PROMPT = list(range(1, 801))


def one_at_a_time(model: Path, address: str) -> Engine:
    """A decode engine with one run slot."""
    config = engine_config(
        model,
        1,
        role="kv_consumer",
        engine_id="decode-0",
        extra={"broker": address, "model_name": "test-model"},
    )
    config.scheduler_config.max_num_seqs = 1
    return Engine(config, NUM_BLOCKS, poison=True)


def queue_behind_a_running_request(
    consumer: Engine, producer: Engine, params: dict, seconds: float = QUEUED_S
) -> Request:
    """Start a local request on ``consumer``, add the decode leg behind it and step both
    engines for ``seconds`` (:func:`step_while_queued`)."""
    consumer.add("busy", [5] * 16, 100_000, None)
    consumer.step()
    request = consumer.add("r1", PROMPT, 3, params)
    step_while_queued(consumer, producer, request, seconds)
    return request


def step_while_queued(consumer: Engine, producer: Engine, request: Request, seconds: float) -> None:
    """Step both engines for ``seconds``; ``request`` is never scheduled meanwhile."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        out, _ = consumer.step()
        assert set(out.num_scheduled_tokens) == {"busy"}
        producer.step()
        time.sleep(0.005)
    assert request.status == RequestStatus.WAITING


def test_a_request_queued_past_its_ttl_still_loads(broker: BrokerProcess, tmp_path: Path) -> None:
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(
        model, 1, "kv_producer", "prefill-0", broker.address, publish_ttl_ms=TTL_MS
    )
    consumer = one_at_a_time(model, broker.address)
    try:
        free = producer.free_blocks
        params = prefill(producer, "r1", PROMPT)
        assert params is not None
        prefill_blocks = transfer_blocks(producer, "r1")
        request = queue_behind_a_running_request(consumer, producer, params)
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_PUBLISHED"
        consumer.scheduler.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
        seen = follow(consumer, request, producer)
        # Loaded, not recomputed: decode computes the last prompt token, then decodes.
        assert seen["scheduled"] == [1, 1, 1]
        assert_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            len(PROMPT) - 1,
        )
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_COMPLETED"
        assert producer.free_blocks == free
    finally:
        consumer.close()
        producer.close()


def transfer_info(process: BrokerProcess, transfer_id: str) -> pb.GetTransferResponse:
    with grpc.insecure_channel(process.address) as channel:
        return pb_grpc.BrokerStub(channel).GetTransfer(
            pb.GetTransferRequest(transfer_id=transfer_id), timeout=10
        )


def wait_for_release(producer: Engine, free: int) -> None:
    """Step the prefill engine until its blocks are free again."""
    deadline = time.monotonic() + DEADLINE_S
    while producer.free_blocks != free and time.monotonic() < deadline:
        producer.step()
        time.sleep(0.01)
    assert producer.free_blocks == free


def test_a_publication_nobody_renews_expires_and_prefill_frees_it(
    broker: BrokerProcess,
    tmp_path: Path,
) -> None:
    """The decode engine goes away while its request waits: renewals stop, the publication
    expires one TTL later and the prefill engine frees its blocks."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(
        model, 1, "kv_producer", "prefill-0", broker.address, publish_ttl_ms=TTL_MS
    )
    consumer = one_at_a_time(model, broker.address)
    try:
        free = producer.free_blocks
        params = prefill(producer, "r1", PROMPT)
        assert params is not None
        queue_behind_a_running_request(consumer, producer, params)
        assert transfer_state(broker, params[TRANSFER_ID]) == "TRANSFER_STATE_PUBLISHED"
    finally:
        consumer.close()
    try:
        wait_for_release(producer, free)
        info = transfer_info(broker, params[TRANSFER_ID])
        assert info.state == pb.TRANSFER_STATE_EXPIRED
        assert info.expires_at_ms - info.published_at_ms > TTL_MS  # renewed while it lived
    finally:
        producer.close()


@pytest.fixture
def short_broker() -> Iterator[BrokerProcess]:
    process = BrokerProcess("--max-ttl-ms", str(MAX_TTL_MS))
    yield process
    process.stop()


def test_renewals_end_at_the_brokers_max_ttl(
    short_broker: BrokerProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode engine that keeps renewing holds the prefill blocks no longer than the
    broker's ``--max-ttl-ms`` after the publication; refused then, it renews it no more, and
    its request computes the prompt."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    address = short_broker.address
    producer = make_engine(model, 1, "kv_producer", "prefill-0", address, publish_ttl_ms=TTL_MS)
    consumer = one_at_a_time(model, address)
    try:
        free = producer.free_blocks
        params = prefill(producer, "r1", PROMPT)
        assert params is not None
        request = queue_behind_a_running_request(consumer, producer, params, 2 * TTL_MS / 1000)
        assert transfer_state(short_broker, params[TRANSFER_ID]) == "TRANSFER_STATE_PUBLISHED"
        deadline = time.monotonic() + DEADLINE_S
        while (info := transfer_info(short_broker, params[TRANSFER_ID])).state != (
            pb.TRANSFER_STATE_EXPIRED
        ):
            assert time.monotonic() < deadline, "the transfer never expired"
            step_while_queued(consumer, producer, request, 0.2)
        assert info.expires_at_ms - info.published_at_ms == MAX_TTL_MS
        step_while_queued(consumer, producer, request, 1.0)  # renewals refused meanwhile
        wait_for_release(producer, free)
        consumer.scheduler.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
        seen = follow(consumer, request, producer)
        assert seen["scheduled"][0] == len(PROMPT)  # the whole prompt, computed by decode
        refused = [r for r in caplog.records if "cannot be kept alive" in r.getMessage()]
        assert len(refused) == 1 and "FAILED_PRECONDITION" in refused[0].getMessage()
    finally:
        consumer.close()
        producer.close()
