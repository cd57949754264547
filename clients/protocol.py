"""The client side of ``pdbroker.v1``: the broker channel, calls that carry the trace
context, :class:`FailoverStub` over replicas, and one builder or call per request the clients
share, with its reconciliation rule: a registration (:func:`registration`), a publish whose
reply was lost with its replica (:func:`publish`), extensions of waiting transfers
(:func:`extend`), an abort, a transfer's state. The engine
clients (:mod:`clients.session`, :mod:`clients.prefill`, :mod:`clients.decode`), the vLLM
connector's scheduler and the harness all build and send these requests here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from broker import tracing
from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.layout import RankLayout
from broker.limits import LIMITS
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import (
    MEMORY_KIND,
    ROLE,
    TRANSFER_STATE,
    MemoryKind,
    Role,
    TransferState,
    block_ids_to_proto,
    join_plan_chunks,
    rank_layout_to_proto,
)
from clients.engine_session import SESSION_CALLS, EngineSession
from clients.transport import Region

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Pause before retrying a broken release stream or a failed lease renewal (seconds); it
#: doubles while the broker stays unreachable, up to MAX_RETRY_DELAY_S.
RETRY_DELAY_S = 0.2
MAX_RETRY_DELAY_S = 5.0
#: Calls the broker answers alike when they are repeated while the first may still be running
#: (a plan or report again, a lease renewed twice, a publish that finds its own transfer):
#: :class:`FailoverStub` repeats them on the next replica when one does not answer in time.
REPEATABLE = frozenset(
    {
        "KeepAlive",
        "GetTransferPlan",
        "GetTransferPlans",
        "StreamTransferPlan",
        "ReportTransfer",
        "ReportTransfers",
        "AbortTransfer",
        "ExtendTransfers",
        "PublishBlocks",
        "GetTransfer",
        "ListEngines",
        "ListTransfers",
        "Deregister",
    }
)


class BrokerCallError(RuntimeError):
    """A broker RPC failed: ``code`` is the gRPC status, ``field`` the offending field path
    the broker names at the start of its message (empty when it names none)."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details
        head = details.split(":", 1)[0]
        self.field = head if ":" in details and " " not in head else ""


async def call(
    stub: FailoverStub | pb_grpc.BrokerStub, method: str, request: Any, timeout_s: float
) -> Any:
    """One unary RPC carrying the current trace context, its status recorded on the client
    span around it (:func:`broker.tracing.client_call_ended`); a failure raises
    :class:`BrokerCallError`."""
    try:
        response = await getattr(stub, method)(
            request, timeout=timeout_s, metadata=tracing.grpc_metadata() or None
        )
    except grpc.aio.AioRpcError as exc:
        tracing.client_call_ended(method, exc.code().value[0])
        raise BrokerCallError(method, exc.code(), exc.details() or "") from None
    tracing.client_call_ended(method, grpc.StatusCode.OK.value[0])
    return response


def open_channel(target: str, security: ChannelSecurity = PLAINTEXT) -> grpc.aio.Channel:
    """A channel to the broker at ``HOST:PORT`` (plans of long requests are large); plaintext
    unless ``security`` names a CA."""
    return security.aio_channel(
        target,
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
    )


def broker_addresses(target: str | Sequence[str]) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]`` (or a sequence of them) as a tuple of addresses."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    addresses = tuple(a.strip() for a in parts if a.strip())
    if not addresses:
        raise ValueError("target: name at least one broker address")
    return addresses


#: Statuses on which :class:`FailoverStub` moves a call on to the next replica.
_MOVING_ON = frozenset({grpc.StatusCode.UNAVAILABLE})
_MOVING_ON_REPEATABLE = _MOVING_ON | {grpc.StatusCode.DEADLINE_EXCEEDED}


