"""The wire codec every side shares: ``pdbroker.v1`` protobuf ⇄ value types.

Engines (:mod:`clients`), the broker's gRPC edge (:mod:`broker.convert`) and its stores meet
here and nowhere else: the value enums, one mapping table each to and from protobuf, the
identifier and text rules, page layouts, block ids and packed descriptor arrays. Inbound
conversions raise typed errors whose ``field`` is the protobuf field path (for example
``layout.groups[1].segments[0].strides``); layout rules themselves are the dataclasses' own
(:mod:`broker.layout`).
"""

from __future__ import annotations

import re
import unicodedata
from array import array
from collections.abc import Collection, Iterable, Sequence
from enum import Enum
from typing import Generic, TypeVar

import numpy as np

from broker.errors import InvalidFieldError, LayoutError, LimitExceededError
from broker.layout import GroupKind, GroupLayout, RankLayout, Segment
from broker.limits import LIMITS
from broker.v1 import broker_pb2 as pb

#: Block ids per KV-cache group, in request order: each group a tuple, or an ``array('q')``
#: when longer than :data:`LONG_GROUP` (see :func:`group_ids`).
BlockIds = tuple[Sequence[int], ...]
E = TypeVar("E", bound=Enum)
#: A generated protobuf enum: a class in the type stubs, plain ints at run time.
P = TypeVar("P", bound=int)


