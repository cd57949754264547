"""Sliding-window attention groups: the block lists hold only the in-window tail (vLLM's NIXL
clipping rule), and the planner moves exactly those blocks' tokens."""

from __future__ import annotations

import dataclasses
from itertools import chain

import pytest
from test_planner_properties import check_plan_by_simulation

from broker.errors import IncompatibleLayoutsError, RequestError
from broker.layout import GroupKind, attention_shortfall, tail_start, window_blocks, window_tail
from broker.models import AttentionParams, MambaParams, ModelSpec, build_engine_layout
from broker.planner import PairPlanner, TransferRequest
from broker.wire import rank_layout_from_proto, rank_layout_to_proto

WINDOW, BLOCK = 64, 16


CASES = [(64, 16), (128, 16), (100, 16), (4096, 32), (17, 16), (16, 16), (1, 16), (130, 48)]


@pytest.mark.parametrize(("window", "block_size"), CASES)
def test_window_tail_is_what_vllms_nixl_scheduler_keeps(window: int, block_size: int) -> None:
    """vLLM's own scheduler (its ``blocks_per_sw`` and clipping at every block-id exchange)
    keeps the same blocks of a sliding-window group, and a full group's whole list."""
    pytest.importorskip("vllm")
    from harness.vllm import cpu_engine  # noqa: F401  (configures vLLM for CPU first)

    # isort: split
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    head = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.bfloat16}
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", engine_id="e"
        ),
    )
    groups = [
        KVCacheGroupSpec(
            ["s"], SlidingWindowSpec(block_size=block_size, sliding_window=window, **head)
        ),
        KVCacheGroupSpec(["f"], FullAttentionSpec(block_size=block_size, **head)),
    ]
    vllm = NixlPullConnectorScheduler(config, "e", KVCacheConfig(1, [], groups))
    assert vllm.blocks_per_sw == [window_blocks(window, block_size), 0]
    for length in range(3 * window_blocks(window, block_size) + 2):
        ids = list(range(1, length + 1))
        clipped = vllm.get_exchange_clipped_blocks((ids, ids)) if ids else ((), ())
        assert [list(g) for g in clipped] == (
            [window_tail(ids, window, block_size), window_tail(ids, 0, block_size)]
            if ids
            else [[], []]
        )


def swa_model(window: int = WINDOW, full: bool = True) -> ModelSpec:
    """A sliding-window group and (``full``) a full-attention group, two layers each."""
    groups = [(GroupKind.ATTENTION, ("s.0", "s.1"))]
    if full:
        groups.append((GroupKind.ATTENTION, ("f.0", "f.1")))
    return ModelSpec("swa", tuple(groups), AttentionParams(4, 8), None, (window, 0)[: len(groups)])


def simulate_window_group(prefill, decode, req: TransferRequest) -> None:
    """Byte-exact simulation of the window group alone (it checks one attention group)."""
    alone = [
        build_engine_layout(
            swa_model(full=False),
            e.tp_size,
            e.ranks[0].num_blocks,
            g.block_size,
            g.kernel_block_size,
        )
        for e, g in ((prefill, prefill.groups[0]), (decode, decode.groups[0]))
    ]
    check_plan_by_simulation(
        *alone,
        TransferRequest(req.num_tokens, req.prefill_block_ids[:1], req.decode_block_ids[:1]),
    )


