"""A decode engine's batched calls: ``GetTransferPlans``, ``ReportTransfers``, and the
``EngineSession`` stream that carries both as messages (:class:`BatchedCalls`, a part of
:class:`~broker.servicer.BrokerServicer`). One implementation answers each request
(:func:`transfer_plans`, :func:`transfer_reports`) and raises on a whole-call failure: a
unary handler ends its call with that status, the stream answers that message with it and
goes on. A stream's messages are answered one at a time, in order, each exactly as its call
would be: the caller is identified once, when the stream opens, and each message passes the
call's authorization, limits, fencing and tracing; with metrics or tracing on, each message
is observed as a call of its kind (:attr:`BatchedCalls.observe_message`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from broker import convert, tracing
from broker.api import PlanResult, Report, ReportOutcome
from broker.auth import AccessGuard, Identity
from broker.calls import (
    OFFLOAD_BLOCK_IDS,
    OFFLOAD_DESCRIPTORS,
    Refused,
    Rule,
    abort,
    as_engine,
    failure_status,
    status_code,
)
from broker.errors import PdbrokerError, StoreUnavailableError
from broker.limits import LIMITS
from broker.plans import PlanTicket
from broker.service import BrokerService
from broker.v1 import broker_pb2 as pb

T = TypeVar("T")

#: A batched call gives the event loop back between entries after holding it this long.
BATCH_SLICE_S = 0.002


class Observed(Protocol):
    """A call under way, as the server observes it (counted, traced)."""

    def ended(self, code: grpc.StatusCode) -> None: ...


class _Servicer(Protocol):
    """What the batched calls use of :class:`~broker.servicer.BrokerServicer`."""

    service: BrokerService
    guard: AccessGuard | None
    traced: bool
    sessions_open: int
    observe_message: Callable[[str], Observed] | None

    def identify(self, context: grpc.aio.ServicerContext) -> Identity | None: ...

    async def authorized_as(self, who: Identity | None, rule: Rule, request: Any) -> Any: ...

    async def stored(self, function: Callable[..., T], *args: Any) -> T: ...

    async def pure(self, heavy: bool, function: Callable[..., T], *args: Any) -> T: ...

    async def parsed(self, request: Any) -> Any: ...

    async def planned(
        self, request: pb.GetTransferPlanRequest, answer_bytes: int | None, block_ids: int
    ) -> PlanResult: ...


class BatchedCalls:
    """The batched handlers of the Broker servicer."""

    #: EngineSession streams open now.
    sessions_open = 0
    #: Starts observing one message of a stream as a call of the method it names (set by
    #: the server when it counts or traces calls).
    observe_message: Callable[[str], Observed] | None = None

    async def GetTransferPlans(
        self: _Servicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Each entry is planned as ``GetTransferPlan`` plans one, in order, and answered
        on its own (:func:`transfer_plans`)."""
        try:
            response = pb.GetTransferPlansResponse()
            await transfer_plans(self, self.identify(context), await self.parsed(request), response)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)
        return response

    async def ReportTransfers(
        self: _Servicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Each report is recorded as ``ReportTransfer`` records one, in order, and
        answered on its own (:func:`transfer_reports`), in the call's trace context."""
        try:
            response = pb.ReportTransfersResponse()
            metadata = context.invocation_metadata() if self.traced else None
            who, request = self.identify(context), await self.parsed(request)
            await transfer_reports(self, who, request, metadata, response)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort(context, exc)
        return response

    async def EngineSession(
        self: _Servicer, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EngineSessionResponse]:
        """Answer each message as the call it carries (:func:`session_answer`), in order,
        until the client closes the stream; at most ``max_session_streams`` at once. A
        message that does not parse or is too large ends the stream with its status."""
        most = self.service.config.max_session_streams
        if self.sessions_open >= most:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: {most} EngineSession streams are open, the most this broker "
                "serves at once (--max-session-streams): make the unary calls",
            )
        self.sessions_open += 1
        try:
            who = self.identify(context)
            async for message in requests:
                if isinstance(message, Refused):
                    raise message
                yield await session_answer(self, who, await self.parsed(message))
        except Exception as exc:  # noqa: BLE001 - an unreadable message ends the stream
            await abort(context, exc)
        finally:
            self.sessions_open -= 1


async def session_answer(
    servicer: _Servicer, who: Identity | None, message: pb.EngineSessionRequest
) -> pb.EngineSessionResponse:
    """The answer to one EngineSession ``message`` of caller ``who``: its call's response,
    or the status that call would end with in ``error``."""
    answer = pb.EngineSessionResponse(sequence=message.sequence)
    kind = message.WhichOneof("request")
    observed = None
    try:
        if kind == "get_transfer_plans":
            if servicer.observe_message is not None:
                observed = servicer.observe_message("GetTransferPlans")
            answer.get_transfer_plans.SetInParent()
            await transfer_plans(
                servicer, who, message.get_transfer_plans, answer.get_transfer_plans
            )
        elif kind == "report_transfers":
            if servicer.observe_message is not None:
                observed = servicer.observe_message("ReportTransfers")
            traced = servicer.traced and message.traceparent
            metadata = (("traceparent", message.traceparent),) if traced else None
            answer.report_transfers.SetInParent()
            await transfer_reports(
                servicer, who, message.report_transfers, metadata, answer.report_transfers
            )
        else:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, "name get_transfer_plans or report_transfers"
            )
    except Exception as exc:  # noqa: BLE001 - the message's failure is its answer
        code, answer.error.message = failure_status(exc)
        answer.error.code = code.value[0]
        if observed is not None:
            observed.ended(code)
        return answer
    if observed is not None:
        observed.ended(grpc.StatusCode.OK)
    return answer


