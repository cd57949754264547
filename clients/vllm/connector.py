"""``PdBrokerConnector``: a vLLM 0.33 KV connector that moves prompt state through pdbroker.

Load it with ``--kv-transfer-config '{"kv_connector": "PdBrokerConnector",
"kv_connector_module_path": "clients.vllm.connector", "kv_role": "kv_producer" | "kv_consumer",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"broker": "HOST:PORT"}}'``
(see ``docs/VLLM.md``; settings in :class:`~clients.vllm.metadata.ConnectorSettings`).

vLLM builds one instance in the scheduler process (:class:`~clients.vllm.scheduler.SchedulerHalf`)
and one per worker (:class:`~clients.vllm.worker.WorkerHalf`); this class only forwards. The
scheduler hands the workers their plans in the step's connector metadata
(``build_connector_meta``); the workers hand back their reports as connector worker metadata
(``build_connector_worker_meta``), which vLLM merges over the TP ranks and gives the scheduler
(``update_connector_output``) before it reads the step's finished loads. It
supports the hybrid memory allocator (HMA), which hybrid Mamba models require. Failed loads
are reported as ``failed_recving``: with several KV-cache groups vLLM cannot map block-level
errors (``get_block_ids_with_load_errors``) to requests, so this connector reports none.
Decode transfer statistics (the workers', and the scheduler's for the plans it asked for)
reach vLLM's log and ``/metrics`` as :class:`~clients.vllm.stats.PdBrokerKVConnectorStats` and
``vllm:pdbroker_*`` metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from clients.vllm.metadata import ConnectorSettings, PdBrokerMetadata
from clients.vllm.scheduler import SchedulerHalf
from clients.vllm.stats import PdBrokerKVConnectorStats, PdBrokerPromMetrics
from clients.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class PdBrokerConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill engines publish finished prompts to the broker; decode engines read them."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        for name in (
            "pipeline_parallel_size",
            "decode_context_parallel_size",
            "prefill_context_parallel_size",
        ):
            if getattr(parallel, name) > 1:
                raise ValueError(
                    f"parallel_config.{name}: {getattr(parallel, name)}; PdBrokerConnector "
                    "supports tensor parallelism only (no pipeline or context parallelism)"
                )
        settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHalf(vllm_config, kv_cache_config, settings)
        else:
            self.worker = WorkerHalf(
                vllm_config,
                kv_cache_config,
                settings,
                get_tensor_model_parallel_world_size(),
                get_tensor_model_parallel_rank(),
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Layer-outer, heads before tokens: a head slice of a block is one byte range."""
        return "LBHNC" if vllm_config.model_config is not None else None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """A load always carries each Mamba group's state after all published tokens, so a
        local hit may end where the attention groups' hit ends, past a Mamba group's own."""
        return True

    # ---------------------------------------------------------------- scheduler side

    def _scheduler(self) -> SchedulerHalf:
        assert self.scheduler is not None, "a scheduler-side call on a worker connector"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A load restores the request's own blocks in every transfer group."""
        return self._kv_cache_config.transfer_group_ids

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    # ---------------------------------------------------------------- worker side

    def _worker(self) -> WorkerHalf:
        assert self.worker is not None, "a worker-side call on the scheduler connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PdBrokerMetadata)
        self._worker().start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete before their requests are scheduled: nothing to wait for."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Decode engines read prefill memory in place: nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing is saved."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker().get_transfer_results()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """A decode worker's loads since the last call, or the scheduler's: those whose
        plans it asked for."""
        if self.worker is not None:
            return self.worker.get_kv_connector_stats()
        return self._scheduler().get_kv_connector_stats()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().build_connector_worker_meta()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return (
            PdBrokerKVConnectorStats(data=data) if data is not None else PdBrokerKVConnectorStats()
        )

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return PdBrokerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
