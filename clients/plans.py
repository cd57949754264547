"""A decode rank's plans on the client side: checking one before anything is posted
(:func:`check_plan`), reporting them (:func:`report_request`, :func:`report_traced`) and
judging the broker's answer (:func:`check_usable`), and what a rank's fetch of one recorded
(:class:`RankFetch`). Shared by :mod:`clients.decode` and the vLLM connector's scheduler, which
asks for and reports its workers' plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import numpy as np

from broker import tracing
from broker.errors import InvalidFieldError
from broker.limits import LIMITS
from broker.v1 import broker_pb2 as pb
from broker.wire import MEMORY_KIND
from clients.protocol import BrokerCallError, FailoverStub, report_transfers
from clients.transport import Region, TransferError, descriptor_array, inside


@dataclass(frozen=True)
class RankFetch:
    """One decode rank's part of a fetch. Durations in seconds; ``reported_at`` is
    ``time.monotonic()`` just before the report was sent."""

    tp_rank: int
    plan_id: str
    prefill_ranks: tuple[int, ...]
    nbytes: int
    num_descriptors: int
    naive_bytes: int
    vllm_descriptors: int
    plan_s: float
    read_s: float
    report_s: float
    reported_at: float

    @classmethod
    def of(
        cls,
        tp_rank: int,
        plan: pb.GetTransferPlanResponse,
        plan_s: float,
        read_s: float,
        report_s: float,
        reported_at: float,
    ) -> RankFetch:
        """Rank ``tp_rank``'s part of a fetch that read ``plan``."""
        return cls(
            tp_rank,
            plan.plan_id,
            tuple(s.prefill_rank for s in plan.sources),
            plan.total_bytes,
            plan.num_descriptors,
            plan.naive_bytes,
            plan.vllm_descriptors,
            plan_s,
            read_s,
            report_s,
            reported_at,
        )


@dataclass(frozen=True)
class PlanReport:
    """A decode rank's report of a plan (:meth:`~clients.decode.AsyncDecodeClient.report_many`,
    :func:`report_traced`): DONE with ``nbytes`` moved in ``duration_s``, or FAILED with
    ``error`` when one is given."""

    tp_rank: int
    plan_id: str
    nbytes: int = 0
    duration_s: float = 0.0
    error: str = ""


class TransferEnded(TransferError):
    """The broker ended the transfer (expired, aborted, failed) before this rank's report:
    what it read may have been overwritten. Recompute."""


class PlanRejected(TransferError):
    """A plan this rank refuses to execute; nothing of it was posted to NIXL."""


@dataclass(frozen=True)
class SourceRead:
    """One checked source of a plan: ``(n, 3)`` descriptor rows of both sides, memory kinds."""

    source: pb.SourcePlan
    local: np.ndarray
    remote: np.ndarray
    local_kind: str
    remote_kind: str


def check_plan(
    plan: pb.GetTransferPlanResponse, regions: Sequence[Region], tp_rank: int
) -> list[SourceRead]:
    """Parse and check every source of ``plan`` before anything is posted: descriptors whole
    and paired one to one with equal lengths, every local one inside ``regions`` (decode rank
    ``tp_rank``'s registered memory), no local byte written twice, and the lengths adding up
    to each source's and the plan's ``total_bytes``; a source's local memory kind is the kind
    of the regions it writes. Raises :class:`PlanRejected`."""
    reads: list[SourceRead] = []
    for i, source in enumerate(plan.sources):
        where = f"plan {plan.plan_id} source {i} (prefill rank {source.prefill_rank})"
        try:
            local = descriptor_array(source.local_descriptors)
            remote = descriptor_array(source.remote_descriptors)
            kinds = (
                MEMORY_KIND.from_proto(source.local_memory_kind, "local_memory_kind").name,
                MEMORY_KIND.from_proto(source.remote_memory_kind, "remote_memory_kind").name,
            )
        except InvalidFieldError as exc:
            raise PlanRejected(f"{where}: unknown memory kind: {exc}") from None
        except ValueError as exc:
            raise PlanRejected(f"{where}: {exc}") from None
        if not len(local):
            raise PlanRejected(f"{where}: no descriptors")
        if local.shape != remote.shape:
            raise PlanRejected(f"{where}: {len(local)} local descriptors for {len(remote)} remote")
        if len(local) != source.num_descriptors:
            raise PlanRejected(
                f"{where}: {len(local)} descriptors, not its num_descriptors "
                f"{source.num_descriptors}"
            )
        if not np.array_equal(local[:, 1], remote[:, 1]):
            raise PlanRejected(f"{where}: local and remote descriptor lengths differ")
        if not inside(local, [r for r in regions if r.kind == kinds[0]]):
            raise PlanRejected(f"{where} writes outside rank {tp_rank}'s registered regions")
        reads.append(SourceRead(source, local, remote, *kinds))
    if reads:
        writes = np.concatenate([r.local for r in reads])
        writes = writes[np.lexsort((writes[:, 0], writes[:, 2]))]  # by device, then address
        same_device = writes[1:, 2] == writes[:-1, 2]
        if (same_device & (writes[1:, 0] < writes[:-1, 0] + writes[:-1, 1])).any():
            raise PlanRejected(f"plan {plan.plan_id} writes some bytes of rank {tp_rank} twice")
    # Inside the regions and disjoint: every sum below is bounded by the registered bytes.
    for i, read in enumerate(reads):
        nbytes = int(read.local[:, 1].sum())
        if nbytes != read.source.total_bytes:
            raise PlanRejected(
                f"plan {plan.plan_id} source {i}'s descriptors add up to {nbytes} "
                f"bytes, not its total_bytes {read.source.total_bytes}"
            )
    nbytes = sum(r.source.total_bytes for r in reads)
    if nbytes != plan.total_bytes:
        raise PlanRejected(
            f"plan {plan.plan_id}'s descriptors add up to {nbytes} bytes, not its "
            f"total_bytes {plan.total_bytes}"
        )
    return reads