async def transfer_plans(
    servicer: _Servicer,
    who: Identity | None,
    request: pb.GetTransferPlansRequest,
    response: pb.GetTransferPlansResponse,
) -> None:
    """Answer ``request`` into ``response``: each entry planned as ``GetTransferPlan`` plans
    one, in order, and answered on its own; the answer's plans share one
    ``max_unary_plan_bytes`` budget. Adjacent entries of one transfer asked alike are handed
    out in one unit of work (:meth:`BrokerService.plan_group`). Raises on a whole-call
    failure."""
    await servicer.authorized_as(who, as_engine, request)
    engine_id = convert.batch_engine(request, request.entries, "entries")
    counts = convert.batch_block_ids(request.entries)
    budget = LIMITS.max_unary_plan_bytes
    entries, start, slice_start = request.entries, 0, time.perf_counter()
    while start < len(entries):
        end = convert.alike_entries(entries, counts, start, engine_id, OFFLOAD_BLOCK_IDS)
        group = entries[start:end]
        tickets = await _planned_group(servicer, group, engine_id, budget) if group[1:] else None
        for i in range(start, end):
            entry, result = entries[i], response.results.add()
            try:
                if tickets is None:
                    convert.check_entry_engine(entry, engine_id)
                    entry.engine_id = engine_id
                    plan = await servicer.planned(entry, budget, counts[i])
                    convert.plan_to_proto(plan, into=result.plan)
                elif tickets[i - start].num_descriptors > OFFLOAD_DESCRIPTORS:
                    plan = await servicer.pure(True, tickets[i - start].result)
                    convert.plan_to_proto(plan, into=result.plan)
                else:
                    convert.ticket_to_proto(tickets[i - start], result.plan)
                budget -= result.plan.ByteSize()
            except Exception as exc:  # noqa: BLE001 - an entry's failure is its answer
                result.ClearField("plan")
                result.code, result.message = _entry_refusal(exc, "entries", i)
            slice_start = await _yield_when_due(slice_start)
        start = end


async def _planned_group(
    servicer: _Servicer,
    entries: Sequence[pb.GetTransferPlanRequest],
    engine_id: str,
    budget: int,
) -> list[PlanTicket] | None:
    """Entries of one transfer asked alike handed out together, or None: each alone."""
    for entry in entries:
        entry.engine_id = engine_id
    queries = convert.plan_queries_alike(entries)
    if queries is None:
        return None
    return await servicer.stored(servicer.service.plan_group, queries, budget, OFFLOAD_BLOCK_IDS)


async def transfer_reports(
    servicer: _Servicer,
    who: Identity | None,
    request: pb.ReportTransfersRequest,
    metadata: Any,
    response: pb.ReportTransfersResponse,
) -> None:
    """Answer ``request`` into ``response``: each report recorded as ``ReportTransfer``
    records one, in order, and answered on its own; in the trace context of its
    ``traceparent`` (the reporting rank's span) when it names one, else of ``metadata`` (the
    call's, None: none). Raises on a whole-call failure."""
    await servicer.authorized_as(who, as_engine, request)
    engine_id = convert.batch_engine(request, request.reports, "reports")
    called = tracing.context_from_metadata(metadata) if metadata is not None else None
    slice_start = time.perf_counter()
    for i, entry in enumerate(request.reports):
        result = response.results.add()
        try:
            convert.check_entry_engine(entry, engine_id)
            entry.engine_id = engine_id
            report = convert.report_from_proto(entry)
            traced = called
            if servicer.traced and entry.traceparent:  # the reporting rank's span
                traced = tracing.context_from_traceparent(entry.traceparent)
            outcome = await servicer.stored(_report, servicer, who, report, traced)
            convert.outcome_to_proto(outcome, into=result.outcome)
        except Exception as exc:  # noqa: BLE001 - an entry's failure is its answer
            result.code, result.message = _entry_refusal(exc, "reports", i)
        slice_start = await _yield_when_due(slice_start)


def _report(
    servicer: _Servicer, who: Identity | None, report: Report, traced: Any
) -> ReportOutcome:
    """Record ``report`` once its plan is the caller's, in the trace context ``traced``
    (None: the current one)."""
    if servicer.guard is not None:
        assert who is not None
        servicer.guard.report_plan(who, report.plan_id)
    if traced is None:
        return servicer.service.report(report)
    with tracing.attached(traced):
        return servicer.service.report(report)


def _entry_refusal(exc: Exception, field: str, index: int) -> tuple[int, str]:
    """An entry's refusal as a result's ``code`` and ``message`` (its path first). The store
    being unavailable, or a failure not ours, fails the whole call instead (raised): the
    caller repeats it on another replica (every entry is idempotent)."""
    if isinstance(exc, StoreUnavailableError) or not isinstance(exc, PdbrokerError):
        raise exc
    return status_code(exc).value[0], f"{field}[{index}].{exc}"


async def _yield_when_due(slice_start: float) -> float:
    """Let the event loop run other calls once a batch has held it for ``BATCH_SLICE_S``;
    returns when the current slice started."""
    now = time.perf_counter()
    if now - slice_start < BATCH_SLICE_S:
        return slice_start
    await asyncio.sleep(0)
    return time.perf_counter()
