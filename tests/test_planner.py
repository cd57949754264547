"""Planner behaviour on named scenarios and its validation errors."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc

import pytest
from test_planner_properties import check_plan_by_simulation

from broker.errors import IncompatibleLayoutsError, LayoutError, RequestError
from broker.layout import (
    EngineLayout,
    GroupKind,
    GroupLayout,
    RankLayout,
    Segment,
    contiguous_strides,
)
from broker.models import AttentionParams, MambaParams, ModelSpec, build_engine_layout
from broker.planner import PairPlanner, TransferRequest
from broker.presets import resolve_model
from harness.scenarios import build_scenario

MAMBA2 = MambaParams(
    "mamba2",
    conv_kernel=4,
    intermediate_size=64,
    num_heads=16,
    head_dim=4,
    n_groups=2,
    state_size=8,
)
GDN = MambaParams(
    "gdn",
    conv_kernel=4,
    conv_dtype="bfloat16",
    ssm_dtype="bfloat16",
    num_k_heads=8,
    num_v_heads=16,
    head_k_dim=4,
    head_v_dim=4,
)


def hybrid(mamba: MambaParams = MAMBA2, kv_heads: int = 4, kv_dtype: str = "bfloat16") -> ModelSpec:
    return ModelSpec(
        "tiny",
        (
            (GroupKind.MAMBA, ("m0", "m2")),
            (GroupKind.ATTENTION, ("a1", "a3")),
            (GroupKind.MAMBA, ("m4", "m5")),
        ),
        AttentionParams(kv_heads, 8, kv_dtype),
        mamba,
    )


@pytest.mark.parametrize(
    "p_ids,d_ids,pairs",
    [
        ((4, 7, 2), (9,), {9: 2}),  # decode takes the newest state only
        ((4, 7, 2), (9, 5), {9: 7, 5: 2}),  # the newest two, oldest first
        ((4,), (9, 5), {9: 4}),  # a spare decode block receives nothing
    ],
    ids=["3->1", "3->2", "1->2"],
)
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_mamba_state_blocks_pair_from_the_prefill_tail(p_ids, d_ids, pairs, p_tp, d_tp) -> None:
    """Prefill lists a Mamba group's state blocks oldest first (prefix caching keeps older
    ones): decode's blocks receive the newest, in order, whatever the TP pair."""
    model = hybrid()
    prefill = build_engine_layout(model, p_tp, 16, 32)
    decode = build_engine_layout(model, d_tp, 16, 32)
    request = TransferRequest.of(40, (p_ids, (0, 1), (10,)), (d_ids, (3, 6), (12,)))
    page_p, page_d = prefill.ranks[0].page_bytes, decode.ranks[0].page_bytes
    for d in range(d_tp):
        moved: dict[int, set[int]] = {}
        for source in PairPlanner(prefill, decode).plan_rank(d, request).sources:
            for d_off, p_off in zip(source.local_offset.tolist(), source.remote_offset.tolist()):
                moved.setdefault(d_off // page_d, set()).add(p_off // page_p)
        assert {b: moved[b] for b in d_ids if b in moved} == {b: {p} for b, p in pairs.items()}
    check_plan_by_simulation(prefill, decode, request)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 2), (1, 4), (4, 1), (2, 8), (8, 2)])
@pytest.mark.parametrize("mamba", [MAMBA2, GDN], ids=["mamba2", "gdn"])
def test_tp_pairs_reshard_exactly(p_tp: int, d_tp: int, mamba: MambaParams) -> None:
    sc = build_scenario(
        hybrid(mamba), p_tp, d_tp, num_tokens=100, prefill_offset=3, decode_offset=1
    )
    check_plan_by_simulation(sc.prefill, sc.decode, sc.request)


