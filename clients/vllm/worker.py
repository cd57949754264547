"""The connector's worker half: one TP rank's registration, loads and releases.

:meth:`WorkerHalf.register_kv_caches` derives the rank's page layout from vLLM's KV cache
tensors (:mod:`clients.vllm.layout`) and registers the rank with the broker through
:class:`~clients.prefill.AsyncPrefillClient` or :class:`~clients.decode.AsyncDecodeClient`,
which run on a private event-loop thread (NIXL agent, lease keep-alive, release stream).

Decode: :meth:`start_load_kv` starts each new load in the background. With the rank's plan in
the metadata (the scheduler asked for every rank's plans in one call) it reads that plan
(:meth:`~clients.decode.AsyncDecodeClient.execute`) and the report goes back to the scheduler
in the step's :meth:`build_connector_worker_meta`; a plan naming a prefill agent this rank's
agent lost, or no plan, makes the rank load on its own: check the published token count,
plan, NIXL reads, report. :meth:`get_transfer_results` reports finished loads, and failed
ones, whose requests vLLM recomputes (``kv_load_failure_policy=recompute``), among them, as
well as the loads the scheduler says to fail (their reads were not intact on every rank). A
load fails when the broker is unreachable, refuses the plan (layouts that do not match), or
says the data is not intact, when a read fails, or when the prefill engine published another
token count than this engine expects. A plan the broker refused, or a token count that does
not match, aborts the transfer so the prefill engine frees its blocks. Each load the rank
planned itself, read or failed, is recorded in the rank's
:class:`~clients.vllm.stats.PdBrokerKVConnectorStats`, which vLLM collects every step
(:meth:`get_kv_connector_stats`); the scheduler records the others.

Prefill: each release the broker streams to this rank (every reader done, expired, failed or
aborted) becomes a finished send of the request that published it, and vLLM frees its blocks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from google.protobuf.message import DecodeError
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

from broker.layout import EngineLayout
from broker.v1 import broker_pb2 as pb
from broker.wire import TRANSFER_STATE
from clients.decode import AsyncDecodeClient, Fetch, FetchError
from clients.fetches import PlanReport, TransferEnded
from clients.nixl_transport import NixlTransport, UnavailableBackendError
from clients.plan_check import Checked, check_plans
from clients.prefill import AsyncPrefillClient, Release
from clients.protocol import BrokerCallError
from clients.session import AsyncEngineClient, LoopThread, RankSession
from clients.vllm.layout import ModelFacts, derive_rank_memory, model_fingerprint
from clients.vllm.metadata import (
    ConnectorSettings,
    LoadSpec,
    PdBrokerMetadata,
    PdBrokerWorkerMetadata,
)
from clients.vllm.stats import PdBrokerKVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


class LoadError(RuntimeError):
    """A load that cannot be used; its request is recomputed. ``transfer_ended``: the
    broker had ended the transfer (expired, aborted, failed by another rank) before this
    rank's report."""

    def __init__(self, message: str, *, transfer_ended: bool = False) -> None:
        super().__init__(message)
        self.transfer_ended = transfer_ended