class Role(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def publishes(self) -> bool:
        return self is not Role.DECODE

    @property
    def reads(self) -> bool:
        return self is not Role.PREFILL


class MemoryKind(Enum):
    """Where a region lives; the member names are NIXL's segment kinds."""

    DRAM = "dram"
    VRAM = "vram"


class ReportStatus(Enum):
    DONE = "done"
    FAILED = "failed"


class ReleaseReason(Enum):
    COMPLETED = "completed"
    EXPIRED = "expired"
    ABORTED = "aborted"
    CONSUMER_FAILED = "consumer_failed"


class TransferState(Enum):
    """``PUBLISHED -> IN_PROGRESS -> COMPLETED``; any non-terminal state may end in
    ``FAILED``, ``EXPIRED`` or ``ABORTED``."""

    PUBLISHED = "published"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        # Compared by identity: a set lookup would hash the member in Python (Enum.__hash__).
        return self is not TransferState.PUBLISHED and self is not TransferState.IN_PROGRESS


class EnumCodec(Generic[E, P]):
    """One value enum ⇄ its protobuf enum, whose member ``PREFIX_NAME`` is ``E.NAME``; the
    protobuf ``PREFIX_UNSPECIFIED`` value (0) stands for no member."""

    def __init__(self, enum: type[E], proto: type[P], prefix: str) -> None:
        self.enum_name = enum.__name__
        # Each protobuf value is an attribute of its enum, typed P by the generated stubs.
        self._unspecified: P = getattr(proto, prefix + "UNSPECIFIED")
        self._to: dict[E, P] = {member: getattr(proto, prefix + member.name) for member in enum}
        self._from: dict[int, E] = {number: member for member, number in self._to.items()}

    def to_proto(self, member: E | None) -> P:
        """The protobuf value of ``member`` (UNSPECIFIED for None)."""
        return self._unspecified if member is None else self._to[member]

    def from_proto(self, number: int, field: str) -> E:
        """The member of protobuf value ``number``; INVALID_ARGUMENT naming ``field`` for
        UNSPECIFIED or an unknown value."""
        try:
            return self._from[number]
        except KeyError:
            raise InvalidFieldError(
                field, f"{self.enum_name} {number} is not one of {sorted(self._from)}"
            ) from None


ROLE = EnumCodec(Role, pb.Role, "ROLE_")
MEMORY_KIND = EnumCodec(MemoryKind, pb.MemoryKind, "MEMORY_KIND_")
GROUP_KIND = EnumCodec(GroupKind, pb.GroupKind, "GROUP_KIND_")
REPORT_STATUS = EnumCodec(ReportStatus, pb.ReportStatus, "REPORT_STATUS_")
RELEASE_REASON = EnumCodec(ReleaseReason, pb.ReleaseReason, "RELEASE_REASON_")
TRANSFER_STATE = EnumCodec(TransferState, pb.TransferState, "TRANSFER_STATE_")


# --------------------------------------------------------------------------- field rules


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


#: Data-parallel ranks one engine name stands for: ``X_dp0`` to ``X_dp1023`` (see
#: :func:`data_parallel_deployment`).
MAX_DATA_PARALLEL_RANKS = 1024
#: vLLM's suffix of a data-parallel rank's engine id: ``_dp`` and the rank in canonical
#: decimal (ASCII digits, no sign, no leading zero).
_DATA_PARALLEL_SUFFIX = re.compile(r"_dp(0|[1-9][0-9]{0,3})\Z")


def data_parallel_deployment(engine_id: str) -> str:
    """``X`` when ``engine_id`` is ``X_dp<N>``, the engine id vLLM gives data-parallel rank
    ``N`` (below :data:`MAX_DATA_PARALLEL_RANKS`) of an engine configured as ``X``; else ''.
    Only the last suffix counts: ``X_dp1_dp2`` is rank 2 of ``X_dp1``."""
    found = _DATA_PARALLEL_SUFFIX.search(engine_id)
    if found is None or int(found.group(1)) >= MAX_DATA_PARALLEL_RANKS:
        return ""
    return engine_id[: found.start()]


def names_engine(names: Collection[str], engine_id: str) -> bool:
    """Whether one of ``names`` (a caller's identity, an allowlist) names ``engine_id``:
    the engine itself, or the deployment ``X`` of its data-parallel rank ``X_dp<N>``."""
    if engine_id in names:
        return True
    deployment = data_parallel_deployment(engine_id)
    return bool(deployment) and deployment in names


def optional_ident(value: str, field: str) -> str:
    """``''`` or a usable id (:func:`ident`)."""
    return ident(value, field) if value else ""


def text(value: str) -> str:
    """A free text (report error, abort reason), cut to ``max_text_chars`` characters."""
    return value[: LIMITS.max_text_chars]


def check_count(items: Sequence[object], limit: int, field: str) -> None:
    """RESOURCE_EXHAUSTED naming ``field`` when ``items`` has more than ``limit`` entries."""
    if len(items) > limit:
        raise LimitExceededError(field, f"{len(items)} entries, at most {limit}")


# --------------------------------------------------------------------------- block ids


#: Ids converted by one call: a conversion of more is split, so that a thread translating a
#: huge request lets the event loop's thread run every few milliseconds (one C call over a
#: million ids would hold the interpreter for tens of them).
_IDS_PER_STEP = 1 << 16
#: Groups longer than this are kept as ``array('q')``: 8 bytes an id instead of a Python int
#: each, and compared, copied and handed to numpy at C speed (release events share them).
LONG_GROUP = _IDS_PER_STEP


def group_ids(ids: Sequence[int]) -> Sequence[int]:
    """One group's block ids as :data:`BlockIds` keeps them: a tuple, or an ``array('q')``
    (copied a slice at a time) when longer than :data:`LONG_GROUP`."""
    if len(ids) <= LONG_GROUP:
        return tuple(ids[:])  # a protobuf field copies a slice at once, faster than it iterates
    if isinstance(ids, array) and ids.typecode == "q":
        return ids
    out = array("q")
    for start in range(0, len(ids), _IDS_PER_STEP):
        out.extend(ids[start : start + _IDS_PER_STEP])
    return out


def ids_array(ids: Sequence[int]) -> np.ndarray:
    """One group's block ids as int64 numpy (no copy of an ``array('q')``)."""
    if isinstance(ids, array):
        return np.frombuffer(ids, dtype=np.int64)
    return np.concatenate(
        [np.zeros(0, dtype=np.int64)]
        + [
            np.fromiter(ids[start : start + _IDS_PER_STEP], dtype=np.int64)
            for start in range(0, len(ids), _IDS_PER_STEP)
        ]
    )


def block_ids_from_proto(groups: Sequence[pb.BlockIds], field: str = "block_ids") -> BlockIds:
    """Per-group block ids; at most ``max_groups`` groups and ``max_block_ids`` ids in all."""
    check_count(groups, LIMITS.max_groups, field)
    lists = [g.ids for g in groups]
    total = sum(map(len, lists))
    if total > LIMITS.max_block_ids:
        raise LimitExceededError(field, f"{total} block ids, at most {LIMITS.max_block_ids}")
    return tuple([group_ids(ids) for ids in lists])


def block_ids_to_proto(ids: Sequence[Sequence[int]]) -> list[pb.BlockIds]:
    groups = []
    for group in ids:
        message = pb.BlockIds()
        for start in range(0, len(group), _IDS_PER_STEP):
            message.ids.extend(group[start : start + _IDS_PER_STEP])
        groups.append(message)
    return groups


def count_block_ids(groups: Sequence[pb.BlockIds]) -> int:
    """Block ids of a request, all groups together (cheap: no id is read)."""
    return sum([len(g.ids) for g in groups])


# --------------------------------------------------------------------------- layouts

_RANK_PREFIX = re.compile(r"^ranks\[\d+\]\.?")


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
            msg.tokens_per_entry or 1,
        )
    except LayoutError as exc:  # fields named "segment 'kv'.strides"
        raise LayoutError(f"{where}.{exc.field.rsplit('.', 1)[-1]}", exc.detail) from None