def test_replicated_mamba2_groups_read_the_right_group() -> None:
    # n_groups=2 < tp=8: each decode rank holds one whole group; vLLM 0.33 misreads this case.
    sc = build_scenario(hybrid(), 1, 8, num_tokens=40)
    check_plan_by_simulation(sc.prefill, sc.decode, sc.request)
    sc = build_scenario(hybrid(), 8, 2, num_tokens=40)
    check_plan_by_simulation(sc.prefill, sc.decode, sc.request)
    b_rank5 = sc.decode.ranks[1].groups[0].segment("conv.B")
    assert (b_rank5.shard_start, b_rank5.shape[0]) == (8, 8)  # rank 1 of 2 holds group 1


def test_different_logical_block_sizes_without_common_kernel_block() -> None:
    model = hybrid()
    prefill = build_engine_layout(model, 2, 40, block_size=48, kernel_block_size=16)
    decode = build_engine_layout(model, 1, 40, block_size=80, kernel_block_size=40)
    request = TransferRequest.of(150, [[1], list(range(4, 8)), [2]], [[3], [10, 11], [5]])
    check_plan_by_simulation(prefill, decode, request)


def test_prefix_hit_moves_only_the_missing_tail() -> None:
    sc = build_scenario(hybrid(), 2, 2, num_tokens=100)
    full = PairPlanner(sc.prefill, sc.decode).plan_rank(0, sc.request)
    d_ids = list(sc.request.decode_block_ids)
    d_ids[1] = d_ids[1][-1:]  # decode already holds all but the last attention page
    request = dataclasses.replace(sc.request, decode_block_ids=tuple(d_ids))
    check_plan_by_simulation(sc.prefill, sc.decode, request)
    partial = PairPlanner(sc.prefill, sc.decode).plan_rank(0, request)
    attention_page = sc.decode.groups[1].state_bytes
    pages_skipped = len(sc.request.decode_block_ids[1]) - 1
    assert full.nbytes - partial.nbytes == pages_skipped * attention_page * 2  # two layers


def _same_shape(request: TransferRequest, shift: int) -> list[TransferRequest]:
    """``request``, its block ids moved by ``shift``, and both with each decode list
    reversed: one shape (tokens, list lengths), other pages paired, contiguous or not."""
    moved = TransferRequest.of(
        request.num_tokens,
        [[b + shift for b in g] for g in request.prefill_block_ids],
        [[b + shift for b in g] for g in request.decode_block_ids],
    )
    return [
        r
        for base in (request, moved)
        for r in (
            base,
            TransferRequest.of(
                base.num_tokens,
                base.prefill_block_ids,
                [g[::-1] for g in base.decode_block_ids],
            ),
        )
    ]


@pytest.mark.parametrize("same_block_size", [True, False])
def test_requests_of_one_shape_are_planned_from_their_own_block_ids(same_block_size: bool) -> None:
    """A planner reuses what a request's shape fixes (which list positions pair, the templates
    gathered), never its block ids: each request of one shape, planned after the others (all
    ranks, then one), equals its plan by a fresh planner."""
    if same_block_size:
        sc = build_scenario(hybrid(), 2, 2, 100, stride=2, prefill_offset=1, decode_offset=1)
        prefill, decode, request = sc.prefill, sc.decode, sc.request
    else:
        model = hybrid()
        prefill = build_engine_layout(model, 2, 40, block_size=48, kernel_block_size=16)
        decode = build_engine_layout(model, 2, 40, block_size=80, kernel_block_size=40)
        request = TransferRequest.of(150, [[1], [5, 7, 9, 11], [3]], [[3], [13, 15], [5]])
    requests = _same_shape(request, -1)
    reused = PairPlanner(prefill, decode)
    for _ in range(2):
        for r in requests:
            fresh = PairPlanner(prefill, decode)
            assert (reused.plan(r).rows() == fresh.plan(r).rows()).all()
            one, alone = reused.plan_rank(1, r), fresh.plan_rank(1, r)
            assert [s.prefill_rank for s in one.sources] == [s.prefill_rank for s in alone.sources]
            for a, b in zip(one.sources, alone.sources):
                assert (a.local_offset == b.local_offset).all()
                assert (a.remote_offset == b.remote_offset).all()
                assert (a.length == b.length).all()
    assert len({reused.plan(r).rows().tobytes() for r in requests}) == len(requests)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 2), (1, 2), (4, 2)])
