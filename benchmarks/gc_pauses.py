"""Summarise the collections ``benchmarks/gc_probe`` recorded: per broker process, the
collections of each generation after its first second (start-up), their total time, the
longest ones and the longest of each generation; and, where the probe counted them
(``PDBROKER_GC_PROBE_TYPES=1``), what the largest such walk after start-up held, by type;
and, where it broke stalls down (``PDBROKER_STALL_PROBE_MS``), the longest ones.

    .venv/bin/python benchmarks/gc_pauses.py /tmp/gc
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: str) -> None:
    for path in sorted(Path(folder).glob("*.json")):
        probed = json.loads(path.read_text())
        records = [r for r in probed["collections"] if r[0] > 1.0]
        per_generation = [sum(1 for r in records if r[1] == g) for g in range(3)]
        pauses = sorted((r[2] for r in records), reverse=True)
        longest = [max((r[2] for r in records if r[1] == g), default=0.0) for g in range(3)]
        print(
            f"{path.stem}: {len(records)} collections (by generation {per_generation}), "
            f"{sum(pauses):.1f} ms in all, longest {[round(p, 1) for p in pauses[:4]]} ms, "
            f"longest by generation {[round(p, 1) for p in longest]} ms"
        )
        walked = [w for w in probed.get("walked", []) if w[0] > 1.0]
        if walked:
            since, generation, count, kinds = max(walked, key=lambda w: w[2])
            print(f"  largest walk: generation {generation} at {since} s, {count} objects: {kinds}")
        stalls = sorted(probed.get("stalls", []), key=lambda s: -s[1])
        for since, ms, ran, waited, others, collecting in stalls[:5]:
            print(
                f"  stall {ms} ms at {since} s; over the probe's interval the loop ran {ran} ms, "
                f"waited {waited} ms for a CPU; other threads ran {others} ms; "
                f"collecting {collecting} ms"
            )


if __name__ == "__main__":
    main(sys.argv[1])
