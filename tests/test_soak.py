"""``pdbroker soak`` as a real command: a short run against a real broker process. The memory
verdict on long runs: ``test_soak_memory.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from broker.cli import main


def test_short_soak_releases_every_transfer_exactly_once_and_leaves_memory_unjudged() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "soak",
            "--seconds",
            "15",
            "--prefill-ranks",
            "2",
            "--decode-ranks",
            "2",
            "--json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(proc.stdout)
    assert result["transfers"] > 0
    assert result["leaked"] == 0, result["leaked_sample"]
    assert result["double_released"] == 0
    assert result["errors"] == 0, result["error_samples"]
    assert set(result["paths"]) == {
        "completed",
        "consumer_failed",
        "duplicate_report",
        "aborted",
        "expired",
    }
    assert result["plans"] > 0 and result["p99_ms"] > 0
    # Still warming up after 15 s: memory is not judged, which fails nothing.
    assert result["rss_growth_pct"] is None and not result["rss_grew"]
    assert result["memory"].startswith("not judged, run shorter than 90 s")
    assert proc.returncode == 0, proc.stderr
    progress = proc.stderr.splitlines()
    assert progress[0].startswith("pdbroker soak [0 s] 15 s of load (--seconds; default 600)")
    # Not a terminal: a line every 5 s of the load.
    assert len([line for line in progress if "/15 s, broker RSS " in line]) >= 2, progress
    assert all(line.startswith("pdbroker soak [") for line in progress), progress


def test_soak_help_states_the_default_duration(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["soak", "--help"])
    assert "seconds of load, before the drain (default: 600)" in capsys.readouterr().out
