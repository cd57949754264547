"""Protobuf (``pdbroker.v1``) ⇄ domain objects.

Inbound conversions validate what the domain types cannot (enum values, empty ids, sizes of
repeated fields) and raise typed errors whose ``field`` is the protobuf field path, e.g.
``layout.groups[1].segments[0].strides`` or ``regions[2].memory_kind``. Layout rules are the
dataclasses' own (:mod:`broker.layout`); their errors are re-labelled with the proto path.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Iterable, Sequence

from broker.api import (
    EngineView,
    Lease,
    PlanQuery,
    PlanResult,
    Publication,
    Report,
    TransferListing,
)
from broker.descriptors import pack
from broker.errors import InvalidFieldError, LayoutError, LimitExceededError
from broker.layout import GroupKind, GroupLayout, RankLayout, Segment
from broker.limits import LIMITS
from broker.records import (
    BlockIds,
    MemoryKind,
    MemoryRegion,
    RankRegistration,
    ReleaseEvent,
    ReleaseReason,
    ReportStatus,
    Role,
    TransferRecord,
    TransferState,
)
from broker.v1 import broker_pb2 as pb

_ROLES = {pb.ROLE_PREFILL: Role.PREFILL, pb.ROLE_DECODE: Role.DECODE, pb.ROLE_BOTH: Role.BOTH}
_MEMORY_KINDS = {pb.MEMORY_KIND_DRAM: MemoryKind.DRAM, pb.MEMORY_KIND_VRAM: MemoryKind.VRAM}
_GROUP_KINDS = {pb.GROUP_KIND_ATTENTION: GroupKind.ATTENTION, pb.GROUP_KIND_MAMBA: GroupKind.MAMBA}
_REPORT_STATUSES = {
    pb.REPORT_STATUS_DONE: ReportStatus.DONE,
    pb.REPORT_STATUS_FAILED: ReportStatus.FAILED,
}
_ROLE_TO_PB = {v: k for k, v in _ROLES.items()}
_MEMORY_KIND_TO_PB = {v: k for k, v in _MEMORY_KINDS.items()}
_REPORT_STATUS_TO_PB = {v: k for k, v in _REPORT_STATUSES.items()}
_REASON_TO_PB = {
    ReleaseReason.COMPLETED: pb.RELEASE_REASON_COMPLETED,
    ReleaseReason.EXPIRED: pb.RELEASE_REASON_EXPIRED,
    ReleaseReason.ABORTED: pb.RELEASE_REASON_ABORTED,
    ReleaseReason.CONSUMER_FAILED: pb.RELEASE_REASON_CONSUMER_FAILED,
}
_STATE_TO_PB = {
    TransferState.PUBLISHED: pb.TRANSFER_STATE_PUBLISHED,
    TransferState.IN_PROGRESS: pb.TRANSFER_STATE_IN_PROGRESS,
    TransferState.COMPLETED: pb.TRANSFER_STATE_COMPLETED,
    TransferState.FAILED: pb.TRANSFER_STATE_FAILED,
    TransferState.EXPIRED: pb.TRANSFER_STATE_EXPIRED,
    TransferState.ABORTED: pb.TRANSFER_STATE_ABORTED,
}
_RANK_PREFIX = re.compile(r"^ranks\[\d+\]\.?")


# --------------------------------------------------------------------------- field checks


def ident(value: str, field: str) -> str:
    """``value`` if it is a usable id: not empty, at most ``max_id_chars`` characters, each
    printable (``str.isprintable``: no character of the Unicode categories Cc, Cf, Cs, Co, Cn,
    Zl, Zp or Zs but the ASCII space). Ids end up in log lines, Redis keys and NIXL
    notifications, where a control, invisible or bidi character would forge or hide text."""
    if not value:
        raise InvalidFieldError(field, "must not be empty")
    if len(value) > LIMITS.max_id_chars:
        raise InvalidFieldError(field, f"{len(value)} characters, at most {LIMITS.max_id_chars}")
    if not value.isprintable():
        at, bad = next((i, c) for i, c in enumerate(value) if not c.isprintable())
        raise InvalidFieldError(
            field,
            f"character U+{ord(bad):04X} ({unicodedata.category(bad)}) at {at} is not printable",
        )
    return value


def text(value: str) -> str:
    """A free text (report error, abort reason), cut to ``max_text_chars`` characters."""
    return value[: LIMITS.max_text_chars]


def _enum(value: int, table: dict, field: str, enum_name: str):
    try:
        return table[value]
    except KeyError:
        raise InvalidFieldError(
            field, f"{enum_name} {value} is not one of {sorted(table)}"
        ) from None


def _count(items: Sequence, limit: int, field: str) -> None:
    if len(items) > limit:
        raise LimitExceededError(field, f"{len(items)} entries, at most {limit}")


def block_ids_from_proto(groups: Sequence[pb.BlockIds], field: str = "block_ids") -> BlockIds:
    """Per-group block ids; at most ``max_block_ids`` in all."""
    _count(groups, LIMITS.max_groups, field)
    total = sum(len(g.ids) for g in groups)
    if total > LIMITS.max_block_ids:
        raise LimitExceededError(field, f"{total} block ids, at most {LIMITS.max_block_ids}")
    return tuple(tuple(g.ids) for g in groups)


def _block_ids_to_proto(ids: BlockIds) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=g) for g in ids]


# --------------------------------------------------------------------------- registration


def _segment_from_proto(msg: pb.Segment, where: str) -> Segment:
    ident(msg.tensor, f"{where}.tensor")
    if len(msg.shape) > LIMITS.max_dims:
        raise LimitExceededError(
            f"{where}.shape", f"{len(msg.shape)} dimensions, at most {LIMITS.max_dims}"
        )
    if len(msg.shape) != len(msg.strides):
        raise InvalidFieldError(
            f"{where}.strides", f"{len(msg.strides)} strides for {len(msg.shape)} dimensions"
        )
    try:
        return Segment(
            msg.tensor,
            msg.offset,
            tuple(msg.shape),
            tuple(msg.strides),
            msg.dtype,
            msg.shard_axis if msg.HasField("shard_axis") else None,
            msg.shard_start,
            msg.global_extent,
            msg.token_axis if msg.HasField("token_axis") else None,
        )
    except LayoutError as exc:  # fields named "segment 'kv'.strides"
        raise LayoutError(f"{where}.{exc.field.rsplit('.', 1)[-1]}", exc.detail) from None


def _group_from_proto(msg: pb.GroupLayout, where: str) -> GroupLayout:
    kind = _enum(msg.kind, _GROUP_KINDS, f"{where}.kind", "GroupKind")
    _count(msg.layers, LIMITS.max_regions, f"{where}.layers")
    for i, layer in enumerate(msg.layers):
        ident(layer, f"{where}.layers[{i}]")
    _count(msg.segments, LIMITS.max_segments_per_group, f"{where}.segments")
    if kind is GroupKind.ATTENTION and msg.kernel_block_size:
        per_page = msg.block_size // msg.kernel_block_size
        if per_page > LIMITS.max_kernel_blocks_per_page:
            raise LimitExceededError(
                f"{where}.kernel_block_size",
                f"{per_page} kernel blocks per page, at most {LIMITS.max_kernel_blocks_per_page}",
            )
    segments = tuple(
        _segment_from_proto(s, f"{where}.segments[{i}]") for i, s in enumerate(msg.segments)
    )
    return GroupLayout(
        kind,
        tuple(msg.layers),
        segments,
        msg.block_size,
        msg.kernel_block_size,
        msg.kernel_block_bytes,
    )


def rank_layout_from_proto(msg: pb.RankLayout, tp_rank: int, where: str = "layout") -> RankLayout:
    _count(msg.groups, LIMITS.max_groups, f"{where}.groups")
    if msg.num_regions > LIMITS.max_regions:
        raise LimitExceededError(
            f"{where}.num_regions", f"{msg.num_regions}, at most {LIMITS.max_regions}"
        )
    groups = tuple(_group_from_proto(g, f"{where}.groups[{i}]") for i, g in enumerate(msg.groups))
    try:
        return RankLayout(tp_rank, msg.num_regions, msg.num_blocks, msg.page_bytes, groups)
    except (LayoutError, LimitExceededError) as exc:  # fields named "ranks[0].groups[1].layers"
        suffix = _RANK_PREFIX.sub("", exc.field)
        raise type(exc)(f"{where}.{suffix}" if suffix else where, exc.detail) from None


def rank_layout_to_proto(layout: RankLayout) -> pb.RankLayout:
    """The inverse of :func:`rank_layout_from_proto` (clients use it to register)."""
    kinds = {v: k for k, v in _GROUP_KINDS.items()}
    return pb.RankLayout(
        num_regions=layout.num_regions,
        num_blocks=layout.num_blocks,
        page_bytes=layout.page_bytes,
        groups=[
            pb.GroupLayout(
                kind=kinds[g.kind],
                layers=g.layers,
                block_size=g.block_size,
                kernel_block_size=g.kernel_block_size,
                kernel_block_bytes=g.kernel_block_bytes,
                segments=[
                    pb.Segment(
                        tensor=s.tensor,
                        offset=s.offset,
                        shape=s.shape,
                        strides=s.strides,
                        dtype=s.dtype,
                        shard_axis=s.shard_axis,
                        shard_start=s.shard_start,
                        global_extent=s.global_extent,
                        token_axis=s.token_axis,
                    )
                    for s in g.segments
                ],
            )
            for g in layout.groups
        ],
    )


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


def registration_from_proto(msg: pb.RegisterRankRequest) -> RankRegistration:
    engine_id = ident(msg.engine_id, "engine_id")
    role = _enum(msg.role, _ROLES, "role", "Role")
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
    _count(msg.regions, LIMITS.max_regions, "regions")
    regions = tuple(
        MemoryRegion(
            r.base_addr,
            r.length_bytes,
            r.device_id,
            _enum(r.memory_kind, _MEMORY_KINDS, f"regions[{i}].memory_kind", "MemoryKind"),
        )
        for i, r in enumerate(msg.regions)
    )
    _check_disjoint(regions)
    if not msg.HasField("layout"):
        raise InvalidFieldError("layout", "missing")
    layout = rank_layout_from_proto(msg.layout, msg.tp_rank)
    fingerprint = ident(msg.model_fingerprint, "model_fingerprint")
    return RankRegistration(
        engine_id,
        role,
        msg.tp_size,
        msg.tp_rank,
        agent_name,
        msg.agent_metadata,
        regions,
        layout,
        fingerprint,
    )


def registration_to_proto(reg: RankRegistration) -> pb.RegisterRankRequest:
    """The registration as the ``RegisterRankRequest`` it was (or could have been) sent as."""
    return pb.RegisterRankRequest(
        engine_id=reg.engine_id,
        role=_ROLE_TO_PB[reg.role],
        tp_size=reg.tp_size,
        tp_rank=reg.tp_rank,
        agent_name=reg.agent_name,
        agent_metadata=reg.agent_metadata,
        regions=[
            pb.Region(
                base_addr=r.base_addr,
                length_bytes=r.length_bytes,
                device_id=r.device_id,
                memory_kind=_MEMORY_KIND_TO_PB[r.memory_kind],
            )
            for r in reg.regions
        ],
        layout=rank_layout_to_proto(reg.layout),
        model_fingerprint=reg.model_fingerprint,
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
                role=_ROLE_TO_PB[v.role],
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
    _count(msg.allowed_decode_engines, LIMITS.max_allowed_decode_engines, "allowed_decode_engines")
    allowed = frozenset(
        ident(e, f"allowed_decode_engines[{i}]") for i, e in enumerate(msg.allowed_decode_engines)
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
        ident(msg.prefill_engine_id, "prefill_engine_id") if msg.prefill_engine_id else "",
    )


def plan_to_proto(plan: PlanResult) -> pb.GetTransferPlanResponse:
    return pb.GetTransferPlanResponse(
        plan_id=plan.plan_id,
        sources=[
            pb.SourcePlan(
                prefill_rank=s.prefill_rank,
                remote_agent_name=s.agent_name,
                remote_agent_metadata=s.agent_metadata,
                local_descriptors=pack(s.local),
                remote_descriptors=pack(s.remote),
                num_descriptors=s.num_descriptors,
                total_bytes=s.total_bytes,
                notification=s.notification,
                local_memory_kind=_MEMORY_KIND_TO_PB[s.local_memory_kind],
                remote_memory_kind=_MEMORY_KIND_TO_PB[s.remote_memory_kind],
            )
            for s in plan.sources
        ],
        total_bytes=plan.total_bytes,
        num_descriptors=plan.num_descriptors,
        naive_bytes=plan.naive_bytes,
        vllm_descriptors=plan.vllm_descriptors,
        expires_at_ms=plan.expires_at_ms,
        traceparent=plan.traceparent,
    )


def report_from_proto(msg: pb.ReportTransferRequest) -> Report:
    return Report(
        ident(msg.plan_id, "plan_id"),
        ident(msg.engine_id, "engine_id"),
        msg.tp_rank,
        _enum(msg.status, _REPORT_STATUSES, "status", "ReportStatus"),
        msg.bytes_moved,
        msg.duration_us,
        text(msg.error),
    )


def state_to_proto(state: TransferState) -> int:
    return _STATE_TO_PB[state]


def release_to_proto(event: ReleaseEvent) -> pb.ReleaseEvent:
    return pb.ReleaseEvent(
        sequence=event.sequence,
        transfer_id=event.transfer_id,
        block_ids=_block_ids_to_proto(event.block_ids),
        reason=_REASON_TO_PB[event.reason],
        detail=event.detail,
        released_at_ms=event.released_at_ms,
        traceparent=event.traceparent,
    )


def transfer_to_proto(t: TransferRecord, now_ms: int) -> pb.GetTransferResponse:
    """``now_ms``: the broker's clock when answering."""
    return pb.GetTransferResponse(
        transfer_id=t.transfer_id,
        state=_STATE_TO_PB[t.state],
        prefill_engine_id=t.prefill_engine_id,
        decode_engine_id=t.decode_engine_id,
        num_tokens=t.num_tokens,
        block_ids=_block_ids_to_proto(t.block_ids),
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
                status=_REPORT_STATUS_TO_PB[p.status] if p.status else pb.REPORT_STATUS_UNSPECIFIED,
                bytes_moved=p.bytes_moved,
                duration_us=p.duration_us,
                error=p.error,
            )
            for _, p in sorted(t.plans.items())
        ],
        releases=[
            pb.PrefillRankRelease(
                tp_rank=p,
                reason=_REASON_TO_PB[t.released[p]]
                if p in t.released
                else pb.RELEASE_REASON_UNSPECIFIED,
                consumers=sorted(t.consumers.get(p, ())),
            )
            for p in range(t.prefill_tp_size)
        ],
        timeline=[
            pb.TimelineEvent(at_ms=e.at_ms, event=e.event, detail=e.detail) for e in t.timeline
        ],
        traceparent=t.traceparent,
        now_ms=now_ms,
    )


def listing_to_proto(listing: TransferListing) -> pb.ListTransfersResponse:
    return pb.ListTransfersResponse(
        now_ms=listing.now_ms,
        counts=[
            pb.TransferStateCount(state=_STATE_TO_PB[state], count=listing.counts[state])
            for state in TransferState
            if listing.counts.get(state)
        ],
        transfers=[
            pb.TransferSummary(
                transfer_id=t.transfer_id,
                state=_STATE_TO_PB[t.state],
                prefill_engine_id=t.prefill_engine_id,
                decode_engine_id=t.decode_engine_id,
                num_tokens=t.num_tokens,
                published_at_ms=t.published_at_ms,
                expires_at_ms=t.expires_at_ms,
                finished_at_ms=t.finished_at_ms or 0,
                plans=len(t.plans),
                plans_reported=sum(p.status is not None for p in t.plans.values()),
                traceparent=t.traceparent,
            )
            for t in listing.transfers
        ],
    )
