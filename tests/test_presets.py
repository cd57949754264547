"""Presets and Hugging Face config parsing reproduce vLLM 0.33's layers, groups and shapes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from broker.errors import LayoutError
from broker.layout import GroupKind
from broker.models import AttentionParams, build_engine_layout, hma_block_size, mamba_state_bytes
from broker.presets import (
    PRESET_CONFIGS,
    model_from_hf_config,
    model_from_hf_file,
    preset_names,
    resolve_model,
    vllm_kv_cache_groups,
)
from harness.cases import model_from_case

#: Vector cases vLLM groups by layer kind (DeepSeek-V4's packed caches: test_presets_deepseek_v4).
CASES = [
    path
    for path in sorted((Path(__file__).parent / "data" / "testvectors" / "cases").glob("*.json"))
    if json.loads(path.read_text()).get("attention", {}).get("kind") != "deepseek_v4"
]


def load(case: Path) -> dict[str, Any]:
    return json.loads(case.read_text())


def case_layers(case: dict[str, Any]) -> list[tuple[str, GroupKind]]:
    return [(layer["name"], GroupKind(layer["type"])) for layer in case["layers"]]


def case_groups(case: dict[str, Any]) -> tuple[tuple[GroupKind, tuple[str, ...]], ...]:
    return tuple((GroupKind(g["type"]), tuple(g["layers"])) for g in case["groups"])


def case_windows(case: dict[str, Any]) -> dict[str, int]:
    """Each sliding-window layer's window in tokens."""
    return {
        name: g["sliding_window"]
        for g in case["groups"]
        if "sliding_window" in g
        for name in g["layers"]
    }


def layer_index(name: str) -> int:
    return int(name.split(".")[2])


def segment_shapes(model_name: str, tp: int) -> dict[str, tuple[int, ...]]:
    rank = build_engine_layout(resolve_model(model_name), tp, 1).ranks[0]
    mamba = next(g for g in rank.groups if not g.is_attention)
    return {s.tensor: s.shape for s in mamba.segments}


# --- grouping -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_grouping_reproduces_every_vector_case(path: Path) -> None:
    case = load(path)
    assert vllm_kv_cache_groups(case_layers(case), case_windows(case)) == case_groups(case)


def test_grouping_pads_the_last_groups_of_a_bucket() -> None:
    # Nemotron-3-Nano: 23 Mamba + 6 attention -> group size 6, 4 Mamba groups (6, 6, 6, 5).
    layers = [(f"m{i}", GroupKind.MAMBA) for i in range(23)] + [
        (f"a{i}", GroupKind.ATTENTION) for i in range(6)
    ]
    groups = vllm_kv_cache_groups(layers)
    assert [(k, len(names)) for k, names in groups] == [
        (GroupKind.MAMBA, 6),
        (GroupKind.MAMBA, 6),
        (GroupKind.MAMBA, 6),
        (GroupKind.MAMBA, 5),
        (GroupKind.ATTENTION, 6),
    ]
    assert groups[3][1] == ("m3", "m7", "m11", "m15", "m19")


def test_grouping_uses_the_largest_bucket_when_under_one_and_a_half_times_the_smallest() -> None:
    layers = [(f"a{i}", GroupKind.ATTENTION) for i in range(5)] + [
        (f"m{i}", GroupKind.MAMBA) for i in range(7)
    ]
    assert vllm_kv_cache_groups(layers) == (
        (GroupKind.ATTENTION, tuple(f"a{i}" for i in range(5))),
        (GroupKind.MAMBA, tuple(f"m{i}" for i in range(7))),
    )
    # 6 is 1.5x 4: not under, so the group size falls back to the smallest bucket.
    layers = [(f"a{i}", GroupKind.ATTENTION) for i in range(4)] + [
        (f"m{i}", GroupKind.MAMBA) for i in range(6)
    ]
    assert [len(names) for _, names in vllm_kv_cache_groups(layers)] == [4, 3, 3]


def test_grouping_orders_buckets_by_first_layer_and_rejects_no_layers() -> None:
    groups = vllm_kv_cache_groups([("a", GroupKind.ATTENTION), ("m", GroupKind.MAMBA)])
    assert [kind for kind, _ in groups] == [GroupKind.ATTENTION, GroupKind.MAMBA]
    with pytest.raises(LayoutError) as exc:
        vllm_kv_cache_groups([])
    assert exc.value.field == "layers"


