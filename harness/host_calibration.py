"""The host's own parallel efficiency: the work rate each of N busy processes gets against one
process alone, over the same wall-clock window. Below 1 where the cores are hyperthreads of
fewer physical ones, the clock falls as more cores are busy, or other tenants share the host.

Each probe is an interpreter of its own (``python -m harness.host_calibration START SECONDS``)
running a pure-Python loop, interpreter-bound like the broker; all start together at START
(``time.time()``) and print their iterations per second.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

#: Wall-clock seconds each probe runs.
PROBE_SECONDS = 1.0
#: Seconds for the probes' interpreters to start before their common window opens, and more
#: per probe.
START_LEAD_S, START_LEAD_PER_PROBE_S = 0.5, 0.05
#: How late (share of the window) a probe may start before its figure is refused.
LATE_SHARE = 0.1
#: Runs of one probe alone whose median is the reference rate.
ALONE_RUNS = 3


def spin(until: float) -> int:
    """Iterations of a pure-Python loop until ``time.time()`` reaches ``until``."""
    iterations, x = 0, 1
    while time.time() < until:
        for _ in range(1000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        iterations += 1000
    return iterations


def probe_rates(processes: int, seconds: float = PROBE_SECONDS) -> list[float]:
    """Iterations/s of each of ``processes`` probes run over one common window."""
    start = time.time() + START_LEAD_S + START_LEAD_PER_PROBE_S * processes
    command = [sys.executable, "-m", "harness.host_calibration", repr(start), repr(seconds)]
    probes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(processes)
    ]
    rates = []
    for probe in probes:
        out, _ = probe.communicate(timeout=60 + seconds)
        if probe.returncode != 0:
            raise RuntimeError(f"host probe exited {probe.returncode}")
        late_s, rate = (float(x) for x in out.split())
        if late_s > LATE_SHARE * seconds:
            raise RuntimeError(f"host probe started {late_s:.3f} s late: the host is too busy")
        rates.append(rate)
    return rates


def alone_rate(seconds: float = PROBE_SECONDS) -> float:
    """Iterations/s of one probe alone: the median of :data:`ALONE_RUNS` runs."""
    return statistics.median(probe_rates(1, seconds)[0] for _ in range(ALONE_RUNS))


def host_efficiency(processes: int, alone_per_s: float, seconds: float = PROBE_SECONDS) -> float:
    """Mean work rate of ``processes`` probes run together over ``alone_per_s``, one probe's."""
    rates = probe_rates(processes, seconds)
    return sum(rates) / len(rates) / alone_per_s


def _probe(start: float, seconds: float) -> None:
    time.sleep(max(0.0, start - time.time()))
    began = time.time()
    iterations = spin(start + seconds)
    print(began - start, iterations / (time.time() - began))


if __name__ == "__main__":
    _probe(float(sys.argv[1]), float(sys.argv[2]))
