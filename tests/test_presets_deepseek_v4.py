"""DeepSeek-V4's ``config.json`` parsing and block-row packing (:mod:`broker.row_models`),
without vLLM; ``tests/test_vllm_layout.py`` checks the same layouts against vLLM's objects."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from broker.errors import LayoutError
from broker.layout import GroupKind
from broker.models import build_engine_layout, hma_block_size, with_kv_dtype
from broker.presets import PRESET_CONFIGS, model_from_hf_config, resolve_model
from broker.row_models import RowCache
from harness.cases import load_case

FLASH = PRESET_CONFIGS["deepseek-v4-flash"]


def caches_of(layer: int, model_name: str = "deepseek-v4-flash") -> list[tuple[Any, ...]]:
    """Layer ``layer``'s caches: name, block size (0: the engine's), tokens per entry, width,
    dtype and sliding window."""
    prefix = f"model.layers.{layer}.attn"
    return [
        (c.name, c.block_size, c.tokens_per_entry, c.width, c.dtype, c.sliding_window)
        for c in resolve_model(model_name).row_caches
        if c.name == prefix or c.name.startswith(prefix + ".")
    ]


def test_flash_declares_each_layers_caches() -> None:
    """A sliding-window layer, a ratio-4 layer (latent, compressor state doubled for its
    overlapping windows, indexer keys of 128 fp8 values and a float32 scale, their
    compressor state) and a ratio-128 layer, in the order vLLM registers them."""
    swa = ("model.layers.{}.attn.swa_cache", 64, 1, 512, "bfloat16", 128)
    assert caches_of(0) == [(swa[0].format(0), *swa[1:])]
    assert caches_of(2) == [
        (swa[0].format(2), *swa[1:]),
        ("model.layers.2.attn", 0, 4, 512, "bfloat16", 0),
        ("model.layers.2.attn.compressor.state_cache", 4, 1, 2048, "float32", 8),
        ("model.layers.2.attn.indexer.k_cache", 0, 4, 132, "uint8", 0),
        ("model.layers.2.attn.indexer.compressor.state_cache", 4, 1, 512, "float32", 8),
    ]
    assert caches_of(3) == [
        (swa[0].format(3), *swa[1:]),
        ("model.layers.3.attn", 0, 128, 512, "bfloat16", 0),
        ("model.layers.3.attn.compressor.state_cache", 8, 1, 1024, "float32", 128),
    ]
    assert caches_of(42)[1][:3] == ("model.layers.42.attn", 0, 4)  # the MTP layer is not


@pytest.mark.parametrize(("kv_dtype", "row"), [(None, 1_600_000), ("fp8", 891_392)])
@pytest.mark.parametrize("tp", [1, 4])
def test_flash_packs_five_groups_in_rows_of_the_widest(
    kv_dtype: str | None, row: int, tp: int
) -> None:
    """vLLM's groups: the sliding-window caches split in two (22 repeats a group pads
    least), the compressed latents and indexer keys whole, one group per compressor state
    size; rows as wide as the compressed group's pages. Every rank holds the same whole
    pages, each layer's page its own segment, alignment padding in none."""
    model = with_kv_dtype(resolve_model("deepseek-v4-flash"), kv_dtype)
    assert [(kind, len(names)) for kind, names in model.groups] == [
        (GroupKind.ATTENTION, n) for n in (22, 21, 62, 42, 20)
    ]
    assert model.sliding_windows == (128, 128, 0, 8, 128)
    assert model.groups[0][1][:2] == (
        "model.layers.0.attn.swa_cache",
        "model.layers.2.attn.swa_cache",
    )
    assert hma_block_size(model, tp) == 256
    engine = build_engine_layout(model, tp, 3)
    assert {rank.groups for rank in engine.ranks} == {engine.ranks[0].groups}
    rank = engine.ranks[0]
    assert (rank.num_regions, rank.page_bytes) == (1, row)
    assert [(g.block_size, g.kernel_block_bytes, g.sliding_window) for g in rank.groups] == [
        (64, row, 128),
        (64, row, 128),
        (256, row, 0),
        (4, row, 8),
        (8, row, 128),
    ]
    compressed = rank.groups[2]
    assert all(s.shard_axis is None and s.token_axis == 0 for s in compressed.segments)
    keys = [s for s in compressed.segments if s.tensor.endswith("indexer.k_cache")]
    # 64 entries of 132 bytes (8448), one after another at the 512-byte aligned 8704.
    assert [(s.shape, s.nbytes) for s in keys[:2]] == [((64, 132), 8448)] * 2
    assert keys[1].offset - keys[0].offset == 8704
    latent = compressed.segment("model.layers.2.attn")
    assert (latent.offset, latent.shape, latent.tokens_per_entry) == (0, (64, 512), 4)
    assert latent.dtype == ("float8_e4m3fn" if kv_dtype else "bfloat16")
    assert compressed.segment("model.layers.3.attn").tokens_per_entry == 128


