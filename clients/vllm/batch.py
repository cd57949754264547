"""A decode engine's plans and reports in one broker call each per scheduler step
(``batch_calls``, the default), made by the connector's scheduler half for its workers.

vLLM 0.33 carries it as follows. The scheduler's ``build_connector_meta`` asks for every decode
rank's plan of every load it starts in the step in one ``GetTransferPlans`` call
(:meth:`BatchedCalls.with_plans`) and the connector metadata, which vLLM pickles to every
worker, carries them serialized; a rank whose entry the broker refused, or every rank when the
call fails, gets no plan and asks for its own. Each worker reads its plan and declares the load
finished in ``get_transfer_results`` (failed too when its read failed); its report rides back
in the same step's ``build_connector_worker_meta``, which vLLM's ``KVOutputAggregator`` merges
over the TP ranks. The scheduler's ``update_connector_output`` (:meth:`BatchedCalls.update`)
keeps each report until every rank finished that load (the aggregator then lists it in the
step's ``finished_recving``) and sends the reports of the loads that finished in the step in
one ``ReportTransfers`` call: each transfer is reported in one call, whichever steps its ranks'
reads ended in.

vLLM handles a step's failed loads (``failed_recving``) before that hook and its finished ones
(``finished_recving``) after it, and lets the hook rewrite them (its own MoRIIO connector
rewrites ``finished_sending`` there). So a load whose reads the broker did not record intact on
every rank (its transfer ended while they read: prefill may have reused the pages) is taken
out of the step's finished loads, and the next step's metadata (``failed_loads``) tells every
worker to report it finished and failed: vLLM then recomputes the request. A usable load costs
no step more than a worker planning and reporting its own; an unusable one is recomputed one
step later (two with vLLM's asynchronous scheduling, whose next step is scheduled before this
step's output is processed). The plans and reports block the scheduler thread for one call
each per step that has any.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from broker.v1 import broker_pb2 as pb
from broker.wire import block_ids_to_proto
from clients import protocol
from clients.fetches import PlanReport, TransferEnded
from clients.protocol import BrokerCallError, FailoverStub
from clients.reports import check_usable, refused_report, report_traced
from clients.session import LoopThread
from clients.transport import TransferError
from clients.vllm.metadata import LoadSpec, PdBrokerWorkerMetadata
from clients.vllm.stats import PdBrokerKVConnectorStats

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Handed:
    """A plan handed to a worker, until its report is answered: its transfer, the trace its
    report span joins, its descriptors and the plan call's duration."""

    transfer_id: str
    traceparent: str
    num_descriptors: int
    plan_s: float


