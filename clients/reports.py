"""Reporting plans a decode rank executed: the request the broker takes, the ``decode.report``
span of each report (a CLIENT span in its transfer's trace, the parent of the broker's
``broker.report``), and what the broker's answer means for the data read."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from broker import tracing
from broker.limits import LIMITS
from broker.v1 import broker_pb2 as pb
from clients.fetches import PlanReport, TransferEnded
from clients.protocol import BrokerCallError, FailoverStub, report_transfers
from clients.transport import TransferError


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
        traceparent=report.traceparent,
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
    that the report names as its parent and that records the entry's status and the
    broker's ``intact`` verdict, or ends with its refusal."""
    spans = [
        tracing.start_span(
            "decode.report",
            traceparent,
            report_attributes(transfer_id, r.tp_rank, r.error),
            rpc="ReportTransfers",
        )
        for r, (transfer_id, traceparent) in zip(reports, traces)
    ]
    requests = [
        report_request(
            engine_id, dataclasses.replace(r, traceparent=tracing.span_traceparent(span))
        )
        for r, span in zip(reports, spans)
    ]
    try:
        outcomes = await report_transfers(stub, engine_id, requests, timeout_s)
    except BaseException as exc:
        for span in spans:
            tracing.end_span(span, str(exc) or type(exc).__name__)
        raise
    for span, outcome in zip(spans, outcomes):
        if isinstance(outcome, BrokerCallError):
            tracing.set_rpc_status(span, outcome.code.value[0])
            tracing.end_span(span, str(outcome))
            continue
        tracing.set_rpc_status(span, grpc.StatusCode.OK.value[0])
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
    plan_id: str, outcome: pb.ReportTransferResponse, failure: TransferError | None
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