# --- presets ---------------------------------------------------------------------------------

LAYER_MIX = {  # preset: (Mamba/GDN layers, attention layers), from the public configs
    "nemotron-h-8b": (24, 4),
    "nemotron-3-nano-30b-a3b": (23, 6),
    "nemotron-3-super-120b-a12b": (40, 8),
    "qwen3.5-0.8b": (18, 6),
    "qwen3.5-4b": (24, 8),
    "qwen3.5-27b": (48, 16),
    "jamba-1.5-mini": (28, 4),
    "deepseek-v2-lite": (0, 27),
    "kimi-linear-48b-a3b": (20, 7),
    # DeepSeek-V4: cache layers (43 sliding-window, 41 compressed latents, 21 indexer key
    # caches, 62 compressor states; tests/test_presets_deepseek_v4.py)
    "deepseek-v4-flash": (0, 167),
}
HYBRIDS = sorted(name for name, (mamba, _) in LAYER_MIX.items() if mamba)


#: Attention-only presets: their sliding-window and full-attention layers.
ATTENTION_MIX = {"gpt-oss-20b": (12, 12)}


def test_preset_names_are_the_documented_ones() -> None:
    assert set(preset_names()) == set(LAYER_MIX) | set(ATTENTION_MIX)


def test_gpt_oss_alternates_sliding_window_and_full_attention_groups() -> None:
    model = resolve_model("gpt-oss-20b")
    assert model.mamba is None and model.attention == AttentionParams(8, 64, "bfloat16")
    assert [(kind, len(layers)) for kind, layers in model.groups] == [
        (GroupKind.ATTENTION, n) for n in ATTENTION_MIX["gpt-oss-20b"]
    ]
    # vLLM gives the even layers the window; its buckets are ordered by first layer.
    assert model.groups[0][1][:2] == ("model.layers.0.attn.attn", "model.layers.2.attn.attn")
    assert model.groups[1][1][:2] == ("model.layers.1.attn.attn", "model.layers.3.attn.attn")
    assert model.sliding_windows == (128, 0)
    layout = build_engine_layout(model, 2, 4, 16)
    assert [g.sliding_window for g in layout.groups] == [128, 0]
    with pytest.raises(LayoutError) as exc:
        model_from_hf_config({**PRESET_CONFIGS["gpt-oss-20b"], "sliding_window": 0}, "x")
    assert exc.value.field == "sliding_window"


def test_a_nemotron_h_sliding_window_windows_every_attention_layer() -> None:
    """vLLM's Nemotron-H gives its attention layers the config's ``sliding_window`` (none
    when null or 0, as vLLM reads a window of 0); the Mamba groups stay as they are."""
    nemotron = PRESET_CONFIGS["nemotron-h-8b"]
    plain = resolve_model("nemotron-h-8b")
    for off in (None, 0):
        assert model_from_hf_config({**nemotron, "sliding_window": off}, "nemotron-h-8b") == plain
    model = model_from_hf_config({**nemotron, "sliding_window": 1000}, "nemotron-h-8b")
    assert model.groups == plain.groups and model.fingerprint != plain.fingerprint
    assert model.sliding_windows == tuple(
        1000 if kind is GroupKind.ATTENTION else 0 for kind, _ in model.groups
    )
    with pytest.raises(LayoutError) as exc:
        model_from_hf_config({**nemotron, "sliding_window": -1}, "x")
    assert exc.value.field == "sliding_window"


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_hybrid_preset_builds_at_common_tp_sizes(name: str, tp: int) -> None:
    model = resolve_model(name)
    counts = {kind: sum(len(names) for k, names in model.groups if k is kind) for kind in GroupKind}
    assert (counts[GroupKind.MAMBA], counts[GroupKind.ATTENTION]) == LAYER_MIX[name]
    engine = build_engine_layout(model, tp, 2)
    assert engine.tp_size == tp and len(engine.ranks) == tp
    block_size = hma_block_size(model, tp)
    assert block_size % 16 == 0
    assert engine.ranks[0].page_bytes >= mamba_state_bytes(model.mamba, tp)
    # One block fewer (16 tokens) would no longer hold the Mamba state.
    with pytest.raises(LayoutError):
        build_engine_layout(model, tp, 2, block_size - 16)


