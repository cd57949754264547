"""The host's own parallel efficiency for each kind of probe work: the work rate of each of N
processes run together over one process's alone (``harness.host_calibration``: ``spin``, a
pure-Python loop on a few integers, and ``broker``, the broker's own work in process), for
each N of ``--processes``, ``--rounds`` times in turn. What ``pdbroker bench control-plane
--workers`` measures after each phase, over a range of process counts.

    .venv/bin/python benchmarks/host_efficiency.py --processes 1,8,15 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.host_calibration import PROBE_SECONDS, WORKS, alone_rate, host_efficiency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2", help="process counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--works", default=",".join(WORKS), help="kinds of probe work")
    parser.add_argument("--seconds", type=float, default=PROBE_SECONDS)
    args = parser.parse_args()
    counts = [int(n) for n in args.processes.split(",")]
    print(f"{os.cpu_count()} CPUs; each probe {args.seconds:g} s; efficiency at N processes")
    for work in args.works.split(","):
        alone = alone_rate(args.seconds, work)
        rows = [
            [host_efficiency(n, alone, args.seconds, work) for n in counts]
            for _ in range(args.rounds)
        ]
        for n, effs in zip(counts, zip(*rows)):
            print(
                f"  {work:>6} alone {alone:12,.1f}/s  N={n:<3} "
                + " ".join(f"{e:.3f}" for e in effs)
            )


if __name__ == "__main__":
    main()
