"""The broker edge's translation: ``pdbroker.v1`` requests → service values, and the
service's answers → responses.

Inbound conversions validate what the domain types cannot (enum values, empty ids, sizes of
repeated fields, overlapping regions) and raise typed errors whose ``field`` is the protobuf
field path, e.g. ``regions[2].memory_kind``. Values every side shares (enums, layouts, block
ids, packed descriptors) are translated by :mod:`broker.wire`.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from broker.api import (
    EngineView,
    Extension,
    Lease,
    PlanQuery,
    PlanResult,
    Publication,
    Report,
    ReportOutcome,
    TransferListing,
    TransferName,
)
from broker.errors import InvalidFieldError, LimitExceededError, PdbrokerError, RequestError
from broker.layout import RankLayout, shared_layout
from broker.limits import LIMITS
from broker.plans import PlanTicket
from broker.records import (
    ANY_DECODE_ENGINE,
    MemoryRegion,
    RankRegistration,
    ReleaseEvent,
    TransferRecord,
    region_rows,
)
from broker.v1 import broker_pb2 as pb
from broker.wire import (
    DESCRIPTOR_BYTES,
    MEMORY_KIND,
    RELEASE_REASON,
    REPORT_STATUS,
    ROLE,
    TRANSFER_STATE,
    TransferState,
    block_ids_from_proto,
    block_ids_to_proto,
    check_count,
    count_block_ids,
    ident,
    optional_ident,
    pack,
    rank_layout_from_proto,
    text,
)

# --------------------------------------------------------------------------- registration


def _check_disjoint(regions: Sequence[MemoryRegion]) -> None:
    """Regions are non-empty, end below 2**63, and no two of one device (and memory kind)
    share a byte: the planner would otherwise hand out reads and writes that alias."""
    for i, r in enumerate(regions):
        if r.length_bytes == 0:
            raise InvalidFieldError(f"regions[{i}].length_bytes", "must be positive")
        if r.base_addr + r.length_bytes >= 1 << 63:
            raise InvalidFieldError(f"regions[{i}].base_addr", "region ends past 2**63")
    by_start = sorted(
        range(len(regions)),
        key=lambda i: (regions[i].memory_kind.value, regions[i].device_id, regions[i].base_addr),
    )
    for before, after in itertools.pairwise(by_start):
        a, b = regions[before], regions[after]
        if (a.memory_kind, a.device_id) == (b.memory_kind, b.device_id) and (
            b.base_addr < a.base_addr + a.length_bytes
        ):
            first, second = sorted((before, after))
            raise InvalidFieldError(
                f"regions[{second}]",
                f"bytes [{regions[second].base_addr:#x}, "
                f"{regions[second].base_addr + regions[second].length_bytes:#x}) overlap "
                f"regions[{first}] on {a.memory_kind.value} device {a.device_id}",
            )


#: Rank layouts converted from registrations, by tp rank and the layout's bytes, while some
#: registration holds them: a rank declaring what another rank of that tp rank declared is
#: not converted and validated again (most of a registration's conversion).
_CONVERTED: weakref.WeakValueDictionary[tuple[int, bytes], RankLayout] = (
    weakref.WeakValueDictionary()
)


def _rank_layout(msg: pb.RegisterRankRequest) -> RankLayout:
    key = (msg.tp_rank, msg.layout.SerializeToString(deterministic=True))
    layout = _CONVERTED.get(key)
    if layout is None:
        layout = shared_layout(rank_layout_from_proto(msg.layout, msg.tp_rank))
        _CONVERTED[key] = layout
    return layout


def registration_from_proto(msg: pb.RegisterRankRequest) -> RankRegistration:
    engine_id = ident(msg.engine_id, "engine_id")
    role = ROLE.from_proto(msg.role, "role")
    if not msg.tp_size:
        raise InvalidFieldError("tp_size", "must be positive")
    if msg.tp_size > LIMITS.max_tp_size:
        raise LimitExceededError("tp_size", f"{msg.tp_size}, at most {LIMITS.max_tp_size}")
    if msg.tp_rank >= msg.tp_size:
        raise InvalidFieldError("tp_rank", f"{msg.tp_rank} outside [0, {msg.tp_size})")
    agent_name = ident(msg.agent_name, "agent_name")
    if len(msg.agent_metadata) > LIMITS.max_agent_metadata_bytes:
        raise LimitExceededError(
            "agent_metadata",
            f"{len(msg.agent_metadata)} bytes, at most {LIMITS.max_agent_metadata_bytes}",
        )
    check_count(msg.regions, LIMITS.max_regions, "regions")
    regions = tuple(
        MemoryRegion(
            r.base_addr,
            r.length_bytes,
            r.device_id,
            MEMORY_KIND.from_proto(r.memory_kind, f"regions[{i}].memory_kind"),
        )
        for i, r in enumerate(msg.regions)
    )
    _check_disjoint(regions)
    if not msg.HasField("layout"):
        raise InvalidFieldError("layout", "missing")
    layout = _rank_layout(msg)
    fingerprint = ident(msg.model_fingerprint, "model_fingerprint")
    return RankRegistration(
        engine_id,
        role,
        msg.tp_size,
        msg.tp_rank,
        agent_name,
        msg.agent_metadata,
        region_rows(regions),
        layout,
        fingerprint,
    )


def lease_to_proto(lease: Lease) -> pb.RegisterRankResponse:
    return pb.RegisterRankResponse(
        lease_id=lease.lease_id,
        ttl_ms=lease.ttl_ms,
        generation=lease.generation,
        engine_complete=lease.engine_complete,
    )


def engines_to_proto(views: Iterable[EngineView]) -> pb.ListEnginesResponse:
    return pb.ListEnginesResponse(
        engines=[
            pb.EngineInfo(
                engine_id=v.engine_id,
                role=ROLE.to_proto(v.role),
                tp_size=v.tp_size,
                model_fingerprint=v.model_fingerprint,
                generation=v.generation,
                complete=v.complete,
                ranks=[
                    pb.RankInfo(
                        tp_rank=r.registration.tp_rank,
                        agent_name=r.registration.agent_name,
                        lease_expires_at_ms=r.lease_expires_at_ms,
                        num_regions=r.registration.layout.num_regions,
                        num_blocks=r.registration.layout.num_blocks,
                        page_bytes=r.registration.layout.page_bytes,
                        registered_at_ms=r.registered_at_ms,
                    )
                    for r in v.ranks
                ],
            )
            for v in views
        ]
    )


# --------------------------------------------------------------------------- transfers


def publication_from_proto(msg: pb.PublishBlocksRequest, traceparent: str = "") -> Publication:
    """``traceparent``: the publisher's W3C trace context (from the call's metadata)."""
    transfer_id = ident(msg.transfer_id, "transfer_id")
    engine_id = ident(msg.engine_id, "engine_id")
    if msg.num_tokens == 0:
        raise InvalidFieldError("num_tokens", "must be positive")
    check_count(
        msg.allowed_decode_engines, LIMITS.max_allowed_decode_engines, "allowed_decode_engines"
    )
    allowed = ANY_DECODE_ENGINE
    if msg.allowed_decode_engines:
        allowed = frozenset(
            ident(e, f"allowed_decode_engines[{i}]")
            for i, e in enumerate(msg.allowed_decode_engines)
        )
    return Publication(
        transfer_id,
        engine_id,
        block_ids_from_proto(msg.block_ids),
        msg.num_tokens,
        msg.ttl_ms,
        allowed,
        traceparent,
    )


def plan_query_from_proto(msg: pb.GetTransferPlanRequest) -> PlanQuery:
    return PlanQuery(
        ident(msg.transfer_id, "transfer_id"),
        ident(msg.engine_id, "engine_id"),
        msg.tp_rank,
        block_ids_from_proto(msg.block_ids),
        msg.want_agent_metadata,
        optional_ident(msg.prefill_engine_id, "prefill_engine_id"),
    )


def plan_queries_alike(entries: Sequence[pb.GetTransferPlanRequest]) -> list[PlanQuery] | None:
    """The queries of entries that name one transfer, engine and block ids alike (converted
    once), or None when their block ids differ or one is refused (each then says why)."""
    first = entries[0]
    if any(e.block_ids != first.block_ids for e in entries[1:]):
        return None
    try:
        q = plan_query_from_proto(first)
    except PdbrokerError:
        return None
    return [q] + [
        PlanQuery(q.transfer_id, q.engine_id, e.tp_rank, q.block_ids, e.want_agent_metadata,
                  q.prefill_engine_id)
        for e in entries[1:]
    ]  # fmt: skip


def plan_to_proto(
    plan: PlanResult,
    descriptors: int | None = None,
    into: pb.GetTransferPlanResponse | None = None,
) -> pb.GetTransferPlanResponse:
    """The plan as one message, written into ``into`` (a field of a batched answer, filled in
    place rather than copied there) or a new one; with ``descriptors``, only each source's
    first ones."""
    msg = pb.GetTransferPlanResponse() if into is None else into
    msg.plan_id = plan.plan_id
    for s in plan.sources:
        source = msg.sources.add()  # fields set one by one: cheaper than as keywords
        source.prefill_rank = s.prefill_rank
        source.remote_agent_name = s.agent_name
        source.remote_agent_metadata = s.agent_metadata
        source.local_descriptors = pack(s.local[:descriptors])
        source.remote_descriptors = pack(s.remote[:descriptors])
        source.num_descriptors = s.num_descriptors
        source.total_bytes = s.total_bytes
        source.notification = s.notification
        source.local_memory_kind = MEMORY_KIND.to_proto(s.local_memory_kind)
        source.remote_memory_kind = MEMORY_KIND.to_proto(s.remote_memory_kind)
    msg.total_bytes = plan.total_bytes
    msg.num_descriptors = plan.num_descriptors
    msg.naive_bytes = plan.naive_bytes
    msg.vllm_descriptors = plan.vllm_descriptors
    msg.expires_at_ms = plan.expires_at_ms
    msg.traceparent = plan.traceparent
    return msg


def ticket_to_proto(ticket: PlanTicket, into: pb.GetTransferPlanResponse) -> None:
    """What :func:`plan_to_proto` writes of ``ticket.result()``, written straight from the
    ticket's descriptors into ``into`` (a field of a batched answer)."""
    into.plan_id = ticket.plan_id
    local_kind = MEMORY_KIND.to_proto(ticket.memory_kind)
    for reads, agent, local, remote in ticket.descriptors():
        source = into.sources.add()
        source.prefill_rank = reads.prefill_rank
        source.remote_agent_name = agent.agent_name
        source.remote_agent_metadata = agent.agent_metadata
        source.local_descriptors = pack(local)
        source.remote_descriptors = pack(remote)
        source.num_descriptors = local.shape[0]
        source.total_bytes = reads.nbytes
        source.notification = ticket.notification(reads.prefill_rank)
        source.local_memory_kind = local_kind
        source.remote_memory_kind = MEMORY_KIND.to_proto(agent.memory_kind)
    plan = ticket.rank_plan
    into.total_bytes = plan.nbytes
    into.num_descriptors = plan.num_descriptors
    into.naive_bytes = plan.naive_bytes
    into.vllm_descriptors = plan.vllm_descriptors
    into.expires_at_ms = ticket.expires_at_ms
    into.traceparent = ticket.traceparent


