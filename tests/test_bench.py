"""Every benchmark command runs and reports consistent figures (timings are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from prerequisites import require_module

from broker.cli import main
from broker.planner import PairPlanner
from broker.presets import resolve_model
from harness.scenarios import build_scenario


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    """The JSON result of ``pdbroker bench ARGV --json``, whose progress went to stderr."""
    assert main(["bench", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(f"pdbroker bench {argv[0]} ["), err
    return json.loads(out)


def test_bench_planner_reports_each_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "planner", "--iterations", "3", "--trials", "1", "--no-vllm")[
        "planner"
    ]
    assert {r["name"] for r in result} >= {
        "nemotron-3-nano 32k tp2->tp2",
        "qwen3.5-27b 32k tp1->tp8",
    }
    for r in result:
        assert r["bytes"] == r["optimal_bytes"] <= r["naive_bytes"]
        assert 0 < r["descriptors"] <= r["vllm_descriptors"]
        assert r["warm_median_us"] > 0


def test_bench_planner_times_vllm_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own connector plans the same request; it posts our uncoalesced descriptors
    plus one read per segment of the Mamba page in the region a group's padding layer
    holds (no state), which the planner's vLLM count leaves out."""
    require_module("vllm", "vllm")
    name = "nemotron-3-nano 32k tp2->tp2"
    out = run_json(capsys, "planner", "--iterations", "20", "--trials", "1", "--scenario", name)
    (result,) = out["planner"]
    assert result["vllm_warm_median_us"] > 0 and out["vllm_scope"]
    sc = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 2, 2, 32768)
    uncoalesced = PairPlanner(sc.prefill, sc.decode, coalesce=False).plan_rank(0, sc.request)
    rank = sc.decode.ranks[0]
    padding_reads = sum(
        (rank.num_regions - len(group.layers)) * len(ids) * len(group.segments)
        for group, ids in zip(rank.groups, sc.request.decode_block_ids)
        if not group.is_attention
    )
    assert padding_reads > 0
    assert result["vllm_descriptors"] == uncoalesced.num_descriptors
    assert result["vllm_measured_descriptors"] == uncoalesced.num_descriptors + padding_reads


def test_bench_control_plane_reports_each_client_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = run_json(
        capsys, "control-plane", "--clients", "1,4", "--seconds", "1", "--pairs", "3"
    )["control_plane"]
    assert [p["clients"] for p in result["phases"]] == [1, 4]
    for phase in result["phases"]:
        assert phase["plan_calls"] > 0 and not phase["ran_out"]
        assert 0 < phase["plan_p50_ms"] <= phase["plan_p99_ms"]
        assert phase["plan_per_s"] > 0 and phase["plan_broker_cpu_us"] > 0
    contact = result["first_contact"]
    assert len(contact["samples_ms"]) == 3 and 0 < contact["median_ms"] <= contact["max_ms"]
    assert result["descriptors_per_plan"] > 0


def test_bench_bytes_plan_never_exceeds_naive(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    result = run_json(capsys, "bytes", "--out", str(tmp_path))["bytes"]
    for series in result:
        for point in series["points"]:
            assert point["plan_bytes"] == point["optimal_bytes"] <= point["naive_bytes"]
    assert (tmp_path / "bytes.png").stat().st_size > 0


def test_bench_descriptors_homogeneous_tp_beats_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(capsys, "descriptors")["descriptors"]
    homogeneous = [
        r for r in rows if r["name"] == "qwen3.5-27b tp4->tp4" and r["allocation"] == "contiguous"
    ]
    assert homogeneous[0]["descriptors"] * 10 <= homogeneous[0]["vllm_descriptors"]


def test_bench_transfer_moves_verified_bytes_and_prints_json_alone() -> None:
    """Run as a process with NIXL and UCX logging at INFO: standard output, file descriptor
    and all, holds the JSON alone; their lines go to standard error."""
    require_module("nixl", "engine")
    env = {**os.environ, "NIXL_LOG_LEVEL": "INFO", "UCX_LOG_LEVEL": "info"}
    env.pop("UCX_LOG_FILE", None)
    argv = ["transfer", "--tokens", "2048", "--repeats", "1", "--kernel-block-size", "16"]
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "bench", *argv, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "NIXL INFO" in done.stderr and "UCX  INFO" in done.stderr
    figures = json.loads(done.stdout)["transfer"]
    assert figures["bytes"] > 0 and figures["ucx_env"] == {"UCX_LOG_LEVEL": "info"}
    assert figures["coalesced_descriptors"] < figures["per_block_descriptors"]
    for key in ("coalesced_gbps", "per_block_gbps", "single_desc_gbps", "memcpy_gbps"):
        assert figures[key] > 0
