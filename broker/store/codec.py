"""How a shared store writes the broker's records: compact JSON for their fields and packed
int64 columns for plans, in a format of the store's own (independent of the public
``pdbroker.v1`` messages, so the API can grow without touching what replicas have stored).

Every format carries a version number; a reader refuses a version it does not know rather
than misread it.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from broker.layout import GroupKind, GroupLayout, RankLayout, Segment, shared_layout
from broker.planner import RankPlan, SourceReads
from broker.records import (
    ANY_DECODE_ENGINE,
    PlanRecord,
    RankRegistration,
    ReleaseEvent,
    TransferRecord,
)
from broker.wire import (
    BlockIds,
    MemoryKind,
    ReleaseReason,
    ReportStatus,
    Role,
    TransferState,
    group_ids,
)

#: Version of the formats below.
FORMAT = 1
_COLUMNS = 4  # region, local_offset, remote_offset, length


class FormatError(ValueError):
    """A stored value written in a format this broker does not read."""


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _check(values: dict[str, Any], what: str) -> dict[str, Any]:
    if values.get("v") != FORMAT:
        raise FormatError(
            f"{what} stored in format {values.get('v')!r}, this broker reads {FORMAT}"
        )
    return values


def _optional(decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else decode(v)


# --------------------------------------------------------------------------- registrations


def encode_registration(reg: RankRegistration) -> str:
    """The registration without its agent metadata (stored beside it as raw bytes)."""
    layout = reg.layout
    return _dumps(
        {
            "v": FORMAT,
            "engine": reg.engine_id,
            "role": reg.role.value,
            "tp": [reg.tp_size, reg.tp_rank],
            "agent": reg.agent_name,
            "regions": reg.region_rows,
            "layout": [
                layout.num_regions,
                layout.num_blocks,
                layout.page_bytes,
                [
                    [
                        g.kind.value,
                        g.layers,
                        g.block_size,
                        g.kernel_block_size,
                        g.kernel_block_bytes,
                        [
                            [
                                s.tensor,
                                s.offset,
                                s.shape,
                                s.strides,
                                s.dtype,
                                s.shard_axis,
                                s.shard_start,
                                s.global_extent,
                                s.token_axis,
                                s.tokens_per_entry,
                            ]
                            for s in g.segments
                        ],
                        # A sliding window only where there is one: other groups stored as
                        # before.
                        *([g.sliding_window] if g.sliding_window else []),
                    ]
                    for g in layout.groups
                ],
            ],
            "model": reg.model_fingerprint,
        }
    )


def decode_registration(text: bytes | str, agent_metadata: bytes) -> RankRegistration:
    values = _check(json.loads(text), "registration")
    tp_size, tp_rank = values["tp"]
    num_regions, num_blocks, page_bytes, groups = values["layout"]
    layout = RankLayout(
        tp_rank,
        num_regions,
        num_blocks,
        page_bytes,
        tuple(
            GroupLayout(
                GroupKind(kind),
                tuple(layers),
                # Segments stored before tokens_per_entry existed hold one token per entry.
                tuple(
                    Segment(t, off, tuple(shape), tuple(strides), *rest)
                    for t, off, shape, strides, *rest in segments
                ),
                block_size,
                kernel_block_size,
                kernel_block_bytes,
                *window,
            )
            for kind, layers, block_size, kernel_block_size, kernel_block_bytes, segments, *window in (
                groups
            )
        ),
    )
    return RankRegistration(
        values["engine"],
        Role(values["role"]),
        tp_size,
        tp_rank,
        values["agent"],
        agent_metadata,
        tuple(
            (base, length, device, MemoryKind(kind).value)
            for base, length, device, kind in values["regions"]
        ),
        shared_layout(layout),
        values["model"],
    )


# --------------------------------------------------------------------------- transfers


def _ids(groups: list[list[int]]) -> BlockIds:
    return tuple(group_ids(g) for g in groups)


def _plain(groups: BlockIds) -> list[Sequence[int]]:
    """Block ids as JSON can hold them."""
    return [g.tolist() if isinstance(g, array) else g for g in groups]


def encode_transfer(t: TransferRecord, plans_token: str) -> str:
    """Everything but the plans' runs (stored under ``plans_token``: :func:`encode_plans`)."""
    return _dumps(
        {
            "v": FORMAT,
            "id": t.transfer_id,
            "prefill": [t.prefill_engine_id, t.prefill_generation, t.prefill_tp_size],
            "tokens": t.num_tokens,
            "ids": _plain(t.block_ids),
            "allowed": sorted(t.allowed_decode_engines),
            "times": [t.published_at_ms, t.expires_at_ms, t.deadline_ms, t.finished_at_ms],
            "ttl": t.ttl_ms,
            "state": t.state.value,
            "decode": [t.decode_engine_id, t.decode_generation],
            "plans": [
                [
                    p.plan_id,
                    p.decode_rank,
                    _plain(p.block_ids),
                    p.handed_out_at_ms,
                    None if p.status is None else p.status.value,
                    p.bytes_moved,
                    p.duration_us,
                    p.error,
                    p.intact,
                ]
                for p in t.plans
            ],
            "released": [None if r is None else r.value for r in t.released],
            "timeline": t.timeline,
            "trace": t.traceparent,
            "end": [None if t.end_reason is None else t.end_reason.value, t.end_detail],
            "token": plans_token,
        }
    )