def test_layer_types_spell_the_same_model_as_compress_ratios() -> None:
    types = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    types[128] = "heavily_compressed_attention"
    config = {k: v for k, v in FLASH.items() if k != "compress_ratios"}
    config["layer_types"] = [types[r] for r in FLASH["compress_ratios"][:43]]
    by_types = model_from_hf_config(config, "deepseek-v4-flash")
    assert by_types == resolve_model("deepseek-v4-flash")
    rates = {"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}
    with pytest.raises(LayoutError) as exc:  # vLLM's compressor knows ratios 4 and 128
        model_from_hf_config({**config, "compress_rates": rates}, "x")
    assert exc.value.field == "layer_types[2]"


def test_the_engine_block_size_sizes_the_compressed_caches() -> None:
    model = resolve_model("deepseek-v4-flash")
    rank = build_engine_layout(model, 1, 2, 512).ranks[0]
    assert rank.groups[2].segment("model.layers.2.attn").shape == (128, 512)
    assert [g.block_size for g in rank.groups] == [64, 64, 512, 4, 8]
    with pytest.raises(LayoutError) as exc:  # no whole entry of 128 tokens
        build_engine_layout(model, 1, 2, 64)
    assert exc.value.field == "block_size"
    with pytest.raises(LayoutError) as exc:
        build_engine_layout(model, 1, 2, 256, 64)
    assert exc.value.field == "kernel_block_size"


def test_fp8_formats_store_the_latents_in_e4m3_and_nvfp4_is_refused() -> None:
    """Any fp8 format but the packed one stores the sliding-window and compressed latents as
    per-tensor e4m3, as vLLM's plain-row cache does; indexer keys stay bytes, compressor
    states float32. The packed NVFP4 format is refused."""
    model = with_kv_dtype(resolve_model("deepseek-v4-flash"), "fp8_e5m2")
    assert {(c.latent, c.dtype) for c in model.row_caches} == {
        (True, "float8_e4m3fn"),
        (False, "uint8"),
        (False, "float32"),
    }
    with pytest.raises(LayoutError) as exc:
        with_kv_dtype(model, "nvfp4_ds_mla")
    assert exc.value.field == "kv_dtype" and "nvfp4_ds_mla" in exc.value.detail


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_fp8_ds_mla_latent_pages_are_one_entry_of_the_block(tp: int) -> None:
    """Under fp8_ds_mla each latent page holds 584 bytes per entry (values, then the block's
    scales), declared as one entry of the whole block; every page is padded to 576 bytes.
    The groups are the plain rows' ones."""
    model = with_kv_dtype(resolve_model("deepseek-v4-flash"), "fp8_ds_mla")
    assert model.groups == resolve_model("deepseek-v4-flash").groups
    engine = build_engine_layout(model, tp, 3)
    assert {rank.groups for rank in engine.ranks} == {engine.ranks[0].groups}
    rank = engine.ranks[-1]
    # The compressed group: 21 ratio-4 latents (64 x 584 = 37,376 bytes, padded to 37,440),
    # 21 indexer keys (64 x 132 = 8,448, padded to 8,640), 20 ratio-128 latents (2 x 584 =
    # 1,168, padded to 1,728).
    assert rank.page_bytes == 21 * 37_440 + 21 * 8_640 + 20 * 1_728 == 1_002_240
    compressed = rank.groups[2]
    latent = compressed.segment("model.layers.2.attn")
    assert (latent.offset, latent.shape, latent.strides) == (0, (1, 37_376), (37_376, 1))
    assert (latent.dtype, latent.token_axis, latent.tokens_per_entry) == ("uint8", 0, 256)
    assert compressed.segment("model.layers.3.attn").shape == (1, 1_168)
    keys = compressed.segment("model.layers.2.attn.indexer.k_cache")
    assert (keys.offset, keys.shape, keys.tokens_per_entry) == (21 * 37_440, (64, 132), 4)
    swa = rank.groups[0].segment("model.layers.2.attn.swa_cache")
    assert (swa.offset, swa.shape, swa.tokens_per_entry) == (37_440, (1, 37_376), 64)
    states = rank.groups[3].segments  # 4 x 2048 float32 = 32,768, padded to 32,832
    assert sorted(s.offset for s in states)[:2] == [0, 32_832]
    assert all(s.shard_axis is None for g in rank.groups for s in g.segments)


def test_a_page_is_padded_to_its_alignment() -> None:
    cache = RowCache("k", 256, 4, 132, "uint8")
    assert (cache.entries, cache.content_bytes, cache.page_bytes) == (64, 8448, 8704)


def mutated(path: str, value: Any) -> dict[str, Any]:
    config = copy.deepcopy(FLASH)
    if value is None:
        del config[path]
    else:
        config[path] = value
    return config


@pytest.mark.parametrize(
    "path,value,field",
    [
        ("compress_ratios", [0, 4], "compress_ratios"),
        ("compress_ratios", [0, 0, 2] + [4] * 41, "compress_ratios[2]"),
        ("compress_ratios", [0, 0, True] + [4] * 41, "compress_ratios[2]"),
        ("compress_ratios", None, "layer_types"),
        ("head_dim", None, "head_dim"),
        ("index_head_dim", 0, "index_head_dim"),
        ("sliding_window", None, "sliding_window"),
        ("num_hidden_layers", "43", "num_hidden_layers"),
    ],
)
def test_bad_configs_name_the_field(path: str, value: Any, field: str) -> None:
    with pytest.raises(LayoutError) as exc:
        model_from_hf_config(mutated(path, value), "bad")
    assert exc.value.field == field


def test_caches_of_one_page_size_are_not_packed_in_rows() -> None:
    """Sliding-window layers alone have pages of one size, which vLLM does not pack."""
    with pytest.raises(LayoutError) as exc:
        model_from_hf_config(mutated("compress_ratios", [0] * 43), "x")
    assert exc.value.field == "layers"


def test_bad_layer_types_name_the_entry() -> None:
    config = {**mutated("compress_ratios", None), "num_hidden_layers": 2}
    with pytest.raises(LayoutError) as exc:
        model_from_hf_config({**config, "layer_types": ["sliding_attention", "full"]}, "x")
    assert exc.value.field == "layer_types[1]"
    with pytest.raises(LayoutError) as exc:
        model_from_hf_config(
            {**config, "layer_types": ["sliding_attention"] * 2, "compress_rates": [4]}, "x"
        )
    assert exc.value.field == "compress_rates"


VECTORS = Path(__file__).parent / "data" / "testvectors" / "cases"
DSV4_CASES = sorted(VECTORS.glob("*deepseek_v4*.json"))


@pytest.mark.parametrize("path", DSV4_CASES, ids=lambda p: p.stem)
def test_vector_cases_list_vllms_groups(path: Path) -> None:
    """A DeepSeek-V4 case's groups are those vLLM forms of its layers' caches."""
    case = json.loads(path.read_text())
    model = load_case(case).model
    assert [c.name for c in model.row_caches] == [layer["name"] for layer in case["layers"]]
    assert [(g["layers"], g.get("sliding_window", 0)) for g in case["groups"]] == [
        (list(names), window) for (_, names), window in zip(model.groups, model.sliding_windows)
    ]


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda c: c["groups"].reverse(), "groups"),
        (lambda c: c["attention"].update(compress_ratios=[0, 2]), "attention.compress_ratios[1]"),
        (lambda c: c["attention"].update(compress_ratios=4), "attention.compress_ratios"),
        (lambda c: c["attention"].pop("head_dim"), "attention.head_dim"),
        (lambda c: c["attention"].update(dtype="nvfp4_ds_mla"), "attention.dtype"),
    ],
)
def test_bad_cases_name_the_field(change: Any, field: str) -> None:
    case = json.loads(DSV4_CASES[0].read_text())
    change(case)
    with pytest.raises(LayoutError) as exc:
        load_case(case)
    assert exc.value.field == field