class BatchedCalls:
    """Decode engine ``engine_id``'s (``tp_size`` ranks) plans and reports, through the
    scheduler half's ``broker`` loop and stub; called from vLLM's scheduler thread only.
    :attr:`stats` counts the loads it planned, once their reports are answered."""

    def __init__(
        self,
        engine_id: str,
        tp_size: int,
        call_timeout_s: float,
        broker: Callable[[], tuple[LoopThread, FailoverStub]],
    ) -> None:
        self.engine_id, self.tp_size, self.call_timeout_s = engine_id, tp_size, call_timeout_s
        self._broker = broker
        #: Plans handed to the workers, by request id and plan id, until reported.
        self._handed: dict[str, dict[str, _Handed]] = {}
        #: The workers' reports of loads some rank has not finished yet, by request id.
        self._reports: dict[str, list[PlanReport]] = {}
        #: Requests with a read the broker did not record intact, until every worker
        #: finished their load.
        self._unusable: set[str] = set()
        self._failed_loads: set[str] = set()  # for the workers to report failed next step
        self.stats = PdBrokerKVConnectorStats()

    def with_plans(self, loads: dict[str, LoadSpec], to_plan: set[str]) -> dict[str, LoadSpec]:
        """``loads``, those of ``to_plan`` with every decode rank's plan, all asked for in
        one ``GetTransferPlans`` call (a call per ``max_batch_entries`` entries). A rank whose
        entry the broker refuses gets no plan, nor does any when the call fails: its worker
        asks for its own."""
        plannable = [(r, spec) for r, spec in loads.items() if r in to_plan]
        loop, stub = self._broker()
        requests = [
            pb.GetTransferPlanRequest(
                transfer_id=spec.transfer_id,
                tp_rank=rank,
                block_ids=block_ids,
                prefill_engine_id=spec.prefill_engine,
            )
            for _, spec in plannable
            for block_ids in [block_ids_to_proto(spec.block_ids)]  # once per load
            for rank in range(self.tp_size)
        ]
        started = time.perf_counter()
        try:
            answers = loop.run(
                protocol.get_plans(stub, self.engine_id, requests, self.call_timeout_s)
            )
        except BrokerCallError as exc:
            log.warning(
                "cannot get the plans of %d loads (%s: %s); each worker asks for its own",
                len(plannable),
                exc.code.name,
                exc.details,
            )
            return loads
        plan_s = time.perf_counter() - started
        planned = dict(loads)
        for i, (request_id, spec) in enumerate(plannable):
            ranks = answers[i * self.tp_size : (i + 1) * self.tp_size]
            handed: dict[str, _Handed] = {}
            for rank, answer in enumerate(ranks):
                if isinstance(answer, BrokerCallError):
                    log.info(
                        "rank %d's plan of %s was refused (%s); the rank asks for it itself",
                        rank,
                        spec.transfer_id,
                        answer,
                    )
                    continue
                handed[answer.plan_id] = _Handed(
                    spec.transfer_id, answer.traceparent, answer.num_descriptors, plan_s
                )
            self._handed[request_id] = handed
            planned[request_id] = replace(
                spec,
                plans=tuple(
                    b"" if isinstance(a, BrokerCallError) else a.SerializeToString() for a in ranks
                ),
            )
        return planned

    def take_failed_loads(self) -> set[str]:
        """The loads for the workers to report failed with the next step, handed over once."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def update(self, output: KVConnectorOutput) -> None:
        """Keep the reports the workers sent this step; send those of the loads every worker
        has finished now (:meth:`_report`); take each such load one of whose reads is
        unusable out of ``output.finished_recving`` (vLLM reads it after this hook) for the
        workers to report failed next step."""
        meta = output.kv_connector_worker_meta
        if isinstance(meta, PdBrokerWorkerMetadata):
            for request_id, report in meta.reports:
                self._reports.setdefault(request_id, []).append(report)
        finished = output.finished_recving or set()
        due = [(r, report) for r in finished for report in self._reports.pop(r, ())]
        if due:
            self._report(due)
        for request_id in list(finished):
            self._handed.pop(request_id, None)
            if request_id not in self._unusable:
                continue
            self._unusable.discard(request_id)
            if request_id not in output.failed_recving:
                finished.discard(request_id)
                self._failed_loads.add(request_id)

    def _report(self, reports: Sequence[tuple[str, PlanReport]]) -> None:
        """Send the workers' ``(request id, report)`` pairs in one ``ReportTransfers`` call
        (each in its transfer's trace), count each load in :attr:`stats` and note the
        requests with a successful read the broker did not record intact (or whose report
        it refused)."""
        loop, stub = self._broker()
        handed = [self._handed.get(r, {}).pop(report.plan_id, None) for r, report in reports]
        try:
            outcomes: Sequence[pb.ReportTransferResponse | BrokerCallError] = loop.run(
                report_traced(
                    stub,
                    self.engine_id,
                    [report for _, report in reports],
                    [("", "") if h is None else (h.transfer_id, h.traceparent) for h in handed],
                    self.call_timeout_s,
                )
            )
        except BrokerCallError as exc:
            outcomes = [exc] * len(reports)
        for (request_id, report), plan, outcome in zip(reports, handed, outcomes):
            try:
                if isinstance(outcome, BrokerCallError):
                    refused_report(outcome)
                check_usable(
                    report.plan_id, outcome, TransferError(report.error) if report.error else None
                )
            except (TransferError, BrokerCallError) as exc:
                if isinstance(exc, TransferEnded):
                    self.stats.record_expired_transfer()
                else:
                    self.stats.record_failed_transfer()
                if not report.error:  # else the worker failed the load already
                    log.warning(
                        "load of %s: rank %d's read is unusable, vLLM recomputes it: %s",
                        request_id,
                        report.tp_rank,
                        exc,
                    )
                    self._unusable.add(request_id)
                continue
            self.stats.record_read(
                report.duration_s,
                0.0 if plan is None else plan.plan_s,
                report.nbytes,
                0 if plan is None else plan.num_descriptors,
            )
