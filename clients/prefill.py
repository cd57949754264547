"""Prefill side: register ranks, publish a request's blocks, free them when the broker says so.

Per hosted rank the client keeps its lease alive, consumes ``WatchReleases`` and hands each
release to ``on_release`` (which frees the blocks), and polls its NIXL agent so readers can
connect and their completion notifications arrive (``on_notification``): every
``progress_interval_s`` while some published transfer awaits a release, every
``idle_interval_s`` otherwise (an idle poll every millisecond would cost ~7% of a core). A
client hosting ranks of an engine whose transfers another process publishes (one process per
rank) does not see them coming: give it ``idle_interval_s=progress_interval_s``.

Tracing: :meth:`AsyncPrefillClient.publish` starts the transfer's trace (span
``prefill.publish``, whose context the broker keeps); each release is handled in a span
``prefill.free``, a child of the broker's release span.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from broker import tracing
from broker.layout import EngineLayout
from broker.logs import transfer_fields
from broker.records import BlockIds, ReleaseReason
from broker.v1 import broker_pb2 as pb
from clients.session import (
    RETRY_DELAY_S,
    AsyncEngineClient,
    BlockingEngineClient,
    RankSession,
    call,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Release:
    """Prefill rank ``tp_rank`` may free ``block_ids`` (per group) of ``transfer_id``.
    ``received_at`` is this process's ``time.monotonic()`` when the event arrived;
    ``traceparent`` the broker's release span (W3C; '' when nobody traces)."""

    tp_rank: int
    transfer_id: str
    block_ids: BlockIds
    reason: ReleaseReason
    detail: str
    sequence: int
    released_at_ms: int
    received_at: float
    traceparent: str = ""


#: Called once per release of a hosted rank; may be a coroutine function.
ReleaseCallback = Callable[[Release], Awaitable[None] | None]
#: Called with ``(tp_rank, sender agent, message)`` for each NIXL notification a rank receives.
NotificationCallback = Callable[[int, str, bytes], None]


def _release_from_proto(tp_rank: int, event: pb.ReleaseEvent) -> Release:
    reason = ReleaseReason[pb.ReleaseReason.Name(event.reason).removeprefix("RELEASE_REASON_")]
    return Release(tp_rank, event.transfer_id, tuple(tuple(g.ids) for g in event.block_ids),
                   reason, event.detail, event.sequence, event.released_at_ms, time.monotonic(),
                   event.traceparent)


