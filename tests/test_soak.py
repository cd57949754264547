"""``pdbroker soak`` as a real command: a short run against a real broker process."""

from __future__ import annotations

import json
import subprocess
import sys


def test_short_soak_releases_every_transfer_exactly_once() -> None:
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
    # A 15 s run is too short to judge growth against the 10% limit; it must stay sane.
    assert -50 < result["rss_growth_pct"] < 50
    assert proc.returncode == (1 if result["rss_growth_pct"] >= 10 else 0), proc.stderr
