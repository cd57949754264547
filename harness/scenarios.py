"""Ready-made planning scenarios: a model at two TP sizes and a request with fresh block ids,
and the blocks a request takes per group.

Used by ``pdbroker plan`` and ``bench``, the fleet, the soak and the benchmarks; tests use it
to build realistic requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.layout import EngineLayout
from broker.models import ModelSpec, build_engine_layout, hma_block_size
from broker.planner import TransferRequest


@dataclass(frozen=True)
class Scenario:
    model: ModelSpec
    prefill: EngineLayout
    decode: EngineLayout
    request: TransferRequest


def fresh_block_ids(
    layout: EngineLayout, num_tokens: int, first_block: int = 0, stride: int = 1
) -> tuple[tuple[int, ...], ...]:
    """Block ids for a new request: ``ceil(num_tokens / block_size)`` per attention group,
    one per Mamba group, allocated from ``first_block`` every ``stride`` blocks (``stride``
    > 1 models a fragmented allocator)."""
    counts = [-(-num_tokens // g.block_size) if g.is_attention else 1 for g in layout.groups]
    ids, nxt = [], first_block
    for count in counts:
        ids.append(tuple(range(nxt, nxt + count * stride, stride)))
        nxt += count * stride
    return tuple(ids)


def block_counts(layout: EngineLayout, num_tokens: int, mamba_blocks: int = 1) -> list[int]:
    """Blocks a request takes per group: its pages for attention, ``mamba_blocks`` state
    blocks for Mamba."""
    return [
        -(-num_tokens // g.block_size) if g.is_attention else mamba_blocks for g in layout.groups
    ]


def blocks_needed(layout: EngineLayout, num_tokens: int, stride: int = 1) -> int:
    return max(max(g) for g in fresh_block_ids(layout, num_tokens, 0, stride) if g) + 1


def build_scenario(
    model: ModelSpec,
    prefill_tp: int,
    decode_tp: int,
    num_tokens: int,
    block_size: int = 0,
    kernel_block_size: int = 0,
    stride: int = 1,
    prefill_offset: int = 0,
    decode_offset: int = 0,
) -> Scenario:
    """Both engines sized to hold the request, with block ids from the given offsets.

    ``block_size`` 0 uses one block size on both sides, the larger of their HMA choices, as
    an operator passing ``--block-size`` to both engines does (vLLM requires it under HMA).
    """
    if not block_size:
        block_size = max(hma_block_size(model, prefill_tp), hma_block_size(model, decode_tp))
    probe_p = build_engine_layout(model, prefill_tp, 1, block_size, kernel_block_size)
    probe_d = build_engine_layout(model, decode_tp, 1, block_size, kernel_block_size)
    p_blocks = prefill_offset + blocks_needed(probe_p, num_tokens, stride)
    d_blocks = decode_offset + blocks_needed(probe_d, num_tokens, stride)
    prefill = build_engine_layout(model, prefill_tp, p_blocks, block_size, kernel_block_size)
    decode = build_engine_layout(model, decode_tp, d_blocks, block_size, kernel_block_size)
    request = TransferRequest(
        num_tokens,
        fresh_block_ids(prefill, num_tokens, prefill_offset, stride),
        fresh_block_ids(decode, num_tokens, decode_offset, stride),
    )
    return Scenario(model, prefill, decode, request)
