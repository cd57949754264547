"""The reference-plan generator (vLLM 0.33's own NIXL connector, its descriptors recorded)
reproduces the shipped vectors: Mamba2 at homogeneous and heterogeneous TP, MLA,
sliding-window attention, Kimi-Linear (KDA beside MLA) and DeepSeek-V4 (block rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# harness.vllm first: it configures vLLM for CPU before vLLM is imported.
from harness.vllm.reference_vectors import hf_config, reference_plan

# isort: split

from clients.vllm.scheduler import _clip_group
from harness.cases import merge_runs

VECTORS = Path(__file__).parent / "data" / "testvectors"


@pytest.mark.parametrize(
    "name",
    [
        "01_nemotron_h_8b_mamba2_tp1_tp1",
        "04_nemotron_h_8b_mamba2_tp4_tp2",
        "11_mamba2_gqa2_tp2_tp4_replicated_heads",
        "14_deepseek_v2_lite_mla_tp4_tp2_prefix_hit",
        "15_gpt_oss_sliding_window_tp1_tp2",
        "16_gpt_oss_sliding_window_null_padded_tp2_tp1",
        "17_kimi_linear_kda_mla_tp2_tp1",
        "19_deepseek_v4_swa_csa_hca_tp1_tp2",
        "20_deepseek_v4_swa_csa_hca_tp2_tp1",
        "21_deepseek_v4_fp8_tp1_tp2",
        "22_deepseek_v4_fp8_ds_mla_tp1_tp2",
        "23_deepseek_v4_fp8_ds_mla_tp2_tp1",
    ],
)
def test_generator_reproduces_shipped_vector(name: str) -> None:
    case = json.loads((VECTORS / "cases" / f"{name}.json").read_text())
    expected = json.loads((VECTORS / "expected" / f"{name}.json").read_text())
    got = reference_plan(case)
    assert got["runs"] == [list(run) for run in merge_runs(expected["runs"])]
    assert got["total_bytes"] == expected["total_bytes"]
    assert got["vllm_descriptors"] == expected["vllm_descriptors"]
    assert got["vllm_bytes_incl_unused"] == expected["vllm_bytes_incl_unused"]


def test_mla_latent_is_read_once_from_vllms_source_rank() -> None:
    """TP4 -> TP2: decode rank d reads every latent byte from prefill rank 2d only."""
    expected = json.loads(
        (VECTORS / "expected" / "14_deepseek_v2_lite_mla_tp4_tp2_prefix_hit.json").read_text()
    )
    assert {(run[0], run[3]) for run in expected["runs"]} == {(0, 0), (1, 2)}
    # 27 layers x 3 missing blocks x 16 tokens x 576 bf16 elements, on each decode rank.
    assert expected["total_bytes"] == 2 * 27 * 3 * 16 * 576 * 2


def test_null_padded_window_block_is_read_by_vllm_and_moves_nothing() -> None:
    """208 tokens, a 128-token window of 16-token blocks: vLLM keeps 9 window blocks but
    prefill has freed the first of them (its null block stands in), which the case lists as
    our scheduler hands them over. vLLM reads the null block into decode's first window block
    (both layers, both prefill ranks); that block holds tokens 64..79, all before the
    window's first token (81), so the expected plan writes nothing there."""
    name = "16_gpt_oss_sliding_window_null_padded_tp2_tp1"
    case = json.loads((VECTORS / "cases" / f"{name}.json").read_text())
    expected = json.loads((VECTORS / "expected" / f"{name}.json").read_text())
    window_ids = case["request"]["p_block_ids"][0]
    assert _clip_group([0, *window_ids], None, (128, 16)) == tuple(window_ids)
    page = 2 * 16 * 8 * 64 * 2  # the TP1 decode page: 16 tokens of 8 K and 8 V heads of 64
    first = case["request"]["d_block_ids"][0][0]
    assert not [
        r for r in expected["runs"] if r[2] < (first + 1) * page and r[2] + r[6] > first * page
    ]
    assert expected["vllm_bytes_incl_unused"] - expected["total_bytes"] == 2 * page
    # 13 full-attention and 8 window blocks per layer, 2 layers each, from 2 prefill ranks.
    assert expected["vllm_descriptors"] == (13 + 8) * 2 * 2


