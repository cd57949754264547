"""Every benchmark command runs and reports consistent figures (timings are not asserted)."""

from __future__ import annotations

import json

import pytest

from broker.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_planner_reports_each_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "planner", "--iterations", "3")["planner"]
    assert {r["name"] for r in result} >= {"nemotron-3-nano 32k tp2->tp2", "qwen3.5-27b 32k tp1->tp8"}
    for r in result:
        assert r["bytes"] == r["optimal_bytes"] <= r["naive_bytes"]
        assert 0 < r["descriptors"] <= r["vllm_descriptors"]
        assert r["warm_median_us"] > 0


def test_bench_bytes_plan_never_exceeds_naive(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    result = run_json(capsys, "bytes", "--out", str(tmp_path))["bytes"]
    for series in result:
        for point in series["points"]:
            assert point["plan_bytes"] == point["optimal_bytes"] <= point["naive_bytes"]
    assert (tmp_path / "bytes.png").stat().st_size > 0


def test_bench_descriptors_homogeneous_tp_beats_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(capsys, "descriptors")["descriptors"]
    homogeneous = [r for r in rows if r["name"] == "qwen3.5-27b tp4->tp4" and r["allocation"] == "contiguous"]
    assert homogeneous[0]["descriptors"] * 10 <= homogeneous[0]["vllm_descriptors"]


def test_bench_transfer_moves_verified_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("nixl", reason="the transfer bench needs NIXL (extra 'engine')")
    figures = run_json(capsys, "transfer", "--tokens", "2048", "--repeats", "1",
                       "--kernel-block-size", "16")["transfer"]
    assert figures["bytes"] > 0
    assert figures["coalesced_descriptors"] < figures["per_block_descriptors"]
    for key in ("coalesced_gbps", "per_block_gbps", "single_desc_gbps", "memcpy_gbps"):
        assert figures[key] > 0
