"""Prefill side: register ranks, publish a request's blocks, free them when the broker says so.

Per hosted rank the client keeps its lease alive, consumes ``WatchReleases`` and hands each
release to ``on_release`` (which frees the blocks), and polls its agent (readers of a NIXL
agent need that to connect), collecting their completion notifications (``on_notification``):
every ``progress_interval_s`` while some published transfer awaits a release, every
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
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from broker import tracing
from broker.client_security import PLAINTEXT, ChannelSecurity
from broker.errors import COMPACTED_THROUGH_KEY
from broker.layout import EngineLayout
from broker.logs import transfer_fields
from broker.v1 import broker_pb2 as pb
from broker.wire import RELEASE_REASON, BlockIds, ReleaseReason, Role
from clients import protocol
from clients.protocol import RETRY_DELAY_S, BrokerCallError
from clients.session import AsyncEngineClient, BlockingEngineClient, RankSession
from clients.transport import Transport

log = logging.getLogger(__name__)
#: How many recent (transfer, rank) releases a client remembers to never free blocks twice.
FREED_MEMORY = 65536
#: How a broker answers a publish of an engine it does not (fully) hold: it restarted, or
#: some ranks have registered again and others not yet.
_ENGINE_UNKNOWN = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})


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


def _compacted_through(exc: grpc.aio.AioRpcError) -> int | None:
    """For a release stream refused because the events it would resume from are no longer
    kept (OUT_OF_RANGE), the newest sequence dropped; else None."""
    if exc.code() is not grpc.StatusCode.OUT_OF_RANGE:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == COMPACTED_THROUGH_KEY:
            return int(value)
    return None


def _release_from_proto(tp_rank: int, event: pb.ReleaseEvent) -> Release:
    reason = RELEASE_REASON.from_proto(event.reason, "reason")
    return Release(
        tp_rank,
        event.transfer_id,
        tuple(tuple(g.ids) for g in event.block_ids),
        reason,
        event.detail,
        event.sequence,
        event.released_at_ms,
        time.monotonic(),
        event.traceparent,
    )


class AsyncPrefillClient(AsyncEngineClient):
    """Hosts prefill ranks of one engine (see :class:`~clients.session.AsyncEngineClient` for
    ``memory``). Use as ``async with AsyncPrefillClient(...) as client``."""

    role = Role.PREFILL

    def __init__(
        self,
        target: str,
        engine_id: str,
        layout: EngineLayout,
        memory: Mapping[int, Sequence[object]],
        *,
        on_release: ReleaseCallback | None = None,
        on_notification: NotificationCallback | None = None,
        progress_interval_s: float = 0.001,
        idle_interval_s: float = 0.05,
        call_timeout_s: float = 10.0,
        security: ChannelSecurity = PLAINTEXT,
        transport: Transport | None = None,
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
        self.on_release = on_release
        self.on_notification = on_notification
        self.progress_interval_s = progress_interval_s
        self.idle_interval_s = idle_interval_s
        self._awaiting: dict[str, set[int]] = {}  # published transfer -> ranks not yet released
        self._blocks: dict[str, BlockIds] = {}  # and its block ids
        self._freed: OrderedDict[tuple[str, int], None] = OrderedDict()  # recent releases
        self._publishing: set[str] = set()  # transfers whose PublishBlocks has not answered
        #: Releases of a (transfer, rank) already freed, not handed to ``on_release``: the
        #: broker's own release after a local free (the registration was lost), or a fault.
        self.repeated_releases = 0
        self._busy = asyncio.Event()

    def _started(self) -> None:
        for session in self.sessions.values():
            session.on_registered_again = self._lost_registration
            self._spawn(self._watch(session))
        self._spawn(self._progress())

    def _lost_registration(self, session: RankSession) -> None:
        """The broker lost this rank's registration (its lease expired, or it restarted
        without a shared store): it failed the rank's transfers and will send no release for
        them, so free their blocks here (reason ABORTED). A decode rank still reading them
        gets ABORTED or NOT_FOUND for its report, never DONE. A transfer whose publish has
        not answered yet may belong to the new registration: :meth:`publish` checks it."""
        lost = [
            t
            for t, ranks in self._awaiting.items()
            if session.tp_rank in ranks and t not in self._publishing
        ]
        for transfer_id in lost:
            self._free_lost(transfer_id, session.tp_rank)

    def _free_lost(self, transfer_id: str, tp_rank: int) -> None:
        release = Release(
            tp_rank,
            transfer_id,
            self._blocks[transfer_id],
            ReleaseReason.ABORTED,
            "the broker lost this rank's registration",
            0,
            0,
            time.monotonic(),
        )
        self._spawn(self._deliver(release))

    def _leases(self) -> tuple[str, ...]:
        return tuple(s.lease_id for s in self.sessions.values())

    async def publish(
        self,
        transfer_id: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        ttl_ms: int = 0,
        allowed_decode_engines: Sequence[str] = (),
    ) -> int:
        """Offer a request's prefill blocks (per group) to decode engines; returns when the
        transfer expires (ms since the epoch on the broker's clock). ``ttl_ms`` 0 takes the
        broker's default. Starts the transfer's trace (span ``prefill.publish``).

        A broker that does not know the engine (it restarted without a shared store) makes
        the hosted ranks renew their leases now, registering again where it lost them; the
        publish is then sent once more. A rank that registered again while the publish was
        under way may have lost it with the old registration: the broker is asked, and a
        transfer it does not know is freed (reason ``aborted``) like the others."""
        self._awaiting[transfer_id] = set(self.ranks)
        self._blocks[transfer_id] = tuple(tuple(g) for g in block_ids)
        self._publishing.add(transfer_id)
        self._busy.set()
        request = protocol.publication(
            transfer_id,
            self.engine_id,
            block_ids,
            num_tokens,
            ttl_ms=ttl_ms,
            allowed_decode_engines=allowed_decode_engines,
        )
        try:
            with tracing.root_span(
                "prefill.publish",
                {
                    "pdbroker.transfer_id": transfer_id,
                    "pdbroker.prefill_engine": self.engine_id,
                    "pdbroker.num_tokens": num_tokens,
                    "pdbroker.blocks": sum(len(g) for g in block_ids),
                },
                rpc="PublishBlocks",
            ):
                leases = self._leases()
                try:
                    expires_at_ms = await protocol.publish(self.stub, request, self.call_timeout_s)
                except BrokerCallError as exc:
                    if exc.field != "engine_id" or exc.code not in _ENGINE_UNKNOWN:
                        raise
                    log.warning(
                        "publish: %s; renewing the leases, then publishing again",
                        exc,
                        extra=transfer_fields(transfer_id),
                    )
                    await self._known_again(exc)
                    leases = self._leases()
                    expires_at_ms = await protocol.publish(self.stub, request, self.call_timeout_s)
                log.debug("published %d tokens", num_tokens, extra=transfer_fields(transfer_id))
        except BaseException:
            self._publishing.discard(transfer_id)
            self._awaiting.pop(transfer_id, None)
            self._blocks.pop(transfer_id, None)
            raise
        self._publishing.discard(transfer_id)
        if self._leases() != leases:
            await self._free_if_forgotten(transfer_id)
        return expires_at_ms

    async def _known_again(self, exc: BrokerCallError) -> None:
        """Wait until the broker holds every hosted rank (renewed or registered again), at
        most ``call_timeout_s``; ``exc`` is raised if it does not by then."""
        try:
            await asyncio.wait_for(
                asyncio.gather(*(s.known_again() for s in self.sessions.values())),
                self.call_timeout_s,
            )
        except asyncio.TimeoutError:
            raise exc from None

    async def _free_if_forgotten(self, transfer_id: str) -> None:
        """A rank registered again while ``transfer_id`` was published: free it (reason
        ``aborted``) unless the broker still knows it."""
        try:
            await self.transfer(transfer_id, self.engine_id)
        except BrokerCallError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND:
                raise
            for tp_rank in sorted(self._awaiting.get(transfer_id, ())):
                self._free_lost(transfer_id, tp_rank)

    async def _watch(self, session: RankSession) -> None:
        """Stream the rank's releases for the client's lifetime, resuming after the last one
        seen when the stream ends (the rank re-registered) or breaks. A cursor is only valid
        for the registration it was read under (a restarted broker numbers anew): the request
        names that lease, and the broker refuses it once the rank registered again, even if
        that happened after the check below. When the other calls move on to another replica
        (this one hangs or is gone), the stream is reopened there."""
        cursor, lease = 0, session.lease_id
        while True:
            if session.lease_id != lease:
                cursor, lease = 0, session.lease_id
            address = self.stub.address
            request = pb.WatchReleasesRequest(
                engine_id=self.engine_id,
                tp_rank=session.tp_rank,
                after_sequence=cursor,
                lease_id=lease,
            )
            stream = self.stub.WatchReleases(request)
            moved = asyncio.ensure_future(self.stub.moved_from(address))
            read: asyncio.Future | None = None
            moved_on = False
            try:
                while True:
                    read = asyncio.ensure_future(stream.read())
                    await asyncio.wait((read, moved), return_when=asyncio.FIRST_COMPLETED)
                    if not read.done():
                        log.warning(
                            "rank %s/%d: reopening the release stream on %s",
                            self.engine_id,
                            session.tp_rank,
                            self.stub.address,
                        )
                        moved_on = True
                        break
                    event = read.result()
                    if event is grpc.aio.EOF:
                        break
                    cursor = event.sequence
                    await self._deliver(_release_from_proto(session.tp_rank, event))
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "rank %s/%d: release stream broke: %s",
                    self.engine_id,
                    session.tp_rank,
                    exc.details(),
                )
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self.stub.fail_over(address)
                through = _compacted_through(exc)
                if through is not None and await self._reconcile(session, through):
                    cursor, moved_on = through, True  # resume at once, after what was dropped
            except Exception:  # an event this client cannot read: skip it, keep watching
                log.exception("rank %s/%d: bad release event", self.engine_id, session.tp_rank)
            finally:
                for pending in (moved, read):
                    if pending is not None:
                        pending.cancel()
                stream.cancel()
            if not moved_on:
                await asyncio.sleep(RETRY_DELAY_S)

    async def _reconcile(self, session: RankSession, through: int) -> bool:
        """The broker no longer keeps this rank's release events through sequence
        ``through``: ask it about each transfer the rank still awaits and free exactly those
        it released the rank of (with its reason), or forgot (it forgets a transfer only
        after every rank was released). Returns whether every answer came."""
        for transfer_id in [
            t
            for t, ranks in self._awaiting.items()
            if session.tp_rank in ranks and t not in self._publishing
        ]:
            try:
                info = await self.transfer(transfer_id, self.engine_id)
            except BrokerCallError as exc:
                if exc.code is not grpc.StatusCode.NOT_FOUND:
                    return False
                reason, detail = ReleaseReason.ABORTED, "the broker forgot this finished transfer"
            else:
                rank = next((r for r in info.releases if r.tp_rank == session.tp_rank), None)
                if rank is None or rank.reason == pb.RELEASE_REASON_UNSPECIFIED:
                    continue  # not released yet: its event is still to come
                reason = RELEASE_REASON.from_proto(rank.reason, "reason")
                detail = "reconciled: the broker no longer kept the release event"
            await self._deliver(
                Release(
                    session.tp_rank,
                    transfer_id,
                    self._blocks[transfer_id],
                    reason,
                    detail,
                    0,
                    0,
                    time.monotonic(),
                )
            )
        return True

    async def _deliver(self, release: Release) -> None:
        """Hand ``release`` to ``on_release`` in a ``prefill.free`` span."""
        waiting = self._awaiting.get(release.transfer_id)
        key = (release.transfer_id, release.tp_rank)
        if key in self._freed:  # freed already (locally, when the registration was lost)
            self.repeated_releases += 1
            return
        self._freed[key] = None
        if len(self._freed) > FREED_MEMORY:
            self._freed.popitem(last=False)
        if waiting is not None:
            waiting.discard(release.tp_rank)
            if not waiting:
                del self._awaiting[release.transfer_id]
                self._blocks.pop(release.transfer_id, None)
        fields = transfer_fields(release.transfer_id, release.traceparent)
        with tracing.span(
            "prefill.free",
            release.traceparent,
            {
                "pdbroker.transfer_id": release.transfer_id,
                "pdbroker.prefill_rank": release.tp_rank,
                "pdbroker.reason": release.reason.value,
            },
        ) as span:
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

    def __init__(
        self,
        target: str,
        engine_id: str,
        layout: EngineLayout,
        memory: Mapping[int, Sequence[object]],
        *,
        on_release: ReleaseCallback | None = None,
        on_notification: NotificationCallback | None = None,
        progress_interval_s: float = 0.001,
        idle_interval_s: float = 0.05,
        call_timeout_s: float = 10.0,
        security: ChannelSecurity = PLAINTEXT,
        transport: Transport | None = None,
    ) -> None:
        super().__init__(
            AsyncPrefillClient(
                target,
                engine_id,
                layout,
                memory,
                on_release=on_release,
                on_notification=on_notification,
                progress_interval_s=progress_interval_s,
                idle_interval_s=idle_interval_s,
                call_timeout_s=call_timeout_s,
                security=security,
                transport=transport,
            )
        )

    def publish(
        self,
        transfer_id: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        ttl_ms: int = 0,
        allowed_decode_engines: Sequence[str] = (),
    ) -> int:
        return self._run(
            self._async.publish(
                transfer_id,
                block_ids,
                num_tokens,
                ttl_ms=ttl_ms,
                allowed_decode_engines=allowed_decode_engines,
            )
        )