class WorkerHalf:
    """Worker-side state of one TP rank; vLLM calls it from the model runner's thread."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
        tp_size: int,
        tp_rank: int,
    ) -> None:
        kv_config = vllm_config.kv_transfer_config
        assert kv_config is not None and kv_config.engine_id is not None
        if kv_config.is_kv_producer == kv_config.is_kv_consumer:
            raise ValueError(
                "PdBrokerConnector: kv_role must be kv_producer (prefill engines) "
                "or kv_consumer (decode engines)"
            )
        self.engine_id = kv_config.engine_id
        self.producer = kv_config.is_kv_producer
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.tp_size, self.tp_rank = tp_size, tp_rank
        model_config = vllm_config.model_config
        text_config = model_config.hf_text_config
        self.facts = ModelFacts(
            model_config.get_total_num_kv_heads(),
            getattr(text_config, "n_groups", None)
            or getattr(text_config, "mamba_n_groups", None)
            or 0,
            vllm_config.cache_config.cache_dtype,
        )
        name = settings.model_name or model_config.served_model_name or model_config.model
        self.model_name = name if isinstance(name, str) else name[0]
        self.transport = NixlTransport(settings.backends, settings.nixl_params())
        try:
            self.transport.check()  # before vLLM loads the model
        except UnavailableBackendError as exc:
            raise ValueError(f"kv_connector_extra_config.{exc}") from None
        self.client: AsyncEngineClient | None = None
        self._loop: LoopThread | None = None
        #: Loads in flight: a fetch of this rank's own, or the report of a handed plan read.
        self._loads: dict[str, Future[Fetch | PlanReport]] = {}
        self._reports: list[tuple[str, PlanReport]] = []  # for the scheduler, this step
        self._failing: set[str] = set()  # loads the scheduler says to fail
        self._released: set[str] = set()  # transfer ids released, filled on the loop thread
        self._released_lock = threading.Lock()
        self._sends: dict[str, str] = {}  # transfer id -> request id, from the scheduler
        self.stats = PdBrokerKVConnectorStats()  # this step's, on the model runner's thread

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Declare this rank's pages, register them with NIXL and the rank with the broker."""
        layout = engine_layout(
            self.kv_cache_config, kv_caches, self.tp_size, self.facts, self.model_name
        )
        memory = derive_rank_memory(
            self.kv_cache_config,
            kv_caches,
            self.tp_size,
            self.tp_rank,
            self.facts,
            get_conv_state_layout(),
        )
        timeout, security = self.settings.call_timeout_s, self.settings.channel_security()
        if self.producer:
            client: AsyncEngineClient = AsyncPrefillClient(
                self.settings.broker,
                self.engine_id,
                layout,
                {self.tp_rank: memory.regions},
                on_release=self._on_release,
                progress_interval_s=self.settings.progress_interval_s,
                idle_interval_s=self.settings.progress_interval_s,
                call_timeout_s=timeout,
                security=security,
                transport=self.transport,
            )
        else:
            client = AsyncDecodeClient(
                self.settings.broker,
                self.engine_id,
                layout,
                {self.tp_rank: memory.regions},
                read_timeout_s=self.settings.read_timeout_s,
                call_timeout_s=timeout,
                security=security,
                transport=self.transport,
            )
        self._loop = LoopThread(f"pdbroker-{self.engine_id}-rank{self.tp_rank}")
        try:
            self._loop.run(client.start())
        except BaseException:
            self._loop.close()
            self._loop = None
            raise
        self.client = client
        log.info(
            "rank %d of %s registered with the broker at %s, NIXL over %s: %d regions of "
            "%d blocks of %d bytes, %d groups",
            self.tp_rank,
            self.engine_id,
            self.settings.broker,
            "+".join(self.settings.backends),
            memory.layout.num_regions,
            memory.layout.num_blocks,
            memory.layout.page_bytes,
            len(memory.layout.groups),
        )

    def start_load_kv(self, metadata: PdBrokerMetadata) -> None:
        """Start this step's loads, reading the plans handed to this rank; note this step's
        published transfers and the loads to fail."""
        self._sends.update(metadata.sends)
        self._failing |= metadata.failed_loads
        handed = HandedPlans(
            {r: plan for r, spec in metadata.loads.items() if (plan := spec.plan_of(self.tp_rank))}
        )
        for request_id, spec in metadata.loads.items():
            self._loads[request_id] = self._submit(
                self._execute(request_id, spec, handed)
                if request_id in handed.serialized
                else self._load(spec)
            )

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """Loads that ended (failed ones also in ``failed_recving``, with the loads the
        scheduler says to fail) and released sends; records each ended load this rank
        planned itself in :attr:`stats` and keeps the reports of handed plans for
        :meth:`build_connector_worker_meta`."""
        results = KVConnectorTransferResults()
        results.finished_recving |= self._failing
        results.failed_recving |= self._failing
        self._failing = set()
        for request_id, future in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[request_id]
            results.finished_recving.add(request_id)
            error = "cancelled" if future.cancelled() else future.exception()
            if error is None:
                result = future.result()
                if isinstance(result, PlanReport):
                    self._reports.append((request_id, result))
                    if result.error:  # the scheduler counts it when reporting
                        log.warning(
                            "load of %s failed, vLLM recomputes it: %s", request_id, result.error
                        )
                        results.failed_recving.add(request_id)
                    continue
                for rank in result.ranks:
                    self.stats.record_transfer(rank)
                continue
            log.warning("load of %s failed, vLLM recomputes it: %s", request_id, error)
            results.failed_recving.add(request_id)
            if isinstance(error, LoadError) and error.transfer_ended:
                self.stats.record_expired_transfer()
            else:
                self.stats.record_failed_transfer()
        with self._released_lock:
            done = self._released & self._sends.keys()
            self._released -= done
        results.finished_sending.update(self._sends.pop(t) for t in done)
        return results

    def get_kv_connector_stats(self) -> PdBrokerKVConnectorStats | None:
        """The loads recorded since the last call (None if none), which start anew."""
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def build_connector_worker_meta(self) -> PdBrokerWorkerMetadata | None:
        """The reports of the handed plans whose loads ended this step (None if none), for
        the scheduler half to send."""
        if not self._reports:
            return None
        meta = PdBrokerWorkerMetadata(tuple(self._reports))
        self._reports = []
        return meta

    def shutdown(self) -> None:
        """Leave the broker and stop the loop thread. Idempotent."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            if self.client is not None:
                loop.run(self.client.close())
        except BrokerCallError as exc:  # the broker is gone: its lease expires there
            log.warning("rank %d of %s could not deregister: %s", self.tp_rank, self.engine_id, exc)
        finally:
            loop.close()

    # ---------------------------------------------------------------- internals

    def _submit(self, coro: Coroutine[Any, Any, Fetch | PlanReport]) -> Future[Fetch | PlanReport]:
        assert self._loop is not None, "register_kv_caches() first"
        return self._loop.submit(coro)

    async def _execute(
        self, request_id: str, spec: LoadSpec, handed: HandedPlans
    ) -> Fetch | PlanReport:
        """Read the plan the scheduler handed this rank for ``request_id``; load on its own
        (:meth:`_load`) when the plan names a prefill agent this rank's agent lost."""
        client = self.client
        assert isinstance(client, AsyncDecodeClient)
        plan, checked = handed.checked(request_id, client.sessions[self.tp_rank])
        if client.lost_agent(self.tp_rank, plan):
            log.info(
                "rank %d lacks a prefill agent plan %s reads from; it asks for the plan again",
                self.tp_rank,
                plan.plan_id,
            )
            return await self._load(spec)
        return await client.execute(self.tp_rank, spec.transfer_id, plan, checked=checked)

    def _on_release(self, release: Release) -> None:
        with self._released_lock:
            self._released.add(release.transfer_id)

    async def _load(self, spec: LoadSpec) -> Fetch:
        """Check, plan, read and report one transfer; raises :class:`LoadError` if unusable."""
        client = self.client
        assert isinstance(client, AsyncDecodeClient)
        if not spec.waits_at(self.settings.broker):
            raise LoadError(
                f"transfer {spec.transfer_id} waits at broker {spec.broker}, this "
                f"engine is registered with {self.settings.broker}"
            )
        try:
            info = await client.transfer(spec.transfer_id, spec.prefill_engine)
        except BrokerCallError as exc:
            raise LoadError(str(exc)) from None
        state = TRANSFER_STATE.from_proto(info.state, "state")
        if state.terminal:
            raise LoadError(
                f"transfer {spec.transfer_id} is {state.value}; its blocks are released",
                transfer_ended=True,
            )
        if info.num_tokens != spec.num_tokens:
            await self._abort(
                client,
                spec,
                f"decode engine {self.engine_id} expects "
                f"{spec.num_tokens} tokens, {info.num_tokens} were published",
            )
            raise LoadError(
                f"transfer {spec.transfer_id} holds {info.num_tokens} tokens, "
                f"this engine expects {spec.num_tokens}"
            )
        try:
            return await client.fetch(
                spec.transfer_id, spec.block_ids, prefill_engine_id=spec.prefill_engine
            )
        except FetchError as exc:
            refused = [
                e
                for e in exc.errors.values()
                if isinstance(e, BrokerCallError) and e.method == "GetTransferPlan"
            ]
            if refused:
                await self._abort(client, spec, f"plan refused: {refused[0]}")
            ended = any(isinstance(e, TransferEnded) for e in exc.errors.values())
            raise LoadError(str(exc), transfer_ended=ended) from None

    async def _abort(self, client: AsyncDecodeClient, spec: LoadSpec, reason: str) -> None:
        try:
            await client.abort(spec.transfer_id, reason, spec.prefill_engine)
        except BrokerCallError as exc:
            log.warning("cannot abort transfer %s: %s", spec.transfer_id, exc)


