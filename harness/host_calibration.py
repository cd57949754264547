"""The host's own parallel efficiency: the work rate each of N busy processes gets against one
process alone, over the same wall-clock window. Below 1 where the cores are hyperthreads of
fewer physical ones, the clock falls as more cores are busy, the busy cores contend for the
caches and memory they share, or other tenants share the host.

Each probe is an interpreter of its own (``python -m harness.host_calibration START SECONDS
WORK``) doing one of two kinds of work: ``spin``, a pure-Python loop on a few integers
(interpreter-bound like the broker, but touching almost no memory), or ``broker``, the
broker's own work in process (:class:`BrokerWork`: transfers published, planned and
reported on an in-memory service, its working set the broker's). All start together at
START (``time.time()``) and print their work rate.
"""

from __future__ import annotations

import subprocess
import sys
import time

#: Wall-clock seconds each probe runs.
PROBE_SECONDS = 2.0
#: The probes' kinds of work (see the module's docstring).
WORKS = ("spin", "broker")
#: Seconds for the probes' interpreters to start (and set their work up) before their common
#: window opens, and more per probe, by kind of work.
START_LEAD_S = {"spin": (0.5, 0.05), "broker": (3.0, 0.25)}
#: How late (share of the window) a probe may start before its figure is refused.
LATE_SHARE = 0.1
#: Runs of one probe alone whose highest rate is the reference: a process alone is only ever
#: slowed (a core woken from idle, another tenant), so the highest is the least disturbed.
ALONE_RUNS = 3
#: Transfers a broker-work probe completes before its window: its planner's caches warm.
WARM_TRANSFERS = 20
#: Transfers a broker-work probe's service holds, finished ones included: more than it
#: completes in a window.
BROKER_WORK_CAPACITY = 1_000_000


def spin(until: float) -> int:
    """Iterations of a pure-Python loop until ``time.time()`` reaches ``until``."""
    iterations, x = 0, 1
    while time.time() < until:
        for _ in range(1000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        iterations += 1000
    return iterations


class BrokerWork:
    """The broker's own work, set up: called with a deadline (``time.time()``), it
    publishes transfers of a Nemotron-3-Nano TP2 -> TP2 request of 32k tokens on an
    in-memory service (no gRPC), plans both decode ranks and reports each plan DONE, until
    the deadline, and returns how many transfers it completed."""

    def __init__(self) -> None:
        from broker.presets import resolve_model
        from harness.bench_engines import published_service
        from harness.scenarios import build_scenario

        self.scenario = build_scenario(resolve_model("nemotron-3-nano-30b-a3b"), 2, 2, 32768)
        self.service = published_service(self.scenario, 0, capacity=BROKER_WORK_CAPACITY)
        self.done = 0
        for _ in range(WARM_TRANSFERS):  # the planner's caches, as a worker's once serving
            self.transfer()

    def transfer(self) -> None:
        """One transfer published, both ranks planned, each plan reported DONE."""
        from broker.api import PlanQuery, Report
        from broker.wire import ReportStatus
        from harness.bench_engines import publish_transfers

        sc, service = self.scenario, self.service
        publish_transfers(service, sc, (self.done,))
        for rank in range(sc.decode.tp_size):
            query = PlanQuery(f"t{self.done}", "D", rank, sc.request.decode_block_ids)
            plan = service.get_plan(query)
            service.report(Report(plan.plan_id, "D", rank, ReportStatus.DONE))
        self.done += 1

    def __call__(self, until: float) -> int:
        first = self.done
        while time.time() < until:
            self.transfer()
        return self.done - first


def probe_rates(processes: int, seconds: float = PROBE_SECONDS, work: str = "spin") -> list[float]:
    """Work/s of each of ``processes`` probes of ``work`` run over one common window."""
    lead, per_probe = START_LEAD_S[work]
    start = time.time() + lead + per_probe * processes
    command = [
        sys.executable, "-m", "harness.host_calibration", repr(start), repr(seconds), work
    ]  # fmt: skip
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


def alone_rate(seconds: float = PROBE_SECONDS, work: str = "spin") -> float:
    """Work/s of one probe of ``work`` alone: the highest of :data:`ALONE_RUNS` runs."""
    return max(probe_rates(1, seconds, work)[0] for _ in range(ALONE_RUNS))


def host_efficiency(
    processes: int, alone_per_s: float, seconds: float = PROBE_SECONDS, work: str = "spin"
) -> float:
    """Mean work rate of ``processes`` probes of ``work`` run together over ``alone_per_s``,
    one probe's."""
    rates = probe_rates(processes, seconds, work)
    return sum(rates) / len(rates) / alone_per_s


def _probe(start: float, seconds: float, work: str) -> None:
    run = spin if work == "spin" else BrokerWork()
    time.sleep(max(0.0, start - time.time()))
    began = time.time()
    done = run(start + seconds)
    print(began - start, done / (time.time() - began))


if __name__ == "__main__":
    _probe(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
