"""vLLM 0.33 engines on CPU for the connector tests, built from vLLM's own pieces
(:mod:`harness.vllm.cpu_engine`: config, KV-cache groups, cache tensors). An :class:`Engine`
runs vLLM's ``Scheduler`` (which builds the scheduler-side connector itself) with one
worker-side connector per TP rank. Like vLLM's executor and model runner, each step pickles
the connector metadata to every worker and hands the scheduler the workers' transfer results,
connector stats and connector worker metadata (pickled back).

Importing this module configures vLLM for CPU (see :mod:`harness.vllm.cpu_engine`); where vLLM
cannot be imported it skips the importing test module, saying why, or fails it under CI and
when vLLM is installed but broken (:mod:`prerequisites`).
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prerequisites import require_module

# Before any other vLLM import: the module sets vLLM's environment for CPU.
cpu_engine = require_module("harness.vllm.cpu_engine", "vllm", distribution="vllm")
allocate, kv_cache_config = cpu_engine.allocate, cpu_engine.kv_cache_config
vllm_config, write_model = cpu_engine.vllm_config, cpu_engine.write_model

import torch
from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from clients.vllm.connector import PdBrokerConnector
from clients.vllm.metadata import ConnectorSettings, PdBrokerMetadata
from clients.vllm.worker import WorkerHalf

__all__ = ["write_model"]  # the tests' model directories, re-exported

#: Bytes a decode engine's memory holds wherever no transfer may write.
POISON = 0xA5
CONNECTOR = {
    "kv_connector": "PdBrokerConnector",
    "kv_connector_module_path": "clients.vllm.connector",
}


def engine_config(
    model_dir: Path,
    tp: int,
    *,
    backend: type = FlashAttentionBackend,
    role: str = "",
    engine_id: str = "",
    extra: dict[str, Any] | None = None,
    **cache: Any,
) -> VllmConfig:
    """vLLM's config of an engine serving ``model_dir`` at ``tp``, its hybrid block size
    aligned for ``backend``; ``role`` set: with this connector in that role."""
    transfer = (
        KVTransferConfig(
            **CONNECTOR,
            kv_role=role,
            engine_id=engine_id,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra or {},
        )
        if role
        else None
    )
    return vllm_config(model_dir, tp, transfer, PdBrokerConnector, backend, **cache)


@pytest.fixture(scope="module", autouse=True)
def vllm_distributed() -> Iterator[None]:
    """A TP=1 worker's distributed state (vLLM's connector factory reads the TP rank) for the
    whole of a test module that imports this fixture."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_vllm_distributed(port)
    yield
    shutdown_vllm_distributed()


def init_vllm_distributed(port: int) -> None:
    """vLLM's distributed state for a one-rank world (gloo): what a TP=1 worker has."""
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1)