class FailoverStub:
    """A ``BrokerStub`` over broker replicas that share one store (``pdbroker serve --store
    redis://``). Unary calls go to the current replica; one that is UNAVAILABLE (down,
    unreachable, draining, its store unreachable) makes the call move on to the next, round
    the list with a doubling pause, until the call's timeout runs out. A :data:`REPEATABLE`
    call to one of several replicas gets its share of the time left (half of it with two
    replicas, then all that remains), so a replica that hangs (stopped, overloaded) answers
    DEADLINE_EXCEEDED in time for the call to move on as well. Streams (``WatchReleases``)
    are opened on the current replica; their consumer calls :meth:`fail_over` with that
    replica when one breaks, and reopens them when :meth:`moved_from` it.

    ``session_stream``: ``GetTransferPlans`` and ``ReportTransfers`` go over one
    ``EngineSession`` stream to the current replica (:class:`~clients.engine_session.EngineSession`),
    each exchange within the call's share of the timeout; one the stream cannot carry is
    made as the unary call, and both move on as the unary call would.

    Every broker call is safe to repeat (plans, reports, keep-alives, aborts are
    idempotent); a ``PublishBlocks`` whose reply was lost with its replica comes back
    ALREADY_EXISTS, which :func:`publish` checks and accepts.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        security: ChannelSecurity = PLAINTEXT,
        *,
        session_stream: bool = True,
    ) -> None:
        self.addresses = broker_addresses(target)
        self._session = EngineSession() if session_stream else None
        self._security = security
        self._stubs: dict[int, tuple[grpc.aio.Channel, pb_grpc.BrokerStub]] = {}
        self._current = 0
        self._moved = asyncio.Event()  # set (and replaced) whenever calls move on
        #: How many times calls moved on to another replica.
        self.failovers = 0

    @property
    def address(self) -> str:
        """The replica calls go to now."""
        return self.addresses[self._current]

    def _stub(self) -> pb_grpc.BrokerStub:
        if self._current not in self._stubs:
            channel = open_channel(self.address, self._security)
            self._stubs[self._current] = (channel, pb_grpc.BrokerStub(channel))
        return self._stubs[self._current][1]

    def fail_over(self, failed: str) -> None:
        """Replica ``failed`` did not answer: move on to the next one, unless another call
        already moved away from it (a no-op with one address)."""
        if failed != self.address:
            return
        self.failovers += 1
        if len(self.addresses) > 1:
            self._current = (self._current + 1) % len(self.addresses)
            log.warning("broker calls go to %s now", self.address)
            self._moved.set()
            self._moved = asyncio.Event()

    async def moved_from(self, address: str) -> None:
        """Return once calls no longer go to ``address`` (never, with one address)."""
        while self.address == address:
            await self._moved.wait()

    def WatchReleases(self, request: pb.WatchReleasesRequest, **kwargs: Any) -> Any:
        return self._stub().WatchReleases(request, **kwargs)

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        if not method[:1].isupper():
            raise AttributeError(method)

        session = self._session if method in SESSION_CALLS else None

        async def unary(request: Any, *, timeout: float | None = None, **kwargs: Any) -> Any:
            async def attempt(stub: pb_grpc.BrokerStub, left: float | None) -> Any:
                if session is not None:
                    metadata = kwargs.get("metadata")
                    answer = await session.exchange(stub, method, request, left, metadata)
                    if answer is not None:
                        return answer
                return await getattr(stub, method)(request, timeout=left, **kwargs)

            return await self.repeat(attempt, timeout, method in REPEATABLE)

        setattr(self, method, unary)  # found without __getattr__ from now on
        return unary

    async def repeat(
        self,
        attempt: Callable[[pb_grpc.BrokerStub, float | None], Awaitable[T]],
        timeout: float | None,
        repeatable: bool = True,
    ) -> T:
        """``attempt(stub, seconds left)`` on the current replica, moving on as the class
        docstring says (``repeatable``: also on DEADLINE_EXCEEDED, with a share of the
        time left for each replica)."""
        moving_on = _MOVING_ON_REPEATABLE if repeatable else _MOVING_ON
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = RETRY_DELAY_S
        tried = 0
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and repeatable:  # a share for each replica left this round
                left /= len(self.addresses) - tried % len(self.addresses)
            address = self.address
            try:
                return await attempt(self._stub(), left)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in moving_on:
                    raise
                self.fail_over(address)
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                tried += 1
                if tried % len(self.addresses) == 0:  # every replica refused: back off
                    if deadline is not None and time.monotonic() + delay >= deadline:
                        raise
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, MAX_RETRY_DELAY_S)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.aclose()
        stubs, self._stubs = self._stubs, {}
        await asyncio.gather(*(channel.close() for channel, _ in stubs.values()))


def registration(
    layout: RankLayout,
    regions: Sequence[Region],
    *,
    engine_id: str,
    role: Role,
    tp_size: int,
    agent_name: str,
    agent_metadata: bytes,
    model_fingerprint: str,
) -> pb.RegisterRankRequest:
    """``RegisterRank`` of rank ``layout.tp_rank`` of ``engine_id``: region *i* holds layer
    *i* of every group, as ``layout`` declares."""
    return pb.RegisterRankRequest(
        engine_id=engine_id,
        role=ROLE.to_proto(role),
        tp_size=tp_size,
        tp_rank=layout.tp_rank,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        regions=[
            pb.Region(
                base_addr=r.base_addr,
                length_bytes=r.length_bytes,
                device_id=r.device_id,
                memory_kind=MEMORY_KIND.to_proto(MemoryKind[r.kind]),
            )
            for r in regions
        ],
        layout=rank_layout_to_proto(layout),
        model_fingerprint=model_fingerprint,
    )


def publication(
    transfer_id: str,
    engine_id: str,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    *,
    ttl_ms: int = 0,
    allowed_decode_engines: Sequence[str] = (),
) -> pb.PublishBlocksRequest:
    """``PublishBlocks`` of ``block_ids`` (per group) holding ``num_tokens`` tokens;
    ``ttl_ms`` 0 takes the broker's default."""
    return pb.PublishBlocksRequest(
        transfer_id=transfer_id,
        engine_id=engine_id,
        block_ids=block_ids_to_proto(block_ids),
        num_tokens=num_tokens,
        ttl_ms=ttl_ms,
        allowed_decode_engines=list(allowed_decode_engines),
    )