class HandedPlans:
    """A step's plans handed to this rank (serialized, by request id), parsed and checked
    together (:func:`~clients.plan_check.check_plans`) when the first is read, on the
    client's loop thread."""

    def __init__(self, serialized: dict[str, bytes]) -> None:
        self.serialized = serialized
        self._checked: dict[str, tuple[pb.GetTransferPlanResponse, Checked]] | None = None
        self._unreadable: dict[str, DecodeError] = {}

    def checked(
        self, request_id: str, session: RankSession
    ) -> tuple[pb.GetTransferPlanResponse, Checked]:
        """``request_id``'s plan and its check on ``session``'s rank; raises ``DecodeError``
        for a plan that does not parse (that load alone fails)."""
        if self._checked is None:
            plans = {}
            for r, serialized in self.serialized.items():
                try:
                    plans[r] = pb.GetTransferPlanResponse.FromString(serialized)
                except DecodeError as exc:
                    self._unreadable[r] = exc
            checks = check_plans(list(plans.values()), session.region_index, session.tp_rank)
            self._checked = {r: (plan, c) for (r, plan), c in zip(plans.items(), checks)}
        if request_id in self._unreadable:
            raise self._unreadable[request_id]
        return self._checked[request_id]


def engine_layout(
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    tp_size: int,
    facts: ModelFacts,
    model_name: str,
) -> EngineLayout:
    """Every rank's layout, from this rank's tensors: TP ranks of a vLLM engine allocate the
    same shapes and differ only in which slices of the global tensors they hold."""
    ranks = tuple(
        derive_rank_memory(
            kv_cache_config, kv_caches, tp_size, r, facts, get_conv_state_layout()
        ).layout
        for r in range(tp_size)
    )
    return EngineLayout(model_fingerprint(model_name, ranks[0]), tp_size, ranks)
