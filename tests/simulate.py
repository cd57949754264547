"""A byte-level simulator that checks plans against layout declarations alone.

Memory is modelled as int64 *labels*, one per byte: the label of a byte says which layer,
tensor, global element (global token included) and byte-within-element it holds, computed
from the engine's declared segments. Prefill regions are filled with their labels, a plan is
applied as memcpy, and every decode byte is compared with the label its own declaration
gives the same position. Nothing here uses the planner's logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from broker.layout import EngineLayout, RankLayout, Segment, tail_start
from broker.planner import RankPlan, TransferRequest

UNSET = -1  # a byte nobody wrote
TOKEN_BOUND = 1 << 16  # global token positions are < this in simulations


def _segment_labels(
    seg: Segment,
    layer_id: int,
    tensor_id: int,
    first_token: int,
    snapshot: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per byte of ``seg``: its offset from the segment base, its label and its token."""
    idx = np.indices(seg.shape).reshape(len(seg.shape), -1)
    offsets = (idx * np.array(seg.strides)[:, None]).sum(axis=0)
    flat, tokens = np.zeros(idx.shape[1], dtype=np.int64), np.full(idx.shape[1], -1)
    for axis, n in enumerate(seg.shape):
        if axis == seg.shard_axis:
            value, extent = idx[axis] + seg.shard_start, seg.global_extent
        elif axis == seg.token_axis:  # entries of tokens_per_entry tokens from first_token
            value, extent = idx[axis] + first_token // seg.tokens_per_entry, TOKEN_BOUND
            tokens = value * seg.tokens_per_entry
        else:
            value, extent = idx[axis], n
        flat = flat * extent + value
    item = seg.itemsize
    element_label = (((layer_id * 64 + tensor_id) * 16 + snapshot) * (1 << 36) + flat) * 8
    byte = np.arange(item)
    return (
        (offsets[:, None] + byte).ravel(),
        (element_label[:, None] + byte).ravel(),
        np.repeat(tokens, item),
    )


@dataclass
class RankMemory:
    """Label arrays of one rank: ``regions[r]`` has ``num_blocks * page_bytes`` entries."""

    regions: list[np.ndarray]
    tokens: list[np.ndarray]  # the global token each byte belongs to (-1: none, Mamba)


def blank_memory(rank: RankLayout, fill: int = UNSET) -> RankMemory:
    """Memory of ``rank`` with every byte holding ``fill``."""
    return RankMemory(
        [np.full(rank.region_bytes, fill, dtype=np.int64) for _ in range(rank.num_regions)],
        [np.full(rank.region_bytes, -1, dtype=np.int64) for _ in range(rank.num_regions)],
    )


def label_memory(
    rank: RankLayout, placed: tuple[tuple[tuple[int, int], ...], ...], fill: int
) -> RankMemory:
    """Memory of ``rank`` with every byte of the placed blocks labelled by its declaration.

    ``placed[g]`` lists ``(block_id, logical_index)`` for group ``g``: the request-wide page
    index for attention, the snapshot index counted from the newest for Mamba. Other bytes
    hold ``fill``.
    """
    memory = blank_memory(rank, fill)
    tensor_ids: dict[str, int] = {}
    for g, group in enumerate(rank.groups):
        for region in range(len(group.layers)):
            layer_id = g * 64 + region
            for block, logical in placed[g]:
                page = block * rank.page_bytes
                for kb in range(group.kernel_blocks_per_page):
                    first_token = logical * group.block_size + kb * group.kernel_block_size
                    snapshot = 0 if group.is_attention else logical
                    base = page + kb * group.kernel_block_bytes
                    for seg in group.segments:
                        tid = tensor_ids.setdefault(seg.tensor, len(tensor_ids))
                        offs, labels, toks = _segment_labels(
                            seg, layer_id, tid, first_token, snapshot
                        )
                        memory.regions[region][base + seg.offset + offs] = labels
                        memory.tokens[region][base + seg.offset + offs] = toks
    return memory


def apply_plan(plan: RankPlan, prefill: list[RankMemory], decode: RankMemory) -> int:
    """memcpy every run; returns the number of bytes copied."""
    moved = 0
    for src in plan.sources:
        memory = prefill[src.prefill_rank].regions
        for region, d_off, p_off, length in zip(
            src.region.tolist(),
            src.local_offset.tolist(),
            src.remote_offset.tolist(),
            src.length.tolist(),
        ):
            decode.regions[region][d_off : d_off + length] = memory[region][p_off : p_off + length]
            moved += length
    return moved


def placed_blocks(
    engine: EngineLayout,
    request: TransferRequest,
    side: str,
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``(block, logical index)`` per group of one side of ``request``, per the request
    semantics: a short attention list (decode's after a prefix hit, a sliding window's on
    both sides) holds the request's *last* pages; Mamba
    snapshots pair the prefill list's tail with the decode list's head."""
    out = []
    for g, group in enumerate(engine.groups):
        p_ids, d_ids = request.prefill_block_ids[g], request.decode_block_ids[g]
        ids = p_ids if side == "prefill" else d_ids
        if group.is_attention:
            first = tail_start(request.num_tokens, len(ids), group.block_size) // group.block_size
            out.append(tuple((b, first + i) for i, b in enumerate(ids)))
        else:
            n = min(len(p_ids), len(d_ids))
            chosen = p_ids[len(p_ids) - n :] if side == "prefill" else d_ids[:n]
            out.append(tuple((b, n - 1 - i) for i, b in enumerate(chosen)))
    return tuple(out)