async def publish(stub: FailoverStub, request: pb.PublishBlocksRequest, timeout_s: float) -> int:
    """Send ``request``; returns when the transfer expires (ms since the epoch, the broker's
    clock). A publish that moved on to another replica and found its transfer there
    (ALREADY_EXISTS: the first replica committed it, then its reply was lost; ids are scoped
    by their publisher, so it is this engine's) is ours when the token count matches: it
    succeeds with the stored expiry."""
    failovers = stub.failovers
    try:
        response = await call(stub, "PublishBlocks", request, timeout_s)
    except BrokerCallError as exc:
        if exc.code is not grpc.StatusCode.ALREADY_EXISTS or stub.failovers == failovers:
            raise
        try:
            info = await get_transfer(stub, request.transfer_id, timeout_s, request.engine_id)
        except BrokerCallError:
            raise exc from None
        if info.num_tokens != request.num_tokens:
            raise exc from None
        return info.expires_at_ms
    return response.expires_at_ms


#: gRPC status codes by number, as ``ExtendTransfers`` answers each entry.
_STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


async def extend(
    stub: FailoverStub,
    engine_id: str,
    transfers: Sequence[tuple[str, str]],
    timeout_s: float,
) -> list[pb.TransferExtension | BrokerCallError]:
    """Keep the ``(transfer_id, prefill_engine_id)`` transfers decode engine ``engine_id``
    waits for alive (``ExtendTransfers``, at most ``max_extended_transfers`` a call); per
    entry, its expiry and TTL now (extend again before that TTL elapses), or why the broker
    refused that entry (NOT_FOUND, FAILED_PRECONDITION once it ended, PERMISSION_DENIED:
    not this engine's)."""
    request = pb.ExtendTransfersRequest(
        engine_id=engine_id,
        transfers=[pb.TransferName(transfer_id=t, prefill_engine_id=p) for t, p in transfers],
    )
    response = await call(stub, "ExtendTransfers", request, timeout_s)
    return _entry_answers("ExtendTransfers", response.transfers)


def _entry_answers(method: str, results: Sequence[Any], field: str = "") -> list[Any]:
    """A batched call's results: each entry's answer (``field`` of its result, or the result
    itself), or the :class:`BrokerCallError` the broker answered that entry with."""
    return [
        BrokerCallError(method, _STATUS_BY_CODE.get(r.code, grpc.StatusCode.UNKNOWN), r.message)
        if r.code
        else getattr(r, field)
        if field
        else r
        for r in results
    ]


def _batches(items: Sequence[T]) -> list[Sequence[T]]:
    """``items`` in runs of at most ``max_batch_entries``, one call each."""
    size = LIMITS.max_batch_entries
    return [items[i : i + size] for i in range(0, len(items), size)]