def test_nemotron_h_8b_shapes_match_design() -> None:
    assert segment_shapes("nemotron-h-8b", 1) == {
        "conv.x": (8192, 3),
        "conv.B": (1024, 3),
        "conv.C": (1024, 3),
        "ssm": (128, 64, 128),
    }
    assert segment_shapes("nemotron-h-8b", 4) == {
        "conv.x": (2048, 3),
        "conv.B": (256, 3),
        "conv.C": (256, 3),
        "ssm": (32, 64, 128),
    }


def test_qwen35_27b_shapes_match_design() -> None:
    assert segment_shapes("qwen3.5-27b", 1) == {
        "conv.Q": (2048, 3),
        "conv.K": (2048, 3),
        "conv.V": (6144, 3),
        "ssm": (48, 128, 128),
    }
    assert segment_shapes("qwen3.5-27b", 8) == {
        "conv.Q": (256, 3),
        "conv.K": (256, 3),
        "conv.V": (768, 3),
        "ssm": (6, 128, 128),
    }


def test_preset_dtypes_follow_vllm_defaults() -> None:
    for name in HYBRIDS:
        model = resolve_model(name)
        assert model.attention.dtype == model.mamba.conv_dtype == "bfloat16"
        # Nemotron-H: mamba_ssm_cache_dtype (float32 by default); Qwen3.5: mamba_ssm_dtype;
        # Jamba: the model dtype.
        jamba = name.startswith("jamba")
        assert model.mamba.ssm_dtype == ("bfloat16" if jamba else "float32")


def test_preset_layer_names_are_vllms() -> None:
    nemotron = resolve_model("nemotron-h-8b")
    assert nemotron.groups[0] == (
        GroupKind.MAMBA,
        (
            "model.layers.0.mixer",
            "model.layers.13.mixer",
            "model.layers.26.mixer",
            "model.layers.39.mixer",
        ),
    )
    assert nemotron.groups[-1] == (
        GroupKind.ATTENTION,
        (
            "model.layers.7.mixer.attn",
            "model.layers.18.mixer.attn",
            "model.layers.29.mixer.attn",
            "model.layers.40.mixer.attn",
        ),
    )
    qwen = resolve_model("qwen3.5-0.8b")  # multimodal checkpoint: the text model is nested
    assert qwen.groups[0][1][:2] == (
        "language_model.model.layers.0.linear_attn",
        "language_model.model.layers.4.linear_attn",
    )
    assert qwen.groups[-1][1][0] == "language_model.model.layers.3.self_attn.attn"


def test_unknown_preset_names_the_field_and_lists_presets() -> None:
    with pytest.raises(LayoutError) as exc:
        resolve_model("nemotron-h-9b")
    assert exc.value.field == "model"
    assert all(name in str(exc.value) for name in preset_names())


# --- HMA block size --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case_name,tp,user,expected",
    [
        ("01_nemotron_h_8b_mamba2_tp1_tp1", 1, 0, 1040),
        ("02_nemotron_h_8b_mamba2_tp1_tp2", 2, 0, 1040),
        ("04_nemotron_h_8b_mamba2_tp4_tp2", 4, 0, 1040),
        ("10_jamba_like_mamba1_tp1_tp2", 1, 0, 144),
        ("10_jamba_like_mamba1_tp1_tp2", 2, 0, 144),
        ("11_mamba2_gqa2_tp2_tp4_replicated_heads", 2, 0, 4160),
        ("11_mamba2_gqa2_tp2_tp4_replicated_heads", 4, 4160, 4160),  # decode ran --block-size 4160
        ("09_tiny_mamba2_kernel_ratio4_tp1_tp2", 1, 64, 64),
        ("09_tiny_mamba2_kernel_ratio4_tp1_tp2", 2, 64, 64),
        ("06a_qwen35_0p8b_gdn_tp1_tp4", 1, 288, 288),
        ("06a_qwen35_0p8b_gdn_tp1_tp4", 4, 288, 288),
    ],
)
def test_hma_block_size_matches_the_vectors(
    case_name: str, tp: int, user: int, expected: int
) -> None:
    model = model_from_case(load(next(p for p in CASES if p.stem == case_name)))
    assert hma_block_size(model, tp, user) == expected