class AsyncPrefillClient(AsyncEngineClient):
    """Hosts prefill ranks of one engine (see :class:`~clients.session.AsyncEngineClient` for
    ``memory``). Use as ``async with AsyncPrefillClient(...) as client``."""

    role = pb.ROLE_PREFILL

    def __init__(self, target: str, engine_id: str, layout: EngineLayout,
                 memory: Mapping[int, Sequence[object]], *, on_release: ReleaseCallback | None = None,
                 on_notification: NotificationCallback | None = None,
                 progress_interval_s: float = 0.001, idle_interval_s: float = 0.05,
                 call_timeout_s: float = 10.0) -> None:
        super().__init__(target, engine_id, layout, memory, call_timeout_s=call_timeout_s)
        self.on_release = on_release
        self.on_notification = on_notification
        self.progress_interval_s = progress_interval_s
        self.idle_interval_s = idle_interval_s
        self._awaiting: dict[str, set[int]] = {}  # published transfer -> ranks not yet released
        self._busy = asyncio.Event()

    def _started(self) -> None:
        for session in self.sessions.values():
            self._spawn(self._watch(session))
        self._spawn(self._progress())

    async def publish(self, transfer_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int,
                      *, ttl_ms: int = 0, allowed_decode_engines: Sequence[str] = ()) -> int:
        """Offer a request's prefill blocks (per group) to decode engines; returns when the
        transfer expires (ms since the epoch on the broker's clock). ``ttl_ms`` 0 takes the
        broker's default. Starts the transfer's trace (span ``prefill.publish``)."""
        self._awaiting[transfer_id] = set(self.ranks)
        self._busy.set()
        try:
            with tracing.root_span("prefill.publish", {
                    "pdbroker.transfer_id": transfer_id, "pdbroker.prefill_engine": self.engine_id,
                    "pdbroker.num_tokens": num_tokens,
                    "pdbroker.blocks": sum(len(g) for g in block_ids)}):
                response = await call(self.stub, "PublishBlocks", pb.PublishBlocksRequest(
                    transfer_id=transfer_id, engine_id=self.engine_id,
                    block_ids=[pb.BlockIds(ids=list(g)) for g in block_ids],
                    num_tokens=num_tokens, ttl_ms=ttl_ms,
                    allowed_decode_engines=list(allowed_decode_engines)), self.call_timeout_s)
                log.debug("published %d tokens", num_tokens, extra=transfer_fields(transfer_id))
        except BaseException:
            self._awaiting.pop(transfer_id, None)
            raise
        return response.expires_at_ms

    async def _watch(self, session: RankSession) -> None:
        """Stream the rank's releases for the client's lifetime, resuming after the last one
        seen when the stream ends (the rank re-registered) or breaks."""
        cursor = 0
        while True:
            request = pb.WatchReleasesRequest(engine_id=self.engine_id, tp_rank=session.tp_rank,
                                              after_sequence=cursor)
            try:
                async for event in self.stub.WatchReleases(request):
                    cursor = event.sequence
                    await self._deliver(_release_from_proto(session.tp_rank, event))
            except grpc.aio.AioRpcError as exc:
                log.warning("rank %s/%d: release stream broke: %s", self.engine_id,
                            session.tp_rank, exc.details())
            except Exception:  # an event this client cannot read: skip it, keep watching
                log.exception("rank %s/%d: bad release event", self.engine_id, session.tp_rank)
            await asyncio.sleep(RETRY_DELAY_S)

    async def _deliver(self, release: Release) -> None:
        """Hand ``release`` to ``on_release`` in a ``prefill.free`` span."""
        waiting = self._awaiting.get(release.transfer_id)
        if waiting is not None:
            waiting.discard(release.tp_rank)
            if not waiting:
                del self._awaiting[release.transfer_id]
        fields = transfer_fields(release.transfer_id, release.traceparent)
        with tracing.span("prefill.free", release.traceparent, {
                "pdbroker.transfer_id": release.transfer_id, "pdbroker.prefill_rank": release.tp_rank,
                "pdbroker.reason": release.reason.value}) as span:
            log.debug("rank %d released: %s", release.tp_rank, release.reason.value, extra=fields)
            if self.on_release is None:
                return
            try:
                result = self.on_release(release)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                log.exception("rank %d: on_release failed", release.tp_rank, extra=fields)
                tracing.set_error(span, f"on_release failed: {exc!r}")

    async def _progress(self) -> None:
        """Poll every agent: readers' wire-up needs it, and it collects notifications."""
        while True:
            for session in self.sessions.values():
                for sender, messages in session.agent.notifications().items():
                    if self.on_notification is not None:
                        for message in messages:
                            self.on_notification(session.tp_rank, sender, message)
            if self._awaiting:
                await asyncio.sleep(self.progress_interval_s)
                continue
            self._busy.clear()
            try:
                await asyncio.wait_for(self._busy.wait(), self.idle_interval_s)
            except asyncio.TimeoutError:
                pass


class PrefillClient(BlockingEngineClient):
    """Blocking :class:`AsyncPrefillClient`; use as ``with PrefillClient(...) as client``.
    Callbacks run on the client's loop thread and must not call the client back."""

    _async: AsyncPrefillClient

    def __init__(self, target: str, engine_id: str, layout: EngineLayout,
                 memory: Mapping[int, Sequence[object]], *, on_release: ReleaseCallback | None = None,
                 on_notification: NotificationCallback | None = None,
                 progress_interval_s: float = 0.001, idle_interval_s: float = 0.05,
                 call_timeout_s: float = 10.0) -> None:
        super().__init__(AsyncPrefillClient(
            target, engine_id, layout, memory, on_release=on_release,
            on_notification=on_notification, progress_interval_s=progress_interval_s,
            idle_interval_s=idle_interval_s, call_timeout_s=call_timeout_s))

    def publish(self, transfer_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int,
                *, ttl_ms: int = 0, allowed_decode_engines: Sequence[str] = ()) -> int:
        return self._run(self._async.publish(transfer_id, block_ids, num_tokens, ttl_ms=ttl_ms,
                                             allowed_decode_engines=allowed_decode_engines))
