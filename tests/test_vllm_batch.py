"""The decode engine's broker calls: one ``GetTransferPlans`` per step for every rank of every
load it starts, one ``ReportTransfers`` per step for the loads every rank finished, on CPU.

Engines as in :mod:`test_vllm_connector` (vLLM's ``Scheduler``, vLLM-allocated KV caches, NIXL
over UCX loopback, every byte compared); the broker counts the calls it receives by method
(``grpc_server_started_total`` on its ``/metrics``), and each step's connector output is the one
vLLM's ``KVOutputAggregator`` merged from the workers. With ``batch_calls`` off each worker
plans and reports its own rank's loads. A transfer that ends while the handed plans are read
must be recomputed, never decoded from.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from test_decode_checks import GOOD, REGIONS
from test_vllm_connector import (
    DEADLINE_S,
    assert_poison_elsewhere,
    assert_same_state,
    make_engine,
    prefill,
    transfer_blocks,
    transfer_record,
)
from vllm_engines import (
    Engine,
    vllm_distributed,  # noqa: F401 - an autouse fixture
    write_model,
)

# isort: split
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
from google.protobuf.message import DecodeError
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import RequestStatus

from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import pack
from clients.plan_check import PlanRejected
from clients.transport import RegionIndex
from clients.vllm.metadata import (
    PREFILL_ENGINE,
    TRANSFER_ID,
    PdBrokerMetadata,
    PdBrokerWorkerMetadata,
)
from clients.vllm.worker import HandedPlans
from harness.brokers import BrokerProcess

#: The decode engine's calls about loads (the prefill engine makes none of these).
LOAD_CALLS = (
    "GetTransfer",
    "GetTransferPlan",
    "GetTransferPlans",
    "ReportTransfer",
    "ReportTransfers",
)
#: Enough blocks for two requests held at once.
NUM_BLOCKS = 24


@pytest.fixture
def counting_broker() -> Iterator[BrokerProcess]:
    """A ``pdbroker serve`` process serving ``/metrics``."""
    process = BrokerProcess("--metrics-port", "0")
    yield process
    process.stop()


def load_calls(broker: BrokerProcess) -> dict[str, float]:
    """How many calls of each of :data:`LOAD_CALLS` the broker received so far."""
    text = urllib.request.urlopen(broker.metrics_url, timeout=10).read().decode()
    calls = {
        s.labels["grpc_method"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "grpc_server_started_total"
    }
    return {method: calls[method] for method in LOAD_CALLS}


def decode_together(
    consumer: Engine,
    producer: Engine,
    legs: dict[str, tuple[list[int], dict[str, Any]]],
    scheduled: Callable[[SchedulerOutput], None] | None = None,
) -> tuple[dict[str, tuple[Any, list[int]]], list[PdBrokerMetadata]]:
    """Add every decode leg (request id -> prompt, ``kv_transfer_params``) at once and step
    both engines until every leg finished and prefill freed its blocks (``scheduled`` sees
    each decode step's scheduler output first). Returns per request the blocks its load
    wrote into and the tokens each compute step scheduled for it, and the connector metadata
    of every decode step."""
    requests = {r: consumer.add(r, prompt, 3, params) for r, (prompt, params) in legs.items()}
    blocks: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {r: [] for r in legs}
    metadata: list[PdBrokerMetadata] = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        out, _ = consumer.step(token=9, scheduled=scheduled)
        assert isinstance(out.kv_connector_metadata, PdBrokerMetadata)
        metadata.append(out.kv_connector_metadata)
        for r, request in requests.items():
            if r not in blocks and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                blocks[r] = consumer.block_ids(r)
            if out.num_scheduled_tokens.get(r):
                tokens[r].append(out.num_scheduled_tokens[r])
        producer.step()
        if all(q.is_finished() for q in requests.values()) and not (
            legs.keys() & producer.scheduler.requests.keys()
        ):
            return {r: (blocks[r], tokens[r]) for r in legs}, metadata
        time.sleep(0.005)
    raise AssertionError(f"decode did not finish: {[q.status for q in requests.values()]}")


def test_a_steps_handed_plans_are_checked_together_and_fail_alone() -> None:
    """A worker parses and checks its rank's plans of a step at once when the first is read:
    each load gets its plan and check; a plan that does not parse fails its load alone, and
    one outside the rank's regions is refused alone."""
    outside = pb.GetTransferPlanResponse()
    outside.CopyFrom(GOOD)
    outside.sources[1].local_descriptors = pack(np.array([[(2 << 20) + 1, 4096, 0]]))
    outside.sources[1].remote_descriptors = pack(np.array([[(3 << 30) + 1, 4096, 0]]))
    handed = HandedPlans(
        {
            "a": GOOD.SerializeToString(),
            "b": b"\xff\xff\xff",
            "c": outside.SerializeToString(),
            "d": GOOD.SerializeToString(),
        }
    )
    rank = SimpleNamespace(region_index=RegionIndex(REGIONS), tp_rank=0)
    for request_id in ("a", "d"):
        plan, checked = handed.checked(request_id, rank)  # type: ignore[arg-type]
        assert plan == GOOD and not isinstance(checked, PlanRejected)
        assert [r.source for r in checked] == list(GOOD.sources)
    with pytest.raises(DecodeError):
        handed.checked("b", rank)  # type: ignore[arg-type]
    plan, checked = handed.checked("c", rank)  # type: ignore[arg-type]
    assert isinstance(checked, PlanRejected) and "outside rank 0's" in str(checked)


@pytest.mark.parametrize(
    ("preset", "prefill_tp", "decode_tp", "prompt_len", "batch_calls"),
    [
        ("qwen3.5-0.8b", 1, 2, 1500, True),  # GDN + attention, resharded over two decode ranks
        ("nemotron-3-nano-30b-a3b", 2, 1, 2500, True),  # Mamba2 from two prefill ranks
        ("qwen3.5-0.8b", 1, 2, 1500, False),  # each decode worker asks for its own
    ],
)
def test_a_step_plans_and_reports_every_load_in_one_call(
    counting_broker: BrokerProcess,
    tmp_path: Path,
    preset: str,
    prefill_tp: int,
    decode_tp: int,
    prompt_len: int,
    batch_calls: bool,
) -> None:
    """Two requests start loading in one step: with ``batch_calls`` (the default) the decode
    scheduler asks for all their ranks' plans in one ``GetTransferPlans`` call and sends one
    ``ReportTransfers`` per step in which loads finished on every rank; without, each
    rank of each request makes its own ``GetTransfer``, ``GetTransferPlan`` and
    ``ReportTransfer``. Either way every byte arrives and decode computes only the last
    prompt token."""
    broker = counting_broker.address
    model = write_model(preset, tmp_path / preset)
    producer = make_engine(
        model, prefill_tp, "kv_producer", "prefill-0", broker, num_blocks=NUM_BLOCKS
    )
    extra = {} if batch_calls else {"batch_calls": False}
    consumer = make_engine(
        model, decode_tp, "kv_consumer", "decode-0", broker, num_blocks=NUM_BLOCKS, **extra
    )
    try:
        legs, prefill_blocks = {}, {}
        for n, r in enumerate(("r1", "r2")):
            prompt = list(range(1 + n, prompt_len + 1 + n))
            params = prefill(producer, r, prompt)
            assert params is not None
            legs[r] = (prompt, params)
            prefill_blocks[r] = transfer_blocks(producer, r)
        before = load_calls(counting_broker)
        seen, metadata = decode_together(consumer, producer, legs)
        calls = {m: n - before[m] for m, n in load_calls(counting_broker).items()}
        loaded: list[list[int]] = []
        for r, (blocks, scheduled) in seen.items():
            assert scheduled == [1, 1, 1], r
            decode_blocks = transfer_blocks(consumer, r, blocks)
            assert_same_state(producer, prefill_blocks[r], consumer, decode_blocks, prompt_len - 1)
            loaded += decode_blocks
            record = transfer_record(counting_broker, legs[r][1][TRANSFER_ID])
            assert pb.TransferState.Name(record.state) == "TRANSFER_STATE_COMPLETED"
            assert sorted(p.decode_rank for p in record.plans) == list(range(decode_tp))
        assert_poison_elsewhere(consumer, loaded)
        rank_loads = len(legs) * decode_tp
        if not batch_calls:
            assert calls == {
                "GetTransfer": rank_loads,
                "GetTransferPlan": rank_loads,
                "GetTransferPlans": 0,
                "ReportTransfer": rank_loads,
                "ReportTransfers": 0,
            }
            return
        # One step handed every rank its plan of both loads.
        (handed,) = [m.loads for m in metadata if m.loads]
        assert sorted(handed) == ["r1", "r2"]
        assert all(all(spec.plans) and len(spec.plans) == decode_tp for spec in handed.values())
        reports = [
            report
            for o in consumer.connector_outputs
            if isinstance(o.kv_connector_worker_meta, PdBrokerWorkerMetadata)
            for report in o.kv_connector_worker_meta.reports
        ]
        assert sorted(r for r, _ in reports) == sorted(list(legs) * decode_tp)
        # A load's reports go out when its last rank finished: one call per step that
        # finished loads, one call per transfer at most.
        finishing = [o for o in consumer.connector_outputs if o.finished_recving]
        assert len(finishing) <= len(legs)
        assert calls == {
            "GetTransfer": 0,
            "GetTransferPlan": 0,
            "GetTransferPlans": 1,
            "ReportTransfer": 0,
            "ReportTransfers": len(finishing),
        }
    finally:
        consumer.close()
        producer.close()


def test_a_transfer_that_ends_while_its_plans_are_read_is_recomputed(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    """The transfer is aborted right after the decode scheduler got its plans: both workers
    read them and finish the load, but the broker answers their DONE reports ABORTED (prefill
    may have reused the pages). vLLM must not decode from that state: the load is turned into
    a failed one and the request computes its whole prompt."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producer = make_engine(model, 1, "kv_producer", "prefill-0", broker.address)
    consumer = make_engine(model, 2, "kv_consumer", "decode-0", broker.address)
    try:
        prompt = list(range(1, 1501))
        params = prefill(producer, "r1", prompt)
        assert params is not None

        def abort_once_planned(out: SchedulerOutput) -> None:
            metadata = out.kv_connector_metadata
            assert isinstance(metadata, PdBrokerMetadata)
            if "r1" in metadata.loads:
                assert all(metadata.loads["r1"].plans)  # the workers read handed plans
                with grpc.insecure_channel(broker.address) as channel:
                    pb_grpc.BrokerStub(channel).AbortTransfer(
                        pb.AbortTransferRequest(
                            transfer_id=params[TRANSFER_ID],
                            prefill_engine_id=params[PREFILL_ENGINE],
                            reason="ended while decode reads",
                        ),
                        timeout=10,
                    )

        seen, metadata = decode_together(
            consumer, producer, {"r1": (prompt, params)}, abort_once_planned
        )
        assert seen["r1"][1][0] == len(prompt)  # recomputed, not decoded from the read
        record = transfer_record(broker, params[TRANSFER_ID])
        assert pb.TransferState.Name(record.state) == "TRANSFER_STATE_ABORTED"
        # Both ranks read their plans and reported them DONE; neither read was intact.
        assert sorted((p.decode_rank, pb.ReportStatus.Name(p.status)) for p in record.plans) == [
            (0, "REPORT_STATUS_DONE"),
            (1, "REPORT_STATUS_DONE"),
        ]
        # Held back from vLLM once both ranks had finished, then failed by the workers.
        assert [o.failed_recving for o in consumer.connector_outputs if o.failed_recving] == [
            {"r1"}
        ]
        assert [m.failed_loads for m in metadata if m.failed_loads] == [{"r1"}]
    finally:
        consumer.close()
        producer.close()


def test_a_worker_that_lost_a_prefill_agent_asks_for_its_plan_itself(
    counting_broker: BrokerProcess, tmp_path: Path
) -> None:
    """The broker handed the prefill agent's metadata with the first load; the decode rank's
    agent then forgets it (as a restarted process would). The next handed plan names that
    agent without its metadata: the worker asks for the plan again with the metadata
    (``GetTransferPlan`` twice), reads and reports it itself, and the state arrives."""
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    address = counting_broker.address
    producer = make_engine(model, 1, "kv_producer", "prefill-0", address)
    consumer = make_engine(model, 1, "kv_consumer", "decode-0", address)
    try:
        (prefill_session,) = producer.workers[0].worker.client.sessions.values()
        (decode_session,) = consumer.workers[0].worker.client.sessions.values()
        prompt = list(range(1, 1001))
        first = prefill(producer, "r1", prompt)
        assert first is not None
        decode_together(consumer, producer, {"r1": (prompt, first)})
        decode_session.agent.remove_remote(prefill_session.agent.name)
        second = prefill(producer, "r2", prompt)
        assert second is not None
        prefill_blocks = transfer_blocks(producer, "r2")
        before = load_calls(counting_broker)
        seen, metadata = decode_together(consumer, producer, {"r2": (prompt, second)})
        calls = {m: n - before[m] for m, n in load_calls(counting_broker).items()}
        blocks, scheduled = seen["r2"]
        assert scheduled == [1, 1, 1]
        assert_same_state(
            producer,
            prefill_blocks,
            consumer,
            transfer_blocks(consumer, "r2", blocks),
            len(prompt) - 1,
        )
        (handed,) = [m.loads["r2"].plans for m in metadata if m.loads]
        assert len(handed) == 1 and handed[0]  # the worker was handed its plan
        assert calls == {
            "GetTransfer": 1,
            "GetTransferPlan": 2,
            "GetTransferPlans": 1,
            "ReportTransfer": 1,
            "ReportTransfers": 0,
        }
    finally:
        consumer.close()
        producer.close()