@pytest.mark.parametrize(
    "user,expected", [(0, 1040), (16, 1040), (64, 1088), (100, 1104), (1040, 1040), (2048, 2048)]
)
def test_user_block_size_is_a_step_as_in_vllm(user: int, expected: int) -> None:
    # Platform._align_hybrid_block_size: step max(16, user), then round up to 16.
    assert hma_block_size(resolve_model("nemotron-h-8b"), 1, user) == expected


# --- Hugging Face config parsing -------------------------------------------------------------


def pattern_of(case: dict[str, Any]) -> str:
    kinds = {layer_index(name): kind for name, kind in case_layers(case)}
    code = {GroupKind.MAMBA: "M", GroupKind.ATTENTION: "*"}
    return "".join(code[kinds[i]] if i in kinds else "-" for i in range(max(kinds) + 1))


def test_nemotron_h_config_reproduces_a_vector_case() -> None:
    case = load(CASES[0])
    config = {**PRESET_CONFIGS["nemotron-h-8b"], "hybrid_override_pattern": pattern_of(case)}
    model = model_from_hf_config(config, "nemotron-h-like")
    expected = model_from_case(case)
    assert model.groups == case_groups(case)
    assert (model.attention, model.mamba) == (expected.attention, expected.mamba)


def test_nemotron_h_layers_block_type_spelling() -> None:
    config = copy.deepcopy(PRESET_CONFIGS["nemotron-h-8b"])
    pattern = config.pop("hybrid_override_pattern")
    names = {"M": "mamba", "*": "attention", "-": "mlp"}
    config["layers_block_type"] = [names[c] for c in pattern]
    config["mamba_n_groups"] = config.pop("n_groups")
    config["mamba_d_conv"] = config.pop("conv_kernel")
    assert model_from_hf_config(config, "nemotron-h-8b") == resolve_model("nemotron-h-8b")


def test_qwen35_text_config_reproduces_a_vector_case() -> None:
    case = load(next(p for p in CASES if p.stem.startswith("06a")))
    text = {**PRESET_CONFIGS["qwen3.5-0.8b"]["text_config"], "mamba_ssm_dtype": "bfloat16"}
    model = model_from_hf_config({"architectures": ["Qwen3_5ForCausalLM"], **text}, "qwen")
    expected = model_from_case(case)
    assert model.groups == case_groups(case)
    assert (model.attention, model.mamba) == (expected.attention, expected.mamba)


def test_qwen_layer_types_win_over_the_interval() -> None:
    text = {
        **PRESET_CONFIGS["qwen3.5-0.8b"]["text_config"],
        "num_hidden_layers": 4,
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
    }
    model = model_from_hf_config({"model_type": "qwen3_5", "text_config": text}, "q")
    assert model.groups == (
        (
            GroupKind.ATTENTION,
            (
                "language_model.model.layers.0.self_attn.attn",
                "language_model.model.layers.3.self_attn.attn",
            ),
        ),
        (
            GroupKind.MAMBA,
            (
                "language_model.model.layers.1.linear_attn",
                "language_model.model.layers.2.linear_attn",
            ),
        ),
    )


def test_ssm_dtype_rules_per_family() -> None:
    text = PRESET_CONFIGS["qwen3.5-0.8b"]["text_config"]
    qwen_next = {**text, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}
    assert model_from_hf_config(qwen_next, "n").mamba.ssm_dtype == "bfloat16"  # not read
    no_hint = {k: v for k, v in text.items() if k != "mamba_ssm_dtype"}
    assert (
        model_from_hf_config({"model_type": "qwen3_5", "text_config": no_hint}, "q").mamba.ssm_dtype
        == "bfloat16"
    )
    nemotron = {
        k: v
        for k, v in PRESET_CONFIGS["nemotron-3-nano-30b-a3b"].items()
        if k != "mamba_ssm_cache_dtype"
    }
    assert model_from_hf_config(nemotron, "n").mamba.ssm_dtype == "float32"
    fp32_checkpoint = {**nemotron, "torch_dtype": "float32", "mamba_ssm_cache_dtype": "bfloat16"}
    model = model_from_hf_config(fp32_checkpoint, "n")
    assert (model.attention.dtype, model.mamba.conv_dtype, model.mamba.ssm_dtype) == (
        "bfloat16",
        "bfloat16",
        "bfloat16",
    )


JAMBA = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "num_hidden_layers": 16,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_expand": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
}