def plan_chunks(plan: PlanResult, chunk_bytes: int) -> Iterator[bytes]:
    """``plan`` as StreamTransferPlan sends it, each message serialized: a first message with
    every field and the first descriptors of each source, then messages carrying the next
    descriptors of one source, at most ``chunk_bytes`` of descriptors per message (both sides
    count). Later messages are encoded straight from the descriptor arrays (one copy)."""
    per_chunk = max(1, chunk_bytes // (2 * DESCRIPTOR_BYTES))
    yield plan_to_proto(plan, per_chunk).SerializeToString()
    for s in plan.sources:
        for start in range(per_chunk, s.num_descriptors, per_chunk):
            local = np.ascontiguousarray(s.local[start : start + per_chunk], dtype="<i8")
            remote = np.ascontiguousarray(s.remote[start : start + per_chunk], dtype="<i8")
            yield _source_chunk(s.prefill_rank, local.data, remote.data)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _source_chunk(prefill_rank: int, local: memoryview, remote: memoryview) -> bytes:
    """``GetTransferPlanResponse(sources=[SourcePlan(prefill_rank, local_descriptors,
    remote_descriptors)])`` in protobuf's wire format: fields 1 (varint), 4 and 5 (bytes) of
    the source inside field 2 of the response."""
    head = (b"\x08" + _varint(prefill_rank)) if prefill_rank else b""
    head += b"\x22" + _varint(local.nbytes)
    middle = b"\x2a" + _varint(remote.nbytes)
    size = len(head) + local.nbytes + len(middle) + remote.nbytes
    return b"".join((b"\x12", _varint(size), head, local, middle, remote))


def report_from_proto(msg: pb.ReportTransferRequest) -> Report:
    return Report(
        ident(msg.plan_id, "plan_id"),
        ident(msg.engine_id, "engine_id"),
        msg.tp_rank,
        REPORT_STATUS.from_proto(msg.status, "status"),
        msg.bytes_moved,
        msg.duration_us,
        text(msg.error),
    )


def batch_engine(request: Any, entries: Sequence[object], field: str) -> str:
    """The engine a batched call acts for, its entries within ``max_batch_entries``."""
    engine_id = ident(request.engine_id, "engine_id")
    check_count(entries, LIMITS.max_batch_entries, field)
    return engine_id


def check_entry_engine(entry: Any, engine_id: str) -> None:
    """An entry of a batched call names no engine or the call's."""
    if entry.engine_id and entry.engine_id != engine_id:
        raise RequestError(
            "engine_id", f"{entry.engine_id!r} is not the call's engine_id {engine_id!r}"
        )


def batch_block_ids(entries: Sequence[pb.GetTransferPlanRequest]) -> list[int]:
    """Each entry's block ids counted (no id read), together within ``max_block_ids``."""
    counts = [count_block_ids(e.block_ids) for e in entries]
    total = sum(counts)
    if total > LIMITS.max_block_ids:
        raise LimitExceededError(
            "entries", f"{total} block ids in all entries, at most {LIMITS.max_block_ids}"
        )
    return counts


#: Entries handed out in one unit of work at most: a batch of one transfer's entries holds
#: the event loop for all of them (every decode rank of a TP32 engine fits).
GROUP_ENTRIES = 32


def alike_entries(
    entries: Sequence[pb.GetTransferPlanRequest],
    counts: list[int],
    start: int,
    engine_id: str,
    most_block_ids: int,
) -> int:
    """The end of the entries from ``start`` on that name one transfer alike, for the call's
    engine, each of at most ``most_block_ids`` block ids (at least ``start`` itself, at most
    :data:`GROUP_ENTRIES`)."""
    first = entries[start]
    end, last = start, min(len(entries), start + GROUP_ENTRIES)
    while end < last and counts[end] <= most_block_ids:
        entry = entries[end]
        if (entry.transfer_id, entry.prefill_engine_id) != (
            first.transfer_id,
            first.prefill_engine_id,
        ) or entry.engine_id not in ("", engine_id):
            break
        end += 1
    return max(end, start + 1)


def outcome_to_proto(
    outcome: ReportOutcome, into: pb.ReportTransferResponse | None = None
) -> pb.ReportTransferResponse:
    """The outcome as a message, written into ``into`` (a field of a batched answer) or a
    new one."""
    msg = pb.ReportTransferResponse() if into is None else into
    msg.duplicate, msg.intact = outcome.duplicate, outcome.intact
    msg.state = state_to_proto(outcome.state)
    return msg


def extension_from_proto(
    msg: pb.ExtendTransfersRequest,
) -> tuple[str, list[TransferName | PdbrokerError]]:
    """The decode engine and the transfers it names; an entry with a malformed id is its
    error (field paths within the entry), refused on its own."""
    engine_id = ident(msg.engine_id, "engine_id")
    check_count(msg.transfers, LIMITS.max_extended_transfers, "transfers")
    names: list[TransferName | PdbrokerError] = []
    for entry in msg.transfers:
        try:
            names.append(
                (
                    ident(entry.transfer_id, "transfer_id"),
                    optional_ident(entry.prefill_engine_id, "prefill_engine_id"),
                )
            )
        except PdbrokerError as malformed:
            names.append(malformed)
    return engine_id, names


def extensions_to_proto(
    extensions: Sequence[Extension], code_of: Callable[[PdbrokerError], int]
) -> pb.ExtendTransfersResponse:
    """One answer per entry; a refused one carries ``code_of(error)`` and the error's
    message with the entry's path (``transfers[i].``) before its field."""
    return pb.ExtendTransfersResponse(
        transfers=[
            pb.TransferExtension(expires_at_ms=e.expires_at_ms, ttl_ms=e.ttl_ms)
            if e.error is None
            else pb.TransferExtension(code=code_of(e.error), message=f"transfers[{i}].{e.error}")
            for i, e in enumerate(extensions)
        ]
    )


def state_to_proto(state: TransferState) -> pb.TransferState:
    return TRANSFER_STATE.to_proto(state)


def release_to_proto(event: ReleaseEvent) -> pb.ReleaseEvent:
    return pb.ReleaseEvent(
        sequence=event.sequence,
        transfer_id=event.transfer_id,
        block_ids=block_ids_to_proto(event.block_ids),
        reason=RELEASE_REASON.to_proto(event.reason),
        detail=event.detail,
        released_at_ms=event.released_at_ms,
        traceparent=event.traceparent,
    )


def transfer_to_proto(t: TransferRecord, now_ms: int) -> pb.GetTransferResponse:
    """``now_ms``: the broker's clock when answering."""
    consumers = t.consumers
    return pb.GetTransferResponse(
        transfer_id=t.transfer_id,
        state=TRANSFER_STATE.to_proto(t.state),
        prefill_engine_id=t.prefill_engine_id,
        decode_engine_id=t.decode_engine_id,
        num_tokens=t.num_tokens,
        block_ids=block_ids_to_proto(t.block_ids),
        published_at_ms=t.published_at_ms,
        expires_at_ms=t.expires_at_ms,
        finished_at_ms=t.finished_at_ms or 0,
        plans=[
            pb.PlanInfo(
                plan_id=p.plan_id,
                decode_rank=p.decode_rank,
                prefill_ranks=p.prefill_ranks,
                total_bytes=p.rank_plan.nbytes,
                num_descriptors=p.rank_plan.num_descriptors,
                handed_out=p.handed_out,
                status=REPORT_STATUS.to_proto(p.status),
                bytes_moved=p.bytes_moved,
                duration_us=p.duration_us,
                error=p.error,
            )
            for p in t.plans
        ],
        releases=[
            pb.PrefillRankRelease(
                tp_rank=p, reason=RELEASE_REASON.to_proto(reason), consumers=sorted(consumers[p])
            )
            for p, reason in enumerate(t.released)
        ],
        timeline=[
            pb.TimelineEvent(at_ms=at_ms, event=event, detail=detail)
            for at_ms, event, detail in t.timeline
        ],
        traceparent=t.traceparent,
        now_ms=now_ms,
    )


def listing_to_proto(listing: TransferListing) -> pb.ListTransfersResponse:
    return pb.ListTransfersResponse(
        now_ms=listing.now_ms,
        counts=[
            pb.TransferStateCount(state=TRANSFER_STATE.to_proto(state), count=listing.counts[state])
            for state in TransferState
            if listing.counts.get(state)
        ],
        transfers=[
            pb.TransferSummary(
                transfer_id=t.transfer_id,
                state=TRANSFER_STATE.to_proto(t.state),
                prefill_engine_id=t.prefill_engine_id,
                decode_engine_id=t.decode_engine_id,
                num_tokens=t.num_tokens,
                published_at_ms=t.published_at_ms,
                expires_at_ms=t.expires_at_ms,
                finished_at_ms=t.finished_at_ms or 0,
                plans=len(t.plans),
                plans_reported=sum(p.status is not None for p in t.plans),
                traceparent=t.traceparent,
            )
            for t in listing.transfers
        ],
    )