def test_kimi_linear_gathers_kda_state_and_reads_latents_once() -> None:
    """TP2 -> TP1: every KDA state byte comes from both prefill ranks (each holds half the
    heads), every MLA latent from prefill rank 0 only."""
    name = "17_kimi_linear_kda_mla_tp2_tp1"
    case = json.loads((VECTORS / "cases" / f"{name}.json").read_text())
    expected = json.loads((VECTORS / "expected" / f"{name}.json").read_text())
    page = 128 * 576 * 2  # one 128-token block of bfloat16 latents
    latent_blocks = case["request"]["d_block_ids"][3]
    sources: dict[bool, set[int]] = {True: set(), False: set()}
    for run in expected["runs"]:
        sources[run[2] // page in latent_blocks].add(run[3])
    assert sources == {True: {0}, False: {0, 1}}
    # 2 MLA layers x 3 blocks, and 6 KDA layers x (3 x 256 x 3 conv + 4 x 64 x 64 x 4 SSM)
    # bytes from each of the 2 prefill ranks.
    assert expected["total_bytes"] == 2 * 3 * page + 6 * 2 * (3 * 256 * 3 * 2 + 4 * 64 * 64 * 4)


def test_deepseek_v4_rows_are_read_whole_by_vllm_and_planned_as_their_pages() -> None:
    """TP2 -> TP1: vLLM reads 28 whole rows of 150528 bytes from prefill rank 0 (3 + 3
    sliding-window, 2 compressed, 3 ratio-4 and 17 ratio-128 state blocks; the first ratio-4
    state block from prefill's null block, holding no in-window token); the expected plan
    keeps of them only the pages of each block's group (its layers' content, no alignment
    padding, no row tail) and nothing of the null block's read."""
    name = "20_deepseek_v4_swa_csa_hca_tp2_tp1"
    expected = json.loads((VECTORS / "expected" / f"{name}.json").read_text())
    row = 150528
    assert expected["engines"]["decode"]["0"]["region_page_bytes"] == [row]
    assert expected["vllm_bytes_incl_unused"] == 28 * row
    assert expected["vllm_descriptors"] == 27
    assert {run[3] for run in expected["runs"]} == {0}
    swa = 64 * 512 * 2  # a layer's 64-token page of bfloat16 latents
    # Two ratio-4 latents (64 entries) and their indexer keys (64 x 132 bytes), one ratio-128
    # latent (2 entries); the ratio-4 layers' compressor and indexer states; a ratio-128 state.
    compressed = 2 * 64 * 512 * 2 + 2 * 64 * 132 + 2 * 512 * 2
    states4, state128 = 2 * (4 * 2048 * 4 + 4 * 512 * 4), 8 * 1024 * 4
    assert expected["total_bytes"] == (
        2 * 3 * 2 * swa + 2 * compressed + 2 * states4 + 17 * state128
    )


def test_packed_fp8_ds_mla_latent_pages_move_whole_from_vllms_rows() -> None:
    """TP1 -> TP2 under fp8_ds_mla: each decode rank reads 28 rows of 93888 bytes (every page
    padded to 576 bytes) from prefill rank 0; the expected plan keeps each packed latent page
    whole (584 bytes per entry, the block's scales included) and nothing of the padding."""
    name = "22_deepseek_v4_fp8_ds_mla_tp1_tp2"
    expected = json.loads((VECTORS / "expected" / f"{name}.json").read_text())
    row = 93888
    assert expected["engines"]["decode"]["1"]["region_page_bytes"] == [row]
    assert expected["vllm_bytes_incl_unused"] == 2 * 28 * row
    assert {run[3] for run in expected["runs"]} == {0}
    swa = 64 * 584  # a layer's 64-token packed latent page
    # Two ratio-4 latents (64 entries) and their indexer keys (64 x 132 bytes), one ratio-128
    # latent (2 entries); the ratio-4 layers' compressor and indexer states; a ratio-128 state.
    compressed = 2 * 64 * 584 + 2 * 64 * 132 + 2 * 584
    states4, state128 = 2 * (4 * 2048 * 4 + 4 * 512 * 4), 8 * 1024 * 4
    assert expected["total_bytes"] == 2 * (
        2 * 3 * 2 * swa + 2 * compressed + 2 * states4 + 17 * state128
    )


def test_family_without_a_model_is_refused() -> None:
    case = json.loads((VECTORS / "cases" / "07_qwen35_0p8b_gdn_tp4_tp1.json").read_text())
    with pytest.raises(Exception, match="mamba_type"):
        hf_config(case)