def test_jamba_config_matches_the_jamba_like_vector() -> None:
    case = load(next(p for p in CASES if p.stem.startswith("10")))
    model = model_from_hf_config(JAMBA, "jamba")
    expected = model_from_case(case)
    # vLLM registers Jamba attention as model.layers.{i}.attn; compare the layer indices.
    as_indices = [(kind, [layer_index(n) for n in names]) for kind, names in model.groups]
    assert as_indices == [
        (kind, [layer_index(n) for n in names]) for kind, names in case_groups(case)
    ]
    assert model.groups[-1][1] == ("model.layers.4.attn", "model.layers.12.attn")
    assert model.attention == expected.attention
    assert model.mamba.intermediate_size == 8192 and model.mamba.state_size == 16
    assert model.mamba.ssm_dtype == "bfloat16"  # vLLM: model dtype unless overridden


def test_config_file_and_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "Nemotron-H-8B-Base-8K"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(PRESET_CONFIGS["nemotron-h-8b"]))
    preset = resolve_model("nemotron-h-8b")
    for source in (model_dir, model_dir / "config.json"):
        model = resolve_model(str(source))
        assert model.name == "Nemotron-H-8B-Base-8K"
        assert (model.groups, model.attention, model.mamba) == (
            preset.groups,
            preset.attention,
            preset.mamba,
        )
    assert model_from_hf_file(model_dir) == model


def test_unreadable_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(LayoutError) as exc:
        resolve_model(str(bad))
    assert exc.value.field == "hf_config"
    bad.write_text("[1, 2]")
    with pytest.raises(LayoutError) as exc:
        model_from_hf_file(tmp_path)
    assert exc.value.field == "hf_config"


def mutated(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    config = copy.deepcopy(base)
    *parents, key = path.split(".")
    target = config
    for parent in parents:
        target = target[parent]
    if value is None:
        del target[key]
    else:
        target[key] = value
    return config


NEMOTRON, QWEN = PRESET_CONFIGS["nemotron-h-8b"], PRESET_CONFIGS["qwen3.5-27b"]
DEEPSEEK, KIMI = PRESET_CONFIGS["deepseek-v2-lite"], PRESET_CONFIGS["kimi-linear-48b-a3b"]
#: meta-llama/Meta-Llama-3-8B-Instruct config.json (the fields read here).
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
}


def test_llama_is_one_attention_group_of_every_layer() -> None:
    model = model_from_hf_config(LLAMA, "llama-3-8b")
    assert model.groups == (
        (GroupKind.ATTENTION, tuple(f"model.layers.{i}.self_attn.attn" for i in range(32))),
    )
    assert model.attention == AttentionParams(8, 128, "bfloat16")
    assert model.mamba is None
    rank = build_engine_layout(model, 4, 1).ranks[0]
    # At TP4 each rank holds 2 KV heads of 16-token blocks, K and V of 128 each.
    assert [(s.tensor, s.shape) for g in rank.groups for s in g.segments] == [("kv", (2, 16, 256))]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_deepseek_v2_lite_caches_one_latent_per_token_on_every_rank(tp: int) -> None:
    """MLA: 512 compressed KV + 64 rotary key elements per token, whole on every rank."""
    model = resolve_model("deepseek-v2-lite")
    assert model.groups == (
        (GroupKind.ATTENTION, tuple(f"model.layers.{i}.self_attn.attn" for i in range(27))),
    )
    assert model.attention == AttentionParams(1, 576, "bfloat16", latent=True)
    assert model.mamba is None
    engine = build_engine_layout(model, tp, 2)
    for rank in engine.ranks:
        (latent,) = rank.groups[0].segments
        assert (latent.tensor, latent.shape, latent.shard_axis) == ("latent", (1, 16, 576), None)
        assert rank.page_bytes == 16 * 576 * 2


def test_deepseek_v3_reads_the_same_fields() -> None:
    config = {**PRESET_CONFIGS["deepseek-v2-lite"], "model_type": "deepseek_v3"}
    config |= {"num_hidden_layers": 61, "q_lora_rank": 1536}
    model = model_from_hf_config(config, "deepseek-v3")
    assert len(model.groups[0][1]) == 61
    assert model.attention == AttentionParams(1, 576, "bfloat16", latent=True)