async def get_plans(
    stub: FailoverStub,
    engine_id: str,
    requests: Sequence[pb.GetTransferPlanRequest],
    timeout_s: float,
) -> list[pb.GetTransferPlanResponse | BrokerCallError]:
    """Decode engine ``engine_id``'s plans of ``requests`` through ``GetTransferPlans`` (one
    call per ``max_batch_entries``), each entry's plan or its refusal, in order. An entry
    whose plan is too large for the batch's answer is asked for alone (:func:`get_plan`,
    streamed)."""
    answers: list[pb.GetTransferPlanResponse | BrokerCallError] = []
    for batch in _batches(requests):
        request = pb.GetTransferPlansRequest(engine_id=engine_id, entries=batch)
        response = await call(stub, "GetTransferPlans", request, timeout_s)
        for i, answer in enumerate(_entry_answers("GetTransferPlans", response.results, "plan")):
            if (
                isinstance(answer, BrokerCallError)
                and answer.code is grpc.StatusCode.RESOURCE_EXHAUSTED
                and answer.field == f"entries[{i}].plan"
            ):
                alone = pb.GetTransferPlanRequest()
                alone.CopyFrom(batch[i])
                alone.engine_id = engine_id
                try:
                    answer = await get_plan(stub, alone, timeout_s)
                except BrokerCallError as exc:
                    answer = exc
            answers.append(answer)
    return answers


async def report_transfers(
    stub: FailoverStub,
    engine_id: str,
    reports: Sequence[pb.ReportTransferRequest],
    timeout_s: float,
) -> list[pb.ReportTransferResponse | BrokerCallError]:
    """Decode engine ``engine_id``'s ``reports`` through ``ReportTransfers`` (one call per
    ``max_batch_entries``), each one's outcome or its refusal (ABORTED: DONE about a
    transfer that ended), in order."""
    answers: list[pb.ReportTransferResponse | BrokerCallError] = []
    for batch in _batches(reports):
        request = pb.ReportTransfersRequest(engine_id=engine_id, reports=batch)
        response = await call(stub, "ReportTransfers", request, timeout_s)
        answers += _entry_answers("ReportTransfers", response.results, "outcome")
    return answers


async def abort(
    stub: FailoverStub,
    transfer_id: str,
    reason: str,
    timeout_s: float,
    prefill_engine_id: str = "",
    held_by_decode: bool = False,
) -> TransferState:
    """Tell the broker nobody will read ``transfer_id`` of ``prefill_engine_id`` (its
    publisher; '' when only one engine published that id); the prefill ranks are released
    ABORTED, or COMPLETED when ``held_by_decode`` (decode's prefix cache holds every published
    token) ends a transfer nobody claimed. Returns the transfer's state after the call (an
    ended transfer keeps its own)."""
    request = pb.AbortTransferRequest(
        transfer_id=transfer_id,
        reason=reason,
        prefill_engine_id=prefill_engine_id,
        held_by_decode=held_by_decode,
    )
    response = await call(stub, "AbortTransfer", request, timeout_s)
    return TRANSFER_STATE.from_proto(response.state, "state")


async def get_transfer(
    stub: FailoverStub, transfer_id: str, timeout_s: float, prefill_engine_id: str = ""
) -> pb.GetTransferResponse:
    """What the broker holds about ``transfer_id`` of ``prefill_engine_id`` (see
    :func:`abort`); NOT_FOUND once it forgot it."""
    request = pb.GetTransferRequest(transfer_id=transfer_id, prefill_engine_id=prefill_engine_id)
    return await call(stub, "GetTransfer", request, timeout_s)


async def get_plan(
    stub: FailoverStub, request: pb.GetTransferPlanRequest, timeout_s: float
) -> pb.GetTransferPlanResponse:
    """The decode rank's plan: ``GetTransferPlan``, or, for a plan too large for one answer
    (RESOURCE_EXHAUSTED naming ``plan``: nothing was handed out), ``StreamTransferPlan``
    with its messages joined (:func:`~broker.wire.join_plan_chunks`)."""
    try:
        return await call(stub, "GetTransferPlan", request, timeout_s)
    except BrokerCallError as refused:
        if refused.code is not grpc.StatusCode.RESOURCE_EXHAUSTED or refused.field != "plan":
            raise

    async def streamed(
        broker: pb_grpc.BrokerStub, left: float | None
    ) -> pb.GetTransferPlanResponse:
        stream = broker.StreamTransferPlan(
            request, timeout=left, metadata=tracing.grpc_metadata() or None
        )
        return join_plan_chunks([chunk async for chunk in stream])

    try:
        return await stub.repeat(streamed, timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise BrokerCallError("StreamTransferPlan", exc.code(), exc.details() or "") from None
    except ValueError as exc:  # the stream ended before its first message
        raise BrokerCallError("StreamTransferPlan", grpc.StatusCode.DATA_LOSS, str(exc)) from None
