"""Decode side: ask for a transfer's plan, read it through the transport (NIXL), report.

For each hosted rank :meth:`AsyncDecodeClient.fetch` runs ``GetTransferPlan``, checks the
whole plan (:func:`~clients.plan_check.check_plan`: every write inside the rank's registered regions, none twice,
descriptors adding up to the plan's byte counts) before any NIXL call, loads the metadata of
prefill agents it meets for the first time, posts one READ per source prefill rank (all
sources at once), polls them to completion within the timeout and reports DONE or FAILED
with the bytes moved and the read time. Hosted ranks fetch concurrently. :meth:`plan` and
:meth:`report` are those steps alone, for callers that execute plans their own way (load
generators over :class:`~clients.transport.NoMemoryTransport`).

Tracing: the plan carries a ``traceparent`` of the transfer's trace; each source's read is a
span ``decode.nixl_read`` (bytes, descriptors; its status says whether it failed) and the
report a span ``decode.report``, both its children, so decode joins the prefill's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

from opentelemetry.trace import Span

from broker import tracing
from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.layout import EngineLayout
from broker.logs import transfer_fields
from broker.v1 import broker_pb2 as pb
from broker.wire import Role, block_ids_to_proto
from clients.fetches import (
    Fetch,
    FetchAsk,
    FetchError,
    PlanAsk,
    PlanReport,
    RankFetch,
)
from clients.plan_check import Checked, PlanRejected, check_each, check_plan
from clients.protocol import (
    BrokerCallError,
    call,
    extend,
    get_plan,
    get_plans,
    report_transfers,
)
from clients.reports import (
    check_usable,
    refused_report,
    report_attributes,
    report_request,
    report_traced,
)
from clients.session import AsyncEngineClient, BlockingEngineClient, RankSession
from clients.transport import Read, TransferError, Transport

log = logging.getLogger(__name__)


class AsyncDecodeClient(AsyncEngineClient):
    """Hosts decode ranks of one engine (see :class:`~clients.session.AsyncEngineClient` for
    ``memory``). Use as ``async with AsyncDecodeClient(...) as client``. ``session_stream``:
    the batched calls (:meth:`fetch_many`, :meth:`plans`, :meth:`report_many`) are exchanges
    on one ``EngineSession`` stream, falling back to the unary calls
    (:class:`~clients.protocol.FailoverStub`); False: unary calls only."""

    role = Role.DECODE

    def __init__(
        self,
        target: str,
        engine_id: str,
        layout: EngineLayout,
        memory: Mapping[int, Sequence[object]],
        *,
        read_timeout_s: float = 30.0,
        call_timeout_s: float = 10.0,
        security: ChannelSecurity = PLAINTEXT,
        transport: Transport | None = None,
        session_stream: bool = True,
    ) -> None:
        super().__init__(
            target,
            engine_id,
            layout,
            memory,
            call_timeout_s=call_timeout_s,
            security=security,
            transport=transport,
        )
        self.read_timeout_s = read_timeout_s
        self.session_stream = session_stream

    async def fetch(
        self,
        transfer_id: str,
        block_ids: Sequence[Sequence[int]],
        timeout_s: float | None = None,
        *,
        prefill_engine_id: str = "",
    ) -> Fetch:
        """Move ``transfer_id``'s state into ``block_ids`` (this engine's, per group) on every
        hosted rank. Raises :class:`FetchError` unless every rank's data is usable. Given
        ``prefill_engine_id``, only that engine's transfer of this id is read (another's is
        NOT_FOUND)."""
        deadline = time.monotonic() + (timeout_s or self.read_timeout_s)
        ids = block_ids_to_proto(block_ids)
        sessions = list(self.sessions.values())
        results = await asyncio.gather(
            *(self._fetch_rank(s, transfer_id, ids, deadline, prefill_engine_id) for s in sessions),
            return_exceptions=True,
        )
        errors = {s.tp_rank: r for s, r in zip(sessions, results) if isinstance(r, BaseException)}
        if errors:
            raise FetchError(transfer_id, errors)
        return Fetch(transfer_id, tuple(r for r in results if isinstance(r, RankFetch)))

    async def plan(
        self,
        tp_rank: int,
        transfer_id: str,
        block_ids: Sequence[Sequence[int]],
        *,
        prefill_engine_id: str = "",
    ) -> pb.GetTransferPlanResponse:
        """Hosted rank ``tp_rank``'s plan of ``transfer_id`` into ``block_ids`` (per group),
        the first step of :meth:`fetch`; the prefill agents' metadata it carries is loaded
        into the rank's agent. Executing it is the caller's business (then :meth:`report`)."""
        session = self._session(tp_rank)
        plan = await self._plan(
            session, transfer_id, block_ids_to_proto(block_ids), prefill_engine_id
        )
        for source in plan.sources:
            _load_agent(session, source)
        return plan

    async def fetch_many(
        self, asks: Sequence[FetchAsk], timeout_s: float | None = None
    ) -> list[Fetch | FetchError]:
        """:meth:`fetch` of many transfers at once: the plans of every hosted rank of every
        transfer in one ``GetTransferPlans`` call, all reads posted together, every report
        in one ``ReportTransfers`` call (a call per ``max_batch_entries`` entries). Each
        transfer's :class:`Fetch`, or the :class:`FetchError` saying which ranks failed it,
        in order; one transfer's failure leaves the others' alone, and a call that fails as a
        whole (the broker unreachable) fails every rank it carried."""
        deadline = time.monotonic() + (timeout_s or self.read_timeout_s)
        sessions = list(self.sessions.values())
        jobs = [(ask, session) for ask in asks for session in sessions]
        started = time.perf_counter()
        try:
            plans = await self._plans(
                [(s, a.transfer_id, a.block_ids, a.prefill_engine_id) for a, s in jobs]
            )
        except BrokerCallError as unanswered:  # the call failed: every rank of every transfer
            plans = [unanswered] * len(jobs)
        planned = time.perf_counter()
        read_jobs = [
            (i, plan) for i, plan in enumerate(plans) if not isinstance(plan, BrokerCallError)
        ]
        checked = check_each(
            [(plan, jobs[i][1].region_index, jobs[i][1].tp_rank) for i, plan in read_jobs]
        )
        reads = await asyncio.gather(
            *(
                self._timed_read(jobs[i][1], plan, jobs[i][0].transfer_id, deadline, checks)
                for (i, plan), checks in zip(read_jobs, checked)
            )
        )
        results: dict[int, RankFetch | BaseException] = {
            i: plan for i, plan in enumerate(plans) if isinstance(plan, BrokerCallError)
        }
        reports = [
            PlanReport(
                jobs[i][1].tp_rank, plan.plan_id, plan.total_bytes, read_end - planned, error
            )
            for (i, plan), (error, _, read_end) in zip(read_jobs, reads)
        ]
        reported_at = time.monotonic()
        try:
            outcomes = await report_traced(
                self.stub,
                self.engine_id,
                reports,
                [(jobs[i][0].transfer_id, plan.traceparent) for i, plan in read_jobs],
                self.call_timeout_s,
            )
        except BrokerCallError as unanswered:  # unreported: nothing read is usable
            outcomes = [unanswered] * len(reports)
        reported = time.perf_counter()
        for (i, plan), (_, failure, read_end), outcome in zip(read_jobs, reads, outcomes):
            try:
                if isinstance(outcome, BrokerCallError):
                    refused_report(outcome)
                check_usable(plan.plan_id, outcome, failure)
                results[i] = RankFetch.of(
                    jobs[i][1].tp_rank,
                    plan,
                    planned - started,
                    read_end - planned,
                    reported - read_end,
                    reported_at,
                )
            except Exception as exc:  # noqa: BLE001 - the rank's failure, its transfer's
                results[i] = exc
        fetches: list[Fetch | FetchError] = []
        for a, ask in enumerate(asks):
            mine = [(s.tp_rank, results[a * len(sessions) + j]) for j, s in enumerate(sessions)]
            errors = {rank: r for rank, r in mine if isinstance(r, BaseException)}
            fetches.append(
                FetchError(ask.transfer_id, errors)
                if errors
                else Fetch(ask.transfer_id, tuple(r for _, r in mine if isinstance(r, RankFetch)))
            )
        return fetches

    async def plans(
        self, asks: Sequence[PlanAsk]
    ) -> list[pb.GetTransferPlanResponse | BrokerCallError]:
        """Hosted ranks' plans in one ``GetTransferPlans`` call (:meth:`plan` for many), each
        plan or the broker's refusal of it, in order; the prefill agents' metadata they carry
        is loaded into the ranks' agents. Executing them is the caller's business (then
        :meth:`report_many`)."""
        plans = await self._plans(
            [
                (self._session(a.tp_rank), a.transfer_id, a.block_ids, a.prefill_engine_id)
                for a in asks
            ]
        )
        for ask, plan in zip(asks, plans):
            if not isinstance(plan, BrokerCallError):
                for source in plan.sources:
                    _load_agent(self.sessions[ask.tp_rank], source)
        return plans

    async def report_many(
        self, reports: Sequence[PlanReport]
    ) -> list[pb.ReportTransferResponse | BrokerCallError]:
        """Hosted ranks' reports in one ``ReportTransfers`` call (:meth:`report` for many),
        each outcome or the broker's refusal (ABORTED: DONE about a transfer that ended while
        the rank read), in order."""
        for r in reports:
            self._session(r.tp_rank)
        return await report_transfers(
            self.stub,
            self.engine_id,
            [report_request(self.engine_id, r) for r in reports],
            self.call_timeout_s,
        )

    def lost_agent(self, tp_rank: int, plan: pb.GetTransferPlanResponse) -> bool:
        """Whether ``plan`` reads from a prefill agent whose metadata hosted rank ``tp_rank``
        lacks while the plan does not carry it (the broker gave it to an earlier process):
        ask for the plan again with ``want_agent_metadata`` (:meth:`fetch` does)."""
        return _lost_agent(self._session(tp_rank), plan)

    async def execute(
        self,
        tp_rank: int,
        transfer_id: str,
        plan: pb.GetTransferPlanResponse,
        timeout_s: float | None = None,
        checked: Checked | None = None,
    ) -> PlanReport:
        """Read ``plan`` of ``transfer_id`` into hosted rank ``tp_rank``, a plan asked for
        elsewhere (its engine's scheduler, :func:`~clients.protocol.get_plans`): check it
        (``checked``: already checked, with the step's other plans:
        :func:`~clients.plan_check.check_plans`), load the prefill agents' metadata it
        carries, post every source's READ and wait for them (spans as :meth:`fetch`'s).
        Never raises for a failed read: returns the report to send, DONE, or FAILED with
        the error. Check :meth:`lost_agent` first."""
        session = self._session(tp_rank)
        started = time.perf_counter()
        deadline = time.monotonic() + (timeout_s or self.read_timeout_s)
        error, _, read_end = await self._timed_read(session, plan, transfer_id, deadline, checked)
        return PlanReport(tp_rank, plan.plan_id, plan.total_bytes, read_end - started, error)

    async def extend(
        self, transfers: Sequence[tuple[str, str]]
    ) -> list[pb.TransferExtension | BrokerCallError]:
        """Keep the ``(transfer_id, prefill_engine_id)`` transfers this engine waits to fetch
        alive at the broker (:func:`~clients.protocol.extend`)."""
        return await extend(self.stub, self.engine_id, transfers, self.call_timeout_s)

    async def report(
        self,
        tp_rank: int,
        plan_id: str,
        *,
        nbytes: int = 0,
        duration_s: float = 0.0,
        error: str = "",
    ) -> pb.ReportTransferResponse:
        """Report hosted rank ``tp_rank``'s plan ``plan_id``: DONE with ``nbytes`` moved in
        ``duration_s``, or FAILED with ``error`` when one is given. Idempotent at the broker
        (a repeat is answered ``duplicate``); ABORTED for DONE about a transfer that ended
        while the rank read (:class:`~clients.protocol.BrokerCallError`)."""
        self._session(tp_rank)
        report = PlanReport(tp_rank, plan_id, nbytes, duration_s, error)
        return await call(
            self.stub,
            "ReportTransfer",
            report_request(self.engine_id, report),
            self.call_timeout_s,
        )

    def _session(self, tp_rank: int) -> RankSession:
        try:
            return self.sessions[tp_rank]
        except KeyError:
            raise ValueError(f"tp_rank: rank {tp_rank} is not hosted here") from None

    async def _plan(
        self,
        session: RankSession,
        transfer_id: str,
        block_ids: list[pb.BlockIds],
        prefill_engine_id: str,
    ) -> pb.GetTransferPlanResponse:
        """``GetTransferPlan``, asked again with every agent's metadata when this process lost
        agents the broker thinks it knows."""
        request = pb.GetTransferPlanRequest(
            transfer_id=transfer_id,
            engine_id=self.engine_id,
            tp_rank=session.tp_rank,
            block_ids=block_ids,
            prefill_engine_id=prefill_engine_id,
        )
        plan = await get_plan(self.stub, request, self.call_timeout_s)
        if _lost_agent(session, plan):
            request.want_agent_metadata = True
            plan = await get_plan(self.stub, request, self.call_timeout_s)
        return plan

    async def _plans(
        self, asks: Sequence[tuple[RankSession, str, Sequence[Sequence[int]], str]]
    ) -> list[pb.GetTransferPlanResponse | BrokerCallError]:
        """``GetTransferPlans`` of ``(session, transfer_id, block_ids, prefill_engine_id)``
        entries (each list of block ids converted once however many entries share it; the
        call names the engine, the entries do not); entries whose plan names an agent this
        process lost are asked again, in one more call, with every agent's metadata."""
        converted: dict[int, list[pb.BlockIds]] = {}
        for _, _, block_ids, _ in asks:
            if id(block_ids) not in converted:
                converted[id(block_ids)] = block_ids_to_proto(block_ids)
        requests = [
            pb.GetTransferPlanRequest(
                transfer_id=transfer_id,
                tp_rank=session.tp_rank,
                block_ids=converted[id(block_ids)],
                prefill_engine_id=prefill_engine_id,
            )
            for session, transfer_id, block_ids, prefill_engine_id in asks
        ]
        plans = await get_plans(self.stub, self.engine_id, requests, self.call_timeout_s)
        again = [
            i
            for i, plan in enumerate(plans)
            if not isinstance(plan, BrokerCallError) and _lost_agent(asks[i][0], plan)
        ]
        if again:
            for i in again:
                requests[i].want_agent_metadata = True
            retried = [requests[i] for i in again]
            for i, plan in zip(
                again, await get_plans(self.stub, self.engine_id, retried, self.call_timeout_s)
            ):
                plans[i] = plan
        return plans

    async def _timed_read(
        self,
        session: RankSession,
        plan: pb.GetTransferPlanResponse,
        transfer_id: str,
        deadline: float,
        checked: Checked | None = None,
    ) -> tuple[str, TransferError | None, float]:
        """:meth:`_read`, never raising: the error text to report ('' when the read
        succeeded), the failure to raise after the report, and when the read ended."""
        try:
            await self._read(session, plan, transfer_id, deadline, checked)
            return "", None, time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - any failed read is reported FAILED
            error = str(exc) if isinstance(exc, TransferError) else f"{type(exc).__name__}: {exc}"
            failure = exc if isinstance(exc, TransferError) else TransferError(error)
            log.warning(
                "rank %d: %s",
                session.tp_rank,
                error,
                extra=transfer_fields(transfer_id, plan.traceparent),
            )
            return error, failure, time.perf_counter()

    async def _fetch_rank(
        self,
        session: RankSession,
        transfer_id: str,
        block_ids: list[pb.BlockIds],
        deadline: float,
        prefill_engine_id: str,
    ) -> RankFetch:
        started = time.perf_counter()
        plan = await self._plan(session, transfer_id, block_ids, prefill_engine_id)
        planned = time.perf_counter()
        error, failure, read = await self._timed_read(session, plan, transfer_id, deadline)
        reported_at = time.monotonic()
        attributes = report_attributes(transfer_id, session.tp_rank, error)
        with tracing.span(
            "decode.report", plan.traceparent, attributes, rpc="ReportTransfer"
        ) as span:
            try:
                outcome = await self.report(
                    session.tp_rank,
                    plan.plan_id,
                    nbytes=plan.total_bytes,
                    duration_s=read - planned,
                    error=error,
                )
            except BrokerCallError as exc:
                refused_report(exc)
            if span is not None:
                span.set_attribute("pdbroker.intact", outcome.intact)
        check_usable(plan.plan_id, outcome, failure)
        return RankFetch.of(
            session.tp_rank,
            plan,
            planned - started,
            read - planned,
            time.perf_counter() - read,
            reported_at,
        )

    async def _read(
        self,
        session: RankSession,
        plan: pb.GetTransferPlanResponse,
        transfer_id: str,
        deadline: float,
        checked: Checked | None = None,
    ) -> None:
        """Check the plan (unless ``checked``), post every source's READ, then wait for all;
        raises :class:`TransferError`. Each read is a ``decode.nixl_read`` span, from
        posting to the end of its wait."""
        reads = (
            check_plan(plan, session.region_index, session.tp_rank) if checked is None else checked
        )
        if isinstance(reads, PlanRejected):
            raise reads
        transfers: list[Read] = []
        spans: dict[int, Span] = {}  # open read spans by source index
        try:
            for read in reads:
                source = read.source
                _load_agent(session, source)
                span = tracing.start_span(
                    "decode.nixl_read",
                    plan.traceparent,
                    {
                        "pdbroker.transfer_id": transfer_id,
                        "pdbroker.decode_rank": session.tp_rank,
                        "pdbroker.prefill_rank": source.prefill_rank,
                        "pdbroker.bytes": source.total_bytes,
                        "pdbroker.descriptors": source.num_descriptors,
                    },
                )
                if span is not None:
                    spans[len(transfers)] = span
                transfers.append(
                    session.agent.read(
                        source.remote_agent_name,
                        read.local,
                        read.remote,
                        read.local_kind,
                        read.remote_kind,
                        source.notification,
                    )
                )
            await self._wait(transfers, spans, deadline)
        except BaseException as exc:
            for span in spans.values():
                tracing.end_span(span, str(exc) or type(exc).__name__)
            raise
        finally:
            for transfer in transfers:
                transfer.release()

    @staticmethod
    async def _wait(transfers: Sequence[Read], spans: dict[int, Span], deadline: float) -> None:
        """Wait for every posted read (polling one progresses them all), ending each one's
        span as it completes."""
        for i, transfer in enumerate(transfers):
            await transfer.wait_async(max(0.0, deadline - time.monotonic()))
            tracing.end_span(spans.pop(i, None))