def shutdown_vllm_distributed() -> None:
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole backing allocation of a cache view, as uint8."""
    return torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())


class Engine:
    """One engine in this process: vLLM's ``Scheduler`` with the scheduler-side connector it
    creates, and per TP rank a KV cache and a worker-side connector: the
    :class:`PdBrokerConnector` vLLM's factory makes when ``tp`` is 1 (vLLM's distributed
    state must be up, :func:`init_vllm_distributed`), else one :class:`WorkerHalf` per rank
    (a process holds one vLLM TP rank). Worker outputs merge in vLLM's ``KVOutputAggregator``;
    each step's merged connector output, as the scheduler received it, collects in
    :attr:`connector_outputs`. With ``log_stats`` the scheduler's per-step stats collect in
    :attr:`scheduler_stats`."""

    def __init__(
        self,
        config: VllmConfig,
        num_blocks: int,
        backend: type = FlashAttentionBackend,
        poison: bool = False,
        log_stats: bool = False,
    ) -> None:
        self.config = config
        self.kv_config = kv_cache_config(config, num_blocks, backend)
        config.cache_config.num_gpu_blocks = self.kv_config.num_blocks
        # As vLLM's engine core: the scheduler sees one layer's spec per group.
        scheduler_config = generate_scheduler_kv_cache_config([self.kv_config])
        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, config)
        self.scheduler = Scheduler(
            config,
            scheduler_config,
            StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=log_stats,
        )
        # As vLLM's engine core: requests hash their blocks (prefix caching and connectors).
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(
            hash_block_size, hash_fn, config.num_hash_lookahead_tokens
        )
        self.scheduler_stats: list[SchedulerStats] = []
        self.connector_outputs: list[KVConnectorOutput] = []
        tp = config.parallel_config.tensor_parallel_size
        self.caches = [allocate(config, self.kv_config, backend) for _ in range(tp)]
        if poison:
            for cache in self.caches:
                storage_bytes(next(iter(cache.values()))).fill_(POISON)
        if tp == 1:
            self.workers: list[Any] = [
                KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kv_config)
            ]
        else:
            assert config.kv_transfer_config is not None
            settings = ConnectorSettings.from_extra_config(
                config.kv_transfer_config.kv_connector_extra_config
            )
            self.workers = [WorkerHalf(config, self.kv_config, settings, tp, r) for r in range(tp)]
        self.aggregator = KVOutputAggregator(tp)
        try:
            for worker, cache in zip(self.workers, self.caches):
                worker.register_kv_caches(cache)
        except BaseException:
            self.close()
            raise

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None,
    ) -> Request:
        request = Request(
            request_id,
            list(prompt),
            SamplingParams(
                max_tokens=max_tokens, extra_args={"kv_transfer_params": kv_transfer_params}
            ),
            None,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(request)
        return request

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(request_id)

    def step(
        self, token: int = 7, scheduled: Callable[[SchedulerOutput], None] | None = None
    ) -> tuple[SchedulerOutput, list[Any]]:
        """One scheduler step; each request whose prompt completes samples ``token``;
        ``scheduled`` sees the scheduler's output before the workers do. Returns the
        scheduler output and the request outputs it produced."""
        out = self.scheduler.schedule()
        if scheduled is not None:
            scheduled(out)
        results = [self._worker_step(w, out) for w in self.workers]
        # The scheduler already counted this step's tokens as computed; a request whose
        # tokens are all computed now samples (a prefill chunk short of the prompt does not).
        sampled = {
            r: [token]
            if self.scheduler.requests[r].num_computed_tokens
            >= self.scheduler.requests[r].num_tokens
            else []
            for r in out.num_scheduled_tokens
        }
        ids = list(sampled)
        runner_outputs = [
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled[r] for r in ids],
                kv_connector_output=KVConnectorOutput(
                    finished_sending=r.finished_sending,
                    finished_recving=r.finished_recving,
                    failed_recving=r.failed_recving,
                    kv_connector_stats=w.get_kv_connector_stats(),
                    kv_connector_worker_meta=pickle.loads(
                        pickle.dumps(w.build_connector_worker_meta())
                    ),
                ),
            )
            for w, r in zip(self.workers, results)
        ]
        merged = self.aggregator.aggregate(runner_outputs)
        assert merged is not None and merged.kv_connector_output is not None
        self.connector_outputs.append(merged.kv_connector_output)
        engine_outputs = self.scheduler.update_from_output(out, merged)
        self.scheduler_stats += [
            o.scheduler_stats for o in engine_outputs.values() if o.scheduler_stats is not None
        ]
        return out, [o for outs in engine_outputs.values() for o in outs.outputs]

    @staticmethod
    def _worker_step(worker: Any, out: SchedulerOutput) -> Any:
        metadata = pickle.loads(pickle.dumps(out.kv_connector_metadata))
        assert isinstance(metadata, PdBrokerMetadata)
        if isinstance(worker, WorkerHalf):
            worker.start_load_kv(metadata)
            return worker.get_transfer_results()
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(None)
        results = worker.get_transfer_results(out.finished_req_ids)
        worker.clear_connector_metadata()
        return results

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        connector = self.scheduler.get_kv_connector()
        if connector is not None:
            connector.shutdown()
