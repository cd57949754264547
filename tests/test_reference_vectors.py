"""The reference-plan generator (vLLM 0.33's own NIXL connector, its descriptors recorded)
reproduces the shipped vectors: Mamba2 at homogeneous and heterogeneous TP, and MLA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cases import merge_runs
from harness.vllm.reference_vectors import hf_config, reference_plan

VECTORS = Path(__file__).parent / "data" / "testvectors"


@pytest.mark.parametrize(
    "name",
    [
        "01_nemotron_h_8b_mamba2_tp1_tp1",
        "04_nemotron_h_8b_mamba2_tp4_tp2",
        "11_mamba2_gqa2_tp2_tp4_replicated_heads",
        "14_deepseek_v2_lite_mla_tp4_tp2_prefix_hit",
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


def test_family_without_a_model_is_refused() -> None:
    case = json.loads((VECTORS / "cases" / "07_qwen35_0p8b_gdn_tp4_tp1.json").read_text())
    with pytest.raises(Exception, match="mamba_type"):
        hf_config(case)