def _lost_agent(session: RankSession, plan: pb.GetTransferPlanResponse) -> bool:
    """Whether ``plan`` reads from an agent the broker thinks this rank knows but it does
    not (this process lost it)."""
    return any(
        not s.remote_agent_metadata and not session.agent.knows(s.remote_agent_name)
        for s in plan.sources
    )


def _load_agent(session: RankSession, source: pb.SourcePlan) -> None:
    """Load the metadata of ``source``'s prefill agent when the plan carries it."""
    if source.remote_agent_metadata:
        session.agent.add_remote(source.remote_agent_name, source.remote_agent_metadata)


class DecodeClient(BlockingEngineClient):
    """Blocking :class:`AsyncDecodeClient`; use as ``with DecodeClient(...) as client``."""

    _async: AsyncDecodeClient

    def __init__(
        self,
        target: str,
        engine_id: str,
        layout: EngineLayout,
        memory: Mapping[int, Sequence[object]],
        *,
        read_timeout_s: float = 30.0,
        call_timeout_s: float = 10.0,
        security: ChannelSecurity = PLAINTEXT,
        transport: Transport | None = None,
        session_stream: bool = True,
    ) -> None:
        super().__init__(
            AsyncDecodeClient(
                target,
                engine_id,
                layout,
                memory,
                read_timeout_s=read_timeout_s,
                call_timeout_s=call_timeout_s,
                security=security,
                transport=transport,
                session_stream=session_stream,
            )
        )

    def fetch(
        self,
        transfer_id: str,
        block_ids: Sequence[Sequence[int]],
        timeout_s: float | None = None,
        *,
        prefill_engine_id: str = "",
    ) -> Fetch:
        return self._run(
            self._async.fetch(
                transfer_id, block_ids, timeout_s, prefill_engine_id=prefill_engine_id
            )
        )

    def fetch_many(
        self, asks: Sequence[FetchAsk], timeout_s: float | None = None
    ) -> list[Fetch | FetchError]:
        return self._run(self._async.fetch_many(asks, timeout_s))

    def extend(
        self, transfers: Sequence[tuple[str, str]]
    ) -> list[pb.TransferExtension | BrokerCallError]:
        return self._run(self._async.extend(transfers))
