"""The planner reproduces reference plans computed with vLLM 0.33's own NIXL connector."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from broker.cli import main
from broker.planner import PairPlanner
from harness.cases import Case, load_case, merge_runs

VECTORS = Path(__file__).parent / "data" / "testvectors"
CASES = sorted((VECTORS / "cases").glob("*.json"))


def test_vectors_are_present() -> None:
    assert len(CASES) >= 8


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_plan_matches_vllm_reference(case: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = json.loads((VECTORS / "expected" / case.name).read_text())
    rc = main(["plan", "--case", str(case), "--json"])
    out = capsys.readouterr()
    if expected["status"] != "ok":
        assert rc != 0 and out.err
        return
    assert rc == 0, out.err
    got = json.loads(out.out)
    assert merge_runs(got["runs"]) == merge_runs(expected["runs"])
    assert got["total_bytes"] == expected["total_bytes"]
    assert got["vllm_descriptors"] == expected["vllm_descriptors"]
    if load_case(json.loads(case.read_text())).model.row_caches:
        # vLLM reads whole block rows; the plan reads each layer's page, one descriptor per
        # maximal run of pages (padding between them), fewer bytes for more descriptors.
        assert got["descriptors"] == len(merge_runs(expected["runs"]))
        assert got["total_bytes"] < expected["vllm_bytes_incl_unused"]
    else:
        assert got["descriptors"] <= expected["vllm_descriptors"]


def test_console_script_plans_a_case() -> None:
    exe = shutil.which("pdbroker") or shutil.which(
        "pdbroker", path=str(Path(sys.executable).parent)
    )
    cmd = [exe] if exe else [sys.executable, "-m", "broker.cli"]
    case = CASES[0]
    out = subprocess.run(
        [*cmd, "plan", "--case", str(case), "--json"], capture_output=True, text=True, check=True
    )
    expected = json.loads((VECTORS / "expected" / case.name).read_text())
    assert json.loads(out.stdout)["total_bytes"] == expected["total_bytes"]


def test_unplannable_case_names_the_field(tmp_path: Path) -> None:
    raw = json.loads(CASES[0].read_text())
    raw["decode"]["tp"] = 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "plan", "--case", str(bad), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0
    assert "total_num_kv_heads" in out.stderr and "tp=3" in out.stderr


def test_bad_sliding_window_names_the_group(tmp_path: Path) -> None:
    raw = json.loads((VECTORS / "cases" / "15_gpt_oss_sliding_window_tp1_tp2.json").read_text())
    raw["groups"][0]["sliding_window"] = -128
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "plan", "--case", str(bad), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0
    assert "groups[0].sliding_window" in out.stderr


def layer_pages(loaded: Case, runs: list[list[int]]) -> int:
    """How many layer pages of block rows ``runs`` cover on decode."""
    pages = 0
    for run in runs:
        rank = loaded.decode.ranks[run[0]]
        block = run[2] // rank.page_bytes
        g = next(g for g, ids in enumerate(loaded.request.decode_block_ids) if block in ids)
        start = run[2] - block * rank.page_bytes
        pages += sum(
            s.offset < start + run[6] and start < s.offset + s.nbytes
            for s in rank.groups[g].segments
        )
    return pages


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_uncoalesced_plan_has_vllm_granularity(case: Path) -> None:
    """Without coalescing the planner issues exactly vLLM's descriptors, same bytes (block
    rows, which vLLM reads whole: one descriptor per layer page vLLM's rows hold)."""
    expected = json.loads((VECTORS / "expected" / case.name).read_text())
    loaded = load_case(json.loads(case.read_text()))
    plan = PairPlanner(loaded.prefill, loaded.decode, coalesce=False).plan(loaded.request)
    if loaded.model.row_caches:
        assert plan.num_descriptors == layer_pages(loaded, expected["runs"])
    else:
        assert plan.num_descriptors == expected["vllm_descriptors"]
    assert merge_runs(plan.rows().tolist()) == merge_runs(expected["runs"])