@pytest.mark.parametrize("tp", [1, 4])
def test_kimi_linear_declares_kda_as_gdn_state_beside_mla(tp: int) -> None:
    """Kimi-Linear: the layers ``kda_layers`` numbers from 1 keep GDN's state with 32 K and V
    heads of 128 (Q|K|V conv channels and the recurrent state sharded over TP, the state in
    float32); the others cache MLA's 512 + 64 latent, whole on every rank."""
    model = resolve_model("kimi-linear-48b-a3b")
    layers = {
        kind: {n for k, names in model.groups if k is kind for n in names} for kind in GroupKind
    }
    full = (4, 8, 12, 16, 20, 24, 27)
    assert layers[GroupKind.ATTENTION] == {f"model.layers.{n - 1}.self_attn" for n in full}
    assert layers[GroupKind.MAMBA] == {
        f"model.layers.{i}.self_attn" for i in range(27) if i + 1 not in full
    }
    assert model.attention == AttentionParams(1, 576, "bfloat16", latent=True)
    assert segment_shapes("kimi-linear-48b-a3b", tp) == {
        "conv.Q": (4096 // tp, 3),
        "conv.K": (4096 // tp, 3),
        "conv.V": (4096 // tp, 3),
        "ssm": (32 // tp, 128, 128),
    }
    assert model.mamba is not None and model.mamba.ssm_dtype == "float32"


@pytest.mark.parametrize(
    "base,path,value,field",
    [
        (NEMOTRON, "model_type", "gpt2", "model_type"),
        (NEMOTRON, "model_type", None, "model_type"),
        (NEMOTRON, "mamba_num_heads", None, "mamba_num_heads"),
        (NEMOTRON, "n_groups", 0, "n_groups"),
        (NEMOTRON, "ssm_state_size", "128", "ssm_state_size"),
        (NEMOTRON, "hybrid_override_pattern", "MM*X", "hybrid_override_pattern[3]"),
        (NEMOTRON, "hybrid_override_pattern", None, "hybrid_override_pattern"),
        (NEMOTRON, "mamba_ssm_cache_dtype", "float64", "mamba_ssm_cache_dtype"),
        (NEMOTRON, "torch_dtype", 16, "torch_dtype"),
        (NEMOTRON, "num_key_value_heads", -2, "num_key_value_heads"),
        (QWEN, "text_config.linear_num_key_heads", None, "text_config.linear_num_key_heads"),
        (QWEN, "text_config.layer_types", ["sliding_attention"] * 64, "text_config.layer_types[0]"),
        (QWEN, "text_config.layer_types", ["full_attention"], "text_config.layer_types"),
        (QWEN, "text_config.full_attention_interval", 0, "text_config.full_attention_interval"),
        (QWEN, "text_config.mamba_ssm_dtype", "fp64", "text_config.mamba_ssm_dtype"),
        (JAMBA, "attn_layer_offset", 8, "attn_layer_offset"),
        (JAMBA, "num_attention_heads", 30, "hidden_size"),
        (LLAMA, "num_hidden_layers", 0, "num_hidden_layers"),
        (LLAMA, "num_key_value_heads", None, "num_key_value_heads"),
        (DEEPSEEK, "kv_lora_rank", None, "kv_lora_rank"),
        (DEEPSEEK, "qk_rope_head_dim", 0, "qk_rope_head_dim"),
        (DEEPSEEK, "num_hidden_layers", "27", "num_hidden_layers"),
        (KIMI, "linear_attn_config", [], "linear_attn_config"),
        (KIMI, "linear_attn_config.kda_layers", [0, 1], "linear_attn_config.kda_layers"),
        (KIMI, "linear_attn_config.full_attn_layers", None, "linear_attn_config.full_attn_layers"),
        (KIMI, "linear_attn_config.num_heads", 0, "linear_attn_config.num_heads"),
        (
            KIMI,
            "linear_attn_config.short_conv_kernel_size",
            None,
            "linear_attn_config.short_conv_kernel_size",
        ),
        (KIMI, "kv_lora_rank", None, "kv_lora_rank"),
    ],
)
def test_bad_configs_name_the_field(
    base: dict[str, Any], path: str, value: Any, field: str
) -> None:
    with pytest.raises(LayoutError) as exc:
        model_from_hf_config(mutated(base, path, value), "bad")
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field}: ")
