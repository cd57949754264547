"""The connector's transfer statistics through vLLM's own stats path, on CPU.

Engines as in :mod:`test_vllm_connector` (vLLM's ``Scheduler``, vLLM-allocated KV caches, NIXL
over UCX loopback, a live ``pdbroker serve``), with the decode scheduler logging stats: each
step the worker connectors hand their stats to vLLM's ``KVOutputAggregator``, the scheduler
puts the merged payload in its ``SchedulerStats``, and vLLM's ``PrometheusStatLogger`` and
``KVConnectorLogging`` (the ``/metrics`` endpoint and the periodic log line) consume it. The
recorded bytes and descriptors must be those of the broker's plans, whose bytes are checked
to have arrived.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_vllm_connector import (
    NUM_BLOCKS,
    assert_transferred,
    decode,
    make_engine,
    prefill,
    transfer_blocks,
    transfer_state,
)
from vllm_engines import (
    Engine,
    engine_config,
    vllm_distributed,  # noqa: F401 - an autouse fixture
    write_model,
)

# isort: split
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from clients.vllm.metadata import TRANSFER_ID
from clients.vllm.stats import PdBrokerKVConnectorStats
from harness.brokers import BrokerProcess

MODEL = "qwen3.5-0.8b"


@pytest.fixture
def prometheus() -> Iterator[None]:
    """vLLM's metrics live in the process's default registry: start and end without them."""
    unregister_vllm_metrics()
    yield
    unregister_vllm_metrics()


def decode_engine(model: Path, tp: int, broker_address: str) -> Engine:
    """A decode engine whose scheduler logs stats, as ``vllm serve`` does by default."""
    config = engine_config(
        model,
        tp,
        role="kv_consumer",
        engine_id="decode-0",
        extra={"broker": broker_address, "model_name": "test-model"},
    )
    return Engine(config, NUM_BLOCKS, poison=True, log_stats=True)


def connector_payloads(engine: Engine) -> list[dict[str, Any]]:
    """The connector payloads the scheduler emitted, one per step that had any."""
    return [s.kv_connector_stats for s in engine.scheduler_stats if s.kv_connector_stats]


def merged(engine: Engine) -> dict[str, list[float | int]]:
    """Every step's connector payload of ``engine``, merged as vLLM's stats logger does (on
    copies: merging extends the first payload's lists)."""
    logging = KVConnectorLogging(engine.config.kv_transfer_config)
    for payload in connector_payloads(engine):
        logging.observe(copy.deepcopy(payload))
    stats = logging.transfer_stats_accumulator
    assert isinstance(stats, PdBrokerKVConnectorStats)
    return stats.data


def plans(process: BrokerProcess, transfer_id: str) -> list[pb.PlanInfo]:
    """The transfer's plans at the broker, by decode rank."""
    with grpc.insecure_channel(process.address) as channel:
        response = pb_grpc.BrokerStub(channel).GetTransfer(
            pb.GetTransferRequest(transfer_id=transfer_id), timeout=10
        )
    return sorted(response.plans, key=lambda p: p.decode_rank)


def sample(name: str, engine: Engine) -> float | None:
    """``name``'s value for ``engine`` in the default registry (what ``/metrics`` shows)."""
    labels = {"model_name": engine.config.model_config.served_model_name, "engine": "0"}
    return REGISTRY.get_sample_value(name, labels)


def test_a_load_is_recorded_and_exported(
    broker: BrokerProcess,
    tmp_path: Path,
    prometheus: None,
) -> None:
    """One TP1 load: one transfer of the plan's bytes and descriptors, no failures, in the
    scheduler's stats and in vLLM's Prometheus metrics."""
    model = write_model(MODEL, tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address)
    consumer = decode_engine(model, 1, broker.address)
    try:
        prom = PrometheusStatLogger(consumer.config)
        prompt = list(range(1, 1201))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        prefill_blocks = transfer_blocks(producer, "r1")
        seen = decode(consumer, "r1", prompt, params, producer)
        assert_transferred(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r1", seen["blocks"]),
            len(prompt) - 1,
        )
        (plan,) = plans(broker, params[TRANSFER_ID])
        assert plan.total_bytes > 0 and plan.bytes_moved == plan.total_bytes
        data = merged(consumer)
        assert data["bytes_transferred"] == [plan.total_bytes]
        assert data["num_descriptors"] == [plan.num_descriptors]
        assert len(data["transfer_duration"]) == len(data["plan_duration"]) == 1
        assert 0 < data["transfer_duration"][0] < 60 and 0 < data["plan_duration"][0] < 60
        assert data["num_failed_transfers"] == data["num_expired_transfers"] == []
        # The load was handed out once: the worker reset its stats after the step.
        assert len(connector_payloads(consumer)) == 1

        for stats in consumer.scheduler_stats:
            prom.record(stats, None)
        assert sample("vllm:pdbroker_bytes_transferred_count", consumer) == 1
        assert sample("vllm:pdbroker_bytes_transferred_sum", consumer) == plan.total_bytes
        assert sample("vllm:pdbroker_num_descriptors_sum", consumer) == plan.num_descriptors
        assert sample("vllm:pdbroker_xfer_time_seconds_sum", consumer) == pytest.approx(
            data["transfer_duration"][0]
        )
        assert sample("vllm:pdbroker_plan_time_seconds_count", consumer) == 1
        assert sample("vllm:pdbroker_num_failed_transfers_total", consumer) == 0
        assert sample("vllm:pdbroker_num_expired_transfers_total", consumer) == 0
    finally:
        consumer.close()
        producer.close()


def test_two_decode_workers_stats_add_up(
    broker: BrokerProcess,
    tmp_path: Path,
) -> None:
    """A TP2 decode engine: vLLM's aggregator merges both ranks' loads; ``reduce()`` sums
    their bytes and averages their descriptors."""
    model = write_model(MODEL, tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address)
    consumer = decode_engine(model, 2, broker.address)
    try:
        prompt = list(range(1, 1501))
        params = prefill(producer, "r1", prompt)
        assert params is not None
        decode(consumer, "r1", prompt, params, producer)
        rank_plans = plans(broker, params[TRANSFER_ID])
        assert len(rank_plans) == 2
        data = merged(consumer)
        assert sorted(data["bytes_transferred"]) == sorted(p.total_bytes for p in rank_plans)
        assert sorted(data["num_descriptors"]) == sorted(p.num_descriptors for p in rank_plans)
        summary = PdBrokerKVConnectorStats(data=data).reduce()
        total = sum(p.total_bytes for p in rank_plans)
        assert summary["Num successful transfers"] == 2
        assert summary["Total MB"] == round(total / 2**20, 3)
        assert summary["Avg MB per transfer"] == round(total / 2 / 2**20, 3)
        assert summary["Avg number of descriptors"] == round(
            sum(p.num_descriptors for p in rank_plans) / 2, 1
        )
        assert summary["Num failed transfers"] == summary["Num expired transfers"] == 0
    finally:
        consumer.close()
        producer.close()


def test_expired_and_failed_loads_are_counted(
    broker: BrokerProcess,
    tmp_path: Path,
    prometheus: None,
) -> None:
    """A load of an expired transfer counts as expired, one that fails (decode expects more
    tokens than were published) as failed; neither records a transfer."""
    model = write_model(MODEL, tmp_path / "m")
    producer = make_engine(
        model, 1, "kv_producer", "prefill-0", broker.address, publish_ttl_ms=2000
    )
    consumer = decode_engine(model, 1, broker.address)
    try:
        prom = PrometheusStatLogger(consumer.config)
        prompt = list(range(1, 801))
        expired = prefill(producer, "r1", prompt)
        assert expired is not None
        time.sleep(2.5)
        seen = decode(consumer, "r1", prompt, expired, producer)
        assert seen["scheduled"][0] == len(prompt)  # recomputed
        assert transfer_state(broker, expired[TRANSFER_ID]) == "TRANSFER_STATE_EXPIRED"
        refused = prefill(producer, "r2", prompt)
        seen = decode(consumer, "r2", list(range(1, 901)), refused, producer)
        assert seen["scheduled"][0] == 900
        data = merged(consumer)
        assert data["num_expired_transfers"] == [1]
        assert data["num_failed_transfers"] == [1]
        assert data["bytes_transferred"] == data["transfer_duration"] == []
        summary = PdBrokerKVConnectorStats(data=data).reduce()
        assert summary == {
            "Num successful transfers": 0,
            "Num failed transfers": 1,
            "Num expired transfers": 1,
        }
        for stats in consumer.scheduler_stats:
            prom.record(stats, None)
        assert sample("vllm:pdbroker_num_expired_transfers_total", consumer) == 1
        assert sample("vllm:pdbroker_num_failed_transfers_total", consumer) == 1
        assert sample("vllm:pdbroker_bytes_transferred_count", consumer) == 0
    finally:
        consumer.close()
        producer.close()
