"""Property tests: for random hybrid models, TP pairs, block sizes and block ids, applying a
plan as memcpy reproduces exactly the decode state its own layout declares."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simulate import UNSET, apply_plan, blank_memory, label_memory, placed_blocks

from broker.layout import GroupKind, tail_start
from broker.models import (
    AttentionParams,
    MambaParams,
    ModelSpec,
    build_engine_layout,
    hma_block_size,
)
from broker.planner import PairPlanner, TransferRequest

TP_SIZES = (1, 2, 4, 8)
DTYPES = ("bfloat16", "float32", "fp8")


@st.composite
def mamba_params(draw) -> MambaParams:
    kind = draw(st.sampled_from(("mamba1", "mamba2", "gdn")))
    common = {
        "conv_kernel": draw(st.sampled_from((2, 3, 4))),
        "conv_dtype": draw(st.sampled_from(DTYPES)),
        "ssm_dtype": draw(st.sampled_from(DTYPES)),
    }
    if kind == "mamba1":
        return MambaParams(
            kind,
            intermediate_size=draw(st.sampled_from((8, 16))),
            state_size=draw(st.sampled_from((1, 2, 3))),
            **common,
        )
    if kind == "mamba2":
        heads, head_dim = draw(st.sampled_from((8, 16))), draw(st.sampled_from((1, 2)))
        return MambaParams(
            kind,
            intermediate_size=heads * head_dim,
            num_heads=heads,
            head_dim=head_dim,
            n_groups=draw(st.sampled_from((1, 2, 4, 8))),
            state_size=draw(st.sampled_from((1, 2, 3))),
            **common,
        )
    return MambaParams(
        kind,
        num_k_heads=draw(st.sampled_from((8, 16))),
        num_v_heads=draw(st.sampled_from((8, 16, 32))),
        head_k_dim=draw(st.sampled_from((1, 2))),
        head_v_dim=draw(st.sampled_from((1, 3))),
        **common,
    )


@st.composite
def hybrid_model(draw) -> ModelSpec:
    regions = draw(st.integers(1, 3))
    groups = [
        (GroupKind.MAMBA, tuple(f"m{g}.{i}" for i in range(draw(st.integers(1, regions)))))
        for g in range(draw(st.integers(1, 3)))
    ]
    groups[0] = (GroupKind.MAMBA, tuple(f"m0.{i}" for i in range(regions)))
    groups.insert(
        draw(st.integers(0, len(groups))),
        (GroupKind.ATTENTION, tuple(f"a.{i}" for i in range(draw(st.integers(1, regions))))),
    )
    latent = draw(st.booleans())  # MLA: one latent head, replicated on every rank
    attention = AttentionParams(
        1 if latent else draw(st.sampled_from((1, 2, 4, 8))),
        draw(st.sampled_from((1, 2, 4))),
        draw(st.sampled_from(DTYPES)),
        latent,
    )
    return ModelSpec("random", tuple(groups), attention, draw(mamba_params()))


def _engine(draw, model: ModelSpec, tp: int, extra_blocks: int):
    kbs = draw(st.sampled_from((1, 2, 4, 8)))
    block_size = hma_block_size(model, tp, kbs * draw(st.sampled_from((1, 2, 4))), alignment=kbs)
    return block_size, kbs


@st.composite
def scenario(draw):
    model = draw(hybrid_model())
    p_tp, d_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    (p_bs, p_kbs), (d_bs, d_kbs) = _engine(draw, model, p_tp, 0), _engine(draw, model, d_tp, 0)
    num_tokens = draw(st.integers(1, 3 * max(p_bs, d_bs)))
    p_lists, d_lists = [], []
    for kind, _ in model.groups:
        if kind is GroupKind.ATTENTION:
            p_count = -(-num_tokens // p_bs) + draw(st.integers(0, 1))
            d_needed = -(-num_tokens // d_bs)
            d_count = draw(st.integers(1, d_needed + 1))  # < needed: prefix hit; > needed: spare
        else:
            p_count, d_count = draw(st.sampled_from(((1, 1), (1, 1), (2, 1), (1, 2))))
        p_lists.append(p_count)
        d_lists.append(d_count)
    p_blocks, d_blocks = (
        sum(p_lists) + draw(st.integers(0, 3)),
        sum(d_lists) + draw(st.integers(0, 3)),
    )
    p_perm = draw(st.permutations(range(p_blocks)))
    d_perm = draw(st.permutations(range(d_blocks)))

    def split(perm, counts):
        out, at = [], 0
        for c in counts:
            out.append(tuple(perm[at : at + c]))
            at += c
        return tuple(out)

    prefill = build_engine_layout(model, p_tp, p_blocks, p_bs, p_kbs)
    decode = build_engine_layout(model, d_tp, d_blocks, d_bs, d_kbs)
    return (
        prefill,
        decode,
        TransferRequest(num_tokens, split(p_perm, p_lists), split(d_perm, d_lists)),
    )


def assert_same_plan(one, other) -> None:
    """Equal plans, run for run in the same order."""
    assert (one.decode_rank, one.naive_bytes, one.vllm_descriptors) == (
        other.decode_rank,
        other.naive_bytes,
        other.vllm_descriptors,
    )
    assert [s.prefill_rank for s in one.sources] == [s.prefill_rank for s in other.sources]
    for a, b in zip(one.sources, other.sources):
        for column in ("region", "local_offset", "remote_offset", "length"):
            np.testing.assert_array_equal(getattr(a, column), getattr(b, column))


def check_plan_by_simulation(prefill, decode, request) -> None:
    pair = PairPlanner(prefill, decode)
    p_mem = [
        label_memory(rank, placed_blocks(prefill, request, "prefill"), UNSET)
        for rank in prefill.ranks
    ]
    d_placed = placed_blocks(decode, request, "decode")
    # Decode kernel blocks holding a token below num_tokens arrive whole, as far as the
    # prefill pages reach.
    attention = next(g for g, group in enumerate(decode.groups) if group.is_attention)
    kbs = decode.groups[attention].kernel_block_size
    p_bs = prefill.groups[attention].block_size
    p_count = len(request.prefill_block_ids[attention])
    p_first = tail_start(request.num_tokens, p_count, p_bs)
    last_token = min(-(-request.num_tokens // kbs) * kbs, p_first + p_count * p_bs)
    together = PairPlanner(prefill, decode).plan(request).ranks  # all ranks in one pass
    for d_rank, rank in enumerate(decode.ranks):
        plan = pair.plan_rank(d_rank, request)
        assert_same_plan(plan, together[d_rank])
        for src in plan.sources:  # every run inside a registered region on both sides
            assert src.local_offset.min() >= 0 and src.remote_offset.min() >= 0
            assert (src.local_offset + src.length).max() <= rank.region_bytes
            assert (src.remote_offset + src.length).max() <= prefill.ranks[
                src.prefill_rank
            ].region_bytes
        d_mem = blank_memory(rank)
        moved = apply_plan(plan, p_mem, d_mem)
        expected = label_memory(rank, d_placed, fill=-2)
        for region in range(rank.num_regions):
            got, want, tokens = (
                d_mem.regions[region],
                expected.regions[region],
                expected.tokens[region],
            )
            written = got != UNSET
            # Whatever was written is exactly what the decode layout declares there.
            np.testing.assert_array_equal(got[written], want[written])
            # Every byte of state decode needs arrived: Mamba state, tokens < num_tokens.
            needed = (want >= 0) & (
                (tokens < 0) | ((tokens >= p_first) & (tokens < request.num_tokens))
            )
            assert written[needed].all(), f"decode rank {d_rank} region {region} misses bytes"
        optimal = sum(
            int(((e >= 0) & ((t < 0) | ((p_first <= t) & (t < last_token)))).sum())
            for e, t in zip(expected.regions, expected.tokens)
        )
        written_total = sum(int((r != UNSET).sum()) for r in d_mem.regions)
        assert moved == written_total == plan.nbytes == optimal  # no byte written twice, none extra


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: conftest
@given(scenario())
def test_plan_reproduces_declared_decode_state(case) -> None:
    check_plan_by_simulation(*case)