def test_a_plans_sums_and_bounds_are_those_of_its_runs(p_tp: int, d_tp: int) -> None:
    """What the planner hands along with a plan (per source its bytes and the lowest and
    highest value of each column, which the region checks start from; per rank its counts)
    is what its runs hold, whether the plan was made with all ranks or alone."""
    sc = build_scenario(hybrid(), p_tp, d_tp, 100, stride=2, prefill_offset=1, decode_offset=1)
    planner = PairPlanner(sc.prefill, sc.decode)
    plans = [*planner.plan(sc.request).ranks, planner.plan_rank(1, sc.request)]
    for plan in plans:
        assert plan.sources
        for s in plan.sources:
            columns = (s.region, s.local_offset, s.remote_offset, s.length)
            assert s.bounds == tuple(f(int(x) for x in c) for c in columns for f in (min, max))
            assert s.nbytes == int(s.length.sum())
        assert plan.nbytes == sum(int(s.length.sum()) for s in plan.sources)
        assert plan.num_descriptors == sum(s.length.size for s in plan.sources)
        assert plan.prefill_ranks == tuple(s.prefill_rank for s in plan.sources)


def test_fp8_kv_and_separate_k_v_planes_are_declarations_only() -> None:
    # Older vLLM splits a kernel block into a K plane and a V plane: declare it, plan it.
    def planes(rank: RankLayout) -> RankLayout:
        groups = []
        for group in rank.groups:
            if group.is_attention:
                kv = group.segment("kv")
                heads, kbs, two_d = kv.shape
                shape = (heads, kbs, two_d // 2)
                strides = contiguous_strides(shape, kv.itemsize)
                k = dataclasses.replace(kv, tensor="k", shape=shape, strides=strides)
                v = dataclasses.replace(k, tensor="v", offset=kv.nbytes // 2)
                group = dataclasses.replace(group, segments=(k, v))
            groups.append(group)
        return dataclasses.replace(rank, groups=tuple(groups))

    sc = build_scenario(hybrid(kv_dtype="fp8"), 4, 2, num_tokens=70)
    prefill = dataclasses.replace(sc.prefill, ranks=tuple(planes(r) for r in sc.prefill.ranks))
    decode = dataclasses.replace(sc.decode, ranks=tuple(planes(r) for r in sc.decode.ranks))
    check_plan_by_simulation(prefill, decode, sc.request)


def test_homogeneous_tp_coalesces_consecutive_pages() -> None:
    sc = build_scenario(hybrid(), 2, 2, num_tokens=2000)
    plan = PairPlanner(sc.prefill, sc.decode).plan_rank(0, sc.request)
    # Blocks are [mamba0 | attention pages... | mamba2]: per region, Mamba page 0 is one run
    # (conv and SSM adjacent, padding after), the attention pages and the Mamba page behind
    # them (contiguous on both sides) a second.
    assert plan.num_descriptors == 2 * 2
    assert plan.vllm_descriptors == 2 * 4 * 2 + 2 * len(sc.request.decode_block_ids[1])
    assert plan.nbytes < plan.naive_bytes


# ----------------------------------------------------------------------------- errors


def test_layouts_of_different_models_are_rejected() -> None:
    prefill = build_engine_layout(hybrid(), 1, 8)
    decode = build_engine_layout(dataclasses.replace(hybrid(GDN), name="other"), 1, 8)
    with pytest.raises(IncompatibleLayoutsError) as err:
        PairPlanner(prefill, decode)
    assert err.value.field == "model"


def test_one_model_with_other_state_names_the_difference_not_the_digest() -> None:
    """Same model name, other state (here another mixer): the error says what differs."""
    prefill = build_engine_layout(hybrid(), 1, 8)
    decode = build_engine_layout(hybrid(GDN), 1, 8)
    with pytest.raises(IncompatibleLayoutsError) as err:
        PairPlanner(prefill, decode)
    assert err.value.field.startswith("groups[0].segments[")


def test_a_layer_on_one_side_only_is_named() -> None:
    """A drafter's layer on decode only: named, though it also changes the region count."""
    spec = hybrid()
    groups = tuple(
        (kind, (*names, "mtp.a0")) if kind is GroupKind.ATTENTION else (kind, names)
        for kind, names in spec.groups
    )
    prefill = build_engine_layout(spec, 1, 8)
    decode = build_engine_layout(dataclasses.replace(spec, groups=groups), 1, 8)
    with pytest.raises(IncompatibleLayoutsError) as err:
        PairPlanner(prefill, decode)
    assert err.value.field == "groups[1].layers"
    assert "decode alone has 1 (mtp.a0)" in err.value.detail


def test_dtype_mismatch_names_the_segment() -> None:
    prefill = build_engine_layout(hybrid(), 1, 8)
    decode = build_engine_layout(dataclasses.replace(hybrid(), name="tiny"), 1, 8)
    decode = dataclasses.replace(decode, model=prefill.model)
    ssm_bf16 = dataclasses.replace(
        decode.groups[0].segment("ssm"),
        dtype="bfloat16",
        strides=contiguous_strides(decode.groups[0].segment("ssm").shape, 2),
    )
    group = dataclasses.replace(
        decode.groups[0], segments=(*decode.groups[0].segments[:-1], ssm_bf16)
    )
    rank = dataclasses.replace(decode.ranks[0], groups=(group, *decode.ranks[0].groups[1:]))
    with pytest.raises(IncompatibleLayoutsError) as err:
        PairPlanner(prefill, EngineLayout(decode.model, 1, (rank,)))
    assert err.value.field == "groups[0].segments['ssm'].dtype"


def test_tp_sizes_that_do_not_divide_are_rejected() -> None:
    model = ModelSpec(
        "t",
        ((GroupKind.MAMBA, ("m",)),),
        None,
        MambaParams("mamba1", 4, intermediate_size=12, state_size=2),
    )
    with pytest.raises(IncompatibleLayoutsError) as err:
        PairPlanner(build_engine_layout(model, 2, 4), build_engine_layout(model, 3, 4))
    assert err.value.field == "tp_size"


@pytest.mark.parametrize(
    "mutate,field",
    [
        (
            lambda r: dataclasses.replace(r, prefill_block_ids=r.prefill_block_ids[:2]),
            "prefill_block_ids",
        ),
        (
            lambda r: dataclasses.replace(r, decode_block_ids=((99,), *r.decode_block_ids[1:])),
            "decode_block_ids[0]",
        ),
        (
            lambda r: dataclasses.replace(
                r, decode_block_ids=(r.decode_block_ids[1][:1], *r.decode_block_ids[1:])
            ),
            "decode_block_ids",
        ),
        (
            lambda r: dataclasses.replace(
                r,
                prefill_block_ids=(
                    r.prefill_block_ids[0],
                    r.prefill_block_ids[1][:1],
                    r.prefill_block_ids[2],
                ),
            ),
            "prefill_block_ids[1]",
        ),
        (lambda r: dataclasses.replace(r, num_tokens=0), "num_tokens"),
    ],
)
def test_bad_requests_name_the_field(mutate, field: str) -> None:
    sc = build_scenario(hybrid(), 2, 2, num_tokens=200)
    with pytest.raises(RequestError) as err:
        PairPlanner(sc.prefill, sc.decode).plan_rank(0, mutate(sc.request))
    assert err.value.field == field


def test_decode_rank_out_of_range() -> None:
    sc = build_scenario(hybrid(), 2, 2, num_tokens=20)
    with pytest.raises(RequestError) as err:
        PairPlanner(sc.prefill, sc.decode).plan_rank(2, sc.request)
    assert err.value.field == "decode_rank"


def test_segment_outside_its_page_is_rejected() -> None:
    seg = Segment("ssm", 100, (4, 8), contiguous_strides((4, 8), 4), "float32", 0, 0, 4)
    with pytest.raises(LayoutError) as err:
        RankLayout(0, 1, 4, 128, (GroupLayout(GroupKind.MAMBA, ("m",), (seg,)),))
    assert err.value.field == "ranks[0].groups[0].segments['ssm']"


def test_block_size_too_small_for_mamba_state() -> None:
    with pytest.raises(LayoutError) as err:
        build_engine_layout(hybrid(), 1, 8, block_size=1)
    assert err.value.field == "block_size"


def test_unknown_dtype_is_rejected() -> None:
    with pytest.raises(LayoutError) as err:
        build_engine_layout(hybrid(kv_dtype="int3"), 1, 8)
    assert err.value.field == "attention.dtype"


# ----------------------------------------------------------------------------- MLA


def mla(dtype: str = "bfloat16") -> ModelSpec:
    """DeepSeek-style MLA: one 576-wide latent per token (kv_lora_rank 512 + rope 64)."""
    return ModelSpec(
        "tiny-mla",
        ((GroupKind.ATTENTION, ("a0", "a1", "a2")),),
        AttentionParams(1, 576, dtype, latent=True),
        None,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize(
    "p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4), (8, 2)]
)
def test_mla_latent_is_read_once_per_decode_rank_from_vllms_rank(
    p_tp: int, d_tp: int, dtype: str
) -> None:
    """Every rank holds the whole latent: each decode rank reads one copy, all of it from the
    prefill rank vLLM's connector picks (``d * P // D``); no other prefill rank is read."""
    sc = build_scenario(mla(dtype), p_tp, d_tp, num_tokens=100, block_size=16)
    check_plan_by_simulation(sc.prefill, sc.decode, sc.request)
    latent = sc.decode.groups[0].segment("latent")
    assert latent.shard_axis is None and latent.itemsize == (1 if dtype == "fp8" else 2)
    one_copy = 3 * 7 * 16 * 576 * latent.itemsize  # 3 layers, 7 pages of 16 tokens
    plan = PairPlanner(sc.prefill, sc.decode).plan(sc.request)
    for rank in plan.ranks:
        assert rank.prefill_ranks == (rank.decode_rank * p_tp // d_tp,)
        assert rank.nbytes == one_copy
    assert plan.nbytes == d_tp * one_copy
    read = {p for rank in plan.ranks for p in rank.prefill_ranks}
    assert read == {d * p_tp // d_tp for d in range(d_tp)}


def test_a_replicated_segment_declares_no_shard() -> None:
    with pytest.raises(LayoutError) as err:
        Segment("latent", 0, (1, 16, 8), contiguous_strides((1, 16, 8), 2), "bfloat16", None, 4)
    assert err.value.field == "segment 'latent'.shard_start"


def test_mla_layouts_keep_one_latent_head() -> None:
    with pytest.raises(LayoutError) as err:
        build_engine_layout(
            dataclasses.replace(mla(), attention=AttentionParams(2, 576, latent=True)), 1, 4
        )
    assert err.value.field == "attention.num_kv_heads"


def test_nbytes_is_what_its_templates_hold() -> None:
    """``PairPlanner.nbytes`` (what the broker's planner cache is bounded by) against the
    memory planning leaves allocated, its plans dropped: all of it but the table's keys."""
    sc = build_scenario(resolve_model("qwen3.5-27b"), 1, 8, 32768)
    PairPlanner(sc.prefill, sc.decode).plan(sc.request)  # numpy's first-call allocations
    planner = PairPlanner(sc.prefill, sc.decode)
    assert planner.nbytes < 1024
    gc.collect()
    tracemalloc.start()
    try:
        planner.plan(sc.request)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0.9 * held <= planner.nbytes <= held


# ------------------------------------------------------------- compressed (one state per r tokens)


def compressed_group(kernel_block_size: int, block_size: int, per: int = 4) -> GroupLayout:
    """A group as DeepSeek-V4 declares its compressed caches: per layer a latent of one state
    per ``per`` tokens, its indexer keys (33 opaque bytes per state) and a latent of one
    state per 16 tokens, all replicated over TP, each kernel block padded to 64 bytes."""
    kbs = kernel_block_size
    pieces = (("c4", per, 32, "bfloat16"), ("index", per, 33, "uint8"), ("c16", 16, 32, "bfloat16"))
    segments: list[Segment] = []
    offset = 0
    for name, tokens, width, dtype in pieces:
        shape = (kbs // tokens, width)
        item = 1 if dtype == "uint8" else 2
        segments.append(
            Segment(
                name,
                offset,
                shape,
                contiguous_strides(shape, item),
                dtype,
                token_axis=0,
                tokens_per_entry=tokens,
            )
        )
        offset = segments[-1].end
    block_bytes = -(-offset // 64) * 64
    return GroupLayout(
        GroupKind.ATTENTION, ("l0", "l1"), tuple(segments), block_size, kbs, block_bytes
    )


def compressed_engine(tp: int, block_size: int, kernel_block_size: int, per: int = 4):
    group = compressed_group(kernel_block_size, block_size, per)
    page = group.kernel_block_bytes * group.kernel_blocks_per_page
    return EngineLayout(
        "compressed", tp, tuple(RankLayout(r, 2, 24, page, (group,)) for r in range(tp))
    )


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize(
    "p_sizes,d_sizes", [((32, 32), (32, 32)), ((64, 32), (32, 16)), ((32, 16), (64, 64))]
)
@pytest.mark.parametrize("held_pages", [0, 1])
def test_compressed_states_move_whole_from_one_rank(
    p_tp: int, d_tp: int, p_sizes: tuple[int, int], d_sizes: tuple[int, int], held_pages: int
) -> None:
    """Segments of one entry per ``tokens_per_entry`` tokens move entry by entry between any
    block and kernel-block sizes, after a decode prefix hit too: every byte decode needs,
    none twice, all from vLLM's source rank."""
    prefill, decode = compressed_engine(p_tp, *p_sizes), compressed_engine(d_tp, *d_sizes)
    num_tokens = 200
    p_ids = tuple(range(1, 1 + -(-num_tokens // p_sizes[0])))
    d_count = -(-num_tokens // d_sizes[0]) - held_pages
    d_ids = tuple(range(23, 23 - d_count, -1))
    request = TransferRequest(num_tokens, (p_ids,), (d_ids,))
    check_plan_by_simulation(prefill, decode, request)
    for rank in PairPlanner(prefill, decode).plan(request).ranks:
        assert rank.prefill_ranks == (rank.decode_rank * p_tp // d_tp,)


def test_compressed_entries_must_fill_the_kernel_block() -> None:
    half = Segment("c4", 0, (4, 8), (16, 2), "bfloat16", token_axis=0, tokens_per_entry=4)
    group = GroupLayout(GroupKind.ATTENTION, ("l0",), (half,), 32, 32, 64)
    with pytest.raises(LayoutError) as err:
        RankLayout(0, 1, 4, 64, (group,))
    assert err.value.field == "ranks[0].groups[0].segments['c4'].token_axis"
    with pytest.raises(LayoutError) as err:
        Segment("ssm", 0, (4, 8), (16, 2), "bfloat16", tokens_per_entry=4)
    assert err.value.field == "segment 'ssm'.tokens_per_entry"


def test_compressed_entries_of_other_sizes_are_incompatible() -> None:
    with pytest.raises(IncompatibleLayoutsError) as err:
        PairPlanner(compressed_engine(1, 32, 32), compressed_engine(1, 32, 32, per=8))
    assert err.value.field.endswith("tokens_per_entry")