def request(num_tokens: int, p_bs: int = BLOCK, d_bs: int = BLOCK) -> TransferRequest:
    """Ids as the connector sends them: the window group's lists clipped by vLLM's rule."""
    p_full = list(range(-(-num_tokens // p_bs)))
    d_full = list(range(-(-num_tokens // d_bs)))
    return TransferRequest.of(
        num_tokens,
        [window_tail([100 + b for b in p_full], WINDOW, p_bs), p_full],
        [window_tail([100 + b for b in d_full], WINDOW, d_bs), d_full],
    )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("num_tokens", [200, 256, 257])
def test_only_the_in_window_blocks_move(p_tp: int, d_tp: int, num_tokens: int) -> None:
    prefill = build_engine_layout(swa_model(), p_tp, 128, BLOCK)
    decode = build_engine_layout(swa_model(), d_tp, 128, BLOCK)
    req = request(num_tokens)
    assert len(req.prefill_block_ids[0]) == window_blocks(WINDOW, BLOCK) == 5
    simulate_window_group(prefill, decode, req)
    plan = PairPlanner(prefill, decode).plan(req)
    # The window group moves its 5 tail pages, the full group all (last pages whole: the
    # kernel block is the page).
    held = -(-num_tokens // BLOCK) * BLOCK
    per_token = decode.groups[0].state_bytes // BLOCK * len(decode.groups[0].layers) * d_tp
    assert plan.nbytes == per_token * (5 * BLOCK + held)
    # No run reads a prefill page or writes a decode page the window group dropped.
    rows = plan.rows()
    assert pages(rows[:, 5], rows[:, 6], prefill) == set(chain(*req.prefill_block_ids))
    assert pages(rows[:, 2], rows[:, 6], decode) == set(chain(*req.decode_block_ids))


def pages(offsets, lengths, engine) -> set[int]:
    """Pages the runs at ``offsets`` of ``lengths`` bytes touch."""
    page = engine.ranks[0].page_bytes
    return {
        p
        for start, n in zip(offsets.tolist(), lengths.tolist())
        for p in range(start // page, (start + n - 1) // page + 1)
    }


def test_a_request_shorter_than_the_window_moves_whole() -> None:
    layout = build_engine_layout(swa_model(), 2, 128, BLOCK)
    req = request(50)  # 4 blocks: all inside the window's 5
    assert req.prefill_block_ids[0] == (100, 101, 102, 103)
    simulate_window_group(layout, layout, req)
    plan = PairPlanner(layout, layout).plan(req)
    per_token = layout.groups[0].state_bytes // BLOCK * len(layout.groups[0].layers) * 2
    assert plan.nbytes == per_token * 64 * 2  # both groups: every page


def test_other_block_sizes_move_the_tokens_both_tails_hold() -> None:
    prefill = build_engine_layout(swa_model(), 1, 128, 16)
    decode = build_engine_layout(swa_model(), 2, 128, 48, 16)
    req = request(300, 16, 48)
    simulate_window_group(prefill, decode, req)
    # Prefill's tail starts at token 224 (5 blocks of 16), decode's at 192 (3 blocks of 48):
    # decode's tokens 192..223 are outside the window and the prefill list; they stay.
    plan = PairPlanner(prefill, decode).plan(req)
    per_token = decode.groups[0].state_bytes // 48 * 2 * 2
    assert plan.nbytes == per_token * ((304 - 224) + 304)  # to the end of a kernel block


def test_a_window_list_that_misses_window_tokens_is_refused() -> None:
    layout = build_engine_layout(swa_model(), 1, 128, BLOCK)
    req = request(256)
    short = dataclasses.replace(
        req, prefill_block_ids=(req.prefill_block_ids[0][2:], req.prefill_block_ids[1])
    )
    with pytest.raises(RequestError) as exc:
        PairPlanner(layout, layout).plan(short)
    assert exc.value.field == "prefill_block_ids[0]"
    assert "from 208 on" in exc.value.detail and "starts at token 193" in exc.value.detail
    # The full-attention group still needs every token.
    cut = dataclasses.replace(
        req, prefill_block_ids=(req.prefill_block_ids[0], req.prefill_block_ids[1][1:])
    )
    with pytest.raises(RequestError) as exc:
        PairPlanner(layout, layout).plan(cut)
    assert exc.value.field == "prefill_block_ids[1]"


@pytest.mark.parametrize("num_tokens", [207, 335])
def test_the_window_boundary_is_that_of_the_token_after_the_prompt(num_tokens: int) -> None:
    """The window of token ``num_tokens`` (a 128-token window: from ``num_tokens - 127`` on)
    starts on a block. vLLM's sliding-window manager sizes both engines' tables by that window,
    so the block before it is its null block there, and of the 9 blocks vLLM's connector keeps
    only 8 are pages: they hold all the window needs. Token ``num_tokens - 128``, which the
    window of the token decode computes again (``num_tokens - 1``) also covers, lies in that
    null block on decode too: no list can hold it, so requiring it would refuse the request."""
    group = build_engine_layout(swa_model(128), 1, 128, BLOCK).groups[0]
    first = num_tokens - 128 + 1
    assert first % BLOCK == 0
    assert tail_start(num_tokens, window_blocks(128, BLOCK), BLOCK) == first - BLOCK
    assert tail_start(num_tokens, window_blocks(128, BLOCK) - 1, BLOCK) == first
    assert attention_shortfall(group, num_tokens, window_blocks(128, BLOCK) - 1) is None
    short = attention_shortfall(group, num_tokens, window_blocks(128, BLOCK) - 2)
    assert short is not None
    assert f"from {first + BLOCK} on" in short and f"starts at token {first}" in short


def test_prefill_and_decode_must_declare_the_same_window() -> None:
    prefill = build_engine_layout(swa_model(64), 1, 128, BLOCK)
    for other in (swa_model(128), swa_model(0)):
        with pytest.raises(IncompatibleLayoutsError) as exc:
            PairPlanner(prefill, build_engine_layout(other, 1, 128, BLOCK))
        assert exc.value.field == "groups[0].sliding_window"


def test_the_window_crosses_the_wire() -> None:
    rank = build_engine_layout(swa_model(), 2, 128, BLOCK).ranks[1]
    assert rank_layout_from_proto(rank_layout_to_proto(rank), 1) == rank


def windowed_mamba2_model(window: int = 100) -> ModelSpec:
    """Nemotron-H's shape, small: Mamba2 groups around one attention group whose layers all
    have a ``window``-token sliding window (vLLM gives every attention layer of a Nemotron-H
    config with ``sliding_window`` one)."""
    return ModelSpec(
        "windowed-mamba2",
        (
            (GroupKind.MAMBA, ("m0.0", "m0.1")),
            (GroupKind.ATTENTION, ("s.0", "s.1")),
            (GroupKind.MAMBA, ("m1.0", "m1.1")),
        ),
        AttentionParams(4, 8),
        MambaParams(
            "mamba2", 4, intermediate_size=16, num_heads=8, head_dim=2, n_groups=2, state_size=3
        ),
        (0, window, 0),
    )


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_bs", "d_bs"), [(1, 1, 8, 8), (1, 2, 8, 16), (2, 1, 16, 8), (2, 4, 8, 8)]
)
@pytest.mark.parametrize("num_tokens", [301, 360])
def test_the_window_tail_and_the_mamba_state_move_together(
    p_tp: int, d_tp: int, p_bs: int, d_bs: int, num_tokens: int
) -> None:
    """A sliding-window group beside Mamba2 groups, in one plan: the window group moves its
    in-window tail only, each Mamba group its running-state block, byte-exact."""
    model = windowed_mamba2_model()

    def lists(block_size: int) -> list[tuple[int, ...]]:
        """As the connector sends them: the window group's tail, a state block per Mamba group."""
        pages = -(-num_tokens // block_size)
        return [(pages,), tuple(window_tail(list(range(pages)), 100, block_size)), (pages + 1,)]

    req = TransferRequest.of(num_tokens, lists(p_bs), lists(d_bs))
    assert len(req.prefill_block_ids[1]) == window_blocks(100, p_bs) < num_tokens // p_bs
    prefill = build_engine_layout(model, p_tp, 64, p_bs, 8)
    decode = build_engine_layout(model, d_tp, 64, d_bs, 8)
    check_plan_by_simulation(prefill, decode, req)
    # Every Mamba layer's state, and the window group's tokens both tails hold (to the end of
    # a kernel block): nothing out of the window.
    plan = PairPlanner(prefill, decode).plan(req)
    mamba, window = decode.groups[0], decode.groups[1]
    first = max(
        tail_start(num_tokens, len(ids), bs)
        for ids, bs in ((req.prefill_block_ids[1], p_bs), (req.decode_block_ids[1], d_bs))
    )
    assert first > 0 and num_tokens - first < 100 + 2 * max(p_bs, d_bs)
    tail = -(-num_tokens // 8) * 8 - first
    assert plan.nbytes == d_tp * (mamba.state_bytes * 4 + window.state_bytes // d_bs * 2 * tail)