def report_request(engine_id: str, report: PlanReport) -> pb.ReportTransferRequest:
    """``report`` of decode engine ``engine_id`` as the broker takes it."""
    return pb.ReportTransferRequest(
        plan_id=report.plan_id,
        engine_id=engine_id,
        tp_rank=report.tp_rank,
        status=pb.REPORT_STATUS_FAILED if report.error else pb.REPORT_STATUS_DONE,
        bytes_moved=0 if report.error else report.nbytes,
        duration_us=int(report.duration_s * 1e6),
        error=report.error[: LIMITS.max_text_chars],
    )


async def report_traced(
    stub: FailoverStub,
    engine_id: str,
    reports: Sequence[PlanReport],
    traces: Sequence[tuple[str, str]],
    timeout_s: float,
) -> list[pb.ReportTransferResponse | BrokerCallError]:
    """Decode engine ``engine_id``'s ``reports`` through ``ReportTransfers``
    (:func:`~clients.protocol.report_transfers`), each in a ``decode.report`` span of its
    transfer's trace (``traces``: the transfer id and plan ``traceparent`` of each report)
    that records the broker's ``intact`` verdict or ends with its refusal."""
    spans = [
        tracing.start_span(
            "decode.report", traceparent, report_attributes(transfer_id, r.tp_rank, r.error)
        )
        for r, (transfer_id, traceparent) in zip(reports, traces)
    ]
    try:
        outcomes = await report_transfers(
            stub, engine_id, [report_request(engine_id, r) for r in reports], timeout_s
        )
    except BaseException as exc:
        for span in spans:
            tracing.end_span(span, str(exc) or type(exc).__name__)
        raise
    for span, outcome in zip(spans, outcomes):
        if isinstance(outcome, BrokerCallError):
            tracing.end_span(span, str(outcome))
            continue
        if span is not None:
            span.set_attribute("pdbroker.intact", outcome.intact)
        tracing.end_span(span)
    return outcomes


def report_attributes(transfer_id: str, tp_rank: int, error: str) -> dict[str, Any]:
    """The attributes of a rank's ``decode.report`` span (a child of its plan's trace)."""
    return {
        "pdbroker.transfer_id": transfer_id,
        "pdbroker.decode_rank": tp_rank,
        "pdbroker.status": "failed" if error else "done",
    }


def refused_report(refusal: BrokerCallError) -> NoReturn:
    """Raise for a report the broker refused: :class:`TransferEnded` when the transfer ended
    while the rank read (ABORTED: prefill may reuse the blocks now), else the refusal."""
    if refusal.code is not grpc.StatusCode.ABORTED:
        raise refusal
    raise TransferEnded(f"data invalid, recompute: {refusal.details}") from None


def check_usable(
    plan_id: str,
    outcome: pb.ReportTransferResponse,
    failure: TransferError | None,
) -> None:
    """Raise unless the rank's reported read of plan ``plan_id`` is usable: the read's
    ``failure``, or :class:`TransferEnded` when the broker did not record it intact."""
    if failure is not None:
        raise failure
    if not outcome.intact:
        raise TransferEnded(
            f"data invalid, recompute: plan {plan_id}'s transfer ended "
            f"({pb.TransferState.Name(outcome.state)}) before the report"
        )