def plans_token_of(text: bytes | str) -> tuple[dict[str, Any], str]:
    """The decoded JSON of a stored transfer and the token of its plans."""
    values = _check(json.loads(text), "transfer")
    return values, values["token"]


def decode_transfer(values: dict[str, Any], runs: dict[int, RankPlan]) -> TransferRecord:
    """The record of :func:`plans_token_of`'s ``values``; ``runs``: its plans' runs."""
    prefill, tp_size = values["prefill"][:2], values["prefill"][2]
    published, expires, deadline, finished = values["times"]
    end_reason, end_detail = values["end"]
    status = _optional(ReportStatus)
    plans = tuple(
        PlanRecord(
            plan_id,
            rank,
            _ids(ids),
            runs[rank],
            handed_out,
            status(state),
            moved,
            duration,
            error,
            intact,
        )
        for plan_id, rank, ids, handed_out, state, moved, duration, error, intact in values["plans"]
    )
    return TransferRecord(
        values["id"],
        prefill[0],
        prefill[1],
        tp_size,
        values["tokens"],
        _ids(values["ids"]),
        frozenset(values["allowed"]) if values["allowed"] else ANY_DECODE_ENGINE,
        published,
        values.get("ttl", expires - published),  # stored before extensions: never extended
        expires,
        deadline,
        TransferState(values["state"]),
        values["decode"][0],
        values["decode"][1],
        plans,
        tuple(_optional(ReleaseReason)(r) for r in values["released"]),
        finished,
        tuple((at_ms, event, detail) for at_ms, event, detail in values["timeline"]),
        values["trace"],
        _optional(ReleaseReason)(end_reason),
        end_detail,
    )


def encode_plans(plans: dict[int, RankPlan]) -> bytes:
    """``u32 header length | JSON header | int64 columns``: per plan its decode rank, byte
    and descriptor counts and per source its prefill rank and run count; then per source
    a ``(4, runs)`` array of region, local offset, remote offset and length."""
    header = [
        FORMAT,
        [
            [
                d,
                p.naive_bytes,
                p.vllm_descriptors,
                [[s.prefill_rank, s.num_descriptors] for s in p.sources],
            ]
            for d, p in plans.items()
        ],
    ]
    arrays = [
        np.stack([s.region, s.local_offset, s.remote_offset, s.length]).astype("<i8", copy=False)
        for p in plans.values()
        for s in p.sources
    ]
    head = _dumps(header).encode()
    return b"".join([struct.pack("<I", len(head)), head, *(a.tobytes() for a in arrays)])


def decode_plans(blob: bytes) -> dict[int, RankPlan]:
    (size,) = struct.unpack_from("<I", blob)
    version, header = json.loads(blob[4 : 4 + size])
    if version != FORMAT:
        raise FormatError(f"plans stored in format {version!r}, this broker reads {FORMAT}")
    columns = np.frombuffer(bytearray(blob[4 + size :]), dtype="<i8")
    plans, at = {}, 0
    for d, naive, vllm, sources in header:
        reads = []
        for prefill_rank, runs in sources:
            table = columns[at : at + _COLUMNS * runs].reshape(_COLUMNS, runs)
            at += _COLUMNS * runs
            reads.append(SourceReads(prefill_rank, *table))
        plans[d] = RankPlan(d, tuple(reads), naive, vllm)
    return plans


# --------------------------------------------------------------------------- releases


def encode_release(event: ReleaseEvent) -> str:
    """The event without its sequence (the stream entry's id holds it)."""
    return _dumps(
        {
            "v": FORMAT,
            "id": event.transfer_id,
            "ids": _plain(event.block_ids),
            "reason": event.reason.value,
            "detail": event.detail,
            "at": event.released_at_ms,
            "trace": event.traceparent,
        }
    )


def decode_release(sequence: int, payload: bytes) -> ReleaseEvent:
    values = _check(json.loads(payload), "release event")
    return ReleaseEvent(
        sequence,
        values["id"],
        _ids(values["ids"]),
        ReleaseReason(values["reason"]),
        values["detail"],
        values["at"],
        values["trace"],
    )