def _group_from_proto(msg: pb.GroupLayout, where: str) -> GroupLayout:
    kind = GROUP_KIND.from_proto(msg.kind, f"{where}.kind")
    check_count(msg.layers, LIMITS.max_regions, f"{where}.layers")
    for i, layer in enumerate(msg.layers):
        ident(layer, f"{where}.layers[{i}]")
    check_count(msg.segments, LIMITS.max_segments_per_group, f"{where}.segments")
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
        msg.sliding_window_tokens,
    )


def rank_layout_from_proto(msg: pb.RankLayout, tp_rank: int, where: str = "layout") -> RankLayout:
    """A rank's declared layout, validated; errors name ``where``'s protobuf path."""
    check_count(msg.groups, LIMITS.max_groups, f"{where}.groups")
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
    """The inverse of :func:`rank_layout_from_proto`."""
    return pb.RankLayout(
        num_regions=layout.num_regions,
        num_blocks=layout.num_blocks,
        page_bytes=layout.page_bytes,
        groups=[
            pb.GroupLayout(
                kind=GROUP_KIND.to_proto(g.kind),
                layers=g.layers,
                block_size=g.block_size,
                kernel_block_size=g.kernel_block_size,
                kernel_block_bytes=g.kernel_block_bytes,
                sliding_window_tokens=g.sliding_window,
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
                        tokens_per_entry=s.tokens_per_entry,
                    )
                    for s in g.segments
                ],
            )
            for g in layout.groups
        ],
    )


# --------------------------------------------------------------------------- descriptors

#: Bytes of one packed descriptor: three little-endian int64 (addr, len, dev_id).
DESCRIPTOR_BYTES = 24


def pack(descriptors: np.ndarray) -> bytes:
    """``(n, 3)`` int64 rows as ``n * 24`` bytes of little-endian int64 triples."""
    return np.ascontiguousarray(descriptors, dtype="<i8").tobytes()


def unpack(data: bytes) -> np.ndarray:
    """Inverse of :func:`pack`; raises ``ValueError`` unless ``len(data)`` is a multiple of 24."""
    if len(data) % DESCRIPTOR_BYTES:
        raise ValueError(
            f"{len(data)} bytes is not a whole number of {DESCRIPTOR_BYTES}-byte descriptors"
        )
    return np.frombuffer(data, dtype="<i8").reshape(-1, 3).astype(np.int64)


def join_plan_chunks(
    chunks: Iterable[pb.GetTransferPlanResponse],
) -> pb.GetTransferPlanResponse:
    """The one answer a StreamTransferPlan stream carries in ``chunks``: the first message
    with, per source, the descriptors of every message appended in order. ``ValueError`` if
    the stream is empty or a later message names a source the first did not."""
    messages = iter(chunks)
    first = next(messages, None)
    if first is None:
        raise ValueError("the plan stream ended before its first message")
    local = {s.prefill_rank: [s.local_descriptors] for s in first.sources}
    remote = {s.prefill_rank: [s.remote_descriptors] for s in first.sources}
    for message in messages:
        for source in message.sources:
            if source.prefill_rank not in local:
                raise ValueError(
                    f"a plan chunk names prefill rank {source.prefill_rank}, not a source"
                )
            local[source.prefill_rank].append(source.local_descriptors)
            remote[source.prefill_rank].append(source.remote_descriptors)
    for source in first.sources:
        if len(local[source.prefill_rank]) > 1:
            source.local_descriptors = b"".join(local[source.prefill_rank])
            source.remote_descriptors = b"".join(remote[source.prefill_rank])
    return first
